"""One router: which kernel runs a block, decided in one function (:func:`choose`) from one table (:data:`TABLE`).

A block's **kind** (:func:`kind_of`) is its layout (dense / packed) and what it asks beyond plain attention:

================================  ===========================================  =========================================
kind                              routes, in order                             why
================================  ===========================================  =========================================
``dense``                         cudnn (aten), flash (aten), exact            cuDNN attention is what SDPA picks on
                                                                               Hopper
``dense-mla``                     cudnn (aten), flash (padded), exact          cuDNN takes a v head dim of its own
``dense-window``                  cudnn (graph), flash, flex, exact            a band the graph runs as one kernel
``dense-window-split``            flash, flex, exact                           two cuDNN kernels failed parity (H200)
``dense-softcap``                 cudnn (graph), flex, exact                   flash-attention-2 has no softcap
``dense-softcap-split``           flex, exact                                  as ``dense-window-split``
``packed``                        cudnn (graph), flash (varlen), exact         cuDNN's ragged kernels where installed
``packed-mla``                    cudnn (graph), flash (padded), exact
``packed-window``                 cudnn (graph), flash, flex, exact
``packed-softcap-window``         cudnn (graph), flex, exact                   a left-bounded band over equal offsets
``packed-softcap``                flex, exact                                  other packed softcaps failed parity
================================  ===========================================  =========================================

A route is taken when it is **available** for the block (:func:`available_routes`: ``cudnn`` needs CUDA and, for
graphs, the cuDNN frontend, and the :class:`~cpscope.attention.KernelPolicy` allowing it; ``flash``
needs CUDA; ``flex`` (FlexAttention's compiled kernels, :mod:`.flex`) needs CUDA — or the policy's
``flex="first"``, which also puts it first in its rows — and a torch that has it; ``exact`` runs anywhere) and has
not been **refused**: a graph that cuDNN refuses to build
(:class:`~cpscope.attention._kernels.cudnn_frontend.GraphUnsupported`, raised before any kernel runs), or a block
FlexAttention cannot compile (:class:`~cpscope.attention._kernels.flex.FlexUnsupported`), sends that kind
of block (per direction, dtype, head dims, heads and device) to the next route for the rest of the process, with one
warning; :func:`fallbacks` lists what fell back and why.

**Deferred builds** (the policy's ``defer_builds``, off by default): a packed block whose cuDNN graph is new runs on
its row's next route where that is flash-attention-2, for this call only and with no refusal recorded; the graph
is built when its key comes back (:mod:`.deferral`).

:func:`run_whole` runs a call that is one block (CP1, nothing to merge) through the chosen kernel's own autograd
where it has one (``flex``): the kernel's forward and backward, nothing recomputed.

:func:`routing_table` says, for each kind, the route it takes on a device and why (``python -m cpscope env``).

Example::

    choose(q, k, v, causal=True, varlen=None, window=(4095, 0), softcap=None)     # 'cudnn' on an H100, 'exact' on CPU
    routing_table(torch.device("cuda", 0))["packed-softcap"]                      # ('exact', 'the table ...')

**Dtypes.** A route is taken only where its kernels take the inputs' dtype (:data:`DTYPES`, :func:`routes_for`):
cuDNN and flash take fp16 / bf16; ``efficient`` (aten's memory-efficient kernels, needs CUDA) is fp32's, listed
before ``exact`` by the plain kinds (``dense``, ``dense-mla``, ``packed``, ``packed-mla``); FlexAttention takes fp32
too; the exact math any floating dtype. So fp16 runs where bf16 does, fp32 on the memory-efficient kernels, or on
FlexAttention or the exact math where a window or softcap is asked for, fp64 on the exact math.
"""
from __future__ import annotations

import logging
import threading
import traceback
from typing import Any, NamedTuple, Optional

import torch

from .._mods import Band
from . import aten, cudnn_dense, cudnn_frontend, cudnn_thd, deferral, exact, flex
from .aten import Kernel
from .block import Placeholders, Varlen, Window
from .._policy import KernelPolicy, kernel_policy

__all__ = ["ROUTES", "TABLE", "kind_of", "Caps", "caps_of", "available_routes", "choose", "fallbacks",
           "routing_table", "block_forward", "block_backward", "run_whole"]

log = logging.getLogger(__name__)

ROUTES = ("cudnn", "flash", "efficient", "flex", "exact")
TABLE: dict[str, tuple[str, ...]] = {
    "dense": ("cudnn", "flash", "efficient", "exact"),
    "dense-mla": ("cudnn", "flash", "efficient", "exact"),
    "dense-window": ("cudnn", "flash", "flex", "exact"),
    "dense-window-split": ("flash", "flex", "exact"),
    "dense-softcap": ("cudnn", "flex", "exact"),
    "dense-softcap-split": ("flex", "exact"),
    "packed": ("cudnn", "flash", "efficient", "exact"),
    "packed-mla": ("cudnn", "flash", "efficient", "exact"),
    "packed-window": ("cudnn", "flash", "flex", "exact"),
    "packed-softcap-window": ("cudnn", "flex", "exact"),
    "packed-softcap": ("flex", "exact"),
}

_EXACT = Kernel("exact tiled math", lambda *a: exact.forward(*a[:8]), lambda *a: exact.backward(*a[:11]))
_CUDNN_DENSE = Kernel("cuDNN frontend dense graph",
                      lambda q, k, v, s, c, vl, w, sc, ph: cudnn_dense.forward(q, k, v, scale=s, causal=c, window=w,
                                                                               softcap=sc),
                      lambda do, q, k, v, o, l, s, c, vl, w, sc, ph: cudnn_dense.backward(
                          do, q, k, v, o, l, scale=s, causal=c, window=w, softcap=sc))


def _thd(defer: bool) -> Kernel:  # defer: a new graph key raises deferral.BuildDeferred instead of building
    return Kernel("cuDNN frontend ragged graph",
                  lambda q, k, v, s, c, vl, w, sc, ph: cudnn_thd.forward(q, k, v, vl, scale=s, causal=c, window=w,
                                                                         softcap=sc, defer=defer),
                  lambda do, q, k, v, o, l, s, c, vl, w, sc, ph: cudnn_thd.backward(
                      do, q, k, v, o, l, vl, scale=s, causal=c, window=w, softcap=sc, defer=defer))


_CUDNN_THD, _CUDNN_THD_DEFERRING = _thd(False), _thd(True)
_FLEX = Kernel("FlexAttention (compiled, block mask + score modifier)", lambda *a: flex.forward(*a[:8]),
               lambda *a: flex.backward(*a[:11]))
_REFUSABLE = (_CUDNN_DENSE, _CUDNN_THD, _CUDNN_THD_DEFERRING, _FLEX)  # may refuse a block before running it


def _kernel(route: str, kind: str) -> Kernel:
    """The kernel of ``route`` for blocks of ``kind``."""
    if route == "exact":
        return _EXACT
    if route == "flex":
        return _FLEX
    if route == "cudnn":
        if kind in ("dense", "dense-mla"):
            return aten.SDPA_CUDNN
        return _CUDNN_DENSE if kind.startswith("dense") else _CUDNN_THD
    if route == "flash":
        return {"dense": aten.SDPA_FLASH, "packed": aten.FLASH_VARLEN}.get(kind, aten.FLASH)
    if route == "efficient":
        return aten.EFFICIENT
    raise ValueError(f"route {route!r} has no kernel for {kind!r} blocks")


_HALF = (torch.float16, torch.bfloat16)
# The input dtypes each route's kernels take (a route not listed takes any). ``efficient`` is fp32's: half precision
# always has cuDNN or flash before it where it has CUDA at all.
DTYPES: dict[str, tuple[torch.dtype, ...]] = {
    "cudnn": _HALF,
    "flash": _HALF,
    "efficient": (torch.float32,),
    "flex": (torch.float32, *_HALF),
    "exact": (torch.float64, torch.float32, *_HALF),
}


def _dtype_why_not(route: str, dtype: Optional[torch.dtype]) -> Optional[str]:
    """Why ``route``'s kernels cannot take ``dtype`` inputs (``None``: they can, or the dtype is not known)."""
    takes = DTYPES.get(route)
    if dtype is None or takes is None or dtype in takes:
        return None
    return f"takes {', '.join(str(t).replace('torch.', '') for t in takes)}, not {str(dtype).replace('torch.', '')}"


def routes_for(kind: str, caps: "Caps", dtype: torch.dtype, policy: Optional[KernelPolicy] = None) -> list[str]:
    """:func:`available_routes` of ``kind`` whose kernels take ``dtype`` inputs, in the table's order.

    Example::

        routes_for("dense", Caps(cuda=True, frontend=True), torch.float32)      # ['efficient', 'exact']
    """
    return [r for r in available_routes(kind, caps, policy) if _dtype_why_not(r, dtype) is None]


def kind_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, varlen: Optional[Varlen],
            window: Window, softcap: Optional[float]) -> str:
    """The row of :data:`TABLE` a block belongs to (see the module docstring)."""
    layout = "dense" if varlen is None else "packed"
    if window is None and softcap is None:
        return layout if v.shape[-1] == q.shape[-1] else layout + "-mla"
    if varlen is None:
        split = len(cudnn_dense.pieces(q.shape[1], k.shape[1], causal, window)) > 1
        return ("dense-softcap" if softcap is not None else "dense-window") + ("-split" if split else "")
    if softcap is None:
        return "packed-window"
    band = Band.of(causal, window)
    same = varlen.cu_q is varlen.cu_k or (varlen.cu_q_host is not None and varlen.cu_q_host == varlen.cu_k_host)
    return "packed-softcap-window" if band is not None and band.left != -1 and same else "packed-softcap"


class Caps(NamedTuple):
    """What a device offers the routes: CUDA kernels (aten's), the cuDNN frontend's graphs, FlexAttention (this
    torch's)."""

    cuda: bool
    frontend: bool
    flex: bool = True


def caps_of(device: torch.device) -> Caps:
    """The :class:`Caps` of ``device`` in this process."""
    return Caps(device.type == "cuda", cudnn_frontend.available(device), flex.available())


def _why_not(route: str, kind: str, caps: Caps, policy: KernelPolicy) -> Optional[str]:
    """Why ``route`` cannot take ``kind`` blocks here (``None``: it can); raises where the policy demands a route
    this process lacks."""
    if route == "exact":
        return None
    if route == "efficient":  # aten's memory-efficient kernels (fp32's, see DTYPES)
        return None if caps.cuda else "not a CUDA device"
    if route == "flash":
        return None if caps.cuda else "not a CUDA device"
    if route == "flex":
        if policy.flex == "off":
            return "policy flex='off'"
        if not caps.flex:
            return "no FlexAttention in this torch"
        return None if caps.cuda or policy.flex == "first" else "not a CUDA device (its kernels compile for CUDA)"
    if route != "cudnn":
        return f"no {route} kernel"
    if kind.startswith("dense"):
        if not policy.dense_cudnn:
            return "policy dense_cudnn=False"
        if kind in ("dense", "dense-mla"):
            return None if caps.cuda else "not a CUDA device"
        return None if caps.frontend else "no cuDNN frontend here (nvidia-cudnn-frontend, cuDNN >= 9.6, sm90+)"
    if policy.varlen == "flash":
        return "policy varlen='flash'"
    if not caps.frontend:
        if policy.varlen == "cudnn" and caps.cuda:
            raise RuntimeError("varlen kernel 'cudnn' requested but the cuDNN frontend / cuDNN >= 9.6 / sm90 is "
                               "missing")
        return "no cuDNN frontend here (nvidia-cudnn-frontend, cuDNN >= 9.6, sm90+)"
    return None


def available_routes(kind: str, caps: Caps, policy: Optional[KernelPolicy] = None) -> list[str]:
    """The routes of ``kind``'s row that ``caps`` and the policy allow, in the table's order."""
    pol = policy if policy is not None else kernel_policy()
    return [r for r in _row(kind, pol) if _why_not(r, kind, caps, pol) is None]


def _row(kind: str, policy: KernelPolicy) -> tuple[str, ...]:
    """``kind``'s row of the table, ``flex`` first under the policy's ``flex="first"``."""
    routes = TABLE[kind]
    if policy.flex == "first" and "flex" in routes:
        return ("flex",) + tuple(r for r in routes if r != "flex")
    return routes


# ---- refused graphs --------------------------------------------------------------------------------------------

_lock = threading.Lock()
_REFUSED: dict[tuple, str] = {}  # (route, kind, direction, dtype, head dims, heads, device) -> why


def fallbacks() -> dict[tuple, str]:
    """The kinds of block whose route refused them in this process (cuDNN, FlexAttention), with the reason (a
    copy)."""
    with _lock:
        return dict(_REFUSED)


def _refusal_key(route: str, kind: str, direction: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    return (direction, route, kind, q.dtype, q.shape[-1], v.shape[-1], q.shape[-2], k.shape[-2], q.device)


def _refuse(key: tuple, err: Exception) -> None:
    with _lock:
        _REFUSED[key] = str(err)[:500]
    log.warning("%s refused a %s %s block (%s); this kind of block runs on the next route from now on",
                "FlexAttention" if key[1] == "flex" else "cuDNN", key[2], key[0], err)


def _drop_frames(err: BaseException) -> None:
    """Free what a caught refusal's traceback holds (the finished frames' locals: the block's tensors, the graph
    being built) once the refusal is recorded, so that nothing of the failed attempt outlives it — whoever keeps the
    exception (a debugger, a logging handler)."""
    traceback.clear_frames(err.__traceback__)
    err.__traceback__ = None
    err.__context__ = err.__cause__ = None


def choose(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, varlen: Optional[Varlen],
           window: Window, softcap: Optional[float], direction: str = "forward",
           caps: Optional[Caps] = None) -> str:
    """The route that runs this block: the first of its kind's row that is available and not refused."""
    kind = kind_of(q, k, v, causal=causal, varlen=varlen, window=window, softcap=softcap)
    return _choose(kind, direction, q, k, v, caps if caps is not None else caps_of(q.device))


def _choose(kind: str, direction: str, q, k, v, caps: Caps) -> str:
    for route in routes_for(kind, caps, q.dtype):
        if _refusal_key(route, kind, direction, q, k, v) not in _REFUSED:
            return route
    return "exact"


def _run(direction: str, args: tuple, q, k, v, causal, varlen, window, softcap, scale, placeholders):
    kind = kind_of(q, k, v, causal=causal, varlen=varlen, window=window, softcap=softcap)
    caps = caps_of(q.device)
    rest = (scale, causal, varlen, window, softcap, placeholders)
    while True:
        route = _choose(kind, direction, q, k, v, caps)
        kern = _kernel(route, kind)
        later = None  # where the block runs if its graph's build is deferred (the policy's defer_builds)
        if kern is _CUDNN_THD and (pol := kernel_policy()).defer_builds and pol.varlen == "auto":
            later = deferral.target([r for r in routes_for(kind, caps, q.dtype, pol)
                                     if _refusal_key(r, kind, direction, q, k, v) not in _REFUSED])
            kern = _CUDNN_THD_DEFERRING if later is not None else kern
        try:
            return (kern.forward if direction == "forward" else kern.backward)(*args, *rest)
        except deferral.BuildDeferred as e:  # a new graph key: this call only on the next route, no refusal
            _drop_frames(e)
        except (cudnn_frontend.GraphUnsupported, flex.FlexUnsupported) as e:
            if kern not in _REFUSABLE:
                raise
            _refuse(_refusal_key(route, kind, direction, q, k, v), e)
            _drop_frames(e)
            continue
        kern = _kernel(later, kind)
        return (kern.forward if direction == "forward" else kern.backward)(*args, *rest)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool,
                  varlen: Optional[Varlen] = None, window: Window = None, softcap: Optional[float] = None,
                  placeholders: Optional[Placeholders] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one block: ``(out, lse)``; ``out`` has ``q``'s dtype and ``v``'s head dim, ``lse`` is fp32 (fp64
    for fp64 inputs).

    ``causal=True`` uses flash-attention's bottom-right alignment (query ``i`` of ``n_q`` sees key ``j`` of ``n_k``
    when ``j - n_k <= i - n_q``); ``window=(left, right)`` (``-1``: unbounded) keeps key ``j`` iff
    ``-left <= j - (i + n_k - n_q) <= right`` (``right`` is 0 when ``causal``), per sequence in packed blocks.
    ``softcap``: the scaled scores ``s`` become ``softcap * tanh(s / softcap)`` before masking. Fully masked rows
    give ``out = 0`` and ``lse = -inf``. Grouped-query attention: ``h`` a multiple of ``h_kv``. ``placeholders``:
    the call's :class:`~cpscope.attention._kernels.block.Placeholders` (dense CUDA blocks' backward needs them).

    Example::

        out, lse = block_forward(q, k, v, scale=0.125, causal=True, window=(255, 0), softcap=50.0)
    """
    return _run("forward", (q, k, v), q, k, v, causal, varlen, window, softcap, scale, placeholders)


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, *, scale: float, causal: bool, varlen: Optional[Varlen] = None,
                   window: Window = None, softcap: Optional[float] = None,
                   placeholders: Optional[Placeholders] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` of one block given the **final** (merged) ``out`` and ``lse`` of its queries.

    With the merged statistics, ``p = exp(s - lse)`` is this block's share of the full softmax, so the per-block
    gradients add up to the full gradients (the ring-attention identity) — also when the final ``lse`` holds terms
    no block computed (attention sinks). Other arguments as :func:`block_forward`'s.
    """
    return _run("backward", (dout, q, k, v, out, lse), q, k, v, causal, varlen, window, softcap, scale, placeholders)


def run_whole(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool,
              varlen: Optional[Varlen] = None, window: Window = None, softcap: Optional[float] = None,
              sinks: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """A call that is one block (CP1: nothing to merge; ``sinks`` ``[h]`` optional) through its kernel's own
    autograd: the differentiable output when the router picks a kernel that has one (``flex``) for both directions,
    else ``None`` (the caller runs :func:`block_forward` / :func:`block_backward` in its own autograd function).

    Example::

        out = run_whole(q, k, v, scale=0.125, causal=True, window=(4095, 0), softcap=50.0)
        if out is None:
            ...                                      # the ring's Function around block_forward / block_backward
    """
    kind = kind_of(q, k, v, causal=causal, varlen=varlen, window=window, softcap=softcap)
    if "flex" not in _row(kind, kernel_policy()):  # plain blocks: no row offers flex (host time, every CP1 call)
        return None
    caps = caps_of(q.device)
    if any(_choose(kind, d, q, k, v, caps) != "flex" for d in ("forward", "backward")):
        return None
    try:
        return flex.attend(q, k, v, scale=scale, causal=causal, varlen=varlen, window=window, softcap=softcap,
                           sinks=sinks)
    except flex.FlexUnsupported as e:
        for d in ("forward", "backward"):
            _refuse(_refusal_key("flex", kind, d, q, k, v), e)
        return None


# ---- what routes where, on this machine -------------------------------------------------------------------------

def routing_table(device: Any = None, dtype: torch.dtype = torch.bfloat16) -> dict[str, tuple[str, str]]:
    """For each kind of block (:data:`TABLE`), the route it takes on ``device`` (default: the current CUDA device,
    else the CPU) and why: the kernel, and the routes before it that were skipped with their reasons (``dtype``: the
    inputs' dtype — routes whose kernels do not take it are skipped, and graphs cuDNN refused earlier for it).
    Builds no graph and runs no kernel.

    Example::

        for kind, (route, why) in routing_table().items():
            print(f"{kind:24} {route:6} {why}")
        routing_table("cuda", torch.float32)["dense"]      # ('efficient', 'aten memory-efficient attention (...)')
    """
    dev = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    caps, pol, out = caps_of(dev), kernel_policy(), {}
    refused = {(key[1], key[2]): why for key, why in fallbacks().items() if key[3] == dtype and key[-1] == dev}
    for kind in TABLE:
        skipped = []
        for route in _row(kind, pol):
            try:
                why = _dtype_why_not(route, dtype) or _why_not(route, kind, caps, pol)
            except RuntimeError as e:
                why = str(e)
            if why is None and (route, kind) in refused:
                why = f"refused earlier: {refused[(route, kind)][:120]}"
            if why is None:
                out[kind] = (route, _kernel(route, kind).name + (f" (skipped {'; '.join(skipped)})" if skipped else ""))
                break
            skipped.append(f"{route}: {why}")
    return out
