"""What Pagoda promises of a spec the grammar library rejects: its own words (the field, what kind of
spec is invalid) exactly, then the library's reason as the library gives it, on one line without the
library's C++ source location. The library's wording is its own and moves between releases
(xgrammar 0.2.9 quotes a missing field's name, 0.2.8 did not), so the tests take it from the
library itself instead of writing it out."""
from __future__ import annotations

import re

# "[06:49:29] /project/cpp/regex_converter.cc:94: " before xgrammar's reason
SOURCE_LOCATION = re.compile(r"^\[[\d:]+\]\s*\S+:\d+:\s*")


def library_reason(convert: str, text: str) -> str:
    """The first line of what xgrammar raises for `text` through `xgr.Grammar.<convert>`
    (from_json_schema, from_regex, from_ebnf), its source location left out."""
    import xgrammar as xgr

    try:
        getattr(xgr.Grammar, convert)(text)
    except RuntimeError as exc:
        return SOURCE_LOCATION.sub("", str(exc).strip()).splitlines()[0].strip()
    raise AssertionError(f"xgrammar accepts {text!r}")


def assert_relays(message: str, ours: str, convert: str, text: str) -> None:
    """`message` is `ours` exactly, then ": " and the library's reason for `text`."""
    reason = library_reason(convert, text)
    assert reason and message == f"{ours}: {reason}", (message, reason)
