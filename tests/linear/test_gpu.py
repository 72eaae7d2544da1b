"""cpscope.linear on a GPU: flash-linear-attention's Triton kernels (where installed) against the float64 references.

CP1 through the public functions (which dispatch to fla on CUDA), and CP2 / CP4 with every rank run in turn in one
process through the library's own phases (``_sequential``: summarise with fla from ``[0 | I]``, stack the
summaries as the all-gather would, read the incoming states) — one GPU is enough. Forward and every gradient, bshd
rows and thd packs of uneven documents whose chunks do not fill fla's 64-token blocks. Errors are relative RMS
(bf16 / tf32 rounding is spread over every element); tolerances below.
"""
from __future__ import annotations

import pytest
import torch

from cpscope.linear import _fla, _kernels as kernels
from tests.linear import _sequential

pytestmark = pytest.mark.gpu

TOL = {torch.float32: 5e-3, torch.bfloat16: 3e-2}  # relative RMS error against the float64 loop
KINDS = ("gdn", "kda", "mamba2")
PACK = [0, 256, 352, 736]  # 256, 96 and 384 tokens: divisible by 2*cp for cp = 1, 2, 4


def _case(kind: str, layout: str, dtype: torch.dtype, seed: int) -> tuple[dict, dict, list | None]:
    B, T, cu = (2, 256, None) if layout == "bshd" else (1, PACK[-1], PACK)
    seq, par = _sequential.make_inputs(kind, B, T, H=2, K=64, V=64, seed=seed, dtype=dtype, device="cuda")
    return seq, par, cu


@pytest.fixture(autouse=True)
def _needs_fla() -> None:
    if not _fla.available():
        pytest.skip("flash-linear-attention is not installed")


def _skip_if_fla_refuses_backward(kind: str, x: torch.Tensor) -> None:
    """fla refuses its gated backward (GDN, Mamba2) on Hopper with Triton < 3.7.1 and no tilelang: cpscope then
    picks its torch path for calls that need gradients (checked here), and fla's own run cannot be tested."""
    if kind == "kda" or _fla.usable(x, gated_backward=True):
        return
    assert kernels.pick(x, _runs_of(x), gated_backward=True) is kernels.TORCH
    pytest.skip(_fla._refusal_here(x) or "fla refuses its gated backward here")


def _runs_of(x: torch.Tensor):
    from cpscope.linear._pieces import runs_of_input
    from cpscope.scope import CPScope

    return runs_of_input(x.shape[0], x.shape[1], None, CPScope(None, 1, 0), x.device, where="test")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("layout", ["bshd", "thd"])
@pytest.mark.parametrize("kind", KINDS)
def test_fla_cp1_equals_reference(kind: str, layout: str, dtype: torch.dtype) -> None:
    seq, par, cu = _case(kind, layout, dtype, seed=1)
    _skip_if_fla_refuses_backward(kind, seq["x" if kind == "mamba2" else "q"])
    assert kernels.pick(seq["x" if kind == "mamba2" else "q"], _runs(seq, cu)) is kernels.FLA
    errs = _sequential.errors(kind, seq, par, cu, 1, kernels.FLA, rms=True)
    assert max(errs.values()) < TOL[dtype], errs


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("layout", ["bshd", "thd"])
@pytest.mark.parametrize("kind", KINDS)
def test_fla_cp_ranks_in_one_process_equal_reference(kind: str, layout: str, cp: int) -> None:
    seq, par, cu = _case(kind, layout, torch.bfloat16, seed=cp)
    _skip_if_fla_refuses_backward(kind, seq["x" if kind == "mamba2" else "q"])
    errs = _sequential.errors(kind, seq, par, cu, cp, kernels.FLA, rms=True)
    assert max(errs.values()) < TOL[torch.bfloat16], errs
    with torch.no_grad():  # and it matches fla's own CP1 run of the same inputs
        cp1 = _sequential.run_sequential(kind, seq, par, cu, 1, kernels.FLA).float()
        cpn = _sequential.run_sequential(kind, seq, par, cu, cp, kernels.FLA).float()
    assert float((cpn - cp1).norm() / cp1.norm()) < TOL[torch.bfloat16]


def _runs(seq: dict, cu: list | None):
    from cpscope.linear._pieces import runs_of_input
    from cpscope.scope import CPScope

    t = next(iter(seq.values()))
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=t.device)
    return runs_of_input(t.shape[0], t.shape[1], cu_t, CPScope(None, 1, 0), t.device, where="test")
