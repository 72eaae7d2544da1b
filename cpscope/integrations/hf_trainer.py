"""The documented import path of :mod:`cpscope.integrations.hf.trainer` (the same module object).

Example::

    import cpscope.integrations.hf.trainer as cpt   # == cpscope.integrations.hf.trainer
"""
import sys

from .hf import trainer as _trainer

__all__: list[str] = []  # an alias: the module becomes cpscope.integrations.hf.trainer (its names, its __all__)

sys.modules[__name__] = _trainer
