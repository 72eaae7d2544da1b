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

from .. import _tensor_cache
from .._checks import check_cu_seqlens, check_local_thd_len
from .._pack import host_offsets
from ..scope import CPScope

__all__ = ["Pieces", "Runs", "pieces_for", "pieces_of_input", "runs_of_input", "run_pieces"]


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


@dataclass(frozen=True)
class Runs:
    """How a kernel sees one rank's local tokens: ``rows`` equal runs (``[rows, L, ...]``, no offsets) or one varlen
    row whose pieces start at the local offsets ``cu`` — the form of flash-linear-attention's chunk functions.

    Attributes:
        pieces: the geometry (:class:`Pieces`): which global chunk each run is, for the summary exchange.
        rows: kernel batch rows: ``B`` (``bshd`` at CP1), ``2·B`` (``bshd`` under CP: a row's front and back chunk
            are two runs, ``[B, T] -> [2B, T/2]`` is a view) or ``1`` (``thd``: varlen).
        cu: ``[pieces + 1]`` local piece offsets on the input's device (``thd`` only): at CP1 the caller's own
            ``cu_seqlens`` tensor when it already sits there (the same object every layer, so a kernel's caches keyed
            on it hit), else one cached copy per offsets tensor.
        cu_cpu: the same offsets on the host (int64), so the kernel need not copy them back.
        has_empty: whether a run holds no token (an empty document; the Triton kernels are not given those).
    """

    pieces: Pieces
    rows: int
    cu: Optional[torch.Tensor] = None
    cu_cpu: Optional[torch.Tensor] = None
    has_empty: bool = False

    def shape(self, t: torch.Tensor) -> torch.Tensor:
        """``[B, T, ...]`` -> ``[rows, L, ...]`` (a view; the tensor itself when ``rows == B``)."""
        return t if t.shape[0] == self.rows else t.reshape(self.rows, -1, *t.shape[2:])


def _runs(pieces: Pieces, batch: int, varlen: bool, cu_seqlens: Any, device: torch.device) -> Runs:
    has_empty = not all(pieces.lens)
    if not varlen:
        return Runs(pieces, batch * pieces.per_doc, has_empty=has_empty)
    offsets = [0]
    for n in pieces.lens:
        offsets.append(offsets[-1] + n)
    cu_cpu = torch.tensor(offsets, dtype=torch.long)
    same = (pieces.cp == 1 and isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device == device
            and cu_seqlens.dtype in (torch.int32, torch.int64))
    return Runs(pieces, 1, cu_seqlens if same else cu_cpu.to(device=device, dtype=torch.int32), cu_cpu, has_empty)


def runs_of_input(
    batch: int, local_len: int, cu_seqlens: Optional[Any], scope: CPScope, device: torch.device, *, where: str,
    name: str = "x",
) -> Runs:
    """:func:`pieces_of_input` (same validation, same errors) and the kernel's view of it, cached per offsets tensor
    (or per ``(batch, local_len)`` for ``bshd``) so that a layer's host work does not grow with the documents.

    Example::

        runs = runs_of_input(1, 12, torch.tensor([0, 8, 24], dtype=torch.int32), scope, dev, where="f")
        runs.rows, runs.cu_cpu      # 1, tensor([0, 2, 4, 8, 12]) on CP rank 1 of 2
    """
    def build() -> Runs:
        pieces = pieces_of_input(batch, local_len, cu_seqlens, scope, where=where, name=name)
        return _runs(pieces, batch, cu_seqlens is not None, cu_seqlens, device)

    key = ("linear_runs", batch, local_len, scope.size, scope.rank, device)
    if isinstance(cu_seqlens, torch.Tensor):
        return _tensor_cache.derived(cu_seqlens, key, build)
    if cu_seqlens is None:
        return _tensor_cache.by_value(key, build)
    return build()


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
    if len(by_len) == 1:  # one length: the pieces tile the rows in order, so [tokens] -> [pieces, L] is a view
        (L,) = by_len
        n = len(pieces.lens)
        out, final = fn(*(t.view(n, L, *t.shape[1:]) for t in inputs), s0=s0)
        return out.reshape(n * L, *out.shape[2:]), final
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
