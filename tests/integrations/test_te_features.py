"""TE attention features under cpscope's binding (CPU, TE 2.20.2 stand-in): sliding windows, sinks
(``softmax_type``) and multi-latent head dims pass through to TE with a CP comm type TE runs them with; one it does
not raises ``ValueError`` naming the ones that would, before anything is bound; ``"auto"`` picks among them.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

import cpscope
from cpscope.integrations.te import ScopedDotProductAttention, enable_runtime_cp, te_cp_settings
from cpscope.integrations._te_features import te_features
from tests.distributed import run_ranks
from tests.integrations.test_te_cpu import FakeDotProductAttention, StreamToken


class _FeatureFake(FakeDotProductAttention):
    """The stand-in with TE's feature attributes (``window_size``, ``softmax_type``, head dims, heads), recording
    the ``window_size`` each forward receives."""

    def __init__(self, window=(-1, 0), softmax="vanilla", dk=8, dv=8, heads=4, groups=2):
        super().__init__("bshd")
        self.window_size, self.softmax_type = window, softmax
        self.hidden_size_per_attention_head_k, self.hidden_size_per_attention_head_v = dk, dv
        self.num_attention_heads, self.num_gqa_groups, self.tp_size = heads, groups, 1
        self.windows: list[Any] = []

    def forward(self, query_layer=None, key_layer=None, value_layer=None, *args, window_size=None, **kwargs):
        self.windows.append(window_size)
        return super().forward(query_layer, key_layer, value_layer, *args, window_size=window_size, **kwargs)


def _qkv(dk: int = 8, dv: int = 8) -> tuple[torch.Tensor, ...]:
    return torch.randn(1, 4, 4, dk), torch.randn(1, 4, 2, dk), torch.randn(1, 4, 2, dv)  # [b, s_local, h, d]


def _run(fake: _FeatureFake, group: Any, comm: str, **call: Any) -> str:
    """One CP forward with ``comm``; the comm type TE saw."""
    attn = ScopedDotProductAttention(fake, cp_comm_type=comm, stream_provider=StreamToken)
    q, k, v = _qkv(fake.hidden_size_per_attention_head_k, fake.hidden_size_per_attention_head_v)
    with cpscope.runtime_cp(group):
        attn(q, k, v, **call)
    forward = [e for e in fake.events if e[0] == "forward"][-1]
    return forward[4]


def _refused(fake: _FeatureFake, group: Any, comm: str, match: str, **call: Any) -> None:
    before = te_cp_settings(fake)
    fake.events.clear()
    with pytest.raises(ValueError, match=match):
        _run(fake, group, comm, **call)
    assert fake.events == [] and te_cp_settings(fake) == before  # nothing bound, TE never called


def _features_pick_te_variants() -> None:
    g2 = cpscope.new_cp_groups([2])[2]
    window = _FeatureFake(window=(3, 0))
    _refused(window, g2, "p2p", r"sliding window \(window_size=\(3, 0\)\) only with cp_comm_type in "
                                r"\['all_gather', 'a2a'\]")
    _refused(window, g2, "a2a+p2p", r"\['all_gather', 'a2a'\]")
    assert _run(window, g2, "all_gather") == "all_gather" and _run(window, g2, "a2a") == "a2a"
    assert window.windows[-1] is None  # the module's own window: TE reads it itself
    assert _run(window, g2, "auto") in ("all_gather", "a2a")
    # a per-call window_size overrides the module's, both ways, and reaches TE as given
    assert _run(window, g2, "p2p", window_size=(-1, 0)) == "p2p" and window.windows[-1] == (-1, 0)
    full = _FeatureFake()
    assert _run(full, g2, "p2p") == "p2p"
    _refused(full, g2, "p2p", r"window_size=\(5, 0\)", window_size=(5, 0))
    assert _run(full, g2, "all_gather", window_size=(5, 0)) == "all_gather" and full.windows[-1] == (5, 0)

    sinks = _FeatureFake(softmax="learnable")
    for comm in ("p2p", "all_gather", "a2a+p2p"):
        _refused(sinks, g2, comm, r"sinks \(softmax_type='learnable'\) only with cp_comm_type in \['a2a'\]")
    assert _run(sinks, g2, "a2a") == "a2a" and _run(sinks, g2, "auto") == "a2a"
    _refused(_FeatureFake(softmax="off-by-one", heads=3, groups=3), g2, "auto", "none fits this module")

    mla = _FeatureFake(dk=8, dv=6)
    _refused(mla, g2, "all_gather", r"multi-latent attention \(k head dim 8 != v head dim 6\) only with "
                                    r"cp_comm_type in \['p2p', 'a2a\+p2p'\]")
    _refused(mla, g2, "a2a", r"\['p2p', 'a2a\+p2p'\]")
    assert _run(mla, g2, "p2p") == "p2p" and _run(mla, g2, "auto") == "p2p"

    both = _FeatureFake(window=(3, 0), softmax="learnable")
    _refused(both, g2, "all_gather", r"only with cp_comm_type in \['a2a'\]")
    assert _run(both, g2, "auto") == "a2a"
    _refused(_FeatureFake(window=(3, 0), dk=8, dv=6), g2, "auto", "runs no CP communication type with all of")

    # enable_runtime_cp (the in-place conversion) checks the same way
    model = torch.nn.Sequential(_FeatureFake(window=(3, 0)))
    enable_runtime_cp(model, cp_comm_type="p2p", stream_provider=StreamToken)
    with cpscope.runtime_cp(g2), pytest.raises(ValueError, match=r"\['all_gather', 'a2a'\]"):
        model[0](*_qkv())
    # CP1: TE runs every feature without CP; nothing is checked
    with cpscope.runtime_cp(None):
        out = ScopedDotProductAttention(_FeatureFake(window=(3, 0), softmax="learnable", dv=6),
                                        cp_comm_type="p2p")(*_qkv(dv=6))
    assert out.shape == (1, 4, 4, 8)


def test_features_pick_te_variants_2_ranks():
    run_ranks(2, _features_pick_te_variants)


def test_te_features_reads_module_and_call():
    assert te_features(_FeatureFake()) == {}
    assert te_features(_FeatureFake(window=(-1, -1))) == {}
    assert te_features(_FeatureFake(window=(7, 7), softmax="off-by-one", dv=4)) == {
        "sliding window": "window_size=(7, 7)", "sinks": "softmax_type='off-by-one'",
        "multi-latent attention": "k head dim 8 != v head dim 4"}
    q, k, v = _qkv(dv=6)  # the tensors' head dims win over the attributes
    assert te_features(_FeatureFake(), {"key_layer": k, "value_layer": v}) == {
        "multi-latent attention": "k head dim 8 != v head dim 6"}
    assert te_features(_FeatureFake(), {"key": k, "value": v, "window_size": (2, 0)}).keys() == {
        "multi-latent attention", "sliding window"}
