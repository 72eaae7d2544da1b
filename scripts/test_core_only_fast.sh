#!/usr/bin/env bash
# The suite's second CI pass (about a minute): the core dependencies only, in the venv of the first pass, the
# optional packages hidden rather than uninstalled (CPSCOPE_CORE_ONLY=1, tests/_core_only.py), the tests in a random
# order (CPSCOPE_TEST_SHUFFLE; the seed is printed in pytest's header). It proves what the full core-only run
# (scripts/test_core_only.sh: a venv without the extras, ~6 minutes) proves, for every test it can change:
#   1. every test module imports without transformers, TRL, accelerate, PEFT, datasets, megatron-core, TE, triton,
#      flash-linear-attention... (the whole suite is collected with them hidden: an import error fails the pass);
#   2. every test that reaches an optional package (CPSCOPE_REACHES_OPTIONAL=1: its module names one at the top
#      level, or its function or a helper it calls names one, asks for one with importorskip / find_spec /
#      importlib.metadata, or runs a benchmark script) skips cleanly or passes on the core path without it.
#      Every other test runs the same code with or without the extras: the first pass covers it.
#
#   CPSCOPE_VENV           the venv (default .venv, as scripts/test.sh)
#   CPSCOPE_TEST_SHUFFLE   the order's seed (default: from the commit, so a rerun of one commit keeps its order)
#   arguments              passed to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
export CPSCOPE_CORE_ONLY=1 CPSCOPE_REACHES_OPTIONAL=1
if [[ -z ${CPSCOPE_TEST_SHUFFLE:-} ]]; then
  CPSCOPE_TEST_SHUFFLE=$( (git rev-parse HEAD 2>/dev/null || echo 0) | cksum | cut -d' ' -f1)
fi
export CPSCOPE_TEST_SHUFFLE
exec "${CPSCOPE_VENV:-.venv}/bin/python" -m pytest -q -p no:cacheprovider "$@" tests
