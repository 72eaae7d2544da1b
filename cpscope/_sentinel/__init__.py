"""The correctness sentinel (private package; the public name is the class :class:`cpscope.sentinel`).

Modules, each one concept, imports pointing down this list:

* :mod:`.core` — the :class:`sentinel` object and its switch: its arguments, which sentinel is active, the hooks it
  gives the observer slots;
* the checks: :mod:`.attention_check` (local checks, agreement digest), :mod:`.attention_numeric` (attention against
  the reference, forward and gradients), :mod:`.attention_sampled` (sampled rows against a streamed reference),
  :mod:`.positions` (RoPE and transformers positions), :mod:`.loop_check` (labels and loss normalisation in
  ``run_microbatches``), :mod:`.recompute` (a recompute runs under its forward's scope);
* the bookkeeping: :mod:`.state` (what a running sentinel keeps: the tracker, the microbatch record, recompute
  records, shard cuts); :mod:`.agree` (members of a group agree: the per-call digest, the handshake on the
  sentinel); :mod:`.config` (what it was asked to do: options, sampling policy); :mod:`.report` (what it reports
  and how: mismatches, errors, tolerances, summary, verdicts on every rank); :mod:`.comm` (the groups it checks
  over: members, and its own bounded collectives);
* :mod:`.reference` — the independent float64 / float32 attention.

``cpscope.sentinel.active()`` is the active sentinel; the core reaches it only through :mod:`cpscope._hooks`.
"""
from .core import sentinel
from .report import Mismatch, SentinelError

__all__ = ["sentinel", "SentinelError", "Mismatch"]
