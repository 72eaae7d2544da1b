"""GPU parity (NCCL, bf16): cpscope attention vs single-GPU SDPA / per-document SDPA, forward and backward.

CP1 on one GPU (bshd / sbhd / thd, MHA / GQA / MQA, padded thd) and the ring's block shapes on one GPU; CP2 on two
GPUs. ``python -m pytest -m gpu tests/attention/test_gpu.py``. ``benchmarks/bench_attention.py --check`` calls
:func:`gpu_parity` directly under ``torchrun``.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

REL_TOL = 1e-2
THD_LENS = [1024, 3072, 512, 2048, 1536]  # global document lengths, each divisible by 2*cp for cp <= 4


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _sdpa(q, k, v, causal):  # [b, s, h, d] in and out, GQA by repeating k/v heads
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return o.transpose(1, 2)


def gpu_parity(fmt: str, causal: bool, h: int = 16, h_kv: int = 8, seq: int = 8192, d: int = 128) -> dict:
    """CP over the whole (NCCL) world vs single-GPU attention on this rank; asserts relative error <= 1e-2."""
    import cpscope
    from cpscope.attention import context_parallel_attention
    from cpscope.sharding import zigzag_indices

    cp, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    group = cpscope.new_cp_groups([cp])[cp]
    g = torch.Generator(device=dev).manual_seed(1234)
    cu = [0]
    if fmt == "thd":
        for n in THD_LENS:
            cu.append(cu[-1] + n)
    b, t = (1, cu[-1]) if fmt == "thd" else (2, seq)
    mk = lambda heads: torch.randn(b, t, heads, d, device=dev, dtype=torch.bfloat16, generator=g)  # noqa: E731
    q, k, v, dout = mk(h), mk(h_kv), mk(h_kv), mk(h)
    # single-GPU reference (bf16 SDPA; per document for thd)
    ref_in = [x.clone().requires_grad_(True) for x in (q, k, v)]
    if fmt == "thd":
        outs = [_sdpa(*(x[:, a:e] for x in ref_in), causal) for a, e in zip(cu[:-1], cu[1:])]
        ref_out = torch.cat(outs, dim=1)
    else:
        ref_out = _sdpa(*ref_in, causal)
    ref_out.backward(dout)
    idx = zigzag_indices(cu if fmt == "thd" else t, cp, rank, device=dev)
    loc = [x[:, idx].detach().clone() for x in (q, k, v)]
    if fmt == "thd":
        loc = [x[0] for x in loc]
    elif fmt == "sbhd":
        loc = [x.transpose(0, 1).contiguous() for x in loc]
    loc = [x.requires_grad_(True) for x in loc]
    kw = {"cu_seqlens": torch.tensor(cu, dtype=torch.int32, device=dev)} if fmt == "thd" else {}
    cpscope.set_backward_read_check(True)
    with cpscope.runtime_cp(group):
        out = context_parallel_attention(*loc, qkv_format=fmt, causal=causal, **kw)
    dl = dout[:, idx]
    out.backward(dl[0] if fmt == "thd" else (dl.transpose(0, 1).contiguous() if fmt == "sbhd" else dl))
    cpscope.set_backward_read_check(True)  # back to the default (on)
    errs = {}
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *(x.grad for x in loc)),
                               (ref_out.detach(), *(x.grad for x in ref_in))):
        want = want[:, idx]
        want = want[0] if fmt == "thd" else (want.transpose(0, 1) if fmt == "sbhd" else want)
        errs[name] = _rel(got, want)
    bad = {n: e for n, e in errs.items() if not e <= REL_TOL}
    assert not bad, f"{fmt} causal={causal} heads {h}/{h_kv} rank {rank}: relative errors {errs} > {REL_TOL}"
    return errs


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_cp2_parity_with_single_gpu(fmt, causal):
    from tests.distributed import run_ranks

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    errs = run_ranks(2, gpu_parity, fmt, causal, seq=4096, backend="nccl")
    assert all(max(e.values()) <= REL_TOL for e in errs)


def gpu_parity_varlen_kernel(kernel: str, causal: bool, h_kv: int) -> dict:
    """:func:`gpu_parity` for thd with packed blocks forced onto ``kernel`` ("flash" / "cudnn"), restored after."""
    from cpscope.attention._policy import use_kernel_policy

    with use_kernel_policy(varlen=kernel):
        return gpu_parity("thd", causal, h=32, h_kv=h_kv, seq=8192)


@pytest.mark.gpu
@pytest.mark.parametrize("h_kv", [32, 8], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("kernel", ["flash", "cudnn"])
def test_cp2_parity_varlen_kernels(kernel, causal, h_kv):
    """Both packed-block kernels (cuDNN needs nvidia-cudnn-frontend; skipped without it)."""
    from cpscope.attention._kernels import cudnn_frontend
    from tests.distributed import run_ranks

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    if kernel == "cudnn" and not cudnn_frontend.available(torch.device("cuda", 0)):
        pytest.skip("cuDNN frontend (nvidia-cudnn-frontend) / cuDNN >= 9.6 / sm90 not available")
    errs = run_ranks(2, gpu_parity_varlen_kernel, kernel, causal, h_kv, backend="nccl")
    assert all(max(e.values()) <= REL_TOL for e in errs)


# ----------------------------------------------------------------------------------------------------------------
# One GPU: CP1 (what the ring's diagonal block is) and the ring's remote block shapes


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(32, 32), (32, 8), (32, 4), (32, 1)], ids=["mha", "gqa8", "gqa4", "mqa"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
def test_cp1_parity_one_gpu(fmt, causal, heads):
    from tests.distributed import run_ranks

    errs = run_ranks(1, gpu_parity, fmt, causal, h=heads[0], h_kv=heads[1], seq=2048, backend="nccl")
    assert all(max(e.values()) <= REL_TOL for e in errs)


def gpu_padded_parity(causal: bool, kernel: str) -> float:
    """Padded thd (real + layout offsets, a padding-only document) at CP1 vs per-document SDPA on the real tokens;
    padding rows and their gradients must be zero."""
    import cpscope
    from cpscope.attention._policy import use_kernel_policy

    dev = torch.device("cuda", torch.cuda.current_device())
    real, lay = [700, 0, 333, 1024], [768, 128, 384, 1024]
    cu_r = torch.tensor([0] + [sum(real[: i + 1]) for i in range(4)], dtype=torch.int32)
    cu_l = torch.tensor([0] + [sum(lay[: i + 1]) for i in range(4)], dtype=torch.int32)
    g = torch.Generator(device=dev).manual_seed(7)
    mk = lambda heads: torch.randn(sum(lay), heads, 128, device=dev, dtype=torch.bfloat16, generator=g)  # noqa: E731
    q, k, v, do = mk(16), mk(4), mk(4), mk(16)
    with use_kernel_policy(varlen=kernel):
        qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
        out = cpscope.context_parallel_attention(qq, kk, vv, qkv_format="thd", causal=causal, cu_seqlens=cu_r,
                                                 cu_seqlens_padded=cu_l, group=None)
        out.backward(do)
    worst, start = 0.0, 0
    for n, L in zip(real, lay):
        if n:
            sl = slice(start, start + n)
            ref_in = [x[sl][None].clone().requires_grad_(True) for x in (q, k, v)]
            ref = _sdpa(*ref_in, causal)
            ref.backward(do[sl][None])
            for got, want in zip((out, qq.grad, kk.grad, vv.grad), (ref.detach(), *(x.grad for x in ref_in))):
                worst = max(worst, _rel(got[sl][None], want))
        pad = slice(start + n, start + L)
        for got in (out, qq.grad, kk.grad, vv.grad):
            assert got[pad].abs().max().item() == 0 if L > n else True, "padding rows must be exactly zero"
        start += L
    assert worst <= REL_TOL, f"padded thd causal={causal} kernel={kernel}: relative error {worst}"
    return worst


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("kernel", ["flash", "cudnn"])
def test_padded_thd_one_gpu(kernel, causal):
    from cpscope.attention._kernels import cudnn_frontend

    if kernel == "cudnn" and not cudnn_frontend.available(torch.device("cuda", 0)):
        pytest.skip("cuDNN frontend (nvidia-cudnn-frontend) / cuDNN >= 9.6 / sm90 not available")
    gpu_padded_parity(causal, kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("h_kv", [32, 8, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("kind", ["diag", "kv_front", "q_back"])
def test_ring_block_shapes_one_gpu(kind, h_kv):
    """The ring's blocks (diagonal: causal; kv_front: all Q vs the front half of K/V; q_back: the back half of Q vs
    all K/V) on the dense kernels with GQA, vs fp32 attention with expanded K/V."""
    from cpscope.attention._kernels import Placeholders, block_backward, block_forward

    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(3)
    s, h, d = 2048, 32, 128
    mk = lambda n, heads: torch.randn(1, n, heads, d, device=dev, dtype=torch.bfloat16, generator=g)  # noqa: E731
    q, k, v, do = mk(s, h), mk(s, h_kv), mk(s, h_kv), mk(s, h)
    if kind == "kv_front":
        k, v = k[:, : s // 2], v[:, : s // 2]
    elif kind == "q_back":
        q, do = q[:, s // 2:], do[:, s // 2:]
    causal = kind == "diag"
    scale = d ** -0.5
    ph = Placeholders()  # what the dense forward hands to its backward, as an algorithm's call keeps them
    out, lse = block_forward(q, k, v, scale=scale, causal=causal, placeholders=ph)
    dq, dk, dv = block_backward(do, q, k, v, out, lse, scale=scale, causal=causal, placeholders=ph)
    ref_in = [x.float().clone().requires_grad_(True) for x in (q, k, v)]
    ref = _sdpa(*ref_in, causal)
    ref.backward(do.float())
    errs = [_rel(out, ref), _rel(dq, ref_in[0].grad), _rel(dk, ref_in[1].grad), _rel(dv, ref_in[2].grad)]
    assert dk.shape == k.shape and max(errs) <= REL_TOL, (kind, h_kv, errs)
