"""Hub ids (--model ORG/NAME) and what a checkpoint's generation_config.json says.

A Hugging Face cache laid out as huggingface_hub lays it out holds a tiny random Llama with the
512-word tokenizer of tests/data/tiny-tokenizer (id i is the word w<i>): `main` is one snapshot,
`v2` another, whose weights are tests/conftest.py's `tiny` model and whose generation_config.json
sets sampling defaults and one more EOS id. The same files in a plain directory are the model
"loaded from its directory". The failures run the real huggingface_hub client against a fake Hub
(tests/fakes.py).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from common.cli_args import config_from_args
from common.config import EngineConfig, GatewayConfig, ServingConfig
from common.generation_config import default_sampling_params
from common.models import ModelNotFound, pin_revision, resolve_model
from common.protocol import SamplingParams
from pagoda import cli, up
from tests.conftest import ROOT
from tests.fakes import FakeHub, HubRepo

REPO_ID = "pagoda-test/tiny-llama"
MAIN, V2 = "1" * 40, "2" * 40  # the commits of the two snapshots
TOKENIZER = ROOT / "tests" / "data" / "tiny-tokenizer"
PROMPT, PROMPT_IDS = "w5 w6 w7", [5, 6, 7]
SAMPLING = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05}  # v2's generation_config.json
SERVING = ["chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
           "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"]


def model_files(directory: Path, generation_config: dict | None = None) -> dict[str, bytes]:
    """A saved transformers model's files, the tiny tokenizer's, and a generation_config.json."""
    files = {p.name: p.read_bytes() for p in directory.iterdir()}
    files |= {p.name: p.read_bytes() for p in TOKENIZER.iterdir() if p.name != "README.md"}
    if generation_config is not None:
        files["generation_config.json"] = json.dumps(generation_config).encode()
    return files


def add_snapshot(cache: Path, repo_id: str, commit: str, files: dict[str, bytes], ref: str) -> Path:
    """models--ORG--NAME/{blobs/<sha256>, snapshots/<commit>/<file> -> ../../blobs/<sha256>, refs/<ref>}."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return repo / "snapshots" / commit


def cli_parser(command: str):
    import argparse

    parser = argparse.ArgumentParser(prog=f"pagoda {command}")
    getattr(cli, f"_add_{command}")(parser)
    return parser


def greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    import torch

    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                             eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def reference(tiny):
    """The tiny model's greedy tokens after PROMPT, and the one v2's generation_config.json adds as
    an EOS id: its third."""
    tokens = greedy(tiny[1], PROMPT_IDS, 4)
    assert 2 not in tokens[:3] and tokens[2] not in tokens[:2]
    return tokens, tokens[2]


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """(directory, model) of another tiny random Llama (seed 1): `main`'s."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    torch.manual_seed(1)
    model = LlamaForCausalLM(AutoConfig.from_pretrained(ROOT / "tests" / "data" / "tiny-llama.json")).eval()
    directory = tmp_path_factory.mktemp("other")
    model.save_pretrained(directory)
    return directory, model


@pytest.fixture(scope="module")
def home(tiny, other, reference, tmp_path_factory):
    """HF_HOME: its hub/ cache holds REPO_ID at `main` (the `other` model, transformers' own
    generation_config.json) and at `v2` (the `tiny` model, SAMPLING and EOS ids [2, reference])."""
    root = tmp_path_factory.mktemp("hf-home")
    add_snapshot(root / "hub", REPO_ID, MAIN, model_files(other[0]), "main")
    generation_config = {"bos_token_id": 1, "eos_token_id": [2, reference[1]], **SAMPLING}
    add_snapshot(root / "hub", REPO_ID, V2, model_files(tiny[0], generation_config), "v2")
    return root


@pytest.fixture(scope="module")
def cache(home) -> str:
    return str(home / "hub")


@pytest.fixture(scope="module")
def local(home, tmp_path_factory) -> Path:
    """v2's files in a plain directory: the same model, loaded from its directory."""
    directory = tmp_path_factory.mktemp("local") / "tiny-llama"
    shutil.copytree(home / "hub" / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / V2, directory)
    return directory


@pytest.fixture(scope="module")
def local_llm(local):
    from pagoda.offline import LLM

    llm = LLM(str(local), device="cpu")
    yield llm
    llm.close()


@pytest.fixture
def offline(monkeypatch):
    """HF_HUB_OFFLINE=1 for this process's huggingface_hub (it reads the variable when imported)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


# ----------------------------------------------------------------------------- the cache

def test_pagoda_generate_serves_a_hub_id_from_the_cache_offline_as_from_its_directory(home, local_llm, other,
                                                                                      reference):
    """One real `pagoda generate`: HF_HOME's cache, HF_HUB_OFFLINE=1, --revision v2. Its tokens are
    those of the same files loaded from a directory, and they end at the EOS id that only v2's
    generation_config.json names."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")} | {"HF_HOME": str(home),
                                                                              "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pagoda.cli", "generate", "--model", REPO_ID, "--revision", "v2", "--device", "cpu",
         "--prompt", PROMPT, "--max-tokens", "4", "--temperature", "0", "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    served = json.loads(proc.stdout.splitlines()[0])
    params = dataclasses.replace(local_llm.get_default_sampling_params(), temperature=0.0, max_tokens=4)
    expected = local_llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert (served["token_ids"], served["finish_reason"]) == (expected.token_ids, expected.finish_reason)
    assert (expected.token_ids, expected.finish_reason) == (reference[0][:3], "stop")
    assert served["token_ids"] != greedy(other[1], PROMPT_IDS, 3)  # not main's model
    assert "Fetching" not in proc.stderr  # nothing downloaded


def test_a_hub_id_resolves_to_its_cached_snapshot_named_by_the_id(cache, offline):
    snapshots = Path(cache) / "models--pagoda-test--tiny-llama" / "snapshots"
    source = resolve_model(REPO_ID, download_dir=cache)
    assert (source.kind, source.path, source.name, source.revision) == ("hf", snapshots / MAIN, REPO_ID, MAIN)
    for revision in ("v2", V2):  # a branch, or the commit itself
        assert resolve_model(REPO_ID, revision, cache).path == snapshots / V2
    assert pin_revision(EngineConfig(model=REPO_ID, download_dir=cache)).revision == MAIN
    assert pin_revision(EngineConfig(model="dummy:smollm2-135m.json")) == EngineConfig(model="dummy:smollm2-135m.json")


def test_a_local_directory_of_the_ids_name_wins_over_the_hub(local, tmp_path, monkeypatch, offline):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(local, tmp_path / REPO_ID)
    source = resolve_model(REPO_ID, download_dir=str(tmp_path / "empty-cache"))
    assert (source.kind, source.path, source.name, source.revision) == ("hf", Path(REPO_ID), "tiny-llama", None)


def test_up_resolves_the_id_once_and_gives_every_child_its_commit(cache, tmp_path, offline):
    args = cli_parser("up").parse_args(["--model", REPO_ID, "--download-dir", cache, "--device", "cpu",
                                        "--tensor-parallel-size", "2"])
    engine, gateway = up.pin_model(*(config_from_args(cls, args) for cls in (EngineConfig, GatewayConfig)))
    children = up._children(engine, ServingConfig(), gateway, "redis://127.0.0.1:7000/0", tmp_path)
    assert [c.name for c in children] == ["scheduler-0", "worker-0.0", "worker-0.1", "gateway"]
    for child in children:
        assert f"--revision={MAIN}" in child.command and f"--download-dir={cache}" in child.command
        assert f"--model={REPO_ID}" in child.command


def test_the_gateway_serves_the_id_with_the_snapshots_chat_template_and_generation_config(cache, reference, offline):
    from gateway.app import Gateway

    gateway = Gateway(GatewayConfig(model=REPO_ID, revision="v2", download_dir=cache))
    assert gateway.served_model_name == REPO_ID
    assert gateway.encoder.template_text == (TOKENIZER / "chat_template.jinja").read_text()
    assert gateway.tokenizer.chat_template == (TOKENIZER / "chat_template.jinja").read_text()  # not in its config
    assert gateway.default_sampling_params == SAMPLING
    assert gateway.eos_token_ids == {2, reference[1]}


# ----------------------------------------------------------------------------- generation_config.json

@pytest.fixture(scope="module")
def chatty(local, tmp_path_factory) -> Path:
    """A directory whose generation_config.json sets all five sampling defaults (no weights: the
    gateway reads only the config, the tokenizer and that file)."""
    directory = tmp_path_factory.mktemp("chatty")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(local / name, directory / name)
    (directory / "generation_config.json").write_text(json.dumps(
        {**SAMPLING, "repetition_penalty": 1.1, "max_new_tokens": 9, "do_sample": True}))
    return directory


def chatty_gateway(chatty: Path, **config):
    from common.tokenizer import load_tokenizer
    from gateway.app import Gateway

    return Gateway(GatewayConfig(model=str(chatty), **config), load_tokenizer(str(chatty)))


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_request_without_sampling_fields_gets_the_models_and_its_own_win(chatty, kind):
    gateway = chatty_gateway(chatty)
    body = {"prompt": PROMPT} if kind == "completion" else {"messages": [{"role": "user", "content": PROMPT}]}
    params = gateway._parse(kind, body).params
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == (
        0.6, 0.9, 20, 0.05, 1.1)
    params = gateway._parse(kind, body | {"temperature": 0, "top_k": 0, "repetition_penalty": 1.0}).params
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == (
        0.0, 0.9, 0, 0.05, 1.0)


def test_generation_config_vllm_ignores_the_file_and_beam_search_takes_none_of_it(chatty):
    body = {"prompt": PROMPT}
    params = chatty_gateway(chatty, generation_config="vllm")._parse("completion", body).params
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == (
        1.0, 1.0, 0, 0.0, 1.0)
    params = chatty_gateway(chatty)._parse("completion", body | {"use_beam_search": True, "n": 2}).params
    assert (params.beam_width, params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (
        2, 0.0, 1.0, 0, 1.0)


def test_default_sampling_params_are_the_files_five_fields_or_none():
    assert default_sampling_params({"temperature": 0.7, "top_k": 5, "eos_token_id": 3, "do_sample": True}, "auto") == {
        "temperature": 0.7, "top_k": 5}
    assert default_sampling_params({"temperature": 0.7}, "vllm") == {}


def test_offline_generate_without_sampling_params_uses_the_models_and_given_ones_as_they_are(local_llm):
    """vLLM's LLM: generate(prompts) samples with get_default_sampling_params(); SamplingParams
    given are used as they are (even where they hold SamplingParams' defaults)."""
    assert local_llm.get_default_sampling_params() == SamplingParams(**SAMPLING)
    seen = []
    add_request = local_llm.engine.add_request
    local_llm.engine.add_request = lambda request_id, ids, params, *rest: (seen.append(params),
                                                                           add_request(request_id, ids, params, *rest))
    try:
        local_llm.generate(PROMPT, use_tqdm=False)
        local_llm.generate(PROMPT, SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        local_llm.engine.add_request = add_request
    assert seen == [SamplingParams(**SAMPLING), SamplingParams(max_tokens=2)]


def test_an_eos_id_of_generation_config_ends_generation(local_llm, reference):
    tokens, eos = reference
    assert local_llm.executor.eos_token_ids == [2, eos]  # config.json's, then generation_config.json's
    out = local_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert (out.token_ids, out.finish_reason) == (tokens[:3], "stop")
    out = local_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert (out.token_ids, out.finish_reason) == (tokens, "length")


# ----------------------------------------------------------------------------- downloads and failures

@pytest.fixture
def hub(local, monkeypatch, tmp_path):
    """A fake Hub at HF_ENDPOINT (as this process's huggingface_hub reads it), online, no token.
    Its repositories: org/tiny (the serving files, an index, and what serving does not need),
    org/gated, org/bin (pytorch_model.bin only)."""
    import huggingface_hub.constants as constants

    from safetensors import safe_open

    files = {p.name: p.read_bytes() for p in local.iterdir()}
    with safe_open(str(local / "model.safetensors"), framework="pt") as f:
        index = {"metadata": {}, "weight_map": {name: "model.safetensors" for name in f.keys()}}
    files |= {"model.safetensors.index.json": json.dumps(index).encode(), "README.md": b"# tiny",
              "consolidated.safetensors": b"another format's copy", "original/model.safetensors": b"and another",
              "pytorch_model.bin": b"pickled", ".gitattributes": b"*.safetensors filter=lfs"}
    fake = FakeHub({"org/tiny": HubRepo(files), "org/gated": HubRepo(files, gated=True),
                    "org/bin": HubRepo({"config.json": files["config.json"], "pytorch_model.bin": b"pickled"})})
    for name, value in (("ENDPOINT", fake.url), ("HF_HUB_OFFLINE", False),
                        ("HUGGINGFACE_CO_URL_TEMPLATE", fake.url + "/{repo_id}/resolve/{revision}/{filename}"),
                        ("HF_TOKEN_PATH", str(tmp_path / "no-token"))):
        monkeypatch.setattr(constants, name, value)
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield fake
    fake.close()


def test_a_download_fetches_only_what_serving_reads_and_later_starts_need_no_network(hub, tmp_path):
    """The index's shards, not the other formats' copies beside them; then, the Hub gone, the cache."""
    source = resolve_model("org/tiny", download_dir=str(tmp_path))
    assert sorted(hub.downloaded) == SERVING
    assert sorted(p.name for p in source.path.iterdir()) == SERVING
    assert (source.name, source.revision, source.path.name) == ("org/tiny", HubRepo({}).commit, HubRepo({}).commit)
    hub.close()
    assert resolve_model("org/tiny", download_dir=str(tmp_path)) == source


def test_processes_resolving_one_id_at_once_share_the_download(hub, tmp_path):
    """The ranks of a group and the gateway, started apart: huggingface_hub's file locks."""
    found, errors = [], []

    def resolve() -> None:
        try:
            found.append(resolve_model("org/tiny", download_dir=str(tmp_path)))
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=resolve) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == [] and len(found) == 3 and len(set(found)) == 1
    assert sorted(p.name for p in found[0].path.iterdir()) == SERVING


GATED = ("model 'org/gated' is gated on the Hugging Face Hub: accept its terms at {url}/org/gated, then set HF_TOKEN "
         "to a token of that account")
FAILURES = {
    "unknown repository": (["--model", "org/missing"],
                           "model 'org/missing' is not a local directory or file, and the Hugging Face Hub has no "
                           "repository of that name: check the spelling (ORG/NAME); if it is private, set HF_TOKEN to "
                           "a token that can read it"),
    "gated, no token": (["--model", "org/gated"], GATED),
    "gated, a token without access": (["--model", "org/gated"],
                                      "model 'org/gated' is gated on the Hugging Face Hub and the token in use "
                                      "(HF_TOKEN) has no access to it: accept its terms at {url}/org/gated with the "
                                      "token's account"),
    "no safetensors": (["--model", "org/bin"],
                       "model 'org/bin' has no .safetensors weights on the Hugging Face Hub (Pagoda loads "
                       "safetensors checkpoints only): choose a repository that has them"),
    "unknown revision": (["--model", "org/tiny", "--revision", "v9"],
                         "model 'org/tiny' has no revision 'v9' on the Hugging Face Hub: give a branch, tag or commit "
                         "of it to --revision"),
    "Hub unreachable, not cached": (["--model", "org/tiny"],
                                    "model 'org/tiny' is not (fully) in the Hugging Face cache at {cache}, and the "
                                    "Hugging Face Hub ({url}) cannot be reached (ConnectError: [Errno 111] Connection "
                                    "refused): check the network (or HF_ENDPOINT), or fill the cache where the Hub can "
                                    "be reached and set HF_HUB_OFFLINE=1"),
    "offline, not cached": (["--model", "org/tiny", "--revision", "v2"],
                            "model 'org/tiny' at revision 'v2' is not (fully) in the Hugging Face cache at {cache}, "
                            "and HF_HUB_OFFLINE=1 forbids downloading it: fill the cache where the Hub can be reached "
                            "(`hf download org/tiny`) and point HF_HUB_CACHE or --download-dir at it, or unset "
                            "HF_HUB_OFFLINE"),
}


@pytest.mark.parametrize("case", FAILURES)
def test_each_failure_is_one_error_that_names_the_id_and_what_to_do(case, hub, tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants as constants

    flags, message = FAILURES[case]
    if case == "gated, a token without access":
        monkeypatch.setenv("HF_TOKEN", "hf_no_access")
    if case == "Hub unreachable, not cached":
        hub.close()
    if case == "offline, not cached":
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    argv = ["generate", *flags, "--download-dir", str(tmp_path), "--prompt", PROMPT]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "pagoda: error: " + message.format(url=hub.url, cache=tmp_path)
    with pytest.raises(ModelNotFound):
        resolve_model(flags[1], flags[3] if len(flags) > 2 else None, str(tmp_path))
