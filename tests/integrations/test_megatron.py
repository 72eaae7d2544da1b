"""Megatron-style PackedSeqParams → cpscope scope: both CP1 conventions, contradictions, the decorator."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

import cpscope
from cpscope.integrations.megatron import (
    packed_seq_scope,
    read_packed_seq_params,
    scope_from_packed_seq_params,
)
from tests.distributed import run_ranks


@dataclass
class PackedSeqParams:
    """The fields of megatron.core.packed_seq_params.PackedSeqParams that cpscope reads."""

    qkv_format: Optional[str] = None
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_kv: Optional[torch.Tensor] = None
    cu_seqlens_q_padded: Optional[torch.Tensor] = None
    cu_seqlens_kv_padded: Optional[torch.Tensor] = None
    max_seqlen_q: Optional[int] = None
    max_seqlen_kv: Optional[int] = None
    local_cp_size: Optional[int] = None
    cp_group: Any = None


class Block(torch.nn.Module):
    """Records the active scope seen inside forward."""

    @packed_seq_scope
    def forward(self, x, attention_mask=None, packed_seq_params=None):
        return cpscope.cp_size(), cpscope.current_cp_group()


@packed_seq_scope(arg_name="psp")
def kw_only(x, *, psp=None):
    return cpscope.cp_size()


def test_no_group_named_keeps_current_scope_and_cp1_by_none():
    assert scope_from_packed_seq_params(None) is None
    assert scope_from_packed_seq_params(PackedSeqParams(qkv_format="thd")) is None
    assert scope_from_packed_seq_params(PackedSeqParams(local_cp_size=1)).size == 1


@pytest.mark.parametrize("local", [0, -1, 2.0, True])
def test_bad_local_cp_size(local):
    with pytest.raises(ValueError, match="local_cp_size"):
        scope_from_packed_seq_params(PackedSeqParams(local_cp_size=local))


def test_size_without_group_is_a_contradiction():
    with pytest.raises(ValueError, match=r"local_cp_size=2 contradicts the CP group: got None \(CP1\)"):
        scope_from_packed_seq_params(PackedSeqParams(local_cp_size=2))
    with pytest.raises(ValueError, match="local_cp_size=2"):
        Block()(torch.zeros(1), packed_seq_params=PackedSeqParams(local_cp_size=2))


def test_non_zigzag_partition_rejected():
    psp = PackedSeqParams(local_cp_size=1)
    psp.cp_partition_mode = "contiguous"
    with pytest.raises(ValueError, match="cp_partition_mode='contiguous'"):
        scope_from_packed_seq_params(psp)


def test_decorator_needs_the_parameter():
    with pytest.raises(TypeError, match="no parameter 'packed_seq_params'"):
        packed_seq_scope(lambda x: x)


def test_read_packed_seq_params_cp1():
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    info = read_packed_seq_params(PackedSeqParams("thd", cu, cu, max_seqlen_q=5, local_cp_size=1))
    assert info.scope.size == 1 and info.qkv_format == "thd" and info.cu_seqlens is cu and info.max_seqlen == 5
    with pytest.raises(ValueError, match="differ from kv offsets"):
        read_packed_seq_params(PackedSeqParams("thd", cu, torch.tensor([0, 4, 8], dtype=torch.int32)))


def _conventions_and_decorator():
    groups = cpscope.new_cp_groups([1, 2])
    g2 = groups[2]
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]  # collective: every rank makes all
    single = singles[dist.get_rank()]
    block = Block()
    x = torch.zeros(1)

    # Both CP1 conventions, inside a CP2 scope: CP1 there, CP2 again afterwards.
    with cpscope.runtime_cp(g2):
        for psp in (PackedSeqParams(local_cp_size=1), PackedSeqParams(local_cp_size=1, cp_group=single),
                    PackedSeqParams(cp_group=single), PackedSeqParams(local_cp_size=1, cp_group=None)):
            assert block(x, packed_seq_params=psp) == (1, None), psp
            assert cpscope.cp_size() == 2
        # None (or naming no group) leaves the current scope.
        assert block(x) == (2, g2)
        assert block(x, None, None) == (2, g2)
        assert block(x, packed_seq_params=PackedSeqParams(qkv_format="thd")) == (2, g2)

    # CP2: group alone, or group + matching size; positional or keyword; kw-only parameter.
    for psp in (PackedSeqParams(cp_group=g2), PackedSeqParams(local_cp_size=2, cp_group=g2)):
        assert block(x, None, psp) == (2, g2)
        assert block(x, packed_seq_params=psp) == (2, g2)
        assert kw_only(x, psp=psp) == 2
        assert cpscope.cp_size() == 1
        with packed_seq_scope.bind(psp) as scope:
            assert scope.size == 2 and cpscope.current_cp_group() is g2
        assert cpscope.cp_size() == 1

    # Contradictions: ValueError naming both values, before the body runs.
    with pytest.raises(ValueError, match="local_cp_size=1 contradicts the CP group: got a group of size 2"):
        block(x, packed_seq_params=PackedSeqParams(local_cp_size=1, cp_group=g2))
    with pytest.raises(ValueError, match="local_cp_size=2 contradicts the CP group: got a group of size 1"):
        block(x, packed_seq_params=PackedSeqParams(local_cp_size=2, cp_group=single))
    with pytest.raises(ValueError, match="local_cp_size=4 contradicts"):
        scope_from_packed_seq_params(PackedSeqParams(local_cp_size=4, cp_group=g2))

    # An exception inside the call restores the enclosing scope.
    @packed_seq_scope
    def boom(packed_seq_params):
        assert cpscope.cp_size() == 2
        raise KeyError("planted")

    with pytest.raises(KeyError):
        boom(PackedSeqParams(cp_group=g2))
    assert cpscope.cp_size() == 1

    # Recursion: each call binds afresh.
    @packed_seq_scope
    def nested(depth, packed_seq_params=None):
        if depth == 0:
            return [cpscope.cp_size()]
        inner = PackedSeqParams(local_cp_size=1) if depth % 2 else PackedSeqParams(cp_group=g2)
        return [cpscope.cp_size()] + nested(depth - 1, packed_seq_params=inner)

    assert nested(3, packed_seq_params=PackedSeqParams(cp_group=g2)) == [2, 1, 2, 1]

    # read_packed_seq_params validates documents against 2*cp and prefers the padded offsets.
    cu = torch.tensor([0, 8, 12], dtype=torch.int32)
    info = read_packed_seq_params(PackedSeqParams("thd", cu, cu, local_cp_size=2, cp_group=g2))
    assert info.scope.size == 2 and info.cu_seqlens is cu
    raw = torch.tensor([0, 7, 10], dtype=torch.int32)
    info = read_packed_seq_params(PackedSeqParams("thd", raw, raw, cu, cu, cp_group=g2))
    assert info.cu_seqlens is cu
    with pytest.raises(ValueError, match="document 0 has length 7"):
        read_packed_seq_params(PackedSeqParams("thd", raw, raw, cp_group=g2))


def test_conventions_and_decorator_2_ranks():
    run_ranks(2, _conventions_and_decorator)


def _validates_against_the_enclosing_scope():
    g2 = cpscope.new_cp_groups([1, 2])[2]
    six = torch.tensor([0, 6, 10], dtype=torch.int32)  # fine for CP1, not for CP2 (6 % 4 != 0)
    psp = PackedSeqParams("thd", six, six)  # names no group: the enclosing scope runs it
    assert read_packed_seq_params(psp).scope is None  # CP1 outside every scope: valid
    with cpscope.runtime_cp(g2):
        with pytest.raises(ValueError, match="document 0 has length 6"):
            read_packed_seq_params(psp)
        assert read_packed_seq_params(PackedSeqParams("thd", six, six, local_cp_size=1)).scope.size == 1
        assert read_packed_seq_params(psp, enclosing=cpscope.scope.CP1).scope is None
    with pytest.raises(ValueError, match="document 0 has length 6"):
        read_packed_seq_params(psp, enclosing=cpscope.scope.scope_for(g2))
    with cpscope.build_time_cp(g2), pytest.raises(ValueError, match="document 0 has length 6"):
        read_packed_seq_params(psp)  # outside every runtime scope: the build-time group


def test_read_packed_seq_params_validates_against_the_enclosing_scope():
    run_ranks(2, _validates_against_the_enclosing_scope)
