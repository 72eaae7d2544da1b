"""The CP group registry: rank order, creation at scale, hierarchical groups, stale entries.

Layers: the block planning is pure (no process group); the creation engine runs against a fake dist layer
(call counts at 4096 simulated ranks); the rest runs on the 4-rank (and 2-rank) gloo pool. Every numerical check
compares ring attention with a float64 full-sequence reference cut at the rank that torch gives this rank inside
its group (``dist.get_rank(group)``), forward and dq/dk/dv.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cpscope
from cpscope.groups import _registry as G
from cpscope.groups._rank_blocks import hierarchical_blocks, pad_schedule, plan_cp_blocks
from tests.attention._reference import reference_attention, zigzag_index
from tests.distributed import run_ranks

# ---------------------------------------------------------------------------------------------------------------
# Pure planning


def test_blocks_are_aligned_and_each_ascends():
    p = plan_cp_blocks([1, 2, 4], [2, 3, 0, 1], world=4)
    assert p.blocks[2] == ((2, 3), (0, 1)) and p.blocks[4] == ((0, 1, 2, 3),)
    assert p.reordered == ((2, 3, 0, 1),)  # the caller's size-4 block, which the group orders ascending
    assert p.block_of(0, 2) == (0, 1) and p.block_of(3, 4) == (0, 1, 2, 3) and p.block_of(0, 1) == (0,)
    q = plan_cp_blocks([2, 4], [0, 4, 1, 5, 2, 6, 3, 7], world=8)  # cross-node interleaving
    assert q.blocks[2] == ((0, 4), (1, 5), (2, 6), (3, 7)) and q.blocks[4] == ((0, 1, 4, 5), (2, 3, 6, 7))
    assert q.steps() == [q.blocks[2], q.blocks[4]]
    assert plan_cp_blocks([2, 1, 2], None, world=2).sizes == (2, 1)  # de-duplicated, caller's order
    assert plan_cp_blocks([2], [5, 1], world=8).block_of(0, 2) is None  # not in the ranks split


@pytest.mark.parametrize(
    "sizes,ranks,world,match",
    [
        ([2, 3], None, 4, r"CP sizes \[3\] do not divide the 4 ranks"),
        ([0], None, 4, r"CP sizes \[0\]"),
        ([2], [0, 0], 4, r"distinct global ranks in \[0, 4\), got \[0, 0\]"),
        ([2], [0, 4], 4, r"distinct global ranks in \[0, 4\), got \[0, 4\]"),
        ([2], [], 4, "ranks is empty"),
        ([2.0], None, 4, "must be an int, got float 2.0"),
        ([True], None, 4, "must be an int, got bool"),
        ([2], ["0", "1"], 4, "must be an int, got str"),
    ],
)
def test_bad_arguments_raise_value_errors_that_name_them(sizes, ranks, world, match):
    with pytest.raises(ValueError, match=match):
        plan_cp_blocks(sizes, ranks, world=world)


def test_hierarchical_blocks_orders():
    inner, outer = hierarchical_blocks([1, 3, 5, 7, 9, 11], 2)  # CP ranks 0..5 are global ranks 1, 3, ..., 11
    assert inner == ((1, 3), (5, 7), (9, 11))  # consecutive CP ranks; inner rank = cp_rank % 2
    assert outer == ((1, 5, 9), (3, 7, 11))  # same inner index; outer rank = cp_rank // 2
    with pytest.raises(ValueError, match=r"inner 4 does not divide the CP size 6; use a divisor of 6 \(\[1, 2, 3, 6\]\)"):
        hierarchical_blocks([1, 3, 5, 7, 9, 11], 4)
    inner, outer = hierarchical_blocks([0, 1, 2, 3, 4, 5], 3)  # any divisor: 3 of 6
    assert inner == ((0, 1, 2), (3, 4, 5)) and outer == ((0, 3), (1, 4), (2, 5))
    with pytest.raises(ValueError, match=r"must ascend.*got \[3, 1\]"):
        hierarchical_blocks([3, 1], 1)


def test_pad_schedule_aligns_the_members_of_every_block():
    # ranks 0, 1 have 3 torch groups, ranks 2, 3 have 2 (say rank 0, 1 made a pair group of their own)
    counts = {0: 3, 1: 3, 2: 2, 3: 2}
    steps = [((0, 1), (2, 3)), ((0, 1, 2, 3),)]
    pads = pad_schedule(steps, counts)
    assert pads == [{}, {2: 1, 3: 1}]  # pairs agree already; before the 4-block, 2 and 3 catch up by one
    # a block already cached (not created) at step 0 on ranks 2, 3: they are behind by 2 before step 1
    assert pad_schedule([((0, 1),), ((0, 1, 2, 3),)], {0: 2, 1: 2, 2: 2, 3: 2}) == [{}, {2: 1, 3: 1}]


# ---------------------------------------------------------------------------------------------------------------
# Ring attention on permuted / interleaved rank lists: rows and dq/dk/dv against float64


def _ring_check(group, fmt: str, seed: int) -> float:
    """Ring attention under ``runtime_cp(group)`` vs the float64 reference cut at torch's rank in ``group``."""
    cp, r = group.size(), dist.get_rank(group)
    me = dist.get_rank()
    assert cpscope.group_ranks(group) == dist.get_process_group_ranks(group)  # the real member order
    with cpscope.runtime_cp(group):
        assert cpscope.cp_rank() == r == cpscope.group_ranks(group).index(me)
    h, h_kv, d = 4, 2, 8
    cu = [0, 4 * cp, 10 * cp] if fmt == "thd" else [0, 8 * cp]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(cu[-1], h, d, generator=g, dtype=torch.float64)
    k = torch.randn(cu[-1], h_kv, d, generator=g, dtype=torch.float64)
    v = torch.randn(cu[-1], h_kv, d, generator=g, dtype=torch.float64)
    dout = torch.randn(cu[-1], h, d, generator=g, dtype=torch.float64)
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = reference_attention(*full, causal=True, cu=cu if fmt == "thd" else None)
    ref.backward(dout)
    idx = zigzag_index(cu, cp, r)
    loc = [t[idx].clone().requires_grad_(True) for t in (q, k, v)]
    kw = {"cu_seqlens": torch.tensor(cu, dtype=torch.int32)} if fmt == "thd" else {}
    args = loc if fmt == "thd" else [t.unsqueeze(0) for t in loc]
    with cpscope.runtime_cp(group):
        out = cpscope.context_parallel_attention(*args, qkv_format=fmt, causal=True, **kw)
    out = out.reshape(idx.numel(), h, d)
    out.backward(dout[idx])  # outside the scope, as in training
    worst = 0.0
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in loc)),
                               (ref, *(t.grad for t in full))):
        err = (got - want[idx]).abs().max().item()
        assert err <= 1e-10, f"{name}: max abs err {err:.3g} ({fmt}, cp={cp}, cp rank {r}, global rank {me})"
        worst = max(worst, err)
    return worst


def _permuted_ring(ranks: list[int], sizes: list[int]) -> dict:
    cpscope.set_backward_read_check(True)
    got = cpscope.new_cp_groups(sizes, ranks=ranks)
    me = dist.get_rank()
    for s in sizes:
        if s == 1:
            assert got[1] is None
            continue
        members = cpscope.group_ranks(got[s])
        assert members == sorted(members) and me in members  # documented: ascending global ranks
        for i, fmt in enumerate(("bshd", "thd")):
            _ring_check(got[s], fmt, seed=10 * s + i)
    return {s: cpscope.group_ranks(g) if g is not None else None for s, g in got.items()}


@pytest.mark.parametrize("ranks", [[2, 3, 0, 1], [3, 1, 2, 0], [0, 2, 1, 3]], ids=["blocks-swapped", "shuffled",
                                                                                 "interleaved"])
def test_ring_on_permuted_rank_lists_equals_reference(ranks):
    out = run_ranks(4, _permuted_ring, ranks, [1, 2, 4])
    for me, got in enumerate(out):
        pos = ranks.index(me)
        assert got[2] == sorted(ranks[pos - pos % 2: pos - pos % 2 + 2])
        assert got[4] == [0, 1, 2, 3]


def test_ring_on_two_ranks_listed_backwards():
    # ranks=[1, 0]: with the caller's order kept, each rank's ring "next" was itself (gloo fails, NCCL wrong)
    assert run_ranks(2, _permuted_ring, [1, 0], [2]) == [{2: [0, 1]}] * 2


def _cross_node_interleaving():
    # 4 ranks as 2 "nodes" of 2: [0, 2, 1, 3] keeps CP2 across nodes; CP4 is everything, ascending
    return _permuted_ring([0, 2, 1, 3], [2, 4])


def test_cross_node_interleaving_pairs_across_nodes():
    out = run_ranks(4, _cross_node_interleaving)
    assert [o[2] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def _te_ranks_follow_torch():
    got = cpscope.new_cp_groups([4], ranks=[2, 3, 0, 1])[4]
    # what the TE adapter passes as cp_global_ranks: index i is the rank TE's CP rank i talks to
    ranks = cpscope.group_ranks(got)
    return [dist.get_global_rank(got, i) for i in range(4)] == ranks


def test_te_global_ranks_follow_the_group_rank_order():
    assert run_ranks(4, _te_ranks_follow_torch) == [True] * 4


# ---------------------------------------------------------------------------------------------------------------
# The hybrid loop's plan / group check with a permuted rank list


def _loop_on_permuted_ranks():
    from cpscope.hybrid import Microbatch
    from cpscope.train._loop import prepare_microbatches

    cpscope.set_backward_read_check(True)
    ranks = [2, 3, 0, 1]
    groups = cpscope.new_cp_groups([1, 2, 4], ranks=ranks)
    me = dist.get_rank()
    pos = ranks.index(me)  # this rank's position in the planned rank list
    doc = torch.arange(40)
    # CP4 over all positions, then CP2 over this rank's block of positions
    planned = [Microbatch(4, 0, (0,), 10, 0.0), Microbatch(2, pos // 2, (0,), 20, 0.0)]
    mbs = prepare_microbatches(planned, [doc], groups, ranks=ranks)
    gathered = []
    for mb in mbs:  # each group's local parts put back together are the whole padded document
        full = cpscope.zigzag_unshard(mb.input_ids, seq_dim=0, cu_seqlens=mb.cu_seqlens, group=mb.group)
        gathered.append(torch.equal(full[:40], doc))
    # a plan for the wrong block of positions fails before any collective
    with pytest.raises(ValueError, match=r"planned on global ranks"):
        prepare_microbatches([Microbatch(2, 1 - pos // 2, (0,), 20, 0.0)], [doc], groups, ranks=ranks)
    return gathered


def test_loop_accepts_groups_over_a_permuted_rank_list():
    assert run_ranks(4, _loop_on_permuted_ranks) == [[True, True]] * 4


# ---------------------------------------------------------------------------------------------------------------
# Creation at scale, simulated: what one rank of a 4096-rank job calls


@pytest.fixture
def simulated(monkeypatch):
    """``make(world, rank, **kw)`` swaps the registry's dist layer for a SimulatedLayer (restored after)."""
    from tests._sim import SimulatedLayer

    def make(world: int, rank: int, **kw) -> SimulatedLayer:
        layer = SimulatedLayer(world, rank, **kw)
        monkeypatch.setattr(G, "_LAYER", layer)
        G.clear_cp_group_cache()
        return layer

    yield make
    G.clear_cp_group_cache()


POW2 = [2 ** i for i in range(13)]  # 1 … 4096


@pytest.mark.parametrize("method,calls,lockstep", [("global", 4095, 4095), ("local", 12, 0), ("split", 12, 12)])
def test_4096_ranks_each_rank_creates_only_its_own_blocks(simulated, method, calls, lockstep):
    layer = simulated(4096, 1234, split=method == "split", bound=method == "split")
    got = G.new_cp_groups(POW2, method=method)
    rep = G._LAST_REPORT
    assert (rep.method, rep.calls, rep.lockstep, rep.created, rep.placeholders) == (method, calls, lockstep, 12, 0)
    assert [c[0] for c in layer.calls].count("gather") == 1  # one record exchange over the world
    for s in POW2[1:]:
        lo = 1234 - 1234 % s
        assert got[s].ranks == list(range(lo, lo + s))
    assert got[1] is None
    n = len(layer.calls)
    assert G.new_cp_groups(POW2, method=method) == got and len(layer.calls) == n  # cached: no call at all


def test_cp1_only_makes_no_call(simulated):
    layer = simulated(8, 5)
    assert G.new_cp_groups([1]) == {1: None} and layer.calls == []


def test_auto_picks_split_when_bound_else_local(simulated):
    simulated(64, 3, split=True, bound=True)
    G.new_cp_groups([2, 4])
    assert G._LAST_REPORT.method == "split"
    simulated(64, 3)
    G.new_cp_groups([2, 4])
    assert G._LAST_REPORT.method == "local"


def test_methods_that_cannot_work_are_refused_before_any_call(simulated):
    layer = simulated(8, 0, bound=True)  # NCCL bound to a device whose backend cannot split (say)
    with pytest.raises(ValueError, match=r"method='local' would hang: the default group is bound to cuda:0"):
        G.new_cp_groups([2], method="local")
    with pytest.raises(ValueError, match=r"method='split' needs a default group bound to a device"):
        G.new_cp_groups([2], method="split")
    with pytest.raises(ValueError, match=r"method must be one of"):
        G.new_cp_groups([2], method="fast")
    assert layer.calls == []


def test_arguments_that_differ_between_ranks_raise_instead_of_hanging(simulated):
    layer = simulated(16, 2, fingerprints={5: "abc", 9: "def"})  # their argument digests differ
    with pytest.raises(ValueError, match=r"every rank must pass the same arguments. This rank \(2\) passed "
                                         r"sizes=\[2, 4\].*ranks \[5, 9\] passed different ones"):
        G.new_cp_groups([2, 4])
    assert [c[0] for c in layer.calls] == ["gather"]  # nothing created


def test_local_names_are_aligned_with_placeholders(simulated):
    # rank 2 has 2 torch groups, its CP2 partner rank 3 has 4 (it made two groups of its own before)
    layer = simulated(4, 2, counts={0: 2, 1: 2, 2: 2, 3: 4})
    G.new_cp_groups([2, 4], method="local")
    made = [c for c in layer.calls if c[0] == "new_group"]
    assert made == [("new_group", (2,), True), ("new_group", (2,), True), ("new_group", (2, 3), True),
                    ("new_group", (0, 1, 2, 3), True)]
    # before the 4-block: rank 2 is at 5 like rank 3, ranks 0, 1 at 3 pad twice — rank 2 pads no more
    assert G._LAST_REPORT.placeholders == 2


def test_hierarchical_calls_stay_among_the_cp_groups_members(simulated):
    from tests._sim import SimGroup

    layer = simulated(4096, 1029)
    cp = SimGroup(range(1024, 1032))  # a CP8 group inside a 4096-rank job
    assert G.lookup_hierarchical(cp, 4) is None and layer.calls == []  # not created: None, and no call at all
    inner, outer = G.hierarchical_cp_groups(cp, 4)
    assert inner.ranks == [1028, 1029, 1030, 1031] and outer.ranks == [1025, 1029]
    assert layer.calls == [("gather", tuple(range(1024, 1032)), False), ("new_group", (1028, 1029, 1030, 1031), True),
                           ("new_group", (1025, 1029), True)]
    assert G.hierarchical_cp_groups(cp, 4) == (inner, outer) and len(layer.calls) == 3  # cached
    assert G.lookup_hierarchical(cp, 4) == (inner, outer) and len(layer.calls) == 3  # found, no call
    assert G.lookup_hierarchical(cp, 2) is None  # another inner size: not created
    layer = simulated(4096, 1029, split=True, bound=True)
    inner, outer = G.hierarchical_cp_groups(cp, 4)
    assert G.lookup_hierarchical(cp, 4) == (inner, outer)  # whichever method created it
    # split from the CP group, in its group ranks: inner blocks then outer blocks
    assert [c for c in layer.calls if c[0] == "split"] == [
        ("split", ((1024, 1025, 1026, 1027), (1028, 1029, 1030, 1031)), False),
        ("split", ((1024, 1028), (1025, 1029), (1026, 1030), (1027, 1031)), False)]
    assert (inner.ranks, outer.ranks) == ([1028, 1029, 1030, 1031], [1025, 1029])
    assert G.hierarchical_cp_groups(cp, 8) == (cp, None) and G.hierarchical_cp_groups(cp, 1) == (None, cp)
    n = len(layer.calls)
    assert G.lookup_hierarchical(cp, 8) == (cp, None) and G.lookup_hierarchical(cp, 1) == (None, cp)
    assert G.lookup_hierarchical(None, 1) == (None, None) and len(layer.calls) == n  # nothing to create: answered
    with pytest.raises(ValueError, match=r"inner 3 does not divide the CP size 8"):
        G.hierarchical_cp_groups(cp, 3)
    with pytest.raises(ValueError, match=r"lookup_hierarchical: inner 3 does not divide the CP size 8"):
        G.lookup_hierarchical(cp, 3)
    with pytest.raises(ValueError, match=r"lookup_hierarchical: inner 2 does not divide the CP size 1"):
        G.lookup_hierarchical(None, 2)
    with pytest.raises(ValueError, match=r"method='global' needs every rank"):
        G.hierarchical_cp_groups(cp, 2, method="global")


def test_destroyed_cached_groups_are_never_returned(simulated):
    simulated(8, 0)
    got = G.new_cp_groups([2, 4])
    got[2].alive = False  # destroy_process_group(got[2]) on its members
    with pytest.raises(RuntimeError, match=r"cached group 2 \(global ranks \[0, 1\]\) has been destroyed.*"
                                           r"clear_cp_group_cache\(\) on every rank"):
        G.new_cp_groups([2, 4])
    G.clear_cp_group_cache()
    again = G.new_cp_groups([2, 4])
    assert again[2] is not got[2] and again[2].alive and again[2].ranks == [0, 1]
    inner, outer = G.hierarchical_cp_groups(again[4], 2)
    outer.alive = False
    with pytest.raises(RuntimeError, match=r"lookup_hierarchical: the cached group 'outer' \(global ranks \[0, 2\]\) "
                                           r"has been destroyed"):
        G.lookup_hierarchical(again[4], 2)  # never a destroyed group, never a silent None


def test_a_new_world_starts_the_registry_afresh(simulated):
    layer = simulated(8, 0)
    got = G.new_cp_groups([2])
    layer.world_token = object.__new__(type(layer.world_token))  # destroy_process_group() + init_process_group
    assert G.new_cp_groups([2])[2] is not got[2]


def test_the_registry_holds_no_strong_reference_to_its_groups(simulated):
    import gc
    import weakref

    simulated(8, 0)
    ref = weakref.ref(G.new_cp_groups([2, 4])[4])
    gc.collect()
    assert ref() is None  # torch's own registry is what keeps a real group alive until it is destroyed


# ---------------------------------------------------------------------------------------------------------------
# The registry on gloo ranks: contract semantics, local creation, placeholders, hierarchy, destroyed groups


def _contract_semantics():
    me, world = dist.get_rank(), dist.get_world_size()
    cpscope.clear_cp_group_cache()  # every rank: this test creates afresh whatever the pool ran before
    # groups of the users' own on ranks 0 and 1 only: torch's group counts now differ between ranks (0, 1 ahead),
    # which would give the members of a locally created block different names (a hang) without placeholders
    counts = [None] * world
    dist.all_gather_object(counts, G._LAYER.local_name_count())
    top = max(counts) + 1
    for _ in range(top - counts[me] if me < 2 else 0):
        dist.new_group([me], use_local_synchronization=True)
    got = cpscope.new_cp_groups([4, 1, 2], ranks=[3, 2, 1, 0], method="local")
    rep = G._LAST_REPORT
    # counts differ: the brief record exchange, then the detailed one
    assert (rep.method, rep.created, rep.lockstep, rep.gathers) == ("local", 2, 0, 2)
    # ranks 2, 3 catch up before the 4-block; after it all are equal, so the pairs need none
    assert rep.placeholders == (top - counts[me] if me >= 2 else 0) and rep.calls == 2 + rep.placeholders
    assert set(got) == {1, 2, 4} and got[1] is None
    assert cpscope.group_ranks(got[2]) == [me - me % 2, me - me % 2 + 1]
    assert cpscope.group_ranks(got[4]) == list(range(world))
    for s in (2, 4):  # real groups: a sum over the members, rank order as torch numbers it
        t = torch.tensor([float(dist.get_rank(got[s]))])
        dist.all_reduce(t, group=got[s])
        assert t.item() == s * (s - 1) / 2
    # cached: no collective at all (a collective here would fail)
    real = G._LAYER
    G._LAYER = _NoCollectives(real)
    try:
        assert cpscope.new_cp_groups([4, 1, 2], ranks=[3, 2, 1, 0], method="local") == got
    finally:
        G._LAYER = real
    # a block already made by another call is reused, not created again
    again = cpscope.new_cp_groups([2], ranks=[1, 0, 3, 2], method="local")
    assert again[2] is got[2] and G._LAST_REPORT.created == 0
    # sizes that do not divide: ValueError before any collective; a rank outside `ranks` gets nothing
    with pytest.raises(ValueError, match=r"\[3\] do not divide the 4 ranks"):
        cpscope.new_cp_groups([2, 3])
    sub = cpscope.new_cp_groups([1, 2], ranks=[2, 3])
    assert sub == ({1: None, 2: got[2]} if me >= 2 else {})
    return True


class _NoCollectives:
    def __init__(self, real):
        self.real = real

    def __getattr__(self, name):
        if name in ("all_gather", "new_group", "split"):
            raise AssertionError(f"the cached call made a {name} call")
        return getattr(self.real, name)


def test_registry_contract_on_gloo_ranks():
    assert run_ranks(4, _contract_semantics) == [True] * 4


def _mismatched_arguments():
    sizes = [2] if dist.get_rank() != 3 else [4]
    with pytest.raises(ValueError, match=r"every rank must pass the same arguments"):
        cpscope.new_cp_groups(sizes)
    return True


def test_mismatched_arguments_raise_on_every_rank_instead_of_hanging():
    assert run_ranks(4, _mismatched_arguments, timeout=120) == [True] * 4


def _hierarchy():
    me = dist.get_rank()
    cp = cpscope.new_cp_groups([4])[4]
    c = dist.get_rank(cp)
    inner, outer = cpscope.groups.hierarchical_cp_groups(cp, 2)
    assert cpscope.group_ranks(inner) == [me - me % 2, me - me % 2 + 1]  # consecutive CP ranks
    assert cpscope.group_ranks(outer) == [me % 2, me % 2 + 2]  # same index inside the inner group
    assert dist.get_rank(inner) == c % 2 and dist.get_rank(outer) == c // 2
    # gathering inside, then across, puts the CP ranks back in CP order: what a2a + ring across relies on
    part = [torch.zeros(1) for _ in range(2)]
    dist.all_gather(part, torch.tensor([float(c)]), group=inner)
    whole = [torch.zeros(2) for _ in range(2)]
    dist.all_gather(whole, torch.cat(part), group=outer)
    assert torch.cat(whole).tolist() == [0.0, 1.0, 2.0, 3.0]
    assert cpscope.groups.hierarchical_cp_groups(cp, 2) == (inner, outer)  # cached
    assert cpscope.groups.lookup_hierarchical(cp, 2) == (inner, outer)  # what a forward may call
    pairs = cpscope.new_cp_groups([2])[2]
    assert inner is pairs  # the same member set: one group, shared with the registry
    assert cpscope.groups.hierarchical_cp_groups(cp, 4) == (cp, None)
    assert cpscope.groups.hierarchical_cp_groups(None, 1) == (None, None)
    with pytest.raises(ValueError, match=r"inner 3 does not divide the CP size 4"):
        cpscope.groups.hierarchical_cp_groups(cp, 3)
    return True


def test_hierarchical_groups_on_four_ranks():
    assert run_ranks(4, _hierarchy) == [True] * 4


def _any_size(sizes: list[int]) -> dict:
    """Groups of CP sizes that are not powers of two (3, 6): members, a collective, ring attention against the
    float64 reference, and the hierarchical pairs of every divisor — created up front, then looked up."""
    cpscope.set_backward_read_check(True)
    me, world = dist.get_rank(), dist.get_world_size()
    got = cpscope.new_cp_groups(sizes)
    assert got[1] is None
    for s in sizes[1:]:
        members = cpscope.group_ranks(got[s])
        assert members == list(range(me - me % s, me - me % s + s))  # aligned contiguous blocks, ascending
        t = torch.tensor([float(dist.get_rank(got[s]))])
        dist.all_reduce(t, group=got[s])
        assert t.item() == s * (s - 1) / 2
        for i, fmt in enumerate(("bshd", "thd")):
            _ring_check(got[s], fmt, seed=10 * s + i)
    cp = got[world]
    c = dist.get_rank(cp)
    pairs = {}
    for m in range(1, world + 1):
        if world % m:
            with pytest.raises(ValueError, match=rf"inner {m} does not divide the CP size {world}"):
                cpscope.groups.hierarchical_cp_groups(cp, m)
            continue
        inner, outer = pairs[m] = cpscope.groups.hierarchical_cp_groups(cp, m)
        assert cpscope.groups.lookup_hierarchical(cp, m) == (inner, outer)  # found later without a collective
        if m in (1, world):
            assert (inner, outer) == ((None, cp) if m == 1 else (cp, None))
            continue
        assert cpscope.group_ranks(inner) == list(range(c - c % m, c - c % m + m))
        assert cpscope.group_ranks(outer) == list(range(c % m, world, m))
        assert dist.get_rank(inner) == c % m and dist.get_rank(outer) == c // m
        if m in got:
            assert inner is got[m]  # the same members as a registry block: one group
        part = [torch.zeros(1) for _ in range(m)]  # gathering inside, then across: the CP order back
        dist.all_gather(part, torch.tensor([float(c)]), group=inner)
        whole = [torch.zeros(m) for _ in range(world // m)]
        dist.all_gather(whole, torch.cat(part), group=outer)
        assert torch.cat(whole).tolist() == [float(i) for i in range(world)]
    bad = [s for s in (2, 3, 4, 5) if world % s]
    with pytest.raises(ValueError, match=rf"CP sizes \[{bad[0]}\] do not divide the {world} ranks"):
        cpscope.new_cp_groups([1, bad[0]])
    return sorted(pairs)


@pytest.mark.parametrize("world,sizes", [(3, [1, 3]), (6, [1, 2, 3, 6])])
def test_cp_sizes_that_are_not_powers_of_two(world, sizes):
    divisors = [m for m in range(1, world + 1) if world % m == 0]
    assert run_ranks(world, _any_size, sizes) == [divisors] * world


def _destroyed_group():
    import gc
    import weakref

    me = dist.get_rank()
    got = cpscope.new_cp_groups([2], ranks=[0, 2, 1, 3])[2]  # pairs {0, 2}, {1, 3}: used by no other test
    assert cpscope.group_ranks(got) == [me % 2, me % 2 + 2]
    ref = weakref.ref(got)
    dist.destroy_process_group(got)  # by the members of each pair
    with pytest.raises(ValueError, match="not registered with torch.distributed"):
        cpscope.group_ranks(got)
    with pytest.raises(RuntimeError, match=r"has been destroyed.*clear_cp_group_cache"):
        cpscope.new_cp_groups([2], ranks=[0, 2, 1, 3])
    del got
    gc.collect()
    assert ref() is None  # nothing of cpscope keeps the destroyed group alive
    cpscope.clear_cp_group_cache()  # every rank
    fresh = cpscope.new_cp_groups([2], ranks=[0, 2, 1, 3])[2]
    t = torch.ones(1)
    dist.all_reduce(t, group=fresh)
    return t.item()


def test_destroyed_groups_are_refused_then_recreated_after_clear():
    assert run_ranks(4, _destroyed_group) == [2.0] * 4


def _new_world(init_file: str):
    me, world = dist.get_rank(), dist.get_world_size()
    old = cpscope.new_cp_groups([2])[2]
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=me, world_size=world)
    new = cpscope.new_cp_groups([2])[2]  # no clear_cp_group_cache needed: a new world, a new registry
    assert new is not old
    t = torch.ones(1)
    dist.all_reduce(t, group=new)
    return t.item()


def test_a_new_world_after_destroy_gets_new_groups(tmp_path):
    assert run_ranks(2, _new_world, str(tmp_path / "pg")) == [2.0, 2.0]


def test_pad_schedule_never_reuses_a_name():
    # block (0, 1) was named at count 5 before (then destroyed): now at counts 3, 3 both pad to 6
    assert pad_schedule([((0, 1),)], {0: 3, 1: 3}, {(0, 1): 6}) == [{0: 3, 1: 3}]


# ---------------------------------------------------------------------------------------------------------------
# NCCL (GPU machines): split_group when the default group is bound to a device, local groups when it is not


def _nccl_rank(rank: int, world: int, init_file: str, bound: bool, results) -> None:
    import os

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    kw = {"device_id": dev} if bound else {}
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world, **kw)
    try:
        sizes = [s for s in (1, 2, 4, 8) if world % s == 0]
        ranks = list(range(world))[::-1]  # every block listed backwards
        got = cpscope.new_cp_groups(sizes, ranks=ranks)
        assert G._LAST_REPORT.method == ("split" if bound else "local"), G._LAST_REPORT
        for s in sizes[1:]:
            g = got[s]
            members = cpscope.group_ranks(g)
            assert members == sorted(members) == dist.get_process_group_ranks(g)
            c = dist.get_rank(g)
            with cpscope.runtime_cp(g):
                assert cpscope.cp_rank() == c
            t = torch.ones(1, device=dev)
            dist.all_reduce(t, group=g)
            assert t.item() == s
            # one step around the ring the way RingComm picks its peers: the CP rank before mine arrives
            send, recv = torch.tensor([float(c)], device=dev), torch.zeros(1, device=dev)
            ops = [dist.P2POp(dist.isend, send, members[(c + 1) % s], g),
                   dist.P2POp(dist.irecv, recv, members[(c - 1) % s], g)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            assert recv.item() == (c - 1) % s
        if world >= 4:
            inner, outer = cpscope.groups.hierarchical_cp_groups(got[4], 2)
            c = dist.get_rank(got[4])
            assert dist.get_rank(inner) == c % 2 and dist.get_rank(outer) == c // 2
            t = torch.tensor([float(c)], device=dev)
            dist.all_reduce(t, group=outer)
            assert t.item() == (c % 2) * 2 + 2, t.item()  # c%2 + (c%2 + 2)
        torch.cuda.synchronize()
        results[rank] = True
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize("bound", [True, False], ids=["bound-split", "lazy-local"])
def test_nccl_registry(bound, tmp_path):
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip("needs 2 GPUs")
    world = 8 if n >= 8 else (4 if n >= 4 else 2)
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Manager().dict()
    torch.multiprocessing.start_processes(_nccl_rank, args=(world, str(tmp_path / "pg"), bound, results),
                                          nprocs=world, start_method="spawn", join=True)
    assert dict(results) == {r: True for r in range(world)}
