"""Deferred cuDNN graph builds (``KernelPolicy.defer_builds``, ``cpscope.attention._kernels.deferral``) on CPU.

The cuDNN graphs run on the fake frontend (``tests/attention/_fake_cudnn.py``, which interprets the ragged memory
layout); flash-attention-2 is stood in for at aten's level: ``aten._flash_attention_forward`` / ``_backward`` are
replaced by the exact block math with FA2's conventions (bf16 / fp16 only, ``lse`` ``[h, t]`` that the backward
requires contiguous, ``+inf`` for rows that see no key), so cpscope's own flash wrappers (``_kernels/aten.py``) run
as on a GPU, and the router sees a CUDA device (``caps_of`` patched). Proven here, against float64 each time (forward,
lse, gradients): a packed block's first sighting runs flash and builds nothing, its second builds and runs cuDNN;
forward and backward decide apart and mix kernels correctly (cuDNN's ``lse`` view into flash's backward and back);
nothing is refused; rows whose next route is not flash build at once; the policy off is the old behaviour;
``cpscope.clear_caches()`` forgets the keys seen; through the public API at CP1 and at CP4 on virtual ranks. The speed is for the GPU (``benchmarks/bench_pack_stream.py``,
row ``cpscope_defer``).
"""
from __future__ import annotations

import math

import pytest
import torch

import cpscope
from cpscope.attention._kernels import Varlen, aten, cudnn_frontend, deferral, exact, router
from cpscope.attention._policy import use_kernel_policy
from tests.attention._fake_cudnn import block_reference, fake_cudnn, rel
from tests.attention._virtual import check_virtual
from tests.attention.test_no_cycles import _check as check_no_cycle

H, H_KV, D = 4, 2, 16
CU = (0, 5, 12, 20)


class FakeFlash:
    """aten's namespace with the two flash-attention-2 varlen entries replaced by the exact math (FA2's
    conventions); every other op is aten's own. ``calls`` records ``"forward"`` / ``"backward"``."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name):
        return getattr(torch.ops.aten, name)

    @staticmethod
    def _args(q, cu_q, cu_k, max_q, max_k, left, right):
        assert q.dtype in (torch.float16, torch.bfloat16), "flash-attention-2 takes fp16 / bf16 only"
        hq, hk = tuple(cu_q.tolist()), tuple(cu_k.tolist())
        window = None if (left, right) == (-1, -1) else (left, right)
        return Varlen(cu_q, cu_k, max_q, max_k, hq, hk), window

    def _flash_attention_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, *, scale=None,
                                 window_size_left=-1, window_size_right=-1):
        self.calls.append("forward")
        vl, window = self._args(q, cu_q, cu_k, max_q, max_k, window_size_left, window_size_right)
        out, lse = exact.forward(q, k, v, scale, causal, vl, window, None)
        lse = lse.masked_fill(lse == float("-inf"), float("inf")).contiguous()  # FA2 marks rows with no key +inf
        return out.to(q.dtype), lse, None, None, None

    def _flash_attention_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout, causal, rng,
                                  unused, *, scale=None, window_size_left=-1, window_size_right=-1):
        self.calls.append("backward")
        assert lse.is_contiguous() and lse.dtype == torch.float32 and lse.shape == (q.shape[1], q.shape[0]), (
            "flash-attention-2's backward reads a contiguous [h, t] fp32 lse")
        vl, window = self._args(q, cu_q, cu_k, max_q, max_k, window_size_left, window_size_right)
        lse = lse.masked_fill(lse == float("inf"), float("-inf"))
        dq, dk, dv = exact.backward(dout, q, k, v, out, lse, scale, causal, vl, window, None)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@pytest.fixture
def flash(monkeypatch):
    """The fake cuDNN frontend, the flash stand-in, a CUDA-like device for the router; caches empty."""
    cudnn = fake_cudnn()
    monkeypatch.setattr(cudnn_frontend, "module", lambda: cudnn)
    monkeypatch.setattr(cudnn_frontend, "stream", lambda device: 0)
    monkeypatch.setattr(cudnn_frontend, "handle", lambda device: object())
    monkeypatch.setattr(cudnn_frontend, "available", lambda device: True)
    monkeypatch.setattr(router, "caps_of", lambda device: router.Caps(cuda=True, frontend=True, flex=False))
    monkeypatch.setattr(router, "_REFUSED", {})
    fake = FakeFlash()
    monkeypatch.setattr(aten, "_aten", fake)
    cpscope.clear_caches()
    yield fake
    cpscope.clear_caches()


KINDS = {  # kind -> (window, softcap, v head dim)
    "packed": (None, None, D),
    "packed-window": ((3, 0), None, D),
    "packed-mla": (None, None, 8),
}


def _block(kind: str, dtype=torch.bfloat16, seed: int = 0, cu=CU):
    window, softcap, d_v = KINDS[kind]
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(cu[-1], h, d, generator=g).to(dtype) for h, d in ((H, D), (H_KV, D), (H_KV, d_v)))
    dout = torch.randn(cu[-1], H, d_v, generator=g).to(dtype)
    t = torch.tensor(cu, dtype=torch.int32)
    n = max(b - a for a, b in zip(cu[:-1], cu[1:]))
    vl = Varlen(t, t.clone(), n, n, tuple(cu), tuple(cu))  # a new pack object per call, as a loader makes them
    kw = dict(scale=1 / math.sqrt(D), causal=True, varlen=vl, window=window, softcap=softcap)
    assert router.kind_of(q, k, v, causal=True, varlen=vl, window=window, softcap=softcap) == kind
    ref = block_reference(q, k, v, dout, scale=kw["scale"], causal=True, window=window, softcap=softcap,
                          cu_q=cu, cu_k=cu)
    return (q, k, v, dout), kw, ref


def _check_forward(out, lse, ref) -> None:
    assert rel(out, ref[0]) < 1e-2 and rel(lse, ref[1]) < 1e-5
    assert lse.shape == ref[1].shape and lse.dtype == torch.float32


def _check_grads(grads, ref) -> None:
    for got, want in zip(grads, ref[2:]):
        assert got.shape == want.shape and rel(got, want) < 2e-2


def _graphs(direction: str) -> int:
    return sum(key[0] == {"forward": "fwd", "backward": "bwd"}[direction] for key in cudnn_frontend.cached_graphs())


@pytest.mark.parametrize("kind,dtype", [("packed", torch.bfloat16), ("packed", torch.float16),
                                        ("packed-window", torch.bfloat16), ("packed-mla", torch.bfloat16)])
def test_first_sighting_runs_flash_second_builds_cudnn(flash, kind, dtype):
    (q, k, v, dout), kw, ref = _block(kind, dtype)
    assert router.choose(q, k, v, causal=True, varlen=kw["varlen"], window=kw["window"], softcap=None) == "cudnn"
    with use_kernel_policy(defer_builds=True):
        out, lse = router.block_forward(q, k, v, **kw)
        assert flash.calls == ["forward"] and cudnn_frontend.cached_graphs() == []  # flash ran, nothing built
        _check_forward(out, lse, ref)
        grads = router.block_backward(dout, q, k, v, out, lse, **kw)
        assert flash.calls == ["forward", "backward"] and cudnn_frontend.cached_graphs() == []
        _check_grads(grads, ref)
        assert [key[0] for key in deferral.seen_keys()] == ["fwd", "bwd"] and router.fallbacks() == {}

        (q, k, v, dout), kw, ref = _block(kind, dtype, seed=1)  # the same shape again: new tensors, a new pack
        out, lse = router.block_forward(q, k, v, **kw)
        assert _graphs("forward") == 1 and _graphs("backward") == 0 and len(flash.calls) == 2  # built, on cuDNN
        assert not lse.is_contiguous()  # cuDNN's [h, t] view of token-major statistics
        _check_forward(out, lse, ref)
        grads = router.block_backward(dout, q, k, v, out, lse, **kw)
        assert _graphs("backward") == 1 and len(flash.calls) == 2
        _check_grads(grads, ref)
        router.block_forward(q, k, v, **kw)  # a third time: the cached graph, nothing new
        assert len(cudnn_frontend.cached_graphs()) == 2 and len(flash.calls) == 2
    assert router.fallbacks() == {}, "a deferred build is not a refusal"


@pytest.mark.parametrize("kind", ["packed", "packed-window"])
def test_cudnn_forward_then_flash_backward(flash, kind):
    """The forward's graph is built (second sighting) while the backward's key is new: cuDNN's lse view goes into
    flash's backward (which needs it contiguous)."""
    with use_kernel_policy(defer_builds=True):
        (q, k, v, _), kw, _ = _block(kind)
        router.block_forward(q, k, v, **kw)  # first sighting of the forward key: flash
        (q, k, v, dout), kw, ref = _block(kind, seed=2)
        out, lse = router.block_forward(q, k, v, **kw)
        assert _graphs("forward") == 1 and not lse.is_contiguous()
        grads = router.block_backward(dout, q, k, v, out, lse, **kw)
    assert flash.calls == ["forward", "backward"] and _graphs("backward") == 0
    _check_forward(out, lse, ref)
    _check_grads(grads, ref)


@pytest.mark.parametrize("kind", ["packed", "packed-window"])
def test_flash_forward_then_cudnn_backward(flash, kind):
    """The backward's key was seen (and ran on flash) before the forward's: flash's contiguous lse goes into cuDNN's
    backward."""
    with use_kernel_policy(defer_builds=True):
        (q, k, v, dout), kw, ref = _block(kind)
        router.block_backward(dout, q, k, v, ref[0].to(q.dtype), ref[1].float(), **kw)  # the backward key: seen
        assert flash.calls == ["backward"]
        (q, k, v, dout), kw, ref = _block(kind, seed=3)
        out, lse = router.block_forward(q, k, v, **kw)  # the forward key is new: flash
        assert flash.calls == ["backward", "forward"] and lse.is_contiguous()
        grads = router.block_backward(dout, q, k, v, out, lse, **kw)  # the backward key's second sighting: cuDNN
    assert flash.calls == ["backward", "forward"] and _graphs("backward") == 1 and _graphs("forward") == 0
    _check_forward(out, lse, ref)
    _check_grads(grads, ref)


def test_never_defers_where_the_next_route_is_not_flash(flash):
    """A softcap with a band (next route FlexAttention or the exact math) builds its graph on first sight."""
    g = torch.Generator().manual_seed(4)
    q, k, v, dout = (torch.randn(CU[-1], h, D, generator=g).bfloat16() for h in (H, H_KV, H_KV, H))
    t = torch.tensor(CU, dtype=torch.int32)
    kw = dict(scale=0.25, causal=True, varlen=Varlen(t, t, 8, 8, CU, CU), window=(3, 0), softcap=2.5)
    assert router.kind_of(q, k, v, causal=True, varlen=kw["varlen"], window=(3, 0), softcap=2.5) == (
        "packed-softcap-window")
    ref = block_reference(q, k, v, dout, scale=0.25, causal=True, window=(3, 0), softcap=2.5, cu_q=CU, cu_k=CU)
    with use_kernel_policy(defer_builds=True):
        out, lse = router.block_forward(q, k, v, **kw)
        grads = router.block_backward(dout, q, k, v, out, lse, **kw)
    assert flash.calls == [] and len(cudnn_frontend.cached_graphs()) == 2 and deferral.seen_keys() == []
    _check_forward(out, lse, ref)
    _check_grads(grads, ref)
    assert deferral.target(["cudnn", "exact"]) is None and deferral.target(["cudnn", "flex", "exact"]) is None


def test_policy_off_and_explicit_cudnn_build_at_once(flash):
    """Off (the default): today's behaviour, the graph built on first sight. ``varlen="cudnn"`` asks for cuDNN: no
    deferral either."""
    for changes in ({}, {"defer_builds": True, "varlen": "cudnn"}):
        cpscope.clear_caches()
        (q, k, v, dout), kw, ref = _block("packed", seed=5)
        with use_kernel_policy(**changes):
            out, lse = router.block_forward(q, k, v, **kw)
            grads = router.block_backward(dout, q, k, v, out, lse, **kw)
        assert flash.calls == [] and _graphs("forward") == _graphs("backward") == 1 and deferral.seen_keys() == []
        _check_forward(out, lse, ref)
        _check_grads(grads, ref)


def test_clear_caches_forgets_the_keys_seen(flash):
    with use_kernel_policy(defer_builds=True):
        (q, k, v, _), kw, _ = _block("packed")
        router.block_forward(q, k, v, **kw)
        assert len(deferral.seen_keys()) == 1
        cpscope.clear_caches()
        assert deferral.seen_keys() == []
        router.block_forward(q, k, v, **kw)  # seen for the first time again: flash once more, nothing built
    assert flash.calls == ["forward", "forward"] and cudnn_frontend.cached_graphs() == []


def test_seen_keys_are_bounded(flash, monkeypatch):
    monkeypatch.setattr(deferral, "SEEN_SIZE", 2)
    for i in range(4):
        with pytest.raises(deferral.BuildDeferred):
            deferral.check(("fwd", i))
    assert deferral.seen_keys() == [("fwd", 2), ("fwd", 3)]
    deferral.check(("fwd", 3))  # seen: the caller builds
    assert not issubclass(deferral.BuildDeferred, cudnn_frontend.GraphUnsupported)


def _api_call(cu, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(cu[-1], h, D, generator=g).bfloat16().requires_grad_(True) for h in (H, H_KV, H_KV))
    dout = torch.randn(cu[-1], H, D, generator=g).bfloat16()
    out = cpscope.context_parallel_attention(q, k, v, qkv_format="thd", cu_seqlens=torch.tensor(cu, dtype=torch.int32),
                                             causal=True, group=None)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = block_reference(q, k, v, dout, scale=1 / math.sqrt(D), causal=True, cu_q=cu, cu_k=cu)
    assert rel(out, ref[0]) < 1e-2
    _check_grads(grads, ref)


def test_public_api_cp1_thd(flash):
    """Through ``context_parallel_attention`` at CP1: a new pack runs flash (forward and backward), the same pack
    again builds and runs cuDNN, a new pack shape runs flash again — every call against float64."""
    with use_kernel_policy(defer_builds=True):
        _api_call(CU, seed=6)
        assert flash.calls == ["forward", "backward"] and cudnn_frontend.cached_graphs() == []
        _api_call(CU, seed=7)
        assert flash.calls == ["forward", "backward"] and _graphs("forward") == _graphs("backward") == 1
        _api_call((0, 70, 90), seed=8)  # a new shape (longest sequence 70: another graph key)
        assert flash.calls == ["forward", "backward"] * 2 and len(cudnn_frontend.cached_graphs()) == 2
    assert router.fallbacks() == {}
    _api_call(CU, seed=9)  # the policy off again: the cached graphs
    assert len(flash.calls) == 4


def test_a_deferred_build_leaves_no_cycle(flash):
    """The deferral is an exception caught while choosing a kernel: nothing of the call outlives it in a cycle."""
    def call():
        (q, k, v, dout), kw, _ = _block("packed", seed=10)
        out, lse = router.block_forward(q, k, v, **kw)
        return [out, lse, *router.block_backward(dout, q, k, v, out, lse, **kw)]

    with use_kernel_policy(defer_builds=True):
        check_no_cycle(call)
    assert flash.calls == ["forward", "backward"]


def test_fake_flash_is_not_blind(flash):
    """The stand-in refuses what FA2 refuses: fp32 inputs, a non-contiguous lse."""
    (q, k, v, dout), kw, _ = _block("packed")
    vl = kw["varlen"]
    with pytest.raises(AssertionError, match="fp16 / bf16"):
        flash._flash_attention_forward(q.float(), k.float(), v.float(), vl.cu_q, vl.cu_k, 8, 8, 0.0, True, False,
                                       scale=0.25)
    lse = torch.zeros(CU[-1], H).t()
    with pytest.raises(AssertionError, match="contiguous"):
        flash._flash_attention_backward(dout, q, k, v, q, lse, vl.cu_q, vl.cu_k, 8, 8, 0.0, True, None, None,
                                        scale=0.25)


@pytest.mark.parametrize("comm", ["all_gather", "a2a"])
def test_cp4_virtual_ranks_mix_both_kernels(flash, comm):
    """At CP4 (virtual ranks in one process) the same graph keys come once per rank: the first rank's blocks run on
    flash, later ones build and run cuDNN — the merged rows and gradients still match float64."""
    with use_kernel_policy(defer_builds=True):
        check_virtual(comm, 4, "thd", causal=True, heads=(8, 4), lens=[16, 0, 48, 32], d=8, dtype=torch.bfloat16,
                      tol=2e-2)
    assert {"forward", "backward"} <= set(flash.calls) and cudnn_frontend.cached_graphs()  # both kernels ran
    assert router.fallbacks() == {}


def test_graph_keys_are_made_before_any_copy():
    """The key's strides are those of the packed copy that the graph then runs on (head-sliced views included)."""
    from cpscope.attention._kernels import cudnn_thd

    x = torch.randn(6, 8, 4)
    for t in (x, x[:, 2:5], x[:, :1], x[:1, 3:4]):
        assert cudnn_thd._stride(t) == cudnn_thd._packed(t).stride()
