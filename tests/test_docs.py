"""The prose names only what exists: ``scripts/check_docs.py`` over README.md, docs/ and the results index.

The first test checks the checker on a small synthetic repository in which each kind of stale reference occurs once
next to a live one (so that the second test can fail); the second applies it to this repository. Both read files
only (no import of cpscope), well under a second.
"""
from __future__ import annotations

from tests._scripts import load_script, write


def _checker():
    return load_script("check_docs")


def test_checker_finds_each_kind_of_stale_reference(tmp_path):
    write(tmp_path, "cpscope/__init__.py", "from .a import live\nfrom . import sub\n")
    write(tmp_path, "cpscope/a.py", "def live():\n    pass\n\nclass Box:\n    def open(self):\n        pass\n")
    write(tmp_path, "cpscope/sub/__init__.py", "from .impl import Thing as Alias\n")
    write(tmp_path, "cpscope/sub/impl.py", "class Thing:\n    size = 1\n")
    write(tmp_path, "benchmarks/bench_x.py", 'DEFAULT_JSON = "out_x.json"\n')
    write(tmp_path, "benchmarks/results/x.json", "{}")
    write(tmp_path, "tests/test_a.py", "def test_live():\n    pass\n")
    write(tmp_path, "README.md", """\
        `cpscope.live`, `cpscope.a.Box.open`, `cpscope.sub.Alias.size`, `cpscope.sub.impl` are live;
        `cpscope.gone`, `cpscope.a.Box.shut` and `cpscope.sub.Alias.weight` are not.
        ```python
        from cpscope.a import live, Box
        from cpscope.sub import Alias, Missing
        ```
        Run `python benchmarks/bench_x.py` (writes `benchmarks/results/x.json`, see `benchmarks/results/*.json`),
        not `benchmarks/bench_y.py`, `benchmarks/results/*.csv` or `bench_z.py`; `bench_x.py` is fine.
        `test_live` passes; `test_dead` does not exist.
        `bench_x.py --json benchmarks/results/new.json` writes `out_x.json`; run `<your_script.py>` or `*_y.json`.
        `sub/impl.py` is short for `cpscope/sub/impl.py`; `sub/gone.py` is not there.
        """)
    stale = _checker().check(str(tmp_path), ["README.md"])
    found = sorted((s.kind, s.text) for s in stale)
    assert found == sorted([
        ("name", "cpscope.gone"), ("name", "cpscope.a.Box.shut"), ("name", "cpscope.sub.Alias.weight"),
        ("import", "cpscope.sub.Missing"),
        ("path", "benchmarks/bench_y.py"), ("path", "benchmarks/results/*.csv"),
        ("file", "bench_z.py"),
        ("test", "test_dead"), ("path", "sub/gone.py"),
    ]), found
    assert all(s.line in (2, 5, 8, 9, 11) for s in stale), [str(s) for s in stale]


def test_docs_name_only_what_exists():
    cd = _checker()
    stale = cd.check(files=cd.doc_files() + cd.code_files())  # the prose, and the docstrings / messages of the code
    assert not stale, "stale references in the docs:\n" + "\n".join(str(s) for s in stale)
