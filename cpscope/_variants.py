"""The one list of attention communication variants (``comm=``) and the parsing of a variant name.

Every module that names a variant (the scope, attention's dispatch, the cost model, calibration, the adapters)
takes it from here: :data:`VARIANTS` (what runs), :data:`COMM_CHOICES` (what a user may ask for: the variants and
``"auto"``), :func:`check_comm` (validation of a ``comm=`` value), :func:`check_variants` (validation of a list
of variant names, e.g. the candidates of the cost model) and :func:`split_comm` (``"a2a+p2p:4"`` ->
``("a2a+p2p", 4)``).
This module imports nothing of cpscope.

Example::

    from cpscope._variants import check_comm, split_comm
    check_comm("a2a+p2p:2")            # 'a2a+p2p:2'
    split_comm("a2a+p2p:2")            # ('a2a+p2p', 2)
"""
from __future__ import annotations

from typing import Iterable, Optional

__all__ = [
    "P2P", "ALL_GATHER", "A2A", "HIERARCHICAL", "AUTO", "VARIANTS", "COMM_CHOICES", "check_comm", "check_variants",
    "split_comm",
]

P2P = "p2p"  # the zigzag ring
ALL_GATHER = "all_gather"  # K/V gathered once
A2A = "a2a"  # Ulysses: all-to-all between sequence and heads
HIERARCHICAL = "a2a+p2p"  # all-to-all inside groups of N ranks, ring across them ("a2a+p2p:N" names N)
AUTO = "auto"  # chosen per call by the cost model

VARIANTS: tuple[str, ...] = (P2P, ALL_GATHER, A2A, HIERARCHICAL)
COMM_CHOICES: tuple[str, ...] = VARIANTS + (AUTO,)


def split_comm(comm: str) -> tuple[str, Optional[int]]:
    """``(name, inner size)`` of a checked variant name; the inner size is ``None`` unless ``"a2a+p2p:N"``."""
    name, _, inner = comm.partition(":")
    return name, (int(inner) if inner else None)


def check_comm(comm: Optional[str]) -> Optional[str]:
    """``comm`` if it names a variant (or is ``None``), else ``ValueError`` listing the choices."""
    if comm is None or comm in COMM_CHOICES:
        return comm
    if isinstance(comm, str) and comm.startswith(HIERARCHICAL + ":"):
        inner = comm[len(HIERARCHICAL) + 1:]
        if inner.isdigit() and int(inner) > 1:
            return comm
    raise ValueError(f"comm must be one of {COMM_CHOICES} or 'a2a+p2p:N' (N > 1 the inner size), got {comm!r}")


def check_variants(names: Iterable[str], *, what: str = "variants", extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """``names`` as a tuple if each is one of :data:`VARIANTS` (bare names: no ``"auto"``, no ``":N"``) or of
    ``extra``; else ``ValueError`` naming the unknown ones, the argument (``what``) and the choices.

    Example::

        check_variants(["p2p", "a2a"])         # ('p2p', 'a2a')
        check_variants(["ulysses"])            # ValueError: unknown communication variant 'ulysses' (variants ...
    """
    names = tuple(names)
    unknown = [n for n in names if n not in VARIANTS and n not in extra]
    if unknown:
        bad = repr(unknown[0]) if len(unknown) == 1 else str(unknown)
        s = "" if len(unknown) == 1 else "s"
        raise ValueError(f"unknown communication variant{s} {bad} ({what} must be some of {VARIANTS + extra}, got "
                         f"{list(names)})")
    return names
