"""Helpers for the tests of the repository's own scripts (``scripts/check_layout.py``, ``scripts/check_docs.py``):
load a script as a module, and write a small synthetic tree for it to check."""
from __future__ import annotations

import importlib.util
import os
import sys
import textwrap
from types import ModuleType

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` as the module ``<name>`` (loaded once)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
        sys.modules[name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up meanwhile
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def write(root, rel: str, text: str) -> None:
    """Write ``text`` (dedented) to ``root / rel``, making the folders."""
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
