"""A real megatron-core 0.19.2 GPTModel with multi-token prediction under cpscope's runtime CP (gloo CPU ranks).

The model (local spec, RoPE, GQA, two MTP layers, float64) is built with CP1 and trained with mixed CP2 / CP1
``thd`` microbatches (odd document lengths: cpscope pads them to ``2·cp``) through :func:`enable_runtime_cp` and
cpscope's loop (``megatron_forward``: no labels, so Megatron derives the MTP targets from the input ids). Against
the *unmodified* model run without CP (each document alone, ``bshd`` with its causal mask), for every step:

* the language-model loss;
* each microbatch's MTP loss at each depth: the value ``process_mtp_loss`` attaches to the graph, summed over the
  microbatch's CP ranks, equals the unmodified model's MTP loss of that microbatch (its summed per-token MTP loss
  over its MTP targets, the per-microbatch mean Megatron computes without CP, times ``mtp_loss_scaling_factor /
  mtp_num_layers``); the reference takes it from each document alone, weighted by its share of the targets;
* all gradients (``MTPLossAutoScaler``'s scale set to 0.25 for both), and the weights after the optimizer steps.

In the same call, ``bshd`` under ``runtime_cp(CP2)`` (Megatron's dense CP roll): the MTP losses summed over the
ranks and the summed gradients equal the unmodified model's on the whole batch.

Also: megatron's ``roll_tensor`` is its own again after every call and after an exception, ``disable_runtime_cp``
restores the model's class, and ``calculate_per_token_loss`` with MTP is refused.

CPU shims (test-side only): ``torch.cuda.current_device`` → ``"cpu"`` for both models (Megatron's MTP loss tracker
allocates there; the reference's RoPE too) and a no-op CUDA RNG tracker (the reference's local attention).
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
    VOCAB,
    _assert_close,
    _config,
    _for_rank,
    _grads,
    _init_megatron,
    _megatron_available,
    _megatron_batch,
    _mb,
    _reference_cpu_shims,
)

pytestmark = pytest.mark.skipif(not _megatron_available(), reason="megatron-core 0.19.2 (with triton) is not installed")

MTP_LAYERS, MTP_FACTOR, MTP_SCALE = 2, 0.3, 0.25
LENGTHS = [14, 9, 11, 6, 7, 13]
PLANS = [  # 2 ranks: CP2 and CP1 microbatches, several documents per microbatch
    [_mb(2, 0, (0, 1)), _mb(1, 0, (2,)), _mb(1, 1, (3, 4, 5))],
    [_mb(2, 0, (5,)), _mb(2, 0, (2, 3)), _mb(1, 0, (0, 4)), _mb(1, 1, (1,))],
]


def _build_mtp(seed: int = 0, **overrides: Any) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec

    config = _config(mtp_num_layers=MTP_LAYERS, mtp_loss_scaling_factor=MTP_FACTOR, **overrides)
    spec = get_gpt_layer_local_spec()
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=256, position_embedding_type="rope",
                     mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * 0.3)
    return model.to(torch.float64)


@contextlib.contextmanager
def _mtp_spy(log: list, weights: Any = None):
    """Record the sum of every MTP loss ``process_mtp_loss`` attaches (one per depth, in order); with ``weights``
    (a callable of the depth), the attached loss is multiplied by it first (the reference's per-document share)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    saved = MTPLossAutoScaler.__dict__.get("apply")
    original = MTPLossAutoScaler.apply

    def spy(output: torch.Tensor, mtp_loss: torch.Tensor) -> torch.Tensor:
        log.append(float(mtp_loss.detach().sum()))
        return original(output, mtp_loss if weights is None else mtp_loss * weights(len(log) - 1))

    MTPLossAutoScaler.apply = staticmethod(spy)
    try:
        yield
    finally:
        if saved is None:
            del MTPLossAutoScaler.apply
        else:
            MTPLossAutoScaler.apply = saved


def _mtp_targets(n: int, depth: int) -> int:
    """MTP targets of a document of ``n`` tokens at ``depth`` (0-based): labels derived from the input ids miss
    the last token, each depth one more."""
    return max(n - 2 - depth, 0)


def _cp_step(model: Any, plan: list, docs: list, groups: dict) -> tuple[float, int, dict]:
    """cpscope's loop on this rank's microbatches: the loss, the target count and, per microbatch of the plan (by
    its documents), the MTP loss of each depth summed over its CP ranks."""
    from cpscope.integrations.megatron import megatron_forward, prepare_megatron_microbatches
    from cpscope.train._loop import allreduce_gradients, allreduce_sum, global_num_targets, run_microbatches

    mbs = prepare_megatron_microbatches(_for_rank(plan, dist.get_rank()), docs, groups)
    shares: list = []

    def forward(m: Any, mb: Any) -> torch.Tensor:
        log: list = []
        with _mtp_spy(log):
            out = megatron_forward(m, mb)
        shares.append((mb.seqs, log))
        return out

    dp = dist.group.WORLD
    n = global_num_targets(mbs, dp_group=dp)
    local = run_microbatches(model, mbs, num_targets=n, dp_group=dp, forward=forward)
    allreduce_gradients(model, dp_group=dp)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, shares)
    mtp: dict = {}
    for rank_shares in every:
        for seqs, log in rank_shares:
            assert len(log) == MTP_LAYERS, log
            mtp[seqs] = [a + b for a, b in zip(mtp.get(seqs, [0.0] * MTP_LAYERS), log)]
    return float(allreduce_sum(local, group=dp)) / n, n, mtp


def _reference_step(ref: Any, plan: list, docs: list, n_targets: int) -> tuple[float, dict]:
    """The unmodified model without CP, each document alone (bshd, causal mask): Σ CE / N plus, per microbatch,
    its MTP loss (each document's weighted by its share of the microbatch's MTP targets); backward."""
    total, mtp = 0.0, {}
    for mb in plan:
        counts = [sum(_mtp_targets(len(docs[i]), k) for i in mb.seqs) for k in range(MTP_LAYERS)]
        mtp[mb.seqs] = [0.0] * MTP_LAYERS
        for i in mb.seqs:
            d, log = docs[i], []
            n = len(d)
            share = [_mtp_targets(n, k) / counts[k] for k in range(MTP_LAYERS)]
            with _mtp_spy(log, lambda k: share[k]):
                logits = ref(d.tokens[None], torch.arange(n)[None], torch.triu(torch.ones(n, n, dtype=torch.bool),
                                                                                 1)[None, None])[0]
            loss = F.cross_entropy(logits, d.labels, ignore_index=IGNORE, reduction="sum")
            (loss / n_targets).backward()
            total += float(loss)
            for k in range(MTP_LAYERS):
                mtp[mb.seqs][k] += share[k] * log[k]
    return total / n_targets, mtp


def _mtp_parity(steps: int, tol: float, tol_mtp: float) -> list[float]:
    from megatron.core.transformer import multi_token_prediction as mtp_module
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    from cpscope.integrations.megatron import disable_runtime_cp, documents_from_batch, enable_runtime_cp

    _init_megatron()
    groups = cpscope.new_cp_groups([1, 2])
    model, ref = _build_mtp(), _build_mtp()
    cls, roll = type(model), mtp_module.roll_tensor
    names = enable_runtime_cp(model)
    assert "" in names and "mtp.layers.0.mtp_model_layer.self_attention.core_attention" in names, names
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref)]
    MTPLossAutoScaler.set_loss_scale(torch.tensor(MTP_SCALE, dtype=torch.float64))
    losses = []
    try:
        with _reference_cpu_shims():
            for step in range(steps):
                plan = PLANS[step % len(PLANS)]
                docs = documents_from_batch(_megatron_batch(LENGTHS, seed=20 + step))
                loss, n, mtp = _cp_step(model, plan, docs, groups)
                assert mtp_module.roll_tensor is roll  # Megatron's own again after every call
                ref_loss, ref_mtp = _reference_step(ref, plan, docs, n)
                assert abs(loss - ref_loss) <= tol * max(1.0, abs(ref_loss)), (step, loss, ref_loss)
                assert mtp.keys() == ref_mtp.keys()
                for seqs, want in ref_mtp.items():
                    got = mtp[seqs]
                    assert all(abs(a - b) <= tol_mtp * max(1.0, abs(b)) for a, b in zip(got, want)), (step, seqs, got,
                                                                                                     want)
                _assert_close(_grads(model), _grads(ref), tol_mtp, f"step {step} gradients")
                for o in opts:
                    o.step()
                    o.zero_grad(set_to_none=True)
                losses.append(loss)
            _assert_close(dict(model.named_parameters()), dict(ref.named_parameters()), tol_mtp, "weights after steps")
            _exception_restores(model, roll)
            _dense_mtp(groups, tol_mtp)
    finally:
        MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    disable_runtime_cp(model)
    assert type(model) is cls
    with pytest.raises(ValueError, match="mtp_num_layers=2 with calculate_per_token_loss=True"):
        enable_runtime_cp(_build_mtp(calculate_per_token_loss=True))
    return losses


def _dense_mtp(groups: dict, tol: float) -> None:
    """``bshd`` under ``runtime_cp(CP2)`` (no ``PackedSeqParams``: Megatron's dense CP roll, the microbatch's group):
    the MTP losses summed over the ranks and the summed gradients equal the unmodified model's on the whole batch."""
    from cpscope.integrations.megatron import enable_runtime_cp
    from cpscope.train._loop import allreduce_gradients

    model, ref = _build_mtp(seed=1), _build_mtp(seed=1)
    enable_runtime_cp(model)
    b, s = 2, 24
    ids = torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(5))
    labels = torch.cat([ids[:, 1:], torch.full((b, 1), IGNORE)], dim=1)
    n = b * (s - 1)
    want: list = []
    with _mtp_spy(want):
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
        logits = ref(ids, torch.arange(s)[None].expand(b, -1), causal)
    (F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum") / n).backward()
    got: list = []
    with cpscope.runtime_cp(groups[2]), _mtp_spy(got):
        local = model(cpscope.zigzag_shard(ids, seq_dim=1), None, None)
    mine = cpscope.zigzag_shard(labels, seq_dim=1, group=groups[2])
    (F.cross_entropy(local.flatten(0, 1), mine.flatten(), ignore_index=IGNORE, reduction="sum") / n).backward()
    allreduce_gradients(model, dp_group=dist.group.WORLD)
    total = torch.tensor(got, dtype=torch.float64)
    dist.all_reduce(total)
    assert len(want) == MTP_LAYERS and torch.allclose(total, torch.tensor(want, dtype=torch.float64), rtol=tol,
                                                      atol=tol), (total, want)
    _assert_close(_grads(model), _grads(ref), tol, "bshd CP2 gradients")


def _exception_restores(model: Any, roll: Any) -> None:
    """An exception inside the MTP block: Megatron's ``roll_tensor`` is its own again."""
    from megatron.core.transformer import multi_token_prediction as mtp_module

    from cpscope.integrations.megatron import prepare_megatron_microbatch
    from cpscope.integrations.megatron._data import Document

    doc = Document(torch.arange(1, 9), torch.arange(2, 10))
    mb = prepare_megatron_microbatch([doc], cp=1, group=None)
    layer = model.mtp.layers[0].mtp_model_layer

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise KeyError("planted")

    layer.forward = boom
    try:
        with pytest.raises(KeyError, match="planted"):
            model(mb.input_ids[None], mb.position_ids[None], None, packed_seq_params=mb.packed_seq_params())
    finally:
        del layer.forward
    assert mtp_module.roll_tensor is roll


def test_mtp_trains_with_cp2_and_cp1_equal_to_no_cp():
    """float64, 2 steps on 2 ranks. The language-model loss (cpscope's float64 cross entropy) to 1e-9; the MTP
    losses, and with them the gradients and weights, to 1e-7: Megatron's own cross entropy, which the MTP loss
    uses, computes in float32 (``vocab_parallel_cross_entropy`` casts the logits) in both runs."""
    losses = run_ranks(2, _mtp_parity, 2, 1e-9, 1e-7)[0]
    assert len(losses) == 2
