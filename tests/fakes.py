"""Fakes shared by the tests: a worker's executor without a model or torch; a Hugging Face Hub.

FakeExecutor keeps the sequences it holds with common/plan_state.py, as worker/executor.py does
(so a plan the worker would refuse raises ProtocolError here too), and samples a deterministic
token, so the scheduler runs its whole loop with no model. Unless told that requests fork
(`forks=True`), it also checks that no block is in two tables. With a `sliding_window` it accepts
the null block where the window skips, as a worker of such a model does.
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

from common.plan_state import HeldSequence, PlanState, ScheduledSequence
from common.protocol import SampledToken, StepPlan, StepResult

# token_fn(seq_id, token ids so far, number of prompt tokens) -> the next token
TokenFn = Callable[[int, list[int], int], int]


def token_for(seq_id: int, num_tokens: int) -> int:
    """The fake model's next token after `num_tokens` tokens; never EOS (2)."""
    return (seq_id * 7 + num_tokens) % 1000 + 3


def expected_output(seq_id: int, num_prompt_tokens: int, max_tokens: int) -> list[int]:
    return [token_for(seq_id, num_prompt_tokens + i) for i in range(max_tokens)]


class FakeExecutor:
    """Applies each plan's diffs and samples `token_fn`'s token for every sequence that computed
    its last token, `num_samples` times (logprob -0.25); keeps every plan in `plans`."""

    def __init__(self, block_size: int, token_fn: TokenFn | None = None, forks: bool = False,
                 sliding_window: int | None = None) -> None:
        self.state = PlanState(block_size, sliding_window=sliding_window)
        self.forks = forks
        self.plans: list[StepPlan] = []
        self.token_fn = token_fn or (lambda seq_id, tokens, num_prompt: token_for(seq_id, len(tokens)))

    def forward(self, plan: StepPlan, scheduled: list[ScheduledSequence]) -> None:
        """The model's forward pass: nothing here (KVCheckingExecutor checks what it would read)."""

    @property
    def seqs(self) -> dict[int, HeldSequence]:
        return self.state.seqs

    def reset(self) -> None:
        self.state.reset()

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        scheduled = self.state.apply(plan)
        if not self.forks:
            self.state.check_unshared()
        self.forward(plan, scheduled)
        result = StepResult(plan.step, plan.epoch)
        for s in scheduled:
            for _ in range(s.num_samples):
                token = self.token_fn(s.seq_id, s.held.token_ids, s.held.num_prompt_tokens)
                result.sampled.append(SampledToken(s.seq_id, token, -0.25, [[token, -0.25]]))
        self.state.record_sampled(result.sampled)
        return result


class KVCheckingExecutor(FakeExecutor):
    """A FakeExecutor that also keeps what each KV slot of both pools holds (the token ids up to and
    including its position), runs the plan's swaps and copies on them (out, in, copy-on-write, as a
    worker does, before the forward pass), writes the slots each step computes and checks every key
    each query reads, (p - sliding_window, p] or [0, p]: a block handed out while a query still reads
    it, a prefix-cache hit on a stale block, a swap or copy missed or a null entry read shows here."""

    def __init__(self, block_size: int, token_fn: TokenFn | None = None, forks: bool = False,
                 sliding_window: int | None = None) -> None:
        super().__init__(block_size, token_fn, forks, sliding_window)
        self.window = sliding_window
        self.kv: dict[int, list] = {}  # device block -> per slot, the token ids up to it
        self.cpu_kv: dict[int, list] = {}

    def forward(self, plan: StepPlan, scheduled: list[ScheduledSequence]) -> None:
        bs = self.state.block_size
        empty = [None] * bs
        for src, dst, pools in [(s, d, (self.kv, self.cpu_kv)) for s, d in plan.blocks_to_swap_out] + [
            (s, d, (self.cpu_kv, self.kv)) for s, d in plan.blocks_to_swap_in] + [
            (s, d, (self.kv, self.kv)) for s, d in plan.blocks_to_copy]:
            pools[1][dst] = list(pools[0].get(src, empty))
        for s in scheduled:  # every new key is written first (reshape_and_cache), then read (attention)
            tokens, table = s.held.token_ids, s.held.block_table
            for pos in range(s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens):
                block = table[pos // bs]
                assert block != 0, f"step {plan.step}: sequence {s.seq_id} writes position {pos} into the null block"
                self.kv.setdefault(block, list(empty))[pos % bs] = tuple(tokens[:pos + 1])
        for s in scheduled:
            tokens, table = s.held.token_ids, s.held.block_table
            for pos in range(s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens):
                for key in range(max(pos - self.window + 1, 0) if self.window else 0, pos + 1):
                    block = table[key // bs]
                    held = self.kv.get(block, empty)[key % bs] if block else "the null block"
                    assert held == tuple(tokens[:key + 1]), (
                        f"step {plan.step}: sequence {s.seq_id}'s query at {pos} reads key {key} in block {block}, "
                        f"which holds {held}")


@dataclass
class HubRepo:
    """A model repository of the FakeHub: its files at one commit, reached as `main` or by the commit."""

    files: dict[str, bytes]
    commit: str = "c0ffee" * 6 + "0123"
    gated: bool = False  # files answer 401 GatedRepo, as the Hub answers an anonymous client

    def resolve(self, revision: str) -> bool:
        return revision in ("main", self.commit)


@dataclass
class FakeHub:
    """The endpoints of the Hugging Face Hub that huggingface_hub's snapshot_download calls (model
    info, the tree listing, HEAD and GET of a file), answering as the Hub does: the status codes
    and the X-Error-Code headers its client reads (utils/_http.py: RepoNotFound, RevisionNotFound,
    GatedRepo, EntryNotFound), X-Repo-Commit and ETag on a file. Point HF_ENDPOINT at `url`.
    `downloaded` lists each file whose body was sent."""

    repos: dict[str, HubRepo]
    downloaded: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def do_GET(self) -> None:
                hub._answer(self, body=True)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        parts = [unquote(p) for p in urlsplit(handler.path).path.strip("/").split("/")]
        api = parts[:2] == ["api", "models"]
        repo_id = "/".join(parts[2:4] if api else parts[:2])
        repo = self.repos.get(repo_id)
        if repo is None:  # anonymous: 401, for a private repository looks the same
            return _send(handler, 401, {"error": "Repository not found"}, RepoNotFound="Repository not found")
        rest = parts[4:] if api else parts[2:]
        if api and not rest:  # model info of main
            rest = ["revision", "main"]
        kind, revision, path = rest[0], rest[1] if len(rest) > 1 else "main", "/".join(rest[2:])
        if not repo.resolve(revision):
            return _send(handler, 404, {"error": f"Invalid rev id: {revision}"},
                         RevisionNotFound=f"Invalid rev id: {revision}")
        if api and kind == "revision":
            return _send(handler, 200, {"id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": False,
                                        "gated": "manual" if repo.gated else False,
                                        "siblings": [{"rfilename": name} for name in sorted(repo.files)]})
        if api and kind == "tree":
            return _send(handler, 200, [{"type": "file", "path": name, "size": len(data), "oid": _sha1(data)}
                                        for name, data in sorted(repo.files.items())])
        if kind != "resolve":
            return _send(handler, 404, {"error": "not found"})
        if repo.gated:
            message = (f"Access to model {repo_id} is restricted. You must have access to it and be authenticated "
                       "to access it. Please log in.")
            return _send(handler, 401, {"error": message}, GatedRepo=message)
        if path not in repo.files:
            return _send(handler, 404, {"error": "Entry not found"}, EntryNotFound="Entry not found")
        data = repo.files[path]
        handler.send_response(200)
        for name, value in (("X-Repo-Commit", repo.commit), ("ETag", f'"{_sha1(data)}"'),
                            ("Content-Length", str(len(data))), ("Content-Type", "application/octet-stream")):
            handler.send_header(name, value)
        handler.end_headers()
        if body:
            self.downloaded.append(path)
            handler.wfile.write(data)


def _send(handler: BaseHTTPRequestHandler, status: int, payload, **error_code: str) -> None:
    data = json.dumps(payload).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    for code, message in error_code.items():
        handler.send_header("X-Error-Code", code)
        handler.send_header("X-Error-Message", message)
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(data)


def _sha1(data: bytes) -> str:
    """A file's git blob id, as the Hub gives it (its ETag for a file not in LFS)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
