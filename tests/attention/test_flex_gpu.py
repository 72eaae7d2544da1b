"""FlexAttention's compiled kernels as cpscope's block kernel on one GPU (bf16) against float64 references:

* every window / softcap block case of ``tests/attention/_kernel_cases.py`` (dense, ``sbhd`` views, packed, halos,
  more queries than keys, rows that see no key, two blocks merged by their log-sum-exp) with FlexAttention first,
  forward and backward from merged statistics;
* the router sends window + softcap blocks to flex when cuDNN refuses their graph (and never to the exact math);
* a whole CP1 call (``bshd`` and ``thd``, window + softcap) through flex's own autograd;
* a stream of packs with new document lengths compiles at most twice per configuration (static, then dynamic) and
  class of totals (multiples of 128 or not);
* no ``[h, s, s]`` score or mask tensor is materialised.

``python -m pytest -m gpu tests/attention/test_flex_gpu.py``
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.attention._kernel_cases import CASES, REL_TOL, rel, run_case

FEATURED = sorted(n for n, c in CASES.items() if c[5] is not None or c[6] is not None)


def _dev() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device("cuda", 0)


def _spy(monkeypatch):
    from cpscope.attention._kernels import flex

    calls = {"forward": 0, "backward": 0, "attend": 0}
    for name in calls:
        real = getattr(flex, name)

        def spy(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)
        monkeypatch.setattr(flex, name, spy)
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("name", FEATURED)
def test_flex_block_parity(name, monkeypatch):
    calls = _spy(monkeypatch)
    res = run_case(name, _dev(), seed=FEATURED.index(name), route="flex")
    assert res["unseen_ok"], f"{name}: rows that see no key must come out as out 0, lse -inf ({res})"
    assert res["ok"], f"{name}: relative errors above {REL_TOL} (lse 1e-3): {res}"
    assert not res["cudnn_refused"], f"{name}: FlexAttention refused the block: {res['cudnn_refused']}"
    assert calls["forward"] > 0 and calls["backward"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_router_takes_flex_when_cudnn_refuses(layout, monkeypatch):
    """A window + softcap block whose cuDNN graph is refused runs on FlexAttention, both directions (here the
    refusal is forced, as cuDNN 9.19 gives it; where cuDNN itself refused earlier, the same holds)."""
    from cpscope.attention._kernels import Varlen, cudnn_frontend, router

    dev = _dev()
    monkeypatch.setattr(router, "_REFUSED", {})

    def refuse(*a, **kw):
        raise cudnn_frontend.GraphUnsupported("below 9.26.0 non-ragged Stats must be packed BHSD")
    for kern in ("_CUDNN_DENSE", "_CUDNN_THD"):
        monkeypatch.setattr(router, kern, getattr(router, kern)._replace(forward=refuse, backward=refuse))
    monkeypatch.setattr(router, "_REFUSABLE", (router._CUDNN_DENSE, router._CUDNN_THD, router._FLEX))
    monkeypatch.setattr(cudnn_frontend, "available", lambda device: True)
    calls = _spy(monkeypatch)
    g = torch.Generator(device=dev).manual_seed(3)
    mk = lambda *s: torch.randn(*s, device=dev, dtype=torch.bfloat16, generator=g)  # noqa: E731
    if layout == "thd":
        cu = [0, 700, 2048]
        vl = Varlen(*(torch.tensor(cu, dtype=torch.int32, device=dev),) * 2, 1348, 1348, tuple(cu), tuple(cu))
        q, k, v = mk(2048, 8, 128), mk(2048, 2, 128), mk(2048, 2, 128)
    else:
        vl, (q, k, v) = None, (mk(1, 2048, 8, 128), mk(1, 2048, 2, 128), mk(1, 2048, 2, 128))
    kw = dict(scale=128 ** -0.5, causal=True, varlen=vl, window=(511, 0), softcap=50.0)
    out, lse = router.block_forward(q, k, v, **kw)
    router.block_backward(torch.ones_like(out), q, k, v, out, lse, **kw)
    assert calls["forward"] == 1 and calls["backward"] == 1
    for d in ("forward", "backward"):
        assert router.choose(q, k, v, causal=True, varlen=vl, window=(511, 0), softcap=50.0, direction=d) == "flex"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,with_sinks", [("bshd", False), ("thd", False), ("thd", True)])
def test_cp1_call_through_flex_autograd(fmt, with_sinks, monkeypatch):
    import cpscope
    from cpscope.attention._policy import use_kernel_policy
    from tests.attention._reference import reference_attention

    dev = _dev()
    calls = _spy(monkeypatch)
    g = torch.Generator(device=dev).manual_seed(7)
    cu = [0, 1000, 1024, 3072] if fmt == "thd" else None
    n = 3072
    q, k, v, do = (torch.randn(n, h, 64, device=dev, dtype=torch.float64, generator=g) for h in (8, 2, 2, 8))
    sinks = torch.randn(8, device=dev, dtype=torch.float64, generator=g) if with_sinks else None
    ref = [x.clone().requires_grad_(True) for x in (q, k, v)] + ([sinks.clone().requires_grad_(True)] if with_sinks
                                                                  else [])
    want = reference_attention(*ref[:3], causal=True, cu=cu, window=(511, 0), softcap=30.0,
                               sinks=ref[3] if with_sinks else None)
    want.backward(do)
    loc = [(x if fmt == "thd" else x[None]).bfloat16().requires_grad_(True) for x in (q, k, v)]
    if with_sinks:
        loc.append(sinks.float().requires_grad_(True))
        extra_sinks = {"sinks": loc[3]}
    else:
        extra_sinks = {}
    extra = {"cu_seqlens": torch.tensor(cu, dtype=torch.int32, device=dev)} if fmt == "thd" else {}
    with use_kernel_policy(flex="first"):
        out = cpscope.context_parallel_attention(*loc[:3], qkv_format=fmt, window=(511, 0), softcap=30.0,
                                                 group=None, **extra, **extra_sinks)
    out.backward((do if fmt == "thd" else do[None]).bfloat16())
    assert calls["attend"] == 1 and calls["backward"] == 0
    for got, exp in zip([out, *(x.grad for x in loc)], [want, *(x.grad for x in ref)]):
        assert rel(got.reshape(exp.shape), exp) < REL_TOL


@pytest.mark.gpu
def test_dynamic_divisible_lengths_match_reference():
    """Whole calls at a first length, then new lengths (a dynamic graph): where both lengths divide by 128 the
    kernels skip their bounds checks (``IS_DIVISIBLE``), elsewhere not — forward and gradients against float64."""
    import cpscope
    from cpscope.attention._kernels import flex
    from cpscope.attention._policy import use_kernel_policy
    from tests.attention._reference import reference_attention

    dev = _dev()
    flex.clear_cache()
    g = torch.Generator(device=dev).manual_seed(11)
    for n in (1024, 2560, 1920, 1000, 1400):
        q, k, v, do = (torch.randn(1, n, h, 64, device=dev, dtype=torch.float64, generator=g) for h in (8, 2, 2, 8))
        ref = [x[0].clone().requires_grad_(True) for x in (q, k, v)]
        want = reference_attention(*ref, causal=True, cu=None, window=(255, 0), softcap=30.0)
        want.backward(do[0])
        loc = [x.bfloat16().requires_grad_(True) for x in (q, k, v)]
        with use_kernel_policy(flex="first"):
            out = cpscope.context_parallel_attention(*loc, qkv_format="bshd", window=(255, 0), softcap=30.0,
                                                     group=None)
        out.backward(do.bfloat16())
        for got, exp in zip([out, *(x.grad for x in loc)], [want, *(x.grad for x in ref)]):
            assert rel(got.reshape(exp.shape), exp) < REL_TOL, n
    assert {key[-1] for key in flex._compiled} == {True, False}


@pytest.mark.gpu
def test_new_packs_compile_at_most_twice():
    """Packs with new document lengths (and totals) reuse the compiled kernel: the first shape compiles a static
    graph, the first new one a dynamic graph, later ones nothing — per class of totals: multiples of the 128-row
    tile (whose kernels skip the bounds checks) and the rest."""
    from torch._dynamo.utils import counters

    from cpscope.attention._kernels import Varlen, flex

    dev = _dev()
    flex.clear_cache()
    g = torch.Generator().manual_seed(0)
    before, classes = counters["stats"]["unique_graphs"], set()
    for i in range(6):
        lens = torch.randint(200, 1500, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
        cu = [0]
        for x in lens:
            cu.append(cu[-1] + x)
        vl = Varlen(*(torch.tensor(cu, dtype=torch.int32, device=dev),) * 2, max(lens), max(lens), tuple(cu),
                    tuple(cu))
        q, k, v = (torch.randn(cu[-1], h, 128, device=dev, dtype=torch.bfloat16) for h in (8, 2, 2))
        out, lse = flex.forward(q, k, v, 128 ** -0.5, True, vl, (255, 0), 50.0)
        assert torch.isfinite(out).all()
        classes.add(cu[-1] % flex.TILE == 0)
    assert counters["stats"]["unique_graphs"] - before <= 2 * len(classes)


@pytest.mark.gpu
def test_no_dense_scores_or_mask():
    from cpscope.attention._kernels import flex

    dev = _dev()
    q, k, v = (torch.randn(1, 8192, h, 128, device=dev, dtype=torch.bfloat16) for h in (8, 2, 2))
    flex.forward(q, k, v, 128 ** -0.5, True, None, (1023, 0), 50.0)  # compiled, mask built and kept
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    out, lse = flex.forward(q, k, v, 128 ** -0.5, True, None, (1023, 0), 50.0)
    grown = torch.cuda.max_memory_allocated(dev) - before
    assert grown < 4 * q.numel() * q.element_size(), f"{grown} bytes for a {q.numel() * 2}-byte q"
    assert math.isfinite(lse.float().max().item())
