"""cpscope.linear: bad input raises ValueError naming the values, before any collective (no group is needed)."""
from __future__ import annotations

import pytest
import torch

from cpscope.linear import causal_conv1d, gated_delta_rule, mamba2_scan
from cpscope.scope import CPScope


def _gdn(B=1, T=8, H=2, K=4, HV=2, V=3):
    return (torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, HV, V), -torch.rand(B, T, HV),
            torch.rand(B, T, HV))


def test_delta_rule_shapes() -> None:
    q, k, v, g, beta = _gdn()
    with pytest.raises(ValueError, match=r"q and k must both be \[B, T, H, K\]"):
        gated_delta_rule(q, k[:, :, :1], v, g, beta, group=None)
    with pytest.raises(ValueError, match=r"HV a multiple of the q/k heads H=2, got \(1, 8, 3, 3\)"):
        gated_delta_rule(q, k, torch.randn(1, 8, 3, 3), g, beta, group=None)
    with pytest.raises(ValueError, match=r"g must be \[B, T, HV\]"):
        gated_delta_rule(q, k, v, g[..., None], beta, group=None)
    with pytest.raises(ValueError, match="scale must be a finite number > 0, got -1.0"):
        gated_delta_rule(q, k, v, g, beta, scale=-1.0, group=None)


def test_local_length_vs_cu_seqlens_and_cp() -> None:
    q, k, v, g, beta = _gdn(T=8)
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\]=16 with CP size 1"):
        gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, group=None)
    fake_cp2 = CPScope(None, 2, 0)  # size/rank only: validation runs before any collective
    import cpscope.linear._pieces as mod

    with pytest.raises(ValueError, match="divisible by 2\\*cp=4"):
        mod.pieces_of_input(1, 8, torch.tensor([0, 6, 16], dtype=torch.int32), fake_cp2, where="t")
    with pytest.raises(ValueError, match="batch size 2"):
        gated_delta_rule(*_gdn(B=2, T=8), cu_seqlens=torch.tensor([0, 16], dtype=torch.int32), group=None)
    with pytest.raises(ValueError, match="global length 14 must be divisible by 2\\*cp=4"):
        mod.pieces_of_input(1, 7, None, fake_cp2, where="t")
    # the cached kernel geometry validates the same way, every call (a failed build caches nothing)
    for _ in range(2):
        with pytest.raises(ValueError, match="divisible by 2\\*cp=4"):
            mod.runs_of_input(1, 8, torch.tensor([0, 6, 16], dtype=torch.int32), fake_cp2, torch.device("cpu"),
                              where="t")
        with pytest.raises(ValueError, match="global length 14 must be divisible by 2\\*cp=4"):
            mod.runs_of_input(1, 7, None, fake_cp2, torch.device("cpu"), where="t")


def test_mamba2_and_conv_shapes() -> None:
    x, dt, A = torch.randn(1, 8, 4, 3), torch.randn(1, 8, 4), -torch.rand(4)
    B = C = torch.randn(1, 8, 3, 5)
    with pytest.raises(ValueError, match="divisible by the groups G"):
        mamba2_scan(x, dt, A, B, C, group=None)
    with pytest.raises(ValueError, match=r"A must be \[H\] = \(4,\), got \(3,\)"):
        mamba2_scan(x, dt, A[:3], B[:, :, :2], C[:, :, :2], group=None)
    with pytest.raises(ValueError, match="dt_limit"):
        mamba2_scan(x, dt, A, B[:, :, :2], C[:, :, :2], dt_limit=(1.0, 0.0), group=None)
    with pytest.raises(ValueError, match=r"weight must be \[D=6, W\]"):
        causal_conv1d(torch.randn(1, 8, 6), torch.randn(5, 4), group=None)
    with pytest.raises(ValueError, match="activation must be one of"):
        causal_conv1d(torch.randn(1, 8, 6), torch.randn(6, 4), activation="relu", group=None)
