"""FlexAttention as a block kernel (``cpscope.attention._kernels.flex``) on CPU, where FlexAttention runs its eager
math through the same block masks and score modifier as its compiled CUDA kernels.

* the block-sparse structure (which tiles are visible, which entirely) against a brute-force mask — the eager math
  ignores it, the compiled kernels skip every tile it leaves out;
* blocks (dense, packed, bands off the diagonal, merged statistics) against the exact math in float64;
* whole calls with the router forced onto flex (``KernelPolicy(flex="first")``): bshd / sbhd / thd x window,
  softcap, window + softcap (and with sinks, merged through the blocks' log-sum-exp), at CP1 (one block through flex's own autograd) and CP2 (ring and halo blocks, the
  backward through the merged statistics), forward and gradients against the float64 full-sequence reference;
* a kernel that cannot compile a block is a refusal: the block runs on the next route; ``clear_caches`` empties
  the kernel's caches.
"""
from __future__ import annotations

import gc
import types
import weakref

import pytest
import torch

import cpscope
from cpscope.attention._kernels import Varlen, exact, flex, router
from cpscope.attention._policy import use_kernel_policy
from tests.attention.test_features import check
from tests.distributed import run_ranks

CPU = torch.device("cpu")
LENS = [12, 0, 16, 8]  # thd documents (multiples of 2·cp at CP1 and CP2), longer than the window
FEATS = {"window": {"window": (6, 0)}, "softcap": {"softcap": 1.5}, "window+softcap": {"window": (6, 0), "softcap": 1.5}}


def _vl(cu_q, cu_k):
    t = lambda c: torch.tensor(c, dtype=torch.int32)  # noqa: E731
    return Varlen(t(cu_q), t(cu_k), max(b - a for a, b in zip(cu_q, cu_q[1:])),
                  max(b - a for a, b in zip(cu_k, cu_k[1:])), tuple(cu_q), tuple(cu_k))


PACKED = _vl([0, 100, 130, 900], [0, 150, 400, 1400])


@pytest.mark.parametrize("t_q,t_k,causal,vl,window", [
    (1000, 1000, True, None, (300, 0)), (1000, 1000, True, None, None), (700, 1300, False, None, (200, 50)),
    (1300, 700, True, None, (200, 0)), (900, 1400, True, PACKED, (300, 0)), (900, 1400, True, PACKED, None),
    (900, 1400, False, PACKED, None), (256, 384, False, None, (-1, 100)), (100, 100, True, None, (0, 0))])
def test_block_mask_structure(t_q, t_k, causal, vl, window):
    """Every tile holding a visible (query, key) pair is listed, listed tiles are partial or full, never both, and a
    full tile is visible at every real (query, key) pair; the mask function is the visible intervals."""
    bm = flex.block_mask(t_q, t_k, causal, vl, window, CPU)
    lo, hi = exact.key_bounds(t_q, t_k, causal, vl, window, CPU)
    j = torch.arange(t_k)
    vis = (j[None, :] >= lo[:, None]) & (j[None, :] < hi[:, None])
    T = flex.TILE
    nq, nk = -(-t_q // T), -(-t_k // T)
    grid = torch.zeros(nq * T, nk * T, dtype=torch.bool)
    grid[:t_q, :t_k] = vis
    real = torch.zeros_like(grid)
    real[:t_q, :t_k] = True
    tiles, real_tiles = grid.view(nq, T, nk, T), real.view(nq, T, nk, T)
    some = tiles.any(3).any(1)
    whole = (tiles | ~real_tiles).all(3).all(1) & some

    def listed(num, idx):
        m = torch.zeros(nq, nk, dtype=torch.bool)
        for r in range(nq):
            m[r, idx[0, 0, r, :num[0, 0, r]].long()] = True
        return m

    part, full = listed(bm.kv_num_blocks, bm.kv_indices), listed(bm.full_kv_num_blocks, bm.full_kv_indices)
    assert not (part & full).any()
    assert torch.equal(part | full, some)
    assert not (full & ~whole).any()
    qi, ki = torch.meshgrid(torch.arange(t_q), torch.arange(t_k), indexing="ij")
    assert torch.equal(bm.mask_mod(0, 0, qi, ki), vis)
    assert flex.block_mask(t_q, t_k, causal, vl, window, CPU) is bm  # kept: with the pack, or in the dense LRU


@pytest.mark.parametrize("case", ["dense", "dense-rect", "packed", "packed-full"])
def test_blocks_match_exact(case):
    """Forward and backward of blocks against the exact math (float64), the backward with merged statistics (an
    ``lse`` above the block's own, another ``out``) as the ring passes them."""
    g = torch.Generator().manual_seed(1)
    dt = torch.float64
    if case.startswith("dense"):
        n_q = 200 if case == "dense-rect" else 300
        q, k, v = (torch.randn(2, n, h, d, generator=g, dtype=dt) for n, h, d in ((n_q, 4, 16), (300, 2, 16),
                                                                                   (300, 2, 8)))
        vl, causal, window, softcap = None, True, (40, 0), 5.0
    else:
        q, k, v = (torch.randn(n, h, 16, generator=g, dtype=dt) for n, h in ((900, 4), (1400, 2), (1400, 2)))
        vl, causal = PACKED, case == "packed"
        window, softcap = ((30, 0), 5.0) if causal else ((30, 3), None)
    o1, l1 = exact.forward(q, k, v, 0.3, causal, vl, window, softcap)
    o2, l2 = flex.forward(q, k, v, 0.3, causal, vl, window, softcap)
    assert torch.equal(torch.isfinite(l1), torch.isfinite(l2))
    fin = torch.isfinite(l1)
    assert (o1 - o2).abs().max() < 1e-12 and (l1[fin] - l2[fin]).abs().max() < 1e-12
    lse = torch.where(fin, l1 + torch.rand(l1.shape, generator=g, dtype=dt), l1)  # merged: other blocks add terms
    out, dout = torch.randn(o1.shape, generator=g, dtype=dt), torch.randn(o1.shape, generator=g, dtype=dt)
    for a, b in zip(exact.backward(dout, q, k, v, out, lse, 0.3, causal, vl, window, softcap),
                    flex.backward(dout, q, k, v, out, lse, 0.3, causal, vl, window, softcap)):
        assert a.shape == b.shape and (a - b).abs().max() < 1e-11


@pytest.mark.parametrize("n_q,n_k", [(0, 10), (10, 0)])
def test_empty_blocks(n_q, n_k):
    """A block without queries or keys: out 0 and lse -inf, zero gradients, as the exact math gives them."""
    q, k, v = torch.randn(1, n_q, 4, 8), torch.randn(1, n_k, 2, 8), torch.randn(1, n_k, 2, 8)
    out, lse = flex.forward(q, k, v, 0.3, True, None, (3, 0), 2.0)
    assert out.shape == q.shape and lse.shape == (1, 4, n_q) and not out.abs().sum() and (lse == -float("inf")).all()
    grads = flex.backward(torch.ones_like(out), q, k, v, out, lse, 0.3, True, None, (3, 0), 2.0)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape] and not any(g.abs().sum() for g in grads)


def _spied(monkeypatch=None):
    """Count the flex kernel's entries (the rank tasks patch the module themselves)."""
    calls = {"forward": 0, "backward": 0, "attend": 0}
    for name in calls:
        real = getattr(flex, name)

        def spy(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)
        if monkeypatch is not None:
            monkeypatch.setattr(flex, name, spy)
        else:
            setattr(flex, name, spy)
    return calls


def _flex_matrix(group) -> dict[str, int]:
    calls = _spied()
    with use_kernel_policy(flex="first"):
        for i, (fmt, name, causal) in enumerate([(f, n, c) for f in ("bshd", "sbhd", "thd") for n in FEATS
                                                  for c in (True, False)]):
            if fmt == "sbhd" and i % 2:
                continue
            check(group, "p2p", fmt, causal, 4, 2 if i % 3 else 1, FEATS[name], seed=i, lens=LENS)
        check(group, "p2p", "thd", True, 4, 2, {**FEATS["window+softcap"], "sinks": True}, seed=40, lens=LENS)
        check(group, "p2p", "bshd", True, 4, 1, {**FEATS["softcap"], "sinks": True}, seed=41, lens=LENS)
    return calls


def test_cp1_through_flex_matches_reference(monkeypatch):
    """CP1: one block, run through FlexAttention's own autograd (no block backward)."""
    calls = _spied(monkeypatch)
    with use_kernel_policy(flex="first"):
        for i, (fmt, name) in enumerate([(f, n) for f in ("bshd", "sbhd", "thd") for n in FEATS]):
            for causal in (True, False):
                check(None, "p2p", fmt, causal, 4, 2 if i % 2 else 4, FEATS[name], seed=i, lens=LENS)
    assert calls["attend"] == 18 and calls["forward"] == calls["backward"] == 0
    with use_kernel_policy(flex="first"):  # sinks through the log-sum-exp of the same autograd call
        for i, fmt in enumerate(("bshd", "thd")):
            check(None, "p2p", fmt, True, 4, 2, {**FEATS["window+softcap"], "sinks": True}, seed=30 + i, lens=LENS)
    assert calls["attend"] == 20 and calls["forward"] == calls["backward"] == 0


def _cp2(world: int) -> dict[str, int]:
    group = cpscope.new_cp_groups([world], hierarchical=True)[world]
    cpscope.set_backward_read_check(True)
    return _flex_matrix(group)


def test_cp2_blocks_through_flex_match_reference():
    """CP2: the ring's (softcap) and the halo's (window) blocks on flex, backward from the merged statistics."""
    for calls in run_ranks(2, _cp2, 2):
        assert calls["forward"] > 0 and calls["backward"] > 0 and calls["attend"] == 0


def test_refusal_sends_the_block_to_the_next_route(monkeypatch, caplog):
    monkeypatch.setattr(router, "_REFUSED", {})

    def refuse(*a, **kw):
        raise flex.FlexUnsupported("no kernel for this head dim")
    monkeypatch.setattr(flex, "forward", refuse)
    q, k, v = torch.randn(1, 64, 4, 8), torch.randn(1, 64, 2, 8), torch.randn(1, 64, 2, 8)
    with use_kernel_policy(flex="first"), caplog.at_level("WARNING", logger=router.__name__):
        for _ in range(2):
            out, lse = router.block_forward(q, k, v, scale=0.3, causal=True, softcap=2.0)
        assert router.choose(q, k, v, causal=True, varlen=None, window=None, softcap=2.0) == "exact"
        assert router.choose(q, k, v, causal=True, varlen=None, window=None, softcap=2.0,
                             direction="backward") == "flex"
    want = exact.forward(q, k, v, 0.3, True, None, None, 2.0)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    assert len([r for r in caplog.records if "FlexAttention refused" in r.getMessage()]) == 1
    assert "head dim" in next(iter(router.fallbacks().values()))


def _cyclic_garbage() -> list[str]:
    """Tensors and frames that only the cyclic collector would free (FakeTensors — storage-less values of torch's
    own tracing of the score modifier on the CPU's eager path — aside)."""
    from torch._subclasses.fake_tensor import FakeTensor

    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = [o for o in gc.garbage if isinstance(o, (torch.Tensor, types.FrameType))
                 and not isinstance(o, FakeTensor)]
        gc.garbage.clear()
    finally:
        gc.set_debug(0)
    return [f"frame {o.f_code.co_name}" if isinstance(o, types.FrameType) else f"tensor {tuple(o.shape)}"
            for o in found]


@pytest.mark.parametrize("fmt", ["bshd", "thd", "blocks"])
def test_no_cycles_and_caches_clear(fmt):
    """A flex call (CP1 through its autograd; a block forward + backward from merged statistics) leaves nothing
    for the cyclic collector: its outputs, gradients, block mask and interval tensors die by reference counting once
    the caches are cleared (the dense masks' LRU; packed masks live with their pack)."""
    cpscope.clear_caches()
    gc.collect()
    gc.disable()
    try:
        with use_kernel_policy(flex="first"):
            if fmt == "blocks":
                q, k, v = torch.randn(1, 96, 4, 8), torch.randn(1, 96, 2, 8), torch.randn(1, 96, 2, 8)
                out, lse = router.block_forward(q, k, v, scale=0.3, causal=True, window=(9, 0), softcap=3.0)
                made = [out, lse, *router.block_backward(torch.ones_like(out), q, k, v, out, lse + 0.1, scale=0.3,
                                                         causal=True, window=(9, 0), softcap=3.0)]
            else:
                shape, extra = ((1, 96), {}) if fmt == "bshd" else ((96,), {
                    "cu_seqlens": torch.tensor([0, 40, 96], dtype=torch.int32)})
                q, k, v = (torch.randn(*shape, h, 8, requires_grad=True) for h in (4, 2, 2))
                out = cpscope.context_parallel_attention(q, k, v, qkv_format=fmt, window=(9, 0), softcap=3.0,
                                                         group=None, **extra)
                made = [out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out))]
        refs = [weakref.ref(t) for t in made]
        masks = [weakref.ref(m) for m in flex._dense_masks.values()]
        assert len(masks) == (0 if fmt == "thd" else 1)
        lo = [weakref.ref(m().mask_mod.__closure__[1].cell_contents) for m in masks]
        del made, out, q, k, v
        if fmt == "blocks":
            del lse
        cpscope.clear_caches()
        assert not flex._dense_masks and not flex._compiled
        alive = [r for r in refs + masks + lo if r() is not None]
        garbage = _cyclic_garbage()
    finally:
        gc.enable()
    assert not alive, f"{len(alive)} objects of the call kept alive by a reference cycle"
    assert not garbage, f"the call left cyclic garbage holding {garbage[:10]}"
