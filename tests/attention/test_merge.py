"""Fused row kernels (merge_rows_, rows_add_) vs float64 references, torch fallback and Triton (interpreter, on CPU);
the ring's diagonal split by documents, and ring runs through every dQ assembly path."""
from __future__ import annotations

import dataclasses
import importlib
import math
import os

import pytest
import torch

import cpscope
from cpscope.attention import _merge as merge
from cpscope.attention._merge import merge_rows_, rows_add_
from cpscope.attention._policy import kernel_policy, set_kernel_policy, use_kernel_policy
from cpscope.attention._ring_plan import RingPlan, _doc_split
from tests.attention.test_ring_cpu import H, TOL, check_one
from tests.distributed import run_ranks

NEG = float("-inf")


def _has_triton() -> bool:
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    """Run the test on the torch fallback, and on the Triton kernels under Triton's CPU interpreter."""
    if request.param == "triton":
        if not _has_triton():
            pytest.skip("triton is not importable")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        merge._kernels.cache_clear()  # jit under the interpreter
        with use_kernel_policy(triton_on_cpu=True):
            yield "triton"
        merge._kernels.cache_clear()
    else:
        yield "torch"


# ---------------------------------------------------------------------------------------------------------------
# references (float64, no code shared with cpscope)


def _ref_merge(oa, la, ob, lb):
    """float64 (out, lse) of two partial blocks: batched ``[b, s, h, d]`` / ``[b, h, s]``."""
    l2 = torch.stack([la.double(), lb.double()])  # [2, b, h, s]
    lse = torch.logsumexp(l2, dim=0)
    w = torch.softmax(l2, dim=0).nan_to_num(0.0)  # both -inf: weights 0
    w = w.transpose(-1, -2).unsqueeze(-1)  # [2, b, s, h, 1]
    out = w[0] * oa.double() + w[1] * torch.where(w[1] > 0, ob.double(), 0.0)
    return out, lse


def _ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mant = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52}[dtype]
    e = torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -14)))
    return torch.pow(2.0, e - mant)


def _assert_close(got: torch.Tensor, want: torch.Tensor, backend: str) -> None:
    """Within one rounding of ``got``'s dtype (half an ulp; a full one under the interpreter, which truncates bf16)."""
    assert not torch.isnan(got).any()
    k = 1.0 if backend == "triton" and got.dtype == torch.bfloat16 else 0.5
    tol = k * _ulp(want, got.dtype) + (1e-6 if got.dtype == torch.float32 else 1e-12)
    if got.dtype in (torch.bfloat16, torch.float16):
        tol = tol + 1e-6 * want.abs()  # the fp32 math before the one rounding
    err = (got.double() - want).abs()
    assert (err <= tol).all(), f"max err {err.max().item():.3g} (dtype {got.dtype}, {backend})"


def _assert_lse(got: torch.Tensor, want: torch.Tensor) -> None:
    inf = torch.isneginf(want)
    assert torch.equal(torch.isneginf(got), inf)
    tol = 1e-12 if got.dtype == torch.float64 else 2e-6
    assert ((got.double()[~inf] - want[~inf]).abs() <= tol * (1 + want[~inf].abs())).all()


def _with_neg_inf(la: torch.Tensor, lb: torch.Tensor, oa: torch.Tensor, ob: torch.Tensor, rows_b: torch.Tensor):
    """Mark some rows key-less (lse -inf, out 0): only a, only b, and both; ``rows_b`` maps block rows to acc rows."""
    lb[..., 0, 0] = NEG  # block row 0, head 0: b saw nothing
    ob[..., 0, 0, :] = 0.0
    r1 = int(rows_b[1])
    la[..., 0, r1] = NEG  # acc row of block row 1, head 0: a saw nothing
    oa[..., r1, 0, :] = 0.0
    r2 = int(rows_b[2])
    la[..., -1, r2] = NEG  # both saw nothing: last head of block row 2
    lb[..., -1, 2] = NEG
    oa[..., r2, -1, :] = 0.0
    ob[..., 2, -1, :] = 0.0


# ---------------------------------------------------------------------------------------------------------------
# merge_rows_


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("rows", ["all", "range", "slice"])
def test_merge_dense(backend, dtype, rows):
    g = torch.Generator().manual_seed(1)
    b, s, h, d = 3, 10, 5, 12  # b > 1, heads and head dim not powers of two
    n = s if rows == "all" else 4
    start = 0 if rows == "all" else 5
    sel = None if rows == "all" else ((start, n) if rows == "range" else slice(start, start + n))
    # non-contiguous views everywhere: out_acc a transposed [b, h, s, d] buffer, lse_acc a transposed [b, s, h]
    # buffer, out_b a head slice of a wider tensor, lse_b a strided slice
    oa = torch.randn(b, h, s, d, generator=g).to(dtype).transpose(1, 2)
    la = (3 * torch.randn(b, s, h, generator=g, dtype=torch.float64)).to(merge._acc_dtype(oa)).transpose(1, 2)
    ob = torch.randn(b, n, h + 2, d, generator=g).to(dtype)[:, :, 1:h + 1]
    lb = (3 * torch.randn(b, h, 2 * n, generator=g, dtype=torch.float64)).to(la.dtype)[..., ::2]
    _with_neg_inf(la, lb, oa, ob, torch.arange(start, start + n))
    want_o, want_l = _ref_merge(oa[:, start:start + n], la[..., start:start + n], ob, lb)
    before_o, before_l = oa.clone(), la.clone()
    merge_rows_(oa, la, ob, lb, rows=sel)
    _assert_close(oa[:, start:start + n], want_o, backend)
    _assert_lse(la[..., start:start + n], want_l)
    rest = torch.ones(s, dtype=torch.bool)
    rest[start:start + n] = False
    assert torch.equal(oa[:, rest], before_o[:, rest]) and torch.equal(la[..., rest], before_l[..., rest])
    # a row whose block saw no key keeps out_acc bit for bit; a row nobody saw stays 0 / -inf
    assert torch.equal(oa[:, start, 0], before_o[:, start, 0])
    assert (oa[:, start + 2, -1] == 0).all() and torch.isneginf(la[:, -1, start + 2]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_merge_varlen_index_rows(backend, dtype):
    g = torch.Generator().manual_seed(2)
    t, h, d = 13, 4, 8
    idx = torch.tensor([1, 3, 4, 8, 9, 12])
    oa = torch.randn(t, h, d, generator=g).to(dtype)
    la = (2 * torch.randn(h, t, generator=g, dtype=torch.float64)).to(merge._acc_dtype(oa))
    ob = torch.randn(len(idx), h, d, generator=g).to(dtype)
    lb = (2 * torch.randn(h, len(idx), generator=g, dtype=torch.float64)).to(la.dtype)
    _with_neg_inf(la, lb, oa, ob, idx)
    want_o, want_l = _ref_merge(oa[idx][None], la[:, idx][None], ob[None], lb[None])
    before_o = oa.clone()
    merge_rows_(oa, la, ob, lb, rows=idx)
    _assert_close(oa[idx], want_o[0], backend)
    _assert_lse(la[:, idx], want_l[0])
    rest = torch.ones(t, dtype=torch.bool)
    rest[idx] = False
    assert torch.equal(oa[rest], before_o[rest])


def test_merge_head_chunks_and_one_rounding(backend, monkeypatch):
    """Heads split over several programs (small tile); a bf16 accumulator merged once equals fp32 + one cast."""
    monkeypatch.setattr(merge, "_MAX_TILE", 16)  # BLOCK_D 8 -> 2 heads per program, 3 programs per row
    g = torch.Generator().manual_seed(3)
    t, h, d = 7, 5, 8
    o0, o1 = torch.randn(t, h, d, generator=g), torch.randn(t, h, d, generator=g)
    l0, l1 = torch.randn(h, t, generator=g), torch.randn(h, t, generator=g)
    acc32, lse32 = o0.clone(), l0.clone()
    merge_rows_(acc32, lse32, o1, l1)
    want_o, want_l = _ref_merge(o0[None], l0[None], o1[None], l1[None])
    _assert_close(acc32, want_o[0], backend)
    _assert_lse(lse32, want_l[0])
    acc16, lse16 = o0.bfloat16(), l0.clone()
    merge_rows_(acc16, lse16, o1.bfloat16(), l1)
    want16 = _ref_merge(o0.bfloat16()[None], l0[None], o1.bfloat16()[None], l1[None])[0][0]
    _assert_close(acc16, want16, backend)


def test_merge_empty_block_is_a_no_op(backend):
    oa, la = torch.randn(4, 2, 8), torch.randn(2, 4)
    before = oa.clone(), la.clone()
    merge_rows_(oa, la, torch.zeros(0, 2, 8), torch.zeros(2, 0), rows=torch.zeros(0, dtype=torch.long))
    assert torch.equal(oa, before[0]) and torch.equal(la, before[1])


def test_merge_bad_inputs():
    oa, la = torch.randn(6, 2, 8), torch.randn(2, 6)
    ob, lb = torch.randn(3, 2, 8), torch.randn(2, 3)
    with pytest.raises(ValueError, match=r"length=2\) must select the block's 3 rows"):
        merge_rows_(oa, la, ob, lb, rows=(0, 2))
    with pytest.raises(ValueError, match=r"start=4, length=3\).*accumulators' 6"):
        merge_rows_(oa, la, ob, lb, rows=(4, 3))
    with pytest.raises(ValueError, match="one entry|1-D int64 tensor of 3 entries"):
        merge_rows_(oa, la, ob, lb, rows=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="inconsistent shapes"):
        merge_rows_(oa, la, torch.randn(3, 3, 8), torch.randn(3, 3), rows=(0, 3))
    with pytest.raises(ValueError, match="must be fp32 or fp64"):
        merge_rows_(oa, la.bfloat16(), ob, lb, rows=(0, 3))
    with pytest.raises(ValueError, match="expects out"):
        merge_rows_(oa, la[None], ob, lb)


# ---------------------------------------------------------------------------------------------------------------
# rows_add_


@pytest.mark.parametrize("acc_dtype,val_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                                 (torch.float32, torch.float32), (torch.float64, torch.float64),
                                                 (torch.float16, torch.float32)])
def test_rows_add(backend, acc_dtype, val_dtype):
    g = torch.Generator().manual_seed(4)
    acc = torch.randn(11, 3, 6, generator=g).to(acc_dtype)
    idx = torch.tensor([10, 0, 4, 7], dtype=torch.int32)
    val = torch.randn(4, 3, 6, generator=g).to(val_dtype)
    want = acc.double()
    want[idx.long()] += val.double()
    assert rows_add_(acc, idx, val) is acc
    _assert_close(acc, want, backend)


def test_rows_add_strided_views(backend):
    """Rows that are not contiguous runs (a head slice) take the fallback; row-contiguous views with a row stride
    (a slice of a wider buffer) take the kernel; both exact."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(9, 4, 8, generator=g)
    idx = torch.tensor([2, 5, 7])
    val = torch.randn(6, 3, 8, generator=g)[::2]  # row stride 48, rows contiguous
    for acc in (base.clone()[:, ::2], base.clone()[:, :3]):  # every other head (fallback); row stride 32 (kernel)
        v = val[:, :acc.shape[1]]
        want = acc.double().clone()
        want[idx] += v.double()
        rows_add_(acc, idx, v)
        _assert_close(acc, want, backend)


def test_rows_add_bad_inputs():
    acc = torch.zeros(5, 2, 3)
    with pytest.raises(ValueError, match=r"one entry per row of val \(2\)"):
        rows_add_(acc, torch.tensor([0, 1, 2]), torch.ones(2, 2, 3))
    with pytest.raises(ValueError, match="do not match rows of acc"):
        rows_add_(acc, torch.tensor([0, 1]), torch.ones(2, 3, 3))


# ---------------------------------------------------------------------------------------------------------------
# the ring's diagonal split


def _cu(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return tuple(out)


def test_doc_split_balances_causal_work():
    cp = 2
    # local lengths 8, 2, 2, 6, 2: squares 64 | 4 + 4 + 36 + 4 -> cut after the first document; the longer range
    # (12 tokens) runs first
    parts = _doc_split(_cu([16, 4, 4, 12, 4]), cp, torch.device("cpu"))
    assert [p.rows for p in parts] == [(8, 20), (0, 8)]
    assert parts[1].varlen.cu_q.tolist() == [0, 8] and parts[1].varlen.max_q == 8
    assert parts[0].varlen.cu_q.tolist() == [0, 2, 4, 10, 12] and parts[0].varlen.max_k == 6
    assert all(p.varlen.cu_q is p.varlen.cu_k for p in parts)  # one offsets tensor (cuDNN causal needs it)
    # local 6, 2, 2 (36 | 8): the first range is the longer one and stays first
    assert [p.rows for p in _doc_split(_cu([12, 4, 4]), cp, torch.device("cpu"))] == [(0, 6), (6, 10)]
    # empty documents never make an empty piece; one non-empty document cannot be split
    parts = _doc_split(_cu([0, 8, 0, 8, 0]), cp, torch.device("cpu"))
    assert [p.rows for p in parts] == [(0, 4), (4, 8)]
    assert _doc_split(_cu([0, 8, 0]), cp, torch.device("cpu")) is None
    assert _doc_split(_cu([8]), cp, torch.device("cpu")) is None


def test_diag_parts_choice():
    def plan(lens, **kw):
        return RingPlan(varlen=True, causal=True, scale=1.0, rank=0, size=2, cu=_cu(lens), device=torch.device("cpu"),
                        **kw)

    by_docs = plan([8, 8]).diag_parts(4, 2)
    assert [p.rows for p in by_docs] == [(0, 4), (4, 8)] and by_docs[0].hq == slice(None)
    by_heads = plan([16]).diag_parts(4, 2)
    assert [p.rows for p in by_heads] == [None, None] and [p.hk for p in by_heads] == [slice(0, 1), slice(1, 2)]
    assert len(plan([16]).diag_parts(4, 1)) == 1  # odd k/v heads, one document: one piece
    assert len(plan([0, 16]).diag_parts(4, 1)) == 1
    dense = RingPlan(varlen=False, causal=True, scale=1.0, rank=0, size=2, local_len=8)
    assert [p.hq for p in dense.diag_parts(4, 4)] == [slice(0, 2), slice(2, 4)]


# ---------------------------------------------------------------------------------------------------------------
# ring runs through every dQ assembly path


def _ring_cases(world: int, force_triton: bool) -> float:
    if force_triton:
        os.environ["TRITON_INTERPRET"] = "1"
        old = set_kernel_policy(dataclasses.replace(kernel_policy(), triton_on_cpu=True))
        merge._kernels.cache_clear()
        assert merge._use_triton(torch.zeros(1))  # this rank has triton: the ring runs the interpreted kernels
    try:
        cpscope.set_backward_read_check(True)
        group = cpscope.new_cp_groups([world])[world]
        u = 2 * world
        worst = 0.0
        for i, (causal, lens, heads) in enumerate([
            (True, [2 * u, 2 * u], (H, H // 2)),  # doc split, equal pieces
            (True, [u, u, 6 * u], (H, H)),  # doc split, later range first (dQ, dK, dV joined in token order)
            (True, [6 * u, u, u], (H, H // 4)),  # doc split, earlier range first
            (False, [2 * u, 3 * u], (H, H)),  # doc split, no causal mask: remote full dQ becomes the accumulator
            (True, [4 * u], (H, H // 2)),  # one document: head split
            (True, [4 * u], (H, H // 4)),  # one document, one k/v head: no split
            (True, [0, 3 * u, 0], (H, H)),  # one non-empty document among empty ones: head split
        ]):
            worst = max(worst, check_one(group, "thd", causal, *heads, seed=40 + i, lens=lens))
        for i, (causal, heads) in enumerate([(True, (H, H)), (True, (H, H // 4)), (False, (H, H // 2))]):
            worst = max(worst, check_one(group, "bshd", causal, *heads, seed=50 + i, batch=3))
        worst = max(worst, check_one(group, "thd", True, H, H // 2, dtype=torch.float64, seed=60, lens=[u, 2 * u]))
        return worst
    finally:
        if force_triton:
            set_kernel_policy(old)
            merge._kernels.cache_clear()
            os.environ.pop("TRITON_INTERPRET", None)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_ring_diag_split_and_dq_paths(world, kernels):
    if kernels == "triton" and not _has_triton():
        pytest.skip("triton is not importable")
    errs = run_ranks(world, _ring_cases, world, kernels == "triton")
    assert max(errs) <= TOL[torch.float32] and not math.isnan(max(errs))
