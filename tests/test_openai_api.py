"""[openai-api] through the real stack: one `pagoda up` (the default model on CPU) for scoring (echo,
prompt logprobs), logit_bias, structured output and tool calls over HTTP, and the real clients
(lm-evaluation-harness, the openai SDK)."""
from __future__ import annotations

import pytest

from tests.stack import Stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack():
    stack = Stack("--num-gpu-blocks", "2048", "--num-cpu-blocks", "256").wait_ready()
    yield stack
    assert stack.stop() == 0


# ----------------------------------------------------------------------------- scoring: echo, prompt_logprobs, max_tokens 0
# (helper "scoring")


# ----------------------------------------------------------------------------- structured output, logit_bias, tools over HTTP
# (helper "api")


# ----------------------------------------------------------------------------- real clients: lm-evaluation-harness, the openai SDK
# (helper "clients")
