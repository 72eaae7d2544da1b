"""The kernel router's decision table (``cpscope.attention._kernels.router``) on CPU: every kind of block, every
capability of a device, the policy, and refused graphs — the route one function picks, with the fake cuDNN frontend
of ``tests/attention/_fake_cudnn.py`` standing in for the graphs where a block must actually run."""
from __future__ import annotations

import pytest
import torch

from cpscope.attention._kernels import Varlen, cudnn_frontend, exact, router
from cpscope.attention._kernels.router import Caps, TABLE, available_routes, kind_of
from cpscope.attention._policy import KernelPolicy, use_kernel_policy
from tests.attention._fake_cudnn import fake_cudnn

GPU = Caps(cuda=True, frontend=True)
GPU_NO_FRONTEND = Caps(cuda=True, frontend=False)
CPU = Caps(cuda=False, frontend=False)


def _t(*shape):
    return torch.empty(*shape, device="meta", dtype=torch.bfloat16)


def _vl(cu_q, cu_k):
    t = lambda c: torch.tensor(c, dtype=torch.int32)  # noqa: E731
    return Varlen(t(cu_q), t(cu_k), max(b - a for a, b in zip(cu_q, cu_q[1:])),
                  max(b - a for a, b in zip(cu_k, cu_k[1:])), tuple(cu_q), tuple(cu_k))


SAME = _vl([0, 300, 812], [0, 300, 812])
HALO = _vl([0, 300, 812], [0, 428, 1068])

# (q, k, v, causal, varlen, window, softcap) -> kind
BLOCKS = {
    "dense": ((_t(1, 64, 8, 16), _t(1, 64, 2, 16), _t(1, 64, 2, 16)), True, None, None, None),
    "dense-mla": ((_t(1, 64, 8, 24), _t(1, 64, 2, 24), _t(1, 64, 2, 16)), True, None, None, None),
    "dense-window": ((_t(1, 64, 8, 16), _t(1, 64, 2, 16), _t(1, 64, 2, 16)), True, None, (15, 0), None),
    "dense-window-split": ((_t(1, 48, 8, 16), _t(1, 64, 2, 16), _t(1, 64, 2, 16)), True, None, (15, 0), None),
    "dense-softcap": ((_t(1, 64, 8, 16), _t(1, 64, 2, 16), _t(1, 64, 2, 16)), True, None, None, 30.0),
    "dense-softcap-split": ((_t(1, 64, 8, 16), _t(1, 64, 2, 16), _t(1, 64, 2, 16)), False, None, (9, 5), 30.0),
    "packed": ((_t(812, 8, 16), _t(812, 2, 16), _t(812, 2, 16)), True, SAME, None, None),
    "packed-mla": ((_t(812, 8, 24), _t(812, 2, 24), _t(812, 2, 16)), True, SAME, None, None),
    "packed-window": ((_t(812, 8, 16), _t(1068, 2, 16), _t(1068, 2, 16)), True, HALO, (255, 0), None),
    "packed-softcap-window": ((_t(812, 8, 16), _t(812, 2, 16), _t(812, 2, 16)), True, SAME, (255, 0), 30.0),
    "packed-softcap": ((_t(812, 8, 16), _t(1068, 2, 16), _t(1068, 2, 16)), True, HALO, (255, 0), 30.0),
}

# kind -> route with (GPU + frontend, GPU without frontend, CPU) under the default policy
EXPECTED = {
    "dense": ("cudnn", "cudnn", "exact"),
    "dense-mla": ("cudnn", "cudnn", "exact"),
    "dense-window": ("cudnn", "flash", "exact"),
    "dense-window-split": ("flash", "flash", "exact"),
    "dense-softcap": ("cudnn", "flex", "exact"),
    "dense-softcap-split": ("flex", "flex", "exact"),
    "packed": ("cudnn", "flash", "exact"),
    "packed-mla": ("cudnn", "flash", "exact"),
    "packed-window": ("cudnn", "flash", "exact"),
    "packed-softcap-window": ("cudnn", "flex", "exact"),
    "packed-softcap": ("flex", "flex", "exact"),
}


@pytest.fixture(autouse=True)
def _no_refusals(monkeypatch):
    monkeypatch.setattr(router, "_REFUSED", {})


def test_every_kind_is_in_the_table_and_classified():
    assert set(BLOCKS) == set(TABLE) == set(EXPECTED)
    for kind, ((q, k, v), causal, vl, window, softcap) in BLOCKS.items():
        assert kind_of(q, k, v, causal=causal, varlen=vl, window=window, softcap=softcap) == kind
    for routes in TABLE.values():  # every row ends on the exact math, which runs anywhere
        assert routes[-1] == "exact" and set(routes) <= set(router.ROUTES)


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_decision_table(kind):
    (q, k, v), causal, vl, window, softcap = BLOCKS[kind]
    for caps, want in zip((GPU, GPU_NO_FRONTEND, CPU), EXPECTED[kind]):
        got = router.choose(q, k, v, causal=causal, varlen=vl, window=window, softcap=softcap, caps=caps)
        assert got == want, (kind, caps)


def test_policy_steers_the_table():
    assert available_routes("dense", GPU, KernelPolicy(dense_cudnn=False)) == ["flash", "efficient", "exact"]
    assert available_routes("dense-window", GPU, KernelPolicy(dense_cudnn=False)) == ["flash", "flex", "exact"]
    assert available_routes("dense-softcap", GPU, KernelPolicy(dense_cudnn=False)) == ["flex", "exact"]
    assert available_routes("packed", GPU, KernelPolicy(varlen="flash")) == ["flash", "efficient", "exact"]
    assert available_routes("packed-softcap-window", GPU, KernelPolicy(varlen="flash")) == ["flex", "exact"]
    with pytest.raises(RuntimeError, match="'cudnn' requested"):
        available_routes("packed", GPU_NO_FRONTEND, KernelPolicy(varlen="cudnn"))
    assert available_routes("packed", CPU, KernelPolicy(varlen="cudnn")) == ["exact"]
    with pytest.raises(ValueError, match="varlen"):
        KernelPolicy(varlen="fast")
    (q, k, v), causal, vl, window, softcap = BLOCKS["dense"]
    with use_kernel_policy(dense_cudnn=False):
        assert router.choose(q, k, v, causal=causal, varlen=vl, window=window, softcap=softcap, caps=GPU) == "flash"
    assert router.choose(q, k, v, causal=causal, varlen=vl, window=window, softcap=softcap, caps=GPU) == "cudnn"


def test_flex_policy_and_capabilities():
    """FlexAttention: on CUDA where its row lists it (after cuDNN and flash), first anywhere under ``flex="first"``
    (the CPU runs its eager math), never under ``flex="off"`` or without it in torch."""
    assert available_routes("packed-softcap", CPU) == ["exact"]
    assert available_routes("packed-softcap", CPU, KernelPolicy(flex="first")) == ["flex", "exact"]
    assert available_routes("dense-window", GPU, KernelPolicy(flex="first")) == ["flex", "cudnn", "flash", "exact"]
    assert available_routes("dense", GPU, KernelPolicy(flex="first")) == ["cudnn", "flash", "efficient", "exact"]
    assert available_routes("dense-softcap", GPU, KernelPolicy(flex="off")) == ["cudnn", "exact"]
    assert available_routes("dense-softcap", GPU._replace(flex=False)) == ["cudnn", "exact"]
    with pytest.raises(ValueError, match="flex"):
        KernelPolicy(flex="always")
    with use_kernel_policy(flex="first"):
        table = router.routing_table(torch.device("cpu"))
    assert table["packed-softcap"][0] == "flex" and table["dense"][0] == "exact"


def test_refusals_are_remembered_per_kind(monkeypatch):
    """A graph cuDNN refuses sends that kind of block (that direction, dtype, dims, device) to the next route, once
    and for all; other kinds and the other direction keep their route; ``fallbacks()`` says why."""
    (q, k, v), causal, vl, window, softcap = BLOCKS["packed-window"]
    key = router._refusal_key("cudnn", "packed-window", "forward", q, k, v)
    router._refuse(key, RuntimeError("no engine"))
    kw = dict(causal=causal, varlen=vl, window=window, softcap=softcap, caps=GPU)
    assert router.choose(q, k, v, **kw) == "flash"
    assert router.choose(q, k, v, direction="backward", **kw) == "cudnn"
    (q2, k2, v2), *rest = BLOCKS["packed"]
    assert router.choose(q2, k2, v2, causal=True, varlen=SAME, window=None, softcap=None, caps=GPU) == "cudnn"
    assert list(router.fallbacks().values()) == ["no engine"]


def test_refused_graph_runs_the_next_route_and_warns_once(monkeypatch, caplog):
    """End to end on CPU with the fake frontend: every packed graph is refused; the block runs the exact math (the
    next available route here) bit for bit, with one warning, and the refusal is remembered."""
    cudnn = fake_cudnn()
    monkeypatch.setattr(cudnn_frontend, "module", lambda: cudnn)
    monkeypatch.setattr(cudnn_frontend, "stream", lambda device: 0)
    monkeypatch.setattr(cudnn_frontend, "handle", lambda device: object())
    monkeypatch.setattr(cudnn_frontend, "available", lambda device: True)
    built = []

    def refuse(*args, **kwargs):
        built.append(1)
        raise RuntimeError("below 9.26.0 non-ragged Stats must be packed BHSD")

    monkeypatch.setattr(cudnn_frontend, "finish", refuse)
    cudnn_frontend.clear_cache()
    torch.manual_seed(0)
    cu = [0, 5, 12]
    vl = _vl(cu, cu)
    q, k, v = torch.randn(12, 4, 8).bfloat16(), torch.randn(12, 2, 8).bfloat16(), torch.randn(12, 2, 8).bfloat16()
    with caplog.at_level("WARNING", logger=router.__name__):
        for _ in range(3):
            out, lse = router.block_forward(q, k, v, scale=0.3, causal=True, varlen=vl, window=(3, 0))
    want = exact.forward(q, k, v, 0.3, True, vl, (3, 0), None)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    assert len(built) == 1 and len([r for r in caplog.records if "refused" in r.getMessage()]) == 1
    assert "Stats must be packed" in next(iter(router.fallbacks().values()))
    cudnn_frontend.clear_cache()


def test_routing_table_names_a_route_and_a_reason_for_every_kind():
    table = router.routing_table(torch.device("cpu"))
    assert set(table) == set(TABLE)
    for kind, (route, why) in table.items():
        assert route == "exact" and why, kind
    assert "not a CUDA device" in table["dense"][1]
