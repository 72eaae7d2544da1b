"""Ranks that disagree: every CP > 1 attention call agrees a fixed-size digest over its group, without a host sync.

The ranks of a CP group must run the *same* attention: the same variant, the same global offsets and lengths, the
same heads, dtype and mask. When they do not, the exchange hangs (``p2p`` on one rank, ``all_gather`` on another),
returns wrong rows on every rank (other ``cu_seqlens`` with the same total) or ends in the backend's own size error
(other lengths). So, by default, every attention call under CP > 1 does this before its variant exchanges anything:

1. **digest, on the host** (:data:`FIELDS`): the resolved variant, the global length, the rows (documents in
   ``thd``), a hash of the global offsets (kept on the pack: O(1) per layer), layout, ``causal``, dtype, heads,
   head dims, window, softcap, sinks — all from metadata the call already holds on the host (no tensor is read) —
   and ``sentinel``: 1 when ``cpscope.sentinel`` samples the call (it calls :func:`check_call` itself, first, and
   always reads the verdict, so its own collectives run only once every rank was seen sampling the call), else 0;
2. **one tiny collective, the same on every call of every rank**: a ``MAX`` all-reduce of ``[d, r, -d, -r]``
   (``2·(len(FIELDS) + 1)`` int64; ``r`` = "this rank reads the verdict now"). Field *i* agrees iff
   ``max(d_i) == min(d_i)``. Its op and size never depend on the inputs or on any per-rank state, so it cannot
   hang or size-mismatch; it runs before the variant's first exchange. It stays on the host when the group can
   reduce CPU tensors (gloo, or ``init_process_group("cpu:gloo,cuda:nccl")``), else it is an NCCL all-reduce on the
   device (posted asynchronously, no host sync);
3. **verdict**: read on the host **only** for a digest this context has not seen agreed on this group (the first
   call of each kind — layer 0; packed microbatches: each new pack, whose offsets layer 0 reads to the host
   anyway), else compared **on the device** and accumulated (no host sync: layers 1.. cost one small all-reduce
   each). The accumulated verdict is read at the **step boundary** — a pre-hook on every ``torch.optim``
   optimizer's ``step`` (registered at the first deferred call), the end of :func:`cpscope.train.run_step`,
   :func:`verify_agreement` for other loops — and at the next read, so a disagreement is raised before the
   optimizer step that would apply it.

Every rank of the group reaches the same verdict: the reduced vector is the same on every rank. A disagreement found
when every rank reads (``min(r) == 1``) raises :class:`RanksDisagreeError` on every rank at once, naming each
differing field and each rank's value (a second collective, ``all_gather_object``, fetches them on this rare path).
Whether a rank reads depends on what it has seen agreed, which is the same on every rank as long as the ranks have
agreed so far; at the first disagreement it may differ (one rank repeats an agreed call, another's is new). Then the
readers see ``min(r) == 0``: when only the offsets differ (same exchanges, wrong rows) they run the call like the
others and every rank raises at the step boundary; otherwise they raise at once (naming the smallest and largest
value of each differing field) and a rank that did not read may wait in its exchange until the group's timeout —
the one case the check cannot end cleanly (see ``docs/agreement.md``).

CP1 (no group, or a size-1 group) does nothing: there is no one to disagree with; nor does an activation
recompute in backward (it repeats a forward call that was agreed; a recompute under another scope is what
``cpscope.ScopeReadInBackwardError`` and the sentinel report). Inputs that fail validation raise
their ``ValueError`` at once, before any collective, as before.

Example::

    with cpscope.runtime_cp(groups[2]):
        out = cpscope.context_parallel_attention(q, k, v, comm=("p2p" if rank == 0 else "all_gather"))
    # every rank: RanksDisagreeError: ... communication variant (comm) differs: rank 0: 'p2p', rank 1: 'all_gather'
"""
from __future__ import annotations

import contextvars
import hashlib
import logging
import struct
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .._tensor_cache import register_clear
from .._variants import VARIANTS
from ..backward_check import in_backward
from ._agreement_report import (DTYPES, FIELDS, FORMATS, KEEP_VALUES, LABELS, RanksDisagreeError, raise_gathered,
                               raise_pending, raise_ranges)

AttentionCall = Any  # cpscope.attention._api.AttentionCall (not imported: api imports this module)
__all__ = ["RanksDisagreeError", "check_call", "raise_differ", "STAND_DOWN", "verify_agreement", "FIELDS", "LABELS"]

logger = logging.getLogger(__name__)

# Fields whose difference alone leaves every rank's exchanges identical (same sizes, same collectives): the call can
# run on every rank and the disagreement be raised at the step boundary. Only without a window (a window's halo
# plan depends on the offsets).
_NEUTRAL = frozenset({"cu_seqlens"})
_MASK62 = (1 << 62) - 1  # digest values stay in [0, 2^62): their negation fits int64
_HASH_KEY = ("agreement_digest",)  # the pack memo key of its offsets' hash
_MEMORY_SIZE = 256  # agreed digests remembered per group (LRU)

# Private switch (benchmarks measure the check against none; tests): it must be the same on every rank of a group,
# which is why it is not offered as a user option — a rank with the check and one without would hang.
_ENABLED = True


# ---- digest -------------------------------------------------------------------------------------------------------


def _hash(value: Any) -> int:
    """A process-independent hash of ``repr(value)`` in ``[0, 2^62)``."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") & _MASK62


def _comm_code(name: str, inner: Optional[int]) -> int:
    return VARIANTS.index(name) + 1 + 1000 * (inner or 0)


def _values(call: "AttentionCall", sentinel: int = 0) -> tuple:
    """This rank's readable value of every field of :data:`FIELDS` (host metadata only). A call whose inputs failed
    validation has none but its ``sentinel`` field (its other fields then read ``None``, their codes 0)."""
    if call.error is not None:
        return (None,) * (len(FIELDS) - 1) + (int(sentinel),)
    q, k, v, variant, pack = call.q, call.k, call.v, call.variant, call.pack
    if call.qkv_format == "thd":
        global_len, rows = pack.total, len(pack.lens)
    else:
        b, s = (q.shape[0], q.shape[1]) if call.qkv_format == "bshd" else (q.shape[1], q.shape[0])
        global_len, rows = s * call.scope.size, b
    offsets = None if pack is None else (pack.cu, pack.real)  # not the pack: kept values must not keep it alive
    return ((variant.name, variant.inner), global_len, rows, offsets, call.qkv_format, bool(call.causal), q.dtype,
            q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1], call.window, call.softcap, call.sinks is not None,
            int(sentinel))


def _digest(values: tuple, pack: Any) -> tuple[int, ...]:
    """The int codes of ``values`` (in ``[0, 2^62)``); the offsets' hash is computed once per pack."""
    (name_inner, global_len, rows, offsets, fmt, causal, dtype, h, hk, d, dv, window, softcap, sinks,
     sentinel) = values
    if name_inner is None:  # inputs that failed validation: only the sentinel field is known
        return (0,) * (len(FIELDS) - 1) + (sentinel,)
    name, inner = name_inner
    offsets_hash = 0 if pack is None else pack.memo(_HASH_KEY, lambda: _hash(offsets))
    return (_comm_code(name, inner), global_len, rows, offsets_hash, FORMATS.index(fmt) + 1, int(causal),
            DTYPES.index(dtype) + 1 if dtype in DTYPES else _hash(str(dtype)), h, hk, d, dv,
            0 if window is None else _hash(tuple(window)),
            0 if softcap is None else struct.unpack("<q", struct.pack("<d", softcap))[0] & _MASK62, int(sinks),
            sentinel)


# ---- per-group state ------------------------------------------------------------------------------------------------

class _Pending:
    """Verdicts not read yet on one group: per-field flags (reduced, so the same on every rank) and the readable
    values of the calls since the last read (for the report)."""

    __slots__ = ("flags", "values", "calls")

    def __init__(self, device: torch.device) -> None:
        self.flags = torch.zeros(len(FIELDS), dtype=torch.bool, device=device)
        self.values: list[tuple] = []
        self.calls = 0

    def add(self, values: tuple) -> None:
        self.calls += 1
        if len(self.values) < KEEP_VALUES:
            self.values.append(values)


class _State:
    """Per context (thread / asyncio task, like the scope itself): per group, the digests seen agreed (the one input
    to "read the verdict now?"; each with its reduce row, copied by the later calls) and the verdicts not read yet."""

    __slots__ = ("agreed", "pending")

    def __init__(self) -> None:  # weakly keyed: no destroyed group is kept alive here
        self.agreed: "weakref.WeakKeyDictionary[Any, OrderedDict[tuple, torch.Tensor]]" = weakref.WeakKeyDictionary()
        self.pending: "weakref.WeakKeyDictionary[Any, _Pending]" = weakref.WeakKeyDictionary()


_STATE: contextvars.ContextVar[Optional[_State]] = contextvars.ContextVar("cpscope_agreement", default=None)
_LOCK = threading.Lock()
_HOOKED: list[Any] = []  # the optimizer pre-hook's handle, once registered


def _state() -> _State:
    state = _STATE.get()
    if state is None:
        state = _State()
        _STATE.set(state)
    return state


def _defer(state: _State, group: Any, spread: torch.Tensor, values: tuple) -> None:
    """Keep this call's verdict unread: ``spread`` (max - min per field, on the transport's device) OR-ed into the
    group's flags — one kernel, no host read."""
    pend = state.pending.get(group)
    if pend is None:
        pend = state.pending[group] = _Pending(spread.device)
    torch.logical_or(pend.flags, spread, out=pend.flags)
    pend.add(values)
    if not _HOOKED:
        _hook_optimizers()


def _hook_optimizers() -> None:
    """A pre-hook on every ``torch.optim`` optimizer's ``step``: the deferred verdicts are read before a step."""
    with _LOCK:
        if _HOOKED:
            return
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _HOOKED.append(register_optimizer_step_pre_hook(lambda *_: verify_agreement()))


# ---- transport ------------------------------------------------------------------------------------------------------

# group -> whether it reduces CPU tensors (the same on every member: a group's backends are made together)
_CPU_OK: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


@register_clear  # cpscope.clear_caches() drops the probes (asked again on the next call)
def _forget_transports() -> None:
    _CPU_OK.clear()


def _transport(group: Any, hint: torch.device) -> torch.device:
    ok = _CPU_OK.get(group)
    if ok is None:
        backend = str(dist.get_backend(group)).lower()
        ok = _CPU_OK[group] = any(name in backend for name in ("gloo", "mpi", "ucc"))
    return torch.device("cpu") if ok else hint  # NCCL: the device of the call's tensors


def _row(digest: Sequence[int], read: bool, device: torch.device) -> torch.Tensor:
    """``[d, r, -d, -r]`` as an int64 tensor on ``device`` (what :func:`_exchange` reduces)."""
    row = list(digest) + [int(read)]
    buf = torch.tensor(row + [-x for x in row], dtype=torch.int64)
    if device.type == "cuda":  # pinned + non-blocking: no host wait for the copy
        buf = buf.pin_memory().to(device, non_blocking=True)
    return buf


def _exchange(digest: Sequence[int], read: bool, group: Any, device: torch.device,
              wait: Optional[Callable[[Any, Any], None]] = None, row: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[max d, max r, max -d, max -r]`` over ``group``: the one collective, identical on every call. ``wait``
    (an observer's bounded wait: ``wait(work, group)``) waits for it instead of the group's own timeout. ``row``:
    this digest's ``[d, r, -d, -r]`` made earlier on ``device`` (kept with an agreed digest): a copy of it is
    reduced instead of a new one built on the host (and, on CUDA, pinned and copied to the device)."""
    buf = _row(digest, read, device) if row is None or row.device != device else row.clone()
    if wait is None:
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
    else:
        wait(dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group, async_op=True), group)
    return buf


# ---- the check ------------------------------------------------------------------------------------------------------


class _StandDown:
    """:func:`check_call`'s answer to a sampling observer whose peers do not sample the call (see there)."""

    def __repr__(self) -> str:
        return "STAND_DOWN"


STAND_DOWN = _StandDown()


def check_call(call: "AttentionCall", group: Any = None, *, sentinel: int = 0,
               wait: Optional[Callable[[Any, Any], None]] = None) -> Any:
    """Agree ``call``'s digest over its CP group (CP > 1; ``group`` overrides ``call.scope.group``, e.g. for a
    benchmark of the check on one process), before any exchange of its variant.

    Every member of the group calls this for the same attention call (the core does, on every CP > 1 call; a
    sampling observer — :class:`cpscope.sentinel` — calls it itself, first, with ``sentinel=1``).

    ``sentinel`` is the digest's last field: 1 when an observer samples this call (it will run collectives of its
    own on the group right after), 0 otherwise. A sampling rank always reads the verdict, so its collectives run
    only after every rank was seen to sample the call too; ``wait(work, group)`` bounds its wait for the
    all-reduce (the sentinel's ``timeout``).

    Returns:
        ``()`` when the ranks agree (or the verdict is deferred, as without an observer). For ``sentinel=1``: the
        fields that differ while every rank samples the call (the observer reports them with its own richer
        collective, then :func:`raise_differ`), or :data:`STAND_DOWN` when ranks that did not read the verdict
        (not sampling: no observer collectives there) run the call as their peers do — the observer must then run
        it without any collective of its own; every rank raises at the step boundary.

    Raises:
        RanksDisagreeError: the ranks differ in a field of :data:`FIELDS` (at once when every rank reads the
            verdict now), or a deferred verdict found that they did.
    """
    if not _ENABLED or in_backward():  # an activation recompute repeats a forward call agreed already
        return ()
    group = call.scope.group if group is None else group
    values = _values(call, sentinel)
    digest = _digest(values, call.pack)
    state = _state()
    mem = state.agreed.get(group)
    if mem is None:
        mem = state.agreed[group] = OrderedDict()
    read = bool(sentinel) or digest not in mem  # a sampling observer's collectives follow: always read
    device = _transport(group, getattr(call.q, "device", torch.device("cpu")))
    buf = _exchange(digest, read, group, device, wait, row=None if read else mem[digest])
    n = len(FIELDS)
    if not read:  # compared on the device; read at the step boundary
        mem.move_to_end(digest)
        _defer(state, group, buf.view(2, n + 1).sum(0)[:n], values)  # max - min per field: > 0 where they differ
        return ()
    pend = state.pending.get(group)
    row = buf if pend is None else torch.cat([buf, pend.flags.to(buf.device, torch.int64)])
    out = row.tolist()  # the one host read: a digest not seen agreed (layer 0; a new pack), or a sampled call
    high, low = out[:n], [-x for x in out[n + 1:2 * n + 1]]
    everyone = -out[2 * n + 1] == 1  # min over the ranks of "reads now"
    differ = [FIELDS[i] for i in range(n) if high[i] != low[i]]
    if not differ:
        mem[digest] = _row(digest, False, device)  # what the later calls of this digest reduce (copies of it)
        while len(mem) > _MEMORY_SIZE:
            mem.popitem(last=False)
        if pend is not None:
            pend.add(values)
            flagged = [FIELDS[i] for i, x in enumerate(out[2 * n + 2:]) if x]
            if everyone and flagged:
                raise_pending({group: flagged}, {group: state.pending.pop(group).values})
        return ()
    if everyone:
        if sentinel and "sentinel" not in differ:  # every rank samples: the observer's richer report comes first
            return tuple(differ)
        raise_gathered(group, differ, values)
    # Not every rank reads: those that do not repeat an agreed call and do not sample it (a sampling rank reads).
    if set(differ) <= _NEUTRAL | {"sentinel"} and call.window is None and call.error is None:
        # same exchanges on every rank once a sampling rank stands down: raise at the step boundary
        _defer(state, group, buf.view(2, n + 1).sum(0)[:n], values)
        return STAND_DOWN if sentinel else ()
    raise_ranges(group, differ, values, high, low)
    return ()  # (not reached)


def raise_differ(call: "AttentionCall", differ: Sequence[str], *, sentinel: int = 1, group: Any = None) -> None:
    """Raise :class:`RanksDisagreeError` on every rank for the fields ``differ`` that :func:`check_call` returned
    (every rank holds the same ``differ`` and calls this at the same point: one ``all_gather_object``)."""
    group = call.scope.group if group is None else group
    raise_gathered(group, list(differ), _values(call, sentinel))


# ---- step boundary --------------------------------------------------------------------------------------------------


def verify_agreement() -> None:
    """Read the deferred verdicts of this thread's groups (one host read per group with unread calls); raise on a
    disagreement. Called before every ``torch.optim`` optimizer step and at the end of
    :func:`cpscope.train.run_step`; call it yourself at the step boundary of a loop that steps otherwise.

    Every rank of a group that ran unread calls must call it (each optimizer step does); no collective runs unless a
    disagreement was found (then one ``all_gather_object`` per group, in the same order on every rank).

    Raises:
        RanksDisagreeError: an attention call since the last verdict differed between the ranks of its group.

    Example::

        loss.backward()
        cpscope.verify_agreement()     # what the optimizer pre-hook does; before a hand-written update
    """
    state = _STATE.get()
    if state is None:
        return
    state.agreed.clear()  # each step's first call of each kind reads its verdict again
    pending, state.pending = dict(state.pending.items()), weakref.WeakKeyDictionary()
    if not pending:
        return
    flags = {g: p.flags.to(torch.int64).tolist() for g, p in pending.items()}  # one host read per group
    bad = {g: [FIELDS[i] for i, x in enumerate(f) if x] for g, f in flags.items()}
    bad = {g: fields for g, fields in bad.items() if fields}
    if bad:
        raise_pending(bad, {g: p.values for g, p in pending.items()})


