"""The report of ranks that disagree: the digest's fields and their names, :class:`RanksDisagreeError`, the messages.

:mod:`cpscope.attention._agreement` finds that the ranks of a CP group called attention differently; this module says
how, on every rank: each differing field by name with each rank's value (fetched with one ``all_gather_object``
when every rank is there to answer), or this rank's value and the group's smallest and largest (decoded from the
reduced digest, no collective) when not.

Example::

    try:
        out = cpscope.context_parallel_attention(q, k, v)
    except cpscope.RanksDisagreeError as e:
        print(e.values)            # {'comm': {0: 'p2p', 1: 'all_gather'}}
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from .._variants import VARIANTS
from ..groups import group_ranks

__all__ = ["RanksDisagreeError", "FIELDS", "LABELS", "FORMATS", "DTYPES", "SENTINEL_STATES", "raise_gathered",
           "raise_ranges", "raise_pending"]

KEEP_VALUES = 1024  # readable values kept per group between two verdicts, for the report
FORMATS = ("bshd", "sbhd", "thd")
DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
FIELDS: tuple[str, ...] = ("comm", "global_len", "rows", "cu_seqlens", "qkv_format", "causal", "dtype", "heads",
                           "kv_heads", "head_dim", "v_head_dim", "window", "softcap", "sinks", "sentinel")
LABELS = {
    "comm": "communication variant (comm)",
    "global_len": "global length (tokens per sequence; thd: the packed total)",
    "rows": "rows (bshd/sbhd: batch; thd: documents)",
    "cu_seqlens": "global cu_seqlens",
    "qkv_format": "layout (qkv_format)",
    "causal": "causal",
    "dtype": "dtype",
    "heads": "q heads",
    "kv_heads": "k/v heads",
    "head_dim": "q/k head dim",
    "v_head_dim": "v head dim",
    "window": "window",
    "softcap": "softcap",
    "sinks": "sinks given",
    "sentinel": "cpscope.sentinel sampling this call",
}
SENTINEL_STATES = ("no (sentinel off, or this call not sampled)", "yes (sentinel on, sampled call)")
_HINTS = {
    "comm": "pass the same comm= (or runtime_cp(..., comm=)) on every rank; comm='auto' needs the same chooser and "
            "calibration on every rank",
    "cu_seqlens": "every rank passes the whole microbatch's global offsets (the same cu_seqlens), not its own",
    "global_len": "every rank holds its zigzag shard (zigzag_shard) of the same global sequences",
    "rows": "every rank holds its zigzag shard of the same batch / documents",
    "sentinel": "switch cpscope.sentinel on at the same point on every rank (e.g. before the training loop), with "
                "the same every=, and mark the same microbatches: a sampled call runs the sentinel's collectives, "
                "which a rank that does not sample it would never enter",
}
_READABLE = {"global_len", "rows", "heads", "kv_heads", "head_dim", "v_head_dim", "causal", "sinks"}  # ints as is

FORMATS = ("bshd", "sbhd", "thd")
DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


class RanksDisagreeError(ValueError):
    """The ranks of a CP group ran different attention calls (variant, offsets, lengths, ...): raised on every rank.

    ``values`` maps each differing field to ``{global rank: that rank's value}`` (or, when not every rank could be
    asked, ``{"this rank": ..., "min": ..., "max": ...}``).

    Example::

        try:
            out = cpscope.context_parallel_attention(q, k, v)
        except cpscope.RanksDisagreeError as e:
            print(e.values)            # {'comm': {0: 'p2p', 1: 'all_gather'}}
    """

    def __init__(self, message: str, values: Optional[dict[str, dict[Any, Any]]] = None) -> None:
        super().__init__(message)
        self.values = dict(values or {})

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.values)


def _show(field: str, value: Any) -> Any:
    """A readable form of one field's value (for messages and ``RanksDisagreeError.values``)."""
    if field == "sentinel":
        return SENTINEL_STATES[int(bool(value))]
    if value is None:  # a call whose inputs failed validation (only its sentinel field is known)
        return None
    if field == "comm":
        name, inner = value
        return name if inner is None else f"{name}:{inner}"
    if field == "cu_seqlens":
        if value is None:
            return None
        cu, real = value
        return list(cu) if real is None else {"cu_seqlens": list(real), "cu_seqlens_padded": list(cu)}
    if field == "dtype":
        return str(value).replace("torch.", "")
    return value


def _decode(field: str, code: int) -> Any:
    """A digest code back to a readable value, where the code is not a hash."""
    if field == "sentinel":
        return SENTINEL_STATES[int(bool(code))]
    if field == "comm":
        if not code:
            return None  # a call whose inputs failed validation
        name, inner = VARIANTS[code % 1000 - 1], code // 1000
        return name if not inner else f"{name}:{inner}"
    if field == "qkv_format":
        return FORMATS[code - 1]
    if field == "dtype" and 1 <= code <= len(DTYPES):
        return str(DTYPES[code - 1]).replace("torch.", "")
    if field in _READABLE:
        return code
    return f"<hash {code:#x}>"


def raise_pending(bad: dict[Any, list[str]], kept: dict[Any, list[tuple]]) -> None:
    """Every rank of every group in ``bad`` (its flagged fields) raises, naming the first call (of the readable
    values ``kept`` per group since the last verdict) whose flagged fields differ between the ranks."""
    parts, found = [], {}
    for group in sorted(bad, key=group_ranks):  # the same order on every rank: no crossed collectives
        mine = [[_show(f, row[FIELDS.index(f)]) for f in bad[group]] for row in kept[group]]
        rows: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(rows, mine, group=group)
        members = group_ranks(group)
        first = next((i for i in range(min(map(len, rows))) if any(r[i] != rows[0][i] for r in rows)), None)
        for j, field in enumerate(bad[group]):
            if first is None:
                found[field] = {}
                parts.append(f"{LABELS[field]} differs (in a call beyond the {KEEP_VALUES} kept for the report)")
                continue
            found[field] = {members[r]: rows[r][first][j] for r in range(len(rows))}
            shown = ", ".join(f"rank {g}: {v!r}" for g, v in found[field].items())
            parts.append(f"{LABELS[field]} differs at attention call {first + 1} since the last verdict — {shown}"
                         + (f" ({_HINTS[field]})" if field in _HINTS else ""))
    raise RanksDisagreeError(
        "the ranks of a CP group ran different attention calls (found at the step boundary, before the optimizer "
        "step: their outputs are wrong), so every rank of the group raises: " + "; ".join(parts), found)


def raise_gathered(group: Any, differ: Sequence[str], values: tuple) -> None:
    """Every rank reads this verdict: fetch each rank's readable values and raise, on every rank."""
    mine = {f: _show(f, values[FIELDS.index(f)]) for f in differ}
    rows: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(rows, mine, group=group)
    members = group_ranks(group)
    found = {f: {members[i]: r[f] for i, r in enumerate(rows)} for f in differ}
    parts = []
    for f in differ:
        shown = ", ".join(f"rank {g}: {v!r}" for g, v in found[f].items())
        parts.append(f"{LABELS[f]} differs — {shown}" + (f" ({_HINTS[f]})" if f in _HINTS else ""))
    raise RanksDisagreeError(
        f"the ranks {members} of a CP group called attention with different arguments; their exchange would hang "
        f"or return wrong rows, so every rank of the group raises before it: " + "; ".join(parts), found)


def raise_ranges(group: Any, differ: Sequence[str], values: tuple, high: list[int], low: list[int]) -> None:
    """Not every rank reads this verdict (some repeat a call agreed before): no second collective; name this rank's
    value and the smallest and largest of the group."""
    me = dist.get_rank()
    found, parts = {}, []
    for f in differ:
        i = FIELDS.index(f)
        found[f] = {"this rank": _show(f, values[i]), "min": _decode(f, low[i]), "max": _decode(f, high[i])}
        parts.append(f"{LABELS[f]} differs — rank {me}: {found[f]['this rank']!r}; the group's values range from "
                     f"{found[f]['min']!r} to {found[f]['max']!r}" + (f" ({_HINTS[f]})" if f in _HINTS else ""))
    raise RanksDisagreeError(
        f"the ranks {group_ranks(group)} of a CP group called attention with different arguments; this rank raises "
        f"before its exchange (a rank that repeated an earlier call may wait in its exchange until the group's "
        f"timeout): " + "; ".join(parts), found)
