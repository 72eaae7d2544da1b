#!/usr/bin/env python3
"""cpscope's public surface, read from the source: public modules, their ``__all__``, and the counts.

A module is *public* when no part of its dotted name starts with an underscore (``cpscope.attention._ring`` is,
``cpscope.attention._kernels`` and everything under ``cpscope._sentinel`` are not). A public module's *public names*
are its ``__all__``; a public module without ``__all__`` exports every module-level name without a leading underscore
(what ``from m import *`` would take) and is listed as lacking it. Also counted: *private names imported across
modules* — ``from cpscope.m import _x`` (``_x`` not a submodule) and ``m._x`` through a name bound to a cpscope
module — the same rule as ``scripts/check_layout.py`` (which this script reuses).

Nothing is imported or run (:mod:`ast` only), so the optional integrations need not be installed.

Usage::

    python scripts/public_api.py            # every public module with its names, then the counts
    python scripts/public_api.py --counts   # the counts only
    python scripts/public_api.py --json     # the same as JSON

Counts (issue 30), measured with this script: at 359f37c (``BEFORE``) 84 public modules, 418 public names (300
distinct), 3 public modules without ``__all__``, 51 private names used across modules. After the clean-up outside
``attention/`` (w-house, merged with main at a63da91): 85 modules, 423 names (313 distinct; ``attention/`` alone grew
from 15 modules / 70 names to 25 / 132 in that merge, the rest shrank from 69 / 348 to 60 / 291), 0 modules without
``__all__``, 20 private names used across modules. Before the internal modules were underscored (9280cd2): 91
modules, 487 names (362 distinct), 14 private names used across modules; after (branch w-surface): 20 public modules
— the facades ``cpscope``, ``attention``, ``groups``, ``hybrid``, ``linear``, ``rope``, ``train``, ``cli``, ``scope``,
``sharding``, ``recompute``, ``streams``, ``microbatch``, ``backward_check``, ``integrations`` (``hf``,
``hf.trainer``, ``hf_trainer``, ``megatron``, ``te``) — 155 names, 110 distinct, 14 private names used across
modules. ``--counts`` gives today's figures.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import sys
from typing import Optional

__all__ = ["PublicModule", "public_modules", "counts", "BEFORE"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "cpscope"

#: The counts measured before issue 30's clean-up (commit 359f37c), kept for comparison.
BEFORE = {"public_modules": 84, "public_names": 418, "distinct_public_names": 300, "modules_without_all": 3,
          "private_names_across_modules": 51}


class PublicModule:
    """One public module: its dotted name, path, its public names and whether they come from ``__all__``."""

    def __init__(self, name: str, path: str, names: list[str], has_all: bool) -> None:
        self.name, self.path, self.names, self.has_all = name, path, names, has_all

    def as_dict(self) -> dict:
        return {"module": self.name, "path": self.path, "names": self.names, "has_all": self.has_all}


def _module_name(rel: str) -> str:
    parts = rel[:-3].split(os.sep)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _literal_all(tree: ast.Module) -> Optional[list[str]]:
    names: Optional[list[str]] = None
    for node in tree.body:
        targets = []
        if isinstance(node, ast.Assign):
            targets = [t for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
            targets = [node.target]
        if not any(t.id == "__all__" for t in targets):
            continue
        try:
            value = ast.literal_eval(node.value)
        except ValueError:
            continue
        names = (names or []) + list(value) if isinstance(node, ast.AugAssign) else list(value)
    return names


def _star_names(tree: ast.Module) -> list[str]:
    """The module-level names without a leading underscore (what ``import *`` takes without ``__all__``)."""
    out: list[str] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append(node.name)
        elif isinstance(node, ast.Assign):
            out += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.append(node.target.id)
        elif isinstance(node, ast.ImportFrom):
            out += [(a.asname or a.name) for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Import):
            out += [(a.asname or a.name).split(".")[0] for a in node.names]
    return sorted({n for n in out if not n.startswith("_")})


def public_modules(root: str = ROOT) -> list[PublicModule]:
    """Every public module of the package, sorted by name."""
    out = []
    base = os.path.join(root, PACKAGE)
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(("_", ".")))
        for fn in sorted(filenames):
            if not fn.endswith(".py") or (fn.startswith("_") and fn != "__init__.py"):
                continue
            path = os.path.join(dirpath, fn)
            rel = os.path.relpath(path, root)
            name = _module_name(rel)
            if name.endswith("__main__"):
                continue
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), filename=rel)
            names = _literal_all(tree)
            out.append(PublicModule(name, rel, sorted(names) if names is not None else _star_names(tree),
                                    names is not None))
    return sorted(out, key=lambda m: m.name)


def _private_across(root: str) -> int:
    sys.path.insert(0, os.path.join(root, "scripts"))
    try:
        import check_layout  # the same rule as the layout check
    finally:
        sys.path.pop(0)
    layout = check_layout.analyse(root)
    return len(layout.private_uses)


def counts(root: str = ROOT) -> dict:
    """``public_modules``, ``public_names`` (the sum over modules), ``distinct_public_names``,
    ``modules_without_all``, ``package_all`` (``len(cpscope.__all__)``) and ``private_names_across_modules``."""
    mods = public_modules(root)
    return {
        "public_modules": len(mods),
        "public_names": sum(len(m.names) for m in mods),
        "distinct_public_names": len({n for m in mods for n in m.names}),
        "modules_without_all": sorted(m.name for m in mods if not m.has_all),
        "package_all": next((len(m.names) for m in mods if m.name == PACKAGE), 0),
        "private_names_across_modules": _private_across(root),
    }


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--counts", action="store_true", help="print the counts only")
    p.add_argument("--json", action="store_true", help="print JSON")
    args = p.parse_args(argv)
    mods, c = public_modules(), counts()
    if args.json:
        print(json.dumps({"modules": [m.as_dict() for m in mods], "counts": c, "before": BEFORE}, indent=1))
        return 0
    if not args.counts:
        for m in mods:
            flag = "" if m.has_all else "   (no __all__)"
            print(f"{m.name} [{len(m.names)}]{flag}")
            for n in m.names:
                print(f"    {n}")
    print(f"public modules: {c['public_modules']} (before: {BEFORE['public_modules']})")
    print(f"public names: {c['public_names']} (before: {BEFORE['public_names']}); distinct: "
          f"{c['distinct_public_names']}; cpscope.__all__: {c['package_all']}")
    print(f"public modules without __all__: {len(c['modules_without_all'])} {c['modules_without_all']} "
          f"(before: {BEFORE['modules_without_all']})")
    print(f"private names used across modules: {c['private_names_across_modules']} "
          f"(before: {BEFORE['private_names_across_modules']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
