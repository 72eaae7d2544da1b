"""The documented import path of :mod:`cpscope.integrations.hf.trainer` (the same module object).

Example::

    import cpscope.integrations.hf.trainer as cpt   # == cpscope.integrations.hf.trainer
"""
import sys

from .hf import trainer as _trainer

sys.modules[__name__] = _trainer
