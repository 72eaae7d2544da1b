"""Test-only: several gloo ranks sharing one CUDA device, with point-to-point and gather/scatter collectives staged
through host tensors.

gloo moves CUDA tensors only for ``broadcast`` and ``all_reduce``; everything else cpscope's variants post (the
ring's and the halo's ``batch_isend_irecv``, the all-gather / all-to-all variants' ``all_gather_into_tensor`` /
``all_gather_single`` / ``reduce_scatter_*`` / ``all_to_all_single``, the sentinel's ``all_gather``) raises on a
CUDA tensor. Inside :func:`staged`, those functions of ``torch.distributed`` are replaced by ones that copy a CUDA
send buffer to the host on the **current stream** when the op is posted (so the caller's stream hand-offs still
order it: the ring posts on its side stream after an event), run the original op on host tensors (a batch of
point-to-point ops one by one, as gloo does), and copy the received host buffer back into the caller's CUDA tensor
when the caller **waits** (on the stream it waits on). A work object whose wait takes a timeout (the sentinel's)
keeps it.

``stage_cpu=True`` stages CPU tensors the same way (host copies of host tensors), so that CPU tests run this module's
bookkeeping under gloo in CI (``tests/test_gloo_staging.py``) and it cannot rot unseen. :data:`COUNTS` says how
many tensors each op staged (a test checks the shim was really on the path). Module-level aliases of the replaced
functions in ``cpscope.*`` modules (e.g. ``comm._ALL_GATHER``) are replaced too, and everything is restored on exit.

Example::

    with staged():                       # inside a gloo rank whose tensors are on cuda:0
        out = cpscope.context_parallel_attention(q, k, v, group=group, comm="p2p")
"""
from __future__ import annotations

import contextlib
import sys
from collections import Counter
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["staged", "COUNTS", "REPLACED", "ALIASES"]

COUNTS: Counter = Counter()  # op name -> tensors staged, since the last staged() began
ALIASES: list[str] = []  # "module.attr" of the cpscope aliases the last staged() replaced

REPLACED = ("batch_isend_irecv", "isend", "irecv", "send", "recv", "all_gather", "all_gather_into_tensor", "all_gather_single",
            "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single")

_STAGE_CPU = [False]


def _needs(t: torch.Tensor) -> bool:
    return t.is_cuda or _STAGE_CPU[0]


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t`` (made on the current stream, which the copy waits for)."""
    return t.detach().to("cpu", copy=True).contiguous()


def _host_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="cpu")


class _Staged:
    """The original op's work; waiting on it then copies the received host buffers into the caller's tensors."""

    def __init__(self, work: Any, after: Callable[[], None], keep: Any) -> None:
        self._work, self._after, self._keep = work, after, keep

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        if self._work is not None:
            self._work.wait(*args, **kwargs)
        after, self._after, self._keep = self._after, None, None
        if after is not None:
            after()
        return True

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _finish(work: Any, async_op: bool, after: Callable[[], None], keep: Any) -> Any:
    staged_work = _Staged(work, after, keep)
    if async_op:
        return staged_work
    staged_work.wait()
    return None


def _copy_back(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], None]:
    def after() -> None:
        for dst, src in pairs:
            dst.copy_(src)
    return after


def _make(orig: dict[str, Callable]) -> dict[str, Callable]:
    """The staging versions of the functions in ``orig`` (the originals they call)."""

    def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
        if not _needs(tensor):
            return orig["isend"](tensor, dst, group, tag, group_dst=group_dst)
        COUNTS["isend"] += 1
        host = _to_host(tensor)
        return _Staged(orig["isend"](host, dst, group, tag, group_dst=group_dst), lambda: None, host)

    def irecv(tensor, src=None, group=None, tag=0, group_src=None):
        if not _needs(tensor):
            return orig["irecv"](tensor, src, group, tag, group_src=group_src)
        COUNTS["irecv"] += 1
        host = _host_like(tensor)
        return _Staged(orig["irecv"](host, src, group, tag, group_src=group_src), _copy_back([(tensor, host)]), host)

    def send(tensor, dst=None, group=None, tag=0, group_dst=None):
        if not _needs(tensor):
            return orig["send"](tensor, dst, group, tag, group_dst=group_dst)
        COUNTS["send"] += 1
        return orig["send"](_to_host(tensor), dst, group, tag, group_dst=group_dst)

    def recv(tensor, src=None, group=None, tag=0, group_src=None):
        if not _needs(tensor):
            return orig["recv"](tensor, src, group, tag, group_src=group_src)
        COUNTS["recv"] += 1
        host = _host_like(tensor)
        who = orig["recv"](host, src, group, tag, group_src=group_src)
        tensor.copy_(host)
        return who

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if not _needs(tensor):
            return orig["all_gather"](tensor_list, tensor, group, async_op)
        COUNTS["all_gather"] += 1
        outs = [_host_like(t) for t in tensor_list]
        work = orig["all_gather"](outs, _to_host(tensor), group, async_op)
        return _finish(work, async_op, _copy_back(list(zip(tensor_list, outs))), outs)

    def _one_to_one(name: str) -> Callable:
        def op(output, input, *args, group=None, async_op=False, **kwargs):  # noqa: A002 - torch's names
            if not _needs(input):
                return orig[name](output, input, *args, group=group, async_op=async_op, **kwargs)
            COUNTS[name] += 1
            out = _host_like(output)
            work = orig[name](out, _to_host(input), *args, group=group, async_op=async_op, **kwargs)
            return _finish(work, async_op, _copy_back([(output, out)]), out)
        op.__name__ = name
        return op

    def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not _needs(output):
            return orig["reduce_scatter"](output, input_list, op, group, async_op)
        COUNTS["reduce_scatter"] += 1
        out = _host_like(output)
        work = orig["reduce_scatter"](out, [_to_host(t) for t in input_list], op, group, async_op)
        return _finish(work, async_op, _copy_back([(output, out)]), out)

    def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
        if not any(_needs(t) for t in input_tensor_list):
            return orig["all_to_all"](output_tensor_list, input_tensor_list, group, async_op)
        COUNTS["all_to_all"] += 1
        outs = [_host_like(t) for t in output_tensor_list]
        work = orig["all_to_all"](outs, [_to_host(t) for t in input_tensor_list], group, async_op)
        return _finish(work, async_op, _copy_back(list(zip(output_tensor_list, outs))), outs)

    def batch_isend_irecv(p2p_op_list):
        # each op on its own, through the staging isend / irecv (what gloo's own batch does, without asking the
        # group for a backend of the tensors' device type)
        reqs = []
        for op in p2p_op_list:
            sending = op.op in (isend, orig["isend"])
            peer = {"group_dst": op.group_peer} if sending else {"group_src": op.group_peer}
            work = (isend if sending else irecv)(op.tensor, group=op.group, tag=op.tag, **peer)
            if work is not None:
                reqs.append(work)
        return reqs

    made = {"batch_isend_irecv": batch_isend_irecv, "isend": isend, "irecv": irecv, "send": send, "recv": recv, "all_gather": all_gather,
            "reduce_scatter": reduce_scatter, "all_to_all": all_to_all}
    for name in ("all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single",
                 "all_to_all_single"):
        made[name] = _one_to_one(name)
    return {name: fn for name, fn in made.items() if name in orig}


@contextlib.contextmanager
def staged(stage_cpu: bool = False) -> Iterator[Counter]:
    """Inside the block, the ops of :data:`REPLACED` stage CUDA tensors (and CPU ones with ``stage_cpu``) through the
    host; yields :data:`COUNTS` (reset on entry). Not reentrant."""
    orig = {n: getattr(c10d, n) for n in REPLACED if hasattr(c10d, n)}
    shims = _make(orig)
    by_orig = {id(orig[n]): shims[n] for n in shims}
    undo: list[tuple[Any, str, Any]] = []
    ALIASES.clear()

    def put(obj: Any, name: str, value: Any) -> None:
        undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    for name, fn in shims.items():
        put(c10d, name, fn)  # batch_isend_irecv and P2POp's op check read these module globals
        if getattr(dist, name, None) is orig[name]:
            put(dist, name, fn)
    for mod_name, mod in list(sys.modules.items()):  # module-level aliases such as comm._ALL_GATHER
        if mod is None or not (mod_name == "cpscope" or mod_name.startswith("cpscope.")):
            continue
        for attr, value in list(vars(mod).items()):
            if callable(value) and id(value) in by_orig:
                put(mod, attr, by_orig[id(value)])
                ALIASES.append(f"{mod_name}.{attr}")
    COUNTS.clear()
    _STAGE_CPU[0] = stage_cpu
    try:
        yield COUNTS
    finally:
        _STAGE_CPU[0] = False
        for obj, name, value in reversed(undo):
            setattr(obj, name, value)

