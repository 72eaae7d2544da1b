"""An MoE GPTModel with tensor parallelism beside runtime CP: megatron-core 0.19.2, TP2 on 4 gloo CPU ranks.

Megatron trains MoE with TP only with sequence parallelism (``MoELayer`` refuses otherwise), so the model is built with
TP2, ``sequence_parallel=True``, experts split as the dense layers (``expert_tensor_parallel_size`` 2), 4 experts,
top-2, ``aux_loss`` + ``seq_aux_loss`` + z-loss (and, separately, ``global_aux_loss``), CP1. Each TP rank's router sees its sequence-parallel half of the
tokens and all-reduces its token counts over the ``[tp, cp]`` group — with a CP2 microbatch the 4 ranks of
:func:`cpscope.groups.new_tp_cp_groups`' ``tp_cp`` group, which :func:`enable_runtime_cp` binds per call.

It trains 3 steps (fp32, 1e-5) with mixed CP2 / CP1 ``thd`` microbatches over the two DP×CP positions (and, on 6
ranks, 2 steps of CP3 / CP1 over three positions: a CP size that is not a power of two), and the
loss, every auxiliary loss of every microbatch and layer (summed over the ranks that ran it: each rank attaches its
part), the gradients of every shard and the weights equal the unmodified TP2 model run without CP (each microbatch's
documents as one ``bshd`` row with a block-diagonal causal mask, as in ``test_megatron_moe``; for the global aux
loss each forward index's microbatches as the rows of one padded batch, on a reference whose ``tp_dp_cp`` group is
its TP pair). As Megatron's
``finalize_model_grads`` does, the gradients of the weights replicated over TP under sequence parallelism (norms,
router) are all-reduced over the TP group in both runs. Documents have even lengths (sequence parallelism splits
the reference's rows in two) and several are padded at CP2, so the padding mask's sequence-parallel part is
exercised. A CP group that :func:`new_tp_cp_groups` did not make has no ``[tp, cp]`` group: refused, naming the fix.
Without the router binding (the static groups) the CP2 microbatches' auxiliary losses come out wrong (about twice
the reference here) while the language-model loss is right: the failure mode, checked.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import cpscope
from tests.distributed import run_ranks
from tests.integrations.test_megatron_core import (
    VOCAB,
    _assert_close,
    _grads,
    _mb,
    _megatron_available,
    _megatron_batch,
)
from tests.integrations.test_megatron_moe import (
    EXPERTS,
    GLOBAL,
    PER_MICROBATCH,
    _spied_forward,
    _index_sets,
    _moe_config,
    _moe_cpu_shims,
    _reference_rows,
    _reset_global_aux,
)
from tests.integrations.test_megatron_tp import PLANS, TP, _tensor_parallel, init_tp_weights

pytestmark = pytest.mark.skipif(not _megatron_available(), reason="megatron-core 0.19.2 (with triton) is not installed")

LENGTHS = [40, 22, 18, 30, 10, 6, 12, 4]  # even (sequence parallel), most not multiples of 4 (CP2 pads them)


class _SequenceParallelNorm(torch.nn.LayerNorm):
    """A LayerNorm for sequence parallelism (the local spec's torch norm refuses it; apex / TE are not here): its
    weights are marked ``sequence_parallel`` as Megatron's fused norms mark theirs."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        for p in self.parameters():
            p.sequence_parallel = True


def _build(dtype: torch.dtype, dispatcher: str, tp_rank: int, losses: dict = PER_MICROBATCH,
           pg_collection: Any = None) -> Any:
    import dataclasses

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    config = _moe_config(dtype, dispatcher, losses, tensor_model_parallel_size=TP, sequence_parallel=True)
    layer = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    layer = dataclasses.replace(layer, submodules=dataclasses.replace(
        layer.submodules, input_layernorm=_SequenceParallelNorm, pre_mlp_layernorm=_SequenceParallelNorm))
    block = TransformerBlockSubmodules(layer_specs=[layer] * config.num_layers, layer_norm=_SequenceParallelNorm)
    with _moe_cpu_shims():
        model = GPTModel(config, block, vocab_size=VOCAB, max_sequence_length=256, position_embedding_type="rope",
                         parallel_output=False, pg_collection=pg_collection)
    init_tp_weights(model, tp_rank)
    return model.to(dtype)


def _tp_sync(model: Any, tp: Any) -> None:
    """Megatron's finalize_model_grads for sequence parallelism: replicated weights' gradients summed over TP."""
    for p in model.parameters():
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            dist.all_reduce(p.grad, group=tp)


def _summed(logs: dict, group: Any = None) -> dict:
    """Per microbatch, the auxiliary losses summed over the ranks of ``group`` (default: all) that logged them."""
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, logs, group=group)
    out: dict = {}
    for rank_logs in gathered:
        for i, log in rank_logs.items():
            out[i] = log if i not in out else [a + b for a, b in zip(out[i], log)]
    return out


def _cp_step(model: Any, plan: list, docs: list, groups: dict, ps: Any) -> tuple[float, int, dict]:
    from cpscope.integrations.megatron import prepare_megatron_microbatches
    from cpscope.train._loop import allreduce_gradients, allreduce_sum, global_num_targets, run_microbatches

    dp = ps.get_data_parallel_group()
    dp_ranks = dist.get_process_group_ranks(dp)
    mine = [mb for mb in plan if dp_ranks.index(dist.get_rank()) in mb.ranks]
    mbs = prepare_megatron_microbatches(mine, docs, {s: g.cp for s, g in groups.items()}, ranks=dp_ranks)
    logs: dict[int, list] = {}
    forward = _spied_forward(plan, logs)

    n = global_num_targets(mbs, dp_group=dp)
    with _moe_cpu_shims():
        local = run_microbatches(model, mbs, num_targets=n, dp_group=dp, forward=forward)
    allreduce_gradients(model, dp_group=dp)
    _tp_sync(model, ps.get_tensor_model_parallel_group())
    return float(allreduce_sum(local, group=dp)) / n, n, _summed(logs)


def _reference(ref: Any, plan: list, docs: list, n: int, ps: Any, per_index: bool) -> tuple[float, dict]:
    """The unmodified TP2 model without CP on every TP pair: every microbatch as one row (per microbatch), or each
    forward index's microbatches as the rows of one padded batch (``per_index``: the global aux loss)."""
    total, logs = torch.zeros((), dtype=torch.float64), {}
    sets = _index_sets(plan, len(dist.get_process_group_ranks(ps.get_data_parallel_group())))
    for k, members in enumerate(sets if per_index else [[i] for i in range(len(plan))]):
        log: list = []
        with _moe_cpu_shims():  # sequence parallel's backward allocates on torch.cuda.current_device()
            total += _reference_rows(ref, [[docs[j] for j in plan[i].seqs] for i in members], n, log)
        logs[k] = log
    tp = ps.get_tensor_model_parallel_group()
    _tp_sync(ref, tp)
    return float(total) / n, _summed(logs, tp)


def _train(ps: Any, dispatcher: str, steps: int, tol: float, groups: dict, plans: list = PLANS,
           losses: dict = PER_MICROBATCH) -> list[float]:
    from megatron.core.process_groups_config import ProcessGroupCollection

    from cpscope.integrations.megatron import documents_from_batch, enable_runtime_cp

    tp_rank = ps.get_tensor_model_parallel_rank()
    per_index = losses is GLOBAL
    pgs = None
    if per_index:  # the reference is one TP pair without DP or CP: its tp_dp_cp group is the TP pair
        pgs = ProcessGroupCollection.use_mpu_process_groups()
        pgs.tp_dp_cp = ps.get_tensor_model_parallel_group()
    model = _build(torch.float32, dispatcher, tp_rank, losses)
    ref = _build(torch.float32, dispatcher, tp_rank, losses, pgs)
    assert model.config.expert_tensor_parallel_size == TP and model.config.sequence_parallel
    names = enable_runtime_cp(model)
    assert "decoder.layers.0" in names and "decoder.layers.1" in names  # the MoE layers
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref))
    out = []
    for step in range(steps):
        docs = documents_from_batch(_megatron_batch(LENGTHS, seed=50 + step))
        plan = plans[step % len(plans)]
        loss, n, aux = _cp_step(model, plan, docs, groups, ps)
        ref_loss, ref_aux = _reference(ref, plan, docs, n, ps, per_index)
        if per_index:  # per forward index: the sums over its microbatches
            sets = _index_sets(plan, len(dist.get_process_group_ranks(ps.get_data_parallel_group())))
            aux = {k: [sum(x) for x in zip(*(aux[i] for i in members))] for k, members in enumerate(sets)}
        assert abs(loss - ref_loss) <= tol * max(1.0, abs(ref_loss)), (step, loss, ref_loss)
        assert aux.keys() == ref_aux.keys()
        for i in ref_aux:  # [z, aux, seq aux] per layer, or [global aux] per layer
            assert len(aux[i]) == len(ref_aux[i]) == (2 if per_index else 6), (i, aux[i], ref_aux[i])
            for a, b in zip(aux[i], ref_aux[i]):
                assert abs(a - b) <= tol * max(1.0, abs(b)), (step, i, aux[i], ref_aux[i])
        _assert_close(_grads(model), _grads(ref), tol, f"MoE TP2 step {step} gradients")
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad(set_to_none=True)
        _reset_global_aux(model)
        _reset_global_aux(ref)
        out.append(loss)
    _assert_close(dict(model.named_parameters()), dict(ref.named_parameters()), tol, "MoE TP2 parameters")
    return out


def _static_groups(ps: Any, groups: dict) -> list[tuple[int, float, float]]:
    """The failure mode without the router binding (the static groups of a CP1-built TP2 model: ``tp_cp`` is the TP
    pair): per microbatch of one step, its CP size, the loss's and the auxiliary losses' largest relative error."""
    from cpscope.integrations.megatron import documents_from_batch, enable_runtime_cp

    tp_rank = ps.get_tensor_model_parallel_rank()
    model, ref = _build(torch.float32, "allgather", tp_rank), _build(torch.float32, "allgather", tp_rank)
    enable_runtime_cp(model)
    for m in model.modules():  # undo the router binding only
        if type(m).__name__ == "TransformerLayer" and hasattr(type(m), "_cpscope_base"):
            m.__class__ = type(m)._cpscope_base
    docs = documents_from_batch(_megatron_batch(LENGTHS, seed=50))
    loss, n, aux = _cp_step(model, PLANS[0], docs, groups, ps)
    ref_loss, ref_aux = _reference(ref, PLANS[0], docs, n, ps, False)
    lm = abs(loss - ref_loss) / abs(ref_loss)
    return [(mb.cp, lm, max(abs(a - b) / abs(b) for a, b in zip(aux[i], ref_aux[i]))) for i, mb in enumerate(PLANS[0])]


def _unregistered_cp_group_refused(ps: Any) -> str:
    """A CP group of the right ranks that new_tp_cp_groups did not make: no [tp, cp] group to bind."""
    from cpscope.integrations.megatron import enable_runtime_cp
    from cpscope.integrations.megatron._data import prepare_megatron_microbatch
    from cpscope.integrations.megatron import documents_from_batch

    cpscope.clear_cp_group_cache()  # on every rank: the next groups are new ones
    me = dist.get_rank()
    cp2 = cpscope.new_cp_groups([2], ranks=[0, 2, 1, 3])[2]  # (0, 2), (1, 3): one rank per TP pair
    assert dist.get_process_group_ranks(cp2) == [me % TP, me % TP + TP]
    model = _build(torch.float32, "allgather", ps.get_tensor_model_parallel_rank())
    enable_runtime_cp(model)
    mb = prepare_megatron_microbatch(documents_from_batch(_megatron_batch([8], seed=1)), cp=2, group=cp2)
    with _moe_cpu_shims(), pytest.raises(ValueError, match=r"no \[tp, cp\] group .*new_tp_cp_groups") as e:
        model(mb.input_ids[None], mb.position_ids[None], None, packed_seq_params=mb.packed_seq_params())
    cpscope.clear_cp_group_cache()
    return str(e.value)


_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter_tensor",
                "_reduce_scatter_base", "all_to_all", "all_to_all_single", "broadcast", "batch_isend_irecv", "send",
                "recv", "isend", "irecv", "barrier")


def _refused_before_any_collective() -> tuple[str, int]:
    """TP2, a CP2 microbatch whose [tp, cp] group was not made up front: the error, and how many collectives ran
    before it (Megatron's TP all-reduces / gathers, the ring's exchanges)."""
    from cpscope.integrations.megatron import documents_from_batch, enable_runtime_cp
    from cpscope.integrations.megatron._data import prepare_megatron_microbatch

    with _tensor_parallel(TP) as ps:
        cpscope.clear_cp_group_cache()  # on every rank: the next groups are new ones
        cp2 = cpscope.new_cp_groups([2], ranks=[0, 2, 1, 3])[2]  # one rank per TP pair, no [tp, cp] group made
        model = _build(torch.float32, "allgather", ps.get_tensor_model_parallel_rank())
        enable_runtime_cp(model)
        mb = prepare_megatron_microbatch(documents_from_batch(_megatron_batch([8], seed=1)), cp=2, group=cp2)
        calls = []
        saved = {name: getattr(dist, name) for name in _COLLECTIVES}
        for name, fn in saved.items():
            setattr(dist, name, lambda *a, _n=name, _f=fn, **k: (calls.append(_n), _f(*a, **k))[1])
        try:
            with _moe_cpu_shims(), pytest.raises(ValueError, match=r"no \[tp, cp\] group .*new_tp_cp_groups") as e:
                model(mb.input_ids[None], mb.position_ids[None], None, packed_seq_params=mb.packed_seq_params())
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)
        cpscope.clear_cp_group_cache()
        return str(e.value), len(calls)


def test_moe_tp2_without_tp_cp_groups_is_refused_before_any_collective():
    for msg, collectives in run_ranks(4, _refused_before_any_collective, timeout=120):
        assert "TP2" in msg and collectives == 0, (msg, collectives)


def _moe_tp_runtime_cp(dispatchers: tuple) -> dict:
    with _tensor_parallel(TP) as ps:
        groups = cpscope.groups.new_tp_cp_groups([1, 2], tp_size=TP)
        out = {d: _train(ps, d, 3, 1e-5, groups) for d in dispatchers}
        out["global"] = _train(ps, "allgather", 3, 1e-5, groups, losses=GLOBAL)
        out["static"] = _static_groups(ps, groups)
        out["refused"] = _unregistered_cp_group_refused(ps)
        return out


def _moe_tp_cp3() -> list[float]:
    with _tensor_parallel(TP) as ps:
        groups = cpscope.groups.new_tp_cp_groups([1, 3], tp_size=TP)
        return _train(ps, "alltoall", 2, 1e-5, groups, PLANS_CP3)


# TP2 x CP3 on 6 ranks: mixed CP3 / CP1 plans over the 3 DP×CP positions
PLANS_CP3 = [
    [_mb(3, 0, (0,)), _mb(3, 0, (1, 2)), _mb(1, 0, (3,)), _mb(1, 1, (4, 5)), _mb(1, 2, (6, 7))],
    [_mb(3, 0, (3, 1)), _mb(1, 0, (0,)), _mb(1, 1, (2, 4)), _mb(1, 2, (5, 6, 7))],
]


@pytest.mark.slow  # ~40 s on 2 cores: 6 ranks, each building two MoE models
def test_moe_tp2_cp3_on_6_ranks_equals_tp2_without_cp():
    out = run_ranks(6, _moe_tp_cp3)
    assert all(o == out[0] for o in out)


def test_moe_tp2_with_runtime_cp_equals_tp2_without_cp():
    out = run_ranks(4, _moe_tp_runtime_cp, ("allgather", "alltoall"))
    for d in ("allgather", "alltoall", "global"):
        assert out[0][d][-1] < out[0][d][0] and all(o[d] == out[0][d] for o in out)
    assert "TP2" in out[0]["refused"]
    # the static groups (before the binding): the language-model loss is right, the CP2 microbatches' auxiliary
    # losses are not (each TP pair counts its CP rank's half of the tokens)
    static = out[0]["static"]
    assert all(lm < 1e-5 for _, lm, _ in static)
    assert all(err > 0.05 for cp, _, err in static if cp == 2) and any(cp == 2 for cp, _, _ in static)
