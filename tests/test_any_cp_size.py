"""CP sizes that are not powers of two, everywhere: gloo worlds of 3, 5 and 6 ranks (CP3, CP5, CP6, and CP2 / CP3
blocks inside 6 ranks).

Every figure is checked against an independent float64 full-sequence reference cut per rank (the zigzag index
math, attention and RoPE of tests/attention/_reference.py and tests/hybrid/test_loop.py, which share no code with
cpscope): zigzag shard / unshard / positions; RoPE forward and gradient (bshd, thd); every attention variant that
applies, forward and q / k / v gradients, bshd and thd, causal and not — ``p2p``, ``all_gather``, ``a2a`` where
both head counts divide (and where only the q heads do, which the contract says replicates k/v heads),
``a2a+p2p`` with an inner size (6 ranks: 2 and 3), ``comm="auto"``; the group registry's blocks; and one planned
hybrid step (the planner over every divisor, the loop, RoPE, attention) under ``cpscope.sentinel(every=1)``,
equal to the single-process reference.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import cpscope
from tests.attention._reference import zigzag_index
from tests.attention.test_variants import check, recording
from tests.distributed import run_ranks

WORLDS = (3, 5, 6)
# (comm, format, causal, q heads, k/v heads, dense rows) per world; a2a where both head counts divide by the CP
# size, a2a+p2p where an inner size divides it and the heads
CASES = {
    3: [("a2a", "bshd", True, 6, 3, 2), ("a2a", "thd", True, 3, 3, 1), ("a2a", "thd", False, 6, 3, 1)],
    5: [("a2a", "bshd", False, 5, 5, 1), ("a2a", "thd", True, 10, 5, 1)],
    6: [("a2a", "thd", True, 6, 6, 1), ("a2a", "bshd", True, 12, 6, 1),
        ("a2a+p2p:3", "thd", True, 6, 3, 1), ("a2a+p2p:3", "bshd", False, 3, 3, 2),
        ("a2a+p2p:2", "thd", False, 4, 2, 1), ("a2a+p2p:2", "bshd", True, 8, 4, 1),
        ("a2a+p2p", "thd", True, 6, 6, 1)],  # default inner size: 3
}
COMMON = [("p2p", "bshd", True, 4, 2, 2), ("p2p", "thd", True, 4, 1, 1), ("p2p", "thd", False, 4, 4, 1),
          ("all_gather", "bshd", True, 4, 1, 2), ("all_gather", "thd", True, 8, 2, 1),
          ("all_gather", "thd", False, 2, 2, 1)]
# the contract: comm="a2a" needs the q heads divisible by the CP size and replicates k/v heads as needed
KV_REPLICATION = {3: (6, 2), 5: (5, 1), 6: (6, 2)}


def _variants(world: int) -> list[str]:
    cpscope.set_backward_read_check(True)
    group = cpscope.new_cp_groups([world], hierarchical=True)[world]
    ran = []
    for i, (comm, fmt, causal, h, h_kv, batch) in enumerate(COMMON + CASES[world]):
        with recording() as seen:
            check(group, comm, fmt, causal, h, h_kv, batch=batch, seed=i)
        want = comm.split(":")[0]
        assert seen == [f"{want}.forward", f"{want}.backward"], (comm, seen)
        ran.append(f"{comm}/{fmt}")
    return ran


@pytest.mark.parametrize("world", WORLDS)
def test_every_variant_at_cp_world(world: int) -> None:
    ran = run_ranks(world, _variants, world)[0]
    assert len(ran) == len(COMMON) + len(CASES[world])


def _auto(world: int) -> list[str]:
    """comm="auto" (the default rule): a2a where both head counts divide, all_gather with few k/v heads, else p2p."""
    group = cpscope.new_cp_groups([world], hierarchical=True)[world]
    picked = []
    for i, (h, h_kv, fmt) in enumerate(((2 * world, world, "thd"), (world, 1, "bshd"), (4, 2, "bshd"))):
        with recording() as seen:
            check(group, "auto", fmt, True, h, h_kv, seed=20 + i)
        picked.append(seen[0].split(".")[0])
    return picked


@pytest.mark.parametrize("world", WORLDS)
def test_auto_at_cp_world(world: int) -> None:
    picked = run_ranks(world, _auto, world)[0]
    assert picked == ["a2a", "all_gather" if world >= 4 else "p2p", "p2p"], picked


def _a2a_replicating_kv(world: int) -> str:
    """``"ok"``, or the ValueError the attention raised (before any collective: the ranks stay in step and the
    pool is kept)."""
    group = cpscope.new_cp_groups([world], hierarchical=True)[world]
    h, h_kv = KV_REPLICATION[world]
    try:
        for i, fmt in enumerate(("bshd", "thd")):
            check(group, "a2a", fmt, True, h, h_kv, seed=30 + i)
    except ValueError as e:
        return str(e)
    return "ok"


@pytest.mark.parametrize("world", WORLDS)
def test_a2a_replicates_kv_heads_at_cp_world(world: int) -> None:
    got = run_ranks(world, _a2a_replicating_kv, world)
    assert got == ["ok"] * world, got[0]


def _sub_blocks() -> list:
    """6 ranks, every divisor: CP2 and CP3 blocks (which straddle), CP6; each block's attention and ranks."""
    groups = cpscope.new_cp_groups([1, 2, 3, 6])
    me = dist.get_rank()
    out = []
    for cp in (2, 3, 6):
        ranks = cpscope.group_ranks(groups[cp])
        assert ranks == list(range(me - me % cp, me - me % cp + cp)) and dist.get_rank(groups[cp]) == me % cp
        check(groups[cp], "p2p", "thd", True, 4, 2, seed=40 + cp)
        check(groups[cp], "all_gather", "bshd", True, 4, 1, seed=50 + cp)
        out.append(ranks)
    inner, outer = cpscope.hierarchical_cp_groups(groups[6], 3)
    assert cpscope.group_ranks(inner) == [3 * (me // 3) + i for i in range(3)]
    assert cpscope.group_ranks(outer) == [me % 3, me % 3 + 3]
    assert groups[1] is None
    return out


def test_straddling_blocks_inside_six_ranks() -> None:
    blocks = run_ranks(6, _sub_blocks)
    assert blocks[4] == [[4, 5], [3, 4, 5], list(range(6))]


# ------------------------------------------------------------------------------------------------ sharding, RoPE


def _rope_reference(t: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """TE's non-interleaved RoPE in float64 on ``[n, h, d]`` at ``positions``: channels past ``rot_dim`` pass."""
    rot = freqs.shape[-1]
    ang = freqs[positions.long(), 0, 0].double()[:, None, :]  # [n, 1, rot]
    x, rest = t[..., :rot].double(), t[..., rot:].double()
    half = torch.cat([-x[..., rot // 2:], x[..., : rot // 2]], dim=-1)
    return torch.cat([x * ang.cos() + half * ang.sin(), rest], dim=-1)


def _sharding_and_rope(world: int) -> float:
    group = cpscope.new_cp_groups([world], hierarchical=True)[world]
    r = dist.get_rank(group)
    g = torch.Generator().manual_seed(world)
    worst = 0.0
    # dense: [b, s, ...] with s = 6·cp; the zigzag index of the reference, and back
    s = 6 * world
    x = torch.randn(2, s, 3, generator=g)
    local = cpscope.zigzag_shard(x, seq_dim=1, group=group)
    assert torch.equal(local, x[:, zigzag_index([0, s], world, r)])
    assert torch.equal(cpscope.zigzag_unshard(local, seq_dim=1, group=group), x)
    # thd: documents of multiples of 2·cp, positions restarting per document
    cu = [0, 2 * world, 2 * world + 6 * world, 2 * world + 6 * world + 4 * world]
    cu_t = torch.tensor(cu, dtype=torch.int32)
    idx = zigzag_index(cu, world, r)
    pos_full = torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:])])
    with cpscope.runtime_cp(group):
        assert torch.equal(cpscope.zigzag_position_ids(cu_t), pos_full[idx])
    y = torch.randn(cu[-1], 2, 4, generator=g)
    local = cpscope.zigzag_shard(y, seq_dim=0, cu_seqlens=cu_t, group=group)
    assert torch.equal(local, y[idx])
    assert torch.equal(cpscope.zigzag_unshard(local, seq_dim=0, cu_seqlens=cu_t, group=group), y)
    # RoPE, forward and gradient, thd and bshd, rot_dim 6 of 8 channels
    inv = 1.0 / 10000 ** (torch.arange(0, 6, 2, dtype=torch.float64) / 6)
    ang = torch.outer(torch.arange(8 * world, dtype=torch.float64), inv)
    freqs = torch.cat([ang, ang], dim=-1)[:, None, None, :].float()  # [max_seqlen, 1, 1, 6]
    for fmt in ("thd", "bshd"):
        n = cu[-1] if fmt == "thd" else s
        full = torch.randn(n, 3, 8, generator=g, dtype=torch.float64)
        dout = torch.randn(n, 3, 8, generator=g, dtype=torch.float64)
        rows = idx if fmt == "thd" else zigzag_index([0, s], world, r)
        positions = pos_full if fmt == "thd" else torch.arange(s)
        ref_in = full.clone().requires_grad_(True)
        ref = _rope_reference(ref_in, freqs, positions)
        ref.backward(dout)
        t = full[rows].float().requires_grad_(True)
        with cpscope.runtime_cp(group):
            if fmt == "thd":
                out = cpscope.apply_rotary_pos_emb(t, freqs, qkv_format="thd", cu_seqlens=cu_t)
            else:
                out = cpscope.apply_rotary_pos_emb(t[None], freqs, qkv_format="bshd")[0]
        out.backward(dout[rows].float())  # outside the scope
        for got, want in ((out, ref[rows]), (t.grad, ref_in.grad[rows])):
            err = float((got.double() - want).abs().max())
            assert err <= 1e-5, (fmt, world, err)  # RoPE computes in fp32
            worst = max(worst, err)
    return worst


@pytest.mark.parametrize("world", WORLDS)
def test_sharding_positions_and_rope_at_cp_world(world: int) -> None:
    assert max(run_ranks(world, _sharding_and_rope, world)) <= 1e-5


# ------------------------------------------------------------------------------------------------ a planned step


def _planned_step(world: int, capacity: int) -> list[int]:
    """The planner over every divisor of the world, the loop, the example GPT (cpscope RoPE and attention), under
    the sentinel checking every microbatch: loss and gradients equal the single-process float64 reference."""
    from cpscope.hybrid import plan_hybrid
    from cpscope.hybrid._problem import divisors
    from cpscope.train._loop import (allreduce_gradients, allreduce_sum, global_num_targets, prepare_microbatches,
                                    run_microbatches)
    from tests.hybrid.test_loop import SMALL, reference_loss, rel_err, th

    cpscope.set_backward_read_check(True)
    cfg = th.TrainConfig(mode="hybrid", **{**SMALL, "capacity": capacity})
    groups = cpscope.new_cp_groups(divisors(world))
    docs = th.make_documents(cfg, 1)
    plan = plan_hybrid([d.numel() for d in docs], world, capacity, cost=th.DEMO_COST)
    model = th.build_model(cfg, torch.device("cpu"))
    ref = copy.deepcopy(model).double()
    with cpscope.sentinel(every=1) as sentinel:
        mbs = prepare_microbatches(plan.microbatches_for_rank(dist.get_rank()), docs, groups)
        n = global_num_targets(mbs, dp_group=dist.group.WORLD)
        local = run_microbatches(model, mbs, num_targets=n, dp_group=dist.group.WORLD)
    allreduce_gradients(model, dp_group=dist.group.WORLD)
    loss = allreduce_sum(local, group=dist.group.WORLD).item() / n
    ref_loss = reference_loss(ref, docs)
    ref_loss.backward()
    assert abs(loss - ref_loss.item()) <= 1e-6 * abs(ref_loss.item()), (loss, ref_loss.item())
    errs = [rel_err(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())]
    assert max(errs) <= 1e-5, max(errs)
    summary = sentinel.summary()
    assert summary.mismatches == 0 and summary.sampled == len(mbs) and sum(summary.checks.values()) > 0
    return sorted(set(plan.sizes_used))


@pytest.mark.parametrize("world,capacity", [(3, 48), (5, 32), (6, 32)])
def test_planned_hybrid_step_at_cp_world(world: int, capacity: int) -> None:
    used = run_ranks(world, _planned_step, world, capacity)[0]
    assert any(c > 1 and c & (c - 1) for c in used), used  # a non-power-of-two CP size ran
