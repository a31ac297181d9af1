"""Schemathesis hooks for the short CI run (tests/test_bad_input.py): keep accepted requests cheap.

On a loaded 2-core machine the model makes about one token a second, so a generated request that
the gateway accepts with the default max_tokens (16 for completions) could alone take a good part
of the time budget. This hook lowers a valid max_tokens (or max_completion_tokens) that would fit
the CI stack's context, or a missing one, to 2 tokens. It only maps valid values to valid values:
a value the gateway must reject (0, -1, "abc", 10**9) and everything else in the body are left as
generated, so negative cases stay negative. scripts/fuzz.sh runs without it.
Load it with SCHEMATHESIS_HOOKS=tests/schemathesis_hooks.py.
"""
import schemathesis

CAP = 2
FITS_THE_CONTEXT = 64  # larger values are rejected by the gateway at once (context length), so cost nothing


def _cheap(value):
    if value is None:
        return CAP
    whole = isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer()
    if whole and CAP < value <= FITS_THE_CONTEXT:
        return CAP
    return value


@schemathesis.hook
def map_body(context, body):
    if not isinstance(body, dict):
        return body
    body = dict(body)
    if "max_completion_tokens" in body and body["max_completion_tokens"] is not None:
        body["max_completion_tokens"] = _cheap(body["max_completion_tokens"])  # it overrides max_tokens
        if "max_tokens" in body and body["max_tokens"] is not None:
            body["max_tokens"] = _cheap(body["max_tokens"])
    else:
        body["max_tokens"] = _cheap(body.get("max_tokens"))
    return body
