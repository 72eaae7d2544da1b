"""torch.compile over hybrid CP, two ways.

1. A model compiled whole, ``torch.compile(model)``, whose layers call cpscope's RoPE and attention directly (nothing
   disabled by the user), over CP1, CP2, CP4 and another CP2 group with lengths and document counts that change
   per microbatch: equal to a float64 full-pack reference cut per rank (forward and every gradient), every
   projection inside a compiled graph (no silent eager fall-back), a bounded number of graphs, and graph breaks
   only at cpscope's deliberate eager islands (attention: its host side and collectives, one
   ``torch.compiler.disable``d step per call site; RoPE has none, its host side is the ``cpscope::rope_angles``
   op). Then the islands one by one on one process, the sentinel over a compiled model, and GPU checks (inductor,
   CUDA graphs) that skip without CUDA.
2. The pattern of docs/autograd.md, "torch.compile": the ContextVar read and the ring's collectives kept eager by
   the caller (``torch.compiler.disable``), only tensors and plain ints reaching compiled code. A block is run over
   CP1, CP2, CP4 and a *second, different* CP2 group, twice, on a 4-rank gloo pool; the number of graphs is bounded
   (automatic dynamic shapes: at most one static and one dynamic graph per segment between the eager calls), the
   CP2-b microbatch and the whole second pass compile nothing, and the compiled forward and gradients equal eager
   ones, which equal a float64 full-sequence reference cut per rank. Backend: a counting wrapper that runs the
   captured FX graph as is (what ``backend="eager"`` does): Dynamo's capture, guards and recompiles do not depend
   on the backend; inductor would add minutes of C++ compilation on a 2-core CPU box without changing the count.
"""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import cpscope
from cpscope.attention import ContextParallelAttention, context_parallel_attention
from cpscope.sharding import zigzag_position_ids, zigzag_shard
from tests.attention._reference import zigzag_index
from tests.distributed import run_ranks

B, L, H, D = 1, 16, 2, 8
E = H * D
SEGMENTS = 3  # compiled pieces of `_block`: before the angles, between angles and attention, after attention


@torch.compiler.disable
def _local_angles(freqs: torch.Tensor, local_len: int) -> torch.Tensor:
    """Eager: read the active scope and look up the RoPE angles at the global positions of the local tokens."""
    pos = zigzag_position_ids(local_len * cpscope.cp_size(), device=freqs.device)  # [s_local]
    return freqs[pos, 0, 0, :][None, :, None, :]  # [1, s_local, 1, d]


_attention = torch.compiler.disable(context_parallel_attention)  # eager: ContextVar read + ring collectives


def _rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * angles.cos() + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * angles.sin()


def _block(x: torch.Tensor, w: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """[b, s, e] -> [b, s, e]: qkv projection, RoPE at the zigzag positions, ring attention, output projection."""
    q, k, v = ((x @ w[i]).unflatten(-1, (H, D)) for i in range(3))  # [b, s, h, d] each
    angles = _local_angles(freqs, x.shape[1])
    q, k = _rope(q, angles), _rope(k, angles)
    o = _attention(q, k, v, qkv_format="bshd", causal=True)  # [b, s, h, d]
    return o.flatten(-2) @ w[3]


def _reference(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, freqs: torch.Tensor):
    """Full-sequence float64 block (plain causal attention); returns (out, dx, dw) for loss = sum(out * g)."""
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    q, k, v = ((x @ w[i]).unflatten(-1, (H, D)) for i in range(3))
    ang = freqs[:L, 0, 0, :][None, :, None, :]
    q, k = _rope(q, ang), _rope(k, ang)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
    p = s.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v).flatten(-2) @ w[3]
    (out * g).sum().backward()
    return out.detach(), x.grad, w.grad


def _run(fn: Any, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, freqs: torch.Tensor):
    x = zigzag_shard(x, seq_dim=1).detach().requires_grad_()
    w = w.detach().clone().requires_grad_()
    out = fn(x, w, freqs)
    (out * zigzag_shard(g, seq_dim=1)).sum().backward()
    return out.detach(), x.grad, w.grad


def _module_scope_block(attn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The attention wrapper's pattern: its ``active_scope()`` is compile-disabled and returns a ``CPScope`` whose
    ints (rank here) reach compiled code and whose group goes to eager attention."""
    scope = attn.active_scope()
    return _attention_with_scope(q * (scope.rank + 1), k, v, scope)


def _attention_with_scope(*args: Any, **kwargs: Any) -> torch.Tensor:
    from cpscope.attention import attention_with_scope

    return attention_with_scope(*args, **kwargs)


_attention_with_scope = torch.compiler.disable(_attention_with_scope)


def _compile_module_scope_read() -> list[int]:
    import torch._dynamo

    assert cpscope.backward_read_check_enabled()  # compiled modules pass the default-on check
    torch._dynamo.reset()
    compiles = [0]

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        compiles[0] += 1
        return gm.forward

    groups = cpscope.new_cp_groups([1, 2, 4])
    other_cp2 = cpscope.new_cp_groups([2], ranks=[0, 2, 1, 3])[2]
    attn = ContextParallelAttention(causal=True)
    compiled = torch.compile(_module_scope_block, backend=counting_backend)
    gen = torch.Generator().manual_seed(1)
    counts = []
    for _ in range(2):
        for group in (groups[1], groups[2], groups[4], other_cp2):
            full = [torch.randn(B, L, H, D, generator=gen, dtype=torch.float64) for _ in range(3)]
            with cpscope.runtime_cp(group):
                q, k, v = (zigzag_shard(t, seq_dim=1) for t in full)
                torch.testing.assert_close(compiled(attn, q, k, v), _module_scope_block(attn, q, k, v))
            counts.append(compiles[0])
    return counts


def _compile_over_cp_sizes() -> list[int]:
    import torch._dynamo

    assert cpscope.backward_read_check_enabled()  # compiled blocks pass the default-on check, forward and backward
    torch._dynamo.reset()
    compiles = [0]

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        compiles[0] += 1
        return gm.forward

    groups = cpscope.new_cp_groups([1, 2, 4])
    other_cp2 = cpscope.new_cp_groups([2], ranks=[0, 2, 1, 3])[2]  # same size, different group (and peers)
    schedule = [groups[1], groups[2], groups[4], other_cp2]
    compiled = torch.compile(_block, backend=counting_backend)
    gen = torch.Generator().manual_seed(0)
    freqs_ang = torch.arange(L, dtype=torch.float64)[:, None] / (10000.0 ** (torch.arange(0, D, 2) / D))[None, :]
    freqs = torch.cat((freqs_ang, freqs_ang), -1)[:, None, None, :]  # [L, 1, 1, D]
    counts = []
    for _ in range(2):
        for i, group in enumerate(schedule):
            x, g = (torch.randn(B, L, E, generator=gen, dtype=torch.float64) for _ in range(2))
            w = torch.randn(4, E, E, generator=gen, dtype=torch.float64) / math.sqrt(E)
            with cpscope.runtime_cp(group):
                got = _run(compiled, x, w, g, freqs)
                eager = _run(_block, x, w, g, freqs)
            for a, b in zip(got, eager):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
            out, dx, dw = _reference(x, w, g, freqs)
            # Cut the reference with the independent index of tests/attention/_reference (not cpscope's own).
            cp, rank = (1, 0) if group is None else (group.size(), torch.distributed.get_rank(group))
            idx = zigzag_index([0, out.shape[1]], cp, rank)
            torch.testing.assert_close(eager[0], out[:, idx], rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(eager[1], dx[:, idx], rtol=1e-9, atol=1e-9)
            # dw: each rank holds the gradient of its own tokens' loss; the group sums to the full dw.
            dw_local = eager[2].clone()
            if group is not None:
                torch.distributed.all_reduce(dw_local, group=group)
            torch.testing.assert_close(dw_local, dw, rtol=1e-9, atol=1e-9)
            counts.append(compiles[0])
    return counts


def test_compiled_block_bounded_compiles_over_cp_sizes():
    for counts in run_ranks(4, _compile_over_cp_sizes):
        # CP1: one static graph per segment; CP2: one dynamic-shape recompile per segment; then nothing more —
        # not for CP4, not for a different CP2 group, not for the second pass over the same schedule.
        assert 1 <= counts[0] <= SEGMENTS and counts[1] <= 2 * SEGMENTS, counts  # it did compile something
        assert counts[1:] == [counts[1]] * (len(counts) - 1), counts


def test_attention_module_scope_read_does_not_guard_on_group():
    for counts in run_ranks(4, _compile_module_scope_read):
        # One graph; at most two recompiles (local length, then the rank int, become dynamic). A different CP2
        # group (index 3) and the second pass compile nothing.
        assert counts[0] == 1 and counts[2] <= 3, counts
        assert counts[2:] == [counts[2]] * (len(counts) - 2), counts


# ---------------------------------------------------------------------------------------------------------------
# torch.compile(model) with cpscope RoPE and attention inside, nothing disabled by the user.
#
# A two-layer decoder whose layers call `cpscope.apply_rotary_pos_emb` and `cpscope.context_parallel_attention`
# (bshd) or a `ContextParallelAttention` module (thd) directly is compiled whole (`torch.compile(model)`) and run
# over microbatches of CP1, CP2, CP4 and a second, different CP2 group, with lengths (and, in thd, document counts)
# that change from microbatch to microbatch, on a 4-rank gloo pool. Backend: AOTAutograd with eager kernels
# (`aot_eager`) behind a counter: Dynamo's capture, guards and recompiles and AOTAutograd's joint forward/backward
# tracing are what the model meets under inductor too; inductor itself would add minutes of C++ compilation on a
# 2-core CPU box without changing the counts (the GPU test below runs inductor).
#
# What is measured, per microbatch: the graphs handed to the backend, Dynamo's `unique_graphs`, the graph-break
# reasons, and the projections that ran inside compiled graphs. Eager fall-back is made loud: `suppress_errors`
# off, a recompile-limit hit raises (`fail_on_recompile_limit_hit`, with a limit far above the bound below, so the
# bound is what the test checks, not Dynamo's limit).
# ---------------------------------------------------------------------------------------------------------------

MH, MHKV, MD, MLAYERS = 4, 2, 8, 2  # q heads, k/v heads (GQA), head dim, layers
ME = MH * MD
# cpscope's eager islands per layer: attention (its ContextVar read, collectives and ring autograd stay eager);
# RoPE is in the graph (its angles come from the `cpscope::rope_angles` op, which reads the scope when it runs)
ISLANDS_PER_LAYER = 1
# Microbatches: (CP group, document lengths). bshd takes the single length of each; every length is divisible by
# 2·cp. The second pass has only lengths (and document counts) the first did not have: whatever became dynamic in
# the first pass must stay so, and nothing may be keyed on a length, a CP size or a group.
SCHEDULE = (
    [("cp1", [16]), ("cp2", [24, 16]), ("cp4", [32]), ("cp2b", [16, 16, 8])],
    [("cp4", [48, 16]), ("cp1", [8]), ("cp2b", [40, 8, 8, 24])],
)
# Microbatches after which automatic dynamic shapes has seen every input change once: the second one changes the
# local length in both layouts (16 -> 12 in bshd, 16 -> 20 in thd) and, in thd, the number of documents.
WARMUP = 2


class _Layer(torch.nn.Module):
    def __init__(self, qkv_format: str) -> None:
        super().__init__()
        self.qkv_format = qkv_format
        self.q = torch.nn.Linear(ME, MH * MD, bias=False, dtype=torch.float64)
        self.kv = torch.nn.Linear(ME, 2 * MHKV * MD, bias=False, dtype=torch.float64)
        self.o = torch.nn.Linear(MH * MD, ME, bias=False, dtype=torch.float64)
        # thd runs attention through the module (its forward is the island), bshd through the function
        self.attn = ContextParallelAttention(qkv_format="thd", causal=True) if qkv_format == "thd" else None

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, cu: Any) -> torch.Tensor:
        """``x``: [1, s, e] (bshd) or [t, e] (thd) -> the same shape."""
        q = self.q(x).unflatten(-1, (MH, MD))  # [.., h, d]
        k, v = self.kv(x).unflatten(-1, (2, MHKV, MD)).unbind(-3)  # [.., h_kv, d] each
        q = cpscope.apply_rotary_pos_emb(q, freqs, qkv_format=self.qkv_format, cu_seqlens=cu)
        k = cpscope.apply_rotary_pos_emb(k, freqs, qkv_format=self.qkv_format, cu_seqlens=cu)
        if self.attn is not None:
            o = self.attn(q, k, v, cu_seqlens=cu)
        else:
            o = cpscope.context_parallel_attention(q, k, v, qkv_format=self.qkv_format, causal=True, cu_seqlens=cu)
        return x + self.o(o.flatten(-2))


class _Model(torch.nn.Module):
    def __init__(self, qkv_format: str) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer(qkv_format) for _ in range(MLAYERS))

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, cu: Any = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, freqs, cu)
        return x


def _ref_rope(t: torch.Tensor, freqs: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Non-interleaved RoPE on [t, h, d] at positions ``pos`` (independent of cpscope)."""
    ang = freqs[pos, 0, 0, :][:, None, :]  # [t, 1, d]
    half = t.shape[-1] // 2
    return t * ang.cos() + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * ang.sin()


def _ref_model(model: _Model, x: torch.Tensor, freqs: torch.Tensor, docs: list[int]) -> torch.Tensor:
    """The whole pack on one process in float64: per-document positions, document-masked causal attention."""
    from tests.attention._reference import reference_attention

    cu = [0]
    for n in docs:
        cu.append(cu[-1] + n)
    pos = torch.cat([torch.arange(n) for n in docs])
    for layer in model.layers:
        q = layer.q(x).unflatten(-1, (MH, MD))  # [t, h, d]
        k, v = layer.kv(x).unflatten(-1, (2, MHKV, MD)).unbind(-3)
        q, k = _ref_rope(q, freqs, pos), _ref_rope(k, freqs, pos)
        x = x + layer.o(reference_attention(q, k, v, causal=True, cu=cu).flatten(-2))
    return x


def _graph_ops(gm: torch.fx.GraphModule, what: str) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and what in str(n.target))


def _compiled_model_run(qkv_format: str) -> dict:
    """One rank: the schedule through ``torch.compile(model)``; checks against the reference, returns the counts."""
    import torch._dynamo
    from torch._dynamo.backends.registry import lookup_backend
    from torch._dynamo.utils import counters

    from tests.attention._reference import zigzag_index

    assert cpscope.backward_read_check_enabled()
    torch._dynamo.reset()
    counters.clear()
    groups = cpscope.new_cp_groups([1, 2, 4])
    named = {"cp1": groups[1], "cp2": groups[2], "cp4": groups[4],
             "cp2b": cpscope.new_cp_groups([2], ranks=[0, 2, 1, 3])[2]}  # same size, other members
    torch.manual_seed(0)  # the same weights on every rank
    model = _Model(qkv_format)
    aot_eager = lookup_backend("aot_eager")
    graphs, projections_run = [0], [0]

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs[0] += 1
        n_proj = _graph_ops(gm, "linear")
        compiled = aot_eager(gm, example_inputs)

        def run(*args: Any) -> Any:
            projections_run[0] += n_proj
            return compiled(*args)

        return run

    compiled = torch.compile(model, backend=backend)
    ang = torch.arange(128, dtype=torch.float64)[:, None] / (
        10000.0 ** (torch.arange(0, MD, 2, dtype=torch.float64) / MD))[None, :]
    freqs = torch.cat((ang, ang), -1)[:, None, None, :]  # [128, 1, 1, d], TE layout
    gen = torch.Generator().manual_seed(1)
    rows: list[dict] = []
    mismatches: list[str] = []
    with torch._dynamo.config.patch(suppress_errors=False, fail_on_recompile_limit_hit=True, recompile_limit=64):
        for pass_ in SCHEDULE:
            for name, docs in pass_:
                docs = docs if qkv_format == "thd" else docs[:1]
                group = named[name]
                cp, rank = (1, 0) if group is None else (group.size(), torch.distributed.get_rank(group))
                total = sum(docs)
                x_full = torch.randn(total, ME, generator=gen, dtype=torch.float64)
                g_full = torch.randn(total, ME, generator=gen, dtype=torch.float64)
                cu_list = [0]
                for n in docs:
                    cu_list.append(cu_list[-1] + n)
                idx = zigzag_index(cu_list, cp, rank)  # independent of cpscope's index math
                # reference: the whole pack, float64, one process
                model.zero_grad(set_to_none=True)
                xr = x_full.clone().requires_grad_()
                out_ref = _ref_model(model, xr, freqs, docs)
                (out_ref * g_full).sum().backward()
                dw_ref = [p.grad.clone() for p in model.parameters()]
                # cpscope: this rank's zigzag part, through the compiled model
                model.zero_grad(set_to_none=True)
                x = x_full[idx].clone()
                if qkv_format == "bshd":
                    x = x[None]  # [1, s_local, e]
                x.requires_grad_()
                cu = torch.tensor(cu_list, dtype=torch.int32) if qkv_format == "thd" else None
                before = projections_run[0]
                with cpscope.runtime_cp(group):
                    out = compiled(x, freqs, cu)
                    g = g_full[idx] if qkv_format == "thd" else g_full[idx][None]
                    (out * g).sum().backward()
                dw = [p.grad.clone() for p in model.parameters()]
                if group is not None:
                    for t in dw:  # each rank holds the gradient of its own rows' loss; the group sums them
                        torch.distributed.all_reduce(t, group=group)
                pairs = [("out", out.reshape(-1, ME), out_ref.detach()[idx]), ("dx", x.grad.reshape(-1, ME),
                         xr.grad[idx])] + [(f"d{n}", a, b) for (n, _), a, b in zip(model.named_parameters(), dw,
                                                                                    dw_ref)]
                for what, got, want in pairs:
                    try:
                        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
                    except AssertionError as e:
                        mismatches.append(f"{name} {docs} {what}: {str(e).splitlines()[1:3]}")
                rows.append({"mb": f"{name} {docs}", "graphs": graphs[0],
                             "unique_graphs": counters["stats"]["unique_graphs"],
                             "projections_compiled": projections_run[0] - before})
    breaks = {reason.split("\n")[0]: n for reason, n in counters["graph_break"].items()}
    torch._dynamo.reset()  # the pool's next tasks start without this model's graphs and guards
    return {"rows": rows, "mismatches": mismatches, "breaks": breaks}


_RUNS: dict[str, Any] = {}


def _compiled_model_results(qkv_format: str) -> list[dict]:
    """Per-rank results of one run of the schedule, shared by the three tests below (run once per format); a run
    that crashed raises ``RuntimeError`` in every test that reads it."""
    if qkv_format not in _RUNS:
        try:
            _RUNS[qkv_format] = run_ranks(4, _compiled_model_run, qkv_format)
        except BaseException as e:  # noqa: BLE001 - kept to re-raise in every test that reads it
            _RUNS[qkv_format] = e
    res = _RUNS[qkv_format]
    if isinstance(res, BaseException):
        raise RuntimeError(f"the compiled run ({qkv_format}) failed: {res}") from res
    return res


@pytest.mark.parametrize("qkv_format", ["bshd", "thd"])
def test_compiled_model_equals_reference(qkv_format):
    """Forward and every gradient of the compiled model equal the float64 full-pack reference cut per rank, at
    CP1, CP2, CP4 and another CP2 group; every projection of every microbatch ran inside a compiled graph (a
    frame that fell back to eager would run its projections outside)."""
    for rank, res in enumerate(_compiled_model_results(qkv_format)):
        assert not res["mismatches"], (rank, res["mismatches"])
        for row in res["rows"]:
            assert row["projections_compiled"] >= 3 * MLAYERS, (rank, row)


@pytest.mark.parametrize("qkv_format", ["bshd", "thd"])
def test_compiled_model_bounded_recompiles(qkv_format):
    """Bound: each attention call is one eager island (a graph break) and RoPE none, so one forward is at most
    ``layers + 1`` compiled pieces; each piece sees only tensors, so automatic dynamic shapes compiles it at most
    twice (static, then dynamic) and never again: ``unique_graphs ≤ 2·(layers + 1)`` over the whole schedule, and
    nothing new after the warm-up microbatches — not for CP4, another CP2 group, new lengths or new document
    counts.

    What keeps it so: the host side of each public call (scope read, validation, pack cache, index math) is one
    ``torch.compiler.disable``d step that returns tensors, so Dynamo traces only tensor math and guards on nothing
    that changes per microbatch."""
    bound = 2 * (ISLANDS_PER_LAYER * MLAYERS + 1)
    for rank, res in enumerate(_compiled_model_results(qkv_format)):
        rows = res["rows"]
        assert rows[-1]["unique_graphs"] <= bound, (rank, bound, rows)
        assert all(r["graphs"] == rows[WARMUP - 1]["graphs"] for r in rows[WARMUP:]), (rank, rows)


@pytest.mark.parametrize("qkv_format", ["bshd", "thd"])
def test_compiled_model_breaks_only_at_eager_islands(qkv_format):
    """Every graph break is a deliberate eager island (a ``torch.compiler.disable``d cpscope step: scope read and
    host bookkeeping, collectives), never an accident of tracing (an unsupported context manager, a data-dependent
    ``.item()``, a generator), which would move with torch versions and cost a graph per break."""
    for rank, res in enumerate(_compiled_model_results(qkv_format)):
        accidental = {r: n for r, n in res["breaks"].items() if "torch.compiler.disable" not in r}
        assert not accidental, (rank, accidental)


# ---------------------------------------------------------------------------------------------------------------
# The islands one by one, on one process (CP1): a graph break at each attention call and none at RoPE, the same
# results as eager, and bad input still raising ValueError under torch.compile (an island is the eager call itself,
# the rope_angles op validates as the eager call does: never a silent fallback).
# ---------------------------------------------------------------------------------------------------------------


def _islands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, freqs: torch.Tensor, cu: torch.Tensor,
             attn: ContextParallelAttention) -> torch.Tensor:
    q = cpscope.apply_rotary_pos_emb(q * 2, freqs, qkv_format="thd", cu_seqlens=cu)
    k = cpscope.apply_rotary_pos_emb(k, freqs, qkv_format="thd", cu_seqlens=cu)
    o = cpscope.context_parallel_attention(q, k, v, qkv_format="thd", causal=True, cu_seqlens=cu)
    return attn(o + 1, k, v, cu_seqlens=cu) * 3


def test_islands_one_break_per_call_site_and_errors_raise():
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    graphs = [0]

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs[0] += 1
        return gm.forward

    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(24, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    freqs = cpscope.rotary_freqs(8, 32).double()
    cu = torch.tensor([0, 8, 24], dtype=torch.int32)
    attn = ContextParallelAttention(qkv_format="thd", causal=True)
    compiled = torch.compile(_islands, backend=backend)
    with torch._dynamo.config.patch(suppress_errors=False):
        got = compiled(q, k, v, freqs, cu, attn)
        want = _islands(q, k, v, freqs, cu, attn)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        dq = torch.autograd.grad(got.sum(), q)[0]
        torch.testing.assert_close(dq, torch.autograd.grad(want.sum(), q)[0], rtol=0, atol=0)
        breaks = dict(counters["graph_break"])
        # two attention call sites, each an island (the break is also counted in the frame Dynamo resumes); RoPE
        # none: three compiled pieces around the islands
        assert breaks and all("torch.compiler.disable" in r for r in breaks), breaks
        assert graphs[0] == 3, graphs
        # the dense layouts through the op (their angles broadcast over batch and heads: the fake's shapes), and
        # what the op cannot take through an island: an explicit group, a table that requires grad
        x4 = q.detach()[None].requires_grad_()  # [1, 24, 2, 8]
        cases = [(x4, freqs, {"qkv_format": "bshd", "interleaved": True}),
                 (x4.transpose(0, 1), freqs, {"qkv_format": "sbhd"}),
                 (q, freqs, {"qkv_format": "thd", "cu_seqlens": cu, "group": None}),
                 (q, freqs.clone().requires_grad_(), {"qkv_format": "thd", "cu_seqlens": cu})]
        for i, (t, fr, kw) in enumerate(cases):
            rope = torch.compile(lambda t, f: cpscope.apply_rotary_pos_emb(t, f, **kw), backend=backend)
            before = sum(counters["graph_break"].values())
            got = rope(t, fr)
            assert (sum(counters["graph_break"].values()) > before) == (i >= 2), (kw, dict(counters["graph_break"]))
            want = cpscope.apply_rotary_pos_emb(t, fr, **kw)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            grads = [torch.autograd.grad(o.pow(2).sum(), [t] + [fr] * fr.requires_grad) for o in (got, want)]
            for a, b in zip(*grads):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        with pytest.raises(ValueError, match="freqs"):  # a table shorter than the longest document
            compiled(q, k, v, freqs[:8], cu, attn)
        with pytest.raises(ValueError, match="cu_seqlens"):  # offsets that do not cover the local tokens
            compiled(q, k, v, freqs, torch.tensor([0, 8, 16], dtype=torch.int32), attn)
        te_rope = torch.compile(lambda t: cpscope.apply_rotary_pos_emb(t, freqs, qkv_format="thd", cu_seqlens=cu,
                                                                       impl="te"), backend=backend)
        with pytest.raises(ValueError, match="TransformerEngine"):  # a named fused kernel runs as the whole island
            te_rope(q)
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("qkv_format", ["bshd", "thd"])
def test_compiled_model_inductor_cuda(qkv_format):
    """The two-layer model on one GPU (CP1), bf16, compiled with inductor: RoPE's op and the rotation in inductor's
    graphs, attention an eager island on cuDNN; forward and gradients equal the eager model's, two new lengths
    compile nothing after the first change (automatic dynamic), the graphs stay within the bound."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = _Model(qkv_format).to("cuda", torch.bfloat16)
    compiled = torch.compile(model)
    freqs = cpscope.rotary_freqs(MD, 256, device="cuda")
    unique = []
    with torch._dynamo.config.patch(suppress_errors=False, fail_on_recompile_limit_hit=True, recompile_limit=64):
        for docs in ([64, 64], [32, 96, 64], [128, 32, 96], [64, 64, 64, 64]):
            docs = docs if qkv_format == "thd" else docs[:1]
            total = sum(docs)
            x = torch.randn(total, ME, device="cuda", dtype=torch.bfloat16)
            x = (x if qkv_format == "thd" else x[None]).requires_grad_()
            cu = torch.tensor([0] + [sum(docs[:i + 1]) for i in range(len(docs))], dtype=torch.int32,
                              device="cuda") if qkv_format == "thd" else None
            got, want = compiled(x, freqs, cu), model(x, freqs, cu)
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
            params = [x] + list(model.parameters())
            for a, b in zip(torch.autograd.grad(got.float().square().sum(), params),
                            torch.autograd.grad(want.float().square().sum(), params)):
                err = (a.float() - b.float()).norm() / b.float().norm()  # bf16: normwise, not elementwise
                assert err < 2e-2, (docs, err)
            unique.append(counters["stats"]["unique_graphs"])
    breaks = {r.split("\n")[0]: n for r, n in counters["graph_break"].items()}
    torch._dynamo.reset()
    assert all("torch.compiler.disable" in r for r in breaks), breaks
    assert unique[-1] <= 2 * (ISLANDS_PER_LAYER * MLAYERS + 1) and unique[1:] == [unique[1]] * 3, unique


def _sentinel_over_compiled_model() -> tuple[dict, Any]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    groups = cpscope.new_cp_groups([1, 2])
    torch.manual_seed(0)
    model = _Model("thd")
    compiled = torch.compile(model, backend="aot_eager")
    freqs = cpscope.rotary_freqs(MD, 128).double()
    with cpscope.sentinel(every=1, on_mismatch="raise") as s:
        for group in (groups[2], groups[1], groups[2]):
            cp = 1 if group is None else group.size()
            x = torch.randn(48 // cp, ME, dtype=torch.float64, requires_grad=True)
            with cpscope.runtime_cp(group):
                compiled(x, freqs, torch.tensor([0, 16, 48], dtype=torch.int32)).sum().backward()
    breaks = {r.split("\n")[0]: n for r, n in counters["graph_break"].items()}
    torch._dynamo.reset()
    return breaks, s.summary()


def test_sentinel_checks_a_compiled_model():
    """The sentinel's observers run inside the islands (attention) and the rope_angles op (RoPE): every call of a
    compiled model is checked, CP2 / CP1 / CP2 on 2 ranks, and agrees; its hooks add no graph break."""
    for breaks, summary in run_ranks(2, _sentinel_over_compiled_model):
        assert all("torch.compiler.disable" in r for r in breaks), breaks
        calls = 3 * MLAYERS  # microbatches x layers
        assert summary.checks["rope"] == 2 * calls and summary.checks["attention"] == calls, summary
        assert summary.checks["attention-grad"] == calls and summary.mismatches == 0, summary


# One process, rank 0 of a 2-rank world of torch's fake process group (RoPE needs no collective): RoPE compiled with
# CUDA graphs, called under CP2 and then CP1 with the same local shape. A replayed graph would keep the CP2 angles;
# the rope_angles op is tagged cudagraph_unsafe, so its host side runs at every call.
_REDUCE_OVERHEAD_SCRIPT = """
import sys, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
import cpscope
dev = sys.argv[1]
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
groups = cpscope.new_cp_groups([1, 2])
freqs = cpscope.rotary_freqs(16, 64, device=dev)
rope = lambda t: cpscope.apply_rotary_pos_emb(t, freqs, qkv_format="bshd") * 2
compiled = torch.compile(rope, mode="reduce-overhead" if dev == "cuda" else "default")
x = torch.randn(1, 16, 2, 16, device=dev)
for size in (2, 2, 2, 1, 1, 2, 1):
    with cpscope.runtime_cp(groups[size]):
        torch.testing.assert_close(compiled(x.clone()), rope(x), rtol=1e-5, atol=1e-5, msg=f"CP{size}")
print("ok")
"""


def _reduce_overhead_check(device: str) -> None:
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run([sys.executable, "-c", _REDUCE_OVERHEAD_SCRIPT, device], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


@pytest.mark.gpu
def test_rope_under_cuda_graphs_follows_the_scope():
    _reduce_overhead_check("cuda")
