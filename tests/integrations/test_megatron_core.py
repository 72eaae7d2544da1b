"""Real megatron-core 0.19.2 under cpscope on gloo CPU ranks (skipped when megatron-core is not installed).

* Without cpscope, Megatron-LM #6821 on 0.19.2: a ``GPTModel`` built with CP1 given a CP2 ``thd`` microbatch fails in
  Megatron's own unfused RoPE (``split_with_sizes expects split_sizes to sum exactly to …``).
* With :func:`enable_runtime_cp`, a small real ``GPTModel`` (local spec, unfused RoPE, GQA, ``thd`` packed documents,
  fp32) built with CP1 trains 3 steps on 4 ranks with mixed CP4 / CP2 / CP1 microbatches; the loss of every step
  and the gradients equal the *unmodified* Megatron model run without CP (each document alone, ``bshd``, with its
  causal mask: Megatron's own attention and RoPE) to 1e-5, and a float64 step to 1e-9. The batch comes in Megatron's
  own shape (``tokens`` / ``labels`` / ``loss_mask`` / ``cu_seqlens``) through cpscope's data bridge and loop.
* Binding: both CP1 conventions, CP1 after CP2, the enclosing ``runtime_cp`` when ``PackedSeqParams`` names no group,
  contradictions and bad offsets as ``ValueError`` before any collective, build-time state restored after an
  exception, ``disable_runtime_cp``; unsupported options and versions refused.
* Megatron's own activation recompute (``full`` and ``selective``) under CP2 gives the gradients of the run without
  recompute, with cpscope's debug check proving no ContextVar read in backward; ``bshd`` + recompute is refused.
* ``bshd`` under ``runtime_cp(CP2)`` (no ``PackedSeqParams``): logits equal the unmodified model's, cut per rank.
* The planner bridge: a Megatron-shaped global batch through :class:`PlannerScheduler` (Megatron's scheduler
  interface) and cpscope's plan and loop equals the reference; :func:`shard_batch` equals Megatron's own
  ``get_batch_on_this_cp_rank`` (per-sequence form; the per-document form needs TE's kernels).

CPU shims (test-side only, no Megatron file is changed): the *reference* model runs Megatron's ``RotaryEmbedding``,
whose ``get_emb`` moves its table to ``torch.cuda.current_device()`` (made ``"cpu"`` for the call), and Megatron's
local attention, which forks the CUDA RNG tracker (a no-op tracker: dropout is 0). Megatron's recompute saves CUDA
RNG states (stubbed to nothing). The cpscope-enabled model needs none of them.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import warnings
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import cpscope
from tests.distributed import run_ranks


def _megatron_available() -> bool:
    try:
        version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return False
    return version.startswith("0.19.2") and importlib.util.find_spec("triton") is not None


pytestmark = pytest.mark.skipif(not _megatron_available(), reason="megatron-core 0.19.2 (with triton) is not installed")

VOCAB = 64
IGNORE = -100


# ------------------------------------------------------------------------------------------------ helpers (ranks)


def _init_megatron() -> None:
    """Megatron's parallel_state with TP = PP = CP = 1 over the pool's gloo world (once per pool process)."""
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1, context_parallel_size=1)


def _config(dtype: torch.dtype = torch.float32, **overrides: Any) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(
        num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=8,
        use_cpu_initialization=True, params_dtype=torch.float32, attention_dropout=0.0, hidden_dropout=0.0,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False,
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


def _build(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any) -> Any:
    """A small GPTModel (local spec, RoPE, GQA 4/2) with rank-independent weights."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    model = GPTModel(_config(**overrides), get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=256,
                     position_embedding_type="rope")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.to(dtype)


class _NoRngTracker:
    def fork(self, *args: Any, **kwargs: Any) -> Any:
        return contextlib.nullcontext()


@contextlib.contextmanager
def _reference_cpu_shims():
    """Let the *unmodified* megatron-core model run on CPU (see the module docstring)."""
    from megatron.core import tensor_parallel

    saved = torch.cuda.current_device, tensor_parallel.get_cuda_rng_tracker
    torch.cuda.current_device = lambda: "cpu"
    tensor_parallel.get_cuda_rng_tracker = lambda: _NoRngTracker()
    try:
        yield
    finally:
        torch.cuda.current_device, tensor_parallel.get_cuda_rng_tracker = saved


@contextlib.contextmanager
def _recompute_cpu_shims():
    """Megatron's CheckpointFunction saves / restores CUDA RNG states: nothing to save on a CPU-only host."""
    import megatron.core.tensor_parallel.random as tpr

    saved = tpr._get_cuda_rng_state, tpr._set_cuda_rng_state
    tpr._get_cuda_rng_state = lambda *a, **k: None
    tpr._set_cuda_rng_state = lambda *a, **k: None
    try:
        yield
    finally:
        tpr._get_cuda_rng_state, tpr._set_cuda_rng_state = saved


def _psp(cu: torch.Tensor, *, group: Any = None, local: Optional[int] = None, padded: Optional[torch.Tensor] = None,
         max_seqlen: Optional[int] = None) -> Any:
    from megatron.core.packed_seq_params import PackedSeqParams

    lay = cu if padded is None else padded
    m = int((lay[1:] - lay[:-1]).max()) if max_seqlen is None else max_seqlen
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded,
                           cu_seqlens_kv_padded=padded, max_seqlen_q=m, max_seqlen_kv=m, cp_group=group,
                           local_cp_size=local)


def _megatron_batch(lengths: list[int], seed: int) -> dict[str, torch.Tensor]:
    """A packed global batch as Megatron's data path hands it over: [1, T] tensors; cu_seqlens [1, n+1] padded with
    copies of the last offset; labels = next token inside the document (loss_mask 0 at each document's end)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (sum(lengths),), generator=g)
    labels = torch.zeros_like(tokens)
    mask = torch.zeros(tokens.shape, dtype=torch.float32)
    cu = [0]
    for n in lengths:
        a = cu[-1]
        labels[a:a + n - 1] = tokens[a + 1:a + n]
        mask[a:a + n - 1] = 1.0
        cu.append(a + n)
    cu_t = torch.tensor(cu + [cu[-1], cu[-1]], dtype=torch.int32)[None]
    return {"tokens": tokens[None], "labels": labels[None], "loss_mask": mask[None], "cu_seqlens": cu_t,
            "position_ids": None}


def _reference_step(ref: Any, docs: list[Any], n_targets: int) -> torch.Tensor:
    """The unmodified Megatron model, every document alone (bshd, causal mask): Σ CE / N, backward; returns loss."""
    total = torch.zeros((), dtype=torch.float64)
    with _reference_cpu_shims():
        for d in docs:
            n = len(d)
            mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)[None, None]  # True = masked (Megatron)
            logits = ref(d.tokens[None], torch.arange(n)[None], mask)[0]  # [n, V]
            loss = F.cross_entropy(logits.float() if logits.dtype == torch.float16 else logits, d.labels,
                                   ignore_index=IGNORE, reduction="sum")
            (loss / n_targets).backward()
            total = total + loss.detach().double()
    return total / n_targets


def _grads(model: Any) -> dict[str, torch.Tensor]:
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


def _assert_close(a: dict, b: dict, tol: float, what: str) -> None:
    assert a.keys() == b.keys()
    for name in a:
        scale = max(1.0, float(b[name].abs().max()))
        err = float((a[name] - b[name]).abs().max())
        assert err <= tol * scale, f"{what}: {name} differs by {err:.3e} (scale {scale:.3g}, tol {tol})"


def _mb(cp: int, block: int, seqs: tuple[int, ...]) -> Any:
    from cpscope.hybrid import Microbatch

    return Microbatch(cp=cp, block=block, seqs=seqs, tokens_per_rank=0, cost=0.0)


# Mixed CP4 / CP2 / CP1 plans for 4 ranks over 8 documents (execution order: CP size descending).
LENGTHS = [40, 23, 17, 30, 9, 6, 11, 5]
PLANS = [
    [_mb(4, 0, (0,)), _mb(2, 0, (1, 2)), _mb(2, 1, (3,)), _mb(1, 0, (4,)), _mb(1, 1, (5,)), _mb(1, 2, (6,)),
     _mb(1, 3, (7,))],
    [_mb(4, 0, (3, 1)), _mb(2, 0, (0,)), _mb(1, 2, (2, 4)), _mb(1, 3, (5, 6, 7))],
    [_mb(1, 0, (0, 1)), _mb(1, 1, (2, 3)), _mb(1, 2, (4, 5)), _mb(1, 3, (6, 7))],
]


def _for_rank(plan: list[Any], rank: int) -> list[Any]:
    return [mb for mb in plan if rank in mb.ranks]


def _cp_step(model: Any, plan: list[Any], docs: list[Any], groups: dict) -> tuple[torch.Tensor, int]:
    from cpscope.train._loop import allreduce_gradients, allreduce_sum, global_num_targets, run_microbatches
    from cpscope.integrations.megatron import megatron_forward, prepare_megatron_microbatches

    mbs = prepare_megatron_microbatches(_for_rank(plan, dist.get_rank()), docs, groups)
    dp = dist.group.WORLD
    n = global_num_targets(mbs, dp_group=dp)
    local = run_microbatches(model, mbs, num_targets=n, dp_group=dp, forward=megatron_forward)
    allreduce_gradients(model, dp_group=dp)
    return allreduce_sum(local, group=dp) / n, n


# ------------------------------------------------------------------------------------------------ rank functions


def _megatron_own_failure() -> str:
    """Without cpscope: CP2 thd microbatch on a model built with CP1 → Megatron's unfused RoPE fails."""
    _init_megatron()
    groups = cpscope.new_cp_groups([1, 2])
    model = _build()
    cu = torch.tensor([0, 8, 20], dtype=torch.int32)
    ids = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(1))
    local = cpscope.zigzag_shard(ids, seq_dim=0, cu_seqlens=cu, group=groups[2])
    psp = _psp(cu, group=groups[2], local=2)
    with _reference_cpu_shims(), pytest.raises(RuntimeError, match="split_with_sizes expects split_sizes to sum exactly to") as e:
        model(local[None], None, None, packed_seq_params=psp)
    return str(e.value)


def _training_parity(dtype: torch.dtype, steps: int, tol: float) -> list[float]:
    from cpscope.integrations.megatron import documents_from_batch, enable_runtime_cp

    _init_megatron()
    groups = cpscope.new_cp_groups([1, 2, 4])
    model, ref = _build(dtype), _build(dtype)
    assert enable_runtime_cp(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    losses = []
    for step in range(steps):
        docs = documents_from_batch(_megatron_batch(LENGTHS, seed=10 + step))
        assert [len(d) for d in docs] == LENGTHS
        for d in docs:  # Megatron's targets kept: the next token, ignored at each document's end (loss_mask 0)
            assert torch.equal(d.labels[:-1], d.tokens[1:]) and int(d.labels[-1]) == IGNORE
        loss, n = _cp_step(model, PLANS[step % len(PLANS)], docs, groups)
        ref_loss = _reference_step(ref, docs, n)
        assert abs(float(loss) - float(ref_loss)) <= tol * max(1.0, abs(float(ref_loss))), (step, loss, ref_loss)
        _assert_close(_grads(model), _grads(ref), tol, f"step {step} gradients")
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad(set_to_none=True)
        losses.append(float(loss))
    _assert_close(dict(model.named_parameters()), dict(ref.named_parameters()), tol, "parameters after training")
    return losses


def _binding_and_restore() -> None:
    from megatron.core.transformer.attention import Attention

    from cpscope.integrations.megatron import disable_runtime_cp, enable_runtime_cp
    from cpscope.integrations.megatron._core_attention import RingCoreAttention

    _init_megatron()
    groups = cpscope.new_cp_groups([1, 2])
    g2 = groups[2]
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]  # collective: every rank makes all
    single = singles[dist.get_rank()]
    model, ref = _build(), _build()
    keys = sorted(model.state_dict())
    static_pgs = model.pg_collection
    static_cp = static_pgs.cp
    classes = {n: type(m) for n, m in model.named_modules()}
    names = enable_runtime_cp(model)
    assert "rotary_pos_emb" in names and "decoder.layers.0.self_attention.core_attention" in names
    assert sorted(model.state_dict()) == keys
    swapped = {n: type(m) for n, m in model.named_modules()}
    assert enable_runtime_cp(model) == names  # again: nothing new, the same classes and modules
    assert {n: type(m) for n, m in model.named_modules()} == swapped
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    own = [a.pg_collection for a in attns]

    cu = torch.tensor([0, 12, 20], dtype=torch.int32)
    ids = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), _reference_cpu_shims():  # reference: unmodified model, each document alone
        full = torch.cat([ref(ids[None, a:b], torch.arange(b - a)[None],
                              torch.triu(torch.ones(b - a, b - a, dtype=torch.bool), 1)[None, None])[0]
                          for a, b in ((0, 12), (12, 20))])
    want2 = cpscope.zigzag_shard(full, seq_dim=0, cu_seqlens=cu, group=g2)
    local2 = cpscope.zigzag_shard(ids, seq_dim=0, cu_seqlens=cu, group=g2)

    def run(tokens: torch.Tensor, psp: Any) -> torch.Tensor:
        with torch.no_grad():
            return model(tokens[None], None, None, packed_seq_params=psp)[0]

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return float((a - b).abs().max()) < 1e-5

    assert close(run(local2, _psp(cu, group=g2, local=2)), want2)
    # CP1 after CP2 is CP1 — both conventions (None + local_cp_size=1, a size-1 group, or naming nothing)
    for psp in (_psp(cu, local=1), _psp(cu, group=single), _psp(cu, group=single, local=1), _psp(cu)):
        assert close(run(ids, psp), full), psp
        assert close(run(local2, _psp(cu, group=g2)), want2)
    # psp naming no group: the enclosing runtime_cp scope runs (and the offsets are validated against it)
    with cpscope.runtime_cp(g2):
        assert close(run(local2, _psp(cu)), want2)
        assert close(run(ids, _psp(cu, local=1)), full)  # the psp's own CP1 wins over the enclosing CP2
        with pytest.raises(ValueError, match="document 0 has length 10"):
            run(ids[:18], _psp(torch.tensor([0, 10, 18], dtype=torch.int32)))
    # contradictions / bad input: ValueError before any collective (gloo would otherwise hang or fail)
    bad = [
        (local2, _psp(cu, group=g2, local=1), "local_cp_size=1 contradicts the CP group"),
        (local2, _psp(cu, group=single, local=2), "local_cp_size=2 contradicts the CP group"),
        (local2, _psp(cu, local=2), r"local_cp_size=2 contradicts the CP group: got None"),
        (ids, _psp(cu, group=g2), "holds 20 local tokens"),  # full tokens given to a CP2 microbatch
        (local2, _psp(cu, group=g2, max_seqlen=8), "max_seqlen_q=8"),
        (local2[:9], _psp(torch.tensor([0, 10, 18], dtype=torch.int32), group=g2), "document 0 has length 10"),
    ]
    for tokens, psp, match in bad:
        with pytest.raises(ValueError, match=match):
            run(tokens, psp)
    # an exception inside the forward: every attention gets its own process groups back, the next call is right
    layer0 = model.decoder.layers[0].self_attention.linear_proj

    def boom(*a: Any, **k: Any) -> Any:
        raise KeyError("planted")

    layer0.forward = boom
    with pytest.raises(KeyError, match="planted"):
        run(local2, _psp(cu, group=g2))
    del layer0.forward
    assert [a.pg_collection for a in attns] == own and all(a is b for a, b in zip((a.pg_collection for a in attns), own))
    assert model.pg_collection is static_pgs and static_pgs.cp is static_cp
    assert cpscope.cp_size() == 1
    assert close(run(ids, _psp(cu)), full)
    # a build-time group that is not the model's own static one
    with cpscope.build_time_cp(g2), pytest.raises(ValueError, match="built with static CP1"):
        run(local2, _psp(cu))
    # disable: original classes and core attention back
    disable_runtime_cp(model)
    assert not any(isinstance(m, RingCoreAttention) for m in model.modules())
    assert sorted(model.state_dict()) == keys
    assert {n: type(m) for n, m in model.named_modules()} == classes
    assert not [(n, k) for n, m in model.named_modules() for k in vars(m) if k.startswith("_cpscope_")]


def _refusals() -> None:
    from megatron.core import package_info

    from cpscope.integrations.megatron import enable_runtime_cp

    _init_megatron()
    with pytest.raises(ValueError, match=r"attention_dropout=0.1 \(cpscope's ring attention has no dropout"):
        enable_runtime_cp(_build(attention_dropout=0.1))
    saved = package_info.VERSION
    package_info.VERSION = (0, 18, 0, "")
    try:
        with pytest.raises(RuntimeError, match="supports megatron-core 0.19.2; found 0.18.0"):
            enable_runtime_cp(_build())
    finally:
        package_info.VERSION = saved
    with pytest.raises(ValueError, match="no module of Linear takes packed_seq_params"):
        enable_runtime_cp(torch.nn.Linear(2, 2))


def _recompute(granularity: str) -> None:
    from cpscope.integrations.megatron import enable_runtime_cp

    _init_megatron()
    groups = cpscope.new_cp_groups([1, 2])
    g2 = groups[2]
    extra = {"recompute_granularity": granularity}
    if granularity == "full":
        extra.update(recompute_method="uniform", recompute_num_layers=1)
    plain, rec = _build(), _build(**extra)
    enable_runtime_cp(plain)
    enable_runtime_cp(rec)
    cu = torch.tensor([0, 16, 24], dtype=torch.int32)
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(5))
    local = cpscope.zigzag_shard(ids, seq_dim=0, cu_seqlens=cu, group=g2)
    target = cpscope.zigzag_shard(torch.roll(ids, -1), seq_dim=0, cu_seqlens=cu, group=g2)
    cpscope.set_backward_read_check(True)  # any ContextVar read during backward raises
    try:
        with _recompute_cpu_shims():
            for m in (plain, rec):
                m.train()
                with cpscope.runtime_cp(None):  # an unrelated enclosing scope: the psp's group must win
                    logits = m(local[None], None, None, packed_seq_params=_psp(cu, group=g2, local=2))[0]
                F.cross_entropy(logits, target, reduction="sum").backward()  # outside every scope
    finally:
        cpscope.set_backward_read_check(True)  # back to the default (on)
    _assert_close(_grads(rec), _grads(plain), 1e-6, f"recompute={granularity}")
    # without packed_seq_params nothing carries the scope into the recompute: refused before anything runs
    with pytest.raises(ValueError, match="recompute_granularity=.* needs packed_seq_params"):
        rec(local[None, :8], None, None)


def _dense_runtime_cp() -> None:
    """bshd/sbhd under runtime_cp(CP2), no PackedSeqParams: the RoPE table rows and the ring follow the scope."""
    from cpscope.integrations.megatron import enable_runtime_cp

    _init_megatron()
    g2 = cpscope.new_cp_groups([1, 2])[2]
    model, ref = _build(), _build()
    enable_runtime_cp(model)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(7))  # [b, s]
    with torch.no_grad():
        with _reference_cpu_shims():
            mask = torch.triu(torch.ones(24, 24, dtype=torch.bool), 1)[None, None]
            full = ref(ids, torch.arange(24)[None].expand(2, -1), mask)  # [b, s, V]
        with cpscope.runtime_cp(g2):
            local = cpscope.zigzag_shard(ids, seq_dim=1)
            got = model(local, None, None)
        want = cpscope.zigzag_shard(full, seq_dim=1, group=g2)
        assert float((got - want).abs().max()) < 1e-5
        assert float((model(ids, None, None) - full).abs().max()) < 1e-5  # CP1 outside the scope
        with cpscope.runtime_cp(g2), pytest.raises(ValueError, match="sequence length"):
            model(ids[:, :23], None, None)


def _planner_bridge() -> list[int]:
    """A Megatron-shaped global batch through PlannerScheduler (Megatron's interface) → cpscope's loop."""
    from cpscope.hybrid import Microbatch, plan_hybrid
    from cpscope.integrations.megatron import PlannerScheduler, documents_from_batch, enable_runtime_cp

    _init_megatron()
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = cpscope.new_cp_groups([1, 2, 4])
    model, ref = _build(), _build()
    enable_runtime_cp(model)
    lengths = [96, 40, 33, 12, 9, 20, 7, 16, 5, 11]
    batches = [_megatron_batch(lengths[:5], seed=21), _megatron_batch(lengths[5:], seed=22)]  # two microbatches
    docs = documents_from_batch(batches)
    assert [len(d) for d in docs] == lengths
    sched = PlannerScheduler(max_seq_len_per_rank=32, dp_cp_group=dist.group.WORLD)
    groups_out, ids_out = sched.get_groups_and_subsamples(list(enumerate(lengths)), None)
    assert len(groups_out) == 1 and len(ids_out[0]) == world
    plan = sched.last_plan
    assert plan == plan_hybrid(lengths, world, 32)
    # Megatron's semantics: the ranks listing a sample are an aligned block of its planned CP size
    for i, cp in enumerate(plan.cp_sizes):
        holders = [r for r in range(world) if i in ids_out[0][r]]
        assert len(holders) == cp and holders[0] % cp == 0 and holders == list(range(holders[0], holders[0] + cp))
        assert [lengths[i]] * 1 == [groups_out[0][holders[0]][ids_out[0][holders[0]].index(i)]]
    assert max(plan.cp_sizes) > 1  # the 96-token document cannot fit one rank's 32 tokens
    from cpscope.train._loop import allreduce_gradients, allreduce_sum, global_num_targets, run_microbatches
    from cpscope.integrations.megatron import megatron_forward, prepare_megatron_microbatches

    mine = plan.microbatches_for_rank(rank)
    assert all(isinstance(mb, Microbatch) for mb in mine)
    mbs = prepare_megatron_microbatches(mine, docs, groups)
    dp = dist.group.WORLD
    n = global_num_targets(mbs, dp_group=dp)
    loss = allreduce_sum(run_microbatches(model, mbs, num_targets=n, dp_group=dp, forward=megatron_forward),
                         group=dp) / n
    allreduce_gradients(model, dp_group=dp)
    ref_loss = _reference_step(ref, docs, n)
    assert abs(float(loss) - float(ref_loss)) < 1e-5
    _assert_close(_grads(model), _grads(ref), 1e-5, "planner bridge gradients")
    # and back: the Megatron forward_step batch of a microbatch
    b = mbs[0].megatron_batch()
    assert b["tokens"].shape == b["labels"].shape == b["loss_mask"].shape == b["position_ids"].shape
    assert b["packed_seq_params"].local_cp_size == mbs[0].cp and b["packed_seq_params"].cp_group is mbs[0].group
    return list(plan.cp_sizes)


def _shard_batch_matches_megatron() -> None:
    from megatron.core.utils import _get_batch_on_this_cp_rank_per_sequence_balancing

    from cpscope.integrations.megatron import shard_batch

    g2 = cpscope.new_cp_groups([1, 2])[2]
    batch = _megatron_batch([24], seed=4)
    batch["position_ids"] = torch.arange(24)[None]
    batch["cu_seqlens"] = batch["cu_seqlens"][:, :2]
    theirs = _get_batch_on_this_cp_rank_per_sequence_balancing(dict(batch), cp_group=g2)
    ours = shard_batch(batch, group=g2)
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        assert torch.equal(ours[key], theirs[key]), key
    assert ours["cu_seqlens"] is batch["cu_seqlens"]


# ------------------------------------------------------------------------------------------------ tests


def test_megatron_own_rope_fails_on_runtime_cp2_without_cpscope():
    msgs = run_ranks(2, _megatron_own_failure)
    assert all("split_with_sizes expects split_sizes to sum exactly to 10" in m for m in msgs), msgs


def test_gpt_trains_with_mixed_cp_equal_to_no_cp_fp32():
    losses = run_ranks(4, _training_parity, torch.float32, 3, 1e-5)[0]
    assert len(losses) == 3 and losses[-1] < losses[0]  # it trains


def test_gpt_step_float64_anchor():
    run_ranks(4, _training_parity, torch.float64, 1, 1e-9)


def test_binding_restore_and_refusals():
    run_ranks(2, _binding_and_restore)
    run_ranks(2, _refusals)


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_megatron_recompute_under_runtime_cp(granularity):
    run_ranks(2, _recompute, granularity)


def test_dense_layout_under_enclosing_scope():
    run_ranks(2, _dense_runtime_cp)


def test_planner_bridge_megatron_batch_through_plan_and_loop():
    cps = run_ranks(4, _planner_bridge)[0]
    assert max(cps) > 1 and min(cps) == 1


def test_shard_batch_equals_megatron_get_batch_on_this_cp_rank():
    run_ranks(2, _shard_batch_matches_megatron)


def _schedulers_answer_alike() -> None:
    """No process group: both schedulers on one input; same structure, every sample on an aligned block."""
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    from cpscope.hybrid import long_tail_lengths
    from cpscope.integrations.megatron import PlannerScheduler

    class Group:
        def size(self) -> int:
            return 16

    pairs = [(100 + i, int(n)) for i, n in enumerate(long_tail_lengths(32, seed=3))]
    lengths = dict(pairs)
    ours = PlannerScheduler(16384, Group())
    for sched in (BalancedCPScheduler(16384, Group()), ours):
        groups, ids = sched.get_groups_and_subsamples(list(pairs), None)
        assert len(groups) == len(ids) >= 1 and all(len(g) == 16 for g in groups + ids)
        seen = set()
        for g_lens, g_ids in zip(groups, ids):
            holders: dict[int, list[int]] = {}
            for r in range(16):
                assert g_lens[r] == [lengths[s] for s in g_ids[r]]
                for s in g_ids[r]:
                    holders.setdefault(s, []).append(r)
            for s, rs in holders.items():
                c = len(rs)
                assert c & (c - 1) == 0 and rs == list(range(rs[0], rs[0] + c)), (type(sched).__name__, s, rs)
            seen |= set(holders)
        assert seen == set(lengths), type(sched).__name__
    plan = ours.last_plan
    _, ids = ours.get_groups_and_subsamples(list(pairs), None)
    for r in range(16):  # each rank's order is the plan's order for that rank
        assert ids[0][r] == [pairs[i][0] for mb in plan.microbatches_for_rank(r) for i in mb.seqs]
    with pytest.raises(ValueError, match="unique"):
        ours.get_groups_and_subsamples([(1, 5), (1, 6)], None)


def test_planner_scheduler_answers_like_balanced_cp_scheduler():
    run_ranks(2, _schedulers_answer_alike)  # in the pool: its processes have megatron-core imported already
