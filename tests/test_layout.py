"""The package's layout goals, measured from its own imports by ``scripts/check_layout.py``.

Goals: no import cycle (between modules or between rooms), at most 9 floors, no file over 500 lines, no function
over 80 lines, no repeated block of >= 6 normalised lines, no private name imported across rooms. The first test
checks the checker on a small synthetic package in which each rule is broken once (so that the goals test can
fail); the second applies the goals to ``cpscope/``.
"""
from __future__ import annotations

import pytest

from tests._scripts import ROOT, load_script, write


def _checker():
    return load_script("check_layout")


_BLOCK = "\n".join(f"    total = total + {i} * x  # step {i}" for i in range(7))


def _synthetic(root) -> None:
    """A package breaking each rule once: a lazy-import cycle a <-> b, a private name imported across rooms
    (c from a) and inside a subpackage (pkg.y from pkg.x), a long file, a long function, one repeated block."""
    write(root, "cpscope/__init__.py", "from .a import A\n")
    write(root, "cpscope/a.py", '''
        """Module a."""
        A = 1
        _SECRET = 2


        def uses_b():
            from cpscope import b  # lazy: still an import
            return b.B
    ''')
    write(root, "cpscope/b.py", "from cpscope.a import A\nB = A\n")
    write(root, "cpscope/c.py", "from .a import _SECRET\n\n\ndef f(x):\n    total = 0\n" + _BLOCK + "\n"
           "    return total\n\n\ndef g(x):\n    total = 0\n    # other comments, same code\n" + _BLOCK.replace(
               "# step", "# another") + "\n    return total\n")
    write(root, "cpscope/pkg/__init__.py", "")
    write(root, "cpscope/pkg/x.py", "_HELPER = 3\n")
    write(root, "cpscope/pkg/y.py", "from ._sub import thing\nfrom .x import _HELPER\n")
    write(root, "cpscope/pkg/_sub.py", "thing = 1\n")
    write(root, "cpscope/long.py", "def long():\n" + "".join(f"    y{i} = {i}\n" for i in range(85))
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
    lay = cl.analyse(ROOT)
    failed = {k: fig for k, (ok, fig) in cl.goals(lay).items() if not ok}
    assert not failed, (failed, cl.report(lay))
