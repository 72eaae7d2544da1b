"""Nothing an attention call allocates survives it in a reference cycle (issue 31).

Each path runs with Python's cyclic collector disabled; afterwards the call's output and gradients must be dead by
reference counting alone (weak references), and ``gc.collect()`` must find no tensor and no frame among what it
frees (a frame in a cycle keeps its callers' locals alive — on a GPU, whole activations). Paths: the public API at
CP1 on every layout and feature (window, softcap, sinks, both, no causal mask, padded ``thd``, multi-latent head
dims), the cuDNN graph wrappers against the fake frontend (packed and dense, and a refused graph falling back to the
exact math) and, on a GPU, the first ``thd`` call on a fresh pack shape.
"""
from __future__ import annotations

import contextlib
import gc
import math
import types
import weakref

import pytest
import torch

import cpscope
from cpscope.attention._kernels import Varlen, cudnn_frontend, router
from tests.attention._fake_cudnn import fake_cudnn


@contextlib.contextmanager
def _collector_off():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _real(o) -> bool:
    """A tensor with memory of its own: not a proxy, not a meta tensor, not one of torch.compile's fake tensors (a
    first compiled call — FlexAttention's — leaves tracing garbage behind that holds no device memory)."""
    if type(o) in weakref.ProxyTypes or not isinstance(o, torch.Tensor):
        return False
    from torch._subclasses.fake_tensor import FakeTensor

    return not isinstance(o, FakeTensor) and o.device.type != "meta"


def _holds_tensor(frame: types.FrameType) -> bool:
    return any(_real(v) for v in frame.f_locals.values())


def _cyclic_garbage() -> list[str]:
    """What ``gc.collect()`` frees that matters: tensors and frames that hold one (by name). The cuDNN frontend's
    own cycle (see ``_fake_cudnn``) may stay behind on cpscope's graph-builder thread, whose frames hold shapes only
    and none of the call's frames."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        live = [o for o in gc.garbage if type(o) not in weakref.ProxyTypes]  # a dead proxy raises on isinstance
        found = [o for o in live if _real(o) or isinstance(o, types.FrameType) and _holds_tensor(o)]
        gc.garbage.clear()
    finally:
        gc.set_debug(0)
    return [f"frame {o.f_code.co_name} ({o.f_code.co_filename})" if isinstance(o, types.FrameType)
            else f"tensor {tuple(o.shape)}" for o in found]


def _check(call) -> None:
    """``call()`` returns the tensors it made; none may outlive the call by a cycle."""
    with _collector_off():
        refs = [weakref.ref(t) for t in call()]
        alive = [i for i, r in enumerate(refs) if r() is not None]
        garbage = _cyclic_garbage()
    assert not alive, f"results {alive} of the call are kept alive by a reference cycle"
    assert not garbage, f"the call left cyclic garbage holding {garbage[:10]}"


def _api(fmt: str, feats: dict, dev: str = "cpu", dtype=torch.float32, d_v: int = 16):
    def call():
        h, hk, d = 4, 2, 16
        cu = torch.tensor([0, 40, 64, 128], dtype=torch.int32, device=dev)
        shape = {"thd": (128,), "bshd": (2, 64), "sbhd": (64, 2)}[fmt]
        q = torch.randn(*shape, h, d, dtype=dtype, device=dev, requires_grad=True)
        k = torch.randn(*shape, hk, d, dtype=dtype, device=dev, requires_grad=True)
        v = torch.randn(*shape, hk, d_v, dtype=dtype, device=dev, requires_grad=True)
        kw = dict(feats)
        if kw.pop("sinks", False):
            kw["sinks"] = torch.zeros(h, device=dev, requires_grad=True)
        if fmt == "thd":
            kw["cu_seqlens"] = cu
            if kw.pop("padded", False):
                kw["cu_seqlens"] = torch.tensor([0, 36, 60, 120], dtype=torch.int32, device=dev)
                kw["cu_seqlens_padded"] = cu
        out = cpscope.context_parallel_attention(q, k, v, qkv_format=fmt, group=None, **kw)
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        return [out, *grads]
    return call


_FEATURES = {"plain": {}, "window": {"window": (15, 0)}, "softcap": {"softcap": 30.0}, "sinks": {"sinks": True},
             "window_softcap_sinks": {"window": (7, 0), "softcap": 20.0, "sinks": True},
             "not_causal": {"causal": False}}


@pytest.mark.parametrize("feat", list(_FEATURES))
@pytest.mark.parametrize("fmt", ["thd", "bshd", "sbhd"])
def test_api_cp1_leaves_no_cycle(fmt, feat):
    _check(_api(fmt, _FEATURES[feat]))


@pytest.mark.parametrize("case", ["padded", "mla"])
def test_api_cp1_padded_and_mla_leave_no_cycle(case):
    if case == "padded":
        _check(_api("thd", {"padded": True, "causal": False}))
    else:
        _check(_api("bshd", {}, d_v=8))


def test_rope_leaves_no_cycle():
    def call():
        t = torch.randn(64, 4, 16, requires_grad=True)
        cu = torch.tensor([0, 24, 64], dtype=torch.int32)
        y = cpscope.apply_rotary_pos_emb(t, cpscope.rotary_freqs(16, 64), qkv_format="thd", cu_seqlens=cu,
                                         impl="eager")
        return [y, *torch.autograd.grad(y, (t,), torch.ones_like(y))]
    _check(call)


@pytest.fixture
def fake(monkeypatch):
    cudnn = fake_cudnn()
    monkeypatch.setattr(cudnn_frontend, "module", lambda: cudnn)
    monkeypatch.setattr(cudnn_frontend, "stream", lambda device: 0)
    monkeypatch.setattr(cudnn_frontend, "handle", lambda device: object())
    monkeypatch.setattr(cudnn_frontend, "available", lambda device: True)
    cudnn_frontend.clear_cache()
    yield cudnn
    cudnn_frontend.clear_cache()


def _block_call(dense: bool, window=None, softcap=None):
    def call():
        scale, causal = 1 / math.sqrt(16), True
        if dense:
            q, k, v = (torch.randn(1, 32, h, 16).bfloat16() for h in (4, 2, 2))
            vl = None
        else:
            q, k, v = (torch.randn(48, h, 16).bfloat16() for h in (4, 2, 2))
            cu = torch.tensor([0, 16, 48], dtype=torch.int32)
            vl = Varlen(cu, cu, 32, 32, (0, 16, 48), (0, 16, 48))
        kw = dict(scale=scale, causal=causal, varlen=vl, window=window, softcap=softcap)
        assert router.choose(q, k, v, causal=causal, varlen=vl, window=window, softcap=softcap) == "cudnn"
        out, lse = router.block_forward(q, k, v, **kw)
        grads = router.block_backward(torch.ones_like(out), q, k, v, out, lse, **kw)
        return [out, lse, *grads]
    return call


@pytest.mark.parametrize("dense", [False, True], ids=["thd", "dense"])
def test_cudnn_graph_paths_leave_no_cycle(fake, dense):
    _check(_block_call(dense, window=(7, 0), softcap=20.0))


def test_refused_graph_fallback_leaves_no_cycle(fake, monkeypatch):
    """A graph the frontend refuses (an exception caught while choosing the kernel) keeps no frame alive."""
    def refuse(self):
        raise RuntimeError("below 9.26.0 non-ragged Stats must be packed BHSD (fake refusal)")

    monkeypatch.setattr(type(fake.pygraph(io_data_type=None, intermediate_data_type=None, compute_data_type=None,
                                          handle=None)), "build_plans", refuse)
    monkeypatch.setattr(router, "_REFUSED", {})
    _check(_block_call(False, window=(7, 0), softcap=20.0))
    assert router.fallbacks(), "the refusal must be remembered"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("feat", ["plain", "window", "softcap"])
def test_first_thd_call_on_gpu_leaves_no_cycle(feat):
    """The first call on a pack shape builds graphs (cuDNN) — nothing it allocates may outlive it in a cycle."""
    cudnn_frontend.clear_cache()
    _check(_api("thd", _FEATURES[feat], dev="cuda", dtype=torch.bfloat16))
    before = torch.cuda.memory_allocated()
    _check(_api("thd", _FEATURES[feat], dev="cuda", dtype=torch.bfloat16))
    assert torch.cuda.memory_allocated() <= before
