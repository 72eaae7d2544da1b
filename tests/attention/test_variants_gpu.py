"""GPU checks of the communication variants (bf16, relative error <= 1e-2 against single-GPU / float64 references).

* one GPU: each variant's own kernels on virtual CP2 / CP4 ranks (``tests/attention/_virtual.py``);
* two GPUs (NCCL): ``all_gather`` and ``a2a`` against single-GPU SDPA, ``bshd`` and ``thd``, causal and full, GQA;
* four GPUs: ``a2a+p2p`` (inner 2) as well.

Run: ``python -m pytest -q -m gpu tests/attention/test_variants_gpu.py`` (tests needing more GPUs skip).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.attention.test_gpu import THD_LENS, _rel, _sdpa

REL_TOL = 1e-2


def variant_parity(comm: str, fmt: str, causal: bool, h: int = 16, h_kv: int = 8, seq: int = 4096,
                   d: int = 128) -> dict:
    """``comm`` over the whole (NCCL) world vs single-GPU SDPA on this rank; asserts relative error <= 1e-2."""
    import cpscope
    from cpscope.attention import context_parallel_attention
    from cpscope.sharding import zigzag_indices

    cp, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    group = cpscope.new_cp_groups([cp])[cp]
    g = torch.Generator(device=dev).manual_seed(4321)
    cu = [0]
    for n in THD_LENS:
        cu.append(cu[-1] + n)
    b, t = (1, cu[-1]) if fmt == "thd" else (1, seq)
    mk = lambda heads: torch.randn(b, t, heads, d, device=dev, dtype=torch.bfloat16, generator=g)  # noqa: E731
    q, k, v, dout = mk(h), mk(h_kv), mk(h_kv), mk(h)
    ref_in = [x.clone().requires_grad_(True) for x in (q, k, v)]
    if fmt == "thd":
        ref_out = torch.cat([_sdpa(*(x[:, a:e] for x in ref_in), causal) for a, e in zip(cu[:-1], cu[1:])], dim=1)
    else:
        ref_out = _sdpa(*ref_in, causal)
    ref_out.backward(dout)
    idx = zigzag_indices(cu if fmt == "thd" else t, cp, rank, device=dev)
    loc = [x[:, idx].detach().clone() for x in (q, k, v)]
    loc = [(x[0] if fmt == "thd" else x).requires_grad_(True) for x in loc]
    kw = {"cu_seqlens": torch.tensor(cu, dtype=torch.int32, device=dev)} if fmt == "thd" else {}
    cpscope.set_backward_read_check(True)
    with cpscope.runtime_cp(group, comm=comm):
        out = context_parallel_attention(*loc, qkv_format=fmt, causal=causal, **kw)
    dl = dout[:, idx]
    out.backward(dl[0] if fmt == "thd" else dl)
    cpscope.set_backward_read_check(True)  # back to the default (on)
    errs = {}
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *(x.grad for x in loc)),
                               (ref_out.detach(), *(x.grad for x in ref_in))):
        want = want[:, idx]
        errs[name] = _rel(got, want[0] if fmt == "thd" else want)
    bad = {n: e for n, e in errs.items() if not e <= REL_TOL}
    assert not bad, f"{comm} {fmt} causal={causal} heads {h}/{h_kv} rank {rank}: relative errors {errs} > {REL_TOL}"
    return errs


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["all_gather", "a2a"])
@pytest.mark.parametrize("fmt,causal,heads,batch", [("bshd", True, (16, 16), 1), ("bshd", True, (16, 4), 2),
                                                    ("thd", True, (16, 4), 1), ("thd", False, (16, 16), 1)])
def test_one_gpu_virtual_ranks(variant, fmt, causal, heads, batch):
    from tests.attention._virtual import check_virtual

    for n in (2, 4):
        check_virtual(variant, n, fmt, causal=causal, heads=heads, lens=[512, 1536, 256, 1024, 768], seq=2048,
                      batch=batch, d=128, device="cuda", dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("fmt", ["bshd", "thd"])
@pytest.mark.parametrize("comm", ["all_gather", "a2a"])
def test_cp2_variant_parity(comm, fmt, causal):
    from tests.distributed import run_ranks

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    errs = run_ranks(2, variant_parity, comm, fmt, causal, backend="nccl")
    assert all(max(e.values()) <= REL_TOL for e in errs)


@pytest.mark.gpu
@pytest.mark.parametrize("comm", ["all_gather", "a2a", "a2a+p2p"])
def test_cp4_variant_parity(comm):
    from tests.distributed import run_ranks

    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs")
    for fmt in ("bshd", "thd"):
        errs = run_ranks(4, variant_parity, comm, fmt, True, backend="nccl")
        assert all(max(e.values()) <= REL_TOL for e in errs)
