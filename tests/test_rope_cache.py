"""The eager RoPE path's per-pack cos / sin (issue 31, host time per layer): kept on the pack of a ``thd`` offsets
tensor, used only for the very same table, the same numbers as computing them per call; a new offsets tensor, an
in-place write to the table, a table that learns, inference mode and bad input behave as without it;
``cpscope.clear_caches()`` drops it and nothing it holds outlives its offsets tensor (no reference cycle)."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

import cpscope
from cpscope import _tensor_cache
from cpscope._pack import pack_for
from cpscope.rope import _api as api
from cpscope.rope._torch_math import rope_math


def _cu(*lens: int) -> torch.Tensor:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


def _slots(cu: torch.Tensor, dtype: torch.dtype = torch.float32, cp: int = 1, rank: int = 0) -> list:
    return pack_for(cu, cp, rank).memo(("rope_cos_sin", torch.device("cpu"), dtype), list)


def _reference(t: torch.Tensor, freqs: torch.Tensor, cu: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    return rope_math(t, api._angles(freqs, pack_for(cu, 1, 0), "thd"), interleaved)


def _rope(t, freqs, cu, **kw):
    return cpscope.apply_rotary_pos_emb(t, freqs, qkv_format="thd", cu_seqlens=cu, group=None, **kw)


@pytest.fixture(autouse=True)
def _clean():
    cpscope.clear_caches()
    yield
    cpscope.clear_caches()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_cached_equals_per_call_math_forward_and_backward(dtype, interleaved):
    cu = _cu(8, 16, 8)
    freqs = cpscope.rotary_freqs(8, 64, interleaved=interleaved)
    t = torch.randn(32, 2, 12, dtype=dtype, requires_grad=True)  # 12 channels: 4 pass through
    ref = _reference(t, freqs, cu, interleaved)
    (g_ref,) = torch.autograd.grad(ref.sum(), t)
    for _ in range(3):  # first layer builds, later layers hit
        out = _rope(t, freqs, cu, interleaved=interleaved)
        assert torch.equal(out, ref)
        (g,) = torch.autograd.grad(out.sum(), t)
        assert torch.equal(g, g_ref)
    assert len(_slots(cu, torch.promote_types(dtype, torch.float32))) == 1


def test_later_layers_reuse_one_entry_and_views_of_one_table_hit():
    cu = _cu(8, 8)
    rope = cpscope.RotaryEmbedding(8)
    t = torch.randn(16, 1, 8)
    _rope(t, rope(64), cu)
    (entry,) = _slots(cu)
    for _ in range(3):  # RotaryEmbedding hands out a new view of its cached table per call
        _rope(t, rope(64), cu)
    assert _slots(cu) == [entry]


def test_new_offsets_tensor_gets_its_own_entry():
    freqs = cpscope.rotary_freqs(8, 64)
    t = torch.randn(32, 1, 8)
    cu1, cu2 = _cu(16, 16), _cu(8, 24)  # same total: another pack
    assert torch.equal(_rope(t, freqs, cu1), _reference(t, freqs, cu1))
    assert torch.equal(_rope(t, freqs, cu2), _reference(t, freqs, cu2))
    assert not torch.equal(_reference(t, freqs, cu1), _reference(t, freqs, cu2))
    assert len(_slots(cu1)) == 1 and len(_slots(cu2)) == 1


def test_offsets_written_in_place_miss():
    freqs = cpscope.rotary_freqs(8, 64)
    t = torch.randn(32, 1, 8)
    cu = _cu(16, 16)
    _rope(t, freqs, cu)
    cu[1] = 8  # a write through torch: a new pack for the same tensor
    assert torch.equal(_rope(t, freqs, cu), _reference(t, freqs, _cu(8, 24)))


def test_table_written_in_place_or_another_table_misses():
    cu = _cu(8, 24)
    t = torch.randn(32, 1, 8)
    freqs = cpscope.rotary_freqs(8, 64)
    _rope(t, freqs, cu)
    with torch.no_grad():
        freqs.mul_(0.5)  # bumps the version counter
    assert torch.equal(_rope(t, freqs, cu), _reference(t, freqs, cu))
    other = cpscope.rotary_freqs(8, 64, base=500.0)  # alternating tables (local / global RoPE) keep an entry each
    assert torch.equal(_rope(t, other, cu), _reference(t, other, cu))
    assert torch.equal(_rope(t, freqs, cu), _reference(t, freqs, cu))
    assert len(_slots(cu)) == 3  # the stale entry of the written table stays until pushed out
    for base in (1e3, 2e3, 3e3, 4e3):
        f = cpscope.rotary_freqs(8, 64, base=base)
        assert torch.equal(_rope(t, f, cu), _reference(t, f, cu))
    assert len(_slots(cu)) == api._COS_SIN_TABLES


def test_table_that_learns_is_not_cached_and_gets_its_gradient():
    cu = _cu(8, 8)
    freqs = cpscope.rotary_freqs(8, 64).clone().requires_grad_(True)
    t = torch.randn(16, 1, 8)
    for _ in range(2):
        (g,) = torch.autograd.grad(_rope(t, freqs, cu).sum(), freqs)
        assert g.abs().sum() > 0
    assert _slots(cu) == []


def test_inference_mode_is_not_cached():
    cu = _cu(8, 8)
    freqs = cpscope.rotary_freqs(8, 64)
    t = torch.randn(16, 1, 8)
    with torch.inference_mode():
        out = _rope(t, freqs, cu)
    assert _slots(cu) == []
    t.requires_grad_(True)  # a later training call: no inference tensor saved for its backward
    assert torch.equal(out, _rope(t, freqs, cu).detach())
    _rope(t, freqs, cu).sum().backward()


def test_bad_input_still_raises_after_a_cached_call():
    cu = _cu(8, 8)
    freqs = cpscope.rotary_freqs(8, 64)
    _rope(torch.randn(16, 1, 8), freqs, cu)
    with pytest.raises(ValueError):
        _rope(torch.randn(12, 1, 8), freqs, cu)  # local length != cu[-1]
    with pytest.raises(ValueError):
        _rope(torch.randn(16, 1, 8), cpscope.rotary_freqs(8, 4), cu)  # table shorter than the longest document
    with pytest.raises(ValueError):
        _rope(torch.randn(16, 1, 4), freqs, cu)  # rot_dim > d


def test_clear_caches_drops_it():
    cu = _cu(8, 8)
    _rope(torch.randn(16, 1, 8), cpscope.rotary_freqs(8, 64), cu)
    cos = weakref.ref(_slots(cu)[0][2])
    cpscope.clear_caches()
    assert cos() is None
    assert _tensor_cache.stats()["tensors"] == 0


def test_entry_dies_with_its_offsets_tensor_without_a_cycle():
    freqs = cpscope.rotary_freqs(8, 64)
    t = torch.randn(16, 1, 8, requires_grad=True)
    gc.collect()
    gc.disable()
    try:
        cu = _cu(8, 8)
        out = _rope(t, freqs, cu)
        out.sum().backward()
        (slot,) = _slots(cu)
        cos, sin, table = weakref.ref(slot[2]), weakref.ref(slot[3]), weakref.ref(slot[0])
        del slot, out, cu
        assert cos() is None and sin() is None  # freed by reference counting alone
        assert table() is freqs._base or table() is freqs  # the caller's table itself lives on
    finally:
        gc.enable()
    assert _tensor_cache.stats()["tensors"] == 0


def test_cp2_ranks_keep_their_own_entries():
    from tests.test_sharding import fake_scope

    cu = _cu(8, 16)
    freqs = cpscope.rotary_freqs(8, 64)
    t = torch.randn(12, 1, 8)
    for rank in range(2):
        with fake_scope(2, rank).bind():
            ref = rope_math(t, api._angles(freqs, pack_for(cu, 2, rank), "thd"), False)
            for _ in range(2):
                assert torch.equal(cpscope.apply_rotary_pos_emb(t, freqs, qkv_format="thd", cu_seqlens=cu), ref)
        assert len(_slots(cu, cp=2, rank=rank)) == 1
