#!/usr/bin/env bash
# Fuzz the gateway from its own OpenAPI document (GET /openapi.json) with schemathesis.
#
# Every phase (examples, coverage: each field's boundaries and wrong types; fuzzing: random
# bodies, valid and invalid), many examples per operation, and every check that applies:
# no 5xx, every status and content type documented, every JSON body matching its schema,
# required headers (Retry-After) present, invalid bodies rejected with a 4xx, wrong methods
# a 405 with Allow. Not positive_data_acceptance: a body the schema allows can still be a 400
# (a prompt over the context length, best_of < n, ...), which the document says.
# Generated requests run the real model: unlike the short run in tests/test_bad_input.py,
# max_tokens is not capped, so on a CPU this takes ten minutes or more.
#
#   scripts/fuzz.sh                      start `pagoda up` (CPU, --max-model-len 128) and fuzz it
#   scripts/fuzz.sh http://host:8000     fuzz a running gateway (add -H 'Authorization: Bearer KEY'
#                                        after the URL if it has an API key)
#
# Environment: MAX_EXAMPLES (default 200 per operation), SEED (default random; schemathesis
# prints the seed it used, pass it to reproduce a run), MAX_MODEL_LEN (default 128), ST (the
# schemathesis command, default .venv/bin/st, else st). Extra arguments after the URL go to
# `st run` (for instance --max-time 1800). The exit status is schemathesis's: 0 when no check failed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=python3
[ -x .venv/bin/python ] && PYTHON=.venv/bin/python
ST=${ST:-$([ -x .venv/bin/st ] && echo .venv/bin/st || echo st)}
MAX_EXAMPLES=${MAX_EXAMPLES:-200}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-128}
CHECKS=not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance
CHECKS=$CHECKS,response_headers_conformance,negative_data_rejection,unsupported_method,missing_required_header
CHECKS=$CHECKS,allow_header_conformance

url=${1:-}
[ $# -gt 0 ] && shift
if [ -z "$url" ]; then  # the launcher starts pagoda up, runs this script again on its URL, then stops it
    log=$(mktemp -t pagoda-fuzz-XXXXXX.log)
    exec "$PYTHON" -m pagoda.bench.stack --log "$log" --device cpu --max-model-len "$MAX_MODEL_LEN" -- scripts/fuzz.sh {url} "$@"
fi

seed=()
[ -n "${SEED:-}" ] && seed=(--seed "$SEED")
set -x
"$ST" run "$url/openapi.json" --checks "$CHECKS" --max-examples "$MAX_EXAMPLES" "${seed[@]}" \
    --workers 2 --request-timeout 600 --no-color "$@"
