"""torch.compile over hybrid CP: reading the scope in a compiled block does not recompile per microbatch or group.

The pattern under test (docs/autograd.md, "torch.compile"): the ContextVar read and the ring's collectives stay
eager (``torch.compiler.disable``); only tensors and plain ints reach the compiled code. A block is run over CP1,
CP2, CP4 and a *second, different* CP2 group, twice, on a 4-rank gloo pool; the number of graphs compiled is
bounded (automatic dynamic shapes: at most one static and one dynamic graph per segment between the eager calls),
the CP2-b microbatch and the whole second pass compile nothing, and the compiled forward and gradients equal
eager ones, which equal a float64 full-sequence reference cut per rank.

Backend: a counting wrapper that runs the captured FX graph as is (what ``backend="eager"`` does). What this test
checks is Dynamo's capture, guards and recompiles, which do not depend on the backend; inductor would add minutes
of C++ compilation on a 2-core CPU box without changing the count.
"""
from __future__ import annotations

import math
from typing import Any

import torch

import cpscope
from cpscope.attention import context_parallel_attention
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
    from cpscope.attention import ContextParallelAttention

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
