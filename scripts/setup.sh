#!/usr/bin/env bash
# Create .venv and install cagkv with its dev tools. Idempotent; used by demo.sh and test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.cagkv-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    # torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
    .venv/bin/python -m pip install -q "torch==2.13.0"
    .venv/bin/python -m pip install -q -e ".[dev]"
    touch "$stamp"
fi
