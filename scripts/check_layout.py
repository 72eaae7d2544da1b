#!/usr/bin/env python3
"""The package's layout, drawn from its own imports: rooms, floors, cycles, sizes, repeated blocks, private names.

Reads every ``.py`` file under ``cpscope/`` with :mod:`ast` (nothing is imported or run; standard library only) and
reports:

* **rooms** — the top-level modules and the subpackages of ``cpscope`` (a subpackage counts as one room; the
  package's own ``__init__.py`` is the room ``cpscope``), and the import graph between them;
* **cycles** — strongly connected components of the module graph and of the room graph;
* **floors** — the longest-path layering of the room graph: a room that imports no other room is on floor 0, any
  other one floor above the highest room it imports. Inside a cycle there is no such order; a small set of
  edges (the *arrows up*, found with Eades–Lin–Smyth's greedy ordering) is left out to make the graph acyclic, and
  each of them points from a room to one on the same or a higher floor;
* **sizes** — files over 500 lines and functions (methods, nested functions) over 80 lines;
* **repeated blocks** — runs of at least 6 consecutive lines that occur more than once inside ``cpscope/``, after
  normalising (comments, docstrings, import statements and blank lines dropped, whitespace collapsed);
* **private names** — ``from cpscope.m import _x`` (``_x`` not a submodule) and ``m._x`` through a name bound to
  a cpscope module, split into "inside one subpackage" and "across rooms".

Every import counts, wherever it stands: module level, inside functions (lazy imports), under ``if TYPE_CHECKING:``
(a type is a dependency too) and ``importlib.import_module("cpscope....")`` with a literal name. Importing
``cpscope.a.b`` is an edge to ``cpscope.a.b`` only (not to the package ``cpscope.a`` that Python runs first).

Usage::

    python scripts/check_layout.py            # readable report
    python scripts/check_layout.py --json     # the same as JSON
    python scripts/check_layout.py --check    # exit 1 if a goal fails (no cycle, <= 9 floors, no file > 500
                                              # lines, no function > 80 lines, no repeated block, no private
                                              # name imported across rooms)
"""
from __future__ import annotations

import argparse
import ast
import io
import json
import os
import sys
import tokenize
from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional

__all__ = [
    "Layout", "analyse", "goals", "report", "MAX_FLOORS", "MAX_FILE_LINES", "MAX_FUNCTION_LINES", "MIN_BLOCK_LINES",
]

MAX_FLOORS = 9
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
MIN_BLOCK_LINES = 6
PACKAGE = "cpscope"

# The target layering (floor of each room; imports point down). Informative: rooms not listed are "unplaced".
TARGET_FLOORS = {
    "_variants": 0, "_hooks": 0, "backward_check": 0, "_checks": 0, "_contextlib": 0, "_version": 0, "hybrid": 0,
    "scope": 1, "_scope_binding": 1,
    "_pack": 2, "_tensor_cache": 2, "groups": 2, "streams": 2,
    "sharding": 3, "_padding": 3, "recompute": 3, "microbatch": 3,
    "attention": 4, "rope": 4,
    "train": 5,
    "_sentinel": 6,
    "integrations": 7,
    PACKAGE: 8,
}


@dataclass
class Module:
    name: str  # dotted, e.g. cpscope.attention._ring
    path: str  # relative to the repository root
    room: str  # e.g. "attention" (a subpackage), "scope" (a top-level module), "cpscope" (the package __init__)
    lines: int
    is_package: bool


@dataclass
class Import:
    importer: str
    target: str  # the cpscope module imported
    line: int
    names: list[str] = field(default_factory=list)  # for `from target import a, b`


@dataclass
class PrivateUse:
    importer: str
    module: str
    name: str
    line: int
    how: str  # "import" (from m import _x) or "attribute" (m._x)
    scope: str  # "same room" or "across rooms"


@dataclass
class Layout:
    """Everything :func:`analyse` found; :func:`goals` turns it into pass/fail."""

    root: str
    modules: dict[str, Module]
    imports: list[Import]
    module_edges: dict[str, list[str]]
    room_edges: dict[str, list[str]]
    module_cycles: list[list[str]]
    room_cycles: list[list[str]]
    floors: dict[str, int]
    arrows_up: list[tuple[str, str]]
    against_target: list[tuple[str, str]]
    long_files: list[tuple[str, int]]
    long_functions: list[tuple[str, int, str, int]]  # path, line, qualified name, lines
    repeated_blocks: list[list[tuple[str, int, int]]]  # each: occurrences (path, first line, last line)
    private_uses: list[PrivateUse]
    private_modules_across_rooms: list[tuple[str, str, int]]

    @property
    def n_floors(self) -> int:
        return max(self.floors.values(), default=-1) + 1


# ---------------------------------------------------------------------------------------------------------------
# Reading the package
# ---------------------------------------------------------------------------------------------------------------

def _room_of(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else PACKAGE


def _discover(root: str) -> dict[str, Module]:
    """Every module of the package under ``root`` (the repository root)."""
    pkg_dir = os.path.join(root, PACKAGE)
    mods: dict[str, Module] = {}
    for dirpath, dirnames, filenames in os.walk(pkg_dir):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
        for fn in sorted(filenames):
            if not fn.endswith(".py"):
                continue
            path = os.path.join(dirpath, fn)
            rel = os.path.relpath(path, root)
            parts = rel[:-3].split(os.sep)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            name = ".".join(parts)
            with open(path, encoding="utf-8") as f:
                n_lines = len(f.read().splitlines())
            mods[name] = Module(name, rel, _room_of(name), n_lines, is_pkg)
    return mods


def _parse(root: str, mod: Module) -> ast.Module:
    with open(os.path.join(root, mod.path), encoding="utf-8") as f:
        return ast.parse(f.read(), filename=mod.path)


def _resolve_from(mod: Module, node: ast.ImportFrom) -> Optional[str]:
    """The absolute module of ``from X import ...`` (relative imports resolved against ``mod``)."""
    if node.level == 0:
        return node.module
    base = mod.name.split(".") if mod.is_package else mod.name.split(".")[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports_of(mod: Module, tree: ast.Module, mods: dict[str, Module]) -> list[Import]:
    out: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in mods:
                    out.append(Import(mod.name, a.name, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(mod, node)
            if base is None or not (base == PACKAGE or base.startswith(PACKAGE + ".")):
                continue
            plain = []
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in mods:  # `from cpscope.attention import ring`: the submodule
                    out.append(Import(mod.name, sub, node.lineno))
                else:
                    plain.append(a.name)
            if plain and base in mods:
                out.append(Import(mod.name, base, node.lineno, plain))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and node.args[0].value in mods):
            out.append(Import(mod.name, node.args[0].value, node.lineno))
    return out


def _module_aliases(mod: Module, tree: ast.Module, mods: dict[str, Module]) -> dict[str, str]:
    """Local names bound to cpscope modules in this file (``import cpscope.scope as sc``, ``from . import ring``)."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in mods and a.asname:
                    aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(mod, node)
            for a in node.names:
                if base and f"{base}.{a.name}" in mods:
                    aliases[a.asname or a.name] = f"{base}.{a.name}"
    return aliases


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_uses(mod: Module, tree: ast.Module, imports: list[Import], mods: dict[str, Module]) -> list[PrivateUse]:
    out = []

    def scope_of(target: str) -> str:
        return "same room" if mods[target].room == mod.room else "across rooms"

    for imp in imports:
        for n in imp.names:
            if _is_private(n):
                out.append(PrivateUse(mod.name, imp.target, n, imp.line, "import", scope_of(imp.target)))
    aliases = _module_aliases(mod, tree, mods)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _is_private(node.attr) and isinstance(node.value, ast.Name)
                and node.value.id in aliases):
            target = aliases[node.value.id]
            if target != mod.name and f"{target}.{node.attr}" not in mods:
                out.append(PrivateUse(mod.name, target, node.attr, node.lineno, "attribute", scope_of(target)))
    return out


def _long_functions(mod: Module, tree: ast.Module, limit: int) -> list[tuple[str, int, str, int]]:
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qual = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    n = child.end_lineno - child.lineno + 1
                    if n > limit:
                        out.append((mod.path, child.lineno, qual, n))
                visit(child, qual + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


# ---------------------------------------------------------------------------------------------------------------
# Graphs
# ---------------------------------------------------------------------------------------------------------------

def _sccs(nodes: Iterable[str], edges: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted; only those with more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                elif nxt in on_stack:
                    low[v] = min(low[v], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


def _greedy_order(nodes: list[str], edges: set[tuple[str, str]]) -> list[str]:
    """Eades–Lin–Smyth: an order (importers first) with few edges pointing backwards."""
    left = set(nodes)
    head: list[str] = []
    tail: list[str] = []

    def deg(v: str, out: bool) -> int:
        return sum(1 for a, b in edges if (a if out else b) == v and (b if out else a) in left and a != b)

    while left:
        changed = True
        while changed:
            changed = False
            for v in sorted(left):
                if deg(v, out=True) == 0:  # imports nothing left: goes to the bottom
                    tail.insert(0, v)
                    left.discard(v)
                    changed = True
                elif deg(v, out=False) == 0:  # imported by nothing left: goes to the top
                    head.append(v)
                    left.discard(v)
                    changed = True
        if left:
            v = max(sorted(left), key=lambda u: deg(u, True) - deg(u, False))
            head.append(v)
            left.discard(v)
    return head + tail


def _floors(rooms: list[str], edges: dict[str, list[str]]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Longest-path floors (0 = imports no room) after leaving out the arrows up of every cycle."""
    up: list[tuple[str, str]] = []
    for comp in _sccs(rooms, edges):
        members = set(comp)
        inner = {(a, b) for a in comp for b in edges.get(a, ()) if b in members}
        pos = {v: i for i, v in enumerate(_greedy_order(comp, inner))}
        up += sorted((a, b) for a, b in inner if pos[a] > pos[b])
    dropped = set(up)
    floor: dict[str, int] = {}

    def visit(v: str, seen: tuple[str, ...]) -> int:
        if v not in floor:
            below = [visit(w, seen + (v,)) for w in edges.get(v, ()) if (v, w) not in dropped and w not in seen]
            floor[v] = 1 + max(below) if below else 0
        return floor[v]

    for r in sorted(rooms):
        visit(r, ())
    return floor, up


def _repeated_blocks(root: str, mods: dict[str, Module], min_lines: int) -> list[list[tuple[str, int, int]]]:
    """Runs of >= ``min_lines`` normalised lines that occur in more than one place (non-overlapping)."""
    seqs: dict[str, list[tuple[int, str]]] = {}
    for mod in mods.values():
        seqs[mod.path] = _normalised_lines(os.path.join(root, mod.path))
    windows: dict[tuple[str, ...], list[tuple[str, int]]] = {}
    for path, seq in seqs.items():
        for i in range(len(seq) - min_lines + 1):
            windows.setdefault(tuple(t for _, t in seq[i:i + min_lines]), []).append((path, i))
    pairs = set()
    for occ in windows.values():
        for x in range(len(occ)):
            for y in range(x + 1, len(occ)):
                (pa, ia), (pb, ib) = occ[x], occ[y]
                if pa != pb or abs(ia - ib) >= min_lines:
                    pairs.add((pa, ia, pb, ib))
    groups: dict[tuple[str, ...], set[tuple[str, int, int]]] = {}
    for pa, ia, pb, ib in sorted(pairs):
        if (pa, ia - 1, pb, ib - 1) in pairs:
            continue  # not the start of a maximal run
        n = 0
        while (pa, ia + n, pb, ib + n) in pairs:
            n += 1
        length = n + min_lines - 1
        key = tuple(t for _, t in seqs[pa][ia:ia + length])
        for p, i in ((pa, ia), (pb, ib)):
            groups.setdefault(key, set()).add((p, seqs[p][i][0], seqs[p][i + length - 1][0]))
    blocks = [sorted(g) for g in groups.values()]
    # A run found inside a longer one (same places) is the same block: keep the longest.
    blocks.sort(key=lambda g: -max(b - a for _, a, b in g))
    kept: list[list[tuple[str, int, int]]] = []
    for g in blocks:
        if not any(all(any(p == q and a >= c and b <= d for q, c, d in h) for p, a, b in g) for h in kept):
            kept.append(g)
    return sorted(kept)


def _normalised_lines(path: str) -> list[tuple[int, str]]:
    """(line number, text) of the lines that count: no comments, docstrings, imports or blank lines."""
    with open(path, encoding="utf-8") as f:
        src = f.read()
    lines = src.splitlines()
    drop: set[int] = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Import, ast.ImportFrom)) or (
                isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value,
                                                                                                   str)):
            drop.update(range(node.lineno, node.end_lineno + 1))
    cut: dict[int, int] = {}  # line -> column where a comment starts
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            cut[tok.start[0]] = tok.start[1]
    out = []
    for no, text in enumerate(lines, 1):
        if no in drop:
            continue
        text = " ".join(text[: cut.get(no, len(text))].split())
        if text:
            out.append((no, text))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Analysis, goals, report
# ---------------------------------------------------------------------------------------------------------------

def analyse(root: Optional[str] = None) -> Layout:
    """Read the package under ``root`` (default: this repository) and measure its layout.

    Example::

        lay = analyse()
        print(lay.n_floors, lay.room_cycles)
    """
    root = os.path.abspath(root or os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    mods = _discover(root)
    imports: list[Import] = []
    private: list[PrivateUse] = []
    long_functions = []
    for mod in mods.values():
        tree = _parse(root, mod)
        mine = _imports_of(mod, tree, mods)
        imports += mine
        private += _private_uses(mod, tree, mine, mods)
        long_functions += _long_functions(mod, tree, MAX_FUNCTION_LINES)
    module_edges: dict[str, set[str]] = {m: set() for m in mods}
    room_edges: dict[str, set[str]] = {mods[m].room: set() for m in mods}
    private_modules = []
    for imp in imports:
        if imp.target == imp.importer:
            continue
        module_edges[imp.importer].add(imp.target)
        a, b = mods[imp.importer].room, mods[imp.target].room
        if a != b:
            room_edges[a].add(b)
            if any(_is_private(p) for p in imp.target.split(".")[2:]):
                private_modules.append((imp.importer, imp.target, imp.line))
    m_edges = {k: sorted(v) for k, v in module_edges.items()}
    r_edges = {k: sorted(v) for k, v in room_edges.items()}
    floors, up = _floors(list(r_edges), r_edges)
    against = sorted((a, b) for a, bs in r_edges.items() for b in bs
                     if a in TARGET_FLOORS and b in TARGET_FLOORS and TARGET_FLOORS[b] > TARGET_FLOORS[a])
    return Layout(
        root=root, modules=mods, imports=imports, module_edges=m_edges, room_edges=r_edges,
        module_cycles=_sccs(m_edges, m_edges), room_cycles=_sccs(r_edges, r_edges), floors=floors, arrows_up=up,
        against_target=against,
        long_files=sorted((m.path, m.lines) for m in mods.values() if m.lines > MAX_FILE_LINES),
        long_functions=sorted(long_functions), repeated_blocks=_repeated_blocks(root, mods, MIN_BLOCK_LINES),
        private_uses=sorted(private, key=lambda p: (p.importer, p.line, p.name)),
        private_modules_across_rooms=sorted(set(private_modules)),
    )


def goals(lay: Layout) -> dict[str, tuple[bool, str]]:
    """Each goal of the layout: (met, figure)."""
    across = [p for p in lay.private_uses if p.scope == "across rooms"]
    return {
        "no import cycle between modules": (not lay.module_cycles, f"{len(lay.module_cycles)} cycle(s)"),
        "no import cycle between rooms": (not lay.room_cycles, f"{len(lay.room_cycles)} cycle(s), "
                                                               f"{len(lay.arrows_up)} arrow(s) up"),
        f"at most {MAX_FLOORS} floors": (lay.n_floors <= MAX_FLOORS, f"{lay.n_floors} floors"),
        f"no file over {MAX_FILE_LINES} lines": (not lay.long_files, f"{len(lay.long_files)} file(s)"),
        f"no function over {MAX_FUNCTION_LINES} lines": (not lay.long_functions,
                                                         f"{len(lay.long_functions)} function(s)"),
        f"no repeated block of >= {MIN_BLOCK_LINES} lines": (not lay.repeated_blocks,
                                                             f"{len(lay.repeated_blocks)} block(s)"),
        "no private name imported across rooms": (not across, f"{len(across)} use(s)"),
    }


def _summary(lay: Layout) -> dict:
    priv = lay.private_uses
    return {
        "modules": len(lay.modules), "rooms": len(lay.room_edges), "floors": lay.n_floors,
        "module_cycles": len(lay.module_cycles), "room_cycles": len(lay.room_cycles),
        "arrows_up": len(lay.arrows_up), "room_edges_in_cycles": len(_edges_in_cycles(lay)),
        "files_over_limit": len(lay.long_files),
        "functions_over_limit": len(lay.long_functions), "repeated_blocks": len(lay.repeated_blocks),
        "private_names": len(priv),
        "private_names_same_room": sum(p.scope == "same room" for p in priv),
        "private_names_across_rooms": sum(p.scope == "across rooms" for p in priv),
        "private_names_imported": sum(p.how == "import" for p in priv),
        "private_names_as_attributes": sum(p.how == "attribute" for p in priv),
        "lines": sum(m.lines for m in lay.modules.values()),
    }


def to_json(lay: Layout) -> dict:
    return {
        "summary": _summary(lay),
        "goals": {k: {"met": ok, "figure": fig} for k, (ok, fig) in goals(lay).items()},
        "floors": lay.floors, "room_edges": lay.room_edges, "module_edges": lay.module_edges,
        "module_cycles": lay.module_cycles, "room_cycles": lay.room_cycles, "arrows_up": lay.arrows_up,
        "against_target_layering": lay.against_target,
        "long_files": lay.long_files, "long_functions": lay.long_functions,
        "repeated_blocks": lay.repeated_blocks, "private_uses": [asdict(p) for p in lay.private_uses],
        "private_modules_across_rooms": lay.private_modules_across_rooms,
    }


def _edges_in_cycles(lay: Layout) -> list[tuple[str, str]]:
    """Every room edge whose two ends sit in one cycle (the arrows up are a subset)."""
    comp = {r: i for i, c in enumerate(lay.room_cycles) for r in c}
    return sorted((a, b) for a, bs in lay.room_edges.items() for b in bs if a in comp and comp[a] == comp.get(b))


def _short(name: str) -> str:
    return name[len(PACKAGE) + 1:] if name.startswith(PACKAGE + ".") else name


def report(lay: Layout) -> str:
    """The readable report."""
    s = _summary(lay)
    out = [f"cpscope layout: {s['modules']} modules, {s['lines']} lines, {s['rooms']} rooms on {s['floors']} floors",
           "", "Rooms by floor (room -> rooms it imports; * = arrow up):"]
    up = set(lay.arrows_up)
    for f in range(lay.n_floors - 1, -1, -1):
        for r in sorted(x for x, v in lay.floors.items() if v == f):
            deps = ", ".join(("*" if (r, d) in up else "") + d for d in lay.room_edges[r]) or "-"
            out.append(f"  {f:2d}  {r:<20} -> {deps}")
    out += ["", f"Import cycles between modules: {len(lay.module_cycles)}"]
    out += ["  " + " <-> ".join(_short(m) for m in c) for c in lay.module_cycles]
    out += [f"Import cycles between rooms: {len(lay.room_cycles)}"]
    out += ["  " + " <-> ".join(c) for c in lay.room_cycles]
    out += [f"Room edges inside a cycle: {len(_edges_in_cycles(lay))}; arrows up (the fewest of them left out to "
            f"draw the floors): {len(lay.arrows_up)}"]
    for a, b in lay.arrows_up:
        why = sorted({f"{lay.modules[i.importer].path}:{i.line}" for i in lay.imports
                      if lay.modules[i.importer].room == a and lay.modules[i.target].room == b})
        out.append(f"  {a} -> {b}   ({', '.join(why)})")
    placed = set(TARGET_FLOORS)
    out += [f"Imports against the target layering (a room importing one on a higher target floor): "
            f"{len(lay.against_target)}"]
    out += [f"  {a} (L{TARGET_FLOORS[a]}) -> {b} (L{TARGET_FLOORS[b]})" for a, b in lay.against_target]
    unplaced = sorted(r for r in lay.room_edges if r not in placed)
    out += [f"Rooms not in the target layering: {len(unplaced)}" + (f" ({', '.join(unplaced)})" if unplaced else "")]
    out += ["", f"Files over {MAX_FILE_LINES} lines: {len(lay.long_files)}"]
    out += [f"  {p}: {n}" for p, n in lay.long_files]
    out += [f"Functions over {MAX_FUNCTION_LINES} lines: {len(lay.long_functions)}"]
    out += [f"  {p}:{line} {q}: {n}" for p, line, q, n in lay.long_functions]
    out += [f"Repeated blocks of >= {MIN_BLOCK_LINES} normalised lines: {len(lay.repeated_blocks)}"]
    out += ["  " + "  ==  ".join(f"{p}:{a}-{b}" for p, a, b in g) for g in lay.repeated_blocks]
    out += ["", f"Private names used across modules: {s['private_names']} ({s['private_names_imported']} imported, "
                f"{s['private_names_as_attributes']} as module attributes); inside one room "
                f"{s['private_names_same_room']}, across rooms {s['private_names_across_rooms']}"]
    for scope in ("across rooms", "same room"):
        out.append(f"  {scope}:")
        out += [f"    {lay.modules[p.importer].path}:{p.line} {_short(p.module)}.{p.name}" + (
            " (attribute)" if p.how == "attribute" else "") for p in lay.private_uses if p.scope == scope]
    out += [f"Private modules imported from another room: {len(lay.private_modules_across_rooms)}"]
    out += [f"  {_short(a)} -> {_short(b)} (line {n})" for a, b, n in lay.private_modules_across_rooms]
    out += ["", "Goals:"]
    out += [f"  [{'ok' if ok else 'FAIL'}] {k}: {fig}" for k, (ok, fig) in goals(lay).items()]
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", help="repository root (default: the one this script is in)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the report")
    ap.add_argument("--check", action="store_true", help="exit 1 if any goal fails")
    args = ap.parse_args(argv)
    lay = analyse(args.root)
    print(json.dumps(to_json(lay), indent=1) if args.json else report(lay))
    if args.check:
        failed = [k for k, (ok, _) in goals(lay).items() if not ok]
        if failed:
            print("layout goals not met: " + "; ".join(failed), file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
