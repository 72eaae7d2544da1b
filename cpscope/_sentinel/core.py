"""``cpscope.sentinel``: a correctness sentinel that catches *trains-but-wrong* in a running hybrid-CP job.

On sampled microbatches (every ``every``-th microbatch of each group; the first one is always sampled) it checks:

* **agreement** — all members of the group run the same thing: members and their order, offsets, local lengths,
  layout, ``causal``, communication variant, heads, dtype, scale, microbatch and call index — one fixed-size
  ``all_gather`` per call, naming the rank and the field that differ;
* **attention** — every cpscope attention call against an independent reference computed on the spot (K/V
  gathered over the group, the local rows in float64 / float32), and the gradients of q, k and v that the ring
  produces against the reference's (identity autograd taps around the call, only on sampled calls);
* **positions** — the positions cpscope's RoPE used and the ``position_ids`` a transformers model receives, against
  the global zigzag positions of the active group; the RoPE offsets against the attention offsets;
* **recompute** — an activation recompute (in backward) of a sampled call runs under the scope of its forward;
* **layout** (in ``run_microbatches``) — the labels are the next tokens when the group's tokens are put back in
  zigzag order (a foreign sharder, or labels shifted after sharding, fails this);
* **loss normalisation** (in ``run_microbatches``) — the world-sum of the targets the loss uses equals the
  ``num_targets`` every rank divides by.

Mismatches are logged (logger ``cpscope.sentinel``) with the figures, then raised as :class:`SentinelError`,
logged only, or handed to a callback (``on_mismatch=``). A raise happens on every rank of the group at the same
point: verdicts travel with the sentinel's own collectives, so no rank is left waiting. A summary is logged when the
sentinel stops (and at exit).

Sampling (:mod:`.config`, the one place that decides) follows counters that every member of a group advances
identically when the ranks run the same program (microbatches of that group, marked by ``run_microbatches`` or
:meth:`sentinel.microbatch`; without markers, calls of each kind on that group), so the collectives of a sampled
microbatch match. At a group's first sampled unit its members agree on the sentinel itself
(:mod:`.agree`: on, ``every``, policy, checks), and every collective of the sentinel waits at most ``timeout``
seconds, so ranks that switched it on at other points, with other options, or that stalled, raise an error naming
what differs. Off, the core's observer slots (:mod:`cpscope._hooks`) are ``None``: one attribute check per call.

This module is the sentinel object and its switch: the sentinels switched on and not stopped form a stack whose
innermost one is active; whenever the stack changes, the observer slots are pointed at the active sentinel's hooks
(or emptied). A sentinel stopped out of order leaves the stack at once, so it is never active again. The checks
(:mod:`.attention_check`, :mod:`.positions`, :mod:`.loop_check`) receive the sentinel's tracker (:mod:`.state`).

Scope: process-wide (one training thread); enable it on every rank at the same point, e.g. before the loop.

Example::

    with cpscope.sentinel(every=100):              # context manager ...
        for step in range(steps):
            run_microbatches(model, mbs, num_targets=n, dp_group=dist.group.WORLD)

    s = cpscope.sentinel(every=100)                # ... or a switch
    train()
    s.stop()                                       # logs the summary
"""
from __future__ import annotations

import atexit
import threading
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch

from .. import _hooks
from .._tensor_cache import lru
from ..attention import AttentionCall
from ..scope import CPScope, capture_scope, scope_for
from .attention_check import checked_attention
from .config import Options
from .loop_check import check_loss, watch
from .positions import check_user_positions, on_hf_positions, on_rope
from .report import Mismatch, SentinelError, Summary
from .state import MicrobatchRecord, Tracker, in_backward

__all__ = ["sentinel", "SentinelError", "Mismatch"]

_ACTIVE_SCOPE: Any = object()  # "group not given": the scope in force (a group, or None for CP1, is explicit)


def _scope(group: Any) -> CPScope:
    return capture_scope() if group is _ACTIVE_SCOPE else scope_for(group)


# ---------------------------------------------------------------------------------------------------------------------
# The switch: which sentinel is on (process-wide, like the observer slots themselves)

_STACK: list["sentinel"] = []  # switched on and not stopped, in the order they were switched on
_LOCK = threading.Lock()
_EMPTY = dict.fromkeys(_hooks.SLOTS)


def _active() -> Optional["sentinel"]:
    """The innermost sentinel switched on and not stopped, or ``None``."""
    return _STACK[-1] if _STACK else None


def _push(s: "sentinel") -> None:
    """Switch ``s`` on: it becomes the active sentinel."""
    with _LOCK:
        _STACK.append(s)
        _install()


def _remove(s: "sentinel") -> None:
    """Switch ``s`` off (wherever it is on the stack); the innermost one still on becomes active."""
    with _LOCK:
        _STACK.remove(s)
        _install()


def _install() -> None:
    s = _active()
    _hooks.install(**(_EMPTY if s is None else s.slots()))


@atexit.register
def _log_summaries() -> None:
    for s in list(_STACK):
        s.log_summary(" (at exit)")


class _MicrobatchMarker:
    """``with s.microbatch():`` — one marked microbatch of a group (see :meth:`sentinel.microbatch`)."""

    __slots__ = ("_t", "_group", "_mb")

    def __init__(self, t: Tracker, group: Any) -> None:
        self._t, self._group, self._mb = t, group, None

    def __enter__(self) -> "_MicrobatchMarker":
        self._mb = self._t.begin_microbatch(_scope(self._group))
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._t.end_microbatch(self._mb, flush=exc_type is None)

    @property
    def state(self) -> Optional[MicrobatchRecord]:
        """The microbatch's state (its index in the group, whether it is sampled) once entered."""
        return self._mb


class sentinel:
    """Check a running hybrid-CP job on sampled microbatches; a context manager **and** a switch.

    Constructing it switches it on (``cpscope.sentinel(every=100)``); :meth:`stop` — or leaving the ``with``
    block — switches it off again, restores the sentinel that was active before, and logs the summary.

    Args:
        every: check every ``every``-th microbatch of each group (the first one always); ``1`` checks all.
        on_mismatch: ``"raise"`` (default: :class:`SentinelError` on every rank of the group), ``"log"`` (log
            and go on), or a callable taking a :class:`Mismatch` (it may raise; the raise is then made on every
            rank of the group at the sentinel's next collective verdict).
        attention, gradients, positions, loss: switch single checks off (all on by default).
        labels: ``"next_token"`` (default): in ``run_microbatches``, the labels must be the next tokens of the
            zigzag-ordered microbatch; ``None``: skip (labels that are not next-token targets).
        rtol: per-dtype overrides of the relative tolerances, ``{torch.bfloat16: (out, grad), …}``
            (defaults: :data:`cpscope._sentinel.report.TOLERANCES`, documented in docs/sentinel.md).
        reference_dtype: dtype of the attention reference (default float64 on CPU, float32 on CUDA).
        ignore_index: the label value that marks "no target" (default -100).
        timeout: seconds any of the sentinel's own collectives, and its handshake, may wait for the other members
            of a group (default 300): a member that never joins — the sentinel off there, switched on at another
            point or with other options, or a rank that stalled or died — gives an error naming the collective.
        rows: query rows per rank checked on a sampled attention call (default 64; all rows when a rank holds
            no more): those rows' output and ``dq`` against a reference streamed over each rank's own keys, ``dk``
            / ``dv`` through exact identities of attention — no K/V gathered or kept (docs/sentinel.md). A call
            with at most ``rows`` local rows is checked exactly, every row and every gradient element.

    Raises:
        ValueError: ``every`` not a positive int, an unknown ``on_mismatch`` or ``labels``, a bad ``timeout``.

    Scope: process-wide (the training thread); switch it on at the same point on every rank.

    Example::

        with cpscope.sentinel(every=100, on_mismatch="raise") as s:
            for step in range(steps):
                run_microbatches(model, mbs, num_targets=n, dp_group=dp)   # marks microbatches, checks the loss count
        print(s.summary().text())

        # your own loop: mark each microbatch so that sampling follows microbatches
        for mb in mbs:
            with cpscope.runtime_cp(mb.group), s.microbatch():
                loss = model(**mb.inputs).loss
            loss.backward()
    """

    Mismatch = Mismatch  # what reports and callbacks receive
    SentinelError = SentinelError

    def __init__(
        self,
        every: int = 100,
        *,
        on_mismatch: Union[str, Callable[[Mismatch], Any]] = "raise",
        attention: bool = True,
        gradients: bool = True,
        positions: bool = True,
        loss: bool = True,
        labels: Optional[str] = "next_token",
        rtol: Optional[dict] = None,
        reference_dtype: Optional[torch.dtype] = None,
        ignore_index: int = -100,
        timeout: float = 300.0,
        rows: int = 64,
    ) -> None:
        opts = Options.make(every, on_mismatch=on_mismatch, attention=attention, gradients=gradients,
                            positions=positions, loss=loss, labels=labels, rtol=rtol,
                            reference_dtype=reference_dtype, ignore_index=ignore_index, timeout=timeout, rows=rows)
        self._t = Tracker(opts)
        self._on = False
        self.start()

    # -------------------------------------------------------------------------------------------------------------
    # Switch / context manager

    @staticmethod
    def active() -> Optional["sentinel"]:
        """The sentinel switched on now (the innermost one not stopped), or ``None``."""
        return _active()

    def start(self) -> "sentinel":
        """Switch this sentinel on (constructing it already does); idempotent."""
        if not self._on:
            self._on = True
            _push(self)
        return self

    def stop(self) -> Summary:
        """Switch off, make the innermost sentinel still on the active one, log and return the summary.

        Stopping sentinels out of order is fine: a stopped sentinel is never active again.
        """
        if self._on:
            self._on = False
            _remove(self)
            self.log_summary()
        return self._t.verdicts.summary

    def __enter__(self) -> "sentinel":
        return self.start()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.stop()

    # -------------------------------------------------------------------------------------------------------------
    # What it found

    @property
    def options(self) -> Options:
        """The validated arguments this sentinel was made with."""
        return self._t.opts

    @property
    def every(self) -> int:
        return self._t.opts.every

    @property
    def reports(self) -> list[Mismatch]:
        """Every mismatch found so far (also those only logged)."""
        return self._t.verdicts.reports

    def summary(self) -> Summary:
        """Counters so far: microbatches seen / sampled, checks run, worst error / tolerance, mismatches."""
        return self._t.verdicts.summary

    def log_summary(self, suffix: str = "") -> None:
        """Log the summary (logger ``cpscope.sentinel``, level INFO)."""
        self._t.verdicts.log_summary(suffix)

    # -------------------------------------------------------------------------------------------------------------
    # Microbatches

    def microbatch(self, group: Any = _ACTIVE_SCOPE) -> _MicrobatchMarker:
        """Mark one microbatch of ``group`` (default: the active scope) — ``with s.microbatch(): forward``.

        ``run_microbatches`` marks its microbatches itself. Without markers the sentinel samples every
        ``every``-th call of each kind (attention, RoPE, HF positions) per group instead.
        """
        return _MicrobatchMarker(self._t, group)

    # -------------------------------------------------------------------------------------------------------------
    # Hooks: what the observer slots of cpscope._hooks call while this sentinel is active

    def slots(self) -> dict[str, Callable[..., Any]]:
        """This sentinel's hook for each observer slot of :mod:`cpscope._hooks`."""
        return {"attention": self.on_attention, "rope": self.on_rope, "hf_positions": self.on_hf_positions,
                "shard": self.on_shard, "microbatches": self.watch_loop}

    def on_attention(self, call: AttentionCall, run: Callable[[AttentionCall], torch.Tensor]) -> torch.Tensor:
        """The attention slot: runs the prepared call (``run(call)``), checked when sampled."""
        return _outside_graph(checked_attention)(self._t, call, run)

    def on_rope(self, scope: CPScope, cu: Any, qkv_format: str, t: torch.Tensor) -> None:
        """The RoPE slot: the scope and the offsets RoPE rotates with."""
        if self._t.opts.positions:
            _outside_graph(on_rope)(self._t, scope, cu, qkv_format, t)

    def on_shard(self, scope: CPScope, out: torch.Tensor) -> None:
        """The sharding slot: ``zigzag_shard`` cut ``out`` for ``scope`` (remembered weakly, :class:`.state.Cuts`)."""
        self._t.cuts.record(scope, out)

    def on_hf_positions(self, module: Any, query: torch.Tensor, scope: CPScope, kwargs: dict) -> None:
        """The transformers slot (``query`` ``[b, h, s_local, d]``, the attention function's ``**kwargs``)."""
        if self._t.opts.positions:
            _outside_graph(on_hf_positions)(self._t, kwargs.get("position_ids"), scope, query.shape[2],
                                            kwargs.get("cu_seq_lens_q"), getattr(module, "layer_idx", None))

    def watch_loop(self, microbatches: Iterable[Any], num_targets: int) -> Iterator[Any]:
        """The training loop's slot: its microbatches, marked one by one; checks layout and loss normalisation."""
        return watch(self._t, microbatches, num_targets)

    # -------------------------------------------------------------------------------------------------------------
    # For your own code

    @staticmethod
    def check_positions(position_ids: torch.Tensor, *, cu_seqlens: Any = None, group: Any = _ACTIVE_SCOPE,
                        where: str = "positions") -> None:
        """Check positions your own RoPE uses against the active group's zigzag positions (no-op when off).

        ``position_ids``: ``[n]`` or ``[b, n]`` local positions; ``cu_seqlens``: global offsets of a packed batch
        (positions restart per document), else each row is one sequence of global length ``n·cp``.

        Example::

            pos = my_position_ids(...)
            cpscope.sentinel.check_positions(pos, cu_seqlens=cu)     # in forward, before rotating
        """
        s = _active()
        if not isinstance(s, sentinel) or in_backward() or not s._t.opts.positions:
            return
        check_user_positions(s._t, position_ids, cu_seqlens, _scope(group), where)

    def check_targets(self, targets_used: int, num_targets: int, *, device: Optional[torch.device] = None) -> None:
        """Loss normalisation for your own loop (collective over the world): the world-sum of ``targets_used``
        (targets this rank's loss sums over) must equal ``num_targets`` (what this rank divides by)."""
        check_loss(self._t, int(targets_used), int(num_targets), device, step=None)


def _outside_graph(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, or under torch.compile ``fn`` excluded from the graph (a graph break: the checks run eagerly)."""
    return _compiler_disabled(fn) if torch.compiler.is_compiling() else fn


@lru(maxsize=None)  # one wrapper per checked function (three); cpscope.clear_caches() drops them
def _compiler_disabled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` excluded from torch.compile graphs (made once: the wrapper costs tens of µs per call, so the eager
    path calls ``fn`` directly)."""
    return torch.compiler.disable(fn)
