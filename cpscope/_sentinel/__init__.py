"""The correctness sentinel (private package; the public name is the class :class:`cpscope.sentinel`).

Modules, each one concept, imports pointing down this list:

* :mod:`.core` — the :class:`sentinel` class: options, switch, the hooks it gives the observer slots;
* :mod:`.attention_check`, :mod:`.positions`, :mod:`.loop_check` — the checks (attention; RoPE and transformers
  positions; labels and loss normalisation in ``run_microbatches``), :mod:`.attention_numeric` (attention against
  the reference, forward and gradients), :mod:`.recompute` (a recompute runs under its forward's scope);
* :mod:`.tracker` — what a running sentinel keeps (options, sampling, verdicts, records, the current microbatch);
  :mod:`.switch` — which sentinel is active;
* :mod:`.sampling` (which units are sampled), :mod:`.verdicts` (mismatches to raises on every rank),
  :mod:`.options`, :mod:`.state`;
* :mod:`.agree` (the agreement digest), :mod:`.comm` (the sentinel's collectives), :mod:`.reference` (the
  independent attention), :mod:`.report` (mismatches, tolerances, summary).

``cpscope.sentinel.active()`` is the active sentinel; the core reaches it only through :mod:`cpscope._hooks`.
"""
from .core import sentinel
from .report import Mismatch, SentinelError

__all__ = ["sentinel", "SentinelError", "Mismatch"]
