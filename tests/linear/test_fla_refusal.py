"""fla's known-bad gated backward (Hopper, Triton >= 3.4.0 and < 3.7.1, no tilelang: fla raises in the backward of
GDN and Mamba2) is detected up front, so cpscope runs those layers on its torch path instead of failing after the
forward. Runs on CPU: the decision is a pure function of the GPU's capability, Triton's version and tilelang."""
from __future__ import annotations

import pytest
import torch

from cpscope.linear import _fla, _kernels as kernels


@pytest.mark.parametrize("cap,triton,tilelang,refused", [
    ((9, 0), "3.6.0", False, True),        # H100 / H200 with torch 2.11's Triton: refused
    ((9, 0), "3.4.0", False, True),
    ((9, 0), "3.7.0+git1234", False, True),
    ((9, 0), "3.7.1", False, False),       # fixed Triton
    ((9, 0), "3.3.1", False, False),       # before the bug
    ((9, 0), "3.6.0", True, False),        # tilelang backend takes it
    ((10, 0), "3.6.0", False, False),      # Blackwell
    ((8, 0), "3.6.0", False, False),       # Ampere
])
def test_gated_backward_refusal_table(cap, triton, tilelang, refused):
    reason = _fla.gated_backward_refusal(cap, triton, tilelang)
    assert (reason is not None) == refused
    if refused:
        assert triton in reason and "3.7.1" in reason


def test_pick_takes_the_torch_path_when_fla_refuses_the_backward(monkeypatch):
    from cpscope.linear._pieces import runs_of_input
    from cpscope.scope import CPScope

    x = torch.zeros(1, 8, 2, 4)
    runs = runs_of_input(1, 8, None, CPScope(None, 1, 0), x.device, where="test")
    # stand in for a CUDA tensor on a GPU where fla is installed
    monkeypatch.setattr(_fla, "usable", lambda t, gated_backward=False: not gated_backward)
    assert kernels.pick(x, runs) is kernels.FLA
    assert kernels.pick(x, runs, gated_backward=True) is kernels.TORCH


def test_needs_grad():
    a, b = torch.zeros(2), torch.zeros(2, requires_grad=True)
    assert not kernels.needs_grad(a, None)
    assert kernels.needs_grad(a, b)
    with torch.no_grad():
        assert not kernels.needs_grad(a, b)
