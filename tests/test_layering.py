"""The control plane never imports torch or a networking package at module level (docs/architecture.md)."""
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NETWORKING = {"zmq", "redis", "starlette", "uvicorn"}


def imported_after(statement: str, packages: set[str]) -> list[str]:
    """The modules of `packages` a fresh interpreter holds after running `statement`."""
    code = f"{statement}; import sys; print(sorted(m for m in sys.modules if m.split('.')[0] in {packages!r}))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return eval(proc.stdout.strip().splitlines()[-1])


def test_scheduler_and_common_import_no_torch_and_no_networking():
    statement = ("import scheduler, scheduler.engine, common.protocol, common.config, common.models, "
                 "common.generation_config")
    assert imported_after(statement, NETWORKING | {"torch", "transformers", "huggingface_hub"}) == []


def test_offline_path_imports_no_networking_package():
    """pagoda generate, the LLM API, the worker's executor, the kernels and their benchmarks (bench
    throughput, bench kernels) run on a host without redis, pyzmq, starlette or uvicorn."""
    statement = ("import pagoda.offline, pagoda.cli, worker.executor, worker.model_runner, kernels, scheduler.engine, "
                 "pagoda.bench.throughput, pagoda.bench.kernels, pagoda.bench.latency")
    assert imported_after(statement, NETWORKING) == []


def named_imports(paths, packages: set[str]) -> list[str]:
    """"path: module" for every import of `packages` in `paths`, inside functions too."""
    offenders = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in packages]
    return offenders


def test_no_module_of_scheduler_or_common_names_a_forbidden_package():
    """Catches an import inside a function too, which the subprocess check cannot see. The one
    exception: common/tokenizer.py loads tokenizers with transformers (docs: common may import
    transformers' tokenizers), and no process that cannot afford it imports that module."""
    paths = [path for package in ("scheduler", "common") for path in sorted((ROOT / package).glob("*.py"))]
    assert named_imports(paths, {"torch"}) == []
    assert named_imports(paths, {"transformers"}) == ["common/tokenizer.py: transformers"]


def test_no_module_outside_tests_imports_from_tests_and_kernels_import_no_pagoda():
    outside = [p for p in sorted(ROOT.rglob("*.py"))
               if p.relative_to(ROOT).parts[0] not in ("tests", ".venv", "build") and "site-packages" not in p.parts]
    assert named_imports(outside, {"tests"}) == []
    assert named_imports(sorted((ROOT / "kernels").rglob("*.py")), {"pagoda"}) == []


def test_benchmarks_holds_data_and_results_only():
    """Benchmark code lives in pagoda/bench/."""
    assert sorted(str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").rglob("*.py")) == []


def test_memory_benchmark_and_workloads_import_no_torch_and_no_networking():
    """`pagoda bench memory` runs on a CPU host with neither torch nor a networking package; the
    benchmarks' shared module and the stack launcher need neither either."""
    statement = "import pagoda.bench.memory, pagoda.bench.workloads, pagoda.bench.common, pagoda.bench.stack"
    assert imported_after(statement, NETWORKING | {"torch", "transformers"}) == []


def test_the_tokenizer_loader_lives_in_common_and_the_worker_imports_nothing_of_the_gateway():
    """The worker loads its grammar's tokenizer with common.tokenizer.load_tokenizer: that pulls
    transformers and common only, no module of the gateway."""
    assert imported_after("import common.tokenizer", {"gateway"}) == []
    assert named_imports(sorted((ROOT / "worker").rglob("*.py")), {"gateway"}) == []


def test_a_gateway_process_tokenizes_without_torch_until_a_grammar_needs_it(tmp_path):
    """What `pagoda gateway` does first (gateway/without_torch.py), then the gateway's own start and
    a chat prompt's tokens; then xgrammar (which imports torch) once the block is lifted."""
    from tests import scripted

    model = scripted.build(tmp_path, {"hello": [" world"]})
    statement = (f"from gateway.without_torch import keep_torch_out, let_torch_in; keep_torch_out({str(model)!r}); "
                 "from common.tokenizer import load_tokenizer; import gateway.app; "
                 "t = load_tokenizer(" + repr(str(model)) + "); "
                 "assert t.apply_chat_template([{'role': 'user', 'content': 'hello'}], tokenize=False) == 'user hello\\n'; "
                 "assert sys.modules['torch'] is None; let_torch_in(); import xgrammar")
    code = f"import sys; {statement}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:1])"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["['torch']"]
    assert "PyTorch was not found" not in proc.stderr


def test_the_gateway_keeps_torch_in_while_it_would_read_a_gguf_file(tmp_path, monkeypatch):
    """transformers reads a GGUF file with torch: no block before the file's tokenizer is converted
    (and, with --enable-lora, its config: LoRA's shape check reads it), none for a model that cannot
    be resolved; `pagoda.cli`, which sets the block, imports neither torch nor transformers first."""
    from common.models import resolve_model
    from gateway.without_torch import reads_a_gguf_file

    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert reads_a_gguf_file(str(gguf)) and reads_a_gguf_file("default")
    converted = resolve_model(str(gguf))
    converted.converted_tokenizer_dir.mkdir(parents=True)
    (converted.converted_tokenizer_dir / "tokenizer_config.json").write_text("{}")
    assert not reads_a_gguf_file(str(gguf)) and reads_a_gguf_file(str(gguf), enable_lora=True)
    (converted.converted_dir / "config.json").write_text("{}")
    assert not reads_a_gguf_file(str(gguf), enable_lora=True)
    assert not reads_a_gguf_file(str(tmp_path)) and not reads_a_gguf_file("org/name")
    assert imported_after("import pagoda.cli", {"torch", "transformers"}) == []


PACKAGES = ("common", "gateway", "scheduler", "worker", "kernels", "pagoda", "tests")


def project_modules() -> dict[str, Path]:
    """{dotted name: file} of every module of the project's packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports: at module level and inside functions alike (a deferred
    import is still a dependency; both circles this test was written for hid behind one), but not
    under `if TYPE_CHECKING:`, which never runs."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:  # `from pagoda import cli` imports the module pagoda.cli
                target = f"{base}.{alias.name}"
                found.add(target if target in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return (found & modules.keys()) - {name}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(cycles)


def test_import_cycle_finder_finds_a_circle_through_a_deferred_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_the_project_is_part_of_an_import_circle():
    """gateway/app <-> gateway/dashboard_page and pagoda/cli -> pagoda/up -> pagoda/cli (through
    pagoda/bench/stack) were circles once: a module that needs one of the other's names takes it
    from a third module both may import (pagoda/commands.py, gateway/openai_api.py)."""
    modules = project_modules()
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    assert import_cycles(graph) == []
