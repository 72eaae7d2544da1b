"""The packaging promises that the test suite can check without building anything (scripts/check_install.sh builds
and installs the wheel in CI): one version, the metadata in pyproject.toml only, `import cpscope` and CP1
attention / RoPE without numpy, the README quick start equal to examples/quickstart.py, and a docstring example on
every public callable of the top-level API, the planner and the megatron adapter."""
from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys
import textwrap

import pytest

import cpscope
from cpscope import _version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

try:
    import tomllib
except ImportError:  # Python < 3.11
    tomllib = None


def _pyproject() -> dict:
    if tomllib is None:
        pytest.skip("tomllib needs Python >= 3.11")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_one_version_and_one_metadata_source():
    meta = _pyproject()
    assert not os.path.exists(os.path.join(ROOT, "setup.cfg")), "metadata lives in pyproject.toml only"
    assert meta["project"]["dynamic"] == ["version"]
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "cpscope._version.__version__"}
    assert cpscope.__version__ == _version.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", cpscope.__version__)
    with open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8") as f:
        assert f"## {cpscope.__version__}" in f.read(), "CHANGELOG.md has no entry for this version"


def test_declared_dependencies_and_extras():
    meta = _pyproject()["project"]
    deps = {re.split(r"[<>=!;\[ ]", d)[0]: d for d in meta["dependencies"]}
    assert set(deps) == {"torch", "numpy"}, deps
    extras = meta["optional-dependencies"]
    assert extras["megatron"] == ["megatron-core==0.19.2; python_version >= '3.12'"]
    assert "transformers>=5.4" in extras["hf"]
    assert any(r.startswith("flash-linear-attention") for r in extras["linear"])
    assert meta["license"] == "Apache-2.0" and meta["license-files"] == ["LICENSE"]
    with open(os.path.join(ROOT, "LICENSE"), encoding="utf-8") as f:
        text = f.read()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


def test_import_cpscope_and_cp1_attention_and_rope_need_no_numpy():
    code = textwrap.dedent(
        """
        import sys, warnings
        sys.modules["numpy"] = None          # importing numpy raises ImportError
        warnings.simplefilter("ignore")      # torch warns that it cannot initialise numpy
        import torch, cpscope
        x = torch.randn(1, 8, 2, 4)
        freqs = cpscope.rotary_freqs(4, 8)
        y = cpscope.apply_rotary_pos_emb(x, freqs, qkv_format="bshd")
        out = cpscope.context_parallel_attention(y, y, y, qkv_format="bshd", causal=True, window=(2, 0))
        assert out.shape == x.shape
        assert "cpscope.hybrid" not in sys.modules, "the planner (numpy) was imported"
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_readme_quick_start_is_examples_quickstart():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    m = re.search(r"<!-- quickstart: examples/quickstart.py -->\s*```python\n(.*?)```", readme, re.S)
    assert m, "README.md: no python block under <!-- quickstart: examples/quickstart.py -->"
    with open(os.path.join(ROOT, "examples", "quickstart.py"), encoding="utf-8") as f:
        assert m.group(1) == f.read(), "README's quick start and examples/quickstart.py differ"


# Modules whose every public callable must show an example in its docstring (internal modules: not yet).
EXAMPLE_MODULES = ["cpscope", "cpscope.hybrid", "cpscope.integrations.megatron"]


@pytest.mark.parametrize("module", EXAMPLE_MODULES)
def test_every_public_callable_has_a_docstring_example(module):
    mod = importlib.import_module(module)
    missing = []
    for name in mod.__all__:
        obj = getattr(mod, name)
        if not callable(obj):
            continue
        doc = inspect.getdoc(obj) or ""
        if not re.search(r"^\s*(Example[s]?:{1,2}|>>> )", doc, re.M):
            missing.append(name)
    assert not missing, f"{module}: public callables without a docstring example: {missing}"
