"""GPU parity of the block kernels with windows, softcapping and multi-latent head dims (one GPU, bf16) against
float64 references computed on the GPU: the cuDNN frontend graphs (dense and packed), flash-attention-2 with a
window, the plain routes with 192/128 head dims; forward, and backward with external (merged) statistics. A graph
that the installed cuDNN refuses must fall back with a recorded refusal, and the fallback's numbers are checked.

``python -m pytest -m gpu tests/attention/test_kernels_gpu.py``. The cases are
``tests/attention/_kernel_cases.py``'s (also run by ``benchmarks/bench_attention_features.py --check``).
"""
from __future__ import annotations

import warnings

import pytest
import torch

from tests.attention._kernel_cases import CASES, REL_TOL, run_case


def _cudnn_frontend() -> bool:
    from cpscope.attention._kernels import cudnn_frontend

    return torch.cuda.is_available() and cudnn_frontend.available(torch.device("cuda", 0))


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_block_kernel_parity(name):
    if CASES[name][0] == "cudnn" and not _cudnn_frontend():
        pytest.skip("cuDNN frontend (nvidia-cudnn-frontend) / cuDNN >= 9.6 / sm90 not available")
    res = run_case(name, torch.device("cuda", 0), seed=sorted(CASES).index(name))
    assert res["unseen_ok"], f"{name}: rows that see no key must come out as out 0, lse -inf ({res})"
    assert res["ok"], f"{name}: relative errors above {REL_TOL} (lse 1e-3): {res}"
    check_fallbacks(name, res)


def check_fallbacks(name: str, res: dict) -> None:
    """A graph cuDNN refuses (e.g. cuDNN 9.19: "below 9.26.0 non-ragged Stats must be packed BHSD") is a fallback,
    never a failure: every block that did not take its kind's first route must have a recorded refusal of that route
    (and a later route: ``res["ok"]`` then checked the fallback's numbers)."""
    for r in res["routes"]:
        if r["took"] != r["first"]:
            assert r["refused"], f"{name}: a {r['kind']} {r['direction']} block ran on {r['took']} instead of " \
                                 f"{r['first']} with no refusal recorded ({res})"
            assert r["first"] == "cudnn", f"{name}: only cuDNN graphs are refused ({r})"
            warnings.warn(f"{name}: cuDNN refused the {r['kind']} {r['direction']} graph; checked on {r['took']}: "
                          f"{r['refused'][:200]}")


@pytest.mark.gpu
def test_block_forward_routes_windows_through_the_kernels():
    """The public block entry points reach these kernels with ``window`` / ``softcap`` (no dense mask)."""
    from cpscope.attention import _kernels as kernels

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


@pytest.mark.gpu
def test_no_leak_warnings_at_exit():
    """A process that built cuDNN graphs (packed and dense, with a softcap) exits without the frontend's nanobind
    "leaked" warnings: cpscope releases its graphs and handles at exit."""
    import pathlib
    import subprocess
    import sys

    if not _cudnn_frontend():
        pytest.skip("cuDNN frontend (nvidia-cudnn-frontend) / cuDNN >= 9.6 / sm90 not available")
    code = (
        "import torch, cpscope\n"
        "from cpscope.attention._kernels import cudnn_frontend\n"
        "cu = torch.tensor([0, 1000, 4096], dtype=torch.int32, device='cuda')\n"
        "for fmt, shape, kw in (('thd', (4096,), {'cu_seqlens': cu}), ('bshd', (1, 4096), {'softcap': 30.0})):\n"
        "    q, k, v = (torch.randn(*shape, h, 128, device='cuda', dtype=torch.bfloat16, requires_grad=True)\n"
        "               for h in (8, 2, 2))\n"
        "    out = cpscope.context_parallel_attention(q, k, v, qkv_format=fmt, group=None, **kw)\n"
        "    out.sum().backward()\n"
        "assert cudnn_frontend.cached_graphs(), 'no graph was built'\n"
        "torch.cuda.synchronize()\n"
    )
    root = pathlib.Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "leaked" not in res.stderr, res.stderr[-3000:]
