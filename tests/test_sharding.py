"""Zigzag sharding: index math against a naive chunk-by-chunk reference, shard/unshard round trips (pure and over
real gloo groups), gradients, padding helpers and bad input."""
from __future__ import annotations

import re
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpscope
from cpscope import _tensor_cache
from cpscope._pack import pack_for
from cpscope.scope import CPScope
from cpscope.sharding import (
    pad_packed_batch,
    pad_to_cp_multiple,
    zigzag_indices,
    zigzag_position_ids,
    zigzag_positions,
    zigzag_shard,
    zigzag_unshard,
)
from tests.distributed import run_ranks


# ----------------------------------------------------------------------------------------------------------------
# Independent references


def ref_local_tokens(doc_lens: list[int], cp: int, rank: int) -> tuple[list[int], list[int]]:
    """(full indices, positions) of rank's tokens: cut each document into 2cp chunks, keep r and 2cp-1-r."""
    idx, pos, start = [], [], 0
    for n in doc_lens:
        tokens = list(range(start, start + n))
        c = n // (2 * cp)
        chunks = [tokens[i * c : (i + 1) * c] for i in range(2 * cp)]
        for t in chunks[rank] + chunks[2 * cp - 1 - rank]:
            idx.append(t)
            pos.append(t - start)
        start += n
    return idx, pos


def cu_of(doc_lens: list[int]) -> list[int]:
    cu = [0]
    for n in doc_lens:
        cu.append(cu[-1] + n)
    return cu


def fake_scope(cp: int, rank: int) -> CPScope:
    """A scope for index-only code paths (no communication), to simulate every rank in one process."""
    return CPScope(object(), cp, rank) if cp > 1 else CPScope(None, 1, 0)


def as_rank(cp: int, rank: int, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with a fake scope of rank ``rank`` of ``cp`` bound."""
    with fake_scope(cp, rank).bind():
        return fn(*args, **kwargs)


# ----------------------------------------------------------------------------------------------------------------
# Index math


def test_indices_examples():
    assert zigzag_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert zigzag_indices([0, 4, 12], 2, 1).tolist() == [1, 2, 6, 7, 8, 9]
    assert zigzag_positions([0, 4, 12], 2, 1).tolist() == [1, 2, 2, 3, 4, 5]
    assert zigzag_indices(torch.tensor([0, 3, 8], dtype=torch.int32), 1, 0).tolist() == list(range(8))
    assert zigzag_indices(8, 2, 0).dtype == torch.long


@settings(max_examples=60, deadline=None)
@given(cp=st.integers(1, 5), mults=st.lists(st.integers(0, 4), min_size=1, max_size=5))
def test_indices_and_positions_match_reference(cp, mults):
    doc_lens = [2 * cp * m for m in mults]
    cu = cu_of(doc_lens)
    seen = []
    for r in range(cp):
        ref_idx, ref_pos = ref_local_tokens(doc_lens, cp, r)
        assert zigzag_indices(cu, cp, r).tolist() == ref_idx
        assert zigzag_positions(cu, cp, r).tolist() == ref_pos
        with fake_scope(cp, r).bind():
            assert zigzag_position_ids(torch.tensor(cu, dtype=torch.int32)).tolist() == ref_pos
        seen += ref_idx
    assert sorted(seen) == list(range(cu[-1]))  # the ranks partition the tokens


def test_index_cache_lives_with_the_offsets():
    """Packs are cached: on the offsets tensor while it lives, else in a bounded LRU; what is returned is new."""
    cpscope.clear_caches()
    a = zigzag_indices([0, 8, 16], 2, 1)
    assert pack_for([0, 8, 16], 2, 1) is pack_for((0, 8, 16), 2, 1)  # Python offsets: LRU hit
    t = torch.tensor([0, 8, 16], dtype=torch.int32)
    b = zigzag_indices(t, 2, 1)
    assert pack_for(t, 2, 1) is pack_for(t, 2, 1) and torch.equal(a, b)  # cached on the tensor
    assert zigzag_indices(t, 2, 1) is not b  # a fresh tensor every call (never the cached one)
    for n in range(1, _tensor_cache.VALUE_CACHE_SIZE + 10):
        zigzag_indices(4 * n, 2, 0)
    assert _tensor_cache.stats()["values"] <= _tensor_cache.VALUE_CACHE_SIZE
    assert _tensor_cache.stats()["tensors"] == 1
    del t
    assert _tensor_cache.stats()["tensors"] == 0  # gone with its tensor
    cpscope.clear_caches()
    assert _tensor_cache.stats() == {"tensors": 0, "derived": 0, "values": 0}


def test_positions_one_function_two_names():
    assert cpscope.zigzag_position_ids is cpscope.zigzag_positions
    cu = [0, 4, 12]
    with fake_scope(2, 1).bind():
        assert zigzag_position_ids(cu).tolist() == zigzag_positions(cu, 2, 1).tolist() == [1, 2, 2, 3, 4, 5]
        assert zigzag_indices(cu).tolist() == [1, 2, 6, 7, 8, 9]  # cp / rank of the active scope
    assert zigzag_positions(cu, group=None).tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]
    with pytest.raises(ValueError, match=r"pass both cp and rank \(got cp=2, rank=None\)"):
        zigzag_positions(cu, 2)
    with pytest.raises(ValueError, match=r"either cp and rank.*or group="):
        zigzag_indices(cu, 2, 1, group=None)


# ----------------------------------------------------------------------------------------------------------------
# Pure round trip: shard for every rank, reassemble by the indices, compare to the naive reference

LAYOUTS = {"bshd": 1, "sbhd": 0, "thd": 0}


def _make(layout: str, doc_lens: list[int], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    total = sum(doc_lens)
    shape = {"bshd": (2, total, 3, 4), "sbhd": (total, 2, 3, 4), "thd": (total, 3, 4)}[layout]
    return torch.randn(shape, generator=g)


@settings(max_examples=60, deadline=None)
@given(
    cp=st.sampled_from([1, 2, 3, 4]),
    layout=st.sampled_from(sorted(LAYOUTS)),
    mults=st.lists(st.integers(0, 3), min_size=1, max_size=4),
)
def test_shard_reassemble_roundtrip(cp, layout, mults):
    doc_lens = [2 * cp * m for m in mults]
    if layout != "thd":
        doc_lens = [sum(doc_lens)]
    x = _make(layout, doc_lens)
    d = LAYOUTS[layout]
    cu = cu_of(doc_lens) if layout == "thd" else None
    full = torch.full_like(x, float("nan"))
    for r in range(cp):
        local = as_rank(cp, r, zigzag_shard, x, seq_dim=d, cu_seqlens=cu)
        ref_idx, _ = ref_local_tokens(doc_lens, cp, r)
        assert torch.equal(local, x.index_select(d, torch.tensor(ref_idx, dtype=torch.long)))
        full.index_copy_(d, zigzag_indices(cu if cu else doc_lens[0], cp, r), local)
    assert torch.equal(full, x)


def test_cp1_is_identity():
    x = torch.randn(2, 6, 1, 2)
    assert zigzag_shard(x, seq_dim=1) is x
    assert zigzag_unshard(x, seq_dim=1) is x
    assert zigzag_shard(x, seq_dim=1, group=None) is x
    assert zigzag_position_ids(6).tolist() == list(range(6))
    assert zigzag_position_ids([0, 2, 6]).tolist() == [0, 1, 0, 1, 2, 3]


def test_shard_is_differentiable():
    x = torch.randn(16, 3, requires_grad=True)
    cu = [0, 4, 16]
    local = as_rank(2, 1, zigzag_shard, x, seq_dim=0, cu_seqlens=cu)
    w = torch.randn_like(local)
    (local * w).sum().backward()
    ref = torch.zeros(16, 3)
    ref[torch.tensor(ref_local_tokens([4, 12], 2, 1)[0])] = w
    assert torch.equal(x.grad, ref)


# ----------------------------------------------------------------------------------------------------------------
# Real collectives on the gloo pools


def _unshard_roundtrip_task(sizes):
    groups = cpscope.new_cp_groups(sizes)
    out = []
    for cp in sizes:
        group = groups[cp]
        with cpscope.runtime_cp(group):
            rank = cpscope.cp_rank()
            for layout, d in LAYOUTS.items():
                doc_lens = [2 * cp * 2, 0, 2 * cp * 3] if layout == "thd" else [2 * cp * 3]
                cu = cu_of(doc_lens) if layout == "thd" else None
                x = _make(layout, doc_lens, seed=cp)
                local = zigzag_shard(x, seq_dim=d, cu_seqlens=cu).clone().requires_grad_(True)
                full = zigzag_unshard(local, seq_dim=d, cu_seqlens=cu)
                assert torch.equal(full, x), (cp, layout)
                w = _make(layout, doc_lens, seed=100 + cp)
                (full * w).sum().backward()
                ref_idx = torch.tensor(ref_local_tokens(doc_lens, cp, rank)[0], dtype=torch.long)
                assert torch.equal(local.grad, w.index_select(d, ref_idx)), (cp, layout)
            x = _make("bshd", [4 * cp])
            with cpscope.runtime_cp(None):  # explicit group= wins over the active (CP1) scope
                local = zigzag_shard(x, seq_dim=1, group=group)
                assert torch.equal(zigzag_unshard(local, seq_dim=1, group=group), x)
        out.append(cp)
    return out


@pytest.mark.parametrize("world,sizes", [(2, [1, 2]), (4, [1, 2, 4])])
def test_unshard_collective_roundtrip_and_grad(world, sizes):
    assert run_ranks(world, _unshard_roundtrip_task, sizes) == [sizes] * world


def _unshard_bad_input_task():
    group = cpscope.new_cp_groups([2])[2]
    with cpscope.runtime_cp(group):
        with pytest.raises(ValueError, match=r"holds 5 local tokens.*cu_seqlens\[-1\]=8"):
            zigzag_unshard(torch.zeros(5, 2), seq_dim=0, cu_seqlens=[0, 8])
        with pytest.raises(ValueError, match=r"local length must be even.*got 3"):
            zigzag_unshard(torch.zeros(1, 3, 2), seq_dim=1)
        # the pool is still in step: a real collective right after
        x = torch.arange(8.0)
        assert torch.equal(zigzag_unshard(zigzag_shard(x, seq_dim=0), seq_dim=0), x)
    return True


def test_unshard_bad_input_raises_before_collective():
    assert run_ranks(2, _unshard_bad_input_task) == [True, True]


# ----------------------------------------------------------------------------------------------------------------
# Padding


def test_pad_packed_batch():
    cu = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    ids = torch.arange(1, 11)
    h = torch.randn(10, 2, requires_grad=True)
    b = pad_packed_batch(ids, h, cu_seqlens=cu, cp=2, pad_value=(-100, 0.0))
    assert b.cu_seqlens_padded.tolist() == [0, 4, 4, 12] and b.cu_seqlens_padded.dtype == torch.int32
    assert b.cu_seqlens.tolist() == [0, 3, 3, 10] and b.cu_seqlens.dtype == torch.int32
    ids_p, h_p = b.tensors
    assert ids_p.tolist() == [1, 2, 3, -100, 4, 5, 6, 7, 8, 9, 10, -100]
    assert b.real_mask.tolist() == [t != -100 for t in ids_p.tolist()]
    assert b.real_index.tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 9, 10]
    assert torch.equal(h_p[b.real_index], h) and torch.equal(h_p[~b.real_mask], torch.zeros(2, 2))
    (h_p * 3).sum().backward()
    assert torch.equal(h.grad, torch.full_like(h, 3.0))
    # padded batch shards cleanly with CP2; already-divisible documents are unchanged
    as_rank(2, 0, zigzag_shard, ids_p, seq_dim=0, cu_seqlens=b.cu_seqlens_padded)
    same = pad_packed_batch(ids_p, cu_seqlens=b.cu_seqlens_padded, cp=2)
    assert torch.equal(same.tensors[0], ids_p) and bool(same.real_mask.all())


def test_pad_packed_batch_cp_from_scope_and_errors():
    with fake_scope(4, 1).bind():
        b = pad_packed_batch(torch.zeros(5), cu_seqlens=[0, 5])
    assert b.cu_seqlens_padded.tolist() == [0, 8]
    with pytest.raises(ValueError, match=r"tensor 0 has shape \(6,\).*cu_seqlens\[-1\]=5"):
        pad_packed_batch(torch.zeros(6), cu_seqlens=[0, 5], cp=2)
    with pytest.raises(ValueError, match=r"pad_value has 1 entries for 2 tensors"):
        pad_packed_batch(torch.zeros(5), torch.zeros(5), cu_seqlens=[0, 5], cp=2, pad_value=[0])


def test_pad_to_cp_multiple():
    x = torch.ones(2, 5, 1)
    y, n = pad_to_cp_multiple(x, seq_dim=1, cp=2, pad_value=-1)
    assert n == 5 and y.shape == (2, 8, 1) and y[:, 5:].eq(-1).all() and y[:, :5].eq(1).all()
    z, n = pad_to_cp_multiple(y, seq_dim=1, cp=2)
    assert z is y and n == 8


# ----------------------------------------------------------------------------------------------------------------
# Bad input: ValueError naming the values


def test_bad_sequence_not_divisible():
    with pytest.raises(ValueError, match=r"divisible by 2\*cp=4, got 6"):
        as_rank(2, 0, zigzag_shard, torch.zeros(1, 6), seq_dim=1)
    with pytest.raises(ValueError, match=r"divisible by 2\*cp=8, got 12"):
        zigzag_indices(12, 4, 0)


def test_bad_document_not_divisible():
    with pytest.raises(ValueError, match=r"document 1 has length 6"):
        as_rank(2, 0, zigzag_shard, torch.zeros(10), seq_dim=0, cu_seqlens=[0, 4, 10])


def test_bad_cu_seqlens():
    with pytest.raises(ValueError, match=r"must start at 0, got 2"):
        zigzag_indices([2, 8], 2, 0)
    with pytest.raises(ValueError, match=r"non-decreasing.*cu_seqlens\[2\]=4 < cu_seqlens\[1\]=8"):
        zigzag_indices([0, 8, 4], 2, 0)
    with pytest.raises(ValueError, match=r"int32 \(or int64\) tensor, got dtype torch.float32"):
        zigzag_indices(torch.tensor([0.0, 8.0]), 2, 0)
    with pytest.raises(ValueError, match=r"must hold integers, got \[0, 8.0\]"):
        zigzag_indices([0, 8.0], 2, 0)


def test_bad_shard_length_vs_cu_seqlens():
    with pytest.raises(ValueError, match=r"x has 12 tokens.*cu_seqlens\[-1\]=8"):
        as_rank(2, 0, zigzag_shard, torch.zeros(12), seq_dim=0, cu_seqlens=[0, 8])


def test_bad_seq_dim_and_rank():
    with pytest.raises(ValueError, match=r"seq_dim=3 is out of range for a tensor of shape \(2, 4\)"):
        zigzag_shard(torch.zeros(2, 4), seq_dim=3)
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, cp=2\), got 2"):
        zigzag_indices(8, 2, 2)
    with pytest.raises(ValueError, match=r"cp must be an integer >= 1, got 0"):
        zigzag_indices(8, 0, 0)


def test_cu_seqlens_host_copy_is_cached_per_tensor_and_version():
    """Every layer validating the same cu_seqlens tensor shares one host copy; an in-place change is seen."""
    from cpscope._pack import cu_seqlens_list

    cu = torch.tensor([0, 4, 12], dtype=torch.int32)
    assert cu_seqlens_list(cu) == [0, 4, 12]
    calls = []
    real = torch.Tensor.tolist
    try:
        torch.Tensor.tolist = lambda self: calls.append(1) or real(self)
        assert cu_seqlens_list(cu) == [0, 4, 12] and not calls  # cached: no new host copy
        cu[2] = 16  # in place: bumps the version counter
        assert cu_seqlens_list(cu) == [0, 4, 16] and calls == [1]
        cu[1] = 20  # now non-monotonic: re-validated, not served stale
        with pytest.raises(ValueError, match="non-decreasing"):
            cu_seqlens_list(cu)
    finally:
        torch.Tensor.tolist = real
    with torch.inference_mode():
        inf = torch.tensor([0, 8], dtype=torch.int32)
    assert cu_seqlens_list(inf) == [0, 8]  # no version counter: followed by its content (CPU)
    key = id(cu)
    assert key in _tensor_cache._BY_TENSOR
    del cu
    assert key not in _tensor_cache._BY_TENSOR  # the entry dies with its tensor


def test_cp1_shard_and_unshard_still_validate_cu_seqlens():
    """CP1 returns the tensor itself, but a cu_seqlens that does not describe it is an error, not ignored."""
    x = torch.randn(8, 2)
    assert zigzag_shard(x, seq_dim=0, cu_seqlens=[0, 3, 8]) is x
    for bad, match in (([0, 5], r"8 (local )?tokens.*cu_seqlens\[-1\]=5"), ([3, 1], "must start at 0")):
        with pytest.raises(ValueError, match=match):
            zigzag_shard(x, seq_dim=0, cu_seqlens=bad)
        with pytest.raises(ValueError, match=match):
            zigzag_unshard(x, seq_dim=0, cu_seqlens=bad)


def test_pad_helpers_refuse_cp_contradicting_group():
    with pytest.raises(ValueError, match=r"cp=2 contradicts group= of CP size 1"):
        pad_packed_batch(torch.zeros(6), cu_seqlens=[0, 6], cp=2, group=None)
    with pytest.raises(ValueError, match=r"cp=4 contradicts group= of CP size 1"):
        pad_to_cp_multiple(torch.zeros(1, 6), seq_dim=1, cp=4, group=None)


# ----------------------------------------------------------------------------------------------------------------
# Integers of any kind; cached state never aliased, never stale


def test_numpy_integers_are_sizes_and_ranks():
    i64, i32 = np.int64, np.int32
    assert zigzag_indices(i64(8), i64(2), i32(1)).tolist() == [2, 3, 4, 5]
    assert zigzag_positions(np.array([0, 4, 12]), i32(2), i64(1)).tolist() == [1, 2, 2, 3, 4, 5]
    assert zigzag_positions([i64(0), i64(4), i64(12)], 2, 1).tolist() == [1, 2, 2, 3, 4, 5]
    assert pad_packed_batch(torch.zeros(5), cu_seqlens=[0, 5], cp=i64(2)).cu_seqlens_padded.tolist() == [0, 8]
    assert pad_to_cp_multiple(torch.zeros(1, 5), seq_dim=1, cp=i32(2))[0].shape == (1, 8)
    assert cpscope.sharding.real_offsets(i64(5), i64(2)).tolist() == [0, 5, 10]
    for bad, name in ((True, "cp"), (2.0, "cp"), (np.float32(2), "cp"), (np.bool_(True), "cp")):
        with pytest.raises(ValueError, match=rf"{name} must be an integer, got \w+ {re.escape(repr(bad))}"):
            zigzag_indices(8, bad, 0)
    with pytest.raises(ValueError, match=r"rank must be an integer, got float 1.0"):
        zigzag_positions(8, 2, 1.0)
    with pytest.raises(ValueError, match=r"cp must be an integer, got bool True"):
        pad_packed_batch(torch.zeros(4), cu_seqlens=[0, 4], cp=True)
    with pytest.raises(ValueError, match=r"cp must be an integer, got float 2.0"):
        pad_to_cp_multiple(torch.zeros(1, 4), seq_dim=1, cp=2.0)


def _ref_rope(x: torch.Tensor, freqs: torch.Tensor, pos: list[int]) -> torch.Tensor:
    """Non-interleaved RoPE of ``[t, h, d]`` at ``pos``, float64 (rot_dim == d)."""
    f = freqs[torch.tensor(pos)].reshape(len(pos), 1, -1).double()
    x1, x2 = x.double().chunk(2, dim=-1)
    return x.double() * f.cos() + torch.cat([-x2, x1], -1) * f.sin()


def _doc_positions(cu: list[int]) -> list[int]:
    return [p for a, b in zip(cu[:-1], cu[1:]) for p in range(b - a)]


def test_returned_tensors_never_alias_a_cache():
    """Changing what cpscope returned in place changes nothing it computes later (was: RoPE rotated at the
    shifted positions, max difference 6.57 on this 16-token pack)."""
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    freqs = cpscope.rotary_freqs(8, 32)
    x = torch.randn(8, 2, 8, generator=torch.Generator().manual_seed(0))  # [t_local, h, d]
    with fake_scope(2, 1).bind():
        want = cpscope.apply_rotary_pos_emb(x, freqs, qkv_format="thd", cu_seqlens=cu)
        pos = cpscope.zigzag_position_ids(cu)
        pos += 3
        idx = cpscope.zigzag_indices(cu)
        idx.zero_()
        got = cpscope.apply_rotary_pos_emb(x, freqs, qkv_format="thd", cu_seqlens=cu)
        assert cpscope.zigzag_position_ids(cu).tolist() == [2, 3, 4, 5, 2, 3, 4, 5]
        assert cpscope.zigzag_indices(cu).tolist() == [2, 3, 4, 5, 10, 11, 12, 13]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got.double(), _ref_rope(x, freqs, [2, 3, 4, 5, 2, 3, 4, 5]))
    for fn in (zigzag_positions, zigzag_indices):
        first = fn(cu, 2, 0)
        first.add_(100)
        assert fn(cu, 2, 0).max() < 16
        first = fn([0, 16], 2, 0)  # value-keyed offsets
        first.add_(100)
        assert fn([0, 16], 2, 0).max() < 16


def test_offsets_refilled_in_place_behind_torchs_back_are_seen():
    """``cu = torch.from_numpy(buf)`` reused while the loader refills ``buf[:]``: the version counter does not
    move, yet host copies, packs, positions, RoPE and attention masks follow the new boundaries."""
    from tests.attention._reference import reference_attention

    buf = np.array([0, 8, 16], dtype=np.int32)
    cu = torch.from_numpy(buf)
    assert cpscope._pack.host_offsets(cu) == (0, 8, 16)
    old_pack = pack_for(cu, 2, 1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 2, 8, generator=g, dtype=torch.float64)
    freqs = cpscope.rotary_freqs(8, 32)
    cpscope.apply_rotary_pos_emb(x, freqs, qkv_format="thd", cu_seqlens=cu, group=None)
    version = cu._version
    buf[:] = [0, 4, 16]  # the loader's next microbatch, into the same memory
    assert cu._version == version  # torch did not see the write
    assert cpscope._pack.host_offsets(cu) == (0, 4, 16)
    new_pack = pack_for(cu, 2, 1)
    assert new_pack is not old_pack and new_pack.cu == (0, 4, 16)  # what the ring and cuDNN offsets derive from
    assert zigzag_positions(cu, 2, 1).tolist() == ref_local_tokens([4, 12], 2, 1)[1]
    rope = cpscope.apply_rotary_pos_emb(x, freqs, qkv_format="thd", cu_seqlens=cu, group=None)
    torch.testing.assert_close(rope.double(), _ref_rope(x, freqs, _doc_positions([0, 4, 16])))
    q, k, v = (torch.randn(16, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    out = cpscope.context_parallel_attention(q, k, v, qkv_format="thd", causal=True, cu_seqlens=cu, group=None)
    torch.testing.assert_close(out, reference_attention(q, k, v, causal=True, cu=[0, 4, 16]))


def test_clear_caches_calls_every_registered_clear():
    calls: list[int] = []
    fn = _tensor_cache.register_clear(lambda: calls.append(1))
    try:
        _tensor_cache.register_clear(fn)  # registered once
        zigzag_indices(torch.tensor([0, 8], dtype=torch.int32), 2, 0)
        cpscope.clear_caches()
        assert calls == [1] and _tensor_cache.stats() == {"tensors": 0, "derived": 0, "values": 0}
    finally:
        _tensor_cache._CLEARS.remove(fn)
    from cpscope.attention._kernels import cudnn_frontend

    assert cudnn_frontend.clear_cache in _tensor_cache._CLEARS  # the cuDNN graph cache registered itself


def test_tensor_cache_from_many_threads():
    """Concurrent lookups of shared and fresh offsets tensors give the right packs (no lost or mixed entries)."""
    shared = [torch.tensor([0, 4 * (i + 1), 8 * (i + 1)], dtype=torch.int32) for i in range(4)]
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            for step in range(200):
                i = (seed + step) % 4
                t = shared[i] if step % 2 else torch.tensor([0, 4 * (i + 1), 8 * (i + 1)], dtype=torch.int32)
                p = pack_for(t, 2, step % 2)
                assert p.cu == (0, 4 * (i + 1), 8 * (i + 1)) and p.rank == step % 2
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[0]
