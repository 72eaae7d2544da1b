"""Mamba2's state-space scan (SSD) on one batch of equal-length runs, in torch: chunked, differentiable.

Per head, with the state ``h [P, N]`` starting at zero, the step's log-decay ``a_t = dt_t · A`` and the input
already multiplied by ``dt_t``::

    h_t = exp(a_t) h_{t−1} + x_t B_tᵀ          y_t = h_t C_t

Inside a chunk (cumulative log-decay ``c_t``): ``y_t = Σ_{s≤t} exp(c_t − c_s) (C_t·B_s) x_s`` plus the read of the
state entering the chunk, ``exp(c_t) h_in C_t``; the states entering the chunks follow from the chunks' own final
states by one masked matrix of decays. Only differences ``c_t − c_s ≤ 0`` are exponentiated.

Example::

    y, h, cum = chunk_ssd(x, a, B, C)      # x [N, L, H, P], a [N, L, H], B, C [N, L, H, N]; h [N, H, P, N]
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["chunk_ssd"]


def _decays(c: torch.Tensor, diagonal: int) -> torch.Tensor:
    """``exp(c_i − c_j)`` for ``j ≤ i − diagonal`` (0 elsewhere) along the last dim: ``[.., n, n]``."""
    n = c.shape[-1]
    keep = torch.ones(n, n, dtype=torch.bool, device=c.device).tril(-diagonal)
    return (c.unsqueeze(-1) - c.unsqueeze(-2)).masked_fill(~keep, float("-inf")).exp()


def chunk_ssd(x: torch.Tensor, a: torch.Tensor, B: torch.Tensor, C: torch.Tensor, chunk_size: Optional[int] = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the SSD scan over ``N`` runs of ``L`` tokens each from a zero state.

    Args:
        x: ``[N, L, H, P]`` inputs already multiplied by ``dt``; a: ``[N, L, H]`` log-decays ``dt · A``.
        B, C: ``[N, L, H, N]`` (groups already expanded to heads).
        chunk_size: tokens per chunk (default 64).

    Returns ``(y [N, L, H, P], h [N, H, P, N], cum [N, L, H])``: the outputs, the final states and the cumulative
    log-decay of each token from the start of its run (what the read of an incoming state needs).
    """
    Nb, L, H, P = x.shape
    Cs = chunk_size or 64
    cum = a.cumsum(1)
    if L == 0:
        return x.new_zeros(Nb, 0, H, P), x.new_zeros(Nb, H, P, B.shape[-1]), cum
    pad = (-L) % Cs  # padded tokens: x = 0, a = 0: they change nothing
    if pad:
        x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
        a = F.pad(a, (0, 0, 0, pad))
    n = (L + pad) // Cs
    x, B, C = (t.reshape(Nb, n, Cs, H, t.shape[-1]) for t in (x, B, C))
    c = a.reshape(Nb, n, Cs, H).cumsum(2).permute(0, 1, 3, 2)  # [Nb, n, H, Cs]

    inner = torch.einsum("bclhn,bcshn->bchls", C, B) * _decays(c, 0)
    y = torch.einsum("bchls,bcshp->bclhp", inner, x)
    to_end = (c[..., -1:] - c).exp()  # [Nb, n, H, Cs]
    states = torch.einsum("bclhn,bchl,bclhp->bchpn", B, to_end, x)  # each chunk's final state from zero

    ends = c[..., -1].cumsum(1).transpose(1, 2)  # [Nb, H, n]: log-decay from the run start to each chunk end
    ends0 = F.pad(ends, (1, 0))  # [Nb, H, n + 1]: ... to each chunk start
    enter = _decays(ends0, 0)[..., :, 1:]  # [Nb, H, n+1, n]: exp(ends0_i − ends_j) for j < i
    h_all = torch.einsum("bhij,bjhpn->bihpn", enter, states)  # [Nb, n + 1, H, P, N]: entering chunk i / final
    y = y + torch.einsum("bclhn,bchpn->bclhp", C, h_all[:, :n]) * c.exp().permute(0, 1, 3, 2)[..., None]
    return y.reshape(Nb, n * Cs, H, P)[:, :L], h_all[:, n], cum
