import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# torch on one intra-op thread in this process and in every process it starts: the suite runs a test
# process, stacks and their references side by side on 2 cores, where two threads a process wait on
# each other (a default-model worker's load: 35 CPU-s with two threads under load, 9 with one).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# --quantization's default for every config the tests build (in process and in the processes they
# start): full precision, the transformers parity guard. Quantized runs say so explicitly.
os.environ["PAGODA_QUANTIZATION"] = "none"
os.environ["PAGODA_COMPILE"] = "0"  # the decode step eager unless a test asks (--compile): compiling takes minutes


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


@pytest.fixture(autouse=True, scope="module")
def _one_rank_group_after_the_module():
    """The next module starts on this process's tensor-parallel group of one, whatever group an
    in-process rank 0 of this one's (an LLM with tensor_parallel_size 2) left set."""
    yield
    parallel = sys.modules.get("worker.parallel")
    if parallel is not None:
        parallel.set_tp_group(parallel.TensorParallelGroup())


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


@pytest.fixture(scope="session")
def default_llm():
    """The offline engine of the default model on CPU in float32, loaded once for the session (a load
    costs 15-20 s of CPU: weights, the prefill probe, the swap bandwidth probe). Each module takes
    it through `llm.reset(...)`: a fresh scheduler over the loaded worker, no request or cached
    prefix left from another module. Held to the session's end (an idle object: no CPU)."""
    from pagoda.offline import LLM

    llm = LLM("default", device="cpu", dtype="float32")
    yield llm
    llm.close()


# The modules that share one `pagoda up` of the default model (the `default_stack` fixture), in the
# order they run, one after the other from where the first of them would run.
DEFAULT_STACK_FLAGS = ("--num-gpu-blocks", "2048", "--num-cpu-blocks", "256")
DEFAULT_STACK_MODULES = ("test_dashboard.py", "test_e2e.py", "test_openai_api.py", "test_bench_peer.py")


class _SharedStack:
    """The shared stack, started on first use and stopped (exit code 0 asserted) after the last item
    of DEFAULT_STACK_MODULES, not at the session's end: no idle stack beside the other modules."""

    stack = None

    def get(self):
        if self.stack is None:
            from tests.stack import Stack

            self.stack = Stack(*DEFAULT_STACK_FLAGS).wait_ready()
        return self.stack

    def stop(self) -> None:
        stack, self.stack = self.stack, None
        if stack is not None:
            assert stack.stop() == 0


_shared_stack = _SharedStack()


@pytest.fixture(scope="session")
def default_stack():
    """One `pagoda up` of the default model on CPU (DEFAULT_STACK_FLAGS) for every module of
    DEFAULT_STACK_MODULES: a stack start (a model load, its warmup) once instead of once a module.
    Each test that uses it leaves no request running and the stack serving."""
    yield _shared_stack.get()
    _shared_stack.stop()  # a session that ended within those modules (-x, a selection)


@pytest.hookimpl(trylast=True)  # after the module's own fixtures were torn down
def pytest_runtest_teardown(item, nextitem):
    if item.path.name in DEFAULT_STACK_MODULES and (nextitem is None or nextitem.path.name not in DEFAULT_STACK_MODULES):
        _shared_stack.stop()


def _keep_default_stack_users_together(items) -> None:
    """The items of DEFAULT_STACK_MODULES moved, in that order, to where the first of them was."""
    rank = {name: i for i, name in enumerate(DEFAULT_STACK_MODULES)}
    users = [item for item in items if item.path.name in rank]
    if not users:
        return
    first = next(i for i, item in enumerate(items) if item.path.name in rank)
    others = [item for item in items if item.path.name not in rank]
    users.sort(key=lambda item: rank[item.path.name])  # stable: each module's own order kept
    items[:] = others[:first] + users + others[first:]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`make test` runs the modules on TEST_WORKERS processes (pytest-xdist), each module whole on one
    of them (its module-scoped stack starts once) and DEFAULT_STACK_MODULES together (one shared
    stack), in collection order. (`--dist loadgroup` with xdist_group marks did not group them here,
    with pytest 9.2 and pytest-xdist 3.8.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "default stack" if Path(module).name in DEFAULT_STACK_MODULES else module

    config.option.loadscopereorder = False  # collection order, not the most tests first
    return ByModule(config, log)


# Under xdist the longest modules go first, so that the last ones handed out are short and both
# processes end together (test time a module, 2026-11-30, two processes: parity 248 s, triton
# kernels 184, load 175, models 162, the shared stack's three 138, data parallel 95, faults 89,
# speculative 81, then 72 and below, down to 25 s for the last named here).
LONGEST_FIRST = ("test_parity.py", "test_kernels_triton.py", "test_load.py", "test_models.py", "test_dashboard.py",
                 "test_e2e.py", "test_openai_api.py", "test_data_parallel.py", "test_faults.py", "test_speculative.py",
                 "test_sharing.py", "test_vision.py", "test_compiled_step.py", "test_pooling.py", "test_batch_invariance.py",
                 "test_lora.py", "test_bench_step.py", "test_rank_loss.py", "test_scheduler_server.py", "test_bench_serving.py",
                 "test_qwen3_next.py", "test_gateway.py", "test_speculative_draft.py", "test_bad_input.py",
                 "test_async_scheduling.py", "test_kernels_moe.py")


def _longest_first(items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _longest_first(items)
    _keep_default_stack_users_together(items)
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items or _has_cuda():  # import torch only when a GPU test was collected
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none here)")
    for item in gpu_items:
        item.add_marker(skip)
