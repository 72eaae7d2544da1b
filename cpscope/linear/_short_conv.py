"""``causal_conv1d``: depthwise causal short convolutions under the active CP scope (LFM2, and the convolutions in
front of GDN / KDA / Mamba2 mixers).

Per channel ``d``, with the kernel ``w [D, W]`` and inputs that are zero before a document's start::

    y_t = act(bias_d + Σ_{i<W} w[d, i] · x_{t−W+1+i})          act: None or "silu"

— ``nn.Conv1d(D, D, W, groups=D, padding=W−1)`` truncated to the first ``T`` outputs, as the models run it.

The "state" of a convolution is its last ``W − 1`` inputs: over a piece of ``L`` tokens it is affine in the incoming
one (shifted up by ``L`` rows, plus the piece's own last rows), so the summary machinery of
:mod:`cpscope.linear._summaries` gives each piece its halo — the ``W − 1`` tokens before it in the global sequence,
from whichever chunks hold them (several when chunks are shorter than ``W − 1``), zeros before a document starts.
One all-gather of ``W − 1`` rows per piece.

Example::

    with cpscope.runtime_cp(groups[2]):
        y = cpscope.linear.causal_conv1d(x, conv.weight.squeeze(1), conv.bias, activation="silu")   # x [B, T/2, D]
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from ..scope import UNSET, resolve_scope
from . import _summaries as summaries
from ._pieces import Pieces, pieces_of_input, run_pieces

__all__ = ["causal_conv1d"]

_WHERE = "causal_conv1d"
ACTIVATIONS = (None, "silu", "swish")


def _check(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], activation: Any) -> None:
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and (not isinstance(t, torch.Tensor) or not t.is_floating_point()):
            raise ValueError(f"{_WHERE}: {name} must be a floating-point tensor, got {getattr(t, 'dtype', type(t))}")
    if x.dim() != 3:
        raise ValueError(f"{_WHERE}: x must be [B, T, D] (channels last), got shape {tuple(x.shape)}")
    D = x.shape[2]
    if weight.dim() != 2 or weight.shape[0] != D or weight.shape[1] < 1:
        raise ValueError(f"{_WHERE}: weight must be [D={D}, W] (depthwise, W >= 1), got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (D,):
        raise ValueError(f"{_WHERE}: bias must be [D] = {(D,)}, got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{_WHERE}: activation must be one of {ACTIVATIONS}, got {activation!r}")


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
    activation: Optional[str] = None, cu_seqlens: Optional[Any] = None, group: Any = UNSET,
) -> torch.Tensor:
    """A depthwise causal convolution over this rank's local zigzag shard, equal to the matching rows of the full one.

    Args:
        x: ``[B, T, D]`` local inputs, channels last (this rank's zigzag shard: ``T`` = global length / cp).
        weight: ``[D, W]`` (``conv.weight.squeeze(1)`` of a depthwise ``nn.Conv1d``); ``weight[:, -1]`` multiplies the
            current token.
        bias: ``[D]`` or ``None``.
        activation: ``None`` or ``"silu"`` (``"swish"`` is the same).
        cu_seqlens: **global** document offsets (int32) of a packed row (``B == 1``); inputs before a document's
            start are zero. ``None``: each row is one sequence.
        group: the CP group (``None`` = CP1); default the active scope (read once, in forward).

    Returns:
        ``y [B, T, D]`` in ``x``'s dtype. Differentiable in ``x``, ``weight`` and ``bias``.

    Raises:
        ValueError: mismatched shapes, an unknown activation, a local length that does not match ``cu_seqlens`` and
            the CP size, a document length not divisible by ``2·cp`` — before any collective runs.

    Example::

        y = causal_conv1d(x, w, activation="silu", cu_seqlens=cu, group=groups[4])
    """
    _check(x, weight, bias, activation)
    scope = resolve_scope(group)
    Bt, T, D = x.shape
    pieces = pieces_of_input(Bt, T, cu_seqlens, scope, where=_WHERE, name="x")
    W1 = weight.shape[1] - 1
    xf = x.reshape(Bt * T, D)
    halos = halos_of(xf, W1, pieces, scope)  # [pieces, W1, D]
    fn = lambda run, *, s0: (_conv(run, s0, weight.to(x.dtype), bias, activation), s0[:, :0])  # noqa: E731
    y = run_pieces(pieces, fn, [xf], halos)[0]
    return y.reshape(Bt, T, D)


def _conv(run: torch.Tensor, halo: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
          activation: Optional[str]) -> torch.Tensor:
    """``[n, L, D]`` outputs of runs ``[n, L, D]`` preceded by their halos ``[n, W − 1, D]``."""
    ext = torch.cat([halo, run], 1).transpose(1, 2)  # [n, D, W - 1 + L]
    y = F.conv1d(ext, weight.unsqueeze(1), None if bias is None else bias.to(run.dtype), groups=weight.shape[0])
    y = y.transpose(1, 2)
    return F.silu(y) if activation is not None else y


def _tails(xf: torch.Tensor, W1: int, pieces: Pieces) -> torch.Tensor:
    """``[pieces, W1, D]``: the last ``W1`` rows of each piece, front-padded with zeros when it is shorter."""
    starts = torch.tensor(pieces.starts, dtype=torch.long)
    lens = torch.tensor(pieces.lens, dtype=torch.long)
    rows = (starts + lens)[:, None] - W1 + torch.arange(W1)  # [pieces, W1] local rows
    valid = rows >= starts[:, None]
    idx = torch.where(valid, rows + 1, torch.zeros_like(rows))  # row 0 of the padded tensor is zeros
    padded = torch.cat([xf.new_zeros(1, xf.shape[1]), xf])
    return padded.index_select(0, idx.flatten().to(xf.device)).view(len(pieces.lens), W1, xf.shape[1])


def _shifts(W1: int, pieces: Pieces, like: torch.Tensor) -> torch.Tensor:
    """``[pieces, 1, W1, W1]``: the transition of the last-``W1``-inputs state over each piece (shift up by L)."""
    i = torch.arange(W1)
    lens = torch.tensor(pieces.lens, dtype=torch.long)
    shift = (i[None, None, :] == i[None, :, None] + lens[:, None, None])  # [pieces, W1 (row), W1 (col)]
    return shift.to(dtype=like.dtype, device=like.device).unsqueeze(1)


def halos_of(xf: torch.Tensor, W1: int, pieces: Pieces, scope: Any) -> torch.Tensor:
    """The ``W1`` inputs before each local piece in its document (zeros before the start): ``[pieces, W1, D]``."""
    if W1 == 0 or pieces.cp == 1:
        return xf.new_zeros(len(pieces.lens), W1, xf.shape[1])
    tails = _tails(xf, W1, pieces).unsqueeze(1)  # [pieces, 1, W1, D]
    return summaries.incoming_states(_shifts(W1, pieces, xf), tails, pieces, scope).squeeze(1)
