"""One call that drops every cache cpscope keeps: :func:`clear_caches`.

cpscope caches what it derives from a microbatch's offsets (per-pack metadata: zigzag indices, positions, the ring's
offsets and document split, padding rows, cuDNN's device offsets — kept on the offsets tensor and dropped with it),
validated host copies of offsets tensors, and the cuDNN graphs of packed attention (per shape bucket). Nothing
here is needed for correctness; clearing frees memory and costs a rebuild on next use.

Example::

    import cpscope
    cpscope.clear_caches()        # e.g. between phases of a job, or in tests measuring memory
"""
from __future__ import annotations

__all__ = ["clear_caches"]


def clear_caches() -> None:
    """Drop every cache: per-pack metadata, host copies of offsets, cuDNN graphs (a pending backward is unaffected).

    Example::

        cpscope.clear_caches()
    """
    from . import _checks, _pack
    from .attention import _cudnn_thd

    _pack.clear_pack_caches()
    _checks.clear_host_offsets()
    _cudnn_thd.clear_cache()
