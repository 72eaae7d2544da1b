"""One test case of a cpscope.linear recurrence: full inputs, the float64 reference on the full sequences (forward and
gradients), and the CP run on this rank's zigzag shard, compared row by row.

``run_case`` runs on every rank of a gloo pool (or in-process for CP1) and returns the largest normalised error of
the output and of each gradient (``max |got − want| / max(1, max |want|)``). ``break_mode`` swaps the fold of the
chunk summaries for a deliberately wrong one: ``"drop"`` (no state handed from one chunk to the next) or
``"cross"`` (the state handed across a document boundary).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

import cpscope
from cpscope.linear import causal_conv1d, gated_delta_rule, mamba2_scan, _summaries as summaries
from tests.linear import _reference as ref

KINDS = ("gdn", "kda", "mamba2", "conv")


def doc_lens(cp: int) -> list[int]:
    """Uneven document lengths divisible by 2·cp (the middle one gives chunks of 1 token at the chunk's cp)."""
    return [2 * cp * a for a in (2, 1, 4)]


def _inputs(kind: str, B: int, T: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[dict, dict]:
    """(sequence tensors [B, T, ...], replicated parameters)."""
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    if kind in ("gdn", "kda"):
        H, HV, K, V = 2, 4 if kind == "gdn" else 2, 4, 3
        g = -(0.02 + 0.15 * u(B, T, HV)) if kind == "gdn" else -(0.02 + 0.15 * u(B, T, HV, K))
        seq = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), g=g, beta=0.05 + 0.9 * u(B, T, HV))
        return {n: t.to(dtype) for n, t in seq.items()}, {}
    if kind == "mamba2":
        H, P, G, N = 4, 3, 2, 4
        seq = dict(x=r(B, T, H, P), dt=0.5 * r(B, T, H) - 1.0, B=r(B, T, G, N), C=r(B, T, G, N))
        par = dict(A=-(0.2 + u(H)), D=r(H), dt_bias=0.3 * r(H))
        return {n: t.to(dtype) for n, t in seq.items()}, {n: t.to(dtype) for n, t in par.items()}
    D, W = 6, 4
    return dict(x=r(B, T, D).to(dtype)), dict(weight=r(D, W).to(dtype), bias=r(D).to(dtype))


def _call(kind: str, seq: dict, par: dict, cu: Any, group: Any) -> torch.Tensor:
    if kind in ("gdn", "kda"):
        return gated_delta_rule(seq["q"], seq["k"], seq["v"], seq["g"], seq["beta"], cu_seqlens=cu, group=group,
                                use_qk_l2norm=True)
    if kind == "mamba2":
        return mamba2_scan(seq["x"], seq["dt"], par["A"], seq["B"], seq["C"], D=par["D"], dt_bias=par["dt_bias"],
                           chunk_size=4, cu_seqlens=cu, group=group)
    return causal_conv1d(seq["x"], par["weight"], par["bias"], activation="silu", cu_seqlens=cu, group=group)


def _reference(kind: str, seq: dict, par: dict, cu: Optional[list]) -> torch.Tensor:
    if kind in ("gdn", "kda"):
        return ref.delta_rule(seq["q"], seq["k"], seq["v"], seq["g"], seq["beta"], cu=cu, l2=True)
    if kind == "mamba2":
        return ref.mamba2(seq["x"], seq["dt"], par["A"], seq["B"], seq["C"], D=par["D"], dt_bias=par["dt_bias"],
                          cu=cu)
    return ref.conv1d(seq["x"], par["weight"], par["bias"], activation="silu", cu=cu)


def _fold_dropping_state(A: torch.Tensor, b: torch.Tensor, upto: int) -> torch.Tensor:
    """Break: every chunk starts from zero (no state handed from one chunk to the next)."""
    return torch.zeros_like(b[:, : upto + 1])


def _fold_across_documents(A: torch.Tensor, b: torch.Tensor, upto: int) -> torch.Tensor:
    """Break: each document starts from the previous document's final state instead of zero."""
    carry, out = torch.zeros_like(b[0, 0]), []
    for d in range(A.shape[0]):
        s, states = carry, [carry]
        for c in range(A.shape[1]):
            s = summaries.apply_transition(A[d, c], s) + b[d, c]
            states.append(s)
        out.append(torch.stack(states[: upto + 1]))
        carry = s
    return torch.stack(out)


_BREAKS = {None: None, "drop": _fold_dropping_state, "cross": _fold_across_documents}


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach(), want.detach()
    return float((got.double() - want).abs().max() / max(1.0, float(want.abs().max())))


def run_case(kind: str, layout: str, cp: int, *, seed: int = 0, dtype: str = "float64",
             break_mode: Optional[str] = None, use_scope: bool = False) -> dict[str, float]:
    """Errors of the CP run on this rank against the float64 full-sequence reference, cut per rank."""
    gen = torch.Generator().manual_seed(seed)
    if layout == "thd":
        lens = doc_lens(cp)
        cu_list = [0]
        for n in lens:
            cu_list.append(cu_list[-1] + n)
        B, T, cu = 1, cu_list[-1], torch.tensor(cu_list, dtype=torch.int32)
    else:
        cu_list, cu, B, T = None, None, 2, 2 * cp * 3
    seq, par = _inputs(kind, B, T, getattr(torch, dtype), gen)
    # reference: float64 on the full sequences, forward and gradients
    seq64 = {n: t.double().requires_grad_() for n, t in seq.items()}
    par64 = {n: t.double().requires_grad_() for n, t in par.items()}
    want = _reference(kind, seq64, par64, cu_list)
    wout = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    names = list(seq64) + list(par64)
    grads = torch.autograd.grad((want * wout).sum(), [*seq64.values(), *par64.values()])
    want_grads = dict(zip(names, grads))

    group = cpscope.new_cp_groups([cp])[cp] if cp > 1 else None
    shard = lambda t: cpscope.zigzag_shard(t, seq_dim=1, cu_seqlens=cu, group=group)  # noqa: E731
    local = {n: shard(t).detach().requires_grad_() for n, t in seq.items()}
    params = {n: t.detach().clone().requires_grad_() for n, t in par.items()}
    broken, saved = _BREAKS[break_mode], summaries.fold_chunks
    try:
        if broken is not None:
            summaries.fold_chunks = broken
        if use_scope:
            with cpscope.runtime_cp(group):
                out = _call(kind, local, params, cu, cpscope.scope.UNSET)
        else:
            out = _call(kind, local, params, cu, group)
    finally:
        summaries.fold_chunks = saved
    (out * shard(wout).to(out.dtype)).sum().backward()  # outside the scope: backward must not read it
    errs = {"out": _err(out, shard(want.detach()))}
    for n, t in local.items():
        errs[n] = _err(t.grad, shard(want_grads[n]))
    for n, t in params.items():
        g = t.grad.detach().double().clone()
        if group is not None:
            dist.all_reduce(g, group=group)  # replicated parameters: the ranks' gradients sum to the full one
        errs[n] = _err(g, want_grads[n])
    return errs
