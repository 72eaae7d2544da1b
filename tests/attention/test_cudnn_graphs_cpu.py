"""cpscope's dense cuDNN graphs with windows and softcapping (``cpscope.attention._kernels.cudnn_dense``) on CPU, against
the fake cuDNN frontend of ``tests/attention/_fake_cudnn.py`` (which interprets strides, bands and score modifiers
the way cuDNN documents them), vs a float64 reference of the block contract. Real cuDNN: test_kernels_gpu.py.
"""
from __future__ import annotations

import math

import pytest
import torch

from cpscope.attention._kernels import cudnn_dense, cudnn_frontend, exact, router
from cpscope.attention._kernels.block import Varlen
from tests.attention._fake_cudnn import block_reference, fake_cudnn, rel


@pytest.fixture
def fake(monkeypatch):
    cudnn = fake_cudnn()
    monkeypatch.setattr(cudnn_frontend, "module", lambda: cudnn)
    monkeypatch.setattr(cudnn_frontend, "stream", lambda device: 0)
    monkeypatch.setattr(cudnn_frontend, "handle", lambda device: object())
    cudnn_frontend.clear_cache()
    yield cudnn
    cudnn_frontend.clear_cache()


def _check(n_q, n_k, causal, window, softcap, d_v=8, layout="bshd"):
    b, h, h_kv, d = 2, 4, 2, 8
    mk = lambda n, heads, dd: torch.randn(b, n, heads, dd).bfloat16()  # noqa: E731
    q, k, v, dout = mk(n_q, h, d), mk(n_k, h_kv, d), mk(n_k, h_kv, d_v), mk(n_q, h, d_v)
    if layout == "sbhd":  # [s, b, h, d] memory seen as [b, s, h, d] views
        q, k, v, dout = (x.transpose(0, 1).contiguous().transpose(0, 1) for x in (q, k, v, dout))
    kw = dict(scale=1 / math.sqrt(d), causal=causal, window=window, softcap=softcap)
    out, lse = cudnn_dense.forward(q, k, v, **kw)
    ref = block_reference(q, k, v, dout, **kw)
    assert out.shape == (b, n_q, h, d_v) and lse.shape == (b, h, n_q) and lse.dtype == torch.float32
    seen = torch.isfinite(ref[1])
    assert torch.equal(torch.isfinite(lse), seen), "rows that see no key must have lse -inf, and only those"
    assert torch.all(out.float().transpose(1, 2)[~seen] == 0)
    assert rel(out, ref[0]) < 1e-2 and rel(lse[seen], ref[1][seen]) < 1e-5
    grads = cudnn_dense.backward(dout, q, k, v, ref[0].bfloat16(), ref[1].float(), **kw)
    for got, want in zip(grads, ref[2:]):
        assert got.shape == want.shape and rel(got, want) < 2e-2


@pytest.mark.parametrize("shape", [(12, 12), (12, 17), (17, 12)], ids=["square", "halo", "more_q"])
@pytest.mark.parametrize("feature", ["window", "window_full", "softcap_causal", "mla_softcap_window"])
def test_dense_window_softcap_mla_vs_float64(fake, feature, shape):
    torch.manual_seed(2)
    causal = feature != "window_full"
    window = {"window": (3, 0), "window_full": (3, 2), "mla_softcap_window": (4, 0)}.get(feature)
    softcap = 2.5 if "softcap" in feature else None
    _check(*shape, causal, window, softcap, d_v=4 if feature.startswith("mla") else 8)


def test_dense_sbhd_views_and_graph_cache(fake):
    torch.manual_seed(3)
    _check(12, 12, True, (3, 0), None, layout="sbhd")
    n = len(cudnn_frontend.cached_graphs())
    _check(12, 12, True, (3, 0), None, layout="sbhd")  # same shapes, strides and options: no new graph
    assert len(cudnn_frontend.cached_graphs()) == n == 2


def test_leading_rows_with_no_key(fake):
    """More queries than keys, causal: the first query's diagonal lies before the first key (out 0, lse -inf)."""
    q = torch.randn(1, 8, 2, 8).bfloat16()
    k = torch.randn(1, 2, 2, 8).bfloat16()
    out, lse = cudnn_dense.forward(q[:, :3], k, k, scale=0.3, causal=True, window=(1, 0))
    assert torch.all(out[:, :1] == 0) and torch.all(lse[..., :1] == float("-inf"))
    assert torch.all(torch.isfinite(lse[..., 1:]))


def test_refused_graph_falls_back_to_the_next_route(fake, monkeypatch):
    """A graph cuDNN will not build (here: every score-modifier graph) sends that kind of block to the exact math,
    recorded in ``router.fallbacks()``; the result is the exact block's."""
    def refuse(graph):
        if any(p.get("mod") is not None for _, p in graph.ops):
            raise RuntimeError("no engine for this graph")

    monkeypatch.setattr(type(fake.pygraph(io_data_type=None, intermediate_data_type=None, compute_data_type=None,
                                          handle=None)), "check_support", refuse)
    monkeypatch.setattr(cudnn_frontend, "available", lambda device: True)
    monkeypatch.setattr(router, "_REFUSED", {})
    torch.manual_seed(4)
    q, k, v = (torch.randn(1, 12, h, 8).bfloat16() for h in (4, 2, 2))
    kw = dict(window=(3, 0), softcap=2.5)
    assert router.choose(q, k, v, causal=True, varlen=None, **kw) == "cudnn"
    got = router.block_forward(q, k, v, scale=0.3, causal=True, **kw)
    want = exact.forward(q, k, v, 0.3, True, None, *kw.values())
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert len(router.fallbacks()) == 1 and "no engine" in next(iter(router.fallbacks().values()))
    assert router.choose(q, k, v, causal=True, varlen=None, **kw) == "exact"  # remembered
    # plain windows still build
    out, _ = router.block_forward(q, k, v, scale=0.3, causal=True, window=(3, 0))
    assert len(router.fallbacks()) == 1 and out.shape == q.shape


def test_only_kinds_validated_on_hardware_go_to_cudnn(fake, monkeypatch):
    """Dense bands that split into two kernels, and packed softcap blocks other than a left-bounded window over
    equal offsets, skip cuDNN (they failed parity on an H200) and take the next route: here, with a softcap, the
    exact math — bit for bit its result, and no graph built; a one-kernel band still builds its graph."""
    monkeypatch.setattr(cudnn_frontend, "available", lambda device: True)
    monkeypatch.setattr(router, "_REFUSED", {})

    def on_cudnn(n_q, n_k, causal, vl, window, softcap):
        h = lambda n: torch.empty((n, 4, 8) if vl is not None else (1, n, 4, 8), device="meta",  # noqa: E731
                                  dtype=torch.bfloat16)
        return router.choose(h(n_q), h(n_k), h(n_k), causal=causal, varlen=vl, window=window,
                             softcap=softcap) == "cudnn"

    assert on_cudnn(1024, 1024, True, None, (255, 0), None) and on_cudnn(1024, 1024, True, None, None, 30.0)
    assert on_cudnn(1024, 768, True, None, (255, 0), 30.0)  # more queries than keys: one kernel
    assert not on_cudnn(768, 1024, True, None, (255, 0), None)  # a halo before the chunk: two kernels
    assert not on_cudnn(1024, 1024, False, None, (100, 50), None)  # a two-sided window: two kernels
    t = lambda c: torch.tensor(c, dtype=torch.int32)  # noqa: E731
    cu, cu_halo = [0, 300, 812], [0, 428, 1068]
    same = Varlen(t(cu), t(cu), 512, 512, tuple(cu), tuple(cu))
    halo = Varlen(t(cu), t(cu_halo), 512, 640, tuple(cu), tuple(cu_halo))
    assert on_cudnn(812, 812, True, same, (255, 0), 30.0) and on_cudnn(812, 1068, True, halo, (255, 0), None)
    assert not on_cudnn(812, 812, True, same, None, 30.0) and not on_cudnn(812, 1068, True, halo, (255, 0), 30.0)

    built = []
    monkeypatch.setattr(cudnn_dense, "_run_forward", lambda *a, **k: built.append(a))
    torch.manual_seed(5)
    q, k, v = (torch.randn(1, n, h, 8).bfloat16() for n, h in ((8, 4), (12, 2), (12, 2)))
    got = router.block_forward(q, k, v, scale=0.3, causal=True, window=(3, 0), softcap=2.5)
    want = exact.forward(q, k, v, 0.3, True, None, (3, 0), 2.5)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and built == [] and not router.fallbacks()
    router.block_forward(q, q, q, scale=0.3, causal=True, window=(3, 0), softcap=2.5)
    assert len(built) == 1
