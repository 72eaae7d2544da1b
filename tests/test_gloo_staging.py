"""The test-only shim that lets gloo ranks share one CUDA device (``tests/gloo_staging.py``), exercised on CPU: with
``stage_cpu=True`` every replaced op stages host tensors the way it stages CUDA ones, so its bookkeeping (buffers,
copies back at wait, keywords, timeouts, module aliases, restoring) runs in CI; and the CP2 / CP4 matrix that
``tests/attention/test_cp_one_gpu.py`` runs on a GPU runs here on CPU tensors through the shim."""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tests.distributed import run_ranks


def _ops() -> dict:
    import cpscope
    from cpscope.attention import _exchange as comm
    from tests.gloo_staging import ALIASES, COUNTS, staged

    r, n = dist.get_rank(), dist.get_world_size()
    group = cpscope.new_cp_groups([n])[n]
    base = lambda *shape: torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32).reshape(shape)  # noqa
    mine = base(3, 2) + 100 * r
    got = {}
    originals = {name: getattr(dist, name) for name in ("isend", "all_gather_into_tensor", "all_to_all_single")}
    alias = comm._ALL_GATHER
    with staged(stage_cpu=True):
        assert comm._ALL_GATHER is not alias and "cpscope.attention._exchange._ALL_GATHER" in ALIASES
        nxt, prv = (r + 1) % n, (r - 1) % n
        recv = torch.empty(3, 2)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, nxt, group),
                                       dist.P2POp(dist.irecv, recv, prv, group)])
        for q in reqs:
            q.wait()
        got["ring"] = recv.clone()
        if r == 0:
            dist.send(mine, 1, group)
        elif r == 1:
            buf = torch.empty(3, 2)
            dist.recv(buf, 0, group)
            got["recv"] = buf
        parts = [torch.empty(3, 2) for _ in range(n)]
        dist.all_gather(parts, mine, group=group, async_op=True).wait(timedelta(seconds=30))  # the sentinel's form
        got["all_gather"] = torch.stack(parts)
        out = torch.empty(3 * n, 2)
        comm._ALL_GATHER(out, mine, group=group, async_op=True).wait()
        got["gather_tensor"] = out
        rs = torch.empty(3, 2)
        comm._REDUCE_SCATTER(rs, torch.cat([mine] * n), group=group, async_op=False)
        got["reduce_scatter"] = rs
        a2a = torch.empty(2 * n, 2)
        dist.all_to_all_single(a2a, base(2 * n, 2) + 100 * r, group=group)
        got["a2a"] = a2a
        outs = [torch.empty(1, 2) for _ in range(n)]
        dist.all_to_all(outs, [base(1, 2) + 100 * r + j for j in range(n)], group=group)
        got["a2a_list"] = torch.cat(outs)
        counts = dict(COUNTS)
    assert {name: getattr(dist, name) for name in originals} == originals and comm._ALL_GATHER is alias
    assert c10d.isend is originals["isend"]
    return {"got": got, "counts": counts}


def test_every_staged_op_moves_the_right_values():
    n = 2
    res = run_ranks(n, _ops)
    base = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    for r, out in enumerate(res):
        got = out["got"]
        assert torch.equal(got["ring"], base + 100 * ((r - 1) % n))
        if r == 1:
            assert torch.equal(got["recv"], base)
        assert torch.equal(got["all_gather"], torch.stack([base + 100 * j for j in range(n)]))
        assert torch.equal(got["gather_tensor"], torch.cat([base + 100 * j for j in range(n)]))
        assert torch.equal(got["reduce_scatter"], sum(base + 100 * j for j in range(n)))
        a2a_in = torch.arange(4 * n, dtype=torch.float32).reshape(2 * n, 2)
        assert torch.equal(got["a2a"], torch.cat([a2a_in[2 * r: 2 * r + 2] + 100 * j for j in range(n)]))
        assert torch.equal(got["a2a_list"], torch.cat([torch.arange(2.).reshape(1, 2) + 100 * j + r
                                                       for j in range(n)]))
        for op in ("isend", "irecv", "all_gather", "all_to_all", "all_to_all_single"):
            assert out["counts"].get(op, 0) >= 1, (op, out["counts"])
        assert out["counts"].get("all_gather_single", 0) + out["counts"].get("all_gather_into_tensor", 0) >= 1
        assert out["counts"].get("send" if r == 0 else "recv", 0) == (1 if r in (0, 1) else 0)


@pytest.mark.parametrize("world", [2, 4])
def test_cp_matrix_on_cpu_through_the_shim(world):
    """The one-GPU CP matrix's body (every variant, layout and feature vs float64, forward and gradients, sentinel
    on), on CPU fp32 with every CPU tensor staged through the shim."""
    from tests.attention._cp_matrix import VARIANTS, cp_matrix

    for res in run_ranks(world, cp_matrix, world, "cpu", torch.float32, size="cpu", stage_cpu=True):
        assert set(res["worst"]) == set(VARIANTS[world])
        assert res["staged"].get("isend", 0) > 0 and res["staged"].get("irecv", 0) > 0, res["staged"]
        assert res["staged"].get("all_to_all_single", 0) > 0, res["staged"]
        assert res["checks"].get("attention", 0) > 0 and res["checks"].get("attention-grad", 0) > 0, res["checks"]
