"""Real TransformerEngine (2.20.2) under cpscope on 2 GPUs: runtime CP on a TE module built without CP.

A ``DotProductAttention`` built with no CP group runs mixed microbatches (CP2, CP1, CP2) under ``runtime_cp``
through :class:`ScopedDotProductAttention`; each rank's output and q/k/v gradients match single-GPU TE attention
on the full tokens, cut with zigzag indices (bf16: relative error ‖a−b‖/‖b‖ ≤ 1e-2), in ``bshd`` and ``thd``.
TE's fused RoPE under the scope matches cpscope's own (pure torch) RoPE and the full-sequence reference. A whole
``TransformerLayer`` (GQA, RoPE) converted in place with ``enable_runtime_cp`` runs CP2, CP1, CP2 microbatches and
matches the single-GPU layer (output, input gradient, CP-group-summed weight gradients).

TE facts this relies on (TE 2.20.2 sources): ``thd`` + CP takes **global** int32 ``cu_seqlens`` on the GPU and needs
``cu_seqlens_*_padded`` (the wrapper passes the same tensor when there is no padding, which TE reads as
``pad_between_seqs=False``); every document must divide by 2·cp; the token layout is DualChunkSwap per document
(= cpscope's zigzag); ``thd`` uses ``attn_mask_type="padding_causal"``; the output is ``[..., h*d]``.
Run: ``python -m pytest tests/integrations/test_te_gpu.py`` on a machine with 2 GPUs and TE installed.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

te = pytest.importorskip("transformer_engine.pytorch")

import cpscope  # noqa: E402
from cpscope.integrations.te import (  # noqa: E402
    ScopedDotProductAttention,
    enable_runtime_cp,
    te_apply_rotary_pos_emb,
)
from cpscope.rope import apply_rotary_pos_emb, rotary_freqs  # noqa: E402
from cpscope.sharding import zigzag_indices, zigzag_shard  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402

pytestmark = pytest.mark.gpu

H, HKV, D = 8, 2, 64
SEQ, BATCH = 256, 2  # bshd: global length divisible by 2*cp
DOCS = [64, 192, 128]  # thd: every document divisible by 2*cp
REL_TOL = 1e-2


def _needs_two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _assert_rel(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape, (what, a.shape, b.shape)
    err = _rel_err(a, b)
    assert err <= REL_TOL, f"{what}: relative error {err:.3e} > {REL_TOL}"


def _inputs(fmt: str, device: torch.device):
    """Full q, k, v (bf16) and the output gradient, identical on every rank (seeded on the CPU)."""
    gen = torch.Generator().manual_seed(1234)
    lead = (BATCH, SEQ) if fmt == "bshd" else (sum(DOCS),)
    q = torch.randn(*lead, H, D, generator=gen)
    k = torch.randn(*lead, HKV, D, generator=gen)
    v = torch.randn(*lead, HKV, D, generator=gen)
    dout = torch.randn(*lead, H * D, generator=gen)  # TE returns [..., h*d]
    return [t.to(device=device, dtype=torch.bfloat16) for t in (q, k, v, dout)]


def _run(attn, q, k, v, dout, kwargs):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = attn(q, k, v, **kwargs)
    out.backward(dout)  # outside any scope: TE keeps group and stream on its ctx
    return out.detach(), q.grad, k.grad, v.grad


def _te_mixed_microbatches(fmt: str):
    device = _device()
    groups = cpscope.new_cp_groups([1, 2])
    mask = "causal" if fmt == "bshd" else "padding_causal"
    core = te.DotProductAttention(H, D, num_gqa_groups=HKV, qkv_format=fmt, attn_mask_type=mask)
    assert core.cp_group is None  # built without CP
    attn = ScopedDotProductAttention(core)
    q, k, v, dout = _inputs(fmt, device)
    seq_dim = 1 if fmt == "bshd" else 0
    kwargs: dict = {}
    cu_list = None
    if fmt == "thd":
        cu_list = [0] + torch.cumsum(torch.tensor(DOCS), 0).tolist()
        cu = torch.tensor(cu_list, dtype=torch.int32, device=device)
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(DOCS), max_seqlen_kv=max(DOCS))

    with cpscope.runtime_cp(None):  # single-GPU TE reference on the full tokens
        ref = _run(attn, q, k, v, dout, kwargs)
    assert core.cp_group is None

    for size in (2, 1, 2):
        group = groups[size]
        with cpscope.runtime_cp(group):
            scope = cpscope.capture_scope()
            local = [zigzag_shard(t, seq_dim=seq_dim, cu_seqlens=cu_list) for t in (q, k, v, dout)]
            got = _run(attn, *local, kwargs)
        assert core.cp_group is None and core.cp_stream is None  # build-time settings back after each call
        idx = zigzag_indices(cu_list if fmt == "thd" else SEQ, scope.size, scope.rank, device=device)
        for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
            _assert_rel(g, r.index_select(seq_dim, idx), f"{fmt} CP{size} {name}")
    return True


@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_te_attention_mixed_microbatches_match_single_gpu(fmt):
    _needs_two_gpus()
    assert run_ranks(2, _te_mixed_microbatches, fmt, backend="nccl") == [True, True]


def _te_rope_matches_cpscope():
    device = _device()
    groups = cpscope.new_cp_groups([2])
    freqs = rotary_freqs(D, max(SEQ, *DOCS), device=device)
    gen = torch.Generator().manual_seed(7)
    cu_list = [0] + torch.cumsum(torch.tensor(DOCS), 0).tolist()
    cu = torch.tensor(cu_list, dtype=torch.int32, device=device)
    cases = [
        ("bshd", torch.randn(BATCH, SEQ, H, D, generator=gen).to(device), None, 1, SEQ),
        ("thd", torch.randn(sum(DOCS), H, D, generator=gen).to(device), cu, 0, cu_list),
    ]
    for fmt, full, cu_t, seq_dim, shape in cases:
        grad = torch.randn(full.shape, generator=gen).to(device)
        # Full-sequence reference (pure torch, CP1), cut per rank.
        x = full.clone().requires_grad_()
        ref = apply_rotary_pos_emb(x, freqs, qkv_format=fmt, cu_seqlens=cu_t, group=None, impl="eager")
        ref.backward(grad)
        with cpscope.runtime_cp(groups[2]):
            scope = cpscope.capture_scope()
            idx = zigzag_indices(shape, 2, scope.rank, device=device)
            x_te = full.index_select(seq_dim, idx).clone().requires_grad_()
            x_cp = x_te.detach().clone().requires_grad_()
            y_te = te_apply_rotary_pos_emb(x_te, freqs, qkv_format=fmt, cu_seqlens=cu_t)  # TE fused kernel
            y_cp = apply_rotary_pos_emb(x_cp, freqs, qkv_format=fmt, cu_seqlens=cu_t, impl="eager")
        g_local = grad.index_select(seq_dim, idx)
        y_te.backward(g_local)
        y_cp.backward(g_local)
        torch.testing.assert_close(y_te, y_cp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(y_te, ref.detach().index_select(seq_dim, idx), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(x_te.grad, x_cp.grad, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(x_te.grad, x.grad.index_select(seq_dim, idx), atol=1e-5, rtol=1e-5)
    return True


def test_te_fused_rope_matches_cpscope_rope():
    _needs_two_gpus()
    assert run_ranks(2, _te_rope_matches_cpscope, backend="nccl") == [True, True]


HIDDEN, FFN = 512, 1024  # TransformerLayer: 8 heads of 64


def _te_transformer_layer_in_place():
    device = _device()
    groups = cpscope.new_cp_groups([1, 2])
    torch.manual_seed(0)
    layer = te.TransformerLayer(
        HIDDEN, FFN, H, num_gqa_groups=HKV, hidden_dropout=0.0, attention_dropout=0.0, self_attn_mask_type="causal",
        attn_input_format="bshd", params_dtype=torch.bfloat16, device=device,
    )
    for p in layer.parameters():  # identical weights on every rank
        dist.broadcast(p.data, src=0)
    assert enable_runtime_cp(layer)  # converts its MultiheadAttention and DotProductAttention in place
    freqs = rotary_freqs(HIDDEN // H, SEQ, device=device)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=gen).to(device=device, dtype=torch.bfloat16)
    dy = torch.randn(BATCH, SEQ, HIDDEN, generator=gen).to(device=device, dtype=torch.bfloat16)

    def step(x_in):
        layer.zero_grad(set_to_none=True)
        x_in = x_in.detach().clone().requires_grad_()
        y = layer(x_in, rotary_pos_emb=freqs)
        return y, x_in

    with cpscope.runtime_cp(None):  # single-GPU reference on the full sequence
        ref_y, ref_x = step(x)
    ref_y.backward(dy)
    ref_dx = ref_x.grad
    ref_grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters()}

    for size in (2, 1, 2):
        group = groups[size]
        with cpscope.runtime_cp(group):
            scope = cpscope.capture_scope()
            y, x_local = step(zigzag_shard(x, seq_dim=1))
        y.backward(zigzag_shard(dy, seq_dim=1, group=group))
        idx = zigzag_indices(SEQ, scope.size, scope.rank, device=device)
        _assert_rel(y.detach(), ref_y.detach().index_select(1, idx), f"layer CP{size} out")
        _assert_rel(x_local.grad, ref_dx.index_select(1, idx), f"layer CP{size} dx")
        for name, p in layer.named_parameters():
            g = p.grad.detach().float()
            if group is not None:
                dist.all_reduce(g, group=group)
            _assert_rel(g, ref_grads[name], f"layer CP{size} grad {name}")
    return True


def test_te_transformer_layer_in_place_mixed_microbatches():
    _needs_two_gpus()
    assert run_ranks(2, _te_transformer_layer_in_place, backend="nccl") == [True, True]
