"""Hybrid CP composes with DistributedDataParallel and FSDP2 (cpscope.train._sync through run_step).

The demo's GPT (examples/train_hybrid.py, small shapes) trains 3 steps on 4 gloo ranks, wrapped in DDP or sharded by
FSDP2, on fixed document lengths whose plans mix CP1, CP2 and CP4 and give one rank **no microbatch** in step 1 (so
the ranks run 2/2/3/2, then 1/1/1/0, then 3/3/3/3 microbatches). The final weights and every step's loss must equal
single-process training on the same data (fp32, relative 1e-5 per weight tensor), and on every rank every step
issues the same data-parallel collectives, once: FSDP2 one all-gather and one reduce-scatter per parameter group,
DDP one bucketed all-reduce (plus the step's target count and a has-gradient mask) — never one per microbatch.

A task timeout much shorter than the process group's turns any hang into a failure.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist

import cpscope
from cpscope.train._loop import allreduce_gradients, empty_microbatch, run_step
from cpscope.train._sync import DDPSync, FSDPSync, ManualSync, gradient_sync
from tests.distributed import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import train_hybrid as th  # noqa: E402

from tests.hybrid.test_loop import SMALL, rel_err  # noqa: E402

# Plans (capacity 32, 4 ranks): step 0 CP4 + CP2 + CP1 (2/2/3/2 microbatches per rank), step 1 CP1 only with rank 3
# idle (1/1/1/0), step 2 CP4 + CP2 + CP1 (3/3/3/3). test_plans_mix_cp_sizes_and_leave_a_rank_idle checks this.
LENGTHS = ((100, 50, 20, 12, 9, 30), (20, 14, 9), (60, 120, 7, 25, 16, 40, 11))
STEPS = len(LENGTHS)
TIMEOUT = 75.0  # per task (from the last rank heard of); the pool's process group times out after 90 s


def _cfg(**kw: Any) -> th.TrainConfig:
    return th.TrainConfig(**{"steps": STEPS, "lr": 1e-2, "lengths": LENGTHS, **SMALL, **kw})


def test_plans_mix_cp_sizes_and_leave_a_rank_idle():
    cfg = _cfg(mode="hybrid")
    counts, sizes = [], set()
    for lengths in LENGTHS:
        plan = th.make_plan(cfg, list(lengths), 4)
        counts.append([len(plan.microbatches_for_rank(r)) for r in range(4)])
        sizes |= set(plan.cp_sizes)
    assert sizes == {1, 2, 4}
    assert counts[1].count(0) == 1 and len({tuple(c) for c in counts}) == STEPS, counts


# ---------------------------------------------------------------------------------------------------------------
# Counting the data-parallel collectives of each run_step


_COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
                "all_reduce", "broadcast", "all_gather", "reduce_scatter")


@contextlib.contextmanager
def _count_collectives(group: Any) -> Iterator[dict[str, int]]:
    """Count calls of torch.distributed collectives on ``group`` (None: the world) while inside."""
    target = group if group is not None else dist.group.WORLD
    counts: dict[str, int] = {}
    saved = {}
    for name in _COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        saved[name] = fn
        sig = inspect.signature(fn)

        def counting(*args: Any, __fn=fn, __name=name, __sig=sig, **kwargs: Any) -> Any:
            g = __sig.bind(*args, **kwargs).arguments.get("group")
            if (g if g is not None else dist.group.WORLD) is target:
                counts[__name] = counts.get(__name, 0) + 1
            return __fn(*args, **kwargs)

        setattr(dist, name, counting)
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _train(cfg: th.TrainConfig):
    """th.train on this rank, with the data-parallel collectives of every run_step counted."""
    cpscope.set_backward_read_check(True)  # backward (and the checkpoint recompute) never reads the scope
    per_step: list[dict[str, int]] = []
    syncs: list[str] = []
    real = th.run_step

    def counted(model, mbs, *, sync, **kwargs):
        syncs.append(type(sync).__name__)
        with _count_collectives(sync.dp_group) as counts:
            out = real(model, mbs, sync=sync, **kwargs)
        per_step.append(counts)
        return out

    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    th.run_step = counted
    try:
        res = th.train(cfg)
    finally:
        th.run_step = real
        cpscope.set_backward_read_check(True)  # back to the default (on)
    mbs = [len(step) for step in res.seen]
    compiled = counters["stats"]["unique_graphs"] - graphs
    return res.losses, res.state, per_step, mbs, res.empty, sorted(set(syncs)), compiled


@functools.lru_cache(maxsize=None)
def _single() -> tuple[list[float], dict[str, torch.Tensor]]:
    res = th.train(_cfg(mode="single"))
    return res.losses, res.state


def _check_against_single(per_rank: list, expected_counts: dict[str, int], sync_name: str) -> None:
    ref_losses, ref_state = _single()
    losses, state, _, _, _, syncs, _ = per_rank[0]
    assert syncs == [sync_name]
    for r, (l_r, s_r, counts, mbs, empty, _, _) in enumerate(per_rank):
        assert l_r == losses, r  # every rank logs the same global loss
        for k in state:
            assert torch.equal(s_r[k], state[k]), (r, k)  # and ends with the same weights
        # Once per step, whatever the number of microbatches (which differs between ranks and steps):
        assert counts == [expected_counts] * STEPS, (r, counts)
    assert [pr[3] for pr in per_rank] == [[2, 1, 3], [2, 1, 3], [3, 1, 3], [2, 0, 3]]
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), (step, a, b)
    init = th.build_model(_cfg(), torch.device("cpu")).state_dict()
    assert max(rel_err(ref_state[k], init[k]) for k in ref_state) > 1e-3  # training moved the weights
    errs = {k: rel_err(state[k], ref_state[k]) for k in ref_state}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= 1e-5, (worst, errs[worst])


def test_ddp_with_compiled_blocks_trains_like_one_process():
    cfg = _cfg(mode="hybrid", wrap="ddp", compile=True, compile_backend="eager")  # Dynamo capture and guards
    per_rank = run_ranks(4, _train, cfg, timeout=2 * TIMEOUT)  # Dynamo is slow on a loaded CPU
    # targets count + has-gradient mask + one bucket (the whole small model)
    _check_against_single(per_rank, {"all_reduce": 3}, "DDPSync")
    assert all(pr[4] == [0] * STEPS for pr in per_rank)  # DDP needs no empty microbatch
    assert all(pr[6] > 0 for pr in per_rank)  # graphs were captured


@pytest.mark.parametrize(
    "mp,reshard,extra",
    [("none", True, {}), ("fp32", False, {"checkpoint": True}), ("none", False, {"compile": True, "checkpoint": True})],
    ids=["fp32-reshard", "mixed-fp32/fp64-no-reshard-checkpoint", "no-reshard-compiled-checkpointed-blocks"],
)
def test_fsdp2_trains_like_one_process(mp, reshard, extra):
    if extra.get("compile"):  # Dynamo's capture and guards are what is tested; inductor adds minutes of C++ here
        extra = {**extra, "compile_backend": "eager"}
    cfg = _cfg(mode="hybrid", wrap="fsdp", fsdp_mp=mp, reshard_after_forward=reshard, **extra)
    per_rank = run_ranks(4, _train, cfg, timeout=TIMEOUT * (2 if extra.get("compile") else 1))  # Dynamo is slow
    groups = 1 + SMALL["n_layers"]  # every block and the root
    _check_against_single(per_rank, {"all_gather_single": groups, "reduce_scatter_single": groups,
                                     "all_reduce": 1}, "FSDPSync")
    # The reduce-scatters ride on a CP1 backward: the rank's last microbatch when it is CP1, else an empty one —
    # ranks 0 and 1 end step 0 with their CP2 microbatch, rank 3 has nothing in step 1.
    assert [pr[4] for pr in per_rank] == [[1, 0, 0], [1, 0, 0], [0, 0, 0], [0, 1, 0]]
    if mp == "fp32":
        assert all(v.dtype == torch.float64 for v in per_rank[0][1].values())  # fp64 master weights, fp32 compute
    assert all((pr[6] > 0) == bool(extra.get("compile")) for pr in per_rank)  # Dynamo captured graphs (or none)


# ---------------------------------------------------------------------------------------------------------------
# One step on a hand-made schedule, against the independent float64 reference


# Valid but unlike the planner's order: rank 1 runs a CP1 microbatch before the CP2 one it shares with rank 0, and
# rank 3 has none. FSDP's own lazy all-gather at a first forward would deadlock here (rank 0 waits in the ring for
# rank 1, rank 1 in the next layer's all-gather for rank 0): FSDPSync's unshard at the start of the step avoids it.
CUSTOM_LENGTHS = (40, 24, 30, 18, 26)
CUSTOM = {0: [(2, 0, (0,)), (1, 0, (4,))], 1: [(1, 1, (1,)), (2, 0, (0,))], 2: [(1, 2, (2,)), (1, 2, (3,))], 3: []}


def _fsdp_settings(model: torch.nn.Module) -> list:
    from cpscope.train._fsdp_sync import GROUP_SETTINGS as _GROUP_SETTINGS, param_groups as _param_groups

    return [(type(m).__name__, [{k: getattr(g, k) for k in _GROUP_SETTINGS if hasattr(g, k)} for g in _param_groups(m)])
            for m in model.modules() if hasattr(m, "_get_fsdp_state")]


def _custom_step_vs_reference(wrap: str, reshard: bool):
    import copy

    from cpscope.hybrid import Microbatch
    from cpscope.train._loop import prepare_microbatches
    from tests.hybrid.test_loop import reference_loss

    cpscope.set_backward_read_check(True)
    rank = dist.get_rank()
    cfg = _cfg(mode="hybrid", wrap=wrap, reshard_after_forward=reshard, lengths=(CUSTOM_LENGTHS,))
    groups = cpscope.new_cp_groups([1, 2, 4])
    docs = th.make_documents(cfg, 0)
    model = th.build_model(cfg, torch.device("cpu"))  # fp32
    ref = copy.deepcopy(model).double()
    wrapped = th.wrap_model(cfg, model, torch.device("cpu"))
    planned = [Microbatch(cp, block, seqs, 0, 0.0) for cp, block, seqs in CUSTOM[rank]]
    mbs = prepare_microbatches(planned, docs, groups)
    dp = dist.group.WORLD
    sync = gradient_sync(wrapped, dp_group=dp)
    before = _fsdp_settings(wrapped)

    def broken(m, mb):
        raise RuntimeError("planted")

    if wrap == "fsdp":  # a step that fails in its first forward (on every rank) leaves FSDP as it found it
        with pytest.raises(RuntimeError, match="planted"):
            run_step(wrapped, mbs or [empty_microbatch()], dp_group=dp, sync=sync, forward=broken, num_targets=1)
        assert _fsdp_settings(wrapped) == before
    result = run_step(wrapped, mbs, dp_group=dp, sync=sync)
    assert _fsdp_settings(wrapped) == before  # reshard / gradient-sync / divide-factor settings restored
    loss = result.global_loss()
    ref_loss = reference_loss(ref, docs)
    ref_loss.backward()
    assert abs(loss - ref_loss.item()) <= 1e-6 * abs(ref_loss.item()), (loss, ref_loss.item())
    errs = {}
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad  # FSDP2: sharded DTensor grads
        if wrap == "fsdp":
            assert hasattr(p, "full_tensor"), name  # resharded after the step
        errs[name] = rel_err(g, q.grad)
    worst = max(errs, key=errs.get)
    assert errs[worst] <= 1e-5, (worst, errs[worst])
    return type(sync).__name__, result.num_microbatches


@pytest.mark.parametrize("wrap,reshard", [("none", True), ("ddp", True), ("fsdp", True), ("fsdp", False)])
def test_one_step_on_a_hand_made_schedule_matches_float64_reference(wrap, reshard):
    out = run_ranks(4, _custom_step_vs_reference, wrap, reshard, timeout=TIMEOUT)
    name = {"none": "ManualSync", "ddp": "DDPSync", "fsdp": "FSDPSync"}[wrap]
    assert out == [(name, 2), (name, 2), (name, 2), (name, 0)]


# ---------------------------------------------------------------------------------------------------------------
# DDP buffers; what is refused


class _WithBuffer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 4)
        self.head = torch.nn.Linear(4, 16)
        self.register_buffer("shift", torch.zeros(4))

    def forward(self, ids: torch.Tensor, **_: Any) -> torch.Tensor:
        return self.head(self.embed(ids) + self.shift)


def _ddp_broadcasts_buffers_once_per_step():
    from cpscope.train._loop import prepare_microbatch

    rank = dist.get_rank()
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(_WithBuffer())
    ddp.module.shift.fill_(float(rank + 1))  # diverged after construction (DDP broadcast them there)
    mbs = [prepare_microbatch([torch.arange(2 + i, 8 + i)], cp=1, group=None) for i in range(rank)]  # 0..3
    with _count_collectives(ddp.process_group) as counts:
        run_step(ddp, mbs, dp_group=dist.group.WORLD)
    assert ddp.module.shift.tolist() == [1.0] * 4  # rank 0's buffers, as DDP's first forward of a step gives
    return counts


def test_ddp_broadcasts_buffers_once_per_step_whatever_the_microbatch_count():
    counts = run_ranks(4, _ddp_broadcasts_buffers_once_per_step, timeout=TIMEOUT)
    assert counts == [{"all_reduce": 3, "broadcast": 1}] * 4


def _refusals():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel.distributed import _MixedPrecision

    DDP = torch.nn.parallel.DistributedDataParallel
    world = dist.group.WORLD
    ddp = DDP(torch.nn.Linear(4, 4))
    ddp.register_comm_hook(None, lambda _state, bucket: torch.futures.Future())
    with pytest.raises(ValueError, match=r"1 communication hook\(s\) registered.*would be skipped"):
        gradient_sync(ddp, dp_group=world)
    with pytest.raises(ValueError, match="mixed_precision casts parameters in DDP's forward"):
        gradient_sync(DDP(torch.nn.Linear(4, 4), mixed_precision=_MixedPrecision(param_dtype=torch.float16)),
                      dp_group=world)
    with pytest.raises(ValueError, match=r"torch.compile was applied to the DistributedDataParallel wrapper.*"
                                         r"DistributedDataParallel\(torch.compile\(model\)\)"):
        gradient_sync(torch.compile(DDP(torch.nn.Linear(4, 4))), dp_group=world)
    plain = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="sync was built for Linear"):
        run_step(plain, [], dp_group=world, sync=ManualSync(torch.nn.Linear(4, 4), dp_group=world), num_targets=1)
    with pytest.raises(ValueError, match="num_targets must be the \\(positive\\).*got 0"):
        run_step(plain, [], dp_group=world, num_targets=0)
    hsdp = torch.nn.Linear(4, 4)
    fully_shard(hsdp, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    with pytest.raises(ValueError, match=r"1-D device mesh.*2-D mesh \(2, 2\).*HSDP"):
        gradient_sync(hsdp, dp_group=world)
    half = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    fully_shard(half[0])  # the root and half[1] are not sharded: their gradients would never be summed
    with pytest.raises(ValueError, match=r"2 trainable parameter\(s\) are not sharded by FSDP2 \(e.g. \['1.weight', "
                                         r"'1.bias'\]\).*fully_shard to the root"):
        gradient_sync(half, dp_group=world)
    assert isinstance(gradient_sync(DDP(torch.nn.Linear(4, 4)), dp_group=world), DDPSync)
    shard = torch.nn.Linear(4, 4)
    fully_shard(shard)
    assert isinstance(gradient_sync(shard, dp_group=world), FSDPSync)
    assert isinstance(gradient_sync(plain, dp_group=world), ManualSync)
    # The data-parallel group is named, and must be the wrapper's own: a sub-group (or None) is refused.
    pair = cpscope.new_cp_groups([2])[2]  # ranks 0-1 or 2-3
    for wrapped, what in ((DDP(torch.nn.Linear(4, 4)), "DistributedDataParallel's process_group"),
                          (shard, "the FSDP2 device mesh")):
        for group in (pair, None):
            with pytest.raises(ValueError, match=rf"dp_group has global ranks \[.*\] but {what} reduces over ranks "
                                                 r"\[0, 1, 2, 3\]"):
                gradient_sync(wrapped, dp_group=group)
    with pytest.raises(ValueError, match=r"sync reduces over the ranks \[0, 1, 2, 3\] but dp_group has ranks"):
        run_step(plain, [], dp_group=pair, sync=ManualSync(plain, dp_group=world), num_targets=1)
    with pytest.raises(ValueError, match="dp_group must be a torch.distributed ProcessGroup.*got int 4"):
        gradient_sync(plain, dp_group=4)
    for call in (lambda: gradient_sync(plain), lambda: run_step(plain, [], num_targets=1)):
        with pytest.raises(TypeError, match="dp_group"):  # required: no default that would mean the world
            call()
    return True


def test_unsupported_wrappers_and_settings_raise_value_errors():
    assert run_ranks(4, _refusals, timeout=TIMEOUT) == [True] * 4


# ---------------------------------------------------------------------------------------------------------------
# Tensor parallelism beside plain modules: TP2 x DP2 on 4 ranks, hybrid CP inside each data-parallel group


class _CopyToTP(torch.autograd.Function):
    """Identity forward; backward sums the input gradient over the tensor-parallel group (Megatron's ``f``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Forward sums the partial outputs over the tensor-parallel group; identity backward (Megatron's ``g``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return grad, None


class _ParallelLinear(torch.nn.Module):
    """This TP rank's shard of a bias-free linear layer: column-parallel (output rows) or row-parallel (inputs)."""

    def __init__(self, full: torch.nn.Linear, tp_group: Any, column: bool) -> None:
        super().__init__()
        n, r = dist.get_world_size(tp_group), dist.get_rank(tp_group)
        self.weight = torch.nn.Parameter(full.weight.detach().chunk(n, dim=0 if column else 1)[r].clone())
        self.tp_group, self.column = tp_group, column

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.column:
            return torch.nn.functional.linear(_CopyToTP.apply(x, self.tp_group), self.weight)
        return _ReduceFromTP.apply(torch.nn.functional.linear(x, self.weight), self.tp_group)


TP_LENGTHS = (60, 40, 22, 12, 9, 30, 17)  # at capacity 32 on 2 data-parallel ranks: CP2 and CP1 microbatches


def _tp_dp_step_vs_reference():
    """A GPT whose MLPs are tensor-parallel over ranks {0, 1} / {2, 3} (embedding, attention, norms and head plain,
    replicated over each TP pair); the data-parallel groups are {0, 2} / {1, 3}, and hybrid CP runs inside them."""
    import copy

    from cpscope.hybrid import plan_hybrid
    from cpscope.train._loop import global_num_targets, prepare_microbatch, prepare_microbatches, run_microbatches
    from tests.hybrid.test_loop import reference_loss

    cpscope.set_backward_read_check(True)
    rank = dist.get_rank()
    tp_rank, dp_pos = rank % 2, rank // 2
    tp_group = cpscope.new_cp_groups([2])[2]  # ranks {0, 1} or {2, 3}: the TP groups
    dp_ranks = [tp_rank, tp_rank + 2]
    groups = cpscope.new_cp_groups([1, 2], ranks=[0, 2, 1, 3])  # CP groups inside the data-parallel groups
    dp_group = groups[2]
    assert cpscope.group_ranks(dp_group) == dp_ranks
    cfg = th.TrainConfig(mode="hybrid", lengths=(TP_LENGTHS,), **SMALL)
    docs = th.make_documents(cfg, 0)  # the global batch, the same on every rank
    model = th.build_model(cfg, torch.device("cpu"))  # fp32, the same initial weights everywhere
    ref = copy.deepcopy(model).double()
    for block in model.blocks:
        block.fc1 = _ParallelLinear(block.fc1, tp_group, column=True)
        block.fc2 = _ParallelLinear(block.fc2, tp_group, column=False)
    plan = plan_hybrid(list(TP_LENGTHS), n_ranks=2, capacity=32, cost=th.DEMO_COST)
    mbs = prepare_microbatches(plan.microbatches_for_rank(dp_pos), docs, groups, ranks=dp_ranks)
    cps = sorted({mb.cp for mb in mbs})

    # What group=None used to mean — the world — counts the targets of each TP pair twice ...
    n = global_num_targets(mbs, dp_group=dp_group)
    assert global_num_targets(mbs, dp_group=dist.group.WORLD) == 2 * n
    # ... and a CP group outside the data-parallel group (here a TP pair) is refused before any collective.
    wrong = prepare_microbatch([docs[0]], cp=2, group=tp_group)
    with pytest.raises(ValueError, match=r"CP group with global ranks \[.*\] reaches outside the data-parallel "
                                         r"group \[.*\]"):
        run_microbatches(model, [wrong], num_targets=n, dp_group=dp_group)

    result = run_step(model, mbs, dp_group=dp_group)  # ManualSync over dp_group: gradients summed over {t, t+2}
    loss = result.global_loss()
    ref_loss = reference_loss(ref, docs)
    ref_loss.backward()
    assert result.num_targets == n == sum(d.numel() - 1 for d in docs)
    assert abs(loss - ref_loss.item()) <= 1e-6 * abs(ref_loss.item()), (loss, ref_loss.item())
    errs = _tp_grad_errors(model, ref, tp_rank)
    worst = max(errs, key=errs.get)
    assert errs[worst] <= 1e-5, (worst, errs[worst])

    # The failure mode itself: the loss divided by the world's count (twice the targets) halves every gradient.
    model.zero_grad(set_to_none=True)
    run_microbatches(model, mbs, num_targets=2 * n, dp_group=dp_group)
    allreduce_gradients(model, dp_group=dp_group)
    halved = _tp_grad_errors(model, ref, tp_rank, scale=2.0)
    assert max(halved.values()) <= 1e-5, halved
    return cps


def _tp_grad_errors(model: torch.nn.Module, ref: torch.nn.Module, tp_rank: int, scale: float = 1.0) -> dict:
    """Relative error of each (scaled) gradient against the reference's — its TP shard for fc1 / fc2."""
    errs = {}
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        want = q.grad
        if name.endswith(("fc1.weight", "fc2.weight")):  # this TP rank's shard of the full gradient
            want = want.chunk(2, dim=0 if "fc1" in name else 1)[tp_rank]
        errs[name] = rel_err(scale * p.grad, want)
    return errs


def test_tensor_parallel_beside_plain_modules_counts_each_target_once():
    """TP2 x DP2: the data-parallel group is {t, t+2}, not the world; with it named, loss and gradients (plain and
    tensor-parallel parameters) equal the float64 single-process reference; the world would halve them."""
    cps = run_ranks(4, _tp_dp_step_vs_reference, timeout=TIMEOUT)
    assert set().union(*map(set, cps)) == {1, 2}, cps  # CP2 and CP1 microbatches inside the data-parallel groups
