"""Rotary position embedding (RoPE) at the *global* positions of the local zigzag tokens.

Under context parallelism a rank holds chunks ``r`` and ``2·cp−1−r`` of every sequence (or document), so ordinary
RoPE over the local tensor would use the wrong positions. :func:`apply_rotary_pos_emb` looks up each local token's
global position (restarting at 0 per document in ``thd``) in a TE-style frequency table and rotates there. Its
result equals TransformerEngine's ``apply_rotary_pos_emb(..., cp_size=cp_size(), cp_rank=cp_rank())``.

Conventions (TE's): ``freqs`` is ``[max_seqlen, 1, 1, rot_dim]`` fp32 angles (position × inverse frequency).
Non-interleaved: angle ``i`` and ``i + rot_dim/2`` are equal and the pair is ``(x[i], x[i + rot_dim/2])``
(``rotate_half``). Interleaved: angles are repeated pairwise and the pairs are ``(x[2i], x[2i+1])``. Channels past
``rot_dim`` pass through unchanged.

Paths, on CUDA: cpscope's Triton kernel (:mod:`cpscope.rope._kernel`: one launch, angles read from the table by
position, the least host time: ``docs/attention_kernels.md`` §10), else TE's fused kernel when TransformerEngine is
importable, else plain torch math ``torch.compile``-d (:mod:`cpscope.rope._torch_math`: inside a user's
``torch.compile`` the math joins that graph; a failure of the compiler itself turns compilation off for that case
only, logged once; an out-of-memory error propagates); on CPU plain torch math.
Everything derived from the offsets (validation, positions) is cached per pack (:mod:`cpscope._pack`), so a call
costs the same host time whatever the number of documents.

Example::

    rope = cpscope.RotaryEmbedding(rot_dim=64)
    freqs = rope(max_seqlen=8192, device="cuda")              # [8192, 1, 1, 64] fp32
    with cpscope.runtime_cp(groups[2]):
        q = cpscope.apply_rotary_pos_emb(q_local, freqs, qkv_format="bshd")
"""
from __future__ import annotations

import math
import numbers
import operator
from typing import Any, Optional, Sequence, Union

import torch

from .._checks import (
    check_divisible_seq,
    check_local_thd_len,
    check_qkv_format,
    check_rope_freqs,
    check_tensor_dims,
)
from .. import _hooks
from . import _kernel as _rope_kernel
from .._pack import Pack, dense_pack, pack_for
from .._tensor_cache import owned
from ._te import call_te_rope
from ._te import te_rope_if_available as _te_apply
from ._torch_math import rope_math, rope_math_compiled, rope_math_cos_sin
from ..scope import UNSET as _UNSET, resolve_scope

__all__ = ["apply_rotary_pos_emb", "RotaryEmbedding", "rotary_freqs"]

_IMPLS = ("auto", "triton", "te", "compiled", "eager")
_TRACED_IMPLS = ("auto", "compiled", "eager")  # under torch.compile: torch math in the caller's graph


# ----------------------------------------------------------------------------------------------------------------
# Validation


def checked_rope_inputs(
    t: torch.Tensor, freqs: torch.Tensor, *, qkv_format: str, cu_seqlens: Any, cp: int,
    cu_seqlens_padded: Any = None,
) -> list[int]:
    """Validate RoPE inputs for CP size ``cp`` (``ValueError`` naming the values); return the global offsets.

    ``thd``: the validated global layout offsets; ``bshd`` / ``sbhd``: ``[0, global_len]``. Shared by
    :func:`apply_rotary_pos_emb` and the TransformerEngine adapter, so both refuse exactly the same inputs.
    """
    return list(_rope_pack(t, freqs, qkv_format=qkv_format, cu_seqlens=cu_seqlens, cp=cp, rank=0,
                           cu_seqlens_padded=cu_seqlens_padded).cu)


def _rope_pack(
    t: torch.Tensor, freqs: torch.Tensor, *, qkv_format: str, cu_seqlens: Any, cp: int, rank: int,
    cu_seqlens_padded: Any = None,
) -> Pack:
    """The validated pack of a RoPE call (cached per offsets tensor: O(1) per layer after the first)."""
    check_qkv_format(qkv_format)
    check_tensor_dims(t, qkv_format)
    if qkv_format == "thd":
        if cu_seqlens is None:
            raise ValueError("qkv_format='thd' needs cu_seqlens (the global document offsets)")
        pack = pack_for(cu_seqlens, cp, rank, cu_seqlens_padded=cu_seqlens_padded)
        check_local_thd_len(t.shape[0], [0, pack.total], cp)
        check_rope_freqs(freqs, t.shape[-1], pack.longest, what="longest document")
        return pack
    if cu_seqlens is not None or cu_seqlens_padded is not None:
        raise ValueError(f"cu_seqlens is only used with qkv_format='thd', got qkv_format={qkv_format!r}")
    seq = t.shape[1] if qkv_format == "bshd" else t.shape[0]
    global_len = seq * cp
    check_divisible_seq(global_len, cp, what=f"sequence length (local {seq} x cp {cp})")
    check_rope_freqs(freqs, t.shape[-1], global_len)
    return dense_pack(global_len, cp, rank)


# ----------------------------------------------------------------------------------------------------------------
# Public API


def apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    *,
    qkv_format: str,
    cu_seqlens: Optional[Union[torch.Tensor, Sequence[int]]] = None,
    interleaved: bool = False,
    group: Any = _UNSET,
    impl: str = "auto",
    cu_seqlens_padded: Optional[Union[torch.Tensor, Sequence[int]]] = None,
) -> torch.Tensor:
    """Apply RoPE to the local zigzag tensor ``t`` at the global positions of its tokens.

    The CP group is the active one (:func:`cpscope.runtime_cp`) or ``group=``; under CP1 this is ordinary RoPE.

    Args:
        t: local tensor, ``[b, s, h, d]`` (``bshd``), ``[s, b, h, d]`` (``sbhd``) or ``[t, h, d]`` (``thd``).
        freqs: ``[max_seqlen, 1, 1, rot_dim]`` angles (TE layout), covering the global length: ``s·cp`` for
            ``bshd``/``sbhd``, the longest document for ``thd``. ``rot_dim ≤ d``; channels past it pass through.
        qkv_format: ``"bshd"``, ``"sbhd"`` or ``"thd"``.
        cu_seqlens: ``thd`` only: the **global** (padded) document offsets, int32, starting at 0.
        interleaved: pairs ``(x[2i], x[2i+1])`` instead of ``(x[i], x[i + rot_dim/2])``.
        group: explicit CP group (``None`` = CP1); default: the active scope.
        impl: ``"auto"`` (on CUDA: cpscope's Triton kernel, else TE's fused kernel when importable, else the
            compiled torch math; eager on CPU), ``"triton"``, ``"te"``, ``"compiled"`` or ``"eager"``.
        cu_seqlens_padded: ``thd`` only, TE's convention: the layout offsets when ``cu_seqlens`` holds the real ones
            (positions follow the layout; real tokens get the same positions either way).

    Returns:
        A tensor like ``t`` (same dtype; computed in fp32). Differentiable w.r.t. ``t``.

    Raises:
        ValueError: bad layout or rank; local ``thd`` length ≠ ``cu_seqlens[-1]/cp``; a sequence / document not
            divisible by ``2·cp``; ``freqs`` of the wrong shape, shorter than the global length, or with an odd
            ``rot_dim`` or one larger than ``d``; malformed ``cu_seqlens`` — all before any kernel runs.

    Example::

        with cpscope.runtime_cp(groups[2]):
            q = cpscope.apply_rotary_pos_emb(q, freqs, qkv_format="thd", cu_seqlens=cu_seqlens_padded)
    """
    if torch.compiler.is_compiling():
        if impl in _TRACED_IMPLS:  # the host side gives the angles (an op, else an eager island); the math is traced
            return rope_math(t, _compiled_angles(t, freqs, qkv_format, cu_seqlens, group, cu_seqlens_padded),
                              interleaved)
        # a fused kernel asked for by name: the whole call is the island
        return _rope_island(t, freqs, qkv_format=qkv_format, cu_seqlens=cu_seqlens, interleaved=interleaved,
                            group=group, impl=impl, cu_seqlens_padded=cu_seqlens_padded)
    scope = resolve_scope(group)
    cp, rank = scope.size, scope.rank
    check_qkv_format(qkv_format)
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    pack = _rope_pack(t, freqs, qkv_format=qkv_format, cu_seqlens=cu_seqlens, cp=cp, rank=rank,
                      cu_seqlens_padded=cu_seqlens_padded)
    if _hooks.rope is not None:
        _hooks.rope(scope, pack.cu, qkv_format, t)

    if impl == "triton" or (impl == "auto" and _rope_kernel.usable(t)):
        return _triton_rope(t, freqs, pack, qkv_format, interleaved)
    use_te = impl == "te" or (impl == "auto" and t.is_cuda and _te_apply())
    if use_te:
        te_apply = _te_apply()
        if not te_apply:
            raise ValueError("impl='te' needs TransformerEngine (transformer_engine.pytorch) to be importable")
        layout = cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded
        return call_te_rope(te_apply, t, freqs, qkv_format=qkv_format, cu_seqlens=layout, cu=list(pack.cu), cp=cp,
                            rank=rank, interleaved=interleaved, fused=True)
    if impl == "compiled" or (impl == "auto" and t.is_cuda):
        return rope_math_compiled(t, _angles(freqs, pack, qkv_format).to(t.device), interleaved)
    cos_sin = _cached_cos_sin(t, freqs, pack, qkv_format)
    if cos_sin is not None:  # later layers of a pack: the same numbers without the gather and cos / sin
        return rope_math_cos_sin(t, *cos_sin, interleaved)
    return rope_math(t, _angles(freqs, pack, qkv_format).to(t.device), interleaved)


def _scoped_pack(t: torch.Tensor, freqs: torch.Tensor, qkv_format: str, cu_seqlens: Any, group: Any,
                 cu_seqlens_padded: Any) -> Pack:
    """The host side of a compiled call (the eager one inlines it): the scope read, validation, the pack (cached
    per offsets), the observer."""
    scope = resolve_scope(group)
    pack = _rope_pack(t, freqs, qkv_format=qkv_format, cu_seqlens=cu_seqlens, cp=scope.size, rank=scope.rank,
                      cu_seqlens_padded=cu_seqlens_padded)
    if _hooks.rope is not None:
        _hooks.rope(scope, pack.cu, qkv_format, t)
    return pack


# cudagraph_unsafe: its host side must run at every call (a CUDA graph replay would keep the angles of the scope it
# was captured under), so inductor leaves it out of CUDA graphs (mode="reduce-overhead"). An older torch without the
# tag gets the op without it (and may lack the ``tags=`` option too).
_UNSAFE = getattr(torch.Tag, "cudagraph_unsafe", None)


@torch.library.custom_op("cpscope::rope_angles", mutates_args=(), **({"tags": (_UNSAFE,)} if _UNSAFE else {}))
def _angles_op(t: torch.Tensor, freqs: torch.Tensor, qkv_format: str, cu_seqlens: Optional[torch.Tensor],
               cu_seqlens_padded: Optional[torch.Tensor]) -> torch.Tensor:
    """The angles of the local tokens of ``t`` under the scope active when the op *runs* (the scope read happens
    here, per microbatch, not when the graph is traced), validated as an eager call validates them."""
    pack = _scoped_pack(t, freqs, qkv_format, cu_seqlens, _UNSET, cu_seqlens_padded)
    return _angles(freqs, pack, qkv_format).to(t.device)


@_angles_op.register_fake
def _(t: torch.Tensor, freqs: torch.Tensor, qkv_format: str, cu_seqlens: Optional[torch.Tensor],
      cu_seqlens_padded: Optional[torch.Tensor]) -> torch.Tensor:
    n = t.shape[1] if qkv_format == "bshd" else t.shape[0]  # the local tokens: one angle row each
    angles = freqs.new_empty((n, freqs.shape[-1]), dtype=torch.promote_types(freqs.dtype, torch.float32),
                             device=t.device)
    return _broadcast_angles(angles, qkv_format)


def _compiled_angles(t: torch.Tensor, freqs: torch.Tensor, qkv_format: str, cu_seqlens: Any, group: Any,
                     cu_seqlens_padded: Any) -> torch.Tensor:
    """Under torch.compile: the angles from the ``cpscope::rope_angles`` op (no graph break; shape checks traced,
    the rest at run time), or, for what the op cannot take (an explicit ``group=``, offsets given as a list, a
    ``freqs`` that requires grad), from an eager island (one graph break)."""
    offsets = (cu_seqlens, cu_seqlens_padded)
    if (group is not _UNSET or not all(c is None or isinstance(c, torch.Tensor) for c in offsets)
            or freqs.requires_grad):  # a table that learns: the island's index_select keeps its gradient
        return _angles_island(t, freqs, qkv_format=qkv_format, cu_seqlens=cu_seqlens, group=group,
                              cu_seqlens_padded=cu_seqlens_padded)
    check_qkv_format(qkv_format)  # the checks that need only shapes, traced: bad input raises before the op
    check_tensor_dims(t, qkv_format)
    check_rope_freqs(freqs, t.shape[-1], 0)
    return _angles_op(t.detach(), freqs, qkv_format, cu_seqlens, cu_seqlens_padded)  # t: only its shape


@torch.compiler.disable
def _angles_island(t: torch.Tensor, freqs: torch.Tensor, *, qkv_format: str, cu_seqlens: Any, group: Any,
                   cu_seqlens_padded: Any) -> torch.Tensor:
    """Eager under torch.compile (the call site's one graph break): the host side of a call and the angles of the
    local tokens on ``t``'s device. Dynamo sees a tensor come back, so it guards on no group, size or offsets."""
    pack = _scoped_pack(t, freqs, qkv_format, cu_seqlens, group, cu_seqlens_padded)
    return _angles(freqs, pack, qkv_format).to(t.device)


def _triton_rope(t: torch.Tensor, freqs: torch.Tensor, pack: Pack, qkv_format: str, interleaved: bool) -> torch.Tensor:
    if not _rope_kernel.usable(t):
        raise ValueError(f"impl='triton' needs Triton and a CUDA tensor of fp32/bf16/fp16, got {t.device} {t.dtype}")
    table = freqs.reshape(freqs.shape[0], freqs.shape[-1])  # [max_seqlen, rot_dim]
    if table.dtype != torch.float32 or not table.is_contiguous() or table.device != t.device:
        table = table.to(device=t.device, dtype=torch.float32).contiguous()
    return _rope_kernel.rope(t, table, pack.positions(t.device), interleaved=interleaved,
                             seq_is_a=qkv_format == "sbhd")


def _angles(freqs: torch.Tensor, pack: Pack, qkv_format: str) -> torch.Tensor:
    """The angles of the local tokens, shaped to broadcast against the local tensor (on ``freqs``' device)."""
    pos = pack.positions(freqs.device)  # [n_local] global positions (cached per pack)
    table = freqs.reshape(freqs.shape[0], freqs.shape[-1])  # [max_seqlen, rot_dim]
    angles = table.index_select(0, pos).to(torch.promote_types(freqs.dtype, torch.float32))  # [n_local, rot_dim]
    return _broadcast_angles(angles, qkv_format)


_COS_SIN_TABLES = 4  # freqs tables whose cos / sin a pack keeps (per device and compute dtype), newest first


def _cached_cos_sin(t: torch.Tensor, freqs: torch.Tensor, pack: Pack,
                    qkv_format: str) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """The eager path's ``cos`` / ``sin`` of the local tokens' angles, computed as :func:`rope_math` computes them
    and kept on the pack (``thd``: the pack lives as long as its offsets tensor, one microbatch), so every layer
    after the first skips the table gather and the ``cos`` / ``sin`` — what the benchmarks' plain-PyTorch floor
    does once per pack. ``None`` (compute them per call, as before) where a cache could be wrong or leak: a table
    that requires grad (its gradient flows through the gather), inference mode (its tensors cannot be saved for a
    later backward), a table without a version counter, ``bshd`` / ``sbhd`` (their packs sit in a by-value LRU).

    An entry is used only for the very same table — the same base tensor (it is held, so its memory cannot be
    reused), view (offset, shape, strides, dtype, data pointer) and in-place version (views share their base's
    counter, so a write through torch to any view misses). As for a CUDA offsets tensor (:mod:`cpscope._tensor_cache`),
    a table written behind torch's back (through NumPy or DLPack) must be a new tensor, or call
    :func:`cpscope.clear_caches`. Up to :data:`_COS_SIN_TABLES` tables per pack (alternating local / global RoPE)."""
    if qkv_format != "thd" or freqs.requires_grad or torch.is_inference_mode_enabled():
        return None
    try:
        stamp = (freqs._version, freqs.data_ptr(), freqs.storage_offset(), freqs.shape, freqs.stride(), freqs.dtype)
    except RuntimeError:  # an inference tensor (no version counter), a tensor without storage
        return None
    base = freqs if freqs._base is None else freqs._base
    compute = torch.promote_types(t.dtype, torch.float32)  # rope_math's compute dtype
    tables = pack.memo(("rope_cos_sin", t.device, compute), list)
    for held, held_stamp, cos, sin in tables:
        if held is base and held_stamp == stamp:
            return cos, sin
    a = _angles(freqs, pack, qkv_format).to(t.device).to(compute)
    cos, sin = torch.cos(a), torch.sin(a)
    tables.insert(0, (base, stamp, cos, sin))
    del tables[_COS_SIN_TABLES:]
    return cos, sin


def _broadcast_angles(angles: torch.Tensor, qkv_format: str) -> torch.Tensor:
    """``[n_local, rot_dim]`` angles shaped to broadcast against the local tensor."""
    if qkv_format == "bshd":
        return angles[None, :, None, :]  # [1, s, 1, rot_dim]
    if qkv_format == "sbhd":
        return angles[:, None, None, :]  # [s, 1, 1, rot_dim]
    return angles[:, None, :]  # [t, 1, rot_dim]


_rope_island = torch.compiler.disable(apply_rotary_pos_emb)


def _check_base(base: float) -> float:
    if isinstance(base, bool) or not isinstance(base, numbers.Real) or not math.isfinite(base) or base <= 0:
        raise ValueError(f"RoPE base must be a finite number > 0, got {base!r}")
    return float(base)


def _size(value: Any, what: str, *, positive_even: bool = False) -> int:
    """A size given as a Python or NumPy integer (anything with ``__index__`` but a bool), as an ``int``."""
    try:
        n = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        n = None
    if positive_even and (n is None or n <= 0 or n % 2):
        raise ValueError(f"{what} must be a positive even int, got {value!r}")
    if n is None or n < 0:
        raise ValueError(f"{what} must be a non-negative int, got {value!r}")
    return n


def rotary_freqs(
    rot_dim: int, max_seqlen: int, *, base: float = 10000.0, interleaved: bool = False,
    device: Optional[Union[torch.device, str]] = None,
) -> torch.Tensor:
    """The TE-style fp32 angle table ``[max_seqlen, 1, 1, rot_dim]`` for :func:`apply_rotary_pos_emb`.

    ``angle[p, j] = p · base^(−2j/rot_dim)`` for ``j < rot_dim/2``; non-interleaved concatenates the two halves,
    interleaved repeats each angle twice in a row. Sizes may be Python or NumPy integers.

    Example::

        freqs = cpscope.rotary_freqs(64, 4096)     # [4096, 1, 1, 64]
    """
    rot_dim = _size(rot_dim, "rot_dim", positive_even=True)
    base = _check_base(base)
    max_seqlen = _size(max_seqlen, "max_seqlen")
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32, device=device) / rot_dim))
    pos = torch.arange(max_seqlen, dtype=torch.float32, device=inv_freq.device)
    ang = torch.outer(pos, inv_freq)  # [S, rot_dim/2]
    emb = ang.repeat_interleave(2, dim=-1) if interleaved else torch.cat((ang, ang), dim=-1)
    return emb[:, None, None, :]  # [S, 1, 1, rot_dim]


class RotaryEmbedding(torch.nn.Module):
    """Builds (and caches) the fp32 RoPE angle table for :func:`apply_rotary_pos_emb`.

    ``forward(max_seqlen, device=None)`` returns ``[max_seqlen, 1, 1, rot_dim]``; the table is cached per device
    and grown on demand (a shorter request is a view of the cached table). Pass the **global** length. Sizes may
    be Python or NumPy integers. Writing into a returned table in place changes no later table: the cache sees the
    write (the view shares the table's version counter) and builds a new one.

    Example::

        rope = cpscope.RotaryEmbedding(64)
        freqs = rope(8192, device="cuda")
        q = cpscope.apply_rotary_pos_emb(q, freqs, qkv_format="sbhd")
    """

    def __init__(self, rot_dim: int, base: float = 10000.0, interleaved: bool = False) -> None:
        super().__init__()
        self.rot_dim = _size(rot_dim, "rot_dim", positive_even=True)
        self.base, self.interleaved = _check_base(base), bool(interleaved)

    def forward(self, max_seqlen: int, device: Optional[Union[torch.device, str]] = None) -> torch.Tensor:
        max_seqlen = _size(max_seqlen, "max_seqlen")
        dev = torch.device("cpu") if device is None else torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        cache = owned(self, "_tables")  # device -> (table, its version when made); cpscope.clear_caches() empties it
        table, version = cache.get(dev, (None, -1))
        if table is None or table.shape[0] < max_seqlen or _version(table) != version:
            table = rotary_freqs(self.rot_dim, max_seqlen, base=self.base, interleaved=self.interleaved, device=dev)
            version = _version(table)
            if version is None:  # an inference-mode tensor has no version counter: never hand out the cache
                return table
            cache[dev] = (table, version)
        return table[:max_seqlen]

    def extra_repr(self) -> str:
        return f"rot_dim={self.rot_dim}, base={self.base}, interleaved={self.interleaved}"


def _version(t: torch.Tensor) -> Optional[int]:
    try:
        return t._version
    except RuntimeError:  # inference tensor
        return None
