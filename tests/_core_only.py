"""Run the tests as if only the core dependencies were installed (torch, numpy, pytest, hypothesis, tqdm).

With ``CPSCOPE_CORE_ONLY=1`` in the environment, importing the ``tests`` package hides every optional package
from this interpreter before anything imports it: ``sys.modules[name] = None`` for each top-level module (``import
x`` raises ``ModuleNotFoundError``, so ``pytest.importorskip`` skips; ``importlib.util.find_spec`` returns
``None``), and ``importlib.metadata`` reports their distributions as not installed. The rank pool's workers
(``tests.distributed``, spawned) import the package too and inherit the variable, so they are core-only alike.

It proves, in the same venv and without installing anything, what ``scripts/test_core_only.sh`` proves in a venv
without the extras: every test that needs an optional package skips cleanly without it, and the rest pass.
``.ci/run`` runs such a pass after the full suite: ``scripts/test_core_only_fast.sh`` (the tests that reach an
optional package, :func:`reaches_optional`, in a random order).

Example::

    CPSCOPE_CORE_ONLY=1 python -m pytest -q tests/test_faults.py tests/integrations/test_optional_imports.py
"""
from __future__ import annotations

import ast
import importlib.metadata
import inspect
import os
import re
import sys
from typing import Any

__all__ = ["MODULES", "DISTRIBUTIONS", "enabled", "install", "reaches_optional"]

# the optional packages (pyproject's extras and what they bring), by import name and by distribution name
MODULES = ("transformers", "trl", "accelerate", "peft", "datasets", "megatron", "transformer_engine", "triton",
           "fla", "cudnn", "flash_attn", "mamba_ssm", "causal_conv1d", "tokenizers", "safetensors", "huggingface_hub")
DISTRIBUTIONS = ("transformers", "trl", "accelerate", "peft", "datasets", "megatron-core", "megatron_core",
                 "transformer-engine", "transformer_engine", "triton", "flash-linear-attention", "fla-core",
                 "nvidia-cudnn-frontend", "flash-attn", "mamba-ssm", "causal-conv1d", "tokenizers", "safetensors",
                 "huggingface-hub", "huggingface_hub")


def enabled() -> bool:
    """Whether this process runs core-only (``CPSCOPE_CORE_ONLY`` set to anything but ``""`` / ``"0"``)."""
    return os.environ.get("CPSCOPE_CORE_ONLY", "") not in ("", "0")


def _normal(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


_HIDDEN = {_normal(d) for d in DISTRIBUTIONS}


def install() -> None:
    """Hide the optional packages from this interpreter (idempotent). ``RuntimeError`` when one was imported
    already: hiding it then would leave half of a package visible."""
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in MODULES and sys.modules[m] is not None)
    if loaded:
        raise RuntimeError(f"CPSCOPE_CORE_ONLY: optional modules were imported before the tests package: {loaded[:8]}")
    for name in MODULES:
        sys.modules[name] = None  # type: ignore[assignment]
    dist_cls = importlib.metadata.Distribution
    if getattr(dist_cls.from_name, "_cpscope_core_only", False):
        return
    original = dist_cls.from_name.__func__  # type: ignore[attr-defined]

    def from_name(cls, name: str):  # type: ignore[no-untyped-def]
        if _normal(name) in _HIDDEN:
            raise importlib.metadata.PackageNotFoundError(name)
        return original(cls, name)

    from_name._cpscope_core_only = True  # type: ignore[attr-defined]
    dist_cls.from_name = classmethod(from_name)  # type: ignore[method-assign,assignment]


# How a test reaches an optional package: by name (not cpscope's modules named after them, ``integrations.megatron``),
# or by the calls that ask whether one is there, or through a benchmark script (they import the extras they time)
_REACH = re.compile(r"(?<![.\w])(" + "|".join(MODULES) + r"|megatron-core|flash-linear-attention|importorskip|find_spec|"
                    r"importlib\.metadata|_megatron_available|bench_[a-z_]+)\b")
_MODULE_LEVEL: dict[str, bool] = {}


def _module_level_reaches(path: str) -> bool:
    """Whether a test module's own top-level statements (imports, ``pytestmark``, module-level skips — not its
    functions' bodies) reach an optional package: then every test in it does."""
    if path not in _MODULE_LEVEL:
        tree = ast.parse(open(path, encoding="utf-8").read())
        src = open(path, encoding="utf-8").read()
        top = [ast.get_source_segment(src, n) or "" for n in tree.body
               if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
               and not (isinstance(n, ast.Expr) and isinstance(getattr(n, "value", None), ast.Constant))]
        _MODULE_LEVEL[path] = any(_REACH.search(t) for t in top)
    return _MODULE_LEVEL[path]


def reaches_optional(item: Any) -> bool:
    """Whether a collected test can behave differently without the optional packages: its module reaches one at
    the top level, or its own function (or a module-level helper it names) mentions one or asks for one."""
    path = str(item.fspath)
    if _module_level_reaches(path):
        return True
    fn = getattr(item, "function", None)
    if fn is None:
        return True
    try:
        body = inspect.getsource(fn)
    except (OSError, TypeError):
        return True
    if _REACH.search(body):
        return True
    module = inspect.getmodule(fn)
    for name in set(re.findall(r"\b(_[A-Za-z0-9_]+)\b", body)):  # the module's private helpers it calls
        helper = getattr(module, name, None)
        if inspect.isfunction(helper):
            try:
                if _REACH.search(inspect.getsource(helper)):
                    return True
            except (OSError, TypeError):
                return True
    return False
