import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# --quantization's default for every config the tests build (in process and in the processes they
# start): full precision, the transformers parity guard. Quantized runs say so explicitly.
os.environ["PAGODA_QUANTIZATION"] = "none"


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of tiny tensors: intra-op threads only add overhead (100x on a loaded host)."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


TINY_LLAMA = ROOT / "tests" / "data" / "tiny-llama.json"


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """(directory, transformers model) of a tiny random Llama (seed 0) saved by transformers."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(AutoConfig.from_pretrained(TINY_LLAMA)).eval()
    directory = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(directory)
    return directory, model


@pytest.fixture(scope="module")
def redis_server():
    """A private redis-server for a module's stack (`pagoda up --redis-url`), inspectable by its tests."""
    from common.redis_server import RedisServer

    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture
def r(redis_url):
    """A client of the module's redis-server, emptied for each test."""
    import redis

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.close()


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", help="where the model tests (tests/test_parity.py) run: cpu or cuda")


@pytest.fixture(scope="session")
def device(request) -> str:
    """The --device option; a CUDA device without one is a visible skip."""
    name = request.config.getoption("--device")
    if name.startswith("cuda") and not _has_cuda():
        pytest.skip(f"--device {name}: needs a CUDA GPU (none here)")
    return name


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items or _has_cuda():  # import torch only when a GPU test was collected
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none here)")
    for item in gpu_items:
        item.add_marker(skip)
