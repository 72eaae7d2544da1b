"""The exchange between the ranks of a CP group: the ring's point-to-point hops and the variants' collectives.

:class:`RingComm` (the zigzag ring) sends buffers to the next rank of the group and receives the previous rank's
buffers into fresh ones, asynchronously, so the caller computes on the current buffer while the next one is in
flight. On CUDA the exchange is issued on :func:`cpscope.cp_stream` after that stream waits for the compute stream
(the buffer being sent is ready), and :meth:`RingComm.wait` makes the compute stream wait for the communication; no
host synchronisation happens. Buffers used on both streams are marked with ``record_stream``.

:class:`GroupCollectives` (all-gather, all-to-all, hierarchical) posts ``all_gather`` / ``reduce_scatter`` /
``all_to_all`` asynchronously (NCCL runs them on its own stream; ``wait()`` orders the compute stream after them, no
host sync on CUDA) and returns a :class:`Pending`. The collective variants only talk to this small interface, so a
test harness can run them over an in-process stand-in (``tests/attention/_virtual.py``: several virtual ranks on
one device, one thread each).

Example::

    comm = RingComm(scope.group, scope.rank, scope.size)
    comm.send_recv([k, v])        # post: k, v -> next rank; prev rank's k, v -> new buffers
    ...compute on k, v...
    k, v = comm.wait()            # the received buffers

    coll = GroupCollectives(scope.group, scope.size, scope.rank)
    p = coll.all_gather(k_half)   # posted now
    k_all = p.wait()              # [size * n, ...]
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from ..groups import group_ranks
from ..streams import cp_stream

__all__ = ["RingComm", "is_dense", "Pending", "GroupCollectives"]


# ----------------------------------------------------------------------------------------------------------------
# The ring's hops


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one block of memory without gaps or overlaps (contiguous in some dimension
    order, e.g. the ``[b, s, h, d]`` transpose of a contiguous ``[s, b, h, d]`` tensor)."""
    if t.is_contiguous():
        return True
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    return t.permute(order).is_contiguous()


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D contiguous view of a dense tensor's memory (what goes on the wire)."""
    return t if t.is_contiguous() else t.as_strided((t.numel(),), (1,), t.storage_offset())


class RingComm:
    """Send to ``rank + 1`` / receive from ``rank - 1`` (mod ``size``) within ``group``; one exchange in flight.

    Misuse raises a one-line ``RuntimeError``: :meth:`wait` without a pending :meth:`send_recv`, or a second
    :meth:`send_recv` before the first was waited for.
    """

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int) -> None:
        ranks = group_ranks(group)
        self.group = group
        self.next = ranks[(rank + 1) % size]
        self.prev = ranks[(rank - 1) % size]
        self._reqs: Optional[list] = None
        self._recv: Optional[list[torch.Tensor]] = None
        self._stream: Optional[torch.cuda.Stream] = None
        self._pending: Optional[tuple] = None

    def send_recv(self, send: Sequence[torch.Tensor], recv_shapes: Optional[Sequence[torch.Size]] = None) -> None:
        """Post the exchange: each tensor of ``send`` goes to next; buffers are received from prev — same-shaped as
        ``send``, or shaped ``recv_shapes`` (same dtype/device) when prev sends differently-sized tensors."""
        self.begin(send, recv_shapes)
        self.post()

    def begin(self, send: Sequence[torch.Tensor], recv_shapes: Optional[Sequence[torch.Size]] = None) -> None:
        """First half of :meth:`send_recv`: allocate the receive buffers and (CUDA) mark the compute stream's
        current point; :meth:`post` then issues the exchange, which waits only for that point. Receive buffers are
        allocated here, so they cannot reuse memory that kernels enqueued between ``begin`` and ``post`` still use.

        Measured caveat (H200): enqueuing a cuDNN attention kernel between ``begin`` and ``post`` does NOT overlap
        the exchange with it — those kernels are persistent (a CTA per SM), so the exchange gets no SM until the
        kernel ends. The ring therefore posts every exchange before the kernel it overlaps (:meth:`send_recv`;
        ``docs/attention_kernels.md`` §8)."""
        if self._reqs is not None or self._pending is not None:
            raise RuntimeError("RingComm.send_recv called twice without wait()")
        if recv_shapes is None:
            # dense buffers (contiguous in some dimension order) travel as they are: the receive buffers get the
            # same strides (empty_like keeps a dense tensor's layout), and both go on the wire as flat views
            if not all(is_dense(t) for t in send):
                raise RuntimeError("RingComm.send_recv needs dense (gap-free) send buffers")
            recv = [torch.empty_like(t) for t in send]
        else:
            if len(recv_shapes) != len(send):
                raise RuntimeError(f"RingComm.send_recv: {len(recv_shapes)} recv shapes for {len(send)} buffers")
            if not all(t.is_contiguous() for t in send):
                raise RuntimeError("RingComm.send_recv needs contiguous send buffers when recv_shapes are given")
            recv = [torch.empty(sh, dtype=t.dtype, device=t.device) for sh, t in zip(recv_shapes, send)]
        ready = None
        if send[0].is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(send[0].device))
        self._pending = (list(send), recv, ready)

    def post(self) -> None:
        """Second half of :meth:`send_recv`: issue the exchange prepared by :meth:`begin`."""
        if self._pending is None:
            raise RuntimeError("RingComm.post called without begin()")
        send, recv, ready = self._pending
        self._pending = None
        ops = [dist.P2POp(dist.isend, _flat(t), self.next, self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, _flat(t), self.prev, self.group) for t in recv]
        if ready is not None:
            stream = cp_stream(send[0].device)
            stream.wait_event(ready)
            for t in (*send, *recv):
                t.record_stream(stream)
            with torch.cuda.stream(stream):
                self._reqs = dist.batch_isend_irecv(ops)
            self._stream = stream
        else:
            self._reqs = dist.batch_isend_irecv(ops)
        self._recv = recv

    def wait(self) -> list[torch.Tensor]:
        """Wait for the pending exchange (on CUDA: order the compute stream after it); return the received buffers."""
        if self._reqs is None:
            raise RuntimeError("RingComm.wait called before send_recv")
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                for req in self._reqs:
                    req.wait()
            torch.cuda.current_stream(self._recv[0].device).wait_stream(self._stream)
        else:
            for req in self._reqs:
                req.wait()
        recv, self._reqs, self._recv, self._stream = self._recv, None, None, None
        return recv


# ----------------------------------------------------------------------------------------------------------------
# Collectives (the all-gather, all-to-all and hierarchical variants)

# torch >= 2.13 names them *_single (the *_tensor names warn there); older torch has only the *_tensor names
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Pending:
    """One posted collective: :meth:`wait` waits for it (once) and returns its result tensor."""

    __slots__ = ("_work", "_result")

    def __init__(self, work: Any, result: torch.Tensor) -> None:
        self._work, self._result = work, result

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._result


class GroupCollectives:
    """The collectives of the variants over one ``torch.distributed`` group, each posted asynchronously.

    ``size`` / ``rank`` are the group's (resolved once by the caller, kept on the autograd ``ctx``). Tensors are
    split and joined along dim 0, rank-major. Every rank of the group must post the same collectives in the same
    order.

    Example::

        coll = GroupCollectives(group, 2, rank)
        p = coll.all_gather(k_half)          # posted now
        ...compute...
        k_all = p.wait()                     # [2 * n, ...]
    """

    def __init__(self, group: Optional[dist.ProcessGroup], size: int, rank: int) -> None:
        self.group, self.size, self.rank = group, size, rank

    def all_gather(self, x: torch.Tensor) -> Pending:
        """``[n, ...]`` from every rank -> ``[size * n, ...]`` (rank ``j``'s rows at ``j*n``)."""
        x = x.contiguous()
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        return Pending(_ALL_GATHER(out, x, group=self.group, async_op=True), out)

    def reduce_scatter(self, x: torch.Tensor) -> Pending:
        """``[size * n, ...]`` from every rank -> the sum over ranks of rows ``rank*n .. rank*n+n-1``."""
        x = x.contiguous()
        out = x.new_empty((x.shape[0] // self.size, *x.shape[1:]))
        return Pending(_REDUCE_SCATTER(out, x, group=self.group, async_op=True), out)

    def all_to_all(self, x: torch.Tensor) -> Pending:
        """``[size * n, ...]``: rows ``j*n ..`` go to rank ``j``; the result's rows ``j*n ..`` came from rank ``j``."""
        x = x.contiguous()
        out = torch.empty_like(x)
        return Pending(dist.all_to_all_single(out, x, group=self.group, async_op=True), out)
