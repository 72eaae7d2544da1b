#!/usr/bin/env bash
# Run the test suite with the core dependencies only: torch 2.13.0 (CPU build), cpscope and its `test` extra
# (pytest, hypothesis, numpy, tqdm) — no transformers, TRL, accelerate, PEFT, megatron-core, TransformerEngine,
# triton or flash-linear-attention. Proves that every test needing an optional package skips cleanly without it
# and that nothing in the core imports one. CI runs the faster equivalent, scripts/test_core_only_fast.sh (the same
# venv, the optional packages hidden), after scripts/test.sh (the suite with every extra).
#
#   CPSCOPE_CORE_VENV   the venv to use (default .venv-core); made if missing, reused otherwise
#   PYTHON              the Python that makes it (default python3)
#   arguments           passed to pytest (default: the whole suite)
#
# Example:
#   CPSCOPE_CORE_VENV=/tmp/venv-core bash scripts/test_core_only.sh -x tests/test_faults.py
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${CPSCOPE_CORE_VENV:-.venv-core}
OPTIONAL=(transformers trl accelerate peft datasets megatron transformer_engine triton fla)

if [[ ! -x $VENV/bin/python ]]; then
  "$PY" -m venv "$VENV"
fi
stamp=$VENV/.cpscope-core-setup
if [[ ! -f $stamp || pyproject.toml -nt $stamp ]]; then
  echo "cpscope: setting up $VENV (torch 2.13.0 CPU build, the test extra, cpscope editable without extras)..."
  "$VENV/bin/python" -m pip install -q "torch==2.13.0" "pytest>=7" "hypothesis>=6" numpy tqdm
  "$VENV/bin/python" -m pip install -q --no-deps -e .
  touch "$stamp"
fi

# The venv must really lack the optional packages (a system-site venv or a stray install would hide a missing skip).
present=$("$VENV/bin/python" - "${OPTIONAL[@]}" <<'EOF'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is not None))
EOF
)
if [[ -n $present ]]; then
  echo "cpscope: $VENV has optional packages installed ($present): not a core-only environment" >&2
  exit 2
fi
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
