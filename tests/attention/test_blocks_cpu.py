"""The block kernels on CPU: aten's dense kernels against fakes (which placeholders a dense block's backward
receives), and the exact tiled math against a float64 reference.

The dense kernels' backward takes placeholder outputs of their forward (cum_seq_q/k, philox seed/offset), carried by
the call's :class:`~cpscope.attention._kernels.block.Placeholders`. Each device must get those of a forward on that
same device in that call, whatever order the devices run in; another call's placeholders are never used; the kept
placeholders must never be a tensor returned to the caller. Two devices are stood in by ``cpu`` and ``meta``
tensors; the real kernels are checked on GPU (tests/attention/test_gpu.py).
"""
from __future__ import annotations

import pytest
import torch

from cpscope.attention._kernels import Placeholders, Varlen, aten, block_backward, block_forward, exact
from cpscope.attention._kernels import aten as aten_mod


class _FakeKernel:
    """One fake aten overload: records its calls, answers with ``fn``."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def default(self, *args, **kwargs):
        self.calls.append(args)
        return self.fn(*args, **kwargs)


class _FakeAten:
    """Fake dense cuDNN / flash kernels whose placeholders name the device they were made for."""

    def __init__(self):
        self.seeds: dict[tuple[str, str], torch.Tensor] = {}

        def forward(kernel):
            def fn(q, k, v, *args, **kwargs):  # [b, h, s, d] views
                b, h, s, d = q.shape
                seed = torch.full((), 1000 + len(self.seeds), dtype=torch.long, device=q.device)
                self.seeds[(kernel, q.device.type)] = seed
                lse_shape = (b, h, s, 1) if kernel == "cudnn" else (b, h, s)
                return (torch.zeros(b, h, s, d, device=q.device), torch.zeros(lse_shape, device=q.device), None,
                        None, s, s, seed, torch.zeros((), dtype=torch.long, device=q.device), None)
            return fn

        def backward(*args, **kwargs):
            dout, q, k, v = args[:4]
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

        self._scaled_dot_product_cudnn_attention = _FakeKernel(forward("cudnn"))
        self._scaled_dot_product_flash_attention = _FakeKernel(forward("flash"))
        self._scaled_dot_product_cudnn_attention_backward = _FakeKernel(backward)
        self._scaled_dot_product_flash_attention_backward = _FakeKernel(backward)


@pytest.fixture
def fake_aten(monkeypatch):
    fake = _FakeAten()
    monkeypatch.setattr(aten_mod, "_aten", fake)
    return fake


@pytest.mark.parametrize("use_cudnn", [True, False])
def test_dense_placeholders_per_device(fake_aten, use_cudnn):
    kernel = "cudnn" if use_cudnn else "flash"
    kern = aten.SDPA_CUDNN if use_cudnn else aten.SDPA_FLASH
    bwd = getattr(fake_aten, f"_scaled_dot_product_{kernel}_attention_backward")
    seed_at = 6 if use_cudnn else 12  # where the seed sits among the backward's arguments
    qs = {dev: torch.zeros(1, 4, 2, 8, device=dev) for dev in ("cpu", "meta")}
    ph, other = Placeholders(), Placeholders()
    outs = {dev: kern.forward(q, q, q, 0.5, True, None, None, None, ph) for dev, q in qs.items()}  # cpu, then meta
    kern.forward(qs["cpu"], qs["cpu"], qs["cpu"], 0.5, True, None, None, None, other)  # another call's forward
    assert set(ph.kept()) == {(kernel, torch.device("cpu")), (kernel, torch.device("meta"))}
    for dev in ("meta", "cpu"):  # backward in the other order
        q, (out, lse) = qs[dev], outs[dev]
        kern.backward(torch.zeros_like(out), q, q, q, out, lse, 0.5, True, None, None, None, ph)
        assert bwd.calls[-1][seed_at] is fake_aten.seeds[(kernel, dev)] or dev == "cpu", dev
    # the cpu backward got this call's forward's seed, not the later call's
    assert bwd.calls[-1][seed_at] is not other.kept()[(kernel, torch.device("cpu"))][2]
    assert bwd.calls[-1][seed_at] is ph.kept()[(kernel, torch.device("cpu"))][2]
    # what is kept never shares memory with what a block returned (cpu: meta tensors have no memory)
    kept = {t.untyped_storage().data_ptr() for (_, dev), aux in ph.kept().items() if dev.type == "cpu"
            for t in aux if t is not None}
    out, lse = outs["cpu"]
    assert kept and kept.isdisjoint({out.untyped_storage().data_ptr(), lse.untyped_storage().data_ptr()})


def test_dense_backward_without_forward_on_that_device_raises(fake_aten):
    q = torch.zeros(1, 4, 2, 8)
    ph = Placeholders()
    out, lse = aten.SDPA_CUDNN.forward(q, q, q, 0.5, False, None, None, None, ph)
    m = q.to("meta")
    with pytest.raises(RuntimeError, match="meta"):
        aten.SDPA_CUDNN.backward(m, m, m, m, m, lse.to("meta"), 0.5, False, None, None, None, ph)
    with pytest.raises(RuntimeError, match="without a forward"):  # no placeholders of this call at all
        aten.SDPA_CUDNN.backward(torch.zeros_like(out), q, q, q, out, lse, 0.5, False, None, None, None, None)
    aten.SDPA_CUDNN.backward(torch.zeros_like(out), q, q, q, out, lse, 0.5, False, None, None, None, ph)  # fine


# ------------------------------------------------------------------------------------------------ CPU exact math


def _allowed(n_q: int, n_k: int, causal: bool, window) -> torch.Tensor:
    """[n_q, n_k] bool: the block API's bottom-right-aligned mask with a window, from the pairs' offsets."""
    left, right = window if window is not None else (-1, -1)
    off = torch.arange(n_k)[None, :] - (torch.arange(n_q)[:, None] + n_k - n_q)
    ok = torch.ones(n_q, n_k, dtype=torch.bool)
    if left != -1:
        ok &= off >= -left
    if right != -1:
        ok &= off <= right
    return ok & (off <= 0) if causal else ok


def _block_reference(q, k, v, dout, seqs, causal, window, softcap, scale):
    """float64 out, lse and gradients of one block; ``seqs``: [(q rows, k rows)] of each sequence."""
    q, k, v = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    g = q.shape[-2] // k.shape[-2]
    kk, vv = k.repeat_interleave(g, dim=-2), v.repeat_interleave(g, dim=-2)
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    mask = torch.zeros(q.shape[0], k.shape[0], dtype=torch.bool)
    for (qa, qb), (ka, kb) in seqs:
        mask[qa:qb, ka:kb] = _allowed(qb - qa, kb - ka, causal, window)
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    out = torch.einsum("hqk,khd->qhd", p, vv)
    out.backward(dout.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("window,softcap", [(None, None), ((3, 0), None), ((2, 5), 2.0), ((-1, 1), None),
                                            ((0, -1), 1.5), ((4, 2), None)])
def test_cpu_block_window_softcap_mla(window, softcap, monkeypatch):
    """Dense (n_q != n_k) and varlen blocks with a window, softcap, GQA and a v head dim != q/k's (12 / 8) equal a
    float64 reference, forward (out, lse) and backward, causal or not; tiles (a tiny budget) change nothing."""
    for causal, budget in ((True, None), (False, None), (True, 64), (False, 64)):
        if budget is not None:
            monkeypatch.setattr(exact, "TILE_BUDGET", budget)
        _check_block(causal, window, softcap)


def _check_block(causal, window, softcap) -> None:
    g = torch.Generator().manual_seed(3)
    h, h_kv, d, e, scale = 4, 2, 8, 12, 0.4
    # varlen: sequences with n_q <, =, > n_k, and an empty one
    lq, lk = [5, 7, 0, 9, 3], [9, 7, 4, 4, 0]
    cu_q, cu_k = [0], [0]
    for a, b in zip(lq, lk):
        cu_q.append(cu_q[-1] + a)
        cu_k.append(cu_k[-1] + b)
    vl = Varlen(torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32), max(lq), max(lk))
    cases = [(None, [((0, 6), (0, 10))], 6, 10), (vl, list(zip(zip(cu_q, cu_q[1:]), zip(cu_k, cu_k[1:]))),
                                                  cu_q[-1], cu_k[-1])]
    for varlen, seqs, t_q, t_k in cases:
        q = torch.randn(t_q, h, d, generator=g, dtype=torch.float64)
        k = torch.randn(t_k, h_kv, d, generator=g, dtype=torch.float64)
        v = torch.randn(t_k, h_kv, e, generator=g, dtype=torch.float64)
        dout = torch.randn(t_q, h, e, generator=g, dtype=torch.float64)
        ref = _block_reference(q, k, v, dout, seqs, causal, window, softcap, scale)
        wrap = (lambda x: x) if varlen is not None else (lambda x: x.unsqueeze(0))
        kw = dict(scale=scale, causal=causal, varlen=varlen, window=window, softcap=softcap)
        out, lse = block_forward(wrap(q), wrap(k), wrap(v), **kw)
        grads = block_backward(wrap(dout), wrap(q), wrap(k), wrap(v), out, lse, **kw)
        unwrap = (lambda x: x) if varlen is not None else (lambda x: x[0])
        assert unwrap(out).shape == (t_q, h, e) and lse.dtype == torch.float64
        for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (unwrap(out), unwrap(lse), *map(unwrap, grads)),
                                   ref):
            assert torch.equal(torch.isinf(got), torch.isinf(want)), name
            fin = ~torch.isinf(want)
            torch.testing.assert_close(got[fin], want[fin], atol=1e-12, rtol=0, msg=f"{name} ({varlen is not None})")


def test_cpu_block_window_is_banded():
    """A window far narrower than the block computes only the band: its tiles cover O(rows x window) pairs."""
    lo, hi = exact.key_bounds(4096, 4096, True, None, (31, 0), torch.device("cpu"))
    tiles = exact._tiles(lo, hi, 8)
    area = sum((i1 - i0) * (k1 - k0) for i0, i1, k0, k1 in tiles)
    assert area <= 4096 * 128, area  # the band (32 keys per row) within a small factor
    full = exact._tiles(*exact.key_bounds(4096, 4096, True, None, None, torch.device("cpu")), 8)
    assert sum((i1 - i0) * (k1 - k0) for i0, i1, k0, k1 in full) <= 2 * 4096 * 4097 // 2 + 4096 * 128  # causal
