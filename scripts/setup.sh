#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a virtual environment in .venv with the CPU build of torch 2.13.0
# (pinned: an unpinned torch pulls a multi-GB CUDA build), cpscope in editable mode, the test / example extras and,
# as an optional test dependency, megatron-core 0.19.2 (tests/integrations/test_megatron_core.py; skipped when it is
# not importable). CPSCOPE_NO_MEGATRON=1 skips it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${CPSCOPE_VENV:-.venv}
if [[ ! -x $VENV/bin/python ]]; then
  "$PY" -m venv "$VENV"
fi
stamp=$VENV/.cpscope-setup
# pip warns about every local index folder a package is missing from; keep real errors, drop that noise.
quiet_pip() { "$VENV/bin/python" -m pip install -q "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
if [[ ! -f $stamp || setup.cfg -nt $stamp ]]; then
  set -o pipefail
  echo "cpscope: setting up $VENV (torch 2.13.0 CPU build, cpscope editable, test + HF extras, megatron-core 0.19.2)..."
  quiet_pip "torch==2.13.0"
  quiet_pip -e ".[test,hf,examples]"
  if [[ -z ${CPSCOPE_NO_MEGATRON:-} ]]; then
    # 0.19.2 declares Python >= 3.12; its cp311 wheel works on 3.11. --no-deps: its runtime deps are the
    # megatron-test extra (numpy, packaging, triton); nothing else of its dependency tree is needed.
    quiet_pip -e ".[megatron-test]"
    quiet_pip --no-deps --ignore-requires-python "megatron-core==0.19.2"
  fi
  touch "$stamp"
fi
