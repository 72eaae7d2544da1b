"""The cuDNN frontend in one place: the ``cudnn`` module, whether a device can use it, handles and streams, one cache
of built graphs, and the helpers both graph families build with (packed: :mod:`.cudnn_thd`; dense:
:mod:`.cudnn_dense`).

Why cpscope builds graphs itself: PyTorch's own cuDNN entries either rebuild their graph on every call (the ragged
one) or have no band and no score modifier (the dense one). A built graph is cached under a key that each family
derives from its shapes, strides, dtype, band, softcap, scale and device; a build is paid once, a cached call adds
little host time (figures: ``docs/attention_kernels.md`` §3).

A graph the frontend refuses to build raises :class:`GraphUnsupported` — before any kernel ran, and without the
frontend's exception, whose frames would hold the block — so that the router (:mod:`.router`) sends that kind of
block to its next route. Every build runs on a short-lived thread of its own (:func:`cached`), from a build function
that reads shapes (:class:`Spec`), never the call's tensors: the frontend keeps an exception it caught while
choosing plans in a local of its own frame (a reference cycle through that frame), and a frame keeps its callers'
frames — on the calling thread, the whole step's activations until Python's cyclic collector runs (gigabytes;
``docs/attention_kernels.md`` §3). On the builder thread that cycle holds nothing of the
call. At interpreter exit the cached graphs are dropped and the handles destroyed while the
frontend still works (no nanobind leak warnings).

Executing: the frontend's mapping form of ``execute`` validates every binding in Python on every call; its ordered
form (``tensor_uids=``, frontend >= 1.30) caches that per graph and is used where available
(:attr:`~cpscope.attention.KernelPolicy.ordered_execute`), also with host scalars
(:attr:`~cpscope.attention.KernelPolicy.fixed_form`).

Needs ``nvidia-cudnn-frontend`` (``pip install nvidia-cudnn-frontend``; the ``cudnn`` Python module), cuDNN >= 9.6
and an sm90+ GPU; :func:`available` says whether this process has them.

Example::

    if available(q.device):
        g = new_graph(module(), q.dtype, q.device)
        ...                                         # declare tensors, sdpa, outputs
        built = cached(key, lambda: finish(module(), g, named), q.device)
        built.run(q.device, {"q": q, ...})
"""
from __future__ import annotations

import atexit
import functools
import gc
import inspect
import logging
import threading
import time
import traceback
from collections import OrderedDict
from typing import Any, Callable, NamedTuple, Optional

import torch

from ..._tensor_cache import register_clear
from .._policy import kernel_policy

log = logging.getLogger(__name__)

__all__ = ["module", "available", "version", "clear_cache", "handle", "stream", "GraphUnsupported", "Built", "Spec", "cached",
           "cached_graphs", "has_graph", "new_graph", "finish", "io_type", "tensor", "column", "pow2"]

MIN_CUDNN = 90600
CACHE_SIZE = 256  # graphs; one microbatch shape needs ~6-8 (forward/backward x diagonal pieces, half blocks)
_lock = threading.Lock()
_graphs: "OrderedDict[tuple, Built]" = OrderedDict()
_handles: dict = {}


@functools.lru_cache(maxsize=None)
def module() -> Optional[Any]:
    """The ``cudnn`` Python module, or ``None`` when it is not importable."""
    try:
        import cudnn  # nvidia-cudnn-frontend
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        log.info("cuDNN frontend unavailable (%s: %s); blocks use PyTorch's kernels", type(e).__name__, e)
        return None
    return cudnn


@functools.lru_cache(maxsize=None)
def _device_ok(index: int) -> bool:
    cudnn = module()
    if cudnn is None or torch.cuda.get_device_capability(index)[0] < 9:
        return False
    try:
        return int(cudnn.backend_version()) >= MIN_CUDNN
    except Exception:  # noqa: BLE001
        return False


def available(device: torch.device) -> bool:
    """Whether blocks on ``device`` can run on the frontend's graphs (importable, cuDNN >= 9.6, sm90+)."""
    return device.type == "cuda" and _device_ok(device.index if device.index is not None else torch.cuda.current_device())


def version() -> Optional[int]:
    """cuDNN's backend version as the frontend reports it (e.g. 91900), or ``None`` without the frontend."""
    cudnn = module()
    try:
        return None if cudnn is None else int(cudnn.backend_version())
    except Exception:  # noqa: BLE001
        return None


@register_clear  # cpscope.clear_caches() drops the graphs too
def clear_cache() -> None:
    """Drop the cached cuDNN graphs (they are rebuilt on demand)."""
    with _lock:
        _graphs.clear()


def _release_at_exit() -> None:
    """At interpreter exit: drop the cached graphs and destroy this process's handles while the frontend still
    works, so that no frontend object is alive when its extension is torn down (nanobind prints "leaked instances"
    warnings for those). Does nothing in a process that never built a graph."""
    with _lock:
        graphs, handles = list(_graphs.values()), dict(_handles)
        _graphs.clear()
        _handles.clear()
    if not graphs and not handles:
        return
    del graphs
    gc.collect()  # graphs in reference cycles (a graph keeps its score modifier's Python callables)
    cudnn = module()
    for idx, h in handles.items():
        try:
            with torch.cuda.device(idx):
                cudnn.destroy_handle(h)
        except Exception:  # noqa: BLE001 - CUDA may be torn down already at exit
            log.debug("cuDNN handle of device %s not destroyed at exit", idx, exc_info=True)


atexit.register(_release_at_exit)


def cached_graphs() -> list[tuple]:
    """The keys of the cached graphs, oldest first (tests and benchmarks count them)."""
    with _lock:
        return list(_graphs)


def has_graph(key: tuple) -> bool:
    """Whether a graph is cached under ``key`` (nothing is built; :mod:`.deferral` asks)."""
    with _lock:
        return key in _graphs


def pow2(n: int, lo: int = 64) -> int:
    """``n`` rounded up to a power of two, at least ``lo`` (graph keys of similar shapes coincide)."""
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


def stream(device: torch.device) -> int:
    """The current CUDA stream of ``device``, as the frontend takes it."""
    return torch.cuda.current_stream(device).cuda_stream


def handle(device: torch.device) -> Any:
    """This process's cuDNN handle for ``device`` (one per device, made on first use)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    h = _handles.get(idx)
    if h is None:
        with torch.cuda.device(idx):
            h = module().create_handle()
        _handles[idx] = h
    return h


def io_type(cudnn: Any, dtype: torch.dtype) -> Any:
    """The frontend's data type of ``dtype`` (fp16 / bf16); ``ValueError`` for any other."""
    if dtype == torch.bfloat16:
        return cudnn.data_type.BFLOAT16
    if dtype == torch.float16:
        return cudnn.data_type.HALF
    raise ValueError(f"cuDNN attention supports fp16/bf16, got {dtype}")


class GraphUnsupported(RuntimeError):
    """cuDNN (or its frontend) refused to build a graph; raised before any kernel ran, so another kernel may take
    the block (see :mod:`cpscope.attention._kernels.router`)."""


class Built:
    """A built cuDNN graph, its tensors' uids by role, its workspace size, and the host tensors bound at every execute
    (``fixed``: pass-by-value scalars of a score modifier); ``extras``: device tensors a family binds as well."""

    def __init__(self, graph: Any, uids: dict, workspace: int, fixed: Optional[dict] = None) -> None:
        self.graph, self.uids, self.workspace, self.fixed = graph, uids, workspace, dict(fixed or {})
        self.names = tuple(uids)
        self.order = tuple(uids[n] for n in self.names)
        self.extras: dict = {}
        pol = kernel_policy()
        self.ordered = pol.ordered_execute and _takes_tensor_uids(graph) and (
            not self.fixed or pol.fixed_form == "ordered")

    def run(self, device: torch.device, tensors: dict) -> None:
        """Execute on ``device``'s current stream with ``tensors`` bound by role."""
        cudnn = module()
        h = handle(device)
        cudnn.set_stream(handle=h, stream=stream(device))
        ws = torch.empty(self.workspace, dtype=torch.uint8, device=device) if self.workspace else None
        if self.fixed:
            tensors = {**tensors, **self.fixed}
        if self.ordered:
            self.graph.execute(tuple(tensors[n] for n in self.names), ws, handle=h, tensor_uids=self.order)
        elif self.fixed:
            self.graph.execute({self.uids[name]: t for name, t in tensors.items()}, ws, handle=h)
        else:
            pack = {self.uids[name]: t.data_ptr() for name, t in tensors.items()}
            self.graph.execute(pack, ws.data_ptr() if ws is not None else 0, handle=h)


class Spec(NamedTuple):
    """What a graph declares of a tensor: its shape and strides (``Spec.of(t)``; ``.stride()`` as a tensor's). Build
    functions read these, so that a build holds no tensor of the call (see :func:`cached`)."""

    shape: tuple
    strides: tuple

    @classmethod
    def of(cls, t: torch.Tensor) -> "Spec":
        return cls(tuple(t.shape), tuple(t.stride()))

    def stride(self) -> tuple:
        return self.strides


def _build_apart(build: Callable[[], Built], device: Any) -> tuple[Optional[Built], Optional[str]]:
    """``(build(), None)``, or ``(None, why)`` if it raised — run on a thread of its own, so that any reference cycle
    the frontend leaves through its frames reaches the builder's frames only, never the caller's (whose locals are
    the step's activations). The refusal comes back as text: the exception, its traceback cleared, stays behind."""
    box: list = [None, None]

    def work() -> None:
        try:
            if getattr(device, "type", None) == "cuda":
                with torch.cuda.device(device):
                    box[0] = build()
            else:
                box[0] = build()
        except Exception as e:  # noqa: BLE001 - the frontend raises many types; none of them ran a kernel
            box[1] = f"{type(e).__name__}: {str(e)[:2000]}"
            traceback.clear_frames(e.__traceback__)

    t = threading.Thread(target=work, name="cpscope-cudnn-build", daemon=True)
    t.start()
    t.join()
    if box[1] is not None:  # a refused graph is garbage in the frontend's cycle (with its host scalars): collect it
        gc.collect()  # now — refusals are remembered per kind of block (router), so this runs a few times at most
    return box[0], box[1]


def cached(key: tuple, build: Callable[[], Built], device: Optional[torch.device] = None) -> Built:
    """The graph cached under ``key``, built by ``build()`` on a miss (:class:`GraphUnsupported` if refused).

    ``build`` runs on a builder thread (:func:`_build_apart`; with ``device`` current there) and must read no
    tensor of the call: declare the graph from :class:`Spec` values (the frontend can leave a reference cycle
    through the build's frames)."""
    with _lock:
        g = _graphs.get(key)
        if g is not None:
            _graphs.move_to_end(key)
            return g
    t0 = time.perf_counter()
    g, why = _build_apart(build, device)
    if why is not None:
        raise GraphUnsupported(f"cuDNN graph {key[:1]} not built: {why}")
    log.debug("cuDNN attention graph %s built in %.0f ms", key[:8], 1e3 * (time.perf_counter() - t0))
    with _lock:
        _graphs[key] = g
        while len(_graphs) > CACHE_SIZE:
            _graphs.popitem(last=False)
    return g


def _takes_tensor_uids(graph: Any) -> bool:
    try:
        return "tensor_uids" in inspect.signature(graph.execute).parameters
    except (TypeError, ValueError):  # a pybind method without a Python signature (older frontends)
        return False


def new_graph(cudnn: Any, dtype: torch.dtype, device: torch.device) -> Any:
    """An empty SDPA graph for ``dtype`` inputs (fp32 intermediates and compute) on ``device``'s handle."""
    return cudnn.pygraph(io_data_type=io_type(cudnn, dtype), intermediate_data_type=cudnn.data_type.FLOAT,
                         compute_data_type=cudnn.data_type.FLOAT, handle=handle(device))


def finish(cudnn: Any, graph: Any, named: dict, fixed: Optional[dict] = None) -> Built:
    """Validate and build ``graph``; ``named``: its tensors by role (their uids bind them at execute)."""
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return Built(graph, {name: t.get_uid() for name, t in named.items()}, int(graph.get_workspace_size()), fixed)


def tensor(graph: Any, dims: list, strides: list, dtype: Any, offset: Any = None, name: str = "") -> Any:
    """A graph input with ``dims`` / ``strides`` and, for ragged tensors, its ``offset`` tensor."""
    t = graph.tensor(name=name, dim=dims, stride=strides, data_type=dtype)
    if offset is not None:
        t.set_ragged_offset(offset)
    return t


def column(graph: Any, n: int, dtype: Any, name: str) -> Any:
    """A ``[n, 1, 1, 1]`` graph input (per-sequence lengths and offsets, score-modifier bounds)."""
    return graph.tensor(name=name, dim=[n, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dtype)
