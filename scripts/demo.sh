#!/usr/bin/env bash
# Set up (if needed) and run the demo: a small GPT trained with mixed CP1/CP2/CP4 microbatches on 4 CPU gloo ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${CPSCOPE_VENV:-.venv}/bin/python" examples/train_hybrid.py "$@"
