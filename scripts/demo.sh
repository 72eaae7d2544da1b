#!/usr/bin/env bash
# Set up (if needed) and run the demo: a small GPT trained with mixed CP1/CP2/CP4 microbatches on 4 CPU gloo ranks.
# The demo has its own light venv (CPSCOPE_DEMO_VENV, default .venv-demo): the CPU build of torch 2.13.0 (pinned: an
# unpinned torch pulls a multi-GB CUDA build), cpscope from this checkout (editable, no extras: numpy comes with it)
# and tqdm — not the test extras, which scripts/test.sh keeps in .venv. It is made again when pyproject.toml is newer.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${CPSCOPE_DEMO_VENV:-.venv-demo}
stamp=$VENV/.cpscope-demo
if [[ ! -f $stamp || pyproject.toml -nt $stamp ]]; then
  echo "cpscope demo: setting up $VENV (torch 2.13.0 CPU build, cpscope editable, numpy, tqdm)..."
  [[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
  # one resolver run; pip warns about every local index folder a package is missing from: drop that noise
  "$VENV/bin/python" -m pip install -q "torch==2.13.0" tqdm -e . 2>&1 |
    { grep -v "is ignored: it is neither a file nor a directory" || true; }
  touch "$stamp"
fi
exec "$VENV/bin/python" examples/train_hybrid.py "$@"
