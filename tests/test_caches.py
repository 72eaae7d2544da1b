"""``cpscope.clear_caches()`` empties every cache cpscope keeps, and no cache can be added without it noticing.

Two halves:

* a scan of the package's source (``ast``): every function memo (``functools.lru_cache`` / ``functools.cache`` /
  ``_tensor_cache.lru``), every module-level mutable container (dict, list, set, ``OrderedDict``, weak
  dictionaries) and every module-level name that a function rebinds (``global x``) is either registered with
  ``clear_caches`` (``_tensor_cache.lru`` / ``register_clear``), declared **not a cache** below with the reason, or
  declared a **process-constant probe** (an import or capability answer that cannot change while the process runs
  and holds nothing worth freeing). A new one in none of these lists fails the test, and so does a stale line (a name
  that no longer exists);
* a fill-and-clear check per registered cache: each is filled through its own code (group-keyed ones and the
  variants' device-tensor memos by real CP calls on a pool of gloo ranks), seen non-empty, and seen empty after
  ``cpscope.clear_caches()``. A registered cache without such a check fails the test too.
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
from tests.distributed import run_ranks

PACKAGE = Path(cpscope.__file__).parent

# Module-level state that is not a cache (clearing it would change behaviour, not just cost a rebuild).
NOT_CACHES = {
    "cpscope._tensor_cache._CLEARS": "the registry of clear functions itself",
    "cpscope._scope_binding._SCOPES": "interning: scope_for returns the same CPScope per live group (weak, self-cleaning)",
    "cpscope._scope_binding._CALLBACKS": "the dropping references of _SCOPES",
    "cpscope.streams._STREAMS": "the CP stream per device (contract: created once per device; work is queued on it)",
    "cpscope.groups._registry._USED": "names already used per world: a destroyed group's name must not come back",
    "cpscope.groups._registry._STATE": "the group registry (contract: groups are created once, collectively; a "
                                      "cleared registry would make new groups inside a forward)",
    "cpscope.groups._registry._LAST_REPORT": "the report of the last group creation (what it made, for users)",
    "cpscope.integrations._swap._CLASSES": "one swapped class per (base, mixins): identity (isinstance, pickle)",
    "cpscope.rope._torch_math._compile_off": "memory of torch.compile failures per case (clearing repeats a failing "
                                             "compile)",
    "cpscope.integrations.hf._batch_scope._CUT_FOR": "which scope each batch tensor was sharded for (a check's state)",
    "cpscope.integrations.hf.trainer.hybrid_cp_trainer": "one trainer class per class: identity (isinstance)",
    "cpscope._sentinel.core._STACK": "the sentinels switched on (state)",
    "cpscope._sentinel.core._EMPTY": "a constant (slots all None)",
    "cpscope._sentinel.agree._ROUNDS": "a handshake counter that every rank must keep in step (state)",
    "cpscope._sentinel.attention_numeric._SKIPPED": "a constant (figures of a skipped check)",
    "cpscope.attention._kernels.router._REFUSED": "memory of refused kernel routes (clearing repeats a failing build)",
    "cpscope.attention._kernels.cudnn_frontend._handles": "one cuDNN handle per device (a resource, like the stream)",
    "cpscope.attention._agreement._HOOKED": "the handle of the one optimizer pre-hook (clearing would register a "
                                           "second hook: every step would read the verdicts twice)",
    "cpscope.attention._policy._policy": "the kernel policy that set_kernel_policy set (a setting)",
    "cpscope.attention._dispatch._chooser": "the variant chooser that was installed (a setting)",
    "cpscope.backward_check._switch": "whether the backward read check is on (a setting)",
    "cpscope.backward_check._allowances": "the backward read check's allowances (a setting)",
    "cpscope.backward_check._checking": "the backward read check's state",
    "cpscope.scope._build_time": "the build-time CP group (a setting)",
    "cpscope.integrations.megatron._moe._CHECKED": "which routers were checked per group (a check's state, weak)",
    "cpscope.integrations.megatron._moe._TP_CHECKED": "the same, per TP group",
    "cpscope.linear._fla._LOGGED": "the fla refusals already warned about (a log-once set of strings)",
}

# Memos of an import or a capability probe: the answer cannot change while the process runs (an installed module,
# a device's compute capability and cuDNN version) and holds nothing worth freeing (a module object, a bool).
PROBES = {
    "cpscope.attention._kernels.flex._api": "whether this torch has FlexAttention: its functions, imported once",
    "cpscope.attention._kernels.cudnn_frontend.module": "the cudnn module if importable (sys.modules holds it anyway)",
    "cpscope.attention._kernels.cudnn_frontend._device_ok": "a device's compute capability and the cuDNN version",
    "cpscope.linear._fla.available": "whether flash-linear-attention is installed (importlib.util.find_spec)",
    "cpscope.linear._fla.gated_backward_refusal": "whether fla refuses its gated backward: a pure function of the GPU's "
                                                  "capability, Triton's version and tilelang's presence (strings)",
    "cpscope.rope._te._available": "TransformerEngine's apply_rotary_pos_emb if importable (a function object)",
}

# Containers and rebound names emptied by a function registered with register_clear: name -> that function.
CLEARED_BY = {
    "cpscope.attention._kernels.cudnn_frontend._graphs": "cpscope.attention._kernels.cudnn_frontend.clear_cache",
    "cpscope.attention._kernels.cudnn_dense._consts": "cpscope.attention._kernels.cudnn_dense.clear_constants",
    "cpscope.attention._kernels.deferral._seen": "cpscope.attention._kernels.deferral.clear_seen",
    "cpscope.attention._kernels.flex._compiled": "cpscope.attention._kernels.flex.clear_cache",
    "cpscope.attention._kernels.flex._dense_masks": "cpscope.attention._kernels.flex.clear_cache",
    "cpscope.attention._kernels.flex._score_mods": "cpscope.attention._kernels.flex.clear_cache",
    "cpscope.attention._hierarchical._GROUPS": "cpscope.attention._hierarchical._forget_verified",
    "cpscope.attention._agreement._CPU_OK": "cpscope.attention._agreement._forget_transports",
    "cpscope.integrations.hf._mixers._VERDICTS": "cpscope.integrations.hf._mixers._forget_verdicts",
    "cpscope.rope._torch_math._compiled": "cpscope.rope._torch_math._forget_compiled",
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


def _scan_tree(mod: str, tree: ast.Module, found: dict[str, str]) -> None:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in node.decorator_list:
                kind, _ = _decorator_name(d)
                if kind:
                    found[f"{mod}.{node.name}"] = kind
        elif isinstance(node, ast.Global):  # module state a function rebinds (a lazy value, a setting)
            for name in node.names:
                found.setdefault(f"{mod}.{name}", "global")
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


def scan() -> dict[str, str]:
    """Every memo, module-level container and rebound module-level name of the package: qualified name ->
    ``"registered"`` / ``"bare"`` / ``"container"`` / ``"global"``."""
    found: dict[str, str] = {}
    for mod, path in _modules():
        _scan_tree(mod, ast.parse(path.read_text(encoding="utf-8")), found)
    return found


def _get(qualified: str):
    mod, _, name = qualified.rpartition(".")
    return getattr(importlib.import_module(mod), name)


# ---- fillers: each fills one registered cache through its own code and returns how full it is (0 = empty) ----------

def _fill_comm_cost_load(tmp_path: Path, monkeypatch) -> Callable[[], int]:
    from cpscope.hybrid._comm_cost import CommCostModel
    from cpscope.train import _auto as auto

    c = (1.0, 0.0, 0.0, 0.0, 0.0)
    path = CommCostModel({"float32": {"p2p": c}}).save(tmp_path / "model.json")
    model = auto._load(str(path), os.stat(path).st_mtime_ns)
    assert json.loads(path.read_text())  # the file the cache holds a model of
    assert model.to_json() == CommCostModel.load(path).to_json()
    return lambda: auto._load.cache_info().currsize


def _fill_tensor_cache(tmp_path: Path, monkeypatch) -> Callable[[], int]:
    cpscope.zigzag_indices(torch.tensor([0, 8, 16], dtype=torch.int32), 2, 0)  # per-tensor: host copy, pack
    cpscope.zigzag_indices([0, 4, 8], 2, 1)  # per value
    return lambda: sum(_tensor_cache.stats().values())


def _fake_cudnn(monkeypatch):
    from cpscope.attention._kernels import cudnn_frontend as fe
    from tests.attention._fake_cudnn import fake_cudnn

    cudnn = fake_cudnn()
    monkeypatch.setattr(fe, "module", lambda: cudnn)
    monkeypatch.setattr(fe, "stream", lambda device: 0)
    monkeypatch.setattr(fe, "handle", lambda device: object())
    monkeypatch.setattr(fe, "available", lambda device: True)


def _fill_cudnn(tmp_path: Path, monkeypatch) -> Callable[[], int]:
    """A dense block on the fake frontend: a graph, and the padding mask's length tensors (a left bound with more
    query rows than keys)."""
    from cpscope.attention._kernels import cudnn_dense, cudnn_frontend as fe

    _fake_cudnn(monkeypatch)
    q = torch.randn(1, 32, 4, 16).bfloat16()
    k, v = (torch.randn(1, 16, 2, 16).bfloat16() for _ in range(2))
    cudnn_dense.forward(q, k, v, scale=0.25, causal=False, window=(7, 7))
    assert fe._graphs and cudnn_dense._consts  # both filled
    return lambda: len(fe._graphs) + len(cudnn_dense._consts)


def _fill_deferral(tmp_path: Path, monkeypatch) -> Callable[[], int]:
    """A packed graph key seen once with deferred builds (``KernelPolicy.defer_builds``): remembered, not built."""
    from cpscope.attention._kernels import Varlen, cudnn_frontend as fe, cudnn_thd, deferral

    _fake_cudnn(monkeypatch)
    q = torch.randn(16, 2, 8).bfloat16()
    cu = torch.tensor([0, 6, 16], dtype=torch.int32)
    with pytest.raises(deferral.BuildDeferred):  # what the router asks under the policy's defer_builds
        cudnn_thd.forward(q, q, q, Varlen(cu, cu, 10, 10, (0, 6, 16), (0, 6, 16)), scale=0.3, causal=True,
                          defer=True)
    assert deferral._seen and not fe._graphs
    return lambda: len(deferral._seen)


def _fill_flex(tmp_path: Path, monkeypatch) -> Callable[[], int]:
    """A dense softcapped block through FlexAttention's eager CPU math (a block mask, a score modifier) and the
    compiled function of a CUDA configuration (made, not run: torch.compile is lazy)."""
    from cpscope.attention._kernels import flex

    if not flex.available():
        pytest.skip("this torch has no FlexAttention")
    q, k, v = (torch.randn(1, 24, 2, 16) for _ in range(3))
    flex.forward(q, k, v, 0.25, True, None, window=(7, 0), softcap=20.0)
    flex._compiled_for((torch.device("cuda", 0), torch.bfloat16, 2, 2, 16, 16, 0.25, 20.0, False))
    assert flex._dense_masks and flex._score_mods and flex._compiled  # all three filled
    return lambda: len(flex._dense_masks) + len(flex._score_mods) + len(flex._compiled)


def _fill_mixers(tmp_path: Path, monkeypatch) -> Callable[[], int]:
    pytest.importorskip("transformers")
    from cpscope.integrations.hf import _mixers as mixers

    class Config:  # weakly referenceable, like transformers' configs
        layer_types = ["full_attention", "linear_attention"]

    config = Config()
    with pytest.raises(ValueError, match="linear_attention"):
        mixers.refuse_unbound_mixers(object(), 2, config)
    return lambda: sum(ref() is config for ref, _ in mixers._VERDICTS.values())  # (keeps config, and its entry, alive)


def _fill_rope_compiled(tmp_path: Path, monkeypatch) -> Callable[[], int]:
    """The compiled RoPE path, with the compiler stood in for (a real compile costs tens of seconds on a CPU)."""
    from cpscope.rope import _torch_math

    monkeypatch.setattr(_torch_math, "_compile_off", set())
    monkeypatch.setattr(_torch_math, "_compile", lambda fn: fn)
    t = torch.randn(1, 8, 2, 16)
    cpscope.apply_rotary_pos_emb(t, cpscope.rotary_freqs(16, 8), qkv_format="bshd", group=None, impl="compiled")
    return lambda: int(_torch_math._compiled is not None)


def _fill_owned(tmp_path: Path, monkeypatch) -> Callable[[], int]:
    """Caches kept on modules (``_tensor_cache.owned``): ``cpscope.RotaryEmbedding``'s table and the Megatron RoPE
    adapter's angle table and process-group collection (on stand-ins with the attributes its mixins read: no
    megatron-core needed)."""
    import types

    from cpscope.integrations.megatron import _rope

    class Rotary(_rope.RotaryTableMixin, torch.nn.Module):
        rotary_interleaved = False

        def __init__(self) -> None:
            super().__init__()
            self.inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)

        def get_freqs_non_repeated(self, n: int, offset: int = 0) -> torch.Tensor:
            return torch.outer(torch.arange(n, dtype=torch.float32) + offset, self.inv_freq)

    class Attention(_rope.AttentionRopeMixin, torch.nn.Module):
        pass

    rope, rotary, attention = cpscope.RotaryEmbedding(8), Rotary(), Attention()
    assert rope(16).shape == rotary(16).shape == (16, 1, 1, 8)
    attention._cpscope_collection(cpscope.capture_scope(), types.SimpleNamespace(cp=None))
    held = [(rope, "_tables"), (rotary, "_cpscope_tables"), (attention, "_cpscope_collections")]
    assert all(m.__dict__[name] for m, name in held)  # every one filled
    return lambda: sum(len(m.__dict__[name]) for m, name in held)


def _fill_sentinel_wrapper(tmp_path: Path, monkeypatch) -> Callable[[], int]:
    from cpscope._sentinel import core

    core._compiler_disabled(core.checked_attention)  # what _outside_graph makes under torch.compile
    return lambda: core._compiler_disabled.cache_info().currsize


def _fill_triton(qualified: str) -> Callable[[Path, object], Callable[[], int]]:
    """A Triton kernel memo: its jitted functions defined (None without Triton: still a cached answer)."""
    def fill(tmp_path: Path, monkeypatch) -> Callable[[], int]:
        fn = _get(qualified)
        fn()
        return lambda: fn.cache_info().currsize
    return fill


# Registered caches filled in this process: how to fill each through its own code, and how full it is (0 = empty).
FILLERS: dict[str, Callable[[Path, object], Callable[[], int]]] = {
    "cpscope._tensor_cache._BY_TENSOR": _fill_tensor_cache,
    "cpscope._tensor_cache._BY_VALUE": _fill_tensor_cache,
    "cpscope.train._auto._load": _fill_comm_cost_load,
    "cpscope.attention._kernels.cudnn_frontend._graphs": _fill_cudnn,
    "cpscope.attention._kernels.cudnn_dense._consts": _fill_cudnn,
    "cpscope.attention._kernels.deferral._seen": _fill_deferral,
    "cpscope.attention._kernels.flex._compiled": _fill_flex,
    "cpscope.attention._kernels.flex._dense_masks": _fill_flex,
    "cpscope.attention._kernels.flex._score_mods": _fill_flex,
    "cpscope.integrations.hf._mixers._VERDICTS": _fill_mixers,
    "cpscope.rope._torch_math._compiled": _fill_rope_compiled,
    "cpscope._tensor_cache._OWNED": _fill_owned,
    "cpscope._sentinel.core._compiler_disabled": _fill_sentinel_wrapper,
    "cpscope.attention._merge._kernels": _fill_triton("cpscope.attention._merge._kernels"),
    "cpscope.attention._sink_kernels._jitted": _fill_triton("cpscope.attention._sink_kernels._jitted"),
    "cpscope.rope._kernel._kernel": _fill_triton("cpscope.rope._kernel._kernel"),
}


# Registered caches filled by real CP calls on 4 gloo ranks (group-keyed, or device tensors of the variants' plans):
# name -> how full it is on a rank (run there).
def _size_of(qualified: str) -> int:
    obj = _get(qualified)
    return obj.cache_info().currsize if hasattr(obj, "cache_info") else len(obj)


DISTRIBUTED = (
    "cpscope.attention._allgather._keys_index",
    "cpscope.attention._allgather._block_varlen",
    "cpscope.attention._ulysses._permutation",
    "cpscope.attention._hierarchical._GROUPS",
    "cpscope.attention._agreement._CPU_OK",
)


def _fill_and_clear_on_ranks() -> dict[str, tuple[int, int]]:
    """On every rank: ``thd`` calls at CP4 through all_gather, a2a and a2a+p2p:2 (each agreed over the group
    first), then ``clear_caches()``; per cache ``(entries after the calls, entries after clearing)``."""
    import torch.distributed as dist

    groups = cpscope.new_cp_groups([4], hierarchical=True)
    cpscope.clear_caches()
    cu = torch.tensor([0, 16, 48, 64], dtype=torch.int32)  # every document divisible by 2 * cp
    g = torch.Generator().manual_seed(dist.get_rank())
    q, k, v = (torch.randn(16, 4, 8, generator=g) for _ in range(3))
    for comm in ("all_gather", "a2a", "a2a+p2p:2"):
        with cpscope.runtime_cp(groups[4], comm=comm):
            out = cpscope.context_parallel_attention(q, k, v, qkv_format="thd", cu_seqlens=cu)
        assert out.shape == q.shape and torch.isfinite(out).all()
    filled = {name: _size_of(name) for name in DISTRIBUTED}
    cpscope.clear_caches()
    return {name: (filled[name], _size_of(name)) for name in DISTRIBUTED}


@pytest.fixture(scope="module")
def distributed_sizes() -> list[dict[str, tuple[int, int]]]:
    return run_ranks(4, _fill_and_clear_on_ranks, timeout=120)


def test_every_cache_is_registered_declared_or_a_probe():
    found = scan()
    listed = {*NOT_CACHES, *PROBES, *FILLERS, *CLEARED_BY, *DISTRIBUTED}
    unknown = sorted(q for q in found if q not in listed)
    assert not unknown, (
        f"caches that cpscope.clear_caches() cannot reach: {unknown}; memoise with cpscope._tensor_cache.lru "
        "(or register_clear) and add a filler to FILLERS, or declare why it is not a cache in NOT_CACHES")
    bare = sorted(q for q, kind in found.items() if kind == "bare" and q not in PROBES and q not in NOT_CACHES)
    assert not bare, f"a bare functools.lru_cache is not registered with clear_caches: {bare}"
    stale = sorted(q for q in listed if q not in found)
    assert not stale, f"listed but no longer in the package (delete the line): {stale}"
    overlap = sorted(q for q in NOT_CACHES if q in {*PROBES, *FILLERS, *CLEARED_BY, *DISTRIBUTED}
                     ) + sorted(q for q in PROBES if q in {*FILLERS, *CLEARED_BY, *DISTRIBUTED})
    assert not overlap, f"declared both a cache and not one: {overlap}"


def test_every_registered_cache_has_a_fill_and_clear_check():
    """A memo registered with ``lru`` or a container emptied by a registered clear is checked below."""
    found = scan()
    checked = {*FILLERS, *DISTRIBUTED}
    unchecked = sorted(q for q, kind in found.items() if kind == "registered" and q not in checked)
    unchecked += sorted(q for q in CLEARED_BY if q not in checked)
    assert not unchecked, f"registered caches without a fill-and-clear check: {unchecked}"


def test_scan_sees_a_new_bare_cache(tmp_path):
    """The scan is not blind: a bare lru_cache, a module-level dict, a registered memo and a name a function
    rebinds are each seen."""
    src = ("import functools\nfrom cpscope._tensor_cache import lru\n_SEEN = {}\n_LAZY = None\n"
           "@functools.lru_cache(maxsize=4)\ndef f(x):\n    return x\n@lru(maxsize=4)\ndef g(x):\n    return x\n"
           "def h():\n    global _LAZY\n    _LAZY = object()\n")
    found: dict[str, str] = {}
    _scan_tree("m", ast.parse(src), found)
    assert found == {"m.f": "bare", "m.g": "registered", "m._SEEN": "container", "m._LAZY": "global"}


def test_registered_clears_are_in_the_registry():
    """Each container's clear function is one that clear_caches calls."""
    clears = {}
    for q, fn in CLEARED_BY.items():  # imported first: a module registers when imported
        try:
            clears[q] = _get(fn)
        except ImportError:  # core-only run: its optional package is hidden, so neither module nor cache exists
            continue
    missing = sorted(q for q, fn in clears.items() if fn not in _tensor_cache.registered())
    assert not missing, f"clear functions not registered with register_clear: {missing}"


@pytest.mark.parametrize("qualified", sorted(FILLERS))
def test_clear_caches_empties_each_registered_cache(qualified, tmp_path, monkeypatch):
    cpscope.clear_caches()
    size = FILLERS[qualified](tmp_path, monkeypatch)
    assert size() > 0, f"{qualified}: filling it cached nothing"
    cpscope.clear_caches()
    assert size() == 0, f"{qualified}: cpscope.clear_caches() left {size()} entries"


@pytest.mark.parametrize("qualified", DISTRIBUTED)
def test_clear_caches_empties_caches_filled_by_cp_calls(qualified, distributed_sizes):
    """Filled by real CP4 calls on gloo ranks (device tensors of the variants' plans, verified group pairs, the
    agreement check's transport probe), emptied by clear_caches on every rank."""
    for rank, sizes in enumerate(distributed_sizes):
        filled, cleared = sizes[qualified]
        assert filled > 0, f"rank {rank}: {qualified}: the CP calls cached nothing"
        assert cleared == 0, f"rank {rank}: {qualified}: cpscope.clear_caches() left {cleared} entries"


def test_every_registered_memo_is_cleared_by_clear_caches():
    """Each ``_tensor_cache.lru`` memo of the package is in the registry that clear_caches calls."""
    for qualified, kind in scan().items():
        if kind == "registered":
            assert _get(qualified).cache_clear in _tensor_cache.registered(), qualified


def test_rope_compile_has_its_own_code():
    """The compiled RoPE math is a copy with a code object of its own: torch keeps what it compiled per code object,
    so clearing the copy drops the compiled code too (not only the wrapper)."""
    from cpscope.rope import _torch_math

    compiled = _torch_math._compile(_torch_math.rope_math)  # torch.compile is lazy: nothing is compiled here
    orig = getattr(compiled, "_torchdynamo_orig_callable", None)
    if orig is None:
        pytest.skip("this torch.compile wrapper does not expose its function")
    assert orig.__code__ is not _torch_math.rope_math.__code__ and orig.__code__ == _torch_math.rope_math.__code__


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


def test_owned_caches_of_copies_are_cleared_too():
    """A deep copy of a module copies its cache dict; its next use makes the copy's cache known to clear_caches."""
    import copy

    rope = cpscope.RotaryEmbedding(8)
    rope(16)
    twin = copy.deepcopy(rope)
    assert twin.__dict__["_tables"] and twin(8).shape == (8, 1, 1, 8)
    cpscope.clear_caches()
    assert not rope.__dict__["_tables"] and not twin.__dict__["_tables"]
