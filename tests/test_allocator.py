"""scheduler/allocator.py: both allocators implement the Allocator protocol, and the scheduler
uses nothing of an allocator beyond it."""
import ast

import pytest

from scheduler.allocator import Allocator
from scheduler.block_manager import BlockManager
from scheduler.contiguous import ContiguousAllocator
from tests.conftest import ROOT

MEMBERS = {name for name in vars(Allocator) if not name.startswith("_")} | set(Allocator.__annotations__)


@pytest.mark.parametrize("allocator", [
    BlockManager(9, 4, num_cpu_blocks=4, enable_prefix_caching=True), ContiguousAllocator(9, 4, "pow2", 16),
], ids=["paged", "contiguous"])
def test_both_allocators_implement_the_protocol(allocator):
    assert isinstance(allocator, Allocator)
    assert all(hasattr(allocator, name) for name in MEMBERS)


def allocator_uses(path) -> set[str]:
    """Attributes read of `self.block_manager`, `s.block_manager` or a local `bm` bound to it."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        value = node.value
        local = isinstance(value, ast.Name) and value.id == "bm"
        if local or (isinstance(value, ast.Attribute) and value.attr == "block_manager"):
            used.add(node.attr)
    return used


@pytest.mark.parametrize("module", ["scheduler/scheduler.py", "scheduler/server.py"])
def test_the_scheduler_uses_only_the_allocator_protocol(module):
    used = allocator_uses(ROOT / module)
    assert used and used <= MEMBERS, sorted(used - MEMBERS)
