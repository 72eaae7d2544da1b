#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite on CPU (gloo ranks; GPU tests are skipped without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${CPSCOPE_VENV:-.venv}/bin/python" -m pytest -q "$@"
