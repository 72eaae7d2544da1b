"""GPU parity of the block kernels with windows, softcapping and multi-latent head dims (one GPU, bf16) against
float64 references computed on the GPU: the cuDNN frontend graphs (dense and packed), flash-attention-2 with a
window, the plain routes with 192/128 head dims; forward, and backward with external (merged) statistics.

``python -m pytest -m gpu tests/attention/test_kernels_gpu.py``. The cases are
``tests/attention/_kernel_cases.py``'s (also run by ``benchmarks/bench_attention_features.py --check``).
"""
from __future__ import annotations

import pytest
import torch

from tests.attention._kernel_cases import CASES, REL_TOL, run_case


def _cudnn_frontend() -> bool:
    from cpscope.attention.kernels import cudnn_frontend

    return torch.cuda.is_available() and cudnn_frontend.available(torch.device("cuda", 0))


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_block_kernel_parity(name):
    if CASES[name][0] == "cudnn" and not _cudnn_frontend():
        pytest.skip("cuDNN frontend (nvidia-cudnn-frontend) / cuDNN >= 9.6 / sm90 not available")
    res = run_case(name, torch.device("cuda", 0), seed=sorted(CASES).index(name))
    assert res["unseen_ok"], f"{name}: rows that see no key must come out as out 0, lse -inf ({res})"
    assert res["ok"], f"{name}: relative errors above {REL_TOL} (lse 1e-3): {res}"
    assert not res["cudnn_refused"], f"{name}: cuDNN refused the graph, another kernel ran: {res['cudnn_refused']}"


@pytest.mark.gpu
def test_block_forward_routes_windows_through_the_kernels():
    """The public block entry points reach these kernels with ``window`` / ``softcap`` (no dense mask)."""
    from cpscope.attention import kernels

    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(5)
    q, k, v = (torch.randn(1, 2048, h, 128, device=dev, dtype=torch.bfloat16, generator=g) for h in (8, 2, 2))
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.max_memory_allocated(dev)
    out, lse = kernels.block_forward(q, k, v, scale=128 ** -0.5, causal=True, window=(255, 0), softcap=30.0)
    grown = torch.cuda.max_memory_allocated(dev) - before
    assert out.shape == q.shape and torch.isfinite(lse).all()
    assert grown < 2048 * 2048 * 8 * 4, f"{grown} bytes: a dense [h, s, s] score or mask tensor was materialised"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_sink_kernels_triton_vs_float64(layout):
    from tests.attention.test_sink_kernels_cpu import check_sinks

    assert check_sinks("cuda", layout) < 1e-2
