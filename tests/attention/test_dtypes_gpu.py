"""fp16 and fp32 on CUDA (issue 31) against float64 references computed on the GPU: every block case of
``tests/attention/_kernel_cases.py`` through the router (forward, and backward with external statistics), and the
public call at CP1 on ``bshd`` / ``thd`` with every score feature (window, softcap, sinks) — forward and gradients.
fp16 takes bf16's kernels; fp32 takes aten's memory-efficient kernels where its kind lists them, FlexAttention or
the exact math elsewhere; a refused cuDNN graph is a checked fallback (:func:`tests.attention.test_kernels_gpu.check_fallbacks`).

``python -m pytest -q -m gpu tests/attention/test_dtypes_gpu.py``
"""
from __future__ import annotations

import pytest
import torch

from tests.attention._kernel_cases import CASES, run_case

# relative error bounds against float64 (out, dq, dk, dv; lse of rows that see a key)
TOL = {torch.float16: (1e-2, 1e-3), torch.float32: (1e-4, 1e-5)}
_EFFICIENT_KINDS = ("dense", "dense-mla", "packed", "packed-mla")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_block_parity_by_dtype(name, dtype, monkeypatch):
    from tests.attention import _kernel_cases
    from tests.attention.test_kernels_gpu import check_fallbacks

    draw = _kernel_cases._inputs  # the cases' bf16 inputs, cast (the reference takes the same values)
    monkeypatch.setattr(_kernel_cases, "_inputs", lambda *a: tuple(x.to(dtype) for x in draw(*a)))
    res = run_case(name, torch.device("cuda", 0), seed=sorted(CASES).index(name))
    tol, lse_tol = TOL[dtype]
    assert res["unseen_ok"], f"{name} {dtype}: rows that see no key must come out as out 0, lse -inf ({res})"
    bad = {n: res[n] for n in ("out", "dq", "dk", "dv") if not res[n] <= tol}
    assert not bad and res["lse"] <= lse_tol, f"{name} {dtype}: relative errors {bad} above {tol} ({res})"
    check_fallbacks(name, res)
    for r in res["routes"]:
        if dtype == torch.float16:  # bf16's route
            assert r["first"] == r["first_bf16"], r
        else:
            assert r["took"] in (("efficient",) if r["kind"] in _EFFICIENT_KINDS else ("flex", "exact")), r


_FEATURES = {"plain": {}, "window": {"window": (255, 0)}, "softcap": {"softcap": 30.0}, "sinks": {"sinks": True},
             "all": {"window": (127, 0), "softcap": 20.0, "sinks": True}, "full": {"causal": False}}


@pytest.mark.parametrize("feat", sorted(_FEATURES))
@pytest.mark.parametrize("fmt", ["bshd", "thd"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_api_cp1_by_dtype(dtype, fmt, feat):
    api_case(dtype, fmt, feat, torch.device("cuda", 0))


def api_case(dtype: torch.dtype, fmt: str, feat: str, dev: torch.device) -> dict:
    """One public call at CP1 with ``feat`` (:data:`_FEATURES`) against float64: relative errors (asserted)."""
    import cpscope
    from tests.attention._reference import reference_attention

    g = torch.Generator(device=dev).manual_seed(11)
    cu = [0, 700, 1024, 2048]
    h, h_kv, d, t = 8, 2, 128, cu[-1]
    shape = (1, t) if fmt == "bshd" else (t,)
    mk = lambda *s: torch.randn(*s, device=dev, dtype=dtype, generator=g)  # noqa: E731
    q, k, v, do = mk(*shape, h, d), mk(*shape, h_kv, d), mk(*shape, h_kv, d), mk(*shape, h, d)
    kw = dict(_FEATURES[feat])
    sinks = None
    if kw.pop("sinks", False):
        sinks = torch.randn(h, device=dev, generator=g, dtype=torch.float32)
        kw["sinks"] = sinks.clone().requires_grad_(True)
    if fmt == "thd":
        kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device=dev)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = cpscope.context_parallel_attention(*leaves, qkv_format=fmt, group=None, **kw)
    out.backward(do)
    flat = lambda x: x.reshape(t, *x.shape[-2:])  # noqa: E731
    ref_in = [flat(x).detach().double().requires_grad_(True) for x in (q, k, v)]
    ref = reference_attention(*ref_in, causal=kw.get("causal", True), cu=cu if fmt == "thd" else None,
                              window=kw.get("window"), softcap=kw.get("softcap"),
                              sinks=None if sinks is None else sinks.double())
    ref.backward(flat(do).double())
    tol = TOL[dtype][0]

    def rel(a, b):
        return float((a.detach().double() - b.detach()).norm() / b.detach().norm())

    errs = {"out": rel(flat(out), ref)}
    errs.update({n: rel(flat(x.grad), r.grad) for n, x, r in zip(("dq", "dk", "dv"), leaves, ref_in)})
    assert out.dtype == dtype and all(x.grad.dtype == dtype for x in leaves)
    assert max(errs.values()) <= tol, f"{dtype} {fmt} {feat}: relative errors {errs} above {tol}"
    return errs
