"""TransformerEngine adapter: TE attention and fused RoPE under the active cpscope scope.

TE's ``DotProductAttention`` keeps its CP settings (``cp_group``, ``cp_global_ranks``, ``cp_stream``,
``cp_comm_type``, ``load_balancing_strategy``) as module attributes, set at construction or by
``set_context_parallel_group``. With runtime CP the group changes per microbatch, and a module attribute set for one
microbatch would leak into the next. :class:`ScopedDotProductAttention` therefore binds the active group **for the
duration of each forward only** and restores the module's own (build-time) settings afterwards, also when the forward
raises. TE keeps what backward needs (group, stream) on its autograd ``ctx``, so restoring after forward is safe.

For CP1 (``None`` or a size-1 group) the module is given ``cp_group=None, cp_global_ranks=None, cp_stream=None``.
For CP > 1 it gets the group, its global ranks (:func:`cpscope.group_ranks`) and the auxiliary stream from
``stream_provider(device)`` (default :func:`cpscope.cp_stream`: a real ``torch.cuda.Stream``); a provider that
returns ``None`` (no CUDA) raises ``ValueError`` instead of TE's ``'NoneType' object has no attribute 'wait_event'``.
The token layout is cpscope's zigzag (TE's ``DUAL_CHUNK_SWAP``), per document in ``thd`` with **global**
``cu_seqlens`` (as TE expects).

TransformerEngine is imported lazily: the wrapper works with any module that has TE's
``set_context_parallel_group`` method and attributes, and :func:`te_apply_rotary_pos_emb` imports TE on first call
(after its input checks, so bad input raises ``ValueError`` even where TE is not installed).

Activation checkpointing: the scoped modules (:class:`ScopedDotProductAttention`, and the classes
:func:`enable_runtime_cp` installs) resolve the scope on **every** forward call — including the forward that TE or
Megatron runs again during backward when it checkpoints (recomputes) a layer containing them. By then the caller's
scope is gone or another microbatch's is bound, so a checkpointed scoped layer must re-enter its forward's scope:
wrap the checkpointed function with ``cpscope.scoped(fn)`` *inside* ``forward`` (built per call, so it captures that
microbatch's scope), or checkpoint with :func:`cpscope.checkpoint`. A recompute that does not re-enter the scope
raises :class:`cpscope.ScopeReadInBackwardError` (the default backward read check) before TE runs. Recompute done
inside library code that cannot be wrapped (e.g. Megatron's ``recompute_granularity="selective"``, which calls
``core_attention`` again from ``tensor_parallel.checkpoint``) is not covered: recompute the whole layer under
``cpscope.scoped`` instead.

Outside every runtime scope a scoped module uses its **build-time** CP, captured when it is wrapped: the TE
module's own group if it was built with one, else the process-wide build-time group (:func:`cpscope.build_time_cp`)
— never a runtime binding that happened to be active at that moment.

Example::

    import transformer_engine.pytorch as te
    from cpscope.integrations.te import ScopedDotProductAttention, te_apply_rotary_pos_emb

    attn = ScopedDotProductAttention(te.DotProductAttention(16, 128, qkv_format="bshd", attn_mask_type="causal"))
    with cpscope.runtime_cp(groups[2]):                      # this microbatch runs with CP2
        q = te_apply_rotary_pos_emb(q, freqs, qkv_format="bshd")
        k = te_apply_rotary_pos_emb(k, freqs, qkv_format="bshd")
        out = attn(q, k, v)                                   # local zigzag q/k/v

    class Layer(torch.nn.Module):                 # activation checkpointing of a layer holding `attn`
        def forward(self, x):                     # scoped(...) is built per call, inside forward
            return tensor_parallel.checkpoint(cpscope.scoped(self.block), False, x)   # or cpscope.checkpoint
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import torch
from torch import nn

from .._checks import (
    check_cu_seqlens,
    check_divisible_seq,
    check_local_thd_len,
    check_qkv_format,
)
from .._pack import cu_seqlens_list
from .._variants import check_comm
from ..rope import call_te_rope, checked_rope_inputs, te_rope
from ..scope import UNSET as _UNSET, CPScope, build_time_scope, resolve_scope, runtime_scope_or, scope_for
from ..streams import cp_stream
from ._swap import ForwardSignature, call_with_attributes, swap_class, unswap_all
from ._te_settings import CP_SETTINGS, StreamProvider, bind_te_cp, te_cp_settings

__all__ = [  # bind_te_cp (with CP_SETTINGS and te_cp_settings, importable from here) is defined in _te_settings
    "bind_te_cp",
    "ScopedDotProductAttention",
    "enable_runtime_cp",
    "disable_runtime_cp",
    "te_apply_rotary_pos_emb",
]

logger = logging.getLogger(__name__)

def _check_thd(cu: Any, local_tokens: int, cp: int, name: str) -> None:
    cu_list = cu_seqlens_list(cu, name)
    check_cu_seqlens(cu_list, cp, name)
    check_local_thd_len(local_tokens, cu_list, cp, "query_layer")


class _Options(NamedTuple):
    cp_comm_type: Optional[str]
    stream_provider: StreamProvider
    group: Any  # _UNSET (active scope), None or a ProcessGroup
    validate: bool
    # The module's build-time CP, captured at construction / enable time and used outside every runtime scope:
    # a CPScope, or None = the TE module's own settings, left untouched (it was built with a CP TE knows only).
    build: Optional[CPScope] = None

    def __deepcopy__(self, memo: dict) -> "_Options":
        return self  # immutable; a copied _UNSET sentinel or process group would no longer mean the same

    def scope(self) -> Optional[CPScope]:
        """The scope of this call: ``group=`` if given, else the runtime scope, else the build-time one."""
        if self.group is not _UNSET:
            return scope_for(self.group)
        return runtime_scope_or(self.build)  # type: ignore[arg-type]  # a checked read, once per forward


def _dpa_build_scope(module: nn.Module) -> Optional[CPScope]:
    """The build-time CP of a TE attention module, captured now: its own group if it was built with one, else the
    process-wide build-time group — never a runtime binding active now.

    Raises ``ValueError`` when both are CP > 1 and differ (which would be the model's static CP is ambiguous).
    """
    own = module.cp_group
    process = build_time_scope()
    if own is None:
        return process
    if isinstance(own, torch.distributed.ProcessGroup):
        own_scope = scope_for(own)
        if own_scope.is_cp1:
            return process
        if not process.is_cp1 and process.group is not own:
            raise ValueError(
                f"{type(module).__name__} was built with a CP group of size {own_scope.size} but the build-time "
                f"group is another one ({process!r}); build TE modules without CP (cp_group=None) and let cpscope "
                "bind the group, or make the two the same"
            )
        return own_scope
    # Not a single process group (TE's a2a+p2p pair, a test stand-in): the module's own settings are its build-time
    # CP; cpscope cannot also apply another build-time group.
    if not process.is_cp1:
        raise ValueError(
            f"{type(module).__name__} was built with cp_group={own!r} (not a single ProcessGroup) while the build-time "
            f"group is {process!r}; build TE modules without CP (cp_group=None) and let cpscope bind the group"
        )
    return None


def _mha_build_scope(module: nn.Module) -> Optional[CPScope]:
    """As :func:`_dpa_build_scope` for a MultiheadAttention, which keeps only ``cp_size`` / ``cp_rank``."""
    process = build_time_scope()
    if module.cp_size == 1:
        return process
    if not process.is_cp1 and process.size != module.cp_size:
        raise ValueError(
            f"{type(module).__name__} was built with cp_size={module.cp_size} but the build-time group is "
            f"{process!r}; build TE modules without CP and let cpscope bind the group, or make the two the same"
        )
    return None  # its own (cp_size, cp_rank)


def _prepare(module: nn.Module, call: dict[str, Any], query: Any, cp: int, validate: bool) -> None:
    """CP > 1: fill TE's ``cu_seqlens_*_padded`` for ``thd`` and check the local shapes against ``cp``."""
    fmt = call.get("qkv_format") or getattr(module, "qkv_format", None)
    if fmt is None:
        return
    check_qkv_format(fmt)
    if fmt == "thd":
        for side in ("q", "kv"):
            cu, padded = f"cu_seqlens_{side}", f"cu_seqlens_{side}_padded"
            if call.get(padded) is None and call.get(cu) is not None:
                call[padded] = call[cu]  # the same object: TE then infers pad_between_seqs=False
        if validate and isinstance(query, torch.Tensor):
            cu = call.get("cu_seqlens_q_padded")
            if cu is None:
                raise ValueError(f"qkv_format='thd' with CP size {cp} needs the global cu_seqlens_q (and cu_seqlens_kv)")
            _check_thd(cu, query.shape[0], cp, "cu_seqlens_q_padded")
    elif validate and isinstance(query, torch.Tensor) and query.dim() >= 2:
        local = query.shape[1] if fmt == "bshd" else query.shape[0]
        check_divisible_seq(local * cp, cp, f"sequence length (local {local} x cp {cp})")


def _scoped_dpa_call(
    module: nn.Module, forward: Callable[..., Any], signature: inspect.Signature, opts: _Options,
    args: tuple, kwargs: dict,
) -> Any:
    """Resolve the scope once, bind it to ``module`` around ``forward(*args, **kwargs)``, restore afterwards."""
    scope = opts.scope()  # read once; TE keeps what backward needs on its ctx
    if scope is None:  # outside every runtime scope, a module built with its own CP: as built
        return forward(*args, **kwargs)
    bound = signature.bind(*args, **kwargs)
    call = bound.arguments
    query = call.get("query_layer")
    if query is None:
        query = call.get("qkv_layer")
    device = query.device if isinstance(query, torch.Tensor) else None
    if scope.size > 1:
        _prepare(module, call, query, scope.size, opts.validate)
    with bind_te_cp(
        module, scope, cp_comm_type=opts.cp_comm_type, stream_provider=opts.stream_provider, device=device, call=call
    ):
        return forward(*bound.args, **bound.kwargs)


class ScopedDotProductAttention(nn.Module):
    """Run a TE ``DotProductAttention`` under the active cpscope scope, per forward (a wrapping module).

    Every forward resolves the scope once (``group=`` given at construction, else the runtime scope bound around
    the call, else the build-time scope captured at construction), binds it to the wrapped module with
    :func:`bind_te_cp`, calls it with the same arguments, and restores the module's build-time CP settings
    afterwards — also when the forward raises. Build TE's module *without* CP; the group comes from the scope.

    Build-time scope (captured in ``__init__``, never a runtime binding active then): the TE module's own
    ``cp_group`` if it was built with one (a group of size > 1), else the process-wide build-time group
    (:func:`cpscope.build_time_cp`). Both set and different: ``ValueError``. A module built with a CP that is not a
    single process group (TE's ``a2a+p2p`` pair) runs as built outside every runtime scope. Arguments are TE's own (``qkv_format``, ``cu_seqlens_q/kv``, ``cu_seqlens_*_padded``, …) and pass through;
    under CP > 1 with ``thd``, missing ``cu_seqlens_*_padded`` are set to ``cu_seqlens_*`` (cpscope never pads inside
    documents; TE requires them for ``thd`` + CP).

    Inputs are checked before TE runs (``validate=True``): with CP > 1 the local sequence length must be even
    (global length divisible by 2·cp), and in ``thd`` every document of the global ``cu_seqlens`` must be divisible by
    2·cp and the local token count must be ``cu_seqlens[-1] / cp``. (The ``thd`` check copies ``cu_seqlens`` to the
    host once per call.) To convert a whole model in place instead, see :func:`enable_runtime_cp`.

    Args:
        attention: a ``transformer_engine.pytorch.DotProductAttention``.
        cp_comm_type: TE's CP communication type; default the module's own.
        stream_provider: ``provider(device)`` → CUDA stream; default :func:`cpscope.cp_stream`.
        group: a fixed group (``None`` = CP1) instead of the active scope.
        validate: check shapes against the scope before calling TE.

    Example::

        attn = ScopedDotProductAttention(te.DotProductAttention(h, d, qkv_format="thd",
                                                                attn_mask_type="padding_causal"))
        with cpscope.runtime_cp(groups[2]):
            out = attn(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu)   # cu: global, int32, on the GPU
    """

    def __init__(
        self,
        attention: nn.Module,
        *,
        cp_comm_type: Optional[str] = None,
        stream_provider: StreamProvider = cp_stream,
        group: Any = _UNSET,
        validate: bool = True,
    ) -> None:
        super().__init__()
        te_cp_settings(attention)  # fail early on a module of the wrong kind
        self.attention = attention
        build = _dpa_build_scope(attention) if group is _UNSET else None
        self._opts = _Options(check_comm(cp_comm_type), stream_provider, group, validate, build)
        self._signature = inspect.signature(attention.forward)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapped module with TE's own arguments, bound to the scope resolved now (see the class).

        Resolves the scope on every call, also in an activation-checkpoint recompute: wrap a checkpointed function
        that contains this module with ``cpscope.scoped`` (see the module docstring).
        """
        return _scoped_dpa_call(self.attention, self.attention, self._signature, self._opts, args, kwargs)


# ----------------------------------------------------------------------------------------------------------------
# In place: swap the class of every TE attention module of a model (as FSDP2's fully_shard does), so a model
# written for TE needs no change and its state_dict keys stay the same.


class _ScopedDPAMixin(ForwardSignature):
    """Forward of a DotProductAttention bound to the active scope for the call (see :func:`enable_runtime_cp`)."""

    _cpscope_opts: _Options

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _scoped_dpa_call(
            self, super().forward, self._cpscope_signature, self._cpscope_opts, args, kwargs  # type: ignore[misc]
        )


class _ScopedMHAMixin:
    """Forward of a MultiheadAttention whose RoPE uses the active scope's ``cp_size`` / ``cp_rank`` for the call."""

    _cpscope_opts: _Options

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        scope = self._cpscope_opts.scope()
        if scope is None:  # outside every runtime scope, built with its own CP: as built
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        values = {"cp_size": scope.size, "cp_rank": scope.rank}
        return call_with_attributes(self, values, super().forward, *args, **kwargs)  # type: ignore[misc]


def _kind(module: nn.Module) -> Optional[type]:
    if not callable(getattr(module, "set_context_parallel_group", None)):
        return None
    if all(hasattr(module, name) for name in CP_SETTINGS):
        return _ScopedDPAMixin
    if hasattr(module, "cp_size") and hasattr(module, "cp_rank"):
        return _ScopedMHAMixin
    return None


def enable_runtime_cp(
    model: nn.Module,
    *,
    cp_comm_type: Optional[str] = None,
    stream_provider: StreamProvider = cp_stream,
    group: Any = _UNSET,
    validate: bool = True,
) -> list[str]:
    """Make every TransformerEngine attention module inside ``model`` follow the active cpscope scope, in place.

    Each ``DotProductAttention`` (anything with ``set_context_parallel_group`` and the ``cp_group`` … attributes)
    then binds the active group per forward exactly as :class:`ScopedDotProductAttention` does; each
    ``MultiheadAttention`` (``cp_size`` / ``cp_rank`` attributes, used by its fused RoPE) gets the active size and
    rank for the call. Outside every runtime scope each module uses its build-time CP, captured now (never a
    runtime binding active now): its own group / ``cp_size`` if it was built with CP, else the process-wide
    build-time group (see :class:`ScopedDotProductAttention`). Build-time settings are restored after every call,
    also on exceptions. The modules keep their
    parameters and ``state_dict`` keys (only their class is swapped for a subclass, as FSDP2 does, with
    :mod:`cpscope.integrations._swap`); ``copy.deepcopy`` keeps the behaviour; pickling the module object works only
    where its options pickle (a captured scope or process group does not: save ``state_dict``). Calling it again
    updates the options; :func:`disable_runtime_cp` undoes it.

    Args: as :class:`ScopedDotProductAttention`.

    Returns:
        The qualified names of the modules converted.

    Example::

        layer = te.TransformerLayer(1024, 4096, 16, attn_input_format="bshd", self_attn_mask_type="causal")
        enable_runtime_cp(layer)
        with cpscope.runtime_cp(groups[2]):
            y = layer(x_local, rotary_pos_emb=freqs)     # attention and RoPE use the CP2 group
    """
    check_comm(cp_comm_type)
    converted = []
    for name, module in model.named_modules():  # check and capture everything first: fail before changing any
        mixin = _kind(module)
        if mixin is None:
            continue
        build = None
        if group is _UNSET:
            build = _dpa_build_scope(module) if mixin is _ScopedDPAMixin else _mha_build_scope(module)
        converted.append((name, module, mixin, _Options(cp_comm_type, stream_provider, group, validate, build)))
    for name, module, mixin, opts in converted:
        swap_class(module, mixin, _cpscope_opts=opts)
    return [name for name, *_ in converted]


def disable_runtime_cp(model: nn.Module) -> list[str]:
    """Undo :func:`enable_runtime_cp`: restore the original classes; returns the names of the modules restored.

    Example::

        enable_runtime_cp(model)
        ...
        disable_runtime_cp(model)      # the TE modules use their own (build-time) CP settings again
    """
    return unswap_all(model)


def te_apply_rotary_pos_emb(
    t: torch.Tensor, freqs: torch.Tensor, *, qkv_format: str,
    cu_seqlens: Optional[Union[torch.Tensor, Sequence[int]]] = None,
    interleaved: bool = False, fused: bool = True, group: Any = _UNSET,
) -> torch.Tensor:
    """TE's RoPE (fused by default) at the global positions of the local zigzag tokens of the active scope.

    Calls ``transformer_engine.pytorch.attention.rope.apply_rotary_pos_emb`` with ``cp_size`` / ``cp_rank`` of the
    active scope (or ``group=``). ``freqs`` is TE's / cpscope's table ``[max_seqlen, 1, 1, rot_dim]`` covering the
    **global** length; in ``thd``, ``cu_seqlens`` are the global offsets (TE's ``cu_seqlens_padded``), int32.
    Inputs are checked as :func:`cpscope.apply_rotary_pos_emb` checks them, before TE is imported or run.

    Raises:
        ValueError: ``t`` not 4-D (``bshd`` / ``sbhd``) or 3-D (``thd``); ``freqs`` not ``[max_seqlen, 1, 1,
            rot_dim]`` floating point, with ``rot_dim`` odd or larger than the head dimension, or shorter than the
            global length (longest document in ``thd``); ``cu_seqlens`` missing or malformed in ``thd``, or given
            with another layout; shapes inconsistent with the scope.

    Example::

        with cpscope.runtime_cp(groups[2]):
            q = te_apply_rotary_pos_emb(q, freqs, qkv_format="thd", cu_seqlens=cu)
    """
    scope = resolve_scope(group)
    cu = checked_rope_inputs(t, freqs, qkv_format=qkv_format, cu_seqlens=cu_seqlens, cp=scope.size)
    te_apply = te_rope()  # imported after the checks

    return call_te_rope(te_apply, t, freqs, qkv_format=qkv_format, cu_seqlens=cu_seqlens, cu=cu, cp=scope.size,
                        rank=scope.rank, interleaved=interleaved, fused=fused)
