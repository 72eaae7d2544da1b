"""cpscope's cuDNN packed-attention wrapper (``cpscope.attention._kernels.cudnn_thd``) on CPU, against a fake cuDNN frontend.

The fake (``tests/attention/_fake_cudnn.py``) interprets the memory the way cuDNN documents it: logical
``[B, h, S, d]`` tensors with strides, a ragged offset per sequence (elements) replacing the batch stride, sequence
lengths with the padding mask, the softmax stats as ``[B, h, S, 1]`` at the given strides, diagonal bands and score
modifiers evaluated op by op — reading and writing raw CPU pointers from the variant pack. So a wrapper that hands
cuDNN wrong offsets, strides, a head-sliced view, wrong band bounds or the lse in the wrong layout gets wrong numbers
here; they are compared with a float64 reference (forward, lse and the gradients given the merged lse).
Real cuDNN is checked on GPU (tests/attention/test_gpu.py, tests/attention/test_kernels_gpu.py).
"""
from __future__ import annotations

import math

import pytest
import torch

from cpscope.attention._kernels import Varlen, cudnn_frontend, cudnn_thd
from cpscope.attention._policy import use_kernel_policy
from tests.attention._fake_cudnn import block_reference, fake_cudnn, rel

_fake_cudnn = fake_cudnn  # the name test_variants.py imports from here


@pytest.fixture(params=["ordered", "mapping"])
def fake(monkeypatch, request):
    cudnn = fake_cudnn()
    cudnn.execute_form = request.param
    monkeypatch.setattr(cudnn_frontend, "module", lambda: cudnn)
    monkeypatch.setattr(cudnn_frontend, "stream", lambda device: 0)
    monkeypatch.setattr(cudnn_frontend, "handle", lambda device: object())
    cudnn_frontend.clear_cache()
    with use_kernel_policy(ordered_execute=request.param == "ordered"):
        yield cudnn
    cudnn_frontend.clear_cache()


def _varlen(cu_q, cu_k):
    lens = lambda c: [b - a for a, b in zip(c[:-1], c[1:])]  # noqa: E731
    t = lambda c: torch.tensor(c, dtype=torch.int32)  # noqa: E731
    return Varlen(t(cu_q), t(cu_k), max(lens(cu_q)), max(lens(cu_k)), tuple(cu_q), tuple(cu_k))


def _check_block(cu_q, cu_k, h, h_kv, d, d_v, causal, window=None, softcap=None, heads_view=False):
    """forward (out, lse) and backward given the reference's (merged) out and lse, vs float64."""
    hh, hk = (2 * h, 2 * h_kv) if heads_view else (h, h_kv)
    q, dout = torch.randn(cu_q[-1], hh, d).bfloat16(), torch.randn(cu_q[-1], hh, d_v).bfloat16()
    k, v = torch.randn(cu_k[-1], hk, d).bfloat16(), torch.randn(cu_k[-1], hk, d_v).bfloat16()
    if heads_view:  # head slices (strided views), as the ring's head-split diagonal passes them
        q, dout, k, v = q[:, h:], dout[:, h:], k[:, :h_kv], v[:, :h_kv]
    vl, scale = _varlen(cu_q, cu_k), 1 / math.sqrt(d)
    kw = dict(scale=scale, causal=causal, window=window, softcap=softcap)
    out, lse = cudnn_thd.forward(q, k, v, vl, **kw)
    ref = block_reference(q, k, v, dout, cu_q=cu_q, cu_k=cu_k, **kw)
    assert lse.shape == (h, cu_q[-1]) and lse.dtype == torch.float32 and lse.t().is_contiguous()  # [t, h] memory
    assert out.shape == (cu_q[-1], h, d_v)
    seen = torch.isfinite(ref[1])
    assert torch.equal(torch.isfinite(lse), seen), "rows that see no key must have lse -inf, and only those"
    assert torch.all(out.float().permute(1, 0, 2)[~seen] == 0), "rows that see no key must have out 0"
    assert rel(out, ref[0]) < 1e-2 and rel(lse[seen], ref[1][seen]) < 1e-5
    # backward with the reference's (merged) out and lse, as the ring calls it
    dq, dk, dv = cudnn_thd.backward(dout, q, k, v, ref[0].bfloat16(), ref[1].float(), vl, **kw)
    for got, want in zip((dq, dk, dv), ref[2:]):
        assert got.shape == want.shape and rel(got, want) < 2e-2


@pytest.mark.parametrize("shape", ["equal", "q_half", "kv_half", "heads_view"])
@pytest.mark.parametrize("h_kv", [4, 2])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_forward_backward_vs_float64(fake, causal, h_kv, shape):
    torch.manual_seed(0)
    cu = [0, 6, 16, 20, 32]
    cu_q = [x // 2 for x in cu] if shape == "q_half" else cu
    cu_k = [x // 2 for x in cu] if shape == "kv_half" else cu
    _check_block(cu_q, cu_k, 4, h_kv, 8, 8, causal, heads_view=shape == "heads_view")


_SHAPES = {"square": ([0, 6, 16, 20, 32], [0, 6, 16, 20, 32]),
           "halo": ([0, 6, 16, 20, 32], [0, 9, 23, 27, 44]),  # each sequence's queries vs a halo + its own keys
           "more_q": ([0, 9, 23, 27, 44], [0, 6, 16, 20, 32])}  # rows before the diagonal see no key


@pytest.mark.parametrize("shape", sorted(_SHAPES))
@pytest.mark.parametrize("feature", ["window", "window_full", "right_only", "softcap_causal", "mla_softcap_window"])
def test_window_softcap_mla_vs_float64(fake, feature, shape):
    if fake.execute_form != "ordered":
        pytest.skip("the execute forms are compared by the plain tests")
    torch.manual_seed(1)
    causal = feature not in ("window_full", "right_only", "softcap")
    window = {"window": (3, 0), "window_full": (3, 2), "right_only": (-1, 2), "softcap_window": (4, 0),
              "mla_softcap_window": (2, 0)}.get(feature)
    softcap = 2.5 if "softcap" in feature else None
    d_v = 4 if feature.startswith("mla") else 8
    _check_block(*_SHAPES[shape], 4, 2, 8, d_v, causal, window, softcap)


def test_graphs_are_cached_and_bucketed(fake):
    h, d = 2, 8
    q = torch.randn(20, h, d).bfloat16()
    for cu in ((0, 6, 16, 20), (0, 10, 14, 20)):  # same count, longest 10 and 10 -> same bucket
        t = torch.tensor(cu, dtype=torch.int32)
        vl = Varlen(t, t, max(b - a for a, b in zip(cu[:-1], cu[1:])), 10, cu, cu)
        cudnn_thd.forward(q, q, q, vl, scale=0.3, causal=True)
    assert len(cudnn_frontend.cached_graphs()) == 1


def test_bad_inputs_raise_value_error(fake):
    q = torch.randn(8, 2, 4).bfloat16()
    t = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="unit stride in d"):
        cudnn_thd.forward(q, q[..., ::2], q, Varlen(t, t, 8, 8, (0, 8), (0, 8)), scale=0.5, causal=True)
    with pytest.raises(ValueError, match="fp16/bf16"):
        cudnn_thd.forward(q.float(), q.float(), q.float(), Varlen(t, t, 8, 8, (0, 8), (0, 8)), scale=0.5,
                           causal=False)
    with pytest.raises(ValueError, match="different numbers of sequences"):
        cudnn_thd.forward(q, q, q, Varlen(t, t, 8, 8, (0, 8), (0, 4, 8)), scale=0.5, causal=False)


def test_not_available_on_cpu():
    assert cudnn_frontend.available(torch.device("cpu")) is False


def test_batch_bucketing_pads_with_empty_sequences(fake, monkeypatch):
    torch.manual_seed(1)
    cu = (0, 6, 16, 20)  # 3 sequences -> 4 with an empty one
    q, k, v, dout = (torch.randn(20, 2, 8).bfloat16() for _ in range(4))
    t = torch.tensor(cu, dtype=torch.int32)
    vl = Varlen(t, t, 10, 10, cu, cu)
    res = {}
    for bucket in (False, True):
        with use_kernel_policy(bucket_batch=bucket):
            o, lse = cudnn_thd.forward(q, k, v, vl, scale=0.3, causal=True)
            res[bucket] = (o, lse, *cudnn_thd.backward(dout, q, k, v, o, lse, vl, scale=0.3, causal=True))
    assert {key[1] for key in cudnn_frontend.cached_graphs()} == {3, 4}  # graphs for 3 and for 4 (bucketed) sequences
    for a, b in zip(res[True], res[False]):
        assert torch.equal(a, b)
