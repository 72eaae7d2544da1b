"""Where a rank's local tokens sit in the global sequences: the *pieces* of a recurrence under the zigzag layout.

A recurrence runs along each document (a ``bshd`` row is one document; a ``thd`` pack lists its documents in the
global ``cu_seqlens``). Under CP size ``cp`` each document is cut into ``2·cp`` equal chunks and CP rank ``r`` holds
chunks ``r`` and ``2·cp−1−r`` (shared/CONTRACT.md's zigzag layout): two *pieces* per document, each a contiguous
run of local rows that is a contiguous run of the global document. Under CP1 a document is one piece.

Every tensor is first flattened to ``[local tokens, ...]`` (``bshd`` rows one after the other, which is exactly the
``thd`` layout of ``cu_seqlens = [0, T, 2T, ...]``), so one geometry serves both layouts.

Example::

    p = pieces_for((0, 8, 24), cp=2, rank=1)
    p.starts, p.lens, p.chunks     # (0, 2, 4, 8), (2, 2, 4, 4), (1, 2, 1, 2): front / back piece of each document
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from .._checks import check_cu_seqlens, check_local_thd_len
from .._pack import host_offsets
from ..scope import CPScope

__all__ = ["Pieces", "pieces_for", "pieces_of_input", "run_pieces"]


@dataclass(frozen=True)
class Pieces:
    """The local pieces of one rank, in local row order (document by document; front chunk, then back chunk).

    Attributes:
        cp, rank: the CP size and this rank's rank in the group.
        docs: number of documents (``bshd``: the batch size).
        starts, lens: local row where each piece starts, and its length (all pieces of a document have one length).
        chunks: the global chunk index of each piece inside its document (``0 .. 2·cp−1``; ``0`` under CP1).
        doc_lens: the global length of each document.
    """

    cp: int
    rank: int
    docs: int
    starts: tuple[int, ...]
    lens: tuple[int, ...]
    chunks: tuple[int, ...]
    doc_lens: tuple[int, ...]

    @property
    def per_doc(self) -> int:
        """Pieces per document: 1 under CP1, 2 otherwise."""
        return 1 if self.cp == 1 else 2

    @property
    def local_tokens(self) -> int:
        return sum(self.lens)

    def local_cu(self, device: Any = None) -> torch.Tensor:
        """``[pieces + 1]`` int32 local offsets of the pieces (for a varlen kernel)."""
        cu = [0]
        for n in self.lens:
            cu.append(cu[-1] + n)
        return torch.tensor(cu, dtype=torch.int32, device=device)


def pieces_for(cu: Sequence[int], cp: int, rank: int) -> Pieces:
    """The :class:`Pieces` of global document offsets ``cu`` (already validated) for CP rank ``rank`` of ``cp``."""
    doc_lens = tuple(int(b) - int(a) for a, b in zip(cu[:-1], cu[1:]))
    starts, lens, chunks = [], [], []
    row = 0
    for n in doc_lens:
        if cp == 1:
            starts.append(row), lens.append(n), chunks.append(0)
        else:
            c = n // (2 * cp)
            starts += [row, row + c]
            lens += [c, c]
            chunks += [rank, 2 * cp - 1 - rank]
        row += n // cp
    return Pieces(cp, rank, len(doc_lens), tuple(starts), tuple(lens), tuple(chunks), doc_lens)


def pieces_of_input(
    batch: int, local_len: int, cu_seqlens: Optional[Any], scope: CPScope, *, where: str, name: str = "x"
) -> Pieces:
    """Validate the sequence geometry of a ``[batch, local_len, ...]`` input and return its :class:`Pieces`.

    ``cu_seqlens`` (global document offsets, ``thd`` packed in one row) needs ``batch == 1`` and
    ``local_len == cu_seqlens[-1] / cp``; every document length must be divisible by ``2·cp``. Without it each of the
    ``batch`` rows is one sequence of global length ``local_len · cp`` (divisible by ``2·cp``).

    Raises:
        ValueError: naming the values, before any collective runs.
    """
    cp, rank = scope.size, scope.rank
    if cu_seqlens is None:
        if cp > 1 and local_len % 2:
            raise ValueError(
                f"{where}: {name} holds {local_len} local tokens per row; with CP size {cp} a zigzag shard holds two "
                f"equal chunks (the global length {local_len * cp} must be divisible by 2*cp={2 * cp}); pad the "
                "sequence"
            )
        cu = tuple(range(0, (batch + 1) * local_len * cp, local_len * cp)) if local_len else (0,) * (batch + 1)
        return pieces_for(cu, cp, rank)
    if batch != 1:
        raise ValueError(
            f"{where}: with cu_seqlens the documents are packed in one row ([1, tokens, ...]), got batch size {batch} "
            f"for {name}"
        )
    cu = host_offsets(cu_seqlens)
    check_cu_seqlens(list(cu), cp)
    check_local_thd_len(local_len, list(cu), cp, name)
    return pieces_for(cu, cp, rank)


def run_pieces(
    pieces: Pieces, fn: Callable[..., tuple[torch.Tensor, torch.Tensor]], inputs: Sequence[torch.Tensor],
    s0: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``fn`` on every piece, batching pieces of one length: ``(out [tokens, ...], final [pieces, ...])``.

    ``inputs`` are flat ``[tokens, ...]`` tensors; ``fn(*runs, s0=...)`` gets them as ``[n, L, ...]`` (``n`` pieces
    of ``L`` tokens) and the matching rows of ``s0`` (``[pieces, ...]`` or ``None``) and returns
    ``(out [n, L, ...], final [n, ...])``. Differentiable (gathers and scatters are index selects).
    """
    by_len: dict[int, list[int]] = {}
    for i, n in enumerate(pieces.lens):
        by_len.setdefault(n, []).append(i)
    device = inputs[0].device
    outs, rows_all, finals, order = [], [], [], []
    for L, idx in by_len.items():
        starts = torch.tensor([pieces.starts[i] for i in idx], dtype=torch.long)
        rows = (starts[:, None] + torch.arange(L)).flatten()  # host
        runs = [t.index_select(0, rows.to(device)).view(len(idx), L, *t.shape[1:]) for t in inputs]
        s = None if s0 is None else s0.index_select(0, torch.tensor(idx, device=s0.device))
        out, final = fn(*runs, s0=s)
        outs.append(out.reshape(len(idx) * L, *out.shape[2:]))
        rows_all.append(rows)
        finals.append(final)
        order += idx
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    rows = torch.cat(rows_all)
    if not torch.equal(rows, torch.arange(rows.numel())):
        inv = torch.empty_like(rows)
        inv[rows] = torch.arange(rows.numel())
        out = out.index_select(0, inv.to(device))
    final = torch.cat(finals) if len(finals) > 1 else finals[0]
    if order != sorted(order):
        inv_p = torch.empty(len(order), dtype=torch.long)
        inv_p[torch.tensor(order)] = torch.arange(len(order))
        final = final.index_select(0, inv_p.to(final.device))
    return out, final
