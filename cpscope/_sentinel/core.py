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

Sampling is decided from counters that every member of a group advances identically (microbatches of that group,
marked by ``run_microbatches`` or :meth:`sentinel.microbatch`; without markers, calls of each kind on that group),
so the collectives of a sampled microbatch always match. Off, the hooks cost one module-level ``None`` check.

Scope: process-wide (one training thread); enable it on every rank at the same point, e.g. before the loop.

Example::

    with cpscope.sentinel(every=100):              # context manager ...
        for step in range(steps):
            run_microbatches(model, mbs, num_targets=n)

    s = cpscope.sentinel(every=100)                # ... or a switch
    train()
    s.stop()                                       # logs the summary
"""
from __future__ import annotations

import atexit
import functools
import logging
import math
import numbers
import threading
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch
import torch.distributed as dist

from .report import Mismatch, SentinelError, Summary, logger
from .state import _Microbatch, _Records, group_of, in_backward
from .. import _hooks
from ..scope import _UNSET, CPScope, resolve_scope, runtime_scope_or

__all__ = ["sentinel", "SentinelError", "Mismatch"]

# The active sentinel (the innermost switched on and not stopped), or None. While one is active its methods fill the
# observer slots of cpscope._hooks; the core calls them there (a None check when off) and never imports the sentinel.
ACTIVE: Optional["sentinel"] = None
_STACK: list["sentinel"] = []  # sentinels switched on and not stopped, in the order they were switched on

_POLICIES = ("raise", "log")


_LOCAL = threading.local()


class _MicrobatchMarker:
    __slots__ = ("_s", "_group", "_mb")

    def __init__(self, s: "sentinel", group: Any) -> None:
        self._s, self._group, self._mb = s, group, None

    def __enter__(self) -> "_MicrobatchMarker":
        self._mb = self._s.begin_microbatch(resolve_scope(self._group))
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._s.end_microbatch(self._mb, flush=exc_type is None)


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

    Raises:
        ValueError: ``every`` not a positive int, an unknown ``on_mismatch`` or ``labels``.

    Scope: process-wide (the training thread); switch it on at the same point on every rank.

    Example::

        with cpscope.sentinel(every=100, on_mismatch="raise") as s:
            for step in range(steps):
                run_microbatches(model, mbs, num_targets=n)        # marks microbatches, checks the loss count
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
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, numbers.Integral) or every < 1:
            raise ValueError(f"sentinel: every must be a positive int (1 = check every microbatch), got {every!r}")
        if not callable(on_mismatch) and on_mismatch not in _POLICIES:
            raise ValueError(f"sentinel: on_mismatch must be 'raise', 'log' or a callable, got {on_mismatch!r}")
        if labels not in ("next_token", None):
            raise ValueError(f"sentinel: labels must be 'next_token' or None, got {labels!r}")
        if rtol is not None:
            for dt, pair in rtol.items():
                if not isinstance(dt, torch.dtype) or len(pair) != 2 or not all(
                    isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in pair
                ):
                    raise ValueError(f"sentinel: rtol maps a torch.dtype to (out, grad) positive floats, got {rtol!r}")
        self.every = int(every)
        self.on_mismatch = on_mismatch
        self.check_attention, self.check_gradients = bool(attention), bool(gradients)
        self.check_positions_, self.check_loss, self.labels = bool(positions), bool(loss), labels
        self.rtol = dict(rtol) if rtol else None
        self.reference_dtype = reference_dtype
        self.ignore_index = int(ignore_index)
        self.reports: list[Mismatch] = []
        self._summary = Summary()
        self._counts: dict[Any, int] = {}
        self._steps = 0
        self._mb: Optional[_Microbatch] = None
        self._pending: list[Mismatch] = []
        self._pending_exc: Optional[BaseException] = None
        self.records = _Records()
        self._warned_nonfinite = False
        self._on = False
        self.start()

    # -------------------------------------------------------------------------------------------------------------
    # Switch / context manager

    @staticmethod
    def active() -> Optional["sentinel"]:
        """The sentinel switched on now, or ``None``."""
        return ACTIVE

    def start(self) -> "sentinel":
        """Switch this sentinel on (constructing it already does); idempotent."""
        if not self._on:
            self._on = True
            _STACK.append(self)
            _ALIVE.add(self)
            _activate()
        return self

    def stop(self) -> Summary:
        """Switch off, make the innermost sentinel still on the active one, log and return the summary.

        Stopping sentinels out of order is fine: a stopped sentinel is never active again.
        """
        if self._on:
            self._on = False
            _STACK.remove(self)
            _ALIVE.discard(self)
            _activate()
            if logger.isEnabledFor(logging.INFO):
                logger.info("%s", self._summary.text())
        return self._summary

    def __enter__(self) -> "sentinel":
        return self.start()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.stop()

    def summary(self) -> Summary:
        """Counters so far: microbatches seen / sampled, checks run, worst error / tolerance, mismatches."""
        return self._summary

    # -------------------------------------------------------------------------------------------------------------
    # Microbatches and sampling

    def microbatch(self, group: Any = _UNSET) -> _MicrobatchMarker:
        """Mark one microbatch of ``group`` (default: the active scope) — ``with s.microbatch(): forward``.

        ``run_microbatches`` marks its microbatches itself. Without markers the sentinel samples every
        ``every``-th call of each kind (attention, RoPE, HF positions) per group instead.
        """
        return _MicrobatchMarker(self, group)

    def begin_microbatch(self, scope: CPScope, *, step: Optional[int] = None) -> _Microbatch:
        key = ("mb", scope.group)
        n = self._counts.get(key, 0)
        self._counts[key] = n + 1
        mb = _Microbatch(scope, n, n % self.every == 0, step, marked=True)
        self._mb = mb
        self._pending, self._pending_exc = [], None  # (left by a microbatch that failed: already logged)
        self._summary.microbatches += 1
        self._summary.sampled += int(mb.sampled)
        return mb

    def end_microbatch(self, mb: Optional[_Microbatch], *, flush: bool = True) -> None:
        if self._mb is mb:
            self._mb = None
        if not flush:  # the microbatch failed: its pending mismatches were logged, the error is on its way
            self._pending, self._pending_exc = [], None
        elif mb is not None and mb.sampled and mb.unverified:  # else the last attention digest was the verdict
            self.verdict_point(mb.scope)

    def current(self, kind: str, scope: CPScope) -> _Microbatch:
        """The microbatch a forward call of ``kind`` under ``scope`` belongs to (a one-call unit without markers)."""
        mb = self._mb
        if mb is not None:
            return mb
        exp = self.expected_scope(None) or scope
        key = (kind, exp.group)
        n = self._counts.get(key, 0)
        self._counts[key] = n + 1
        return _Microbatch(exp, n, n % self.every == 0, None, marked=False)

    def expected_scope(self, mb: Optional[_Microbatch]) -> Optional[CPScope]:
        """The scope consumers must use in forward: the bound runtime scope, else the marked microbatch's, else
        ``None`` (nothing bound: a consumer's own scope — a static-CP module's build-time scope — is authoritative)."""
        bound = runtime_scope_or(None)
        if bound is not None:
            return bound
        return mb.scope if mb is not None and mb.marked else None

    def next_step(self) -> int:
        self._steps += 1
        return self._steps - 1

    # -------------------------------------------------------------------------------------------------------------
    # Reporting

    def tolerance(self, dtype: torch.dtype, grad: bool) -> float:
        from .report import tolerance

        return tolerance(dtype, grad, self.rtol)

    def emit(self, mismatches: list[Mismatch], *, consistent: bool, force_raise: bool = False) -> None:
        """Log and record ``mismatches``; raise now when every rank of the group reaches the same verdict here
        (``consistent``), else keep them for the group's next verdict point. ``force_raise``: raise whatever the
        policy (continuing would deadlock or crash the ring)."""
        if not mismatches:
            return
        for m in mismatches:
            self.reports.append(m)
            self._summary.add(m)
            logger.error("%s", m)
        exc: Optional[BaseException] = None
        if callable(self.on_mismatch):
            for m in mismatches:
                try:
                    self.on_mismatch(m)
                except BaseException as e:  # noqa: BLE001 - re-raised at a point every rank reaches
                    exc = exc or e
        raising = force_raise or self.on_mismatch == "raise" or exc is not None
        if not raising:
            return
        if consistent:
            raise exc if exc is not None and not force_raise else SentinelError(mismatches)
        self._pending.extend(mismatches)
        self._pending_exc = self._pending_exc or exc

    def nonfinite(self, what: str, rank: int) -> None:
        """A comparison skipped because its inputs held inf / NaN or scores beyond the arithmetic's range (a
        diverged run, not a CP fault): counted, and logged once as a warning."""
        self._summary.count("skipped: non-finite inputs")
        if not self._warned_nonfinite:
            self._warned_nonfinite = True
            logger.warning("cpscope sentinel: %s of rank %d skipped: its inputs hold inf / NaN or scores too large "
                           "for the kernels' arithmetic (the run has diverged); further skips are only counted in "
                           "the summary", what, rank)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def raise_pending(self, others: Iterable[int] = ()) -> None:
        """Called where every rank of the group learns that some rank has pending mismatches: raise on all."""
        if self._pending:
            pending, exc = self._pending, self._pending_exc
            self._pending, self._pending_exc = [], None
            if exc is not None:
                raise exc
            raise SentinelError(pending)
        others = list(others)
        if others:
            raise SentinelError([Mismatch("agreement", "mismatch on another rank", others[0],
                                          f"rank(s) {others} of the group found a mismatch (see their log)",
                                          {"ranks": others})])

    def verdict_point(self, scope: CPScope) -> None:
        """Agree over ``scope``'s group whether anyone holds pending mismatches, and raise on every rank if so."""
        if self.on_mismatch == "log":
            return
        if scope.size == 1:
            self.raise_pending()
            return
        from .agree import collective_device

        flag = torch.tensor([1 if self._pending else 0], dtype=torch.int64,
                            device=collective_device(scope.group))
        parts = [torch.empty_like(flag) for _ in range(scope.size)]
        dist.all_gather(parts, flag, group=scope.group)
        members = group_of(scope)
        others = [members[i] for i, p in enumerate(parts) if int(p) and i < len(members)]
        self.raise_pending(others)

    # -------------------------------------------------------------------------------------------------------------
    # Hooks (called from attention/__init__.py, rope.py, integrations/hf.py, hybrid/loop.py)

    def on_attention(self, call: Any, run: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        """The attention slot: runs the prepared call (``run(call)``), checked when sampled."""
        if torch.compiler.is_compiling():  # under torch.compile: run the check outside the graph (a graph break)
            return _compiler_disabled(_attention_hook)(self, call, run)
        return _attention_hook(self, call, run)

    def on_rope(self, scope: CPScope, cu: Any, qkv_format: str, t: torch.Tensor) -> None:
        if self.check_positions_:
            hook = _compiler_disabled(_rope_hook) if torch.compiler.is_compiling() else _rope_hook
            hook(self, scope, cu, qkv_format, t)

    def on_hf_positions(self, module: Any, query: torch.Tensor, scope: CPScope, kwargs: dict) -> None:
        """Hook in the transformers attention function (``query`` ``[b, h, s_local, d]``, its ``**kwargs``)."""
        if self.check_positions_:
            hook = _compiler_disabled(_hf_hook) if torch.compiler.is_compiling() else _hf_hook
            hook(self, kwargs.get("position_ids"), scope, query.shape[2], kwargs.get("cu_seq_lens_q"),
                 getattr(module, "layer_idx", None))

    def watch_loop(self, microbatches: Iterable[Any], num_targets: int) -> Iterator[Any]:
        """``run_microbatches``' microbatches, marked one by one; checks layout and loss normalisation."""
        from .loop_check import watch

        return watch(self, microbatches, num_targets)

    # -------------------------------------------------------------------------------------------------------------
    # For your own code

    @staticmethod
    def check_positions(position_ids: torch.Tensor, *, cu_seqlens: Any = None, group: Any = _UNSET,
                        where: str = "positions") -> None:
        """Check positions your own RoPE uses against the active group's zigzag positions (no-op when off).

        ``position_ids``: ``[n]`` or ``[b, n]`` local positions; ``cu_seqlens``: global offsets of a packed batch
        (positions restart per document), else each row is one sequence of global length ``n·cp``.

        Example::

            pos = my_position_ids(...)
            cpscope.sentinel.check_positions(pos, cu_seqlens=cu)     # in forward, before rotating
        """
        s = ACTIVE
        if s is None or in_backward() or not s.check_positions_:
            return
        from .positions import check_user_positions

        check_user_positions(s, position_ids, cu_seqlens, resolve_scope(group), where)

    def check_targets(self, targets_used: int, num_targets: int, *, device: Optional[torch.device] = None) -> None:
        """Loss normalisation for your own loop (collective over the world): the world-sum of ``targets_used``
        (targets this rank's loss sums over) must equal ``num_targets`` (what this rank divides by)."""
        from .loop_check import check_loss

        check_loss(self, int(targets_used), int(num_targets), device, step=None)


def _attention_hook(*args: Any) -> torch.Tensor:
    from .attention_check import checked_attention

    return checked_attention(*args)


def _rope_hook(*args: Any) -> None:
    from .positions import on_rope

    on_rope(*args)


def _hf_hook(*args: Any) -> None:
    from .positions import on_hf_positions

    on_hf_positions(*args)


@functools.lru_cache(maxsize=None)
def _compiler_disabled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` excluded from torch.compile graphs (made once: the wrapper costs tens of µs per call, so the eager
    path calls ``fn`` directly)."""
    return torch.compiler.disable(fn)


# Sentinels switched on and not stopped: their summary is logged at exit.
_ALIVE: "set[sentinel]" = set()


def _activate() -> None:
    """Make the innermost running sentinel the active one and point the core's observer slots at it."""
    global ACTIVE
    ACTIVE = _STACK[-1] if _STACK else None
    s = ACTIVE
    _hooks.install(attention=None if s is None else s.on_attention, rope=None if s is None else s.on_rope,
                   hf_positions=None if s is None else s.on_hf_positions,
                   microbatches=None if s is None else s.watch_loop)


@atexit.register
def _log_summaries() -> None:
    for s in list(_ALIVE):
        logging.getLogger("cpscope.sentinel").info("%s (at exit)", s._summary.text())
