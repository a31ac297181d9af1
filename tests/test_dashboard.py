"""[observability] through the real stack: one `pagoda up` (the default model on CPU) for the memory
page's data, the page in headless Chromium, and the vLLM-compatible metrics."""
from __future__ import annotations

import pytest

from tests.stack import Stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack():
    stack = Stack("--num-gpu-blocks", "2048", "--num-cpu-blocks", "256").wait_ready()
    yield stack
    assert stack.stop() == 0


# ----------------------------------------------------------------------------- the page's data
# (/dashboard/snapshot, /dashboard/events)


# ----------------------------------------------------------------------------- the page in Chromium


# ----------------------------------------------------------------------------- metrics
