"""Context-parallel attention over the active CP group: validate once, prepare the call, run its variant.

:func:`context_parallel_attention` takes this rank's **zigzag** shards of q/k/v (see ``cpscope.zigzag_shard``) and
returns this rank's rows of full attention over the whole sequences — document-masked in ``thd``, causal or not,
with grouped-query attention. Under CP1 (no group, or a size-1 group) it is plain local attention.

A call is validated and resolved once into an :class:`AttentionCall` (:func:`prepare_call`: shapes, offsets and
their per-pack metadata, the variant); :func:`run_call` runs it — the zigzag ring (:mod:`.ring`) here, the
collective variants through :func:`cpscope.attention._dispatch.run_variant`. Under CP > 1 the ranks first agree on
the call (:mod:`.agreement`: a fixed-size digest, no host sync per layer). An observer in the
``cpscope._hooks.attention`` slot (the sentinel) wraps the run of the prepared call.

Kernels: exact math on CPU (fp32/fp64 scores); on CUDA (fp16/bf16) PyTorch's cuDNN attention for dense blocks
(MHA, GQA and MQA: K/V are never expanded), cuDNN's ragged kernels for ``thd`` when the cuDNN frontend is installed
(else PyTorch's flash-attention varlen kernels). Every block of the ring uses the same kernels as CP1; CP1 dense on
CUDA is one ``F.scaled_dot_product_attention`` call.

Example::

    with cpscope.runtime_cp(groups[2]):
        q, k, v = (cpscope.zigzag_shard(t, seq_dim=1) for t in (q, k, v))
        out = cpscope.context_parallel_attention(q, k, v, qkv_format="bshd", causal=True)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from .. import _hooks
from .._pack import Pack, pack_for
from .._variants import P2P
from ..scope import UNSET as _UNSET, CPScope, resolve_scope
from ._inputs import check_attention_inputs, check_dense_max_seqlen, check_softmax_scale, check_thd_pack
from ._agreement import check_call
from ._halo import halo_attention
from ._halo_plan import halo_plan_for
from ._layout import packed, unpacked
from ._mods import Band, Mods
from ._policy import kernel_policy
from ._ring import ring_attention
from ._ring_plan import RingPlan, plan_for_pack
from ._dispatch import Variant, resolve_variant, run_variant

__all__ = ["context_parallel_attention", "attention_with_scope", "AttentionCall", "prepare_call", "run_call"]

def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    qkv_format: str = "bshd",
    causal: bool = True,
    cu_seqlens: Optional[Any] = None,
    max_seqlen: Optional[int] = None,
    softmax_scale: Optional[float] = None,
    comm: Optional[str] = None,
    group: Any = _UNSET,
    cu_seqlens_padded: Optional[Any] = None,
    window: Optional[tuple[int, int]] = None,
    sinks: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """Local rows of full attention for local zigzag q/k/v, over the active CP group (or ``group=``).

    Args:
        q: ``[b, s, h, d]`` (``bshd``), ``[s, b, h, d]`` (``sbhd``) or ``[t, h, d]`` (``thd``), local zigzag shard.
        k, v: same layout, ``h_kv`` heads with ``h % h_kv == 0`` (grouped-query / multi-query attention); ``v`` may
            have its own head dim (multi-latent attention; the output has it).
        qkv_format: ``"bshd"``, ``"sbhd"`` or ``"thd"``.
        causal: causal mask (within each document in ``thd``).
        cu_seqlens: **global** offsets, int32, from 0. ``thd``: the documents' offsets; the local tensor holds
            ``cu_seqlens[-1] / cp`` tokens (or ``cu_seqlens_padded[-1] / cp``), every document zigzag-sharded on its
            own. ``bshd`` / ``sbhd``: optional real lengths of the ``b`` rows as offsets (``b + 1`` entries; a
            padding mask, each row padded at its end to the global length ``s·cp``).
        max_seqlen: optional; checked to be at least the longest global sequence / document.
        softmax_scale: default ``1 / sqrt(d)`` (q/k's head dim); a given value must be a finite number > 0.
        comm: the communication variant — ``"p2p"`` (zigzag ring), ``"all_gather"``, ``"a2a"`` (Ulysses; heads
            must divide by cp), ``"a2a+p2p"`` / ``"a2a+p2p:N"`` (all-to-all in inner groups of N, ring across),
            ``"auto"``; ``None``: what the active scope carries, else ``"p2p"``. Every variant gives the same rows.
            Padding without a causal mask is masked by ``"p2p"`` only (``"auto"`` then picks it; another variant
            raises ``ValueError``).
        group: explicit CP group (``None`` = CP1); default: the active scope.
        cu_seqlens_padded: ``thd`` only, TransformerEngine's convention: the **layout** offsets (documents padded,
            at their end, to multiples of ``2·cp``) while ``cu_seqlens`` holds the **real** ones. Padding tokens are
            then masked: no query attends to them, their output rows are zero and they get zero gradients. Omitted,
            ``cu_seqlens`` is both.
        window: ``(left, right)``: the query at position ``i`` (of its document in ``thd``) sees keys
            ``i - left .. i + right``; ``-1`` is unbounded; ``causal`` applies as well. ``"p2p"`` then exchanges only
            the halo rows the window needs and computes only the blocks it leaves (:mod:`cpscope.attention._halo`).
        sinks: ``[h]`` floating point: one extra logit per q head in every softmax denominator, with no value
            (``out_i = sum_j exp(s_ij) v_j / (exp(sinks[h]) + sum_j exp(s_ij))``); receives the gradient of this
            rank's rows.
        softcap: finite > 0: the scaled scores ``s`` become ``softcap * tanh(s / softcap)`` before masking (sinks
            are not capped).

    Returns:
        The local output, same shape and dtype as ``q``. q, k and v receive the gradients of their own rows.

    Raises:
        ValueError: inconsistent inputs (shapes, dtypes, devices, heads, lengths vs cp and cu_seqlens, a
            ``softmax_scale`` or ``softcap`` that is not a finite positive number, a ``window`` side below -1,
            ``sinks`` not floating point of shape ``[h]``), before any collective or kernel runs.

    Example::

        with cpscope.runtime_cp(groups[4]):       # gpt-oss style: a 128-token window, sinks
            out = context_parallel_attention(q, k, v, window=(127, 0), sinks=model_sinks)
        with cpscope.runtime_cp(groups[2]):       # q/k/v: local zigzag shards, [t_local, h, d]; cu: global offsets
            out = context_parallel_attention(q, k, v, qkv_format="thd", cu_seqlens=cu)
        b = cpscope.pad_packed_batch(x, cu_seqlens=cu, cp=2)      # padded documents: pass both offsets
        out = context_parallel_attention(q, k, v, qkv_format="thd", causal=False, cu_seqlens=b.cu_seqlens,
                                         cu_seqlens_padded=b.cu_seqlens_padded)
        out = context_parallel_attention(q, k, v, qkv_format="bshd", group=None)   # CP1: plain local attention
    """
    if torch.compiler.is_compiling():  # under torch.compile: the whole call is one eager island (see below)
        return _attention_island(q, k, v, qkv_format=qkv_format, causal=causal, cu_seqlens=cu_seqlens,
                                 max_seqlen=max_seqlen, softmax_scale=softmax_scale, comm=comm, group=group,
                                 cu_seqlens_padded=cu_seqlens_padded, window=window, sinks=sinks, softcap=softcap)
    scope = resolve_scope(group)
    return attention_with_scope(
        q, k, v, scope, qkv_format=qkv_format, causal=causal, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
        softmax_scale=softmax_scale, comm=comm, cu_seqlens_padded=cu_seqlens_padded, window=window, sinks=sinks,
        softcap=softcap,
    )


# Under torch.compile a call runs as one eager island, the one graph break of its call site: the scope read (per
# forward, so each microbatch of one compiled model uses its own group), validation, the pack cache, the offsets
# read to the host, the ring's collectives and its autograd Function. Dynamo sees only tensors going in and out, so
# it guards on nothing that changes per microbatch (a group, a CP size, offsets' values). Eager calls do not pass
# through the disable wrapper (it costs a frame-callback swap per call).
_attention_island = torch.compiler.disable(context_parallel_attention)


def attention_with_scope(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scope: CPScope,
    *,
    qkv_format: str = "bshd",
    causal: bool = True,
    cu_seqlens: Optional[Any] = None,
    cu_seqlens_padded: Optional[Any] = None,
    max_seqlen: Optional[int] = None,
    softmax_scale: Optional[float] = None,
    comm: Optional[str] = None,
    window: Optional[tuple[int, int]] = None,
    sinks: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """:func:`context_parallel_attention` with an already resolved :class:`~cpscope.CPScope` (no ContextVar read).

    For callers that resolved the scope once themselves (a module's forward, an adapter); arguments and result as
    :func:`context_parallel_attention`. Everything derived from the offsets (validation, the ring's offsets and
    document split, padding rows) is computed once per pack and cached on the offsets tensor.

    Example::

        scope = cpscope.resolve_scope()            # once, in forward
        out = attention_with_scope(q, k, v, scope, qkv_format="bshd", causal=True)
    """
    if torch.compiler.is_compiling():  # one eager island under torch.compile, as context_parallel_attention
        return _attention_with_scope_island(
            q, k, v, scope, qkv_format=qkv_format, causal=causal, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
            cu_seqlens_padded=cu_seqlens_padded, softmax_scale=softmax_scale, comm=comm, window=window, sinks=sinks,
            softcap=softcap)
    args = (q, k, v, scope, qkv_format, causal, cu_seqlens, cu_seqlens_padded, max_seqlen, softmax_scale, comm)
    features = {"window": window, "sinks": sinks, "softcap": softcap}
    observer = _hooks.attention
    if observer is None:
        call = prepare_call(*args, **features)  # bad input raises here, before any collective
        return run_call(call) if scope.size == 1 else _agreed_run(call)
    try:
        call = prepare_call(*args, **features)
    except ValueError as e:  # the observer agrees with the other ranks first, then raises it
        call = AttentionCall(*args, error=e, mods=Mods(window, softcap, sinks))  # as given, unchecked
    return observer(call, run_call if scope.size == 1 else _agreed_run)


def _agreed_run(call: "AttentionCall") -> torch.Tensor:
    """:func:`run_call` under CP > 1, after the group agreed on the call (:mod:`cpscope.attention._agreement`: one
    fixed-size all-reduce, no host sync after the first call of each kind)."""
    if call.error is None:
        check_call(call)
    return run_call(call)


_attention_with_scope_island = torch.compiler.disable(attention_with_scope)


@dataclass(frozen=True, eq=False)
class AttentionCall:
    """One attention call, validated and resolved once: what runs it and what an observer may look at.

    The first fields are the call's arguments as given; ``scale``, ``pack``, ``variant`` and ``mods`` are derived
    by :func:`prepare_call`: ``mods`` is the call's validated score features (:class:`~cpscope.attention._mods.Mods`:
    the window as a band, the softcap, the sinks), built once there and passed as one value to the variants and
    their plans; ``window`` / ``sinks`` / ``softcap`` read it. ``error`` holds the ``ValueError`` of inputs that
    failed validation (then the derived fields are ``None``, ``mods`` holds the features as given, and
    :func:`run_call` raises it). ``dataclasses.replace(call, q=..., k=..., v=...)`` gives the same call on other
    (e.g. tapped) tensors of the same shapes.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scope: CPScope
    qkv_format: str
    causal: bool
    cu_seqlens: Optional[Any]
    cu_seqlens_padded: Optional[Any]
    max_seqlen: Optional[int]
    softmax_scale: Optional[float]
    comm: Optional[str]  # as asked (None: the scope's, else "p2p")
    scale: Optional[float] = None  # the validated softmax scale
    pack: Optional[Pack] = None  # per-pack metadata (thd; bshd/sbhd with real lengths or as varlen rows)
    variant: Optional[Variant] = None  # the variant that runs (``"auto"`` resolved)
    error: Optional[ValueError] = None
    mods: Mods = Mods()  # the validated score features

    @property
    def window(self) -> Optional[tuple[int, int]]:
        """``(left, right)`` (a :class:`~cpscope.attention._mods.Band`), -1 unbounded; ``None``: no window."""
        return self.mods.window

    @property
    def sinks(self) -> Optional[torch.Tensor]:
        """``[h]``: one logit per q head in every softmax denominator; ``None``: no sinks."""
        return self.mods.sinks

    @property
    def softcap(self) -> Optional[float]:
        """The scores' cap; ``None``: no softcap."""
        return self.mods.softcap

    @property
    def band(self) -> Optional[Band]:
        """The window as it restricts this call's sequences (``None``: it restricts nothing; causal: right 0)."""
        return self.features.window

    @property
    def features(self) -> Mods:
        """:attr:`mods` as the variants run them: the window as it restricts this call's sequences
        (:meth:`~cpscope.attention._mods.Mods.within`)."""
        if self.error is not None:
            return Mods()
        if self.mods.window is None:
            return self.mods
        if self.qkv_format == "thd":
            longest = self.pack.longest
        else:
            longest = (self.q.shape[1] if self.qkv_format == "bshd" else self.q.shape[0]) * self.scope.size
        return self.mods.within(self.causal, longest)

    @property
    def padded(self) -> bool:
        """Whether padding rows are masked (real offsets given that differ from the layout)."""
        return self.pack is not None and self.pack.padded


def prepare_call(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scope: CPScope, qkv_format: str, causal: bool,
    cu_seqlens: Optional[Any], cu_seqlens_padded: Optional[Any], max_seqlen: Optional[int],
    softmax_scale: Optional[float], comm: Optional[str], *, window: Any = None, sinks: Any = None,
    softcap: Any = None,
) -> AttentionCall:
    """Validate the inputs and resolve the pack and the variant: the :class:`AttentionCall` to run.

    Raises:
        ValueError: inconsistent inputs (before any collective or kernel).
    """
    check_attention_inputs(q, k, v, qkv_format=qkv_format, cp=scope.size)
    scale = check_softmax_scale(softmax_scale, q.shape[-1])
    mods = Mods.checked(window, softcap, sinks, heads=q.shape[-2], device=q.device)  # the call's one features value
    pack = _pack_of(q, scope, qkv_format, cu_seqlens, cu_seqlens_padded, max_seqlen)
    variant = resolve_variant(comm, scope, q, k, qkv_format=qkv_format, causal=causal,  # comm= / scope.comm
                              cu=pack.cu if qkv_format == "thd" else None,
                              padded=pack is not None and pack.real is not None, window=mods.window)
    return AttentionCall(q, k, v, scope, qkv_format, causal, cu_seqlens, cu_seqlens_padded, max_seqlen,
                         softmax_scale, comm, scale=scale, pack=pack, variant=variant, mods=mods)


def _pack_of(q: torch.Tensor, scope: CPScope, qkv_format: str, cu_seqlens: Optional[Any],
             cu_seqlens_padded: Optional[Any], max_seqlen: Optional[int]) -> Optional[Pack]:
    """The call's validated per-pack metadata: ``thd``'s documents; bshd/sbhd rows with real lengths (or run as
    varlen rows); ``None`` for plain dense rows."""
    if qkv_format == "thd":
        if cu_seqlens is None:
            raise ValueError("qkv_format='thd' needs cu_seqlens (global, int32, starting at 0)")
        pack = pack_for(cu_seqlens, scope.size, scope.rank, cu_seqlens_padded=cu_seqlens_padded)
        check_thd_pack(q, pack, max_seqlen)
        return pack
    if cu_seqlens_padded is not None:
        raise ValueError(
            f"cu_seqlens_padded is only used with qkv_format='thd', got qkv_format={qkv_format!r}; for "
            f"{qkv_format} pass the rows' real lengths as cu_seqlens"
        )
    b, s = (q.shape[0], q.shape[1]) if qkv_format == "bshd" else (q.shape[1], q.shape[0])
    g = s * scope.size  # global sequence length
    check_dense_max_seqlen(max_seqlen, g)
    if cu_seqlens is None and not kernel_policy().dense_as_varlen:
        return None
    # row i is a document of global length g, zigzag-sharded (padded at its end when real lengths are given)
    layout = tuple(range(0, b * g + 1, g))
    if cu_seqlens is None:
        return pack_for(layout, scope.size, scope.rank)
    return pack_for(cu_seqlens, scope.size, scope.rank, cu_seqlens_padded=layout)


def run_call(call: AttentionCall) -> torch.Tensor:
    """Run a prepared :class:`AttentionCall` (raises its ``error`` if its inputs failed validation)."""
    if call.error is not None:
        raise call.error
    mods = call.features  # the window as it restricts this call's sequences
    if call.variant.name == P2P:
        # a window across ranks, or over padded documents (their compacted keys would shift a kernel's aligned
        # window): the halo plan's blocks; else the ring (one kernel call under CP1)
        if mods.window is not None and (call.scope.size > 1 or call.padded):
            return _run_halo(call, mods)
        return _run_ring(call, mods)
    # causal: padding (at the end of each document) is never seen by a real query; its own rows are zeroed, so no
    # gradient flows from them
    out = run_variant(call.variant, call.q, call.k, call.v, call.scope, qkv_format=call.qkv_format,
                      causal=call.causal, cu=call.pack.cu if call.qkv_format == "thd" else None, scale=call.scale,
                      mods=mods)
    return _zero_padding_rows(out, call.pack, call.qkv_format) if call.padded else out


def _run_halo(call: AttentionCall, mods: Mods) -> torch.Tensor:
    """``"p2p"`` with a window: the halo exchange (:mod:`cpscope.attention._halo`) on the packed rows."""
    q, k, v, scope = call.q, call.k, call.v, call.scope
    pack = call.pack
    if pack is None:  # plain dense rows: each batch row one zigzag-sharded sequence
        b, s = (q.shape[0], q.shape[1]) if call.qkv_format == "bshd" else (q.shape[1], q.shape[0])
        g = s * scope.size
        pack = pack_for(tuple(range(0, b * g + 1, g)), scope.size, scope.rank)
    qp, kp, vp, how = packed(q, k, v, qkv_format=call.qkv_format, cu=pack.cu, cp=scope.size)
    plan = halo_plan_for(pack, q.device, causal=call.causal, scale=call.scale, mods=mods)
    return unpacked(halo_attention(qp, kp, vp, plan=plan, group=scope.group), how)


def _run_ring(call: AttentionCall, mods: Mods) -> torch.Tensor:
    """The zigzag ring (``"p2p"`` without a window; every variant under CP1) on the call's layout."""
    q, k, v, scope, causal, scale, pack = call.q, call.k, call.v, call.scope, call.causal, call.scale, call.pack
    if call.qkv_format == "thd":
        return ring_attention(q, k, v, plan=plan_for_pack(pack, q.device, causal=causal, scale=scale, mods=mods),
                              group=scope.group)
    if call.qkv_format == "sbhd":  # [s, b, h, d] -> [b, s, h, d] views; the kernels read the strides (no copies)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    b, s = q.shape[0], q.shape[1]
    plain = mods.plain and v.shape[-1] == q.shape[-1]
    if pack is not None:  # [b, s, h, d] -> [b*s, h, d] through the varlen ring
        q2, k2, v2 = (t.reshape(b * s, *t.shape[2:]) for t in (q, k, v))
        plan = plan_for_pack(pack, q.device, causal=causal, scale=scale, mods=mods)
        out = ring_attention(q2, k2, v2, plan=plan, group=scope.group)
        out = out.view(b, s, *out.shape[1:])
    elif scope.size == 1 and q.is_cuda and plain:
        # CP1 on CUDA is plain attention: PyTorch's SDPA (cuDNN on Hopper; GQA without expanded K/V) with its own
        # autograd — the same kernels as cpscope's blocks, without the ring's Function around them (host time)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=causal, scale=scale,
                                             enable_gqa=k.shape[-2] != q.shape[-2]).transpose(1, 2)
    else:
        plan = RingPlan(varlen=False, causal=causal, scale=scale, rank=scope.rank, size=scope.size, local_len=s,
                        mods=mods)
        out = ring_attention(q, k, v, plan=plan, group=scope.group)
    return out.transpose(0, 1) if call.qkv_format == "sbhd" else out


def _zero_padding_rows(out: torch.Tensor, pack: Pack, qkv_format: str) -> torch.Tensor:
    """``out`` with the padding rows of ``pack`` zeroed, differentiably (no gradient flows from them)."""
    rows = pack.pad_rows(out.device)
    if rows is None:
        return out
    if qkv_format == "thd":
        return out.index_fill(0, rows, 0)
    dense = out if qkv_format == "bshd" else out.transpose(0, 1)  # [b, s, h, d]
    b, s = dense.shape[:2]
    flat = dense.reshape(b * s, *dense.shape[2:]).index_fill(0, rows, 0)
    res = flat.view(b, s, *dense.shape[2:])
    return res if qkv_format == "bshd" else res.transpose(0, 1)
