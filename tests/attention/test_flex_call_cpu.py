"""What cpscope's compiled FlexAttention call hands the kernels (issue 31: a Gemma 2 call at 16k tokens took 1.19x
FlexAttention called directly on an H100, 0.997x at 64k).

The CUDA path compiles ``flex._call_flex`` per configuration; here the same path runs on the CPU with a backend that
records the graph dynamo traced (the FlexAttention operator's arguments) and then runs it as traced (FlexAttention's
eager math, differentiable). Checked, forward and gradients against the float64 exact math each time:

* a graph that turned dynamic in the lengths still tells the kernels that both lengths divide by the 128-row tile
  where they do (``IS_DIVISIBLE``; a static graph finds it itself, a dynamic one cannot), and never where they do not;
* a whole call without sinks returns no log-sum-exp from the compiled graph (as FlexAttention called plainly), with
  sinks it does;
* a second call of the same shape compiles nothing and builds no block mask; no copy of q / k / v is made.
"""
from __future__ import annotations

import pytest
import torch

from cpscope.attention._kernels import exact, flex

pytestmark = pytest.mark.skipif(not flex.available(), reason="no FlexAttention in this torch")


class _Capture:
    """A compile backend that records, per traced graph, the FlexAttention operator's query length (an int, or a
    symbol once the graph is dynamic), its kernel options and the graph's number of outputs; runs the graph as is."""

    def __init__(self):
        self.graphs: list[dict] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function" and "flex_attention" in str(node.target):
                q = node.args[0].meta["example_value"]
                out = next(n for n in gm.graph.nodes if n.op == "output")
                self.graphs.append({"len": q.shape[-2], "options": dict(node.args[6]),
                                    "outputs": len([a for a in out.args[0] if a is not None])})
        return gm.forward


@pytest.fixture
def compiled(monkeypatch):
    """The CUDA path of ``flex._run`` on the CPU, through a recording backend."""
    cap = _Capture()
    flex.clear_cache()
    monkeypatch.setattr(flex, "_compiles", lambda device: True)
    monkeypatch.setattr(flex, "_BACKEND", cap)
    # FlexAttention's public entry refuses gradients on the CPU (its compiled kernels are CUDA's); the operator
    # under it, which the recorded graph runs, takes them: skip the device check while tracing
    import torch.nn.attention.flex_attention as fa
    monkeypatch.setattr(fa, "_validate_device", lambda *a: None)
    yield cap
    flex.clear_cache()


def _call(n: int, sinks: bool = False, seed: int = 0):
    """A bshd window + softcap call of ``n`` tokens (GQA 4/2) through ``flex.attend``: output, gradients and the
    float64 exact math's."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, n, h, 16, generator=g, requires_grad=True) for h in (4, 2, 2))
    s = torch.randn(4, generator=g, requires_grad=True) if sinks else None
    kw = {"scale": 0.25, "causal": True, "window": (63, 0), "softcap": 5.0}
    out = flex.attend(q, k, v, sinks=s, **kw)
    do = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, (q, k, v), do)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    want, lse = exact.forward(qd, kd, vd, kw["scale"], True, None, kw["window"], kw["softcap"])
    if sinks:
        keep = torch.exp(lse - torch.logaddexp(lse, s.detach().double()[None, :, None]))  # [b, h, s]
        want = want * keep.transpose(1, 2)[..., None]
    wants = torch.autograd.grad(want, (qd, kd, vd), do.double())
    for got, ref in zip((out, *grads), (want, *wants)):
        assert torch.allclose(got.double(), ref, atol=2e-5, rtol=1e-4), (got.double() - ref).abs().max()


def test_dynamic_graphs_keep_lengths_divisible_by_the_tile(compiled):
    _call(256)  # the first length: a static graph, which knows 256 divides by 128
    _call(384)  # a new length: the graph turns dynamic in the lengths
    _call(512)
    first, dyn = compiled.graphs[0], compiled.graphs[-1]
    assert len(compiled.graphs) == 2, [g["len"] for g in compiled.graphs]  # static, then one dynamic graph
    assert isinstance(dyn["len"], torch.SymInt), "the second length should have made the graph dynamic"
    assert first["options"].get("IS_DIVISIBLE") is True
    assert dyn["options"].get("IS_DIVISIBLE") is True, (
        "a dynamic graph at lengths divisible by 128 must tell the kernels so (else they guard every load)")
    _call(200)  # not a multiple of the tile: a configuration of its own, and no claim of divisibility
    _call(328)
    assert len(compiled.graphs) == 4
    assert all("IS_DIVISIBLE" not in g["options"] for g in compiled.graphs[2:])
    assert isinstance(compiled.graphs[-1]["len"], torch.SymInt)


def test_whole_call_returns_no_lse_unless_sinks_need_it(compiled):
    _call(256)
    assert compiled.graphs[-1]["outputs"] == 1, "without sinks the compiled graph should return the output only"
    _call(256, sinks=True)
    assert compiled.graphs[-1]["outputs"] == 2, "sinks merge through the log-sum-exp: the graph returns it"


def test_second_call_compiles_and_builds_nothing_and_copies_nothing(compiled, monkeypatch):
    builds, seen = [], []
    real_build, real_compiled = flex._build, flex._compiled_for
    monkeypatch.setattr(flex, "_build", lambda *a: builds.append(a[2:]) or real_build(*a))

    def spy(key):
        fn = real_compiled(key)
        return lambda *a: seen.append(a[:3]) or fn(*a)
    monkeypatch.setattr(flex, "_compiled_for", spy)
    for layout in ("bshd", "thd"):
        flex.clear_cache()
        builds.clear()
        n0 = len(compiled.graphs)
        g = torch.Generator().manual_seed(1)
        shape = (1, 256) if layout == "bshd" else (256,)
        vl = None if layout == "bshd" else flex.Varlen(*(torch.tensor([0, 100, 256], dtype=torch.int32),) * 2,
                                                      156, 156, (0, 100, 256), (0, 100, 256))
        for _ in range(2):
            q, k, v = (torch.randn(*shape, h, 16, generator=g, requires_grad=True) for h in (4, 2, 2))
            seen.clear()
            out = flex.attend(q, k, v, scale=0.25, causal=True, varlen=vl, window=(63, 0), softcap=5.0)
            out.sum().backward()
            # the kernel reads q / k / v where they are: views of the caller's tensors, nothing copied before it
            assert [a.untyped_storage().data_ptr() for a in seen[0]] == [
                t.untyped_storage().data_ptr() for t in (q, k, v)]
            assert q.grad.shape == q.shape and q.grad.is_contiguous()
        assert len(builds) == 1, f"{layout}: the same shape twice built {len(builds)} block masks"
        assert len(compiled.graphs) - n0 == 1, f"{layout}: the same shape twice compiled more than once"
