"""CP > 1 on the one GPU (issue 31): 2 and 4 gloo ranks share ``cuda:0``; the collectives gloo cannot move on CUDA
tensors are staged through the host (``tests/gloo_staging.py``, test-only). Each rank runs every variant (p2p,
all_gather, a2a; a2a+p2p at CP4), layout (bshd, thd) and feature (dense, window, softcap, sinks) in bf16 on the real
kernels — the ring's block shapes, merges and stream hand-offs that CP1 never makes — against a float64 reference
of the whole sequences computed on the GPU, forward and gradients, with the sentinel on
(``tests/attention/_cp_matrix.py``; the same body runs on CPU in ``tests/test_gloo_staging.py``). Timing stays for
real multi-GPU runs.

``python -m pytest -q -m gpu tests/attention/test_cp_one_gpu.py``
"""
from __future__ import annotations

import pytest
import torch

from tests.attention._cp_matrix import VARIANTS, cp_matrix
from tests.distributed import run_ranks

TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-4}  # relative (norm) error against float64, per tensor

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("world", [2, 4])
def test_cp_on_one_gpu_matches_float64(world, dtype):
    tol = TOL[dtype]
    results = run_ranks(world, cp_matrix, world, "cuda:0", dtype, size="gpu", tol=tol, timeout=900)
    for rank, res in enumerate(results):
        assert set(res["worst"]) == set(VARIANTS[world]), res
        assert max(res["worst"].values()) <= tol, (rank, res)
        staged = res["staged"]
        assert staged.get("isend", 0) > 0 and staged.get("irecv", 0) > 0 and staged.get("all_to_all_single", 0) > 0, \
            f"the collectives did not go through the host staging: {staged}"
        assert res["checks"].get("attention", 0) > 0 and res["checks"].get("attention-grad", 0) > 0, res["checks"]
