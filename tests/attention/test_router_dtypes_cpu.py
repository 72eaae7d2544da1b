"""Every dtype on CUDA (issue 31), on CPU: which route the router picks for each kind of block and dtype (the table
test), and aten's memory-efficient kernels' glue (fp32's CUDA route: GQA, statistics layout, bottom-right causal,
rows that see no key, packed blocks) against a float64 reference, with the ops replaced by a CPU fake that keeps
their contract (``tests/attention/_fake_efficient.py``). The GPU parity of the real kernels is
``tests/attention/test_dtypes_gpu.py``'s."""
from __future__ import annotations

import pytest
import torch

import cpscope
from cpscope.attention._kernels import Placeholders, Varlen, aten, router
from cpscope.attention._kernels.router import DTYPES, TABLE, routes_for
from tests.attention._fake_cudnn import block_reference, rel
from tests.attention._fake_efficient import fake_aten
from tests.attention.test_router_cpu import BLOCKS, CPU, GPU, GPU_NO_FRONTEND

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64

# the kinds whose rows list aten's memory-efficient kernels (fp32's CUDA kernel where there is no window or softcap)
PLAIN = ("dense", "dense-mla", "packed", "packed-mla")


@pytest.fixture(autouse=True)
def _no_refusals(monkeypatch):
    monkeypatch.setattr(router, "_REFUSED", {})


def _choose(kind, dtype, caps):
    (q, k, v), causal, vl, window, softcap = BLOCKS[kind]
    q, k, v = (x.to(dtype) for x in (q, k, v))
    return router.choose(q, k, v, causal=causal, varlen=vl, window=window, softcap=softcap, caps=caps)


@pytest.mark.parametrize("kind", sorted(TABLE))
def test_fp16_routes_as_bf16(kind):
    for caps in (GPU, GPU_NO_FRONTEND, CPU):
        assert _choose(kind, F16, caps) == _choose(kind, BF16, caps), (kind, caps)


@pytest.mark.parametrize("kind", sorted(TABLE))
def test_fp32_and_fp64_routes(kind):
    """fp32: never cuDNN or flash (they take half precision only); on CUDA the memory-efficient kernels where the row
    has them, else FlexAttention where the row has it, else the exact math. fp64: the exact math everywhere."""
    for caps in (GPU, GPU_NO_FRONTEND):
        got = _choose(kind, F32, caps)
        assert got == ("efficient" if kind in PLAIN else "flex" if "flex" in TABLE[kind] else "exact"), (kind, caps)
        assert _choose(kind, F64, caps) == "exact", (kind, caps)
    assert _choose(kind, F32, CPU) == _choose(kind, F64, CPU) == "exact"


def test_every_route_of_every_row_says_which_dtypes_it_takes():
    for kind, routes in TABLE.items():
        for r in routes:
            assert r in DTYPES, (kind, r)
    assert set(DTYPES["exact"]) == {F16, BF16, F32, F64}  # every dtype the inputs may have runs somewhere
    assert routes_for("dense", GPU, F32) == ["efficient", "exact"]
    assert routes_for("dense", GPU, BF16) == routes_for("dense", GPU, F16) == ["cudnn", "flash", "exact"]
    assert routes_for("dense-softcap", GPU, F32) == [r for r in TABLE["dense-softcap"] if r in ("flex", "exact")]
    assert routes_for("dense", GPU, F64) == ["exact"]


def test_routing_table_by_dtype(monkeypatch):
    monkeypatch.setattr(router, "caps_of", lambda device: GPU)
    t32 = router.routing_table(torch.device("cpu"), torch.float32)
    assert t32["dense"][0] == "efficient" and "cudnn: takes float16, bfloat16, not float32" in t32["dense"][1]
    assert "efficient: takes float32, not bfloat16" not in router.routing_table(torch.device("cpu"))["dense"][1]
    assert t32["packed-softcap-window"][0] == ("flex" if "flex" in TABLE["packed-softcap-window"] else "exact")
    assert router.routing_table(torch.device("cpu"), torch.float64)["dense"][0] == "exact"
    assert router.routing_table(torch.device("cpu"), torch.float16)["dense"][0] == "cudnn"


def test_an_unsupported_dtype_is_a_clear_error():
    q = torch.zeros(1, 4, 2, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"dtype torch.int32 is not supported on cpu \(supported: "):
        cpscope.context_parallel_attention(q, q, q, group=None)
    q8 = torch.zeros(1, 4, 2, 8).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="float8_e4m3fn is not supported"):
        cpscope.context_parallel_attention(q8, q8, q8, group=None)


# ---- the memory-efficient kernels' glue, against the fake ops ---------------------------------------------------

@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(aten, "_aten", fake_aten())


def _vl(cu_q, cu_k):
    t = lambda c: torch.tensor(c, dtype=torch.int32)  # noqa: E731
    return Varlen(t(cu_q), t(cu_k), max(b - a for a, b in zip(cu_q, cu_q[1:])),
                  max(b - a for a, b in zip(cu_k, cu_k[1:])), tuple(cu_q), tuple(cu_k))


# name: (n_q, n_k) dense or (cu_q, cu_k) packed, (h, h_kv, d, d_v), causal
CASES = {
    "dense_causal_gqa": ((70, 70), (4, 2, 16, 16), True),
    "dense_more_q": ((70, 40), (4, 4, 16, 16), True),  # 30 rows see no key
    "dense_halo": ((40, 70), (4, 1, 16, 16), True),
    "dense_full_mla": ((33, 50), (4, 2, 24, 16), False),
    "packed_causal": (([0, 37, 40, 105], [0, 37, 40, 105]), (4, 2, 16, 16), True),
    "packed_more_q": (([0, 50, 60, 95], [0, 20, 60, 90]), (4, 2, 16, 16), True),
    "packed_full_mla": (([0, 37, 40, 105], [0, 20, 60, 90]), (4, 4, 24, 8), False),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_efficient_kernel_glue_matches_float64(fake, name):
    shape, (h, h_kv, d, dv), causal = CASES[name]
    g = torch.Generator().manual_seed(sorted(CASES).index(name))
    mk = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    if isinstance(shape[0], int):
        (n_q, n_k), vl, cu = shape, None, {}
        q, k, v, do = mk(2, n_q, h, d), mk(2, n_k, h_kv, d), mk(2, n_k, h_kv, dv), mk(2, n_q, h, dv)
    else:
        vl, cu = _vl(*shape), {"cu_q": shape[0], "cu_k": shape[1]}
        q, k, v, do = mk(shape[0][-1], h, d), mk(shape[1][-1], h_kv, d), mk(shape[1][-1], h_kv, dv), \
            mk(shape[0][-1], h, dv)
    scale = d ** -0.5
    out, lse = aten.EFFICIENT.forward(q, k, v, scale, causal, vl, None, None, Placeholders())
    ref = block_reference(q, k, v, do, scale=scale, causal=causal, **cu)
    assert out.shape == ref[0].shape and lse.shape == ref[1].shape and lse.dtype == torch.float32
    seen = torch.isfinite(ref[1])
    assert torch.equal(torch.isfinite(lse), seen) and (lse[~seen] == float("-inf")).all()
    assert rel(out, ref[0]) < 1e-6 and rel(lse[seen], ref[1][seen]) < 1e-6
    # the backward with external (here: the reference's) statistics, as the ring gives the merged ones
    grads = aten.EFFICIENT.backward(do, q, k, v, ref[0].float(), ref[1].float(), scale, causal, vl, None, None,
                                    Placeholders())
    for got, want, x in zip(grads, ref[2:], (q, k, v)):
        assert got.shape == x.shape and got.dtype == x.dtype and rel(got, want) < 1e-5


def test_fp32_blocks_run_the_efficient_kernels_end_to_end(fake, monkeypatch):
    """With CUDA's capabilities (and the fake ops on CPU), fp32 dense and packed calls run aten's memory-efficient
    kernels through the router — not the exact math — and match float64, forward and backward."""
    from tests.attention._reference import reference_attention

    ran = []
    monkeypatch.setattr(router, "caps_of", lambda device: GPU_NO_FRONTEND)
    monkeypatch.setattr(router, "_kernel", lambda route, kind, _k=router._kernel: ran.append(route) or _k(route, kind))
    torch.manual_seed(0)
    cu = [0, 40, 64, 128]
    for fmt in ("bshd", "thd"):
        shape = (1, 128) if fmt == "bshd" else (128,)
        q, k, v = (torch.randn(*shape, h, 16, requires_grad=True) for h in (4, 2, 2))
        kw = {"cu_seqlens": torch.tensor(cu, dtype=torch.int32)} if fmt == "thd" else {}
        out = cpscope.context_parallel_attention(q, k, v, qkv_format=fmt, group=None, **kw)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        flat = lambda x: x.reshape(128, *x.shape[-2:])  # noqa: E731
        qr, kr, vr = (flat(x).detach().double().requires_grad_(True) for x in (q, k, v))
        ref = reference_attention(qr, kr, vr, causal=True, cu=cu if fmt == "thd" else None)
        ref_grads = torch.autograd.grad(ref, (qr, kr, vr), flat(dout).double())
        assert rel(flat(out), ref) < 1e-5, fmt
        for got, want in zip(grads, ref_grads):
            assert rel(flat(got), want) < 1e-5, fmt
    assert ran and set(ran) == {"efficient"}, ran


@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_the_efficient_path_leaves_no_cycle(fake, monkeypatch, fmt):
    """fp32 calls on the memory-efficient kernels (the fake ops) leave nothing in a reference cycle."""
    from tests.attention.test_no_cycles import _api, _check

    monkeypatch.setattr(router, "caps_of", lambda device: GPU_NO_FRONTEND)
    _check(_api(fmt, {}))
    _check(_api(fmt, {"sinks": True}, d_v=8))


def _efficient_under_cp(world: int) -> dict:
    """On a gloo rank: the CP matrix's calls (every variant, bshd and thd, plain and sinks) with fp32 blocks on the
    memory-efficient kernels (the fake ops), against float64."""
    from tests.attention._cp_matrix import SIZES, VARIANTS, one_call

    import cpscope as cps

    ran = []
    orig_caps, orig_kernel, orig_aten = router.caps_of, router._kernel, aten._aten
    router.caps_of = lambda device: GPU_NO_FRONTEND
    router._kernel = lambda route, kind: ran.append(route) or orig_kernel(route, kind)
    aten._aten = fake_aten()
    try:
        group = cps.new_cp_groups([world], hierarchical=True)[world]
        worst = {}
        for i, comm in enumerate(VARIANTS[world]):
            for fmt in ("bshd", "thd"):
                for feat in ("dense", "sinks"):
                    errs = one_call(group, comm, fmt, feat, torch.device("cpu"), torch.float32, SIZES["cpu"], seed=i)
                    worst[comm] = max(worst.get(comm, 0.0), *errs.values())
    finally:
        router.caps_of, router._kernel, aten._aten = orig_caps, orig_kernel, orig_aten
    return {"worst": worst, "routes": sorted(set(ran))}


@pytest.mark.parametrize("world", [2, 4])
def test_efficient_kernels_under_every_variant(world):
    """The ring's, all-gather's and Ulysses' blocks (more queries than keys, external statistics, merges) on the
    memory-efficient kernels' glue at CP2 / CP4."""
    from tests.distributed import run_ranks

    for res in run_ranks(world, _efficient_under_cp, world):
        assert res["routes"] == ["efficient"], res
        assert max(res["worst"].values()) < 1e-5, res
