#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a virtual environment in .venv with the CPU build of torch 2.13.0
# (pinned: an unpinned torch pulls a multi-GB CUDA build), cpscope in editable mode, and the test / example extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${CPSCOPE_VENV:-.venv}
if [[ ! -x $VENV/bin/python ]]; then
  "$PY" -m venv "$VENV"
fi
stamp=$VENV/.cpscope-setup
if [[ ! -f $stamp || setup.cfg -nt $stamp ]]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q -e ".[test,hf,examples]"
  touch "$stamp"
fi
