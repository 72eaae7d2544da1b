"""One rank's share of the CP2 / CP4 matrix on gloo ranks that share one device (issue 31): every variant, layout
(``bshd``, ``thd``) and feature (dense, window, softcap, sinks) against a float64 reference of the whole sequences
computed on the device, forward and gradients (q, k, v, and the sinks' share of this rank's rows), with the sentinel
on and the collectives staged through the host (:mod:`tests.gloo_staging`).

Run by ``tests/attention/test_cp_one_gpu.py`` on CUDA (bf16, real kernels) and by ``tests/test_gloo_staging.py`` on
CPU (fp32, small shapes, CPU tensors staged too) so the body and the shim are exercised in CI.

Example::

    run_ranks(2, cp_matrix, 2, "cuda", torch.bfloat16, size="gpu")
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
import torch.distributed as dist

import cpscope
from tests.attention._reference import reference_attention, zigzag_index
from tests.gloo_staging import staged

VARIANTS = {2: ("p2p", "all_gather", "a2a"), 4: ("p2p", "all_gather", "a2a", "a2a+p2p")}  # a2a+p2p: 2 x 2 at CP4
FEATURES = ("dense", "window", "softcap", "sinks")
LAYOUTS = ("bshd", "thd")
TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-5}  # relative (norm) error against float64
# per size: q heads, k/v heads, head dim, bshd (batch, sequence), thd document lengths (multiples of 2 * 4), window
SIZES: dict[str, dict[str, Any]] = {
    "gpu": {"h": 8, "h_kv": 4, "d": 128, "dense": (1, 2048), "lens": [512, 1536, 256, 1024, 768], "window": 255},
    "cpu": {"h": 4, "h_kv": 4, "d": 8, "dense": (2, 32), "lens": [16, 40, 8, 24], "window": 5},
}


def _features(name: str, window: int) -> dict[str, Any]:
    return {"dense": {}, "window": {"window": (window, 0)}, "softcap": {"softcap": 5.0}, "sinks": {"sinks": True}}[name]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30)) if b.numel() else 0.0


def one_call(group: Any, comm: str, fmt: str, feat: str, dev: torch.device, dtype: torch.dtype, size: dict,
             seed: int) -> dict[str, float]:
    """One call on this rank against the float64 reference; relative errors of out, dq, dk, dv (and dsinks)."""
    cp, r = group.size(), dist.get_rank(group)
    g = torch.Generator(device=dev).manual_seed(seed)
    h, h_kv, d = size["h"], size["h_kv"], size["d"]
    if fmt == "thd":
        cu = [0]
        for n in size["lens"]:
            cu.append(cu[-1] + n)
        b, t = 1, cu[-1]
    else:
        (b, t), cu = size["dense"], None
    mk = lambda heads: torch.randn(b, t, heads, d, device=dev, dtype=torch.float64, generator=g)  # noqa: E731
    q, k, v, dout = mk(h), mk(h_kv), mk(h_kv), mk(h)
    kw = _features(feat, size["window"])
    sinks = torch.randn(h, device=dev, dtype=torch.float64, generator=g) if kw.pop("sinks", False) else None
    idx = zigzag_index(cu if cu is not None else [0, t], cp, r).to(dev)
    # the reference: float64, whole sequences
    qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
    sr = None if sinks is None else sinks.clone().requires_grad_(True)
    ref = torch.stack([reference_attention(qr[i], kr[i], vr[i], causal=True, cu=cu, sinks=sr, **kw)
                       for i in range(b)])
    own = None
    if sr is not None:  # this rank's rows' share of the sinks' gradient
        (own,) = torch.autograd.grad((ref[:, idx] * dout[:, idx]).sum(), sr, retain_graph=True)
    ref.backward(dout)
    # this rank's call
    local = lambda x: x[0, idx] if fmt == "thd" else x[:, idx]  # noqa: E731
    loc = [local(x).to(dtype).requires_grad_(True) for x in (q, k, v)]
    sk = None if sinks is None else sinks.float().requires_grad_(True)
    extra = {"cu_seqlens": torch.tensor(cu, dtype=torch.int32, device=dev)} if cu is not None else {}
    with cpscope.runtime_cp(group, comm=comm):
        out = cpscope.context_parallel_attention(*loc, qkv_format=fmt, causal=True, sinks=sk, **kw, **extra)
    out.backward(local(dout).to(dtype))
    errs = {"out": _rel(out, local(ref)), "dq": _rel(loc[0].grad, local(qr.grad)),
            "dk": _rel(loc[1].grad, local(kr.grad)), "dv": _rel(loc[2].grad, local(vr.grad))}
    if sk is not None:
        errs["dsinks"] = _rel(sk.grad, own)
    assert out.dtype == dtype and all(x.grad is not None and x.grad.dtype == dtype for x in loc)
    return errs


def cp_matrix(world: int, device: str, dtype: torch.dtype, *, size: str = "gpu", stage_cpu: bool = False,
              sentinel: bool = True, tol: Optional[float] = None) -> dict:
    """Every (variant, layout, feature) at this world's CP on this rank (asserted within ``tol``, default
    :data:`TOL`'s); returns the worst error per variant, the staged tensors per op, and the sentinel's checks."""
    tol = TOL[dtype] if tol is None else tol
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    group = cpscope.new_cp_groups([world], hierarchical=True)[world]
    worst: dict[str, float] = {}
    bad = []
    with staged(stage_cpu) as counts, cpscope.sentinel(every=1) if sentinel else contextlib.nullcontext() as s:
        for ci, comm in enumerate(VARIANTS[world]):
            for fi, fmt in enumerate(LAYOUTS):
                for si, feat in enumerate(FEATURES):
                    errs = one_call(group, comm, fmt, feat, dev, dtype, SIZES[size], seed=100 * ci + 10 * fi + si)
                    worst[comm] = max(worst.get(comm, 0.0), *errs.values())
                    if max(errs.values()) > tol:
                        bad.append((comm, fmt, feat, errs))
        staged_ops = dict(counts)
    assert not bad, f"CP{world} rank {dist.get_rank()}: relative errors above {tol}: {bad}"
    checks = {}
    if sentinel:
        assert not s.reports, f"the sentinel reported {s.reports[:3]}"
        checks = dict(s.summary().checks)
    return {"worst": worst, "staged": staged_ops, "checks": checks}

