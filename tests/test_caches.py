"""``cpscope.clear_caches()`` empties every cache cpscope keeps, and no cache can be added without it noticing.

Two halves:

* a scan of the package's source (``ast``): every function memo (``functools.lru_cache`` / ``functools.cache`` /
  ``_tensor_cache.lru``) and every module-level mutable container (dict, list, set, ``OrderedDict``, weak
  dictionaries) is either registered with ``clear_caches`` (``_tensor_cache.lru`` / ``register_clear``), declared
  **not a cache** below with the reason, or listed as **pending** (a cache in a wing another change owns, named so
  that its owner registers it and deletes the line). A new one in none of these lists fails the test, and so does a
  stale line (a name that no longer exists);
* a fill-and-clear check per registered cache: each is filled through its own code, seen non-empty, and seen empty
  after ``cpscope.clear_caches()``.
"""
from __future__ import annotations

import ast
import importlib
import json
import os
from pathlib import Path
from typing import Callable

import pytest
import torch

import cpscope
from cpscope import _tensor_cache

PACKAGE = Path(cpscope.__file__).parent

# Module-level state that is not a cache (clearing it would change behaviour, not just cost a rebuild).
NOT_CACHES = {
    "cpscope._tensor_cache._CLEARS": "the registry of clear functions itself",
    "cpscope._scope_binding._SCOPES": "interning: scope_for returns the same CPScope per live group (weak, self-cleaning)",
    "cpscope._scope_binding._CALLBACKS": "the dropping references of _SCOPES",
    "cpscope.streams._STREAMS": "the CP stream per device (contract: created once per device; work is queued on it)",
    "cpscope.groups.registry._USED": "names already used per world: a destroyed group's name must not come back",
    "cpscope.integrations._swap._CLASSES": "one swapped class per (base, mixins): identity (isinstance, pickle)",
    "cpscope.rope.api._compile_off": "memory of torch.compile failures per case (clearing repeats a failing compile)",
    "cpscope.integrations.hf.batch_scope._CUT_FOR": "which scope each batch tensor was sharded for (a check's state)",
    "cpscope.integrations.hf.trainer.hybrid_cp_trainer": "one trainer class per class: identity (isinstance)",
    "cpscope._sentinel.switch._STACK": "the sentinels switched on (state)",
    "cpscope._sentinel.switch._EMPTY": "a constant (slots all None)",
    "cpscope._sentinel.handshake._ROUNDS": "a handshake counter that every rank must keep in step (state)",
    "cpscope._sentinel.attention_numeric._SKIPPED": "a constant (figures of a skipped check)",
    "cpscope.attention.kernels.router._REFUSED": "memory of refused kernel routes (clearing repeats a failing build)",
    "cpscope.attention.kernels.cudnn_frontend._handles": "one cuDNN handle per device (a resource, like the stream)",
    "cpscope.integrations.megatron._moe._CHECKED": "which routers were checked per group (a check's state, weak)",
    "cpscope.integrations.megatron._moe._TP_CHECKED": "the same, per TP group",
}

# Caches in wings that other changes own: each still escapes clear_caches. Register it (``_tensor_cache.lru`` or
# ``register_clear``), add a filler to FILLERS, and delete its line here.
PENDING = {
    "cpscope.attention.agreement._CPU_OK": "agreement check: per-group backend probe (merged with the kernels wing)",
    "cpscope.attention.agreement._HOOKED": "agreement check: optimizer classes hooked for the step boundary",
    "cpscope.attention.kernels.flex._api": "flex route: FlexAttention import probe",
    "cpscope.attention.kernels.flex._compiled": "flex route: compiled functions (its own clear hook; to register)",
    "cpscope.attention.kernels.flex._dense_masks": "flex route: dense block masks (its own clear hook; to register)",
    "cpscope.attention.kernels.flex._score_mods": "flex route: softcap score modifiers",
    "cpscope.attention.allgather._keys_index": "attention wing: lru_cache of device index tensors",
    "cpscope.attention.allgather._block_varlen": "attention wing: lru_cache of device offsets (Varlen)",
    "cpscope.attention.ulysses._permutation": "attention wing: lru_cache of device permutations",
    "cpscope.attention.hierarchical._GROUPS": "attention wing: verified (inner, outer) group pairs",
    "cpscope.attention.kernels.cudnn_frontend.module": "attention wing: the cuDNN frontend module (import probe)",
    "cpscope.attention.kernels.cudnn_frontend._device_ok": "attention wing: whether a device runs cuDNN (probe)",
    "cpscope.attention._sink_kernels._jitted": "attention wing: Triton kernels (compile memo)",
    "cpscope.attention.merge._kernels": "attention wing: Triton kernels (compile memo)",
    "cpscope.rope._kernel._kernel": "rope: Triton kernel (compile memo)",
    "cpscope._sentinel.core._compiler_disabled": "sentinel: torch.compile-disabled wrappers per function",
    "cpscope.linear._fla.available": "linear: whether flash-linear-attention is installed",
    "cpscope.integrations.hf.mixers._VERDICTS": "hf: verdicts on models' mixers per model",
}

# Containers emptied by a function registered with register_clear: container -> that function.
CLEARED_BY = {
    "cpscope.attention.kernels.cudnn_frontend._graphs": "cpscope.attention.kernels.cudnn_frontend.clear_cache",
    "cpscope.attention.kernels.cudnn_frontend._kernel_caches": "cpscope.attention.kernels.cudnn_frontend.clear_cache",
    "cpscope.attention.kernels.cudnn_frontend._static": "cpscope.attention.kernels.cudnn_frontend.clear_cache",
    "cpscope.attention.kernels.cudnn_dense._consts": "cpscope.attention.kernels.cudnn_dense.clear_constants",
}

_MEMO_DECORATORS = {"lru_cache", "cache"}
_CONTAINERS = {"dict", "list", "set", "OrderedDict", "defaultdict", "deque", "WeakKeyDictionary",
               "WeakValueDictionary", "WeakIdKeyDictionary", "WeakSet"}


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append((".".join(parts), path))
    return out


def _decorator_name(d: ast.expr) -> tuple[str, str]:
    """(kind, name): kind ``"registered"`` for ``lru(...)`` / ``_tensor_cache.lru(...)``, ``"bare"`` for
    ``functools.lru_cache`` / ``functools.cache`` (called or not), else ``""``."""
    f = d.func if isinstance(d, ast.Call) else d
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    if name == "lru":
        return "registered", name
    if name in _MEMO_DECORATORS:
        return "bare", name
    return "", name


def _is_container(v: ast.expr) -> bool:
    if isinstance(v, ast.Dict) and not v.keys or isinstance(v, (ast.List, ast.Set)) and not v.elts:
        return True
    if isinstance(v, ast.Call):
        f = v.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if name == "fromkeys" or name in _CONTAINERS:
            return True
    return False


def scan() -> dict[str, str]:
    """Every memo and module-level container of the package: qualified name -> ``"registered"`` / ``"bare"`` /
    ``"container"``."""
    found: dict[str, str] = {}
    for mod, path in _modules():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for d in node.decorator_list:
                    kind, _ = _decorator_name(d)
                    if kind:
                        found[f"{mod}.{node.name}"] = kind
        for node in tree.body:
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            for t in targets:
                if isinstance(t, ast.Name) and t.id != "__all__" and _is_container(value):
                    found[f"{mod}.{t.id}"] = "container"
    return found


def _fill_comm_cost_load(tmp_path: Path) -> Callable[[], int]:
    from cpscope.hybrid.comm_cost import CommCostModel
    from cpscope.train import auto

    c = (1.0, 0.0, 0.0, 0.0, 0.0)
    path = CommCostModel({"float32": {"p2p": c}}).save(tmp_path / "model.json")
    model = auto._load(str(path), os.stat(path).st_mtime_ns)
    assert json.loads(path.read_text())  # the file the cache holds a model of
    assert model.to_json() == CommCostModel.load(path).to_json()
    return lambda: auto._load.cache_info().currsize


def _fill_tensor_cache(tmp_path: Path) -> Callable[[], int]:
    cpscope.zigzag_indices(torch.tensor([0, 8, 16], dtype=torch.int32), 2, 0)  # per-tensor: host copy, pack
    cpscope.zigzag_indices([0, 4, 8], 2, 1)  # per value
    return lambda: sum(_tensor_cache.stats().values())


# Registered caches: how to fill each through its own code, and how full it is (0 = empty).
FILLERS: dict[str, Callable[[Path], Callable[[], int]]] = {
    "cpscope._tensor_cache._BY_TENSOR": _fill_tensor_cache,
    "cpscope._tensor_cache._BY_VALUE": _fill_tensor_cache,
    "cpscope.train.auto._load": _fill_comm_cost_load,
}


def test_every_cache_is_registered_declared_or_pending():
    found = scan()
    unknown = sorted(q for q, kind in found.items()
                     if q not in NOT_CACHES and q not in PENDING and q not in FILLERS and q not in CLEARED_BY)
    assert not unknown, (
        f"caches that cpscope.clear_caches() cannot reach: {unknown}; memoise with cpscope._tensor_cache.lru "
        "(or register_clear) and add a filler to FILLERS, or declare why it is not a cache in NOT_CACHES")
    bare_registered = sorted(q for q in FILLERS if found.get(q) == "bare")
    assert not bare_registered, f"a bare functools.lru_cache is not registered with clear_caches: {bare_registered}"
    stale = sorted(q for q in [*NOT_CACHES, *PENDING, *FILLERS, *CLEARED_BY] if q not in found)
    assert not stale, f"listed but no longer in the package (delete the line): {stale}"


def test_scan_sees_a_new_bare_cache(tmp_path):
    """The scan is not blind: a bare lru_cache, a module-level dict and a registered memo are each seen."""
    src = ("import functools\nfrom cpscope._tensor_cache import lru\n_SEEN = {}\n@functools.lru_cache(maxsize=4)\n"
           "def f(x):\n    return x\n@lru(maxsize=4)\ndef g(x):\n    return x\n")
    tree = ast.parse(src)
    decorated = {n.name: _decorator_name(n.decorator_list[0])[0] for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert decorated == {"f": "bare", "g": "registered"}
    assert _is_container(tree.body[2].value)


@pytest.mark.parametrize("qualified", sorted(FILLERS))
def test_clear_caches_empties_each_registered_cache(qualified, tmp_path):
    cpscope.clear_caches()
    size = FILLERS[qualified](tmp_path)
    assert size() > 0, f"{qualified}: filling it cached nothing"
    cpscope.clear_caches()
    assert size() == 0, f"{qualified}: cpscope.clear_caches() left {size()} entries"


@pytest.mark.parametrize("qualified", sorted(CLEARED_BY))
def test_clear_caches_empties_containers_of_registered_clears(qualified):
    """A container with its own clear function: the function is registered, and clear_caches empties it."""
    mod, _, name = qualified.rpartition(".")
    container = getattr(importlib.import_module(mod), name)
    fmod, _, fname = CLEARED_BY[qualified].rpartition(".")
    assert getattr(importlib.import_module(fmod), fname) in _tensor_cache.registered()
    container[("test_caches", "entry")] = object()  # an entry as the code would make it (CPU: no graph to build)
    cpscope.clear_caches()
    assert len(container) == 0


def test_every_registered_memo_is_cleared_by_clear_caches():
    """Each ``_tensor_cache.lru`` memo of the package is in the registry that clear_caches calls."""
    for qualified, kind in scan().items():
        if kind != "registered":
            continue
        mod, _, name = qualified.rpartition(".")
        fn = getattr(importlib.import_module(mod), name)
        assert fn.cache_clear in _tensor_cache.registered(), qualified


def test_lru_is_a_registered_lru_cache():
    calls: list[int] = []

    @_tensor_cache.lru(maxsize=2)
    def twice(x: int) -> int:
        calls.append(x)
        return 2 * x

    try:
        assert twice(3) == 6 and twice(3) == 6 and calls == [3]
        cpscope.clear_caches()
        assert twice.cache_info().currsize == 0 and twice(3) == 6 and calls == [3, 3]
    finally:
        _tensor_cache._CLEARS.remove(twice.cache_clear)
