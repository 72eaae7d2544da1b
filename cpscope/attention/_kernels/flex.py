"""FlexAttention as a block kernel: PyTorch's compiled attention (``torch.nn.attention.flex_attention``) with a block
mask built from the block's visible key intervals and a score modifier for the softcap.

Every mask a block has (documents, causal, a window relative to each sequence's bottom-right-aligned diagonal) gives
each query row one contiguous interval of visible keys, ``lo[i] <= j < hi[i]`` in packed key indices (the exact
math's :func:`~cpscope.attention._kernels.exact.key_bounds`). One mask function serves every block, every layout and
every band under CP: it reads the two interval tensors, so a new pack changes tensors, never the compiled code. The
block-sparse structure (which 128 x 128 tiles are visible, which of them entirely) is built from the same intervals
with a few tensor operations — no mask is evaluated over the whole grid, nothing is compiled per pack — and kept
with the pack (:attr:`~cpscope.attention._kernels.block.Varlen.memo`; dense shapes in a small LRU that
:func:`cpscope.clear_caches` empties).

The compiled function is kept per configuration that its compiled code depends on (device, dtype, heads, head dims,
softcap, grouped-query, gradient, whether the log-sum-exp is returned, whether both lengths are multiples of the
128-row tile) — one compiled graph each, which turns dynamic in the sequence lengths at the first new length — so a
stream of new packs compiles nothing more, and no configuration exhausts the compiler's recompile limit of another.
A dynamic graph no longer knows that its lengths divide by the tile, and its kernels would then guard every load and
store at the sequences' ends (``IS_DIVISIBLE=False``; its cost: ``docs/attention_flex.md``); where both
lengths are multiples of :data:`TILE`, the call says so (:data:`DIVISIBLE`), as a static graph at such lengths
would have found. :func:`attend` asks for no log-sum-exp unless sinks need it (FlexAttention's own call).

* :func:`forward` — ``(out, lse)`` of a block (the ring merges through ``lse``);
* :func:`backward` — ``(dq, dk, dv)`` given the block's inputs and the **merged** ``out`` / ``lse`` of its queries:
  the block's own ``(out_b, lse_b)`` are recomputed through FlexAttention's autograd and its backward is seeded with
  ``c * dout`` for ``out_b`` and ``c * (dout . out_b - dout . out)`` for ``lse_b``, ``c = exp(lse_b - lse)``, which
  gives exactly ``p = exp(s - lse)`` and ``ds = p * (dp - dout . out)`` of the merged softmax;
* :func:`attend` — a whole call's attention (one block, nothing to merge; sinks through its log-sum-exp) through
  FlexAttention's own autograd: its forward and backward kernels and nothing else (what a CP1 call runs when the
  router picks flex).

On CUDA the compiled kernels run; on the CPU (tests) FlexAttention's eager math runs the same masks and score
modifier, including the backward (the public CPU entry refuses gradients; the operator underneath it does not).

Example::

    out, lse = forward(q, k, v, 0.125, True, None, window=(4095, 0), softcap=50.0)      # dense [b, s, h, d]
    dq, dk, dv = backward(dout, q, k, v, out, lse, 0.125, True, None, window=(4095, 0), softcap=50.0)
"""
from __future__ import annotations

import functools
import math
import threading
import types
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch

from ..._tensor_cache import register_clear
from .block import Varlen, Window
from . import exact
from .exact import key_bounds

__all__ = ["available", "FlexUnsupported", "forward", "backward", "attend", "block_mask", "clear_cache", "TILE"]

TILE = 128  # FlexAttention's block-sparse tile (query rows x keys)
# The kernel option that tells FlexAttention's compiled kernels that both lengths divide by the tile (no bounds checks
# at the sequences' ends); its lowering takes a given value over the one it derives from static shapes
DIVISIBLE = {"IS_DIVISIBLE": True}
DENSE_MASKS = 32  # block masks of dense blocks kept (by shape and band)
_lock = threading.Lock()
_dense_masks: "OrderedDict[tuple, Any]" = OrderedDict()
_compiled: dict[tuple, Callable[..., Any]] = {}
_score_mods: dict[float, Callable[..., Any]] = {}


class FlexUnsupported(RuntimeError):
    """FlexAttention cannot compile this kind of block here (raised before a kernel ran; the router then sends such
    blocks to their next route)."""


@functools.lru_cache(maxsize=None)
def _api() -> Optional[types.SimpleNamespace]:
    try:
        from torch.nn.attention import flex_attention as fa
        from torch._higher_order_ops.flex_attention import flex_attention as hop
    except ImportError:  # a torch without FlexAttention
        return None
    return types.SimpleNamespace(flex=fa.flex_attention, BlockMask=fa.BlockMask, hop=hop,
                                 aux=getattr(fa, "AuxRequest", None))


def available() -> bool:
    """Whether this torch has FlexAttention."""
    return _api() is not None


@register_clear  # cpscope.clear_caches() drops the compiled functions and the dense block masks
def clear_cache() -> None:
    """Drop the compiled functions, the score modifiers and the dense block masks (packed blocks keep theirs with
    their pack)."""
    with _lock:
        _dense_masks.clear()
        _compiled.clear()
        _score_mods.clear()


# ---- the block mask ---------------------------------------------------------------------------------------------

def _interval_mask(lo: torch.Tensor, hi: torch.Tensor) -> Callable[..., torch.Tensor]:
    """The mask function of every block: key ``kv`` is seen by query ``q`` iff ``lo[q] <= kv < hi[q]``."""
    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx >= lo[q_idx]) & (kv_idx < hi[q_idx])
    return mask_mod


def _build(lo: torch.Tensor, hi: torch.Tensor, t_q: int, t_k: int) -> Any:
    """The BlockMask of query rows that see keys ``[lo[i], hi[i])``: tiles some row sees (through the mask
    function), and among them the tiles every row sees entirely (no mask function)."""
    dev, nq, nk = lo.device, -(-t_q // TILE), max(1, -(-t_k // TILE))
    pad = nq * TILE - t_q  # rows past the end see nothing (lo = hi = 0): the kernels may index them
    lo = torch.nn.functional.pad(lo.to(torch.int32), (0, pad))
    hi = torch.nn.functional.pad(hi.to(torch.int32), (0, pad))
    seen = hi > lo
    # tiles some row of a query tile sees: each row's tiles [lo // T, (hi - 1) // T], summed as a difference array
    first = torch.where(seen, lo // TILE, nk).long().view(nq, TILE)
    stop = torch.where(seen, (hi - 1) // TILE + 1, nk).long().view(nq, TILE)
    diff = torch.zeros(nq, nk + 1, dtype=torch.int32, device=dev)
    ones = torch.ones(nq, TILE, dtype=torch.int32, device=dev)
    diff.scatter_add_(1, first, ones).scatter_add_(1, stop, -ones)
    some = diff.cumsum(1)[:, :nk] > 0
    # tiles every real row of a query tile sees whole: [ceil(lo / T), end) with end = nk where hi reaches t_k
    real = (torch.arange(nq * TILE, device=dev) < t_q).view(nq, TILE)
    start = torch.where(real, (lo + TILE - 1).view(nq, TILE) // TILE, 0).amax(1)
    end_row = torch.where(hi == t_k, nk, hi // TILE).view(nq, TILE)
    end = torch.where(real & seen.view(nq, TILE), end_row, torch.where(real, 0, nk)).amin(1)
    col = torch.arange(nk, device=dev)
    full = (col >= start[:, None]) & (col < end[:, None])
    part = some & ~full

    def indexed(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # counts, the tiles' indices first
        idx = torch.argsort((~m).to(torch.int8), dim=1, stable=True).to(torch.int32)
        return m.sum(1, dtype=torch.int32)[None, None], idx[None, None].contiguous()

    (n_part, i_part), (n_full, i_full) = indexed(part), indexed(full)
    return _api().BlockMask.from_kv_blocks(n_part, i_part, n_full, i_full, BLOCK_SIZE=(TILE, TILE),
                                           mask_mod=_interval_mask(lo, hi), seq_lengths=(t_q, t_k))


def block_mask(t_q: int, t_k: int, causal: bool, vl: Optional[Varlen], window: Window,
               device: torch.device) -> Any:
    """The BlockMask of a block of ``t_q`` query rows against ``t_k`` keys (per batch row for dense blocks): kept
    with the pack for packed blocks, in a small LRU for dense ones."""
    key = ("flex-mask", t_q, t_k, causal, None if window is None else tuple(window), device)
    if vl is not None:
        bm = vl.memo.get(key)
        if bm is None:
            bm = vl.memo[key] = _build(*key_bounds(t_q, t_k, causal, vl, window, device), t_q, t_k)
        return bm
    with _lock:
        bm = _dense_masks.get(key)
        if bm is not None:
            _dense_masks.move_to_end(key)
            return bm
    bm = _build(*key_bounds(t_q, t_k, causal, None, window, device), t_q, t_k)
    with _lock:
        _dense_masks[key] = bm
        while len(_dense_masks) > DENSE_MASKS:
            _dense_masks.popitem(last=False)
    return bm


# ---- the compiled call ------------------------------------------------------------------------------------------

def _score_mod(softcap: Optional[float]) -> Optional[Callable[..., torch.Tensor]]:
    if softcap is None:
        return None
    with _lock:
        mod = _score_mods.get(softcap)
        if mod is None:
            def mod(score, b, h, q_idx, kv_idx):
                return softcap * torch.tanh(score / softcap)
            _score_mods[softcap] = mod
    return mod


def _call_flex(q, k, v, bm, scale, score_mod, gqa, flex_fn, aux, lse, options):
    """FlexAttention (``flex_fn``) with its log-sum-exp (natural log; ``None`` when ``lse`` is false); the function
    each configuration compiles."""
    if not lse:
        out = flex_fn(q, k, v, score_mod=score_mod, block_mask=bm, scale=scale, enable_gqa=gqa,
                      kernel_options=options)
        return out, None
    if aux is not None:
        out, got = flex_fn(q, k, v, score_mod=score_mod, block_mask=bm, scale=scale, enable_gqa=gqa,
                           return_aux=aux(lse=True), kernel_options=options)
        return out, got.lse
    return flex_fn(q, k, v, score_mod=score_mod, block_mask=bm, scale=scale, enable_gqa=gqa, return_lse=True,
                   kernel_options=options)


def _compiled_for(key: tuple) -> Callable[..., Any]:
    """``_call_flex`` compiled for one configuration: a code object of its own, so that each configuration has its
    own compile cache (no configuration's recompiles count against another's limit)."""
    with _lock:
        fn = _compiled.get(key)
        if fn is None:
            code = _call_flex.__code__.replace(co_name=f"_call_flex_{len(_compiled)}")
            fresh = types.FunctionType(code, _call_flex.__globals__, code.co_name)
            fn = _compiled[key] = torch.compile(fresh, fullgraph=True, backend=_BACKEND)
    return fn


_BACKEND = "inductor"  # what compiles the kernels (tests put a graph-inspecting backend here)


def _compiles(device: torch.device) -> bool:
    """Whether FlexAttention's compiled kernels run on ``device`` (CUDA; elsewhere its eager math runs)."""
    return device.type == "cuda"


def _eager(q, k, v, bm, scale, score_mod, gqa):
    """The CPU path: FlexAttention's operator in eager mode (its math), differentiable, lse in natural log."""
    api = _api()
    mod = score_mod if score_mod is not None else _identity
    out, lse2, _ = api.hop(q, k, v, mod, bm.as_tuple(), scale,
                           {"OUTPUT_LOGSUMEXP": True, "OUTPUT_MAX": False, "BACKEND": "AUTO", "PRESCALE_QK": False,
                            "ROWS_GUARANTEED_SAFE": False, "BLOCKS_ARE_CONTIGUOUS": False, "WRITE_DQ": True})
    return out, lse2 * math.log(2.0)


def _identity(score, b, h, q_idx, kv_idx):
    return score


def _run(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, bm: Any, scale: float,
         softcap: Optional[float], lse: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(out, lse)`` of ``[b, h, s, d]`` views through FlexAttention (compiled on CUDA, its eager math elsewhere);
    ``lse`` false: the compiled call returns no log-sum-exp (``None``), as FlexAttention called plainly."""
    gqa, mod = q4.shape[1] != k4.shape[1], _score_mod(softcap)
    if not _compiles(q4.device):
        return _eager(q4, k4, v4, bm, scale, mod, gqa)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q4, k4, v4))
    divisible = q4.shape[2] % TILE == 0 and k4.shape[2] % TILE == 0
    key = (q4.device, q4.dtype, q4.shape[1], k4.shape[1], q4.shape[-1], v4.shape[-1], scale, softcap, grad, lse,
           divisible)
    fn = _compiled_for(key)
    try:
        api = _api()
        return fn(q4, k4, v4, bm, scale, mod, gqa, api.flex, api.aux, lse, DIVISIBLE if divisible else None)
    except (NotImplementedError, torch._dynamo.exc.Unsupported, torch._dynamo.exc.BackendCompilerFailed) as e:
        raise FlexUnsupported(f"FlexAttention cannot compile this block ({type(e).__name__}: {e})") from e


# ---- layouts ----------------------------------------------------------------------------------------------------

def _bhsd(x: torch.Tensor, vl: Optional[Varlen]) -> torch.Tensor:
    """``[b, s, h, d]`` (dense) or ``[t, h, d]`` (packed) as the ``[b, h, s, d]`` view FlexAttention reads."""
    return (x.unsqueeze(0) if vl is not None else x).transpose(1, 2)


def _back(x: torch.Tensor, vl: Optional[Varlen]) -> torch.Tensor:
    x = x.transpose(1, 2)
    return x[0] if vl is not None else x


def _mask_for(q: torch.Tensor, k: torch.Tensor, causal: bool, vl: Optional[Varlen], window: Window) -> Any:
    t_q, t_k = (q.shape[0], k.shape[0]) if vl is not None else (q.shape[1], k.shape[1])
    return block_mask(t_q, t_k, causal, vl, window, q.device)


def _empty(q: torch.Tensor, k: torch.Tensor, vl: Optional[Varlen]) -> bool:
    return q.shape[0 if vl is not None else 1] == 0 or k.shape[0 if vl is not None else 1] == 0


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, vl: Optional[Varlen],
            window: Window = None, softcap: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of one block through FlexAttention; ``lse`` fp32 (fp64 for fp64 inputs), ``-inf`` (and
    ``out`` 0) on rows that see no key. Layouts and masks as :func:`cpscope.attention._kernels.block_forward`."""
    if _empty(q, k, vl):  # no query or no key: nothing for a kernel to do
        return exact.forward(q, k, v, scale, causal, vl, window, softcap)
    bm = _mask_for(q, k, causal, vl, window)
    with torch.no_grad():
        out, lse = _run(_bhsd(q.detach(), vl), _bhsd(k.detach(), vl), _bhsd(v.detach(), vl), bm, scale, softcap)
    return _back(out, vl), (lse[0] if vl is not None else lse)


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, scale: float, causal: bool, vl: Optional[Varlen], window: Window = None,
             softcap: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one block given the merged ``out`` / ``lse`` of its queries (see the module docstring)."""
    if _empty(q, k, vl):
        return exact.backward(dout, q, k, v, out, lse, scale, causal, vl, window, softcap)
    bm = _mask_for(q, k, causal, vl, window)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    with torch.enable_grad():
        ob, lb = _run(_bhsd(qg, vl), _bhsd(kg, vl), _bhsd(vg, vl), bm, scale, softcap)  # [b, h, s, dv], [b, h, s]
    lse4 = (lse.unsqueeze(0) if vl is not None else lse).to(lb.dtype)
    # c = exp(lse_b - lse): this block's share of each row's softmax (0 where the block or the row sees nothing)
    c = torch.where(lb == float("-inf"), 0.0, torch.exp(lb.detach() - lse4))
    c = torch.where(torch.isfinite(lse4), c, 0.0)
    do4 = _bhsd(dout, vl)
    dot_b = (do4.to(lb.dtype) * ob.detach().to(lb.dtype)).sum(-1)
    dot_o = (do4.to(lb.dtype) * _bhsd(out, vl).to(lb.dtype)).sum(-1)
    g_out = (do4.to(lb.dtype) * c.unsqueeze(-1)).to(ob.dtype)
    dq, dk, dv = torch.autograd.grad((ob, lb), (qg, kg, vg), (g_out, c * (dot_b - dot_o)))
    return dq, dk, dv


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool,
           varlen: Optional[Varlen] = None, window: Window = None, softcap: Optional[float] = None,
           sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The attention of one whole block as a differentiable output, through FlexAttention's own autograd (its
    forward and backward kernels, nothing recomputed); masks and layouts as :func:`forward`. ``sinks`` (``[h]``)
    join each row's denominator through the log-sum-exp: ``out * exp(lse - logaddexp(lse, sink))``, differentiable
    in ``sinks`` too (FlexAttention's backward takes the log-sum-exp's gradient).

    Example::

        out = attend(q, k, v, scale=0.125, causal=True, window=(4095, 0), softcap=50.0)    # out.backward(...) works
    """
    bm = _mask_for(q, k, causal, varlen, window)
    out, lse = _run(_bhsd(q, varlen), _bhsd(k, varlen), _bhsd(v, varlen), bm, scale, softcap,
                    lse=sinks is not None)  # [b, h, s, dv]; the log-sum-exp only where sinks need it
    if sinks is not None:
        keep = torch.exp(lse - torch.logaddexp(lse, sinks.to(lse.dtype)[None, :, None]))
        out = (out * keep.unsqueeze(-1)).to(q.dtype)
    return _back(out, varlen)
