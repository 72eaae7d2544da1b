"""Agreement: do all members of a group run the same thing? One fixed-size digest per rank, one ``all_gather``.

Every rank encodes what it is about to run — group size, members and their order, its own global and CP rank,
offsets (a hash of ``cu_seqlens``), local lengths, layout, ``causal``, the communication variant, dtype, heads,
softmax scale, which microbatch and which call — as a fixed-length int64 vector. The vectors are all-gathered
over the group (``comm.exchange``: the size never depends on the inputs, so the collective cannot hang on a
disagreement) and every rank compares them identically, so every rank reaches the same verdict. Only when
something differs does a second collective fetch the details (the offsets themselves, an error message) for the
report. This module encodes and compares; :mod:`.comm` runs the collectives.

Example::

    rows = exchange(group, {"cp_size": 2, "offsets": hash64(cu), ...}, torch.device("cpu"))
    for d in disagreements(rows, members=group_ranks(group), fields=("cp_size", "offsets")):
        print(d.field, d.ranks, d.message)
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from .._variants import COMM_CHOICES

__all__ = ["hash64", "float_bits", "disagreements", "Disagreement", "FORMATS", "DTYPES", "comm_code", "LABELS"]

FORMATS = {"bshd": 1, "sbhd": 2, "thd": 3}
DTYPES = {torch.float64: 1, torch.float32: 2, torch.bfloat16: 3, torch.float16: 4}
_COMMS = COMM_CHOICES  # codes 1.. in the order of cpscope's one list of variant names

# Human names of the fields, for the reports.
LABELS = {
    "valid": "inputs pass validation",
    "pending": "a mismatch found locally",
    "cp_size": "CP size",
    "members": "group members (global ranks, in order)",
    "step": "step",
    "microbatch": "microbatch index in the group",
    "call": "attention call index (layer)",
    "qkv_format": "layout (qkv_format)",
    "causal": "causal",
    "comm": "communication variant",
    "dtype": "dtype",
    "batch": "batch size",
    "local_len": "local length",
    "heads": "q heads",
    "kv_heads": "k/v heads",
    "head_dim": "head dim",
    "offsets": "offsets (cu_seqlens)",
    "docs": "documents",
    "scale": "softmax scale",
    "seqs": "documents of the microbatch (seqs)",
    "window": "sliding window",
    "softcap": "softcap",
    "sinks": "attention sinks given",
}


def hash64(values: Any) -> int:
    """A process-independent signed 64-bit hash of ``repr(values)`` (ints, tuples, strings)."""
    raw = hashlib.blake2b(repr(values).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


def float_bits(x: float) -> int:
    """The bits of a float64 as a signed int64 (exact comparison of softmax scales)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def comm_code(comm: Optional[str]) -> int:
    """A communication variant as an int64 digest field (small codes for the known names)."""
    name = "p2p" if comm is None else str(comm)
    return _COMMS.index(name) + 1 if name in _COMMS else hash64(name)


@dataclass(frozen=True)
class Disagreement:
    """One field that differs across the gathered rows, and the ranks off the majority."""

    field: str
    ranks: tuple[int, ...]  # global ranks that differ from the majority (all, when there is no majority)
    message: str
    figures: dict


def _show(name: str, value: int) -> str:
    if name == "qkv_format":
        return next((k for k, v in FORMATS.items() if v == value), str(value))
    if name == "dtype":
        return next((str(k).replace("torch.", "") for k, v in DTYPES.items() if v == value), str(value))
    if name == "comm":
        return _COMMS[value - 1] if 1 <= value <= len(_COMMS) else f"{value & 0xFFFFFFFFFFFFFFFF:#018x}"
    if name in ("window", "softcap") and value == -1:
        return "none"
    if name in ("scale", "softcap") and value != -1:
        return f"{struct.unpack('<d', struct.pack('<q', value))[0]:.6g}"
    if name in ("members", "offsets", "seqs", "window") and value != -1:
        return f"#{value & 0xFFFFFFFFFFFFFFFF:016x}"
    if name in ("causal", "sinks"):
        return str(bool(value))
    return str(value)


def disagreements(
    rows: list[dict[str, int]], *, members: Sequence[int], fields: Sequence[str]
) -> list[Disagreement]:
    """Compare the gathered rows: member order (row ``i`` is global rank ``members[i]``, CP rank ``i``), then each
    field of ``fields`` across ranks. Identical on every rank (it only reads the gathered rows)."""
    out: list[Disagreement] = []
    order_bad = [
        i for i, r in enumerate(rows)
        if ("global_rank" in r and i < len(members) and r["global_rank"] != members[i])
        or ("cp_rank" in r and r["cp_rank"] != i)
    ]
    if order_bad or len(rows) != len(members):
        seen = [(r.get("global_rank"), r.get("cp_rank")) for r in rows]
        out.append(Disagreement(
            "members", tuple(int(rows[i].get("global_rank", -1)) for i in order_bad),
            f"group position i holds (global rank, CP rank) {seen}, but group_ranks() lists {list(members)}: the "
            "ring's peers and cp_rank() disagree",
            {"gathered": seen, "group_ranks": list(members)},
        ))
    for name in fields:
        vals = [r[name] for r in rows]
        if len(set(vals)) <= 1:
            continue
        counts: dict[int, int] = {}
        for v in vals:
            counts[v] = counts.get(v, 0) + 1
        top = max(counts.values())
        majority = vals[0] if counts[vals[0]] == top else max(counts, key=counts.get)
        if list(counts.values()).count(top) > 1:  # no strict majority: name every rank
            odd = list(range(len(vals)))
        else:
            odd = [i for i, v in enumerate(vals) if v != majority]
        g = [int(rows[i].get("global_rank", members[i] if i < len(members) else i)) for i in range(len(rows))]
        per_rank = {g[i]: _show(name, vals[i]) for i in range(len(vals))}
        label = LABELS.get(name, name)
        text = ", ".join(f"rank {r}: {v}" for r, v in per_rank.items())
        out.append(Disagreement(name, tuple(g[i] for i in odd), f"{label} differs across the group — {text}",
                                {"values": per_rank}))
    return out
