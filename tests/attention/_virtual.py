"""Several virtual CP ranks in one process, one thread each: the variants' own kernels on one device.

:class:`VirtualWorld` implements the collectives of :class:`cpscope.attention._exchange.GroupCollectives`
(``all_gather``, ``reduce_scatter``, ``all_to_all``) between threads, in lockstep; the variants' plain ``forward`` /
``backward`` functions (no autograd engine: it would run every virtual rank's CUDA backward on one device thread)
then run unchanged for each virtual rank. :func:`check_virtual` compares every virtual rank's rows and gradients with
a full-sequence reference — on CPU in the tests, on one GPU in ``benchmarks/bench_variants.py --one-gpu`` (the block
shapes and varlen descriptors of a CP2/CP4 run, on the GPU's kernels, without a second GPU).

Covers ``all_gather`` and ``a2a``; ``a2a+p2p`` runs the zigzag ring across its outer groups, which exchanges by
point-to-point sends, not through these collectives.

Example::

    errs = check_virtual("all_gather", 4, "thd", causal=True, heads=(8, 2), lens=[64, 192], device="cuda",
                         dtype=torch.bfloat16)
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Sequence

import torch

from cpscope.attention import _allgather as allgather, _ulysses as ulysses
from cpscope.attention._layout import packed
from tests.attention._reference import reference_attention, zigzag_index


class VirtualWorld:
    """``n`` virtual ranks; every rank must post the same collectives in the same order (as with a real group)."""

    def __init__(self, n: int, timeout: float = 120.0) -> None:
        self.n, self.timeout = n, timeout
        self._cond = threading.Condition()
        self._posted: dict[int, list[Optional[torch.Tensor]]] = {}
        self._count = [0] * n

    def collectives(self, rank: int) -> "VirtualCollectives":
        return VirtualCollectives(self, rank)

    def _post(self, rank: int, x: torch.Tensor) -> int:
        with self._cond:
            op = self._count[rank]
            self._count[rank] += 1
            self._posted.setdefault(op, [None] * self.n)[rank] = x.contiguous().clone()
            self._cond.notify_all()
            return op

    def _inputs(self, op: int) -> list[torch.Tensor]:
        with self._cond:
            if not self._cond.wait_for(lambda: all(t is not None for t in self._posted[op]), self.timeout):
                raise TimeoutError(f"virtual collective {op}: not every rank posted within {self.timeout}s")
            return list(self._posted[op])  # type: ignore[arg-type]


class _Pending:
    def __init__(self, world: VirtualWorld, op: int, finish: Callable[[list[torch.Tensor]], torch.Tensor]) -> None:
        self._world, self._op, self._finish, self._result = world, op, finish, None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self._result = self._finish(self._world._inputs(self._op))
        return self._result


class VirtualCollectives:
    """:class:`~cpscope.attention._exchange.GroupCollectives` of one virtual rank."""

    def __init__(self, world: VirtualWorld, rank: int) -> None:
        self.world, self.size, self.rank, self.group = world, world.n, rank, None

    def all_gather(self, x: torch.Tensor) -> _Pending:
        return _Pending(self.world, self.world._post(self.rank, x), lambda xs: torch.cat(xs))

    def reduce_scatter(self, x: torch.Tensor) -> _Pending:
        r, n = self.rank, self.size
        return _Pending(self.world, self.world._post(self.rank, x),
                        lambda xs: torch.stack([t.chunk(n)[r] for t in xs]).sum(0))

    def all_to_all(self, x: torch.Tensor) -> _Pending:
        r, n = self.rank, self.size
        return _Pending(self.world, self.world._post(self.rank, x), lambda xs: torch.cat([t.chunk(n)[r] for t in xs]))


def run_virtual(n: int, fn: Callable[[int, VirtualCollectives], Any]) -> list[Any]:
    """``fn(rank, collectives)`` on ``n`` threads; results in rank order; the first failure is re-raised."""
    world = VirtualWorld(n)
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank, world.collectives(rank))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)
            with world._cond:  # release ranks waiting on this one's posts
                world.timeout = 0.0
                world._cond.notify_all()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _plain(variant: str, rank: int, coll: Any, q, k, v, dout, how, causal: bool, scale: float):
    """One virtual rank: the variant's forward and backward functions, as its autograd function calls them."""
    if variant == "all_gather":
        plan = allgather.AllGatherPlan.of(how, rank=rank, size=coll.size, causal=causal, scale=scale, device=q.device)
        q, k, v, dout = (plan.inner(x) for x in (q, k, v, dout))
        out, lse = allgather.forward(q, k, v, plan, coll)
        dq, dk, dv = allgather.backward(dout, q, k, v, out, lse, plan, coll)
        return [plan.outer(x) for x in (out, dq.to(q.dtype), dk, dv)]
    if variant == "a2a":
        plan = ulysses.UlyssesPlan(causal=causal, scale=scale, how=how, inner=(rank, coll.size), outer=(0, 1),
                                   device=q.device)
        out, saved = ulysses.forward(q, k, v, plan, coll, None)
        return [out, *ulysses.backward(dout, saved, plan, coll, None)[:3]]  # no sinks: (dq, dk, dv)
    raise ValueError(f"no virtual run for variant {variant!r}")


def check_virtual(
    variant: str, n: int, fmt: str, *, causal: bool, heads: tuple[int, int], lens: Sequence[int] = (),
    seq: int = 0, batch: int = 1, d: int = 16, device: Any = "cpu", dtype: torch.dtype = torch.float64,
    tol: Optional[float] = None, seed: int = 0,
) -> dict[str, float]:
    """Run ``variant`` on ``n`` virtual ranks and compare with a float64 reference; returns the worst errors.

    Errors are max-abs for fp32/fp64 (asserted ``<= tol``, default 1e-10 / 2e-5) and relative (``|err| / |ref|``,
    Frobenius) for fp16/bf16 (default tol 1e-2). ``thd`` takes document ``lens``, dense layouts ``seq`` x ``batch``.
    """
    h, h_kv = heads
    dev = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    cu = [0]
    for x in lens:
        cu.append(cu[-1] + x)
    b, t = (1, cu[-1]) if fmt == "thd" else (batch, seq)
    full = [torch.randn(b, t, hh, d, generator=g, dtype=torch.float64) for hh in (h, h_kv, h_kv, h)]
    ref_in = [x.clone().to(dev).requires_grad_(True) for x in full[:3]]
    ref_out = torch.stack([reference_attention(*(x[i] for x in ref_in), causal=causal,
                                               cu=cu if fmt == "thd" else None) for i in range(b)])
    ref_out.backward(full[3].to(dev))
    refs = [ref_out.detach(), *(x.grad for x in ref_in)]
    scale = d ** -0.5

    def layout(x: torch.Tensor) -> torch.Tensor:  # canonical [b, t, h, d] -> fmt
        return x[0] if fmt == "thd" else (x.transpose(0, 1) if fmt == "sbhd" else x)

    low = dtype in (torch.float16, torch.bfloat16)

    def rank_fn(rank: int, coll: Any) -> dict[str, float]:
        idx = zigzag_index(cu if fmt == "thd" else [0, t], n, rank)
        loc = [layout(x[:, idx]).to(dev, dtype).contiguous() for x in full[:3]]
        q, k, v, how = packed(*loc, qkv_format=fmt, cu=tuple(cu) if fmt == "thd" else None, cp=n)
        flat = lambda x: x[:, idx.to(x.device)].reshape(-1, *x.shape[2:])  # noqa: E731 - canonical -> packed rows
        got = _plain(variant, rank, coll, q, k, v, flat(full[3]).to(dev, dtype), how, causal, scale)
        errs = {}
        for name, x, want in zip(("out", "dq", "dk", "dv"), got, refs):
            want = flat(want)
            if not want.numel():
                errs[name] = 0.0
            elif low:
                errs[name] = ((x.double() - want).norm() / want.norm().clamp_min(1e-30)).item()
            else:
                errs[name] = (x.double() - want).abs().max().item()
        return errs

    results = run_virtual(n, rank_fn)
    worst = {k: max(r[k] for r in results) for k in results[0]}
    limit = tol if tol is not None else (1e-2 if dtype in (torch.float16, torch.bfloat16) else
                                         1e-10 if dtype == torch.float64 else 2e-5)
    bad = {k: e for k, e in worst.items() if not e <= limit}
    assert not bad, f"{variant} virtual cp={n} {fmt} causal={causal} heads {h}/{h_kv} {dtype}: errors {worst} > {limit}"
    return worst
