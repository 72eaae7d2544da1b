"""Ranks that disagree: every CP > 1 attention call agrees a small digest over its group before any exchange.

The ranks of a CP group must run the *same* attention: the same communication variant, the same global offsets,
the same global length (and heads, dtype, mask). When they do not, the variant's exchange hangs (``p2p`` on one
rank, ``all_gather`` on another), returns wrong rows on every rank (other ``cu_seqlens`` with the same total), or
ends in the backend's own size error (other lengths). So every attention call under CP > 1, by default, does this
first, before its variant exchanges anything:

1. **digest** (:func:`digest`): what this rank is about to run, as :data:`FIELDS` int64 values — the resolved
   variant (``"auto"`` already chosen), the global length, the rows (documents in ``thd``), a hash of the global
   offsets (cached on the pack: O(1) per layer), layout, ``causal``, dtype, heads, head dims, window, softcap,
   sinks; whether the inputs passed validation (a rank whose inputs fail still joins, so its peers never wait for
   it);
2. **one collective, always the same**: a ``MAX`` all-reduce of ``[d, -d]`` (``2·len(FIELDS)`` int64) over the
   group; field ``i`` agrees iff ``max(d_i) == -max(-d_i)`` (= ``min(d_i)``). Its op and size never depend on the
   variant, the lengths or any per-rank state (no cache decides whether it runs: it runs on every CP > 1 call), so
   it cannot hang on a disagreement; it comes before any variant-specific collective;
3. **verdict on the host, before the exchange**: every rank reads the same reduced vector, so every rank reaches
   the same verdict. Only on a disagreement (the rare path) a second collective fetches each rank's readable values
   (``all_gather_object``: every rank takes it, since every rank saw the disagreement) and every rank raises
   :class:`RanksDisagreeError` (a ``ValueError``) naming each differing field and each rank's value; a rank whose
   own inputs failed validation raises its own ``ValueError`` and the others name it and its message.

Why synchronous, every call. A rank that skipped the host verdict (say, for a digest it had already seen agreed)
would go on into its exchange while a peer with a new digest raised: that rank would then hang. Any skip decided
by per-rank state has this hole, so the verdict is read on every call — and made cheap instead:

* **host-only transport**: the digest is a CPU tensor whenever the group can reduce CPU tensors (gloo, or a job
  initialised with ``backend="cpu:gloo,cuda:nccl"``, whose groups carry both backends): no CUDA stream is touched,
  no device sync, the GPU keeps its queue; the cost is the CPU time of one tiny all-reduce (measured by
  ``benchmarks/bench_agreement.py``; ``docs/agreement.md``);
* an NCCL-only group cannot reduce CPU tensors: the digest then goes through the device and is read back, one
  host sync per attention call (logged once per group, with the remedy: initialise with
  ``"cpu:gloo,cuda:nccl"``).

CP1 (no group, or a size-1 group) does nothing: there is no one to disagree with.

What it does not see: a rank that never calls attention on the group (it runs CP1 while its peers run CP2, or calls
fewer layers) leaves the others in this all-reduce until the group's timeout — that is a scope misuse, reported by
``cpscope.sentinel``.

Example::

    with cpscope.runtime_cp(groups[2]):
        out = cpscope.context_parallel_attention(q, k, v, comm=("p2p" if rank == 0 else "all_gather"))
    # every rank: RanksDisagreeError: ... communication variant (comm): rank 0: 'p2p', rank 1: 'all_gather' ...
"""
from __future__ import annotations

import hashlib
import logging
import struct
import threading
import weakref
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from .._variants import VARIANTS
from ..groups import group_ranks

AttentionCall = Any  # cpscope.attention.api.AttentionCall (not imported: api imports this module)
__all__ = ["RanksDisagreeError", "check_agreement", "digest", "describe", "FIELDS", "LABELS"]

logger = logging.getLogger(__name__)

FIELDS: tuple[str, ...] = ("valid", "comm", "global_len", "rows", "cu_seqlens", "qkv_format", "causal", "dtype",
                           "heads", "kv_heads", "head_dim", "v_head_dim", "window", "softcap", "sinks")

LABELS = {
    "valid": "inputs pass validation",
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
}

_HINTS = {
    "comm": "pass the same comm= (or runtime_cp(..., comm=)) on every rank of the group; comm='auto' needs the same "
            "chooser (and calibration) on every rank",
    "cu_seqlens": "every rank passes the whole microbatch's global offsets (the same cu_seqlens), not its own",
    "global_len": "every rank holds its zigzag shard (zigzag_shard) of the same global sequences",
    "rows": "every rank holds its zigzag shard of the same batch / documents",
}

_FORMATS = {"bshd": 1, "sbhd": 2, "thd": 3}
_DTYPES = {torch.float64: 1, torch.float32: 2, torch.bfloat16: 3, torch.float16: 4}
_MASK62 = (1 << 62) - 1  # digest values stay in [0, 2^62): their negation fits int64
_HASH_KEY = ("agreement_digest",)  # the pack memo key of its offsets' hash


class RanksDisagreeError(ValueError):
    """The ranks of a CP group asked for different attention (variant, offsets, lengths, ...): raised on every rank.

    ``values`` maps each differing field to ``{global rank: that rank's value}``.

    Example::

        try:
            out = cpscope.context_parallel_attention(q, k, v)
        except cpscope.RanksDisagreeError as e:
            print(e.values)            # {'comm': {0: 'p2p', 1: 'all_gather'}}
    """

    def __init__(self, message: str, values: Optional[dict[str, dict[int, Any]]] = None) -> None:
        super().__init__(message)
        self.values = dict(values or {})

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.values)


def _hash(value: Any) -> int:
    """A process-independent hash of ``repr(value)`` in ``[0, 2^62)``."""
    raw = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") & _MASK62


def _dense_shape(call: "AttentionCall") -> tuple[int, int]:
    q = call.q
    return (q.shape[0], q.shape[1]) if call.qkv_format == "bshd" else (q.shape[1], q.shape[0])


def digest(call: "AttentionCall") -> list[int]:
    """This rank's digest of a prepared call: one int in ``[0, 2^62)`` per :data:`FIELDS` entry (all 0 when its
    inputs failed validation). O(1): the offsets' hash is computed once per pack."""
    if call.error is not None:
        return [0] * len(FIELDS)
    q, k, v = call.q, call.k, call.v
    variant, pack = call.variant, call.pack
    if call.qkv_format == "thd":
        global_len, rows = pack.total, len(pack.lens)
    else:
        b, s = _dense_shape(call)
        global_len, rows = s * call.scope.size, b
    offsets = 0 if pack is None else pack.memo(_HASH_KEY, lambda: _hash((pack.cu, pack.real)))
    window, softcap = call.window, call.softcap
    return [
        1,
        VARIANTS.index(variant.name) + 1 + 1000 * (variant.inner or 0),
        global_len,
        rows,
        offsets,
        _FORMATS[call.qkv_format],
        int(bool(call.causal)),
        _DTYPES.get(q.dtype) or _hash(str(q.dtype)),
        q.shape[-2],
        k.shape[-2],
        q.shape[-1],
        v.shape[-1],
        0 if window is None else _hash(tuple(window)),
        0 if softcap is None else struct.unpack("<q", struct.pack("<d", softcap))[0] & _MASK62,
        int(call.sinks is not None),
    ]


def describe(call: "AttentionCall") -> dict[str, Any]:
    """This rank's readable value of every field (for the error message; only on the rare path)."""
    if call.error is not None:
        return {}
    variant, pack = call.variant, call.pack
    comm = variant.name if variant.inner is None else f"{variant.name}:{variant.inner}"
    if call.qkv_format == "thd":
        global_len, rows = pack.total, len(pack.lens)
    else:
        b, s = _dense_shape(call)
        global_len, rows = s * call.scope.size, b
    offsets: Any = None
    if pack is not None:
        offsets = list(pack.cu) if pack.real is None else {"cu_seqlens": list(pack.real),
                                                           "cu_seqlens_padded": list(pack.cu)}
    return {"valid": True, "comm": comm, "global_len": global_len, "rows": rows, "cu_seqlens": offsets,
            "qkv_format": call.qkv_format, "causal": bool(call.causal), "dtype": str(call.q.dtype).replace("torch.", ""),
            "heads": call.q.shape[-2], "kv_heads": call.k.shape[-2], "head_dim": call.q.shape[-1],
            "v_head_dim": call.v.shape[-1], "window": call.window, "softcap": call.softcap,
            "sinks": call.sinks is not None}


# ---- transport ------------------------------------------------------------------------------------------------

_CPU_OK: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()  # group -> can reduce CPU tensors
_WARNED: "weakref.WeakSet[Any]" = weakref.WeakSet()
_LOCK = threading.Lock()


def _host_capable(group: Any) -> bool:
    """Whether ``group`` reduces CPU tensors (gloo / mpi / ucc, or a ``"cpu:gloo,cuda:nccl"`` group). The same on
    every member (a group's backends are made collectively); cached per group."""
    try:
        return _CPU_OK[group]
    except (KeyError, TypeError):
        pass
    backend = str(dist.get_backend(group)).lower()
    ok = any(name in backend for name in ("gloo", "mpi", "ucc"))
    try:
        with _LOCK:
            _CPU_OK[group] = ok
    except TypeError:  # not weakly referenceable: ask again next time
        pass
    return ok


def _device(group: Any, hint: torch.device) -> torch.device:
    if _host_capable(group):
        return torch.device("cpu")
    if group not in _WARNED:
        with _LOCK:
            _WARNED.add(group)
        logger.warning(
            "cpscope: the CP group %s has no CPU backend (%s), so the attention agreement check reads a device tensor "
            "back on every attention call (one host sync per call); initialise torch.distributed with "
            "backend='cpu:gloo,cuda:nccl' to keep it on the host", group_ranks(group), dist.get_backend(group))
    return hint if hint.type == "cuda" else torch.device("cuda", torch.cuda.current_device())


# ---- the check --------------------------------------------------------------------------------------------------


def check_agreement(call: "AttentionCall") -> None:
    """Agree ``call``'s digest over its CP group (CP > 1), before any exchange; raise on every rank if it differs.

    Every member of the group must call this for the same attention call (the core does, on every CP > 1
    attention call, whatever its inputs).

    Raises:
        RanksDisagreeError: the ranks differ in a field of :data:`FIELDS` (named, with each rank's value), or
            another rank's inputs failed validation (named, with its message).
        ValueError: this rank's own inputs failed validation (``call.error``) while another's passed.
    """
    group = call.scope.group
    mine = digest(call)
    n = len(mine)
    buf = torch.tensor(mine + [-x for x in mine], dtype=torch.int64, device=_device(group, call.q.device))
    dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
    out = buf.tolist()
    differ = [FIELDS[i] for i in range(n) if out[i] != -out[n + i]]
    if differ:
        _raise(call, differ, group)


def _raise(call: "AttentionCall", differ: Sequence[str], group: Any) -> None:
    """The rare path, taken by every rank together: fetch each rank's readable values and raise."""
    info = {"error": None if call.error is None else f"{type(call.error).__name__}: {call.error}",
            "values": describe(call)}
    rows: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(rows, info, group=group)
    members = group_ranks(group)
    where = f"the ranks {members} of a CP group"
    if "valid" in differ:
        if call.error is not None:
            raise call.error
        refused = {members[i]: r["error"] for i, r in enumerate(rows) if r["error"] is not None}
        text = "; ".join(f"rank {g} refused its attention inputs ({msg})" for g, msg in refused.items())
        raise RanksDisagreeError(
            f"{where} called attention together but not every rank's inputs are valid: {text}. Every rank of the "
            "group raises (instead of waiting for the ranks that refused).", {"valid": {g: False for g in refused}})
    values = {f: {members[i]: r["values"].get(f) for i, r in enumerate(rows)} for f in differ}
    parts = []
    for f in differ:
        shown = ", ".join(f"rank {g}: {_show(v)}" for g, v in values[f].items())
        hint = f" ({_HINTS[f]})" if f in _HINTS else ""
        parts.append(f"{LABELS.get(f, f)} differs — {shown}{hint}")
    raise RanksDisagreeError(
        f"{where} run different attention calls; their exchange would hang or return wrong rows, so every rank of "
        f"the group raises: " + "; ".join(parts), values)


def _show(value: Any, limit: int = 24) -> str:
    if isinstance(value, list) and len(value) > limit:
        return f"[{', '.join(map(str, value[:limit - 4]))}, ..., {', '.join(map(str, value[-4:]))}] " \
               f"({len(value) - 1} documents)"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_show(v, limit)}" for k, v in value.items()) + "}"
    return repr(value)
