"""Every rank of a CP group in one process, one after the other, through cpscope.linear's own phases.

A recurrence under CP is three phases: each rank summarises its pieces (local kernel pass), the summaries are
exchanged (one all-gather), each rank reads its incoming states (local). ``run_sequential`` runs phase 1 for every
rank, stacks the summaries in rank order (what the all-gather returns), then runs phase 3 for every rank, and puts
the local outputs back in global order. Autograd goes through all of it, so the gradients of the full inputs are
those of a real CP run summed over the ranks. It needs no process group: it checks the fla kernels at CP2 / CP4 on a
single GPU, and the same code on CPU with the torch kernels.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from cpscope._pack import dense_pack, pack_for
from cpscope.linear import _delta_rule as delta_rule, gated_delta_rule, _kernels as kernels, _mamba2 as mamba2, mamba2_scan, _summaries as summaries
from cpscope.linear._pieces import runs_of_input
from cpscope.scope import CPScope
from tests.linear import _reference as ref


def make_inputs(kind: str, B: int, T: int, *, H: int = 2, K: int = 4, V: int = 3, seed: int = 0,
                dtype: torch.dtype = torch.float64, device: Any = "cpu") -> tuple[dict, dict]:
    """(sequence tensors [B, T, ...], replicated parameters) of a GDN (``gdn``: ``2H`` value heads), KDA or Mamba2
    layer (``mamba2``: ``2H`` heads of ``V`` channels, ``H`` groups of state ``K``). Gates in fp32 or wider."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    gate = torch.float64 if dtype == torch.float64 else torch.float32
    if kind in ("gdn", "kda"):
        HV = 2 * H
        g = -(0.02 + 0.15 * u(B, T, HV)) if kind == "gdn" else -(0.02 + 0.15 * u(B, T, HV, K))
        seq = dict(q=r(B, T, H, K).to(dtype), k=r(B, T, H, K).to(dtype), v=r(B, T, HV, V).to(dtype), g=g.to(gate),
                   beta=(0.05 + 0.9 * u(B, T, HV)).to(dtype))
        par: dict = {}
    else:
        seq = dict(x=r(B, T, 2 * H, V).to(dtype), dt=(0.5 * r(B, T, 2 * H) - 1.0).to(dtype),
                   B=r(B, T, H, K).to(dtype), C=r(B, T, H, K).to(dtype))
        par = dict(A=-(0.2 + u(2 * H)).to(gate), D=r(2 * H).to(gate), dt_bias=(0.3 * r(2 * H)).to(gate))
    return ({n: t.to(device) for n, t in seq.items()}, {n: t.to(device) for n, t in par.items()})


def reference(kind: str, seq: dict, par: dict, cu: Optional[list]) -> torch.Tensor:
    """The float64 per-token loop on the full sequences (on CPU)."""
    s = {n: t.detach().double().cpu() for n, t in seq.items()}
    p = {n: t.detach().double().cpu() for n, t in par.items()}
    for t in (*s.values(), *p.values()):
        t.requires_grad_()
    if kind in ("gdn", "kda"):
        out = ref.delta_rule(s["q"], s["k"], s["v"], s["g"], s["beta"], cu=cu, l2=True)
    else:
        out = ref.mamba2(s["x"], s["dt"], p["A"], s["B"], s["C"], D=p["D"], dt_bias=p["dt_bias"], cu=cu)
    return out, s, p


def _local_index(B: int, T: int, cu: Optional[list], cp: int, rank: int, device: Any) -> torch.Tensor:
    pack = dense_pack(T, cp, rank) if cu is None else pack_for(tuple(cu), cp, rank)
    return pack.indices(torch.device(device))


def run_sequential(kind: str, seq: dict, par: dict, cu: Optional[list], cp: int, kern: kernels.Kernels,
                   chunk_size: Optional[int] = None) -> torch.Tensor:
    """The full ``[B, T, ...]`` output of a CP-``cp`` run of every rank in turn (differentiable in the inputs)."""
    B, T = next(iter(seq.values())).shape[:2]
    device = next(iter(seq.values())).device
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device)
    if cp == 1:
        return _direct(kind, seq, par, cu_t, chunk_size)
    idx = [_local_index(B, T, cu, cp, r, device) for r in range(cp)]
    runs = [runs_of_input(B, T // cp, cu_t, CPScope(None, cp, r), device, where="run_sequential") for r in range(cp)]
    local = [{n: t.index_select(1, i) for n, t in seq.items()} for i in idx]
    phase1, outs = [], []
    for r in range(cp):
        s = local[r]
        if kind in ("gdn", "kda"):
            K = s["q"].shape[-1]
            o_aug, A, b = delta_rule.summarise(kern, runs[r], s["q"], s["k"], s["v"], s["g"], s["beta"], K ** -0.5,
                                               True)
            phase1.append((A, b, o_aug))
        else:
            prep = mamba2.prepare(kern, s["x"], s["dt"], par["A"], s["B"], s["C"], par["dt_bias"], True,
                                  (0.0, math.inf))
            y, b = mamba2.local_scan(kern, runs[r], *prep, chunk_size)
            phase1.append((mamba2.piece_decays(prep[0], runs[r]), b, (prep, y)))
    gathered = torch.stack([summaries.pack_summaries(A, b) for A, b, _ in phase1])  # what the all-gather returns
    for r in range(cp):
        A, b, rest = phase1[r]
        s_in = summaries.states_from_gathered(gathered, tuple(A.shape[1:]), tuple(b.shape[1:]), runs[r].pieces)
        if kind in ("gdn", "kda"):
            v = local[r]["v"]
            outs.append(delta_rule.read_incoming(rest, s_in, runs[r], v.shape[-1]).reshape(v.shape).to(v.dtype))
        else:
            prep, y = rest
            y = y + mamba2.read_states(prep[0], prep[3], s_in, runs[r])
            outs.append(mamba2.finish(y, local[r]["x"], par["D"]))
    perm = torch.cat(idx)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return torch.cat(outs, 1).index_select(1, inv)


def _direct(kind: str, seq: dict, par: dict, cu: Optional[torch.Tensor], chunk_size: Optional[int]) -> torch.Tensor:
    if kind in ("gdn", "kda"):
        return gated_delta_rule(seq["q"], seq["k"], seq["v"], seq["g"], seq["beta"], cu_seqlens=cu, group=None,
                                use_qk_l2norm=True)
    return mamba2_scan(seq["x"], seq["dt"], par["A"], seq["B"], seq["C"], D=par["D"], dt_bias=par["dt_bias"],
                       chunk_size=chunk_size, cu_seqlens=cu, group=None)


def errors(kind: str, seq: dict, par: dict, cu: Optional[list], cp: int, kern: kernels.Kernels,
           chunk_size: Optional[int] = None, seed: int = 1, rms: bool = False) -> dict[str, float]:
    """Errors of the output and of every input's gradient of :func:`run_sequential` against the float64 reference:
    ``max |got − want| / max(1, max |want|)``, or with ``rms`` the relative RMS error ``‖got − want‖ / ‖want‖`` (the
    measure for bf16 / tf32 kernels, whose rounding is spread over every element)."""
    want, s64, p64 = reference(kind, seq, par, cu)
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    want_grads = torch.autograd.grad((want * w).sum(), [*s64.values(), *p64.values()])
    seq = {n: t.detach().clone().requires_grad_() for n, t in seq.items()}
    par = {n: t.detach().clone().requires_grad_() for n, t in par.items()}
    out = run_sequential(kind, seq, par, cu, cp, kern, chunk_size)
    wide = torch.promote_types(out.dtype, torch.float32)
    (out.to(wide) * w.to(out.device, wide)).sum().backward()
    errs = {"out": _err(out, want, rms)}
    for (n, t), gw in zip([*seq.items(), *par.items()], want_grads):
        errs[n] = _err(t.grad, gw, rms)
    return errs


def _err(got: torch.Tensor, want: torch.Tensor, rms: bool = False) -> float:
    got, want = got.detach().double().cpu(), want.detach()
    if rms:
        return float((got - want).norm() / want.norm().clamp(min=1e-30))
    return float((got - want).abs().max() / max(1.0, float(want.abs().max())))
