"""TE adapter binding logic on CPU, against a stand-in with TransformerEngine 2.20.2's real method signatures.

TE cannot run here (no GPU). ``FakeDotProductAttention`` has the same ``set_context_parallel_group`` and ``forward``
signatures as TE 2.20.2's ``DotProductAttention`` (checked against text copied from TE's source, and against the
installed TE when there is one) and records every call, so the tests see exactly what the wrapper hands TE.
"""
from __future__ import annotations

import enum
import inspect
import sys
import types

import pytest
import torch
import torch.distributed as dist

import cpscope
from cpscope.integrations.te import ScopedDotProductAttention, bind_te_cp, te_apply_rotary_pos_emb, te_cp_settings
from tests.distributed import run_ranks


class CPLoadBalancingStrategy(enum.Enum):
    """Same members as ``transformer_engine.pytorch.constants.CPLoadBalancingStrategy`` (2.20.2)."""

    DUAL_CHUNK_SWAP = "dual_chunk_swap"
    NO_LOAD_BALANCE = "no_load_balance"


# Copied from transformer_engine 2.20.2, transformer_engine/pytorch/attention/dot_product_attention/
# dot_product_attention.py (parameter names and defaults; annotations dropped).
TE_SET_CP_SIGNATURE = (
    "(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type='p2p', "
    "load_balancing_strategy=CPLoadBalancingStrategy.DUAL_CHUNK_SWAP)"
)
TE_FORWARD_SIGNATURE = (
    "(self, query_layer=None, key_layer=None, value_layer=None, attention_mask=None, qkv_format=None, "
    "cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, "
    "max_seqlen_q=None, max_seqlen_kv=None, attn_mask_type=None, window_size=None, bottom_right_diagonal=None, "
    "softcap=None, checkpoint_core_attention=False, core_attention_bias_type='no_bias', core_attention_bias=None, "
    "alibi_slopes=None, fast_zero_fill=True, inference_params=None, pad_between_seqs=None, fp8_output=False, "
    "bf16_backward=False, num_splits=1, score_mod=None, score_mod_bprop=None, score_mod_tensors=None, "
    "score_mod_bprop_tensors=None, qkv_layer=None, kv_layer=None, qkv_interleave_dim=-3, "
    "thd_attention_policies=None, thd_attention_policy_dispatch='auto')"
)


def _plain_signature(fn) -> str:
    """``(name=default, ...)`` without annotations; enum defaults as ``Class.MEMBER``."""
    parts = []
    for p in inspect.signature(fn).parameters.values():
        if p.default is inspect.Parameter.empty:
            parts.append(p.name)
        elif isinstance(p.default, enum.Enum):
            parts.append(f"{p.name}={type(p.default).__name__}.{p.default.name}")
        else:
            parts.append(f"{p.name}={p.default!r}")
    return "(" + ", ".join(parts) + ")"


class FakeDotProductAttention(torch.nn.Module):
    """Records ``set_context_parallel_group`` calls and, per forward, the CP attributes TE would read."""

    def __init__(self, qkv_format="bshd", cp_group=None, cp_global_ranks=None, cp_stream=None, cp_comm_type="p2p"):
        super().__init__()
        self.qkv_format = qkv_format
        self.cp_group = cp_group
        self.cp_global_ranks = cp_global_ranks
        self.cp_stream = cp_stream
        self.cp_comm_type = cp_comm_type
        self.load_balancing_strategy = CPLoadBalancingStrategy.DUAL_CHUNK_SWAP
        self.events: list[tuple] = []

    def set_context_parallel_group(
        self, cp_group, cp_global_ranks, cp_stream, cp_comm_type="p2p",
        load_balancing_strategy=CPLoadBalancingStrategy.DUAL_CHUNK_SWAP,
    ):
        assert isinstance(load_balancing_strategy, CPLoadBalancingStrategy)  # as TE asserts
        self.events.append(("set", cp_group, cp_global_ranks, cp_stream, cp_comm_type, load_balancing_strategy))
        self.cp_group = cp_group
        self.cp_global_ranks = cp_global_ranks
        self.cp_stream = cp_stream
        self.cp_comm_type = cp_comm_type
        self.load_balancing_strategy = load_balancing_strategy

    def forward(
        self, query_layer=None, key_layer=None, value_layer=None, attention_mask=None, qkv_format=None,
        cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
        max_seqlen_q=None, max_seqlen_kv=None, attn_mask_type=None, window_size=None, bottom_right_diagonal=None,
        softcap=None, checkpoint_core_attention=False, core_attention_bias_type="no_bias", core_attention_bias=None,
        alibi_slopes=None, fast_zero_fill=True, inference_params=None, pad_between_seqs=None, fp8_output=False,
        bf16_backward=False, num_splits=1, score_mod=None, score_mod_bprop=None, score_mod_tensors=None,
        score_mod_bprop_tensors=None, qkv_layer=None, kv_layer=None, qkv_interleave_dim=-3,
        thd_attention_policies=None, thd_attention_policy_dispatch="auto",
    ):
        self.events.append((
            "forward", self.cp_group, self.cp_global_ranks, self.cp_stream, self.cp_comm_type,
            self.load_balancing_strategy,
            {"qkv_format": qkv_format, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_kv": cu_seqlens_kv,
             "cu_seqlens_q_padded": cu_seqlens_q_padded, "cu_seqlens_kv_padded": cu_seqlens_kv_padded,
             "attn_mask_type": attn_mask_type},
        ))
        if query_layer is None:
            raise RuntimeError("planted failure inside TE forward")
        return query_layer * 2


class StreamToken:
    """A stand-in for a ``torch.cuda.Stream`` (CPU has none); remembers the device it was asked for."""

    def __init__(self, device):
        self.device = device


BUILD_GROUP, BUILD_STREAM = object(), object()
BUILD = {"cp_group": BUILD_GROUP, "cp_global_ranks": [99], "cp_stream": BUILD_STREAM, "cp_comm_type": "all_gather",
         "load_balancing_strategy": CPLoadBalancingStrategy.NO_LOAD_BALANCE}


def _built_fake(qkv_format="bshd") -> FakeDotProductAttention:
    fake = FakeDotProductAttention(qkv_format, BUILD_GROUP, [99], BUILD_STREAM, "all_gather")
    fake.load_balancing_strategy = CPLoadBalancingStrategy.NO_LOAD_BALANCE
    return fake


def _never_called(device):
    raise AssertionError("the stream provider must not be called for CP1")


# ------------------------------------------------------------------------------------------------ signatures


def test_fake_has_te_2_20_2_signatures():
    assert _plain_signature(FakeDotProductAttention.set_context_parallel_group) == TE_SET_CP_SIGNATURE
    assert _plain_signature(FakeDotProductAttention.forward) == TE_FORWARD_SIGNATURE


def test_fake_matches_installed_te():
    te = pytest.importorskip("transformer_engine.pytorch")
    real = te.DotProductAttention
    assert _plain_signature(real.set_context_parallel_group) == _plain_signature(
        FakeDotProductAttention.set_context_parallel_group
    )
    assert _plain_signature(real.forward) == _plain_signature(FakeDotProductAttention.forward)


# ------------------------------------------------------------------------------------------------ CP1, no dist


def test_cp1_binds_none_and_restores_build_time_settings():
    fake = _built_fake()
    attn = ScopedDotProductAttention(fake, stream_provider=_never_called)
    q = torch.randn(1, 4, 2, 8)
    for _ in range(2):
        with cpscope.runtime_cp(None):  # a CP1 microbatch
            out = attn(q, q, q)
        torch.testing.assert_close(out, q * 2)
        assert te_cp_settings(fake) == BUILD
    set1, fwd, set2, *_ = fake.events
    assert set1[:5] == ("set", None, None, None, "all_gather")
    assert fwd[1:5] == (None, None, None, "all_gather")
    assert set2[1:] == (BUILD_GROUP, [99], BUILD_STREAM, "all_gather", CPLoadBalancingStrategy.NO_LOAD_BALANCE)
    assert len(fake.events) == 6


def test_cp1_restores_after_exception():
    fake = _built_fake()
    attn = ScopedDotProductAttention(fake, stream_provider=_never_called)
    with cpscope.runtime_cp(None), pytest.raises(RuntimeError, match="planted failure"):
        attn(None, None, None)
    assert te_cp_settings(fake) == BUILD
    assert [e[0] for e in fake.events] == ["set", "forward", "set"]


def test_module_built_with_its_own_cp_runs_as_built_outside_every_scope():
    # The stand-in was built with CP settings cpscope cannot turn into a scope (not a ProcessGroup): they are its
    # build-time CP, so outside every runtime scope nothing is bound over them.
    fake = _built_fake()
    attn = ScopedDotProductAttention(fake, stream_provider=_never_called)
    q = torch.randn(1, 4, 2, 8)
    torch.testing.assert_close(attn(q, q, q), q * 2)
    assert [e[0] for e in fake.events] == ["forward"] and fake.events[0][1:6] == tuple(BUILD.values())


def test_rejects_module_without_te_interface():
    with pytest.raises(ValueError, match="set_context_parallel_group"):
        ScopedDotProductAttention(torch.nn.Linear(2, 2))


def test_cp_comm_type_override():
    fake = _built_fake()
    attn = ScopedDotProductAttention(fake, cp_comm_type="a2a", stream_provider=_never_called)
    with cpscope.runtime_cp(None):
        attn(torch.zeros(1, 2, 1, 1), torch.zeros(1, 2, 1, 1), torch.zeros(1, 2, 1, 1))
    assert fake.events[1][4] == "a2a"
    assert te_cp_settings(fake)["cp_comm_type"] == "all_gather"


def test_unknown_cp_comm_type_is_refused_at_construction():
    fake = _built_fake()
    with pytest.raises(ValueError, match="'ring'"):
        ScopedDotProductAttention(fake, cp_comm_type="ring")
    model = torch.nn.Sequential(fake)
    with pytest.raises(ValueError, match="'ring'"):
        cpscope.integrations.te.enable_runtime_cp(model, cp_comm_type="ring")
    assert type(model[0]) is FakeDotProductAttention  # refused before any module changed
    attn = ScopedDotProductAttention(fake, cp_comm_type="a2a+p2p:2", stream_provider=_never_called)
    with cpscope.runtime_cp(None):  # CP1: TE ignores the variant; the module's own one is bound
        attn(torch.zeros(1, 2, 1, 1), torch.zeros(1, 2, 1, 1), torch.zeros(1, 2, 1, 1))
    assert fake.events[-2][4] == "all_gather"


# ------------------------------------------------------------------------------------------------ multi-rank


def _check_forward(fake, ev, group, stream, comm="all_gather"):
    kind, g, ranks, s, c, lbs, _ = ev
    assert kind == "forward"
    assert g is group
    assert ranks == dist.get_process_group_ranks(group)
    assert s is stream
    assert c == comm
    assert lbs is CPLoadBalancingStrategy.DUAL_CHUNK_SWAP  # cpscope's zigzag layout


def _mixed_microbatches_bshd():
    groups = cpscope.new_cp_groups([1, 2, 4])
    provided: list[StreamToken] = []

    def provider(device):
        provided.append(StreamToken(device))
        return provided[-1]

    fake = _built_fake("bshd")
    attn = ScopedDotProductAttention(fake, stream_provider=provider)
    for size in (2, 1, 4, 2):
        fake.events.clear()
        q = torch.randn(2, 4, 3, 8)  # [b, s_local, h, d]; global length 4*size divisible by 2*size
        with cpscope.runtime_cp(groups[size]):
            out = attn(q, q, q)
        torch.testing.assert_close(out, q * 2)
        assert te_cp_settings(fake) == BUILD, size
        assert [e[0] for e in fake.events] == ["set", "forward", "set"]
        if size == 1:
            assert fake.events[1][1:4] == (None, None, None)
        else:
            _check_forward(fake, fake.events[1], groups[size], provided[-1])
            assert provided[-1].device == q.device
    assert len(provided) == 3  # one stream lookup per CP>1 forward, none for CP1

    # An exception inside TE's forward under CP2 still restores the build-time settings.
    fake.events.clear()
    with cpscope.runtime_cp(groups[2]):
        with pytest.raises(RuntimeError, match="planted failure"):
            attn(None, None, None)
    assert te_cp_settings(fake) == BUILD
    _check_forward(fake, fake.events[1], groups[2], provided[-1])
    assert [e[0] for e in fake.events] == ["set", "forward", "set"]

    # Explicit group= at construction wins over the active scope.
    fixed = ScopedDotProductAttention(fake, stream_provider=provider, group=groups[4])
    fake.events.clear()
    with cpscope.runtime_cp(None):
        fixed(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
    _check_forward(fake, fake.events[1], groups[4], provided[-1])

    # Odd local length: global length not divisible by 2*cp -> ValueError before TE is touched.
    fake.events.clear()
    with cpscope.runtime_cp(groups[2]):
        with pytest.raises(ValueError, match="divisible by 2\\*cp=4"):
            attn(torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4))
    assert fake.events == [] and te_cp_settings(fake) == BUILD


def test_mixed_microbatches_bshd_4_ranks():
    run_ranks(4, _mixed_microbatches_bshd)


def _thd_passthrough_and_checks():
    groups = cpscope.new_cp_groups([1, 2])
    token = StreamToken(None)
    fake = _built_fake("thd")
    attn = ScopedDotProductAttention(fake, stream_provider=lambda device: token)
    cu = torch.tensor([0, 8, 12], dtype=torch.int32)  # global; docs 8 and 4 divisible by 2*cp=4
    q = torch.randn(6, 2, 4)  # 12 / 2 local tokens
    with cpscope.runtime_cp(groups[2]):
        attn(q, q, q, None, "thd", cu, cu)  # positional, as TE's signature orders them
        ev = fake.events[1]
        _check_forward(fake, ev, groups[2], token)
        args = ev[6]
        assert args["cu_seqlens_q"] is cu and args["cu_seqlens_kv"] is cu
        assert args["cu_seqlens_q_padded"] is cu and args["cu_seqlens_kv_padded"] is cu  # filled for TE thd+CP
        # Given padded offsets pass through untouched.
        padded = cu.clone()
        fake.events.clear()
        attn(q, q, q, cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
             attn_mask_type="padding_causal")
        args = fake.events[1][6]
        assert args["cu_seqlens_q_padded"] is padded and args["attn_mask_type"] == "padding_causal"
        assert te_cp_settings(fake) == BUILD
        # Bad inputs: ValueError naming the values, before TE is touched.
        fake.events.clear()
        with pytest.raises(ValueError, match="document 1 has length 6"):
            attn(q, q, q, cu_seqlens_q=torch.tensor([0, 6, 12], dtype=torch.int32),
                 cu_seqlens_kv=torch.tensor([0, 6, 12], dtype=torch.int32))
        with pytest.raises(ValueError, match="holds 5 local tokens"):
            attn(q[:5], q[:5], q[:5], cu_seqlens_q=cu, cu_seqlens_kv=cu)
        with pytest.raises(ValueError, match="needs the global cu_seqlens_q"):
            attn(q, q, q)
        assert fake.events == [] and te_cp_settings(fake) == BUILD
    # CP1 with thd: nothing is filled in (TE does not need padded offsets without CP).
    fake.events.clear()
    with cpscope.runtime_cp(None):
        attn(q, q, q, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    assert fake.events[1][1] is None and fake.events[1][6]["cu_seqlens_q_padded"] is None


def test_thd_passthrough_and_checks_2_ranks():
    run_ranks(2, _thd_passthrough_and_checks)


def _missing_stream_is_a_clear_error():
    groups = cpscope.new_cp_groups([2])
    fake = _built_fake("bshd")
    q = torch.randn(1, 2, 1, 4)
    for attn in (ScopedDotProductAttention(fake), ScopedDotProductAttention(fake, stream_provider=lambda d: None)):
        with cpscope.runtime_cp(groups[2]):
            with pytest.raises(ValueError, match="no CUDA stream for CP communication on device cpu"):
                attn(q, q, q)
        assert fake.events == [] and te_cp_settings(fake) == BUILD
    # CP1 needs no stream: the default provider (cp_stream, None on CPU) is fine.
    with cpscope.runtime_cp(None):
        ScopedDotProductAttention(fake)(q, q, q)
    assert fake.events[1][1:4] == (None, None, None)
    # a2a+p2p needs a pair of groups; cpscope binds one.
    with cpscope.runtime_cp(groups[2]):
        with pytest.raises(ValueError, match="a2a\\+p2p"):
            with bind_te_cp(fake, cpscope.capture_scope(), cp_comm_type="a2a+p2p", stream_provider=StreamToken):
                pass


def test_missing_stream_is_a_clear_error_2_ranks():
    run_ranks(2, _missing_stream_is_a_clear_error)


# ------------------------------------------------------------------------------------------------ TE RoPE


def _te_rope_gets_scope_size_and_rank():
    calls = []

    # TE 2.20.2 transformer_engine/pytorch/attention/rope.py signature.
    def apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False, fused=False,
                             cu_seqlens=None, cp_size=1, cp_rank=0):
        calls.append((tensor_format, fused, interleaved, cu_seqlens, cp_size, cp_rank))
        return t + 1

    names = ["transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.attention",
             "transformer_engine.pytorch.attention.rope"]
    saved = {n: sys.modules.get(n) for n in names}
    for n in names:
        sys.modules[n] = types.ModuleType(n)
    sys.modules[names[-1]].apply_rotary_pos_emb = apply_rotary_pos_emb
    try:
        groups = cpscope.new_cp_groups([1, 2])
        freqs = torch.randn(16, 1, 1, 8)
        t = torch.randn(1, 4, 2, 8)
        with cpscope.runtime_cp(groups[2]):
            torch.testing.assert_close(te_apply_rotary_pos_emb(t, freqs, qkv_format="bshd"), t + 1)
            cu = torch.tensor([0, 4, 16], dtype=torch.int32)
            te_apply_rotary_pos_emb(torch.randn(8, 2, 8), freqs, qkv_format="thd", cu_seqlens=cu, interleaved=True)
            with pytest.raises(ValueError, match="freqs covers 6 positions but the global sequence length is 8"):
                te_apply_rotary_pos_emb(t, freqs[:6], qkv_format="bshd")
            with pytest.raises(ValueError, match="holds 7 local tokens"):
                te_apply_rotary_pos_emb(torch.randn(7, 2, 8), freqs, qkv_format="thd", cu_seqlens=cu)
        te_apply_rotary_pos_emb(t, freqs, qkv_format="sbhd")
        me = dist.get_rank()
        assert calls == [
            ("bshd", True, False, None, 2, me), ("thd", True, True, cu, 2, me), ("sbhd", True, False, None, 1, 0)
        ]
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


def test_te_rope_gets_scope_size_and_rank_2_ranks():
    run_ranks(2, _te_rope_gets_scope_size_and_rank)


_T_BSHD = torch.zeros(1, 4, 2, 8)  # [b, s, h, d]
_T_THD = torch.zeros(12, 2, 8)  # [t, h, d], global cu_seqlens below (CP1)
_FREQS = torch.zeros(16, 1, 1, 8)  # [max_seqlen, 1, 1, rot_dim]
_CU = torch.tensor([0, 4, 12], dtype=torch.int32)
_BAD_ROPE_INPUTS = {  # id: (t, freqs, qkv_format, cu_seqlens, expected message)
    "freqs_2d": (_T_BSHD, torch.zeros(16, 8), "bshd", None,
                 r"freqs must have shape \[max_seqlen, 1, 1, rot_dim\], got \(16, 8\)"),
    "freqs_heads_not_1": (_T_BSHD, torch.zeros(16, 2, 1, 8), "bshd", None,
                          r"freqs must have shape \[max_seqlen, 1, 1, rot_dim\], got \(16, 2, 1, 8\)"),
    "freqs_int": (_T_BSHD, torch.zeros(16, 1, 1, 8, dtype=torch.int64), "bshd", None,
                  "freqs must be a floating-point tensor of angles, got dtype torch.int64"),
    "odd_rot_dim": (_T_BSHD, torch.zeros(16, 1, 1, 7), "bshd", None,
                    r"rot_dim \(freqs.shape\[-1\]\) must be a positive even number, got 7"),
    "odd_rot_dim_thd": (_T_THD, torch.zeros(16, 1, 1, 5), "thd", _CU,
                        r"rot_dim \(freqs.shape\[-1\]\) must be a positive even number, got 5"),
    "rot_dim_over_head_dim": (_T_BSHD, torch.zeros(16, 1, 1, 10), "bshd", None,
                              r"rot_dim \(freqs.shape\[-1\]\) = 10 exceeds the head dimension 8"),
    "freqs_short": (_T_BSHD, _FREQS[:3], "bshd", None,
                    "freqs covers 3 positions but the global sequence length is 4"),
    "freqs_short_thd": (_T_THD, _FREQS[:7], "thd", _CU,
                        "freqs covers 7 positions but the longest document is 8"),
    "t_3d_bshd": (_T_BSHD[0], _FREQS, "bshd", None,
                  r"t must be 4-D for qkv_format='bshd' \(bshd\), got shape \(4, 2, 8\)"),
    "t_3d_sbhd": (_T_BSHD[0], _FREQS, "sbhd", None,
                  r"t must be 4-D for qkv_format='sbhd' \(sbhd\), got shape \(4, 2, 8\)"),
    "t_4d_thd": (_T_THD[:, None], _FREQS, "thd", _CU,
                 r"t must be 3-D for qkv_format='thd' \(\[t, h, d\]\), got shape \(12, 1, 2, 8\)"),
    "thd_without_cu": (_T_THD, _FREQS, "thd", None, "qkv_format='thd' needs cu_seqlens"),
    "cu_with_bshd": (_T_BSHD, _FREQS, "bshd", _CU,
                     "cu_seqlens is only used with qkv_format='thd', got qkv_format='bshd'"),
    "bad_format": (_T_BSHD, _FREQS, "bhsd", None, "qkv_format must be one of"),
}


@pytest.mark.parametrize("case", list(_BAD_ROPE_INPUTS))
def test_te_rope_rejects_bad_input_before_importing_te(case):
    t, freqs, fmt, cu, match = _BAD_ROPE_INPUTS[case]
    # Without TE installed (CPU), reaching TE's import would raise ModuleNotFoundError, not this ValueError.
    with pytest.raises(ValueError, match=match):
        te_apply_rotary_pos_emb(t, freqs, qkv_format=fmt, cu_seqlens=cu, group=None)


# ------------------------------------------------------------------------------------------------ in place


class FakeMultiheadAttention(torch.nn.Module):
    """TE's MultiheadAttention as the adapter sees it: cp_size / cp_rank for its fused RoPE, a core attention."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.core_attention = _built_fake("bshd")
        self.cp_size, self.cp_rank = 1, 0
        self.seen: list[tuple[int, int]] = []

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type="p2p",
                                   load_balancing_strategy=CPLoadBalancingStrategy.DUAL_CHUNK_SWAP):
        raise AssertionError("the adapter binds each module itself")

    def forward(self, x, fail=False):
        self.seen.append((self.cp_size, self.cp_rank))  # what TE's RoPE would use
        q = self.proj(x).unsqueeze(2)  # [b, s, 1, 4]
        return self.core_attention(None if fail else q, q, q)


def _enable_runtime_cp_in_place():
    import copy

    groups = cpscope.new_cp_groups([1, 2])
    model = torch.nn.Sequential(FakeMultiheadAttention())
    keys = list(model.state_dict())
    token = StreamToken(None)
    names = cpscope.integrations.te.enable_runtime_cp(model, stream_provider=lambda d: token)
    assert names == ["0", "0.core_attention"]
    assert list(model.state_dict()) == keys and isinstance(model[0], FakeMultiheadAttention)
    mha, core = model[0], model[0].core_attention
    x = torch.randn(1, 4, 4)
    me = dist.get_rank()
    for size in (2, 1, 2):
        core.events.clear()
        with cpscope.runtime_cp(groups[size]):
            out = model(x)
        assert out.shape == (1, 4, 1, 4)
        assert mha.seen[-1] == ((2, me) if size == 2 else (1, 0))
        assert (mha.cp_size, mha.cp_rank) == (1, 0) and te_cp_settings(core) == BUILD
        if size == 2:
            _check_forward(core, core.events[1], groups[2], token)
        else:
            assert core.events[1][1] is None
    with cpscope.runtime_cp(groups[2]):
        with pytest.raises(RuntimeError, match="planted failure"):
            model[0](x, fail=True)
    assert (mha.cp_size, mha.cp_rank) == (1, 0) and te_cp_settings(core) == BUILD
    # deepcopy keeps the behaviour (and the "active scope" default); disabling restores the classes.
    core.events.clear()  # (the records hold process groups, which cannot be copied)
    twin = copy.deepcopy(model)
    with cpscope.runtime_cp(groups[2]):
        twin(x)
    assert twin[0].seen[-1] == (2, me)
    assert cpscope.integrations.te.disable_runtime_cp(model) == ["0", "0.core_attention"]
    assert type(mha) is FakeMultiheadAttention and type(core) is FakeDotProductAttention
    core.events.clear()
    with cpscope.runtime_cp(groups[2]):
        model(x)
    assert mha.seen[-1] == (1, 0) and [e[0] for e in core.events] == ["forward"]  # no binding any more


def test_enable_runtime_cp_in_place_2_ranks():
    run_ranks(2, _enable_runtime_cp_in_place)


# ------------------------------------------------------------------------------------------------ checkpointing


def _checkpoint_recompute_binds_forward_group():
    from torch.utils.checkpoint import checkpoint

    groups = cpscope.new_cp_groups([1, 2])
    token = StreamToken(None)
    fake = _built_fake("bshd")
    attn = ScopedDotProductAttention(fake, stream_provider=lambda d: token)
    model = torch.nn.Sequential(FakeMultiheadAttention())  # converted in place: the MHA mixin resolves per call
    cpscope.integrations.te.enable_runtime_cp(model, stream_provider=lambda d: token)
    mha, core = model[0], model[0].core_attention
    me = dist.get_rank()

    def block(x):  # sin() saves attn's output, so backward unpacks it and the checkpoint recomputes block
        return attn(x, x, x).sin()

    def layer(x):
        return model(x).sin()

    x = torch.randn(1, 4, 2, 8, requires_grad=True)  # [b, s_local, h, d]
    h = torch.randn(1, 4, 4, requires_grad=True)
    assert cpscope.backward_read_check_enabled()  # on by default
    with cpscope.runtime_cp(groups[2]):  # the forward's group; scoped(...) is built here, per call
        y = checkpoint(cpscope.scoped(block), x, use_reentrant=False)
        z = checkpoint(cpscope.scoped(layer), h, use_reentrant=False)
    fake.events.clear()
    core.events.clear()
    with cpscope.runtime_cp(None):  # another binding (CP1) while backward recomputes
        (y.sum() + z.sum()).backward()
    assert [e[0] for e in fake.events] == ["set", "forward", "set"]  # the recompute
    _check_forward(fake, fake.events[1], groups[2], token)  # ... bound the forward's CP2 group
    assert te_cp_settings(fake) == BUILD
    torch.testing.assert_close(x.grad, 2 * torch.cos(2 * x.detach()))  # the fake returns 2q: y = sin(2x)
    assert mha.seen[-2:] == [(2, me), (2, me)]  # forward and recompute: the forward's size / rank
    _check_forward(core, core.events[1], groups[2], token)
    assert (mha.cp_size, mha.cp_rank) == (1, 0) and te_cp_settings(core) == BUILD
    assert h.grad is not None

    # Contrast: plain checkpoint (no scoped) reads the scope in the recompute, inside backward.
    fake.events.clear()
    with cpscope.runtime_cp(groups[2]):
        y = checkpoint(block, x, use_reentrant=False)
    with pytest.raises(cpscope.ScopeReadInBackwardError, match="read inside autograd backward"):
        y.sum().backward()
    assert [e[0] for e in fake.events] == ["set", "forward", "set"]  # forward only: the recompute never ran TE
    assert te_cp_settings(fake) == BUILD


def test_checkpoint_recompute_binds_forward_group_2_ranks():
    run_ranks(2, _checkpoint_recompute_binds_forward_group)


# ------------------------------------------------------------------------------------------------ build-time capture


def _wrappers_capture_the_build_time_group_at_construction():
    groups = cpscope.new_cp_groups([1, 2, 4])
    token = StreamToken(None)
    q = torch.randn(1, 4, 2, 8)

    def bound_group(attn, fake):
        fake.events.clear()
        attn(q, q, q)
        sets = [e for e in fake.events if e[0] == "set"]
        return sets[0][1] if sets else "as built"

    # Built inside a runtime CP2 scope (lazy init, a rebuild in the loop): the runtime binding is not captured.
    plain = FakeDotProductAttention("bshd")
    with cpscope.runtime_cp(groups[2]):
        wrapped = ScopedDotProductAttention(plain, stream_provider=lambda d: token)
        model = torch.nn.Sequential(FakeMultiheadAttention())
        model[0].core_attention = FakeDotProductAttention("bshd")
        cpscope.integrations.te.enable_runtime_cp(model, stream_provider=lambda d: token)
    assert bound_group(wrapped, plain) is None  # CP1, the build-time group, not CP2
    model(torch.randn(1, 4, 4))
    assert model[0].seen[-1] == (1, 0) and model[0].core_attention.events[1][1] is None

    # Built under build_time_cp(CP2): CP2 outside every scope, also after the build-time group changed back.
    plain2 = FakeDotProductAttention("bshd")
    with cpscope.build_time_cp(groups[2]):
        wrapped2 = ScopedDotProductAttention(plain2, stream_provider=lambda d: token)
        model2 = torch.nn.Sequential(FakeMultiheadAttention())
        model2[0].core_attention = FakeDotProductAttention("bshd")
        cpscope.integrations.te.enable_runtime_cp(model2, stream_provider=lambda d: token)
    assert bound_group(wrapped2, plain2) is groups[2]
    me2 = dist.get_rank(groups[2])
    model2(torch.randn(1, 4, 4))
    assert model2[0].seen[-1] == (2, me2) and model2[0].core_attention.events[1][1] is groups[2]
    with cpscope.runtime_cp(None):  # a runtime scope still wins
        assert bound_group(wrapped2, plain2) is None

    # A TE module built with its own CP group (Megatron-style static CP): that group is its build-time CP.
    own = FakeDotProductAttention("bshd", cp_group=groups[2], cp_global_ranks=dist.get_process_group_ranks(groups[2]))
    wrapped3 = ScopedDotProductAttention(own, stream_provider=lambda d: token)
    assert bound_group(wrapped3, own) is groups[2]
    with cpscope.runtime_cp(groups[4]):
        assert bound_group(wrapped3, own) is groups[4]
    assert own.cp_group is groups[2]  # restored
    # ... contradicting the process-wide build-time group: refused at construction, naming both.
    with cpscope.build_time_cp(groups[4]):
        with pytest.raises(ValueError, match="not a single ProcessGroup"):
            ScopedDotProductAttention(_built_fake())  # a CP TE knows only, and a build-time group too
        with pytest.raises(ValueError, match="built with a CP group of size 2 but the build-time group"):
            ScopedDotProductAttention(own)
        mha = FakeMultiheadAttention()
        mha.cp_size, mha.cp_rank = 2, me2
        with pytest.raises(ValueError, match="built with cp_size=2 but the build-time group"):
            cpscope.integrations.te.enable_runtime_cp(torch.nn.Sequential(mha))
        assert type(mha) is FakeMultiheadAttention  # nothing was converted
    # A MultiheadAttention built with its own cp_size keeps it outside every scope.
    mha = FakeMultiheadAttention()
    mha.core_attention = FakeDotProductAttention("bshd")
    mha.cp_size, mha.cp_rank = 2, me2
    cpscope.integrations.te.enable_runtime_cp(torch.nn.Sequential(mha), stream_provider=lambda d: token)
    mha(torch.randn(1, 4, 4))
    assert mha.seen[-1] == (2, me2)
    return True


def test_wrappers_capture_the_build_time_group_at_construction_4_ranks():
    assert all(run_ranks(4, _wrappers_capture_the_build_time_group_at_construction))
