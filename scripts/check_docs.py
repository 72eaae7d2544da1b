#!/usr/bin/env python3
"""Check that the prose (``README.md``, ``docs/*.md``, ``benchmarks/results/README.md``) names only things that exist.

Reads the Markdown files and the package's sources with :mod:`ast` (nothing is imported or run; standard library
only) and reports:

* **dotted names** — every ``cpscope.a.b.c``: the longest prefix that is a module or package of ``cpscope/`` must
  exist, and each further part must be defined there (a function, class, assignment, import or submodule; an
  imported name is followed to where it is defined, a class to its methods and class attributes);
* **imports** — ``from cpscope.x import a, b`` in code: each name must be defined in ``cpscope.x``;
* **paths** — every repository path (``cpscope/…``, ``benchmarks/…``, ``scripts/…``, ``docs/…``, ``tests/…``,
  ``examples/…``, ``.ci/…``) must exist, unless it follows ``--out`` / ``--json`` / ``>`` (what a command would
  write); a path with a wildcard (``*``, ``{``, ``<``) must match at least one file; a path inside the package
  written from a subpackage (``attention/_ring.py``, ``megatron/_moe.py``) must be the end of an existing one;
* **file names** — a bare ``name.py`` / ``name.sh`` / ``name.json`` must be the name of some file of the repository
  or a name that its code spells out (an output a script writes, a file a benchmark looks for outside the
  repository); ``<name.py>`` is a placeholder and ``*_x.json`` a pattern, neither checked;
* **test names** — ``test_xxx`` in backticks must be a test function or a test file of ``tests/``.

Usage::

    python scripts/check_docs.py          # list what is stale; exit 1 if anything is
    python scripts/check_docs.py --code   # the package's and the examples' sources as well
"""
from __future__ import annotations

import argparse
import ast
import fnmatch
import os
import re
import sys
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Set, Tuple

__all__ = ["Stale", "check", "code_files", "doc_files", "main"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "cpscope"
PATH_ROOTS = ("cpscope", "benchmarks", "scripts", "docs", "tests", "examples", ".ci")
_SKIP_DIRS = {".git", ".venv", ".venv-ci", "__pycache__", ".pytest_cache", "node_modules", ".hypothesis"}

_DOTTED = re.compile(r"(?<![\w./-])cpscope(?:\.[A-Za-z_]\w*)+")
_FROM_IMPORT = re.compile(r"from\s+(cpscope(?:\.\w+)*)\s+import\s+\(?([\w\s,]+)\)?")
_PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./*{}<>,-]*)" % "|".join(re.escape(r) for r in PATH_ROOTS))
_FILE = re.compile(r"(?<![\w./<*-])([A-Za-z_][\w-]*\.(?:py|sh|json|png|log|toml|cfg))\b(?![\w/-])")
_OUTPUT_FLAG = re.compile(r"(?:--out|--json|-o)[ =]$|> ?$")
_CODE_SPAN = re.compile(r"`([^`\n]+)`")


@dataclass(frozen=True)
class Stale:
    """One name or path in the prose that the repository does not have."""

    doc: str
    line: int
    kind: str  # "name", "import", "path", "file", "test"
    text: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.kind} {self.text}"


def doc_files(root: str = ROOT) -> List[str]:
    """The Markdown files checked, relative to ``root``."""
    out = ["README.md"] if os.path.exists(os.path.join(root, "README.md")) else []
    docs = os.path.join(root, "docs")
    if os.path.isdir(docs):
        out += sorted(os.path.join("docs", f) for f in os.listdir(docs) if f.endswith(".md"))
    if os.path.exists(os.path.join(root, "benchmarks", "results", "README.md")):
        out.append(os.path.join("benchmarks", "results", "README.md"))
    return out


class _Package:
    """What each module of the package defines, read with ``ast``."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._defs: Dict[str, Optional[Dict[str, object]]] = {}

    def path_of(self, module: str) -> Optional[str]:
        base = os.path.join(self.root, *module.split("."))
        for p in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.exists(p):
                return p
        return None

    def defs(self, module: str) -> Optional[Dict[str, object]]:
        """Top-level names of ``module``: a class maps to its member names, an import to ``(module, name)``."""
        if module not in self._defs:
            path = self.path_of(module)
            self._defs[module] = None if path is None else _top_level(self.root, path, module)
        return self._defs[module]

    def resolve(self, module: str, parts: List[str], depth: int = 0) -> bool:
        """Whether ``module.parts[0].parts[1]…`` names something defined in the package."""
        if not parts or depth > 20:
            return True
        head, rest = parts[0], parts[1:]
        if self.path_of(f"{module}.{head}") is not None:
            return self.resolve(f"{module}.{head}", rest, depth + 1)
        names = self.defs(module)
        if names is None or head not in names:
            return False
        target = names[head]
        if isinstance(target, tuple):  # imported: follow it
            src_mod, src_name = target
            if not src_mod.startswith(PACKAGE):
                return True  # something from another library: not ours to check
            if src_name is None:
                return self.resolve(src_mod, rest, depth + 1) if self.path_of(src_mod) else False
            return self.resolve(src_mod, [src_name] + rest, depth + 1)
        if isinstance(target, set):  # a class: one more part may be a member
            return not rest or rest[0] in target
        return True  # a function or a value: what follows it cannot be told statically


def _top_level(root: str, path: str, module: str) -> Dict[str, object]:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    pkg = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out: Dict[str, object] = {}
    for node in _module_level(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = "def"
            if node.name == "__getattr__":  # module-level __getattr__: the names it compares against are defined
                for n in ast.walk(node):
                    if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.isidentifier():
                        out.setdefault(n.value, "value")
        elif isinstance(node, ast.ClassDef):
            out[node.name] = _members(node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        out[n.id] = "value"
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(pkg, node.module, node.level)
            for a in node.names:
                sub = _is_module(root, base, a.name)
                out[a.asname or a.name] = (f"{base}.{a.name}", None) if sub else (base, a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                out[(a.asname or a.name).split(".")[0]] = (a.name if a.asname else a.name.split(".")[0], None)
    return out


def _module_level(body: List[ast.stmt]) -> Iterable[ast.stmt]:
    """Statements at module level, looking into ``if`` / ``try`` blocks."""
    for node in body:
        if isinstance(node, ast.If):
            yield from _module_level(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            yield from _module_level(node.body + node.orelse + node.finalbody
                                     + [s for h in node.handlers for s in h.body])
        else:
            yield node


def _members(cls: ast.ClassDef) -> Set[str]:
    names: Set[str] = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if node.name == "__init__" and not isinstance(node, ast.ClassDef):
                for n in ast.walk(node):  # self.x = ... in __init__
                    if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
                        names.add(n.attr)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def _absolute(pkg: str, module: Optional[str], level: int) -> str:
    if level == 0:
        return module or ""
    parts = pkg.split(".")
    base = ".".join(parts[: len(parts) - (level - 1)]) if level > 1 else pkg
    return f"{base}.{module}" if module else base


def _is_module(root: str, base: str, name: str) -> bool:
    p = os.path.join(root, *base.split("."), name)
    return os.path.exists(p + ".py") or os.path.exists(os.path.join(p, "__init__.py"))


def _repo_files(root: str) -> Tuple[Set[str], Set[str]]:
    """Every file (relative path) and every file name of the repository."""
    paths: Set[str] = set()
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in _SKIP_DIRS and not x.endswith(".egg-info")]
        for f in files:
            paths.add(os.path.relpath(os.path.join(d, f), root))
        for x in dirs:
            paths.add(os.path.relpath(os.path.join(d, x), root) + "/")
    names = {os.path.basename(p.rstrip("/")) for p in paths}
    return paths, names


def _spelled_names(root: str) -> Set[str]:
    """File names that the repository's code and scripts spell out (outputs they write, files they look for)."""
    names: Set[str] = set()
    for top in (PACKAGE, "benchmarks", "scripts", "examples"):  # not tests/: their literals are made-up names
        for d, dirs, files in os.walk(os.path.join(root, top)):
            dirs[:] = [x for x in dirs if x not in _SKIP_DIRS]
            for f in files:
                if f.endswith((".py", ".sh")) and f != "check_docs.py":
                    with open(os.path.join(d, f), encoding="utf-8", errors="replace") as fh:
                        names.update(_FILE.findall(fh.read()))
    return names


def _test_names(root: str) -> Set[str]:
    names: Set[str] = set()
    for d, dirs, files in os.walk(os.path.join(root, "tests")):
        dirs[:] = [x for x in dirs if x not in _SKIP_DIRS]
        for f in files:
            if not f.endswith(".py"):
                continue
            names.add(f[:-3])
            with open(os.path.join(d, f), encoding="utf-8") as fh:
                tree = ast.parse(fh.read())
            names.update(n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef)))
    return names


_SUBPATH_CACHE: Dict[frozenset, "re.Pattern[str]"] = {}


def _subpath_re(paths: Set[str]) -> "re.Pattern[str]":
    """``sub/…/name.py`` for every subpackage ``sub`` of the package (``attention/``, ``megatron/``, …)."""
    subs = frozenset(p.rstrip("/").rsplit("/", 1)[-1] for p in paths
                     if p.startswith(PACKAGE + "/") and p.endswith("/") and "__pycache__" not in p)
    if subs not in _SUBPATH_CACHE:
        alt = "|".join(sorted(re.escape(x) for x in subs)) or "(?!)"
        _SUBPATH_CACHE[subs] = re.compile(r"(?<![\w./-])((?:%s)/[\w/-]*\.py)\b" % alt)
    return _SUBPATH_CACHE[subs]


def _path_exists(p: str, paths: Set[str]) -> bool:
    p = p.rstrip(".,:;)")
    if p.endswith("/"):
        return p in paths
    if any(c in p for c in "*{<"):
        pattern = re.sub(r"<[^>]*>", "*", re.sub(r"\{[^}]*\}", "*", p))
        return any(fnmatch.fnmatch(q, pattern) for q in paths)
    return p in paths or p + "/" in paths


def check(root: str = ROOT, files: Optional[List[str]] = None) -> List[Stale]:
    """Every stale name or path in ``files`` (default: :func:`doc_files`)."""
    pkg = _Package(root)
    paths, names = _repo_files(root)
    names |= _spelled_names(root)
    tests = _test_names(root)
    out: List[Stale] = []
    for doc in files if files is not None else doc_files(root):
        with open(os.path.join(root, doc), encoding="utf-8") as f:
            lines = f.read().splitlines()
        for i, line in enumerate(lines, 1):
            out += _check_line(doc, i, line, pkg, paths, names, tests)
    return out


def _check_line(doc: str, i: int, line: str, pkg: _Package, paths: Set[str], names: Set[str],
                tests: Set[str]) -> List[Stale]:
    out: List[Stale] = []
    for m in _DOTTED.finditer(line):
        dotted = m.group(0)
        if not pkg.resolve(PACKAGE, dotted.split(".")[1:]):
            out.append(Stale(doc, i, "name", dotted))
    for m in _FROM_IMPORT.finditer(line):
        module = m.group(1)
        for name in (n.strip() for n in m.group(2).split(",")):
            name = name.split(" as ")[0].strip()
            if name and name.isidentifier() and not pkg.resolve(module, [name]):
                out.append(Stale(doc, i, "import", f"{module}.{name}"))
    for m in _PATH.finditer(line):
        p = m.group(1).rstrip(".,:;)")
        if p.count("/") == 0 or p.endswith("/...") or _OUTPUT_FLAG.search(line[:m.start()]):
            continue
        if not _path_exists(p, paths):
            out.append(Stale(doc, i, "path", p))
    for m in _subpath_re(paths).finditer(line):  # attention/_ring.py: a path inside the package, written short
        p = m.group(1)
        if not any(q == p or q.endswith("/" + p) for q in paths):
            out.append(Stale(doc, i, "path", p))
    for m in _FILE.finditer(line):
        if m.group(1) not in names:
            out.append(Stale(doc, i, "file", m.group(1)))
    for span in _CODE_SPAN.findall(line):
        for t in re.findall(r"\b(test_\w+)", span):
            if t not in tests:
                out.append(Stale(doc, i, "test", t))
    return out


def code_files(root: str = ROOT) -> List[str]:
    """The package's and the examples' Python files (docstrings, comments and messages name things too)."""
    out: List[str] = []
    for top in ("cpscope", "examples"):
        for d, dirs, files in os.walk(os.path.join(root, top)):
            dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS)
            out += sorted(os.path.relpath(os.path.join(d, f), root) for f in files if f.endswith(".py"))
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Names and paths in the prose that do not exist.")
    ap.add_argument("--code", action="store_true", help="also check cpscope/ and examples/ (docstrings, messages)")
    args = ap.parse_args(argv)
    files = doc_files() + (code_files() if args.code else [])
    stale = check(files=files)
    for s in stale:
        print(s)
    print(f"{len(stale)} stale name(s) or path(s) in {len(files)} file(s)")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
