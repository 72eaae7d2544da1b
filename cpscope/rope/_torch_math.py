"""RoPE as plain torch math: eager, and ``torch.compile``-d with the compiler's failures remembered per case.

Private to :mod:`cpscope.rope`. This is the path :func:`cpscope.rope.apply_rotary_pos_emb` takes when neither
cpscope's Triton kernel (:mod:`cpscope.rope._kernel`) nor TransformerEngine's fused kernel (:mod:`cpscope.rope._te`)
runs: on CPU (eager), on CUDA without Triton or TE (compiled), and inside a user's ``torch.compile`` (the eager math,
traced into the user's graph). The angles come from the caller, already looked up at the tokens' global positions
and shaped to broadcast against ``t``; nothing here knows about CP, packs or validation.

Math (TransformerEngine's convention): ``y = x·cos a + rot(x)·sin a`` on the first ``rot_dim`` channels, with
``rot(x) = [-x2, x1]`` (halves) or ``(-x[2i+1], x[2i])`` (interleaved pairs); channels past ``rot_dim`` pass through.
Computed in at least fp32, returned in ``t``'s dtype.

The compiled math: a failure of the compiler itself (TorchDynamo / Inductor: no working C++ compiler or Triton, a
lowering bug) turns compilation off for that case only — (device type, dtype, rank, interleaved, autograd) — and is
logged once per case; anything else (an out-of-memory error, also one wrapped by the compiler, or an error the math
would raise eagerly as well) propagates and compilation stays on. ``cpscope.clear_caches()`` drops the compiled
function (compiled again on next use); the memory of failed cases is kept.

Example::

    from cpscope.rope._torch_math import rope_math, rope_math_compiled

    angles = freqs[:s, 0, 0, :][None, :, None, :]              # [1, s, 1, rot_dim] for a [b, s, h, d] tensor
    y = rope_math(q, angles, interleaved=False)                 # eager
    y = rope_math_compiled(q, angles, interleaved=False)        # one fused kernel (eager where compiling fails)
"""
from __future__ import annotations

import logging
import threading
import types
from typing import Any, Callable, Iterator, Optional

import torch

from .._tensor_cache import register_clear

__all__ = ["rope_math", "rope_math_cos_sin", "rope_math_compiled"]

logger = logging.getLogger(__name__)


def _rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The 90° partner of each channel: non-interleaved ``[-x2, x1]`` (halves); interleaved ``(-x1, x0)`` per pair."""
    if interleaved:
        pairs = x.unflatten(-1, (-1, 2))  # [..., rot_dim/2, 2]
        return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_math(t: torch.Tensor, angles: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate the first ``rot_dim`` channels of ``t`` by ``angles`` (broadcastable ``[..., rot_dim]``), in ≥ fp32.

    Example::

        y = rope_math(torch.randn(2, 8, 4, 64), angles[None, :, None, :], interleaved=False)   # angles [8, 64]
    """
    a = angles.to(torch.promote_types(t.dtype, torch.float32))
    return rope_math_cos_sin(t, torch.cos(a), torch.sin(a), interleaved)


def rope_math_cos_sin(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """:func:`rope_math` with ``cos`` / ``sin`` of the angles given, already in the compute dtype (``≥ fp32``, as
    :func:`rope_math` makes them): the same numbers, without the per-call ``cos`` / ``sin`` (the eager path caches
    them per pack, see :func:`cpscope.rope._api.apply_rotary_pos_emb`)."""
    rot_dim = cos.shape[-1]
    whole = rot_dim == t.shape[-1]
    x = (t if whole else t[..., :rot_dim]).to(cos.dtype)  # no slice view (an autograd node) when it is all of t
    y = x * cos + _rotate(x, interleaved) * sin
    if whole:
        return y.to(t.dtype)
    return torch.cat((y.to(t.dtype), t[..., rot_dim:]), dim=-1)


_compiled_lock = threading.Lock()
_compiled: Optional[Callable[..., torch.Tensor]] = None
_compile_off: set[tuple[Any, ...]] = set()


def _compile(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    # a copy with a code object of its own: torch keeps compiled code per code object, so clearing drops that too
    return torch.compile(types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__), dynamic=True)


@register_clear  # cpscope.clear_caches() drops the compiled math (compiled again on next use)
def _forget_compiled() -> None:
    global _compiled
    _compiled = None


def _causes(e: Optional[BaseException]) -> Iterator[BaseException]:
    """``e`` and what it wraps (``inner_exception`` of the compiler's errors, ``__cause__``, ``__context__``)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = getattr(e, "inner_exception", None) or e.__cause__ or e.__context__


def _is_compile_failure(e: BaseException) -> bool:
    """Whether ``e`` is the compiler failing (not the kernel: no out-of-memory anywhere in what it wraps)."""
    from torch._dynamo.exc import TorchDynamoException  # imported only when something failed

    if not isinstance(e, TorchDynamoException):
        return False
    return not any(isinstance(c, torch.OutOfMemoryError) or "out of memory" in str(c) for c in _causes(e))


def rope_math_compiled(t: torch.Tensor, angles: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """:func:`rope_math` as one fused ``torch.compile`` kernel (created on first use); see the module docstring.

    Inside a caller's ``torch.compile`` it is :func:`rope_math` (the caller's graph takes the math as it is).

    Example::

        y = rope_math_compiled(q.cuda(), angles.cuda(), interleaved=False)
    """
    global _compiled
    if torch.compiler.is_compiling():  # inside the user's torch.compile: its graph takes the math as it is
        return rope_math(t, angles, interleaved)
    case = (t.device.type, t.dtype, t.dim(), bool(interleaved), torch.is_grad_enabled() and t.requires_grad)
    if case in _compile_off:
        return rope_math(t, angles, interleaved)
    with _compiled_lock:
        if _compiled is None:
            _compiled = _compile(rope_math)
        compiled = _compiled
    try:
        return compiled(t, angles, interleaved)
    except Exception as e:
        if not _is_compile_failure(e):
            raise
        with _compiled_lock:
            first = case not in _compile_off
            _compile_off.add(case)
        if first:
            logger.warning("cpscope RoPE: torch.compile failed for %s (%s: %s); using the eager path for it",
                           case, type(e).__name__, e)
    return rope_math(t, angles, interleaved)
