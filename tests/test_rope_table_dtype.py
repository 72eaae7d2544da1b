"""A RoPE angle table that is not float32/float64 raises ``ValueError`` naming its dtype, at every entry that takes a
table, before any kernel (before: a bf16 table was accepted, up to 9.5 off at 64k positions)."""
from __future__ import annotations

import pytest
import torch

import cpscope

LOW = [torch.bfloat16, torch.float16]


def _x(fmt: str) -> torch.Tensor:
    return torch.randn(16, 2, 8) if fmt == "thd" else torch.randn(1, 16, 2, 8)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("impl", ["auto", "eager", "compiled"])
def test_apply_rotary_pos_emb_refuses_a_low_precision_table(dtype, fmt, impl):
    freqs = cpscope.rotary_freqs(8, 64).to(dtype)
    cu = torch.tensor([0, 8, 16], dtype=torch.int32) if fmt == "thd" else None
    with pytest.raises(ValueError, match=f"must be float32 or float64, got {dtype}"):
        cpscope.apply_rotary_pos_emb(_x(fmt), freqs, qkv_format=fmt, cu_seqlens=cu, impl=impl, group=None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_float32_and_float64_tables_are_accepted(dtype):
    x = _x("bshd")
    out = cpscope.apply_rotary_pos_emb(x, cpscope.rotary_freqs(8, 64).to(dtype), qkv_format="bshd", group=None)
    assert out.shape == x.shape and out.dtype == x.dtype


def test_rotary_embedding_builds_float32_and_its_low_precision_copy_is_refused():
    table = cpscope.RotaryEmbedding(8)(64)
    assert table.dtype == torch.float32
    with pytest.raises(ValueError, match="torch.bfloat16"):
        cpscope.apply_rotary_pos_emb(_x("bshd"), table.bfloat16(), qkv_format="bshd", group=None)


def test_compiled_call_refuses_it_too():
    fn = torch.compile(lambda x, f: cpscope.apply_rotary_pos_emb(x, f, qkv_format="bshd"), backend="eager")
    with pytest.raises(Exception, match="must be float32 or float64, got torch.bfloat16"):
        fn(_x("bshd"), cpscope.rotary_freqs(8, 64).bfloat16())


@pytest.mark.parametrize("dtype", LOW)
def test_te_bridge_refuses_it_before_importing_te(dtype):
    from cpscope.integrations.te import te_apply_rotary_pos_emb

    with pytest.raises(ValueError, match=f"got {dtype}"):  # without TE installed, reaching TE would not be this
        te_apply_rotary_pos_emb(_x("bshd"), cpscope.rotary_freqs(8, 64).to(dtype), qkv_format="bshd", group=None)


class _FakeMegatronAttention(torch.nn.Module):
    """The signature of megatron-core's ``Attention.forward`` that the adapter reads (no megatron needed)."""

    def __init__(self) -> None:
        super().__init__()
        self.pg_collection = None
        self.ran = False

    def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None, packed_seq_params=None):
        self.ran = True
        return hidden_states


@pytest.mark.parametrize("emb", ["table", "pair"])
def test_megatron_bridge_refuses_a_low_precision_rotary_pos_emb_before_megatron_rope(emb):
    from cpscope.integrations.megatron._rope import AttentionRopeMixin

    class Bound(AttentionRopeMixin, _FakeMegatronAttention):
        _cpscope_psp_index = 3

    module = Bound()
    table = cpscope.rotary_freqs(8, 64).bfloat16()
    arg = table if emb == "table" else (cpscope.rotary_freqs(8, 64), table)
    with pytest.raises(ValueError, match="rotary_pos_emb .* must be float32 or float64, got torch.bfloat16"):
        module(torch.zeros(1), rotary_pos_emb=arg)
    assert not module.ran


def test_the_check_itself():
    from cpscope._checks import check_rope_table_dtype

    check_rope_table_dtype(torch.zeros(4, 1, 1, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="freqs .* got torch.float16"):
        check_rope_table_dtype(torch.zeros(4, 1, 1, 8, dtype=torch.float16))
