"""The package's layout goals, measured from its own imports by ``scripts/check_layout.py``.

Goals: no import cycle (between modules or between rooms), at most 9 floors, no file over 500 lines, no function
over 80 lines, no repeated block of >= 6 normalised lines, no private name imported across rooms. The first test
checks the checker on a small synthetic package in which each rule is broken once (so that the goals test can
fail); the second applies the goals to ``cpscope/``.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import textwrap

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _checker():
    spec = importlib.util.spec_from_file_location("check_layout", os.path.join(_ROOT, "scripts", "check_layout.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("check_layout", mod)  # dataclasses look their module up while the class is made
    spec.loader.exec_module(sys.modules["check_layout"])
    return sys.modules["check_layout"]


def _write(root, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


_BLOCK = "\n".join(f"    total = total + {i} * x  # step {i}" for i in range(7))


def _synthetic(root) -> None:
    """A package breaking each rule once: a lazy-import cycle a <-> b, a private name imported across rooms
    (c from a) and inside a subpackage (pkg.y from pkg.x), a long file, a long function, one repeated block."""
    _write(root, "cpscope/__init__.py", "from .a import A\n")
    _write(root, "cpscope/a.py", '''
        """Module a."""
        A = 1
        _SECRET = 2


        def uses_b():
            from cpscope import b  # lazy: still an import
            return b.B
    ''')
    _write(root, "cpscope/b.py", "from cpscope.a import A\nB = A\n")
    _write(root, "cpscope/c.py", "from .a import _SECRET\n\n\ndef f(x):\n    total = 0\n" + _BLOCK + "\n"
           "    return total\n\n\ndef g(x):\n    total = 0\n    # other comments, same code\n" + _BLOCK.replace(
               "# step", "# another") + "\n    return total\n")
    _write(root, "cpscope/pkg/__init__.py", "")
    _write(root, "cpscope/pkg/x.py", "_HELPER = 3\n")
    _write(root, "cpscope/pkg/y.py", "from ._sub import thing\nfrom .x import _HELPER\n")
    _write(root, "cpscope/pkg/_sub.py", "thing = 1\n")
    _write(root, "cpscope/long.py", "def long():\n" + "".join(f"    y{i} = {i}\n" for i in range(85))
           + "\n" + "".join(f"Z{i} = {i}\n" for i in range(420)))


def test_checker_finds_each_broken_rule(tmp_path):
    cl = _checker()
    _synthetic(tmp_path)
    lay = cl.analyse(str(tmp_path))
    assert lay.module_cycles == [["cpscope.a", "cpscope.b"]]
    assert lay.room_cycles == [["a", "b"]] and len(lay.arrows_up) == 1
    assert [(p, n) for p, n in lay.long_files] == [("cpscope/long.py", 507)]
    assert [(q, n) for _, _, q, n in lay.long_functions] == [("long", 86)]
    assert [[(p, a) for p, a, _ in g] for g in lay.repeated_blocks] == [[("cpscope/c.py", 5), ("cpscope/c.py", 17)]]
    across = [(p.importer, p.name) for p in lay.private_uses if p.scope == "across rooms"]
    inside = [(p.importer, p.name) for p in lay.private_uses if p.scope == "same room"]
    assert across == [("cpscope.c", "_SECRET")] and inside == [("cpscope.pkg.y", "_HELPER")]
    assert lay.floors["cpscope"] > lay.floors["a"] and lay.floors["pkg"] == 0
    assert "thing" not in {p.name for p in lay.private_uses}  # a private *module* is not a private name
    failed = {k for k, (ok, _) in cl.goals(lay).items() if not ok}
    assert len(failed) == 6 and not any("floors" in k for k in failed), failed
    assert cl.main(["--root", str(tmp_path), "--check"]) == 1


def test_layout_goals():
    cl = _checker()
    lay = cl.analyse(_ROOT)
    failed = {k: fig for k, (ok, fig) in cl.goals(lay).items() if not ok}
    assert not failed, (failed, cl.report(lay))
