"""The affine chunk-summary algebra: how a recurrence's state crosses chunk and rank boundaries.

Each recurrence here is affine in its state over any run of tokens: the state ``S`` leaving a run is
``S_out = A · S_in + b``, with

* ``b`` — the state the run leaves when it starts from zero (``[.., K, V]``: the delta rule's ``K×V`` memory,
  Mamba2's ``P×N`` state), and
* ``A`` — the run's transition: a scalar per head (Mamba2, ``exp(Σ dt·A)``) stored as ``[.., H]``, or a matrix per
  head (the gated delta rule: ``Π (I − β k kᵀ) diag(exp g)``, for GDN's scalar gate and KDA's per-channel gate
  alike) stored as ``[.., H, K, K]``.

Summaries compose: running ``(A₁, b₁)`` then ``(A₂, b₂)`` is ``(A₂A₁, A₂b₁ + b₂)``. So a rank summarises each of its
pieces on its own (in fp32 or wider), the summaries are all-gathered once (:mod:`cpscope.linear._exchange`), and the
state entering global chunk ``c`` of a document is the fold of chunks ``0 .. c−1`` from a zero state — **reset to
zero at every document start**: no state crosses a document boundary. Each piece then runs its local recurrence from
that incoming state.

Example::

    s_in = incoming_states(A, b, pieces, scope)   # [pieces, H, K, V]: the state entering each local piece
"""
from __future__ import annotations

import math

import torch

from ..scope import CPScope
from ._exchange import all_gather_pieces
from ._pieces import Pieces

__all__ = ["apply_transition", "compose", "fold_chunks", "incoming_states", "pack_summaries", "states_from_gathered"]


def apply_transition(A: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """``A · S`` for a scalar transition ``A [.., H]`` or a matrix one ``A [.., H, K, K]``; ``S [.., H, K, V]``."""
    if A.dim() == S.dim() - 2:
        return A[..., None, None] * S
    return A @ S


def compose(first: tuple[torch.Tensor, torch.Tensor], second: tuple[torch.Tensor, torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The summary of running ``first`` then ``second``: ``(A₂A₁, A₂b₁ + b₂)``.

    Example::

        A, b = compose((A1, b1), (A2, b2))
    """
    (a1, b1), (a2, b2) = first, second
    a = a2 * a1 if a1.dim() == b1.dim() - 2 else a2 @ a1
    return a, apply_transition(a2, b1) + b2


def fold_chunks(A: torch.Tensor, b: torch.Tensor, upto: int) -> torch.Tensor:
    """States entering chunks ``0 .. upto`` of each document: ``S₀ = 0``, ``S_{c+1} = A_c S_c + b_c``.

    ``A [docs, chunks, H]`` or ``[docs, chunks, H, K, K]``, ``b [docs, chunks, H, K, V]`` in global chunk order.
    Returns ``[docs, upto + 1, H, K, V]``. Every document starts from zero (no state crosses a document boundary).
    """
    state = torch.zeros_like(b[:, 0])
    states = [state]
    for c in range(upto):
        state = apply_transition(A[:, c], state) + b[:, c]
        states.append(state)
    return torch.stack(states, 1)


def _global_order(pieces: Pieces) -> torch.Tensor:
    """``[docs, 2·cp]`` index into the rank-major flattening of the gathered pieces: chunk ``c`` of document ``d``."""
    cp, n_local = pieces.cp, pieces.docs * pieces.per_doc
    idx = torch.empty(pieces.docs, 2 * cp, dtype=torch.long)
    for c in range(2 * cp):
        owner, back = (c, 0) if c < cp else (2 * cp - 1 - c, 1)
        idx[:, c] = owner * n_local + torch.arange(pieces.docs) * 2 + back
    return idx


def pack_summaries(A: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[pieces, a + b]``: this rank's summaries in one tensor, what :func:`incoming_states` exchanges."""
    return torch.cat([A.reshape(A.shape[0], -1), b.reshape(b.shape[0], -1)], 1)


def states_from_gathered(gathered: torch.Tensor, A_shape: tuple[int, ...], b_shape: tuple[int, ...],
                         pieces: Pieces) -> torch.Tensor:
    """The state entering each of ``pieces``' local pieces, from every rank's :func:`pack_summaries` stacked in CP
    rank order (``[cp, pieces, a + b]``): ``[pieces, H, K, V]``. Pure (no collective): one rank's part of
    :func:`incoming_states`, or every rank's in turn in one process.

    Example::

        gathered = torch.stack([pack_summaries(A_r, b_r) for A_r, b_r in per_rank])
        s_in_1 = states_from_gathered(gathered, A_r.shape[1:], b_r.shape[1:], pieces_for(cu, cp, 1))
    """
    cp, rank, docs = pieces.cp, pieces.rank, pieces.docs
    flat = gathered.flatten(0, 1)  # [cp * pieces, a + b]
    flat = flat.index_select(0, _global_order(pieces).flatten().to(flat.device)).view(docs, 2 * cp, -1)
    n_a = flat.shape[-1] - math.prod(b_shape)
    A_all = flat[..., :n_a].reshape(docs, 2 * cp, *A_shape)
    b_all = flat[..., n_a:].reshape(docs, 2 * cp, *b_shape)
    back = 2 * cp - 1 - rank
    states = fold_chunks(A_all, b_all, back)  # [docs, back + 1, H, K, V]
    mine = torch.stack([states[:, rank], states[:, back]], 1)  # [docs, 2, H, K, V]: front, back
    return mine.flatten(0, 1)


def incoming_states(A: torch.Tensor, b: torch.Tensor, pieces: Pieces, scope: CPScope) -> torch.Tensor:
    """The state entering each local piece: ``[pieces, H, K, V]`` (zeros under CP1).

    ``A`` / ``b`` are this rank's piece summaries in local piece order (``[pieces, H]`` or ``[pieces, H, K, K]``;
    ``[pieces, H, K, V]``). One differentiable all-gather of ``(A, b)`` over ``scope``'s group; every rank computes
    the fold of the chunks before each of its own (:func:`states_from_gathered`).
    """
    if pieces.cp == 1:
        return torch.zeros_like(b)
    gathered = all_gather_pieces(pack_summaries(A, b), scope)  # [cp, pieces, a + b]: one collective for both
    return states_from_gathered(gathered, tuple(A.shape[1:]), tuple(b.shape[1:]), pieces)
