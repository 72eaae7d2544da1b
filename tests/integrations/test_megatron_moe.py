"""A real megatron-core 0.19.2 MoE GPTModel under cpscope's runtime CP on 4 gloo CPU ranks (skipped without it).

The model (local spec, 4 experts, top-2, fp32 or float64) is built with CP1 and trained 3 steps with mixed CP4 /
CP2 / CP1 ``thd`` microbatches through :func:`enable_runtime_cp`; the loss of every step, every auxiliary loss of
every microbatch and layer (the value the router attaches to the graph: ``aux_loss``, ``seq_aux_loss``,
``global_aux_loss``, z-loss), the gradients and the weights equal the *unmodified* model run without CP.

The reference runs each microbatch's documents as one ``bshd`` sequence with a block-diagonal causal mask: the
router then sees the microbatch's tokens together, as it does in ``thd`` without CP (``seq_aux_loss`` takes the
packed microbatch as one sequence there), and RoPE is relative, so positions running on across documents change
no score (checked against each document alone). For the global aux loss, whose token counts span every microbatch
that runs at the same forward index across the job (Megatron's data-parallel semantics; every rank runs one
forward per index in these plans), the reference runs each index's microbatches as the rows of one padded batch
with Megatron's ``padding_mask``, on a model whose ``tp_dp_cp`` group is this rank alone (one process).

Without the router binding (the static CP1 groups, what an adapter without :mod:`._moe` leaves), the CP4 and CP2
microbatches' load-balancing losses come out wrong while the language-model loss is right: that failure mode is a
test of its own.

CPU shims (test-side only; no Megatron file changes): ``torch.cuda.current_device`` → ``"cpu"`` (the router moves
its weights there in every forward), a no-op CUDA RNG tracker, and for the ``alltoall`` dispatcher CUDA streams /
events that do nothing (it syncs device-to-host copies on a side stream).
"""
from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import cpscope
from tests.distributed import run_ranks
from tests.integrations.test_megatron_core import (
    IGNORE,
    LENGTHS,
    PLANS,
    VOCAB,
    _assert_close,
    _for_rank,
    _grads,
    _init_megatron,
    _megatron_available,
    _megatron_batch,
    _mb,
    _reference_cpu_shims,
)

pytestmark = pytest.mark.skipif(not _megatron_available(), reason="megatron-core 0.19.2 (with triton) is not installed")

EXPERTS, TOPK = 4, 2
PER_MICROBATCH = {"moe_router_load_balancing_type": ["aux_loss", "seq_aux_loss"], "moe_aux_loss_coeff": [0.3, 0.2],
                  "moe_z_loss_coeff": 0.05}
GLOBAL = {"moe_router_load_balancing_type": "global_aux_loss", "moe_aux_loss_coeff": 0.3}


# ------------------------------------------------------------------------------------------------ shims & model


class _Stream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def record_event(self, *args: Any) -> Any:
        return _Stream()

    def synchronize(self) -> None:
        pass


@contextlib.contextmanager
def _moe_cpu_shims():
    """What megatron's MoE layers need on a CPU-only host (module docstring), around build and run."""
    cuda = torch.cuda
    saved = cuda.Stream, cuda.current_stream, cuda.stream
    current = _Stream()
    cuda.Stream, cuda.current_stream, cuda.stream = _Stream, lambda *a: current, lambda s: contextlib.nullcontext()
    try:
        with _reference_cpu_shims():
            yield
    finally:
        cuda.Stream, cuda.current_stream, cuda.stream = saved


def _moe_config(dtype: torch.dtype, dispatcher: str, losses: dict, **overrides: Any) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(
        num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=8,
        use_cpu_initialization=True, params_dtype=dtype, attention_dropout=0.0, hidden_dropout=0.0,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, add_bias_linear=False,
        num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=16, moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=False, moe_permute_fusion=False, moe_router_fusion=False, **losses,
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


def _build_moe(dtype: torch.dtype, dispatcher: str, losses: dict, pg_collection: Any = None, **overrides: Any) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    with _moe_cpu_shims():
        model = GPTModel(_moe_config(dtype, dispatcher, losses, **overrides),
                         get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False), vocab_size=VOCAB,
                         max_sequence_length=256, position_embedding_type="rope", pg_collection=pg_collection)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * 0.3)
    return model.to(dtype)


def _single_process_groups() -> Any:
    """Megatron's groups, except ``tp_dp_cp``: this rank alone (the reference is one process without CP)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]  # collective: every rank makes all
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    pgs.tp_dp_cp = singles[dist.get_rank()]
    return pgs


@contextlib.contextmanager
def _aux_spy(log: list):
    """Record every auxiliary loss the routers attach to the graph (z-loss, aux, seq aux, global aux, in order)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    saved = MoEAuxLossAutoScaler.__dict__.get("apply")  # torch.autograd.Function's own classmethod: not here
    original = MoEAuxLossAutoScaler.apply

    def spy(output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        log.append(float(aux_loss.detach()))
        return original(output, aux_loss)

    MoEAuxLossAutoScaler.apply = staticmethod(spy)
    try:
        yield
    finally:
        if saved is None:
            del MoEAuxLossAutoScaler.apply
        else:
            MoEAuxLossAutoScaler.apply = saved


def _max_err(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) / max(1.0, float(b[k].abs().max())) for k in b)


def _reset_global_aux(model: Any) -> None:
    for m in model.modules():
        if hasattr(m, "reset_global_aux_loss_tracker"):
            m.reset_global_aux_loss_tracker()


# ------------------------------------------------------------------------------------------------ the two runs


def _spied_forward(plan: list, logs: dict):
    """``megatron_forward`` that records each microbatch's auxiliary losses in ``logs[its index in plan]``."""
    from cpscope.integrations.megatron import megatron_forward

    def forward(m: Any, mb: Any) -> torch.Tensor:
        log: list = []
        with _aux_spy(log):
            out = megatron_forward(m, mb)
        logs[next(i for i, p in enumerate(plan) if p.seqs == mb.seqs)] = log
        return out

    return forward


def _cp_step(model: Any, plan: list, docs: list, groups: dict) -> tuple[float, int, dict]:
    """cpscope's loop on this rank's microbatches; returns the loss, the target count and, per microbatch of the
    plan (by position), the auxiliary losses summed over its CP group's ranks."""
    from cpscope.integrations.megatron import prepare_megatron_microbatches
    from cpscope.train._loop import allreduce_gradients, allreduce_sum, global_num_targets, run_microbatches

    mine = _for_rank(plan, dist.get_rank())
    mbs = prepare_megatron_microbatches(mine, docs, groups)
    logs: dict[int, list] = {}
    forward = _spied_forward(plan, logs)

    n = global_num_targets(mbs, dp_group=dist.group.WORLD)
    with _moe_cpu_shims():
        local = run_microbatches(model, mbs, num_targets=n, dp_group=dist.group.WORLD, forward=forward)
    allreduce_gradients(model, dp_group=dist.group.WORLD)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, logs)
    summed: dict[int, list] = {}
    for rank_logs in gathered:
        for i, log in rank_logs.items():
            summed[i] = log if i not in summed else [a + b for a, b in zip(summed[i], log)]
    return float(allreduce_sum(local, group=dist.group.WORLD)) / n, n, summed


def _packed(docs: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A microbatch's documents as one sequence: tokens, labels, block-diagonal causal mask (True = masked)."""
    tokens = torch.cat([d.tokens for d in docs])
    labels = torch.cat([d.labels for d in docs])
    n = tokens.numel()
    mask = torch.ones(n, n, dtype=torch.bool)
    start = 0
    for d in docs:
        end = start + len(d)
        mask[start:end, start:end] = torch.triu(torch.ones(len(d), len(d), dtype=torch.bool), 1)
        start = end
    return tokens, labels, mask


def _reference_rows(ref: Any, rows: list, n_targets: int, log: list) -> torch.Tensor:
    """One forward of the unmodified model: each row a microbatch (packed documents), padded to the longest row
    with Megatron's padding_mask; Σ CE / n_targets, backward. Returns the loss sum."""
    packed = [_packed(docs) for docs in rows]
    s = max(t.numel() for t, _, _ in packed)
    b = len(rows)
    tokens = torch.zeros(b, s, dtype=torch.long)
    labels = torch.full((b, s), IGNORE, dtype=torch.long)
    mask = torch.ones(b, 1, s, s, dtype=torch.bool)
    pad = torch.ones(b, s, dtype=torch.bool)
    for i, (t, y, m) in enumerate(packed):
        n = t.numel()
        tokens[i, :n], labels[i, :n], mask[i, 0, :n, :n], pad[i, :n] = t, y, m, False
        mask[i, 0, n:, :] = torch.triu(torch.ones(s - n, s, dtype=torch.bool), n + 1)  # pads: causal, harmless
    with _moe_cpu_shims(), _aux_spy(log):
        logits = ref(tokens, torch.arange(s)[None].expand(b, -1), mask, padding_mask=pad if b > 1 else None)
    loss = F.cross_entropy(logits.reshape(b * s, -1), labels.reshape(-1), ignore_index=IGNORE, reduction="sum")
    (loss / n_targets).backward()
    return loss.detach().double()


def _index_sets(plan: list, world: int) -> list[list[int]]:
    """Per forward index, the plan positions of the microbatches that run then (each once)."""
    per_rank = [[i for i, mb in enumerate(plan) if r in mb.ranks] for r in range(world)]
    assert len({len(x) for x in per_rank}) == 1, "every rank must run as many microbatches (global aux loss)"
    return [sorted({lst[j] for lst in per_rank}) for j in range(len(per_rank[0]))]


def _expert_bias_step(model: Any, ref: Any, alone: Any) -> float:
    """Megatron's step end for aux-loss-free balancing (``finalize_model_grads``): the tokens each router counted,
    summed over the job's ranks, equal the reference's count (exactly), then both update their expert bias
    (the model over the whole job, the reference over this rank ``alone``) and reset the counts. Returns the
    largest expert bias (nonzero: later steps route with it)."""
    from megatron.core.distributed.finalize_model_grads import (
        _update_router_expert_bias,
        reset_model_temporary_tensors,
    )

    routers, ref_routers = ([m for m in x.modules() if getattr(m, "expert_bias", None) is not None]
                            for x in (model, ref))
    assert len(routers) == len(ref_routers) == 2
    counts = torch.stack([r.local_tokens_per_expert for r in routers])
    dist.all_reduce(counts)
    want = torch.stack([r.local_tokens_per_expert for r in ref_routers])
    assert float(want.sum()) > 0 and torch.equal(counts, want), (counts, want)
    for m, group in ((model, dist.group.WORLD), (ref, alone)):
        _update_router_expert_bias([m], m.config, tp_dp_cp_group=group)
        reset_model_temporary_tensors(m.config, [m])
    for r, w in zip(routers, ref_routers):
        assert torch.equal(r.expert_bias, w.expert_bias), (r.expert_bias, w.expert_bias)
    return max(float(r.expert_bias.abs().max()) for r in routers)


def _train(dtype: torch.dtype, dispatcher: str, losses: dict, steps: int, tol: float, bind: bool = True,
           plans: Any = None, **overrides: Any) -> dict:
    from cpscope.integrations.megatron import documents_from_batch, enable_runtime_cp

    _init_megatron()
    plans = PLANS if plans is None else plans
    groups = cpscope.new_cp_groups(sorted({mb.cp for plan in plans for mb in plan} | {1}))
    per_index = "global_aux_loss" in losses["moe_router_load_balancing_type"]
    expert_bias = overrides.get("moe_router_enable_expert_bias", False)
    expects_aux = losses["moe_router_load_balancing_type"] != "none" or bool(losses.get("moe_z_loss_coeff"))
    alone = _single_process_groups().tp_dp_cp if expert_bias else None
    model = _build_moe(dtype, dispatcher, losses, **overrides)
    ref = _build_moe(dtype, dispatcher, losses, pg_collection=_single_process_groups() if per_index else None,
                     **overrides)
    names = enable_runtime_cp(model)
    assert "decoder.layers.0" in names and "decoder.layers.1" in names  # the MoE layers
    if not bind:  # the static groups: undo the router binding only (the failure mode)
        for m in model.modules():
            if type(m).__name__ == "TransformerLayer" and hasattr(type(m), "_cpscope_base"):
                m.__class__ = type(m)._cpscope_base
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref))
    out: dict = {"loss": [], "ref_loss": [], "aux": [], "ref_aux": [], "grad_err": [], "aux_err": [], "bias": []}
    for step in range(steps):
        docs = documents_from_batch(_megatron_batch(LENGTHS, seed=10 + step))
        plan = plans[step % len(plans)]
        loss, n, aux = _cp_step(model, plan, docs, groups)
        ref_aux: dict[int, list] = {}
        total = torch.zeros((), dtype=torch.float64)
        for members in (_index_sets(plan, dist.get_world_size()) if per_index else [[i] for i in range(len(plan))]):
            log: list = []
            total += _reference_rows(ref, [[docs[j] for j in plan[i].seqs] for i in members], n, log)
            for i in members:
                ref_aux[i] = log  # one list per forward: each microbatch of it carries the whole forward's
        if per_index:  # compare per forward index: the sums over its microbatches
            aux = {k: [sum(x) for x in zip(*(aux[i] for i in members))]
                   for k, members in enumerate(_index_sets(plan, dist.get_world_size()))}
            ref_aux = {k: ref_aux[members[0]] for k, members in enumerate(_index_sets(plan, dist.get_world_size()))}
        out["loss"].append(loss)
        out["ref_loss"].append(float(total) / n)
        out["aux"].append(aux)
        out["ref_aux"].append(ref_aux)
        out["grad_err"].append(_max_err(_grads(model), _grads(ref)))
        out["aux_err"].append(max((abs(a - b) / max(1.0, abs(b)) for i in ref_aux for a, b in zip(aux[i], ref_aux[i])),
                                  default=0.0))
        if bind:
            assert abs(loss - float(total) / n) <= tol * max(1.0, abs(float(total) / n)), (step, loss, total / n)
            for i in ref_aux:
                assert len(aux[i]) == len(ref_aux[i]) > (0 if expects_aux else -1)
                for a, b in zip(aux[i], ref_aux[i]):
                    assert abs(a - b) <= tol * max(1.0, abs(b)), (step, i, aux[i], ref_aux[i])
            _assert_close(_grads(model), _grads(ref), tol, f"step {step} gradients")
        if expert_bias:
            out["bias"].append(_expert_bias_step(model, ref, alone))
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad(set_to_none=True)
        _reset_global_aux(model)
        _reset_global_aux(ref)
    out["weight_err"] = _max_err(dict(model.named_parameters()), dict(ref.named_parameters()))
    if bind:
        _assert_close(dict(model.named_parameters()), dict(ref.named_parameters()), tol, "parameters after training")
    return out


def _reference_is_each_document_alone() -> float:
    """The packed reference (block-diagonal mask, positions running on) equals each document alone."""
    from cpscope.integrations.megatron import documents_from_batch

    _init_megatron()
    ref = _build_moe(torch.float64, "allgather", {"moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0})
    docs = documents_from_batch(_megatron_batch(LENGTHS[:3], seed=3))
    tokens, _, mask = _packed(docs)
    with torch.no_grad(), _moe_cpu_shims():
        packed = ref(tokens[None], torch.arange(tokens.numel())[None], mask[None, None])[0]
        alone = torch.cat([ref(d.tokens[None], torch.arange(len(d))[None],
                               torch.triu(torch.ones(len(d), len(d), dtype=torch.bool), 1)[None, None])[0]
                           for d in docs])
    return float((packed - alone).abs().max())


def _tracker_groups_restored() -> None:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from cpscope.integrations.megatron import enable_runtime_cp

    _init_megatron()
    g2 = cpscope.new_cp_groups([1, 2])[2]
    model = _build_moe(torch.float32, "allgather", PER_MICROBATCH)
    enable_runtime_cp(model)
    router = model.decoder.layers[0].mlp.router
    static = (router.tp_cp_group, router.cp_group, router.config)
    cu = torch.tensor([0, 12, 18], dtype=torch.int32)  # 18 real tokens padded to 12 + 8 at CP2
    padded = torch.tensor([0, 12, 20], dtype=torch.int32)
    ids = cpscope.zigzag_shard(torch.randint(0, VOCAB, (20,)), seq_dim=0, cu_seqlens=padded, group=g2)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded,
                          cu_seqlens_kv_padded=padded, max_seqlen_q=12, max_seqlen_kv=12, cp_group=g2,
                          local_cp_size=2)
    seen = []
    original = type(router).routing

    def routing(self: Any, logits: torch.Tensor, padding_mask: Any = None) -> Any:
        seen.append((self.tp_cp_group, int((~padding_mask).sum())))
        return original(self, logits, padding_mask)

    type(router).routing = routing
    try:
        with _moe_cpu_shims():
            model(ids[None], None, None, packed_seq_params=psp).sum().backward()
    finally:
        type(router).routing = original
    assert seen[0][0] is g2 and len(seen) == 2  # both layers' routers ran with the CP2 group
    real = sum(int(i) < 18 for i in cpscope.zigzag_indices(padded, 2, dist.get_rank()))  # tokens 18, 19: padding
    assert seen[0][1] == real == (8, 10)[dist.get_rank()]  # padding (tokens 18, 19 on rank 0) not counted
    assert all(a is b for a, b in zip((router.tp_cp_group, router.cp_group, router.config), static))  # restored
    for name in ("load_balancing_loss", "seq_load_balancing_loss"):
        assert get_moe_metrics_tracker().metrics[name].reduce_group is static[0]


def _recompute_full() -> None:
    """Megatron's full-layer recompute of MoE layers under CP2: the router's aux losses are computed in the
    recompute during backward, with the groups of the carried scope (no ContextVar read in backward)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from cpscope.integrations.megatron import enable_runtime_cp
    from tests.integrations.test_megatron_core import _recompute_cpu_shims

    _init_megatron()
    g2 = cpscope.new_cp_groups([1, 2])[2]
    plain = _build_moe(torch.float32, "allgather", PER_MICROBATCH)
    rec = _build_moe(torch.float32, "allgather", PER_MICROBATCH, recompute_granularity="full",
                     recompute_method="uniform", recompute_num_layers=1)
    cu, padded = torch.tensor([0, 13, 19], dtype=torch.int32), torch.tensor([0, 16, 24], dtype=torch.int32)
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(5))
    local = cpscope.zigzag_shard(ids, seq_dim=0, cu_seqlens=padded, group=g2)
    target = cpscope.zigzag_shard(torch.roll(ids, -1), seq_dim=0, cu_seqlens=padded, group=g2)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded,
                          cu_seqlens_kv_padded=padded, max_seqlen_q=16, max_seqlen_kv=16, cp_group=g2,
                          local_cp_size=2)
    logs: list = [[], []]
    cpscope.set_backward_read_check(True)  # any ContextVar read during backward raises
    for m, log in zip((plain, rec), logs):
        enable_runtime_cp(m)
        with _recompute_cpu_shims(), _moe_cpu_shims(), _aux_spy(log):
            with cpscope.runtime_cp(None):  # an unrelated enclosing scope: the psp's group must win
                logits = m(local[None], None, None, packed_seq_params=psp)[0]
            F.cross_entropy(logits, target, reduction="sum").backward()  # outside every scope
    # the same aux losses, computed in the recompute (layers in reverse order there)
    assert len(logs[1]) == len(logs[0]) > 0
    assert all(abs(a - b) <= 1e-6 * max(1.0, abs(b)) for a, b in zip(sorted(logs[1]), sorted(logs[0]))), logs
    _assert_close(_grads(rec), _grads(plain), 1e-6, "MoE full recompute")


def _refusals() -> None:
    from types import SimpleNamespace

    from cpscope.integrations.megatron import enable_runtime_cp
    from cpscope.integrations.megatron._moe import moe_refusals

    base = dict(num_moe_experts=4, tensor_model_parallel_size=1, expert_model_parallel_size=1,
                expert_tensor_parallel_size=1, recompute_granularity=None, recompute_modules=None,
                moe_router_load_balancing_type="aux_loss")
    assert moe_refusals(SimpleNamespace(**base)) == [] and moe_refusals(SimpleNamespace(num_moe_experts=None)) == []
    assert moe_refusals(SimpleNamespace(**{**base, "tensor_model_parallel_size": 2,
                                           "expert_tensor_parallel_size": 2})) == []  # TP: test_megatron_tp_moe
    for change, text in (({"tensor_model_parallel_size": 2}, "expert_tensor_parallel_size=1 with "
                                                             "tensor_model_parallel_size=2"),
                         ({"expert_model_parallel_size": 4}, "expert_model_parallel_size=4"),
                         ({"recompute_granularity": "selective", "recompute_modules": ["moe"]}, "'moe'"),
                         ({"moe_router_load_balancing_type": "quantile_balancing"}, "quantile_balancing")):
        got = moe_refusals(SimpleNamespace(**{**base, **change}))
        assert len(got) == 1 and text in got[0], got
    _init_megatron()
    # Mamba and linear-attention (gated delta net) mixers need mamba-ssm / fla kernels, absent here: stand-ins by
    # class name, which is what the refusal reads
    for mixer in ("MambaMixer", "GatedDeltaNet"):
        model = _build_moe(torch.float32, "allgather", PER_MICROBATCH)
        model.decoder.add_module("mixer", type(mixer, (torch.nn.Module,), {})())
        with pytest.raises(ValueError, match=f"{mixer} modules"):
            enable_runtime_cp(model)
    names = enable_runtime_cp(_build_mtp())  # MoE with multi-token prediction: the MTP layer's router is bound too
    assert "" in names and "mtp.layers.0.mtp_model_layer" in names, names  # (MTP parity: test_megatron_mtp)


def _bare_moe_layer() -> None:
    """A bare MoE ``TransformerLayer`` as the entry keeps its entry state: its forward equals the unmodified one's."""
    from cpscope.integrations.megatron import enable_runtime_cp

    layer, ref = (_build_moe(torch.float32, "allgather", PER_MICROBATCH).decoder.layers[0] for _ in range(2))
    enable_runtime_cp(layer)
    hidden = torch.randn(12, 1, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), _moe_cpu_shims():
        got, want = layer(hidden)[0], ref(hidden, torch.triu(torch.ones(12, 12, dtype=torch.bool), 1)[None, None])[0]
    assert float((got - want).abs().max()) < 1e-5


def _build_mtp() -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec

    config = _moe_config(torch.float32, "allgather", PER_MICROBATCH, mtp_num_layers=1)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    with _moe_cpu_shims():
        return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=256, position_embedding_type="rope",
                        mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False))


# ------------------------------------------------------------------------------------------------ tests


def test_packed_reference_equals_each_document_alone():
    # float64 model; Megatron's RoPE angles are float32 (position × inv_freq), so running positions differ from
    # restarted ones by float32 rounding of the angles: ~5e-8 here, the floor of every float64 figure below
    assert max(run_ranks(2, _reference_is_each_document_alone)) < 1e-6  # the 2-rank pool (megatron loaded)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_moe_trains_with_mixed_cp_equal_to_no_cp(dispatcher):
    """aux_loss + seq_aux_loss + z-loss, fp32, 3 steps (CP4 / CP2 / CP1 microbatches)."""
    out = run_ranks(4, _train, torch.float32, dispatcher, PER_MICROBATCH, 3, 1e-5)[0]
    assert out["loss"][-1] < out["loss"][0]


# Mixed CP3 / CP1 plans for 3 ranks (a CP size that is not a power of two)
PLANS_CP3 = [
    [_mb(3, 0, (0,)), _mb(3, 0, (1, 2)), _mb(1, 0, (3,)), _mb(1, 1, (4, 5)), _mb(1, 2, (6, 7))],
    [_mb(3, 0, (3, 1)), _mb(1, 0, (0,)), _mb(1, 1, (2, 4)), _mb(1, 2, (5, 6, 7))],
]


def test_moe_trains_with_cp3_equal_to_no_cp():
    """aux_loss + seq_aux_loss + z-loss at CP3 / CP1 on 3 ranks, fp32, 2 steps (zigzag padding to multiples of 6)."""
    run_ranks(3, _train, torch.float32, "alltoall", PER_MICROBATCH, 2, 1e-5, True, PLANS_CP3)


def test_moe_global_aux_loss_equal_to_no_cp():
    run_ranks(4, _train, torch.float32, "allgather", GLOBAL, 3, 1e-5)


EXPERT_BIAS = {"moe_router_enable_expert_bias": True, "moe_router_score_function": "sigmoid",
               "moe_router_bias_update_rate": 0.05}


@pytest.mark.parametrize("losses", [{"moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0},
                                    {"moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 0.01}],
                         ids=["aux_loss_free", "with_seq_aux_loss"])
def test_moe_expert_bias_trains_equal_to_no_cp(losses):
    """Aux-loss-free balancing (sigmoid router with expert bias, as in DeepSeek-V3; with DeepSeek-V3's small
    sequence aux loss too), mixed CP4 / CP2 / CP1 ``thd`` microbatches with zigzag padding, 3 steps: loss,
    gradients and weights equal the model without CP, and so do the tokens counted per expert (summed over the job)
    and the expert bias Megatron's step end derives from them, which the later steps route with."""
    out = run_ranks(4, _train, torch.float32, "alltoall", losses, 3, 1e-5, True, None, **EXPERT_BIAS)[0]
    assert len(out["bias"]) == 3 and out["bias"][0] > 0


def test_moe_float64_step():
    # float64 weights and activations; the router's aux-loss scores are float32 in megatron-core
    # (compute_routing_scores_for_aux_loss) and its RoPE angles too: 1e-6, not 1e-9
    run_ranks(4, _train, torch.float64, "alltoall", PER_MICROBATCH, 1, 1e-6)


def test_static_groups_give_the_wrong_aux_loss():
    """The failure mode without the router binding: the language-model loss is right, the load-balancing losses
    of the CP4 and CP2 microbatches are not."""
    out = run_ranks(4, _train, torch.float32, "allgather", PER_MICROBATCH, 1, 1e-5, False)[0]
    assert abs(out["loss"][0] - out["ref_loss"][0]) < 1e-5  # the forward itself follows the scope
    aux, ref = out["aux"][0], out["ref_aux"][0]
    for i, mb in enumerate(PLANS[0]):  # [z, aux, seq aux] per layer
        rel = max(abs(a - b) / abs(b) for a, b in zip(aux[i], ref[i]))
        if mb.cp > 1:  # computed on each rank's part of the sequence (and padding counted)
            assert rel > 0.05, (mb, aux[i], ref[i])
        elif all(LENGTHS[j] % 2 == 0 for j in mb.seqs):  # CP1 without zigzag padding: right
            assert rel < 1e-5, (mb, aux[i], ref[i])


def test_router_groups_and_padding_bound_per_call_and_restored():
    run_ranks(2, _tracker_groups_restored)


def test_moe_full_recompute_under_runtime_cp():
    run_ranks(2, _recompute_full)


def test_moe_refusals():
    run_ranks(2, _refusals)  # local checks; the 2-rank pool has megatron-core loaded already
    run_ranks(2, _bare_moe_layer)
