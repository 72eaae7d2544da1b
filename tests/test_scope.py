"""Scope runtime semantics (CONTRACT.md "Scope runtime", "Groups and streams"), on real gloo groups of 2 and 4 ranks."""
from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist

import cpscope
from cpscope import _scope_binding as binding_mod
from cpscope import scope as scope_mod
from tests.distributed import run_ranks


# ---------------------------------------------------------------------------------------------------------------
# Single process: no process group needed for CP1 semantics.


def test_defaults_outside_every_scope_are_cp1():
    assert cpscope.current_cp_group() is None
    assert cpscope.cp_size() == 1 and cpscope.cp_rank() == 0
    assert cpscope.capture_scope().is_cp1


def test_cp1_scope_and_local_cp_size_one():
    with cpscope.runtime_cp(None, local_cp_size=1) as s:
        assert s.is_cp1 and cpscope.current_cp_group() is None
    assert cpscope.cp_size() == 1


def test_local_cp_size_contradicting_none_raises():
    with pytest.raises(ValueError, match=r"local_cp_size=2.*None"):
        cpscope.runtime_cp(None, local_cp_size=2)


def test_non_group_object_raises():
    with pytest.raises(ValueError, match="ProcessGroup or None"):
        cpscope.runtime_cp("not a group")  # type: ignore[arg-type]


def test_cp_stream_is_none_without_cuda():
    assert cpscope.cp_stream("cpu") is None
    assert cpscope.cp_stream(torch.device("cpu")) is None
    if not torch.cuda.is_available():
        assert cpscope.cp_stream() is None


def test_decorator_rejects_async_generator():
    async def agen():
        yield 1

    with pytest.raises(TypeError, match="async generator"):
        cpscope.runtime_cp(None)(agen)


# ---------------------------------------------------------------------------------------------------------------
# Multi-process workers (module level: pickled by reference into the rank pool).


def _groups(world):
    sizes = [s for s in (1, 2, 4) if world % s == 0]
    return cpscope.new_cp_groups(sizes)


def _expect(group):
    """(group, size, rank) that the readers must report for ``group`` bound."""
    if group is None or group.size() == 1:
        return None, 1, 0
    return group, group.size(), dist.get_rank(group)


def _reads():
    return cpscope.current_cp_group(), cpscope.cp_size(), cpscope.cp_rank()


def _w_basic_semantics():
    world = dist.get_world_size()
    g = _groups(world)
    big = g[world]
    me = dist.get_rank()
    # The registry: aligned contiguous blocks, cached, real groups.
    assert cpscope.group_ranks(g[2]) == [me - me % 2, me - me % 2 + 1]
    assert cpscope.new_cp_groups([1, 2, 4] if world == 4 else [1, 2])[2] is g[2]
    t = torch.ones(1)
    dist.all_reduce(t, group=g[2])
    assert t.item() == 2.0
    # Enter / exit, nesting, explicit CP1 inside CP2, restore on exception.
    assert _reads() == (None, 1, 0)
    with cpscope.runtime_cp(g[2]) as s2:
        assert s2.size == 2 and _reads() == _expect(g[2])
        with cpscope.runtime_cp(None):
            assert _reads() == (None, 1, 0)
            with cpscope.runtime_cp(big):
                assert _reads() == _expect(big)
            assert _reads() == (None, 1, 0)
        assert _reads() == _expect(g[2])
        try:
            with cpscope.runtime_cp(big):
                raise KeyError("boom")
        except KeyError:
            pass
        assert _reads() == _expect(g[2])
    assert _reads() == (None, 1, 0)
    # A CP1 microbatch after a CP2 one never inherits the stale group.
    seen = []
    for cp in (2, 1, world, 1):
        with cpscope.runtime_cp(g[cp]):
            seen.append(cpscope.cp_size())
    assert seen == [2, 1, world, 1]
    return True


def _w_local_cp_size_contract():
    world = dist.get_world_size()
    g = _groups(world)
    single = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    # Both conventions for CP1.
    for cp1 in (None, single):
        with cpscope.runtime_cp(cp1, local_cp_size=1):
            assert _reads() == (None, 1, 0)
        with cpscope.runtime_cp(cp1):
            assert cpscope.current_cp_group() is None  # a size-1 group is reported as None
    with cpscope.runtime_cp(g[2], local_cp_size=2):
        assert cpscope.cp_size() == 2
    errors = []
    cases = [(g[2], 1), (None, 2), (single, 2), (g[2], 4)] + ([(g[4], 2)] if world == 4 else [])
    for group, lcs in cases:
        with pytest.raises(ValueError, match=rf"local_cp_size={lcs}") as info:
            cpscope.runtime_cp(group, local_cp_size=lcs)
        errors.append(str(info.value))
    assert len(errors) == (5 if world == 4 else 4)
    assert any("a group of size 2" in e for e in errors) and any("None (CP1)" in e for e in errors)
    return len(errors)


def _w_not_a_member():
    handle = dist.new_group([0, 1])  # collective; ranks 2, 3 get the non-member sentinel
    if dist.get_rank() >= 2:
        with pytest.raises(ValueError, match="not a member"):
            cpscope.runtime_cp(handle)
    else:
        with cpscope.runtime_cp(handle):
            assert cpscope.cp_size() == 2
    return True


def _w_new_cp_groups_errors_and_subsets():
    world = dist.get_world_size()
    with pytest.raises(ValueError, match=r"\[3\].*do not divide the 4 ranks"):
        cpscope.new_cp_groups([2, 3])
    with pytest.raises(ValueError, match="distinct global ranks"):
        cpscope.new_cp_groups([2], ranks=[0, 0])
    with pytest.raises(ValueError, match=r"\[0\]"):
        cpscope.new_cp_groups([0])
    sub = cpscope.new_cp_groups([1, 2], ranks=[2, 3])  # e.g. one data-parallel replica's ranks
    if dist.get_rank() in (2, 3):
        assert sub[1] is None and cpscope.group_ranks(sub[2]) == [2, 3]
    else:
        assert sub == {}
    return world


def _w_build_time_group():
    world = dist.get_world_size()
    g = _groups(world)
    cpscope.set_build_time_cp_group(g[2])
    try:
        assert _reads() == _expect(g[2])
        with cpscope.runtime_cp(None):
            assert _reads() == (None, 1, 0)
        with cpscope.runtime_cp(g[world]):
            assert _reads() == _expect(g[world])
        assert _reads() == _expect(g[2])  # outside every scope: the build-time group
        with cpscope.build_time_cp(None):
            assert _reads() == (None, 1, 0)
        assert cpscope.build_time_cp_group() is g[2]
        # A snapshot resolves the effective group, and can be re-entered elsewhere.
        snap = cpscope.capture_scope()
    finally:
        cpscope.set_build_time_cp_group(None)
    assert _reads() == (None, 1, 0)
    with snap.bind():
        assert _reads() == _expect(g[2])
    assert not hasattr(snap, "run")  # one way to re-enter a scope: bind()
    return True


def _w_decorator_recursion_and_threads():
    world = dist.get_world_size()
    g = _groups(world)
    order = [g[2], None, g[world], g[2], None]

    def make(depth):
        @cpscope.runtime_cp(order[depth])
        def rec(d):
            assert _reads() == _expect(order[d])
            if d + 1 < len(order):
                decorated[d + 1](d + 1)
                assert _reads() == _expect(order[d])  # restored after the inner call returned
            return d

        return rec

    decorated = [make(d) for d in range(len(order))]
    decorated[0](0)
    assert _reads() == (None, 1, 0)

    # The same decorated function entered concurrently from threads: each call binds afresh.
    f2 = cpscope.runtime_cp(g[2])(lambda barrier: (barrier.wait(), _reads())[1])
    barrier = threading.Barrier(4)
    results = [None] * 4

    def run(i):
        results[i] = f2(barrier)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r == _expect(g[2]) for r in results)

    # A binding in one thread never leaks into another (new threads see the build-time group).
    seen = {}
    with cpscope.runtime_cp(g[2]):
        th = threading.Thread(target=lambda: seen.setdefault("other", _reads()))
        th.start()
        th.join()
        assert _reads() == _expect(g[2])
    assert seen["other"] == (None, 1, 0)

    # A generator is bound around each step, never across a yield.
    @cpscope.runtime_cp(g[2])
    def gen():
        for _ in range(3):
            yield cpscope.cp_size()

    it = gen()
    assert next(it) == 2 and cpscope.cp_size() == 1
    with cpscope.runtime_cp(None):
        assert next(it) == 2 and cpscope.cp_size() == 1
    assert list(it) == [2]
    return True


def _w_asyncio_isolation():
    world = dist.get_world_size()
    g = _groups(world)

    async def task(group, gate_in, gate_out):
        with cpscope.runtime_cp(group):
            gate_in.set()
            await gate_out.wait()  # the other task binds its own group meanwhile
            return _reads()

    @cpscope.runtime_cp(g[world])
    async def decorated():
        await asyncio.sleep(0)
        return _reads()

    async def main():
        a_in, b_in, go = asyncio.Event(), asyncio.Event(), asyncio.Event()
        ta = asyncio.create_task(task(g[2], a_in, go))
        tb = asyncio.create_task(task(None, b_in, go))
        await a_in.wait()
        await b_in.wait()
        outer = _reads()
        go.set()
        ra, rb = await ta, await tb
        with cpscope.runtime_cp(g[2]):
            inherited = await asyncio.create_task(_reads_async())  # tasks copy the creating context
        return outer, ra, rb, inherited, await decorated(), _reads()

    async def _reads_async():
        return _reads()

    outer, ra, rb, inherited, dec, after = asyncio.run(main())
    assert outer == (None, 1, 0)
    assert ra == _expect(g[2]) and rb == (None, 1, 0)
    assert inherited == _expect(g[2])
    assert dec == _expect(g[world]) and after == (None, 1, 0)
    return True


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(
    "worker",
    [_w_basic_semantics, _w_local_cp_size_contract, _w_build_time_group, _w_decorator_recursion_and_threads,
     _w_asyncio_isolation],
    ids=lambda f: f.__name__[3:],
)
def test_scope_semantics(world, worker):
    assert all(run_ranks(world, worker))


def test_binding_a_group_this_rank_is_not_in_raises():
    assert all(run_ranks(4, _w_not_a_member))


def test_new_cp_groups_validation_and_rank_subsets():
    assert run_ranks(4, _w_new_cp_groups_errors_and_subsets) == [4] * 4


def _w_cp1_group_size_one_from_registry_is_cp1():
    g = cpscope.new_cp_groups([1])
    assert g == {1: None}
    with cpscope.runtime_cp(g[1], local_cp_size=1):
        return _reads()


def test_registry_size_one_is_none():
    assert run_ranks(2, _w_cp1_group_size_one_from_registry_is_cp1) == [(None, 1, 0)] * 2


def test_scope_knows_none_of_its_readers():
    """scope.py (and _scope_binding.py, its binding half) import only the bottom layer, name no attention variant
    and hold no backward-check internals."""
    import re

    src = open(scope_mod.__file__).read() + open(binding_mod.__file__).read()
    imports = set(re.findall(r"^from \.(\w*) import", src, flags=re.M))
    assert imports == {"_checks", "_contextlib", "_scope_binding", "_variants", "backward_check"}, imports
    assert "import cpscope" not in src
    for word in ("p2p", "all_gather", "a2a", "graph_task_id()", "saved_tensors", "_checkpoint", "_raise"):
        assert word not in src, word


@pytest.mark.parametrize("bad", [True, 1.0, "1", np.float64(1.0), np.bool_(True)])
def test_local_cp_size_must_be_an_int(bad):
    with pytest.raises(ValueError, match=r"local_cp_size must be an int.*" + type(bad).__name__):
        cpscope.runtime_cp(None, local_cp_size=bad)


@pytest.mark.parametrize("one", [np.int64(1), np.int32(1), np.uint8(1)])
def test_numpy_integer_local_cp_size_is_accepted(one):
    with cpscope.runtime_cp(None, local_cp_size=one) as s:
        assert s.is_cp1
    assert cpscope.MicrobatchScope.of(None, local_cp_size=one).scope.is_cp1
    with pytest.raises(ValueError, match=r"local_cp_size=2 contradicts"):
        cpscope.runtime_cp(None, local_cp_size=np.int64(2))


def test_scope_sizes_are_any_integer():
    s = scope_mod.CPScope(object(), np.int64(2), np.int32(1))
    assert type(s.size) is int and type(s.rank) is int and (s.size, s.rank) == (2, 1)
    for size, rank, match in ((2.0, 0, "CPScope size must be an integer, got float 2.0"),
                              (True, 0, "CPScope size must be an integer, got bool True"),
                              (2, -1, "CPScope rank must be an integer >= 0, got -1")):
        with pytest.raises(ValueError, match=match):
            scope_mod.CPScope(object(), size, rank)


def test_scope_cache_hit_needs_the_very_group():
    """A cache entry serves only the very object it was made for: a new object that reuses the id of a dead one
    whose entry was never dropped (planted here, with no dropping callback) gets no hit (the old id-keyed cache
    served the dead object's CPScope(size=4) for an object it never validated)."""
    import gc
    import weakref

    class StandIn:  # not a ProcessGroup: validation refuses it
        pass

    old = StandIn()
    planted = scope_mod.CPScope(old, 4, 3)
    binding_mod._SCOPES[weakref.ref(old)] = planted
    old_id = id(old)
    del old
    gc.collect()
    kept, new = [], StandIn()
    while id(new) != old_id and len(kept) < 10000:  # CPython hands the freed memory out again soon
        kept.append(new)
        new = StandIn()
    try:
        assert id(new) == old_id, "could not reuse the id"
        for bind in (cpscope.runtime_cp, scope_mod.scope_for):
            with pytest.raises(ValueError, match="expected a torch.distributed.ProcessGroup or None, got StandIn"):
                bind(new)
    finally:
        for key in [k for k, v in binding_mod._SCOPES.items() if v is planted]:
            del binding_mod._SCOPES[key]


def _w_numpy_integer_local_cp_size_with_a_real_group():
    g = _groups(2)[2]
    for n in (np.int64(2), np.int32(2)):
        with cpscope.runtime_cp(g, local_cp_size=n):
            assert cpscope.cp_size() == 2
    for bad in (2.0, True, np.float32(2.0)):
        with pytest.raises(ValueError, match=r"local_cp_size must be an int"):
            cpscope.runtime_cp(g, local_cp_size=bad)
    return True


def test_numpy_integer_local_cp_size_with_a_real_group():
    assert all(run_ranks(2, _w_numpy_integer_local_cp_size_with_a_real_group))


def _w_new_cp_groups_refuses_non_int_sizes():
    for sizes, ranks in (([2.5], None), ([True], None), ([2], [0, 1.0])):
        with pytest.raises(ValueError, match="must be an int"):
            cpscope.new_cp_groups(sizes, ranks)
    return True


def test_new_cp_groups_refuses_non_int_sizes_and_ranks():
    assert all(run_ranks(2, _w_new_cp_groups_refuses_non_int_sizes))


# ---------------------------------------------------------------------------------------------------------------
# Modules capture the build-time group at construction, never a runtime binding.


def _w_module_built_inside_a_runtime_scope():
    from cpscope.attention import ContextParallelAttention
    from tests.attention._reference import reference_attention, zigzag_index

    g = _groups(2)
    rank = dist.get_rank(g[2])
    gen = torch.Generator().manual_seed(7)
    L, H, D = 16, 2, 8
    q, k, v, w = (torch.randn(L, H, D, generator=gen, dtype=torch.float64) for _ in range(4))  # same on every rank

    def reference(rows):  # float64 full-sequence attention and its gradients, cut to ``rows``
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = reference_attention(qq, kk, vv, causal=True)
        (out * w).sum().backward()
        return out.detach()[rows], qq.grad[rows], kk.grad[rows], vv.grad[rows]

    def run(attn, rows):  # [t, h, d] -> bshd [1, t, h, d]; loss = sum(out * w) over the given rows
        leaves = [t[rows].clone().requires_grad_() for t in (q, k, v)]
        out = attn(*(t[None] for t in leaves))[0]
        (out * w[rows]).sum().backward()
        return out.detach(), *(t.grad for t in leaves)

    def check(got, want):
        for a, b, name in zip(got, want, ("out", "dq", "dk", "dv")):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)

    full = torch.arange(L)
    local = zigzag_index([0, L], 2, rank)
    # Lazy init / a rebuild inside the loop's runtime CP2 scope: the runtime binding must not stick.
    with cpscope.runtime_cp(g[2]):
        lazy = ContextParallelAttention(causal=True)
        assert cpscope.build_time_scope().is_cp1
    assert lazy.build_scope.is_cp1 and lazy.active_scope().is_cp1
    check(run(lazy, full), reference(full))  # outside every scope: CP1 on full tensors (a CP2 call would mismatch)
    with cpscope.runtime_cp(g[2]):
        check(run(lazy, local), reference(local))  # the runtime scope still wins when bound
    # Built under build_time_cp(CP2): CP2 outside every scope, even after the build-time group changed back.
    with cpscope.build_time_cp(g[2]):
        static = ContextParallelAttention(causal=True)
    assert static.build_scope.size == 2 and cpscope.build_time_scope().is_cp1
    check(run(static, local), reference(local))
    with cpscope.runtime_cp(None):
        check(run(static, full), reference(full))
    return True


def test_module_built_inside_a_runtime_scope_uses_the_build_time_group():
    assert all(run_ranks(2, _w_module_built_inside_a_runtime_scope))


# ---------------------------------------------------------------------------------------------------------------
# The scope cache does not keep destroyed process groups alive.


def _w_destroyed_group_is_released():
    import gc
    import weakref

    group = dist.new_group([0, 1])
    with cpscope.runtime_cp(group):
        assert cpscope.cp_size() == 2 and cpscope.current_cp_group() is group
        snap = cpscope.capture_scope()
    assert scope_mod.scope_for(group) is snap  # cached: one scope per group
    assert weakref.ref(group) in binding_mod._SCOPES
    ref = weakref.ref(group)
    dist.destroy_process_group(group)
    del group
    gc.collect()
    assert ref() is None, gc.get_referrers(ref())  # neither the cache nor the snapshot kept it alive
    assert not any(s is snap for s in binding_mod._SCOPES.values())  # its cache entry is gone
    with pytest.raises(RuntimeError, match="was destroyed"):
        snap.group  # a kept snapshot of a destroyed group refuses loudly (it never turns into CP1)
    assert snap.size == 2 and "destroyed" in repr(snap)
    dist.barrier()  # the world group still works
    return True


def test_scope_cache_releases_destroyed_groups():
    assert all(run_ranks(2, _w_destroyed_group_is_released))


def test_scope_copy_and_pickle():
    import copy
    import pickle

    s = scope_mod.CPScope(object(), 2, 1)
    assert copy.copy(s) is s and copy.deepcopy(s) is s and copy.deepcopy([s])[0] is s
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(s)
    attn = cpscope.ContextParallelAttention()
    assert copy.deepcopy(attn).build_scope is attn.build_scope  # modules holding a scope can be deep-copied


def test_runtime_scope_or_and_build_time_scope():
    default = scope_mod.CPScope(object(), 4, 3)
    assert cpscope.runtime_scope_or(default) is default
    with cpscope.runtime_cp(None) as bound:
        assert cpscope.runtime_scope_or(default) is bound and bound.is_cp1
    assert cpscope.build_time_scope() is scope_mod.CP1
