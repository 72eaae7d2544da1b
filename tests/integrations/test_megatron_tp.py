"""Tensor parallelism beside runtime CP: a real megatron-core 0.19.2 GPTModel with TP2 on 4 gloo CPU ranks.

Megatron's tensor-parallel layers (``ColumnParallelLinear`` / ``RowParallelLinear``, the vocab-parallel embedding,
the gathered output layer) run on gloo on CPU, so the test uses Megatron's own TP, through
``parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)``: TP pairs (0, 1) and (2, 3), DP groups
(0, 2) and (1, 3). The model is built with TP2 and CP1; cpscope's groups come from
:func:`cpscope.groups.new_tp_cp_groups` (CP2 = ranks (0, 2) or (1, 3), one per TP rank). It trains 3 steps (fp32,
1e-5) and 1 step (float64, 1e-9) with mixed CP2 / CP1 ``thd`` microbatches over the two DP×CP positions, and the
loss, the gradients of every TP shard and the weights after training equal the *unmodified* TP2 model run without
CP (each document alone, ``bshd`` with its causal mask, on every TP pair). Each TP rank's shards start from its own
random weights (replicated ones are equal on both), so a CP group that mixed TP ranks could not pass. Binding a CP group that holds both ranks of a TP
pair (``new_cp_groups([2])`` here) is refused with a ``ValueError`` before any collective.

CPU shims as in ``test_megatron_core`` (test-side only).
"""
from __future__ import annotations

import contextlib
import zlib
from typing import Any

import pytest
import torch
import torch.distributed as dist

import cpscope
from tests.distributed import run_ranks
from tests.integrations.test_megatron_core import (
    LENGTHS,
    VOCAB,
    _assert_close,
    _config,
    _grads,
    _megatron_available,
    _megatron_batch,
    _mb,
    _psp,
    _reference_cpu_shims,
    _reference_step,
)

pytestmark = pytest.mark.skipif(not _megatron_available(), reason="megatron-core 0.19.2 (with triton) is not installed")

TP = 2
# Mixed CP2 / CP1 plans over the 2 DP×CP positions of 4 ranks at TP2 (8 documents of LENGTHS)
PLANS = [
    [_mb(2, 0, (0,)), _mb(2, 0, (1, 2)), _mb(1, 0, (3, 4)), _mb(1, 1, (5, 6, 7))],
    [_mb(1, 0, (0, 2)), _mb(1, 1, (1, 3, 4, 5, 6, 7))],
    [_mb(2, 0, (3, 1, 0)), _mb(1, 0, (2, 4)), _mb(1, 1, (5, 6, 7))],
]


@contextlib.contextmanager
def _tensor_parallel(tp: int):
    """Megatron's parallel_state with TP ``tp`` for the block; the pool's TP1 state again after it."""
    import warnings

    from megatron.core import parallel_state as ps

    warnings.filterwarnings("ignore")
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, 1, context_parallel_size=1)
    try:
        yield ps
    finally:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(1, 1, context_parallel_size=1)


def _build_tp(dtype: torch.dtype, tp_rank: int) -> Any:
    """A small TP2 GPTModel (local spec, RoPE, GQA 4/2 → 2/1 heads per TP rank), logits gathered over TP."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    with _reference_cpu_shims():
        model = GPTModel(_config(tensor_model_parallel_size=TP), get_gpt_layer_local_spec(), vocab_size=VOCAB,
                         max_sequence_length=256, position_embedding_type="rope", parallel_output=False)
    init_tp_weights(model, tp_rank)
    return model.to(dtype)


def init_tp_weights(model: Any, tp_rank: int) -> None:
    """Random weights: each TP rank's shards its own, replicated weights (norms, router) equal on every TP rank."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            sharded = bool(getattr(p, "tensor_model_parallel", False))
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + (1 + tp_rank if sharded else 0))
            p.copy_((torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3).to(p.dtype))


def _cp_step(model: Any, plan: list, docs: list, cp_groups: dict, dp: Any) -> tuple[float, int]:
    from cpscope.integrations.megatron import megatron_forward, prepare_megatron_microbatches
    from cpscope.train._loop import allreduce_gradients, allreduce_sum, global_num_targets, run_microbatches

    dp_ranks = dist.get_process_group_ranks(dp)
    position = dp_ranks.index(dist.get_rank())
    mine = [mb for mb in plan if position in mb.ranks]
    mbs = prepare_megatron_microbatches(mine, docs, cp_groups, ranks=dp_ranks)
    n = global_num_targets(mbs, dp_group=dp)
    with _reference_cpu_shims():  # the TP layers' RNG tracker (dropout 0)
        local = run_microbatches(model, mbs, num_targets=n, dp_group=dp, forward=megatron_forward)
    allreduce_gradients(model, dp_group=dp)
    return float(allreduce_sum(local, group=dp)) / n, n


def _train(ps: Any, dtype: torch.dtype, steps: int, tol: float, groups: dict) -> list[float]:
    from cpscope.integrations.megatron import documents_from_batch, enable_runtime_cp

    tp_rank, dp = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_group()
    model, ref = _build_tp(dtype, tp_rank), _build_tp(dtype, tp_rank)
    assert enable_runtime_cp(model)
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref))
    losses = []
    for step in range(steps):
        docs = documents_from_batch(_megatron_batch(LENGTHS, seed=30 + step))
        loss, n = _cp_step(model, PLANS[step % len(PLANS)], docs, {s: g.cp for s, g in groups.items()}, dp)
        ref_loss = float(_reference_step(ref, docs, n))  # every TP pair runs every document: TP2 without CP
        assert abs(loss - ref_loss) <= tol * max(1.0, abs(ref_loss)), (step, loss, ref_loss)
        _assert_close(_grads(model), _grads(ref), tol, f"TP2 step {step} gradients")
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad(set_to_none=True)
        losses.append(loss)
    _assert_close(dict(model.named_parameters()), dict(ref.named_parameters()), tol, "TP2 parameters after training")
    return losses


def _cp_across_tp_refused(ps: Any) -> str:
    """A CP2 group made of a TP pair (what new_cp_groups([2]) gives at TP2) is refused before any collective."""
    from cpscope.integrations.megatron import enable_runtime_cp

    wrong = cpscope.new_cp_groups([1, 2])[2]
    assert dist.get_process_group_ranks(wrong) == dist.get_process_group_ranks(ps.get_tensor_model_parallel_group())
    model = _build_tp(torch.float32, ps.get_tensor_model_parallel_rank())
    enable_runtime_cp(model)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"holds ranks \[\d\] of this rank's TP group") as e:
        model(torch.zeros(1, 4, dtype=torch.long), None, None, packed_seq_params=_psp(cu, group=wrong, local=2))
    return str(e.value)


def _tp_runtime_cp() -> dict:
    with _tensor_parallel(TP) as ps:
        assert ps.get_tensor_model_parallel_world_size() == TP
        groups = cpscope.groups.new_tp_cp_groups([1, 2], tp_size=TP)
        me = dist.get_rank()
        assert dist.get_process_group_ranks(groups[2].cp) == [me % TP, me % TP + TP]
        return {"fp32": _train(ps, torch.float32, 3, 1e-5, groups), "fp64": _train(ps, torch.float64, 1, 1e-9, groups),
                "refused": _cp_across_tp_refused(ps)}


def test_tp2_with_runtime_cp_equals_tp2_without_cp():
    out = run_ranks(4, _tp_runtime_cp)
    assert out[0]["fp32"][-1] < out[0]["fp32"][0]  # it trains
    assert all(o["fp32"] == out[0]["fp32"] for o in out)  # every rank reports the same loss
    assert "new_tp_cp_groups" in out[0]["refused"]
