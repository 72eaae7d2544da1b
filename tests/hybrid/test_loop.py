"""The hybrid microbatch loop (cpscope.train._loop): labels, padding, sharding, binding, loss normalisation.

The numerical checks compare against an independent float64 single-process reference: the same GPT weights run
document by document with hand-written RoPE and naive causal attention (no cpscope sharding, RoPE or attention),
next-token targets made per document, loss = mean over every real target of the global batch.
"""
from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import cpscope
import cpscope.hybrid._cheapest_variant
from cpscope.train._loop import (
    IGNORE_INDEX,
    allreduce_gradients,
    allreduce_sum,
    global_num_targets,
    next_token_labels,
    pack_documents,
    prepare_microbatch,
    prepare_microbatches,
    run_microbatches,
)
from tests.distributed import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import train_hybrid as th  # noqa: E402

# Small enough for 2 cores; capacity 32 forces a mix of CP1 / CP2 / CP4 on documents of up to 128 tokens.
SMALL = dict(docs_per_step=8, median_len=40, sigma=0.9, min_len=6, max_len=128, capacity=32, vocab_size=64,
             hidden=32, n_layers=2, n_heads=4, n_kv_heads=2)


# ---------------------------------------------------------------------------------------------------------------
# The independent reference


def _rope_ref(x: torch.Tensor, base: float) -> torch.Tensor:
    """Non-interleaved RoPE at positions 0..L-1 of one document; x [L, h, d]."""
    L, _, d = x.shape
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.outer(torch.arange(L, dtype=torch.float64), inv)  # [L, d/2]
    cos, sin = ang.cos()[:, None, :].to(x.dtype), ang.sin()[:, None, :].to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _doc_logits_ref(model, ids: torch.Tensor) -> torch.Tensor:
    """The GPT's logits for one whole document, with naive attention and hand RoPE."""
    cfg = model.cfg
    h, hkv, d = cfg.n_heads, cfg.kv_heads, cfg.head_dim
    L = ids.numel()
    x = model.embed(ids)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    for blk in model.blocks:
        q, k, v = blk.qkv(blk.norm1(x)).split([h * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.view(L, h, d), k.view(L, hkv, d), v.view(L, hkv, d)
        q, k = _rope_ref(q, cfg.rope_base), _rope_ref(k, cfg.rope_base)
        k, v = k.repeat_interleave(h // hkv, dim=1), v.repeat_interleave(h // hkv, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        p = s.masked_fill(~causal, float("-inf")).softmax(-1)
        o = torch.einsum("hqk,khd->qhd", p, v).reshape(L, h * d)
        x = x + blk.proj(o)
        x = x + blk.fc2(F.gelu(blk.fc1(blk.norm2(x)), approximate="tanh"))
    return model.lm_head(model.norm(x))


def reference_loss(model, docs: list[torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy over every real target of the batch (one process, no CP, no padding)."""
    total, count = 0.0, 0
    for doc in docs:
        logits = _doc_logits_ref(model, doc)
        total = total + F.cross_entropy(logits[:-1], doc[1:], reduction="sum")
        count += doc.numel() - 1
    return total / count


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _zigzag_ref(cu: list[int], cp: int, r: int) -> list[int]:
    out = []
    for a, b in zip(cu[:-1], cu[1:]):
        c = (b - a) // (2 * cp)
        out += list(range(a + r * c, a + (r + 1) * c)) + list(range(a + (2 * cp - 1 - r) * c, a + (2 * cp - r) * c))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Pure logic (no process group)


def test_next_token_labels_stop_at_document_ends():
    ids = torch.tensor([5, 6, 7, 8, 9, 10])
    assert next_token_labels(ids, [0, 3, 3, 5, 6]).tolist() == [6, 7, -100, 9, -100, -100]


def test_next_token_labels_rejects_mismatched_offsets():
    with pytest.raises(ValueError, match=r"shape \(4,\).*cu_seqlens\[-1\]=5"):
        next_token_labels(torch.arange(4), [0, 5])


def test_pack_documents_rejects_empty():
    with pytest.raises(ValueError, match="at least one document"):
        pack_documents([])
    with pytest.raises(ValueError, match=r"\(1, \(0,\)\)"):
        pack_documents([torch.arange(3), torch.arange(0)])


def test_prepare_microbatch_cp1_pads_to_two_and_counts_targets():
    docs = [torch.arange(10, 15), torch.arange(20, 23)]
    mb = prepare_microbatch(docs, cp=1, group=None, seqs=(4, 7))
    assert mb.cu_seqlens.tolist() == [0, 6, 10] and mb.cu_seqlens.dtype == torch.int32 and mb.max_seqlen == 6
    assert mb.input_ids.tolist() == [10, 11, 12, 13, 14, 0, 20, 21, 22, 0]
    assert mb.labels.tolist() == [11, 12, 13, 14, -100, -100, 21, 22, -100, -100]
    assert mb.num_targets == 6 and mb.seqs == (4, 7) and mb.group is None


def test_prepare_microbatch_cp_contradicting_group_raises():
    with pytest.raises(ValueError, match="local_cp_size=2"):
        prepare_microbatch([torch.arange(8)], cp=2, group=None)


_L0 = {"cpscope._variants", "cpscope._hooks", "cpscope._checks", "cpscope.backward_check", "cpscope._version"}
_LOAD_HYBRID_ALONE = """
import importlib, pkgutil, sys, types
pkg = types.ModuleType("cpscope"); pkg.__path__ = [sys.argv[1]]; sys.modules["cpscope"] = pkg  # root not run
import cpscope.hybrid as h
for m in pkgutil.iter_modules(h.__path__):
    importlib.import_module("cpscope.hybrid." + m.name)
print(" ".join(sorted(n for n in sys.modules if n.split(".")[0] in ("torch", "cpscope"))))
"""


def test_hybrid_package_is_the_pure_planner():
    """cpscope.hybrid is numpy only: every module of it, loaded without the package root (which imports torch),
    loads no torch module and no cpscope module outside hybrid and L0; and no import in its files — lazy ones
    inside functions included — names torch, torch.distributed or a cpscope module above L0."""
    import ast
    import subprocess

    root = Path(cpscope.__file__).resolve().parent
    out = subprocess.run([sys.executable, "-c", _LOAD_HYBRID_ALONE, str(root)], capture_output=True, text=True,
                         check=True)
    loaded = out.stdout.split()
    assert "cpscope.hybrid._cheapest_variant" in loaded and "cpscope.hybrid._planner" in loaded, loaded
    assert [m for m in loaded if m.split(".")[0] == "torch"] == []
    assert [m for m in loaded if m != "cpscope" and not m.startswith("cpscope.hybrid") and m not in _L0] == []
    for path in sorted((root / "hybrid").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ("cpscope." if node.level >= 2 else "cpscope.hybrid." if node.level == 1 else "")
                names = [base + (node.module or "")] if node.module else [base + a.name for a in node.names]
            else:
                continue
            for name in names:
                assert name.split(".")[0] != "torch", (path.name, node.lineno, name)
                if name.startswith("cpscope.") and not name.startswith("cpscope.hybrid"):
                    assert name in _L0, (path.name, node.lineno, name)
    for name in ("run_microbatches", "run_step", "auto_chooser", "use_calibration", "cached_cost"):
        # the loop, the sync and comm="auto"'s run-time glue live in cpscope.train only
        assert not hasattr(cpscope.hybrid, name) and not hasattr(cpscope.hybrid._cheapest_variant, name), name


def test_run_microbatches_needs_a_positive_count():
    with pytest.raises(ValueError, match="got 0"):
        run_microbatches(lambda *a, **k: None, [], num_targets=0, dp_group=None)


def test_the_reduction_group_is_always_named():
    """No default that would mean the world: dp_group / group is required; None is this rank alone."""
    mb = prepare_microbatch([torch.arange(6)], cp=1, group=None)
    model = torch.nn.Linear(2, 2)
    for call in (lambda: global_num_targets([mb]), lambda: allreduce_gradients(model), lambda: allreduce_sum(1),
                 lambda: run_microbatches(model, [mb], num_targets=5)):
        with pytest.raises(TypeError, match="dp_group|group"):
            call()
    assert global_num_targets([mb], dp_group=None) == 5 and allreduce_sum(3, group=None).item() == 3
    with pytest.raises(ValueError, match="dp_group must be a torch.distributed ProcessGroup.*got str 'world'"):
        global_num_targets([mb], dp_group="world")
    with pytest.raises(ValueError, match="dp_group is GroupMember.NON_GROUP_MEMBER"):
        allreduce_gradients(model, dp_group=dist.GroupMember.NON_GROUP_MEMBER)


def test_single_process_step_matches_reference_float64():
    """CP1 only, no torch.distributed: the loop's loss and gradients equal the reference's."""
    cfg = th.TrainConfig(mode="single", dtype="float64", **SMALL)
    docs = th.make_documents(cfg, 0)
    model = th.build_model(cfg, torch.device("cpu"))
    ref = copy.deepcopy(model)
    plan = th.make_plan(cfg, [d.numel() for d in docs], 1)
    mbs = prepare_microbatches(plan.microbatches_for_rank(0), docs, {1: None})
    assert len(mbs) > 1  # several microbatches: accumulation is exercised
    n = global_num_targets(mbs, dp_group=None)  # one process: this rank alone
    assert n == sum(d.numel() - 1 for d in docs)
    loss = run_microbatches(model, mbs, num_targets=n, dp_group=None).item() / n
    ref_loss = reference_loss(ref, docs)
    ref_loss.backward()
    assert abs(loss - ref_loss.item()) <= 1e-12 * abs(ref_loss.item())
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) <= 1e-8, name  # float64; summation order differs


# ---------------------------------------------------------------------------------------------------------------
# On 4 gloo ranks


def _cp2_microbatch_pairs_tokens_with_targets():
    """Each rank's local (id, label) pairs are exactly the zigzag cut of the full padded (id, next id) stream."""
    cpscope.set_backward_read_check(True)
    groups = cpscope.new_cp_groups([1, 2, 4])
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(1, 50, (n,), generator=g) for n in (5, 16, 1, 9)]  # lengths not multiples of 2·cp
    out = {}
    for cp in (2, 4):
        mb = prepare_microbatch(docs, cp=cp, group=groups[cp])
        r = dist.get_rank(groups[cp])
        # reference: pad each document to a multiple of 2·cp by hand, targets inside the real document only
        ids_full, lab_full, cu = [], [], [0]
        for d in docs:
            n = d.numel()
            pad = -n % (2 * cp)
            ids_full += d.tolist() + [0] * pad
            lab_full += d[1:].tolist() + [IGNORE_INDEX] * (1 + pad)
            cu.append(cu[-1] + n + pad)
        idx = _zigzag_ref(cu, cp, r)
        assert mb.cu_seqlens.tolist() == cu and mb.max_seqlen == max(b - a for a, b in zip(cu[:-1], cu[1:]))
        assert mb.input_ids.tolist() == [ids_full[i] for i in idx]
        assert mb.labels.tolist() == [lab_full[i] for i in idx]
        counts = allreduce_sum(mb.num_targets, group=groups[cp]).item()
        assert counts == sum(d.numel() - 1 for d in docs)  # each real target on exactly one rank of the group
        out[cp] = mb.num_targets
    return out


def test_microbatch_sharding_keeps_targets_with_their_tokens():
    run_ranks(4, _cp2_microbatch_pairs_tokens_with_targets)


def _plan_group_mismatch_raises():
    cpscope.set_backward_read_check(True)
    groups = cpscope.new_cp_groups([1, 2, 4])
    from cpscope.hybrid import Microbatch

    me = dist.get_rank()
    wrong_block = 1 - me // 2  # the other pair of ranks
    with pytest.raises(ValueError, match=r"planned on global ranks \[.*\] at CP 2.*has ranks"):
        prepare_microbatches([Microbatch(2, wrong_block, (0,), 4, 0.0)], [torch.arange(8)], groups)
    with pytest.raises(ValueError, match=r"CP size 8 but groups only has sizes \[1, 2, 4\]"):
        prepare_microbatches([Microbatch(8, 0, (0,), 4, 0.0)], [torch.arange(8)], groups)
    return True


def test_plan_that_does_not_match_the_groups_raises_before_any_collective():
    assert run_ranks(4, _plan_group_mismatch_raises) == [True] * 4


def _allreduce_gradients_sums_and_fills_missing():
    cpscope.set_backward_read_check(True)
    me = dist.get_rank()
    a = torch.nn.Parameter(torch.zeros(3))
    b = torch.nn.Parameter(torch.zeros(2, 2))
    c = torch.nn.Parameter(torch.zeros(2))  # no gradient on any rank: stays None (an optimizer skips it)
    d = torch.nn.Parameter(torch.zeros(5, dtype=torch.float64))  # another dtype, and buckets of one tensor each
    a.grad = torch.full((3,), float(me + 1))
    d.grad = torch.full((5,), 0.5, dtype=torch.float64)
    if me % 2 == 0:  # b has no grad on odd ranks: it must count as zeros, not hang or be skipped
        b.grad = torch.ones(2, 2) * me
    allreduce_gradients([a, b, c, d], dp_group=dist.group.WORLD, bucket_bytes=16)
    assert a.grad.tolist() == [10.0] * 3
    assert b.grad.tolist() == [[2.0, 2.0], [2.0, 2.0]]
    assert c.grad is None
    assert d.grad.tolist() == [2.0] * 5 and d.grad.dtype == torch.float64
    return True


def test_allreduce_gradients_sums_and_treats_missing_grads_as_zero():
    assert run_ranks(4, _allreduce_gradients_sums_and_fills_missing) == [True] * 4


def _one_step_grads_match_reference(mode: str, step: int):
    cpscope.set_backward_read_check(True)  # the GPT / loop path must never read the scope in backward
    cfg = th.TrainConfig(mode=mode, **SMALL)
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = cpscope.new_cp_groups([1, 2, 4])
    docs = th.make_documents(cfg, step)
    plan = th.make_plan(cfg, [d.numel() for d in docs], world)
    model = th.build_model(cfg, torch.device("cpu"))  # fp32
    ref = copy.deepcopy(model).double()

    mbs = prepare_microbatches(plan.microbatches_for_rank(rank), docs, groups)
    dp = dist.group.WORLD
    n = global_num_targets(mbs, dp_group=dp)
    local = run_microbatches(model, mbs, num_targets=n, dp_group=dp)
    allreduce_gradients(model, dp_group=dp)
    loss = allreduce_sum(local, group=dp).item() / n

    ref_loss = reference_loss(ref, docs)
    ref_loss.backward()
    assert abs(loss - ref_loss.item()) <= 1e-6 * abs(ref_loss.item()), (loss, ref_loss.item())
    errs = {name: rel_err(p.grad, q.grad) for (name, p), q in zip(model.named_parameters(), ref.parameters())}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= 1e-5, (worst, errs[worst])
    return sorted({mb.cp for mb in mbs})


@pytest.mark.parametrize("mode,step", [("hybrid", 0), ("hybrid", 2), ("static2", 0), ("static4", 1)])
def test_one_step_gradients_equal_single_rank_float64_reference(mode, step):
    cps = run_ranks(4, _one_step_grads_match_reference, mode, step)
    used = set().union(*map(set, cps))
    expected = {"hybrid": None, "static2": {2}, "static4": {4}}[mode]
    if expected is None:
        assert len(used) >= 2, used  # a real mix of CP sizes (the plan for these steps)
    else:
        assert used == expected


# ---------------------------------------------------------------------------------------------------------------
# The examples run (each checks every microbatch's loss and gradients against the same documents without CP,
# examples/_check.py, and raises on a mismatch)


def _run_example(name: str):
    import importlib

    cpscope.set_backward_read_check(True)  # the examples' backward never reads the scope either
    importlib.import_module(name).main()
    return True


@pytest.mark.parametrize("name,world", [("microbatch_loop", 4), ("decorated_forward", 2)])
def test_examples_run_on_the_rank_pool(name, world):
    assert run_ranks(world, _run_example, name) == [True] * world


# ---------------------------------------------------------------------------------------------------------------
# The planned communication variant is bound per microbatch and gives the same step


def _planned_variant_is_bound(comm: str):
    from cpscope.attention import _dispatch

    cfg = th.TrainConfig(mode="hybrid", **SMALL)
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = cpscope.new_cp_groups([1, 2, 4])
    docs = th.make_documents(cfg, 0)
    plan = th.make_plan(cfg, [d.numel() for d in docs], world)
    planned = [mb._replace(comm=comm) for mb in plan.microbatches_for_rank(rank)]
    model = th.build_model(cfg, torch.device("cpu"))
    ref = copy.deepcopy(model).double()
    ran: list[int] = []
    real = _dispatch._RUNNERS[comm]
    _dispatch._RUNNERS[comm] = lambda *a, **k: ran.append(1) or real(*a, **k)
    try:
        mbs = prepare_microbatches(planned, docs, groups)
        assert all(mb.comm == comm for mb in mbs)
        dp = dist.group.WORLD
        n = global_num_targets(mbs, dp_group=dp)
        loss = allreduce_sum(run_microbatches(model, mbs, num_targets=n, dp_group=dp), group=dp).item() / n
        allreduce_gradients(model, dp_group=dp)
    finally:
        _dispatch._RUNNERS[comm] = real
    ref_loss = reference_loss(ref, docs)
    ref_loss.backward()
    assert abs(loss - ref_loss.item()) <= 1e-6 * abs(ref_loss.item()), (loss, ref_loss.item())
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) <= 1e-5, name
    return len(ran), sum(mb.cp > 1 for mb in mbs)


def test_run_microbatches_binds_the_planned_variant():
    res = run_ranks(4, _planned_variant_is_bound, "all_gather")
    assert sum(r[1] for r in res) > 0 and all(r[0] >= r[1] for r in res), res  # every CP>1 microbatch ran it
