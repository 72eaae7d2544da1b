"""Per-pack metadata: what one microbatch's offsets imply for one CP rank, computed once, shared by every layer.

A *pack* is a microbatch's global document offsets (``cu_seqlens``; with padding, the layout offsets and the real
ones, as TE's ``cu_seqlens_padded`` / ``cu_seqlens``) as seen by CP rank ``rank`` of ``cp``. Validation, the zigzag
index of the local tokens, their global positions, the padding rows and whatever the attention ring derives from the
offsets are functions of ``(offsets, cp, rank)`` only: they are computed at the first call of the first layer and
then looked up, so host time per layer does not grow with the number of documents.

Lifetime. A pack is cached **on its offsets tensor** (:mod:`cpscope._tensor_cache`: weakly, by identity, while the
tensor keeps its content): it lives as long as that tensor and goes with it, so memory stays flat over a long run
with a fresh pack per microbatch. Offsets given as Python sequences (or one sequence length, for ``bshd`` /
``sbhd``) go to a small LRU cache instead. :func:`cpscope.clear_caches` drops every cache.

Example::

    pack = pack_for(cu_seqlens, cp=2, rank=1)         # validated once; cached on the cu_seqlens tensor
    idx = pack.indices(x.device)                       # full-tensor index of the local tokens (cached)
    pos = pack.positions(x.device)                     # their global positions, restarting per document
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch

from . import _tensor_cache
from ._checks import check_cu_seqlens, offsets_values

__all__ = ["Pack", "pack_for", "dense_pack", "host_offsets", "cu_seqlens_list"]

Offsets = Union[torch.Tensor, Sequence[int]]
_MISSING: Any = object()


class Pack:
    """Geometry of one packed microbatch for CP rank ``rank`` of ``cp``: validated offsets and cached derivatives.

    Attributes:
        cu: global layout offsets (the padded ones when padding is described), a tuple starting at 0.
        real: global real offsets (TE's ``cu_seqlens`` beside ``cu_seqlens_padded``), or ``None`` when the layout
            holds no padding.
        cp, rank: the CP size and this rank's rank in the group.
        lens, real_lens: per-document layout / real lengths; ``longest`` the longest layout document.

    Derived tensors (:meth:`indices`, :meth:`positions`, ...) are built on first use, per device, and kept for the
    pack's lifetime; treat them as read-only.

    Raises:
        ValueError: a document length not divisible by ``2·cp``; real offsets that do not fit the layout.

    Example::

        p = Pack((0, 4, 12), cp=2, rank=1)
        p.indices(torch.device("cpu"))      # tensor([1, 2, 6, 7, 8, 9])
    """

    __slots__ = ("cu", "real", "cp", "rank", "lens", "real_lens", "longest", "_memo", "__weakref__")

    def __init__(self, cu: tuple[int, ...], cp: int, rank: int, real: Optional[tuple[int, ...]] = None,
                 name: str = "cu_seqlens") -> None:
        check_cu_seqlens(list(cu), cp, name)
        self.cu, self.cp, self.rank = cu, cp, rank
        self.lens = tuple(b - a for a, b in zip(cu[:-1], cu[1:]))
        self.longest = max(self.lens, default=0)
        if real is not None:
            if len(real) != len(cu):
                raise ValueError(
                    f"{name} (real offsets) has {len(real) - 1} documents but cu_seqlens_padded (layout offsets) has "
                    f"{len(cu) - 1}: both must describe the same documents"
                )
            real_lens = tuple(b - a for a, b in zip(real[:-1], real[1:]))
            bad = [(i, r, n) for i, (r, n) in enumerate(zip(real_lens, self.lens)) if r > n]
            if bad:
                shown = ", ".join(f"document {i}: {r} real > {n} padded" for i, r, n in bad[:5])
                raise ValueError(
                    f"real document lengths must not exceed the padded ones: {shown} ({name}={list(real)}, "
                    f"cu_seqlens_padded={list(cu)})"
                )
            if real_lens == self.lens:
                real = None
        self.real = real
        self.real_lens = self.lens if real is None else real_lens
        self._memo: dict[Any, Any] = {}

    @property
    def total(self) -> int:
        """Tokens of the full (unsharded) layout."""
        return self.cu[-1]

    @property
    def local_tokens(self) -> int:
        """Tokens this rank holds."""
        return self.cu[-1] // self.cp

    @property
    def padded(self) -> bool:
        """Whether the layout holds padding tokens (real offsets were given and differ)."""
        return self.real is not None

    def memo(self, key: Any, build: Callable[[], Any]) -> Any:
        """``build()`` once per ``key`` for this pack's lifetime (for consumers' own derived state)."""
        value = self._memo.get(key, _MISSING)
        if value is _MISSING:
            value = self._memo.setdefault(key, build())
        return value

    # ---- zigzag index math -------------------------------------------------------------------------------------

    def indices(self, device: torch.device) -> torch.Tensor:
        """``[local_tokens]`` int64: where each local token sits in the full tensor."""
        return self.memo(("indices", device), lambda: self._host_index()[0].to(device))

    def positions(self, device: torch.device) -> torch.Tensor:
        """``[local_tokens]`` int64: the global position of each local token inside its document."""
        return self.memo(("positions", device), lambda: (self._host_index()[0] - self._host_index()[1]).to(device))

    def inverse(self, device: torch.device) -> torch.Tensor:
        """``inv`` with ``full = gathered.index_select(inv)`` where ``gathered`` is the rank-major concatenation."""

        def build() -> torch.Tensor:
            perm = torch.cat([_zigzag_index(self.cu, self.cp, r)[0] for r in range(self.cp)])
            inv = torch.empty_like(perm)
            inv[perm] = torch.arange(perm.numel())
            return inv.to(device)

        return self.memo(("inverse", device), build)

    def _host_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.memo("host_index", lambda: _zigzag_index(self.cu, self.cp, self.rank))

    # ---- padding -----------------------------------------------------------------------------------------------

    def real_local_lens(self, rank: Optional[int] = None) -> tuple[int, ...]:
        """Real tokens of each document held by CP rank ``rank`` (default this rank). They are a prefix of that
        rank's part of the document: padding sits at the end of a document, so a chunk's real tokens are its first
        ones, and the back chunk holds real tokens only if the front chunk is full."""
        r = self.rank if rank is None else rank
        return self.memo(("real_local", r), lambda: _real_local(self.lens, self.real_lens, self.cp, r))

    def local_offsets(self) -> tuple[int, ...]:
        """Local layout offsets of this rank's tensor (``cu / cp``)."""
        return self.memo("local_cu", lambda: tuple(x // self.cp for x in self.cu))

    def real_rows(self, device: torch.device, rank: Optional[int] = None) -> torch.Tensor:
        """``[n]`` int64 local rows of CP rank ``rank``'s real tokens (all rows without padding)."""
        r = self.rank if rank is None else rank

        def build() -> torch.Tensor:
            starts = torch.tensor(self.local_offsets()[:-1], dtype=torch.long)
            n = torch.tensor(self.real_local_lens(r), dtype=torch.long)
            doc = torch.repeat_interleave(torch.arange(len(n)), n)
            first = torch.cumsum(n, 0) - n
            return (starts[doc] + torch.arange(int(n.sum())) - first[doc]).to(device)

        return self.memo(("real_rows", r, device), build)

    def pad_rows(self, device: torch.device) -> Optional[torch.Tensor]:
        """``[n]`` int64 local rows of this rank's padding tokens, or ``None`` when it holds none."""

        def build() -> Optional[torch.Tensor]:
            if not self.padded:
                return None
            keep = torch.ones(self.local_tokens, dtype=torch.bool)
            keep[self.real_rows(torch.device("cpu"))] = False
            rows = torch.nonzero(keep).flatten()
            return rows.to(device) if rows.numel() else None

        return self.memo(("pad_rows", device), build)

    def __repr__(self) -> str:
        pad = f", padded ({sum(self.real_lens)} real of {self.total})" if self.padded else ""
        return f"Pack({len(self.lens)} documents, {self.total} tokens, cp={self.cp}, rank={self.rank}{pad})"


def _zigzag_index(cu: tuple[int, ...], cp: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(full-tensor indices of the local tokens, start offset of each local token's document); both [n_local]."""
    cu_t = torch.tensor(cu, dtype=torch.long)
    lens = cu_t[1:] - cu_t[:-1]  # [docs]
    local = lens // cp  # tokens per document on each rank (2 chunks)
    n_local = int(local.sum())
    doc = torch.repeat_interleave(torch.arange(len(lens)), local)  # [n_local] document of each local token
    local_start = torch.cumsum(local, 0) - local  # [docs] offset of each document in the local tensor
    k = torch.arange(n_local) - local_start[doc]  # offset of the token inside its document's local part
    start = cu_t[:-1][doc]
    if cp == 1:
        return start + k, start
    c = (local // 2)[doc]
    second = k >= c
    chunk_id = torch.where(second, 2 * cp - 1 - rank, rank)
    idx = start + chunk_id * c + torch.where(second, k - c, k)
    return idx, start


def _real_local(lens: Sequence[int], real_lens: Sequence[int], cp: int, rank: int) -> tuple[int, ...]:
    if cp == 1:
        return tuple(real_lens)
    out = []
    for n, r in zip(lens, real_lens):
        c = n // (2 * cp)
        front = min(c, max(0, r - rank * c))
        back = min(c, max(0, r - (2 * cp - 1 - rank) * c))
        out.append(front + back)
    return tuple(out)


# ----------------------------------------------------------------------------------------------------------------
# Lookup (cached in cpscope._tensor_cache)

_HOST_OFFSETS = ("host_offsets",)  # the key of a validated host copy in the tensor cache


def host_offsets(cu_seqlens: Offsets, name: str = "cu_seqlens") -> tuple[int, ...]:
    """Validated global offsets as a tuple of ints (``cpscope._checks.offsets_values``); for a tensor, one host
    copy kept while the tensor lives and keeps its content, so every layer of a forward shares one device sync.

    Example::

        cu = torch.tensor([0, 4, 12], dtype=torch.int32)
        host_offsets(cu)            # (0, 4, 12): one host copy, then served from the cache while cu is unchanged
    """
    if isinstance(cu_seqlens, torch.Tensor):
        return _tensor_cache.derived(cu_seqlens, _HOST_OFFSETS, lambda: offsets_values(cu_seqlens, name))
    return offsets_values(cu_seqlens, name)


def cu_seqlens_list(cu_seqlens: Offsets, name: str = "cu_seqlens") -> list[int]:
    """:func:`host_offsets` as a new list (yours to change)."""
    return list(host_offsets(cu_seqlens, name))


def pack_for(cu_seqlens: Offsets, cp: int, rank: int, *, cu_seqlens_padded: Optional[Offsets] = None,
             name: str = "cu_seqlens") -> Pack:
    """The :class:`Pack` of global offsets for CP rank ``rank`` of ``cp`` (validated once, then cached).

    ``cu_seqlens_padded`` follows TransformerEngine: when given it is the **layout** (where documents sit in the
    tensors) and ``cu_seqlens`` the **real** offsets (padding excluded); when omitted ``cu_seqlens`` is both. A
    layout tensor keeps its packs while it lives and keeps its content (:mod:`cpscope._tensor_cache`: also writes
    that torch does not see, on CPU); offsets given as values go to a small LRU.

    Raises:
        ValueError: malformed offsets, a document not divisible by ``2·cp``, real offsets that do not fit the layout.

    Example::

        b = cpscope.pad_packed_batch(ids, cu_seqlens=cu, cp=2)
        pack = pack_for(b.cu_seqlens, 2, rank, cu_seqlens_padded=b.cu_seqlens_padded)
    """
    layout_src = cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded
    layout_name = name if cu_seqlens_padded is None else "cu_seqlens_padded"
    real = None if cu_seqlens_padded is None else host_offsets(cu_seqlens, name)

    def by_value() -> Pack:
        layout = host_offsets(layout_src, layout_name)
        return _tensor_cache.by_value(("pack", layout, real, cp, rank),
                                      lambda: Pack(layout, cp, rank, real, layout_name))

    if not isinstance(layout_src, torch.Tensor):
        return by_value()
    return _tensor_cache.derived(
        layout_src, ("pack", cp, rank, real),
        lambda: Pack(host_offsets(layout_src, layout_name), cp, rank, real, layout_name), by_value,
    )


def dense_pack(seqlen: int, cp: int, rank: int) -> Pack:
    """The :class:`Pack` of one sequence of global length ``seqlen`` (``bshd`` / ``sbhd``); cached (LRU)."""
    return pack_for((0, seqlen), cp, rank, name="sequence length")
