"""The correctness sentinel (private package; the public name is the class :class:`cpscope.sentinel`).

Modules: :mod:`.core` (the switch, sampling, the hooks), :mod:`.attention_check` (attention and gradients against a
reference), :mod:`.positions` (RoPE and transformers positions), :mod:`.loop_check` (labels, loss normalisation),
:mod:`.agree` (agreement between the ranks of a group), :mod:`.reference`, :mod:`.report`, :mod:`.state`.
"""
from . import core as _core
from .core import sentinel
from .report import Mismatch, SentinelError

__all__ = ["sentinel", "SentinelError", "Mismatch"]


def __getattr__(name: str):  # the switch's live state (ACTIVE, busy, attention) lives in .core
    return getattr(_core, name)
