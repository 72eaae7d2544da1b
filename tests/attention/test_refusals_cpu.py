"""A graph cuDNN refuses is a fallback, never a failure (issue 31), on CPU with the fake frontend: the GPU parity
check (``tests/attention/test_kernels_gpu.py``'s :func:`check_fallbacks` over ``_kernel_cases``) passes when the
refused blocks fell back with a recorded refusal and right numbers, and fails when a block left its route without
one. And the frontend's objects are released at exit (no nanobind leak warnings)."""
from __future__ import annotations

import contextlib
import pathlib
import subprocess
import sys
import types

import pytest
import torch

from cpscope.attention._kernels import cudnn_frontend, router
from tests.attention._fake_cudnn import fake_cudnn
from tests.attention._kernel_cases import run_case
from tests.attention.test_kernels_gpu import check_fallbacks


@pytest.fixture
def frontend(monkeypatch):
    cudnn = fake_cudnn()
    monkeypatch.setattr(cudnn_frontend, "module", lambda: cudnn)
    monkeypatch.setattr(cudnn_frontend, "stream", lambda device: 0)
    monkeypatch.setattr(cudnn_frontend, "handle", lambda device: object())
    monkeypatch.setattr(cudnn_frontend, "available", lambda device: True)
    monkeypatch.setattr(router, "caps_of", lambda device: router.Caps(cuda=False, frontend=True))
    monkeypatch.setattr(router, "_REFUSED", {})
    cudnn_frontend.clear_cache()
    yield cudnn
    cudnn_frontend.clear_cache()


def _refuse_stats(monkeypatch):
    real = cudnn_frontend.finish

    def finish(cudnn, g, named, fixed=None):
        if "stats" in named and "dq" not in named:  # the forward graphs, as cuDNN 9.19 refuses some
            raise RuntimeError("below 9.26.0 non-ragged Stats must be packed BHSD (fake refusal)")
        return real(cudnn, g, named, fixed)

    monkeypatch.setattr(cudnn_frontend, "finish", finish)


@pytest.mark.parametrize("name", ["thd_softcap_window", "dense_softcap_more_q"])
def test_a_refused_graph_is_checked_on_its_fallback(frontend, monkeypatch, name):
    _refuse_stats(monkeypatch)
    res = run_case(name, torch.device("cpu"), seed=1)
    assert res["ok"], res
    fwd = [r for r in res["routes"] if r["direction"] == "forward"]
    assert fwd and all(r["first"] == "cudnn" and r["took"] == "exact" and "Stats" in r["refused"] for r in fwd)
    assert all(r["took"] == "cudnn" for r in res["routes"] if r["direction"] == "backward")
    with pytest.warns(UserWarning, match="cuDNN refused"):
        check_fallbacks(name, res)


def test_a_fallback_without_a_recorded_refusal_fails(frontend, monkeypatch):
    res = run_case("thd_window", torch.device("cpu"), seed=2)
    assert res["ok"] and all(r["took"] == r["first"] == "cudnn" for r in res["routes"])
    check_fallbacks("thd_window", res)
    res["routes"][0].update(took="exact")  # as if the router had left cuDNN silently
    with pytest.raises(AssertionError, match="no refusal recorded"):
        check_fallbacks("thd_window", res)


def test_graphs_and_handles_are_released_at_exit(monkeypatch):
    """The exit hook drops the cached graphs and destroys the handles through the frontend (nanobind warns about
    frontend objects still alive when its extension is torn down), and runs when the process exits."""
    destroyed, freed = [], []
    fake = types.SimpleNamespace(destroy_handle=destroyed.append)
    monkeypatch.setattr(cudnn_frontend, "module", lambda: fake)
    monkeypatch.setattr(torch.cuda, "device", lambda idx: contextlib.nullcontext())

    class Graph:
        def __del__(self):
            freed.append(1)

    g = Graph()
    g.cycle = g  # a graph in a reference cycle (it keeps its score modifier's callables)
    monkeypatch.setitem(cudnn_frontend._handles, 0, "handle 0")
    monkeypatch.setitem(cudnn_frontend._graphs, ("fwd",), g)
    del g
    cudnn_frontend._release_at_exit()
    assert destroyed == ["handle 0"] and freed == [1]
    assert not cudnn_frontend._handles and not cudnn_frontend.cached_graphs()
    cudnn_frontend._release_at_exit()  # nothing left: nothing done
    assert destroyed == ["handle 0"]
    # and it runs at exit: a process that holds a (fake) handle destroys it when it ends
    code = ("import contextlib, types, torch\n"
            "from cpscope.attention._kernels import cudnn_frontend as fe\n"
            "fake = types.SimpleNamespace(destroy_handle=lambda h: print('destroyed', h))\n"
            "fe.module = lambda: fake\n"
            "torch.cuda.device = lambda idx: contextlib.nullcontext()\n"
            "fe._handles[0] = 'handle 0'\n")
    root = pathlib.Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root)
    assert res.returncode == 0 and res.stdout.strip() == "destroyed handle 0", (res.stdout, res.stderr[-2000:])
