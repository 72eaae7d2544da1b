"""``CPSCOPE_CORE_ONLY=1`` (tests/_core_only.py) really hides the optional packages — in a fresh interpreter as in
the rank pool's spawned workers — and ``CPSCOPE_REACHES_OPTIONAL=1`` keeps the tests that can change without them."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})


def test_core_only_hides_every_optional_package_by_import_spec_and_metadata():
    res = _python("""
        import importlib.metadata, importlib.util
        import tests  # installs the switch
        from tests._core_only import MODULES
        for name in ("transformers", "megatron", "trl", "triton", "fla", "transformer_engine"):
            assert name in MODULES and importlib.util.find_spec(name) is None, name
            try:
                __import__(name)
            except ImportError:
                pass
            else:
                raise AssertionError(name + " imported")
        for dist in ("transformers", "megatron-core", "megatron_core", "flash-linear-attention"):
            try:
                importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                pass
            else:
                raise AssertionError(dist + " has metadata")
        import torch, numpy, pytest  # the core stays
        assert importlib.metadata.version("torch")
        from tests.distributed import run_ranks
        from tests.test_core_only_switch import _worker_sees
        assert run_ranks(2, _worker_sees) == [None, None]  # spawned workers inherit it
        print("ok")
        """, CPSCOPE_CORE_ONLY="1")
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout + res.stderr


def _worker_sees():
    import importlib.util

    return importlib.util.find_spec("transformers")


def test_reaches_optional_keeps_the_tests_that_can_change():
    res = _python("""
        import subprocess, sys
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                              "tests/test_cli.py", "tests/test_scope.py", "tests/integrations/test_megatron_moe.py"],
                             capture_output=True, text=True).stdout
        ids = [line for line in out.splitlines() if "::" in line]
        assert any("test_dataset_offline_is_a_clear_error" in i for i in ids), ids
        assert any("test_megatron_moe.py" in i for i in ids), ids  # module-level: megatron-core
        assert not any("test_scope.py" in i for i in ids), ids  # reaches nothing optional
        assert not any("test_plan_json_and_text" in i for i in ids), ids
        print("ok")
        """, CPSCOPE_REACHES_OPTIONAL="1")
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout + res.stderr
