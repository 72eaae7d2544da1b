"""Ring attention on CPU (gloo): output and dQ/dK/dV equal a float64 full-sequence reference cut per rank."""
from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

import cpscope
from cpscope.attention import ContextParallelAttention, context_parallel_attention
from tests.attention._reference import reference_attention, zigzag_index
from tests.distributed import run_ranks

B, H, D = 2, 4, 8
HEADS = [(H, H), (H, H // 2), (H, H // 4)]  # (q heads, k/v heads): MHA, GQA h/2, GQA h/4
TOL = {torch.float32: 2e-5, torch.float64: 1e-10}


def _doc_lens(seed: int, unit: int) -> list[int]:
    rnd = random.Random(seed)
    return [unit * rnd.randint(1, 4) for _ in range(rnd.randint(2, 4))]


def _cu(lens: list[int]) -> list[int]:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def _case(fmt: str, h: int, h_kv: int, seed: int, cu: list[int], seq: int, batch: int = B):
    """Full float64 q/k/v/dout in canonical ``[b, t, h, d]`` (b = 1 for thd)."""
    g = torch.Generator().manual_seed(seed)
    b, t = (1, cu[-1]) if fmt == "thd" else (batch, seq)
    q = torch.randn(b, t, h, D, generator=g, dtype=torch.float64)
    k = torch.randn(b, t, h_kv, D, generator=g, dtype=torch.float64)
    v = torch.randn(b, t, h_kv, D, generator=g, dtype=torch.float64)
    dout = torch.randn(b, t, h, D, generator=g, dtype=torch.float64)
    return q, k, v, dout


def _reference(q, k, v, dout, causal, cu, scale):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = torch.stack([reference_attention(q[i], k[i], v[i], causal=causal, cu=cu, scale=scale) for i in range(len(q))])
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _to_layout(x: torch.Tensor, fmt: str) -> torch.Tensor:  # canonical [b, t, h, d] -> fmt
    return x[0] if fmt == "thd" else (x.transpose(0, 1) if fmt == "sbhd" else x)


def check_one(group, fmt: str, causal: bool, h: int, h_kv: int, *, dtype=torch.float32, seed: int = 0,
              how: str = "scope", scale=None, module=None, batch: int = B, lens=None) -> float:
    """Run one configuration on this rank and assert against the reference; returns the max abs error."""
    cp = group.size() if group is not None else 1
    r = dist.get_rank(group) if group is not None else 0
    seq = 24
    cu = _cu(lens or _doc_lens(seed, 2 * cp)) if fmt == "thd" else [0, seq]
    q, k, v, dout = _case(fmt, h, h_kv, seed, cu, seq, batch)
    ref = _reference(q, k, v, dout, causal, cu if fmt == "thd" else None, scale)
    idx = zigzag_index(cu, cp, r)
    loc = [_to_layout(t[:, idx], fmt).to(dtype).requires_grad_(True) for t in (q, k, v)]
    kw = dict(qkv_format=fmt, causal=causal, softmax_scale=scale)
    if fmt == "thd":
        kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
    if how == "scope":
        with cpscope.runtime_cp(group):
            out = context_parallel_attention(*loc, **kw)
    elif how == "group":
        out = context_parallel_attention(*loc, group=group, **kw)
    else:  # module: bound scope (if group given) else module's build-time scope
        kw.pop("qkv_format"), kw.pop("causal"), kw.pop("softmax_scale")
        if how == "module-scope":
            with cpscope.runtime_cp(group):
                out = module(*loc, **kw)
        else:
            out = module(*loc, **kw)
    assert out.shape == loc[0].shape and out.dtype == dtype
    out.backward(_to_layout(dout[:, idx], fmt).to(dtype))  # outside the scope, as in training
    tol, worst = TOL[dtype], 0.0
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in loc)), ref):
        want = _to_layout(want[:, idx], fmt)
        err = (got.double() - want).abs().max().item() if want.numel() else 0.0
        assert err <= tol, f"{name}: max abs err {err:.3g} > {tol} ({fmt}, causal={causal}, cp={cp}, rank={r}, " \
                           f"heads {h}/{h_kv}, {dtype}, cu={cu})"
        worst = max(worst, err)
    return worst


def _matrix(world: int, fmt: str, causal: bool) -> float:
    cpscope.set_backward_read_check(True)
    group = cpscope.new_cp_groups([world])[world]
    return max(check_one(group, fmt, causal, h, h_kv, seed=s) for s, (h, h_kv) in enumerate(HEADS))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("world", [2, 4])
def test_ring_matches_reference(world, fmt, causal):
    errs = run_ranks(world, _matrix, world, fmt, causal)
    assert max(errs) <= TOL[torch.float32]


def _varlen_route(world: int) -> None:
    from cpscope.attention._policy import use_kernel_policy

    cpscope.set_backward_read_check(True)
    group = cpscope.new_cp_groups([world])[world]
    with use_kernel_policy(dense_as_varlen=True):  # bshd/sbhd as packed varlen rows
        for s, (fmt, causal, (h, h_kv)) in enumerate([("bshd", True, HEADS[1]), ("sbhd", True, HEADS[2]),
                                                      ("bshd", False, HEADS[0])]):
            check_one(group, fmt, causal, h, h_kv, seed=20 + s)
        check_one(group, "bshd", True, H, H // 2, seed=30, batch=1)  # one row: halves are zero-copy slices
        check_one(group, "thd", True, H, H, seed=31, lens=[8 * world])  # one document: likewise
        check_one(group, "thd", True, H, H // 2, seed=32, lens=[0, 4 * world, 0, 2 * world])  # empty documents


@pytest.mark.parametrize("world", [2, 4])
def test_bshd_sbhd_through_varlen_route(world):
    run_ranks(world, _varlen_route, world)


def _float64(fmt: str) -> float:
    cpscope.set_backward_read_check(True)
    group = cpscope.new_cp_groups([2])[2]
    return max(check_one(group, fmt, c, H, H // 2, dtype=torch.float64, seed=7, scale=0.3) for c in (True, False))


@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_float64_inputs_and_custom_scale(fmt):
    run_ranks(2, _float64, fmt)


def _mixed() -> None:
    cpscope.set_backward_read_check(True)
    groups = cpscope.new_cp_groups([1, 2, 4])
    for seed, cp in enumerate((2, 1, 4)):  # same pool, switching CP size per "microbatch"
        for fmt in ("bshd", "thd"):
            check_one(groups[cp], fmt, True, H, H // 2, seed=10 + seed)


def test_mixed_cp2_cp1_cp4_on_one_pool():
    run_ranks(4, _mixed)


def _explicit_and_module() -> None:
    cpscope.set_backward_read_check(True)
    groups = cpscope.new_cp_groups([1, 2, 4])
    check_one(groups[4], "bshd", True, H, H, how="group", seed=3)  # no scope bound at all
    with cpscope.runtime_cp(groups[4]):  # explicit group= beats the active scope
        check_one(groups[2], "thd", True, H, H // 4, how="group", seed=4)
    with cpscope.build_time_cp(groups[2]):
        attn = ContextParallelAttention(qkv_format="thd", causal=True)
    assert attn.build_scope.size == 2
    check_one(groups[2], "thd", True, H, H, how="module", module=attn, seed=5)  # build-time CP2
    check_one(groups[4], "thd", True, H, H, how="module-scope", module=attn, seed=6)  # runtime CP4 wins
    check_one(None, "thd", True, H, H, how="module-scope", module=attn, seed=7)  # runtime_cp(None): CP1


def test_explicit_group_and_module_scope_rules():
    run_ranks(4, _explicit_and_module)


def test_module_validates_its_arguments_at_construction():
    with pytest.raises(ValueError, match="'bhsd'"):
        ContextParallelAttention(qkv_format="bhsd")
    with pytest.raises(ValueError, match="'ring'"):
        ContextParallelAttention(comm="ring")
    attn = ContextParallelAttention(qkv_format="thd")
    with pytest.raises(ValueError, match="'ring'"):  # a call's comm is checked before anything runs
        attn(*(torch.zeros(8, 2, 4) for _ in range(3)), cu_seqlens=torch.tensor([0, 8], dtype=torch.int32),
             comm="ring")


def _compiled_module() -> tuple[list[float], list[float]]:
    cpscope.set_backward_read_check(True)
    groups = cpscope.new_cp_groups([1, 2])
    attn = ContextParallelAttention(qkv_format="bshd", causal=True)
    f = torch.compile(lambda q, k, v: attn(q, k, v) * 2, backend="eager")
    g = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(1, 16, 2, 8, generator=g, dtype=torch.float64) for _ in range(4))
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref_out = 2 * reference_attention(*(t[0] for t in full), causal=True)[None]
    ref_out.backward(dout)
    ref = (ref_out.detach(), *(t.grad for t in full))  # float64 out, dq, dk, dv of the full sequence
    idx = zigzag_index([0, 16], 2, dist.get_rank())
    fwd_errs, grad_errs = [], []
    for group, cut in ((groups[2], idx), (None, slice(None))):
        loc = [t[:, cut].clone().requires_grad_(True) for t in (q, k, v)]
        with cpscope.runtime_cp(group):  # the scope is read outside the compiled region, per call
            out = f(*loc)
        out.backward(dout[:, cut])  # outside the scope
        errs = [(got - want[:, cut]).abs().max().item() for got, want in zip((out, *(t.grad for t in loc)), ref)]
        fwd_errs.append(errs[0])
        grad_errs += errs[1:]
    return fwd_errs, grad_errs


def test_compiled_module_follows_runtime_scope():
    for fwd_errs, grad_errs in run_ranks(2, _compiled_module):
        assert len(fwd_errs) == 2 and max(fwd_errs) < 1e-12
        assert len(grad_errs) == 6 and max(grad_errs) <= TOL[torch.float64], grad_errs  # dq, dk, dv at CP2 and CP1


def test_cp1_without_process_group():
    cpscope.set_backward_read_check(True)
    try:
        for fmt in ("bshd", "sbhd", "thd"):
            check_one(None, fmt, True, H, H // 2, how="group", seed=1)
            check_one(None, fmt, False, H, H, how="scope", seed=2)
    finally:
        cpscope.set_backward_read_check(True)  # back to the default (on)


def _bad_inputs() -> str:
    group = cpscope.new_cp_groups([2])[2]
    x = torch.randn(1, 6, 2, 4)  # local 6 -> global 12, divisible by 4
    odd = torch.randn(1, 5, 2, 4)  # local 5 -> global 10, not divisible by 2*cp = 4
    with pytest.raises(ValueError, match="divisible by 2\\*cp=4"):
        context_parallel_attention(odd, odd, odd, group=group)
    t = torch.randn(6, 2, 4)
    with pytest.raises(ValueError, match="divisible by 2\\*cp=4"):
        context_parallel_attention(t, t, t, qkv_format="thd", cu_seqlens=torch.tensor([0, 6, 12], dtype=torch.int32),
                                   group=group)
    with pytest.raises(ValueError, match="cu_seqlens\\[-1\\]/cp=8"):
        context_parallel_attention(t, t, t, qkv_format="thd", cu_seqlens=torch.tensor([0, 8, 16], dtype=torch.int32),
                                   group=group)
    with pytest.raises(ValueError, match="max_seqlen=8"):
        context_parallel_attention(x, x, x, max_seqlen=8, group=group)
    with pytest.raises(ValueError, match=r"max_seqlen=6 is shorter than the longest document \(8\)"):
        context_parallel_attention(t, t, t, qkv_format="thd", cu_seqlens=torch.tensor([0, 4, 12], dtype=torch.int32),
                                   max_seqlen=6, group=group)
    # the ranks are still in step: a valid call works afterwards
    return str(context_parallel_attention(x, x, x, group=group).shape)


def test_bad_inputs_raise_before_any_collective():
    assert run_ranks(2, _bad_inputs) == ["torch.Size([1, 6, 2, 4])"] * 2


@pytest.mark.parametrize(
    "q_shape,k_shape,kw,match",
    [
        ((1, 4, 4, 8), (1, 4, 3, 8), {}, "multiple of k/v heads"),
        ((1, 4, 4, 8), (1, 6, 4, 8), {}, "every dimension but heads"),
        ((1, 4, 4, 8), (1, 4, 4, 8), {"qkv_format": "bhsd"}, "qkv_format must be one of"),
        ((4, 4, 8), (4, 4, 8), {"qkv_format": "thd"}, "needs cu_seqlens"),
        ((4, 4, 8), (4, 4, 8), {"qkv_format": "bshd"}, "needs 4-D"),
        ((1, 4, 4, 8), (1, 4, 4, 8), {"cu_seqlens": [0, 5]}, r"document 0: 5 real > 4 padded"),
        ((2, 4, 4, 8), (2, 4, 4, 8), {"cu_seqlens": [0, 4]}, "1 documents but cu_seqlens_padded .* has 2"),
        ((1, 4, 4, 8), (1, 4, 4, 8), {"cu_seqlens": [0, 4], "cu_seqlens_padded": [0, 4]},
         "cu_seqlens_padded is only used with qkv_format='thd'"),
        ((4, 4, 8), (4, 4, 8), {"qkv_format": "thd", "cu_seqlens": [0, 3], "cu_seqlens_padded": [0, 2]},
         "3 real > 2 padded"),
        ((1, 4, 4, 8), (1, 4, 4, 8), {"softmax_scale": float("nan")}, "softmax_scale must be a finite number > 0"),
        ((1, 4, 4, 8), (1, 4, 4, 8), {"softmax_scale": float("inf")}, "softmax_scale must be a finite number > 0"),
        ((1, 4, 4, 8), (1, 4, 4, 8), {"softmax_scale": 0.0}, "softmax_scale must be a finite number > 0"),
        ((1, 4, 4, 8), (1, 4, 4, 8), {"softmax_scale": -0.5}, "softmax_scale must be a finite number > 0"),
        ((1, 4, 4, 8), (1, 4, 4, 8), {"softmax_scale": "0.1"}, "softmax_scale must be a finite number > 0"),
        ((4, 4, 8), (4, 4, 8), {"qkv_format": "thd", "cu_seqlens": [0, 2, 6]}, "holds 4 local tokens"),
    ],
)
def test_bad_input_messages(q_shape, k_shape, kw, match):
    q, k = torch.randn(q_shape), torch.randn(k_shape)
    with pytest.raises(ValueError, match=match):
        context_parallel_attention(q, k, k, group=None, **kw)


def test_dtype_and_device_mismatch():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="share a dtype"):
        context_parallel_attention(q, q.double(), q, group=None)
    with pytest.raises(ValueError, match=r"v must have k's heads.*k/v heads 2 vs 1"):
        context_parallel_attention(q, q, q[:, :, :1], group=None)
    with pytest.raises(ValueError, match="not supported on cpu"):
        context_parallel_attention(q.int(), q.int(), q.int(), group=None)


def _comm_misuse() -> None:
    from cpscope.attention._exchange import RingComm

    group = cpscope.new_cp_groups([2])[2]
    comm = RingComm(group, dist.get_rank(group), 2)
    with pytest.raises(RuntimeError, match="wait called before send_recv"):
        comm.wait()
    mine = torch.full((3,), float(dist.get_rank()))
    comm.send_recv([mine])
    with pytest.raises(RuntimeError, match="send_recv called twice"):
        comm.send_recv([mine])
    (got,) = comm.wait()
    assert got.tolist() == [float(1 - dist.get_rank())] * 3
    with pytest.raises(RuntimeError, match="post called without begin"):
        comm.post()
    comm.begin([mine], recv_shapes=[torch.Size([3])])  # the two-phase form exchanges the same way
    with pytest.raises(RuntimeError, match="send_recv called twice"):
        comm.begin([mine])
    comm.post()
    (got,) = comm.wait()
    assert got.tolist() == [float(1 - dist.get_rank())] * 3


def test_ring_comm_misuse_and_exchange():
    run_ranks(2, _comm_misuse)


def test_merge_handles_rows_without_keys():
    from cpscope.attention._merge import merge_rows_

    out_a, out_b = torch.randn(3, 2, 4), torch.randn(3, 2, 4)  # [t, h, d]; lse [h, t]
    lse_a = torch.tensor([[0.5, float("-inf"), float("-inf")], [1.0, 2.0, float("-inf")]])
    lse_b = torch.tensor([[float("-inf"), 0.3, float("-inf")], [1.5, float("-inf"), float("-inf")]])
    out_a[1, 0] = 0.0  # a row without keys has out 0 (block kernels guarantee it)
    out_b[0, 0] = out_b[2] = out_a[2] = 0.0
    out_b[1, 1] = 0.0
    out, lse = out_a.clone(), lse_a.clone()
    merge_rows_(out, lse, out_b, lse_b)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out[0, 0], out_a[0, 0])  # only a saw keys
    torch.testing.assert_close(out[1, 0], out_b[1, 0])  # only b saw keys
    assert lse[0, 2] == float("-inf") and (out[2] == 0).all()  # nobody saw keys
    w = torch.softmax(torch.tensor([1.0, 1.5]), 0)
    torch.testing.assert_close(out[0, 1], w[0] * out_a[0, 1] + w[1] * out_b[0, 1])
    torch.testing.assert_close(lse[1, 0], torch.logaddexp(torch.tensor(1.0), torch.tensor(1.5)))


def test_cpu_varlen_block_matches_per_sequence_reference():
    """Unequal q/k lengths per sequence, bottom-right causal, an empty sequence, GQA."""
    from cpscope.attention._kernels import Varlen, block_backward, block_forward

    g = torch.Generator().manual_seed(3)
    lq, lk = [3, 0, 5], [4, 0, 5]
    cq, ck = _cu(lq), _cu(lk)
    q = torch.randn(cq[-1], 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(ck[-1], 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(ck[-1], 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    vl = Varlen(torch.tensor(cq, dtype=torch.int32), torch.tensor(ck, dtype=torch.int32), 5, 5)
    out, lse = block_forward(q, k, v, scale=0.35, causal=True, varlen=vl)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    dq, dk, dv = block_backward(dout, q, k, v, out, lse, scale=0.35, causal=True, varlen=vl)
    ref = []
    for (a, b), (c, e) in zip(zip(cq[:-1], cq[1:]), zip(ck[:-1], ck[1:])):
        if b == a:
            continue
        s = torch.einsum("qhd,khd->hqk", q[a:b], k[c:e].repeat_interleave(2, 1)) * 0.35
        i, j = torch.arange(b - a)[:, None], torch.arange(e - c)[None, :]
        s = s.masked_fill(j - (e - c) > i - (b - a), float("-inf"))
        ref.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v[c:e].repeat_interleave(2, 1)))
    ref = torch.cat(ref)
    ref.backward(dout)
    torch.testing.assert_close(out, ref.detach())
    for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(got, want)


# ----------------------------------------------------------------------------------------------------------------
# The pad helpers' documented path: real + layout offsets mask padding (non-causal), forward and backward


def _pad_helpers_task(fmt: str) -> float:
    from cpscope.sharding import pad_packed_batch, pad_to_cp_multiple, real_offsets

    group = cpscope.new_cp_groups([2])[2]
    r = dist.get_rank(group)
    g = torch.Generator().manual_seed(11)
    h, h_kv = 4, 2
    if fmt == "thd":
        real = [3, 5, 0, 9]
        cu = torch.tensor(_cu(real), dtype=torch.int32)
        q, k, v, dout = (torch.randn(sum(real), n, D, generator=g, dtype=torch.float64) for n in (h, h_kv, h_kv, h))
        b = pad_packed_batch(q, k, v, dout, cu_seqlens=cu, cp=2)
        lay = b.cu_seqlens_padded.tolist()
        idx = zigzag_index(lay, 2, r)
        loc = [x[idx].float().requires_grad_(True) for x in b.tensors[:3]]
        kw = dict(cu_seqlens=b.cu_seqlens, cu_seqlens_padded=b.cu_seqlens_padded)
        attn = ContextParallelAttention(qkv_format="thd", causal=False, comm="all_gather")
        mod_in = [x.detach().clone().requires_grad_(True) for x in loc]
        with cpscope.runtime_cp(group):
            out = context_parallel_attention(*loc, qkv_format="thd", causal=False, **kw)
            legacy = context_parallel_attention(*loc, qkv_format="thd", causal=False, cu_seqlens=b.cu_seqlens_padded)
            mod_out = attn(*mod_in, comm="p2p", **kw)  # the call's comm beats the module's
            with pytest.raises(ValueError, match="cannot mask padding"):
                attn(*mod_in, **kw)  # the module's all_gather cannot mask padding without a causal mask
        out.backward(b.tensors[3][idx].float())
        mod_out.backward(b.tensors[3][idx].float())
        for got, want in zip((mod_out, *(x.grad for x in mod_in)), (out, *(x.grad for x in loc))):
            torch.testing.assert_close(got, want, rtol=0, atol=0)  # the module passes cu_seqlens_padded on
        real_of = torch.full((lay[-1],), -1, dtype=torch.long)
        real_of[b.real_index] = torch.arange(sum(real))
        rows = real_of[idx]
        ref_in = [x.clone().requires_grad_(True) for x in (q, k, v)]
        ref = reference_attention(*ref_in, causal=False, cu=_cu(real))
        ref.backward(dout)
    else:  # bshd: two rows padded at their end to a multiple of 2cp; one real length for the batch
        n = 7
        q, k, v, dout = (torch.randn(2, n, m, D, generator=g, dtype=torch.float64) for m in (h, h_kv, h_kv, h))
        padded = [pad_to_cp_multiple(x, seq_dim=1, cp=2)[0] for x in (q, k, v, dout)]
        S = padded[0].shape[1]
        idx = zigzag_index([0, S], 2, r)
        loc = [x[:, idx].float().requires_grad_(True) for x in padded[:3]]
        with cpscope.runtime_cp(group):
            out = context_parallel_attention(*loc, qkv_format="bshd", causal=False, cu_seqlens=real_offsets(n, 2))
            legacy = context_parallel_attention(*loc, qkv_format="bshd", causal=False)
        out.backward(padded[3][:, idx].float())
        rows = torch.where(idx < n, idx, torch.full_like(idx, -1))
        ref_in = [x.clone().requires_grad_(True) for x in (q, k, v)]
        ref = torch.stack([reference_attention(*(x[i] for x in ref_in), causal=False) for i in range(2)])
        ref.backward(dout)
        # compare row by row on the [b*s] flattening
        out, loc = out.reshape(-1, h, D), [x.grad.reshape(-1, *x.shape[2:]) for x in loc]
        rows = torch.cat([torch.where(rows >= 0, rows + i * n, rows) for i in range(2)])
        ref, ref_grads = ref.reshape(-1, h, D), [x.grad.reshape(-1, *x.shape[2:]) for x in ref_in]
        legacy = legacy.reshape(-1, h, D)
    grads = loc if fmt != "thd" else [x.grad for x in loc]
    if fmt == "thd":
        ref_grads = [x.grad for x in ref_in]
    real_rows = rows >= 0
    worst = 0.0
    for got, want in zip((out, *grads), (ref.detach(), *ref_grads)):
        w = torch.zeros_like(got, dtype=torch.float64)
        w[real_rows] = want[rows[real_rows]]
        worst = max(worst, (got.double() - w).abs().max().item())
    assert worst < 2e-5, worst
    # without the real offsets the padding is attended to: the real rows differ (the documented caveat)
    assert (legacy[real_rows].double() - ref.detach()[rows[real_rows]]).abs().max() > 1e-2
    return worst


@pytest.mark.parametrize("fmt", ["thd", "bshd"])
def test_pad_helpers_mask_padding_without_causal_mask(fmt):
    assert all(e < 2e-5 for e in run_ranks(2, _pad_helpers_task, fmt))
