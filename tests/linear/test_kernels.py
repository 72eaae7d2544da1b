"""cpscope.linear's kernel dispatch and its flash-linear-attention path, on CPU.

fla's Triton kernels need a GPU, so the fla path runs here with a checked stand-in (``_fla_standin``: fla's keyword
contract, cpscope's torch chunk code inside): forward and every gradient against the float64 references at CP1 and
at 2 and 4 gloo ranks, with a deliberate break; and every rank of a group in one process through the library's own
phases (``_sequential``, the harness of the GPU tests). The dispatch: at CP1 one kernel call with the caller's own
offsets tensor and their host copy; the kernel geometry cached per offsets tensor.
"""
from __future__ import annotations

import inspect

import pytest
import torch

from cpscope.linear import gated_delta_rule, _kernels as kernels, mamba2_scan
from cpscope.linear._pieces import runs_of_input
from cpscope.scope import CPScope
from tests.distributed import run_ranks
from tests.linear import _sequential
from tests.linear._cases import run_case
from tests.linear._fla_standin import FLA_KEYWORDS, standin

TOL64, TOL32 = 1e-10, 1e-4
FLA_KINDS = ("gdn", "kda", "mamba2")
LAYOUTS = ("bshd", "thd")
CPU = torch.device("cpu")


def test_fla_keywords_match_installed_fla() -> None:
    """Every keyword cpscope passes is a named parameter of the installed fla function (not swallowed by **kwargs)."""
    pytest.importorskip("fla")
    import importlib

    for (mod_name, fn_name), keywords in FLA_KEYWORDS.items():
        fn = getattr(importlib.import_module(mod_name), fn_name)
        named = {n for n, p in inspect.signature(fn).parameters.items() if p.kind != p.VAR_KEYWORD}
        assert set(keywords) <= named, (fn_name, set(keywords) - named)


def test_pick() -> None:
    x = torch.zeros(1, 8, 2, 4)
    runs = runs_of_input(1, 8, None, CPScope(None, 1, 0), CPU, where="t")
    assert kernels.pick(x, runs) is kernels.TORCH  # CPU: the torch kernels
    with standin():
        assert kernels.pick(x, runs) is kernels.FLA
        empty = runs_of_input(1, 8, torch.tensor([0, 0, 8], dtype=torch.int32), CPScope(None, 1, 0), CPU, where="t")
        assert empty.has_empty and kernels.pick(x, empty) is kernels.TORCH  # fla is not given empty runs


def test_runs_geometry_and_cache() -> None:
    cu = torch.tensor([0, 8, 24], dtype=torch.int32)
    cp1 = runs_of_input(1, 24, cu, CPScope(None, 1, 0), CPU, where="t")
    assert cp1.cu is cu and cp1.cu_cpu.tolist() == [0, 8, 24] and cp1.rows == 1  # the caller's own tensor at CP1
    assert runs_of_input(1, 24, cu, CPScope(None, 1, 0), CPU, where="t") is cp1  # cached on cu
    cp2 = runs_of_input(1, 12, cu, CPScope(None, 2, 1), CPU, where="t")
    assert cp2.cu.dtype == torch.int32 and cp2.cu.tolist() == [0, 2, 4, 8, 12] == cp2.cu_cpu.tolist()
    bshd = runs_of_input(3, 10, None, CPScope(None, 2, 0), CPU, where="t")
    assert bshd.rows == 6 and bshd.cu is None  # front and back chunk of each row: two runs, a view
    assert runs_of_input(3, 10, None, CPScope(None, 1, 0), CPU, where="t").rows == 3


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", FLA_KINDS)
def test_fla_path_cp1(kind: str, layout: str) -> None:
    """CP1 on the fla path: the reference's numbers, from one kernel call with no initial or final state."""
    with standin() as calls:
        errs = run_case(kind, layout, 1, seed=4)
        assert calls and all(kw["initial_state"] is None and not kw["output_final_state"] for _, kw in calls)
        assert len(calls) == 1, [name for name, _ in calls]  # forward only: backward is autograd's
    assert max(errs.values()) < TOL64, errs


def test_fla_path_cp1_hands_over_the_callers_offsets() -> None:
    seq, par = _sequential.make_inputs("gdn", 1, 24, seed=5)
    cu = torch.tensor([0, 8, 24], dtype=torch.int32)
    with standin() as calls:
        o = gated_delta_rule(*seq.values(), cu_seqlens=cu, group=None, use_qk_l2norm=True)
        kw = calls[-1][1]
        assert kw["cu_seqlens"] is cu and kw["cu_seqlens_cpu"].tolist() == [0, 8, 24]
        assert kw["use_qk_l2norm_in_kernel"] is True and kw["scale"] == 4 ** -0.5
        gated_delta_rule(*seq.values(), cu_seqlens=cu, group=None, use_qk_l2norm=True)
        assert calls[-1][1]["cu_seqlens_cpu"] is kw["cu_seqlens_cpu"]  # one host copy per offsets tensor
        xs, xp = _sequential.make_inputs("mamba2", 2, 16, seed=6)
        mamba2_scan(xs["x"], xs["dt"], xp["A"], xs["B"], xs["C"], D=xp["D"], group=None)
        name, kw = calls[-1]
        assert name == "chunk_simple_gla" and kw["cu_seqlens"] is None and kw["scale"] == 1.0
    torch.testing.assert_close(o, gated_delta_rule(*seq.values(), cu_seqlens=cu, group=None, use_qk_l2norm=True),
                               rtol=0, atol=1e-12)  # the torch path gives the same numbers


def _fla_cases(cp: int) -> dict:
    out = {}
    with standin() as calls:
        for kind in FLA_KINDS:
            for layout in LAYOUTS:
                out[kind, layout] = run_case(kind, layout, cp, seed=10 + cp, use_scope=layout == "thd")
            out[kind, "f32"] = run_case(kind, "thd", cp, seed=20, dtype="float32")
            out[kind, "drop"] = run_case(kind, "thd", cp, seed=21, break_mode="drop")
        out["calls"] = [(name, kw["initial_state"] is not None, kw["output_final_state"]) for name, kw in calls]
    return out


@pytest.mark.parametrize("cp", [2, 4])
def test_fla_path_under_cp(cp: int) -> None:
    """The fla path at 2 and 4 gloo ranks equals the float64 reference; a dropped state hand-over fails it."""
    got = run_ranks(cp, _fla_cases, cp)
    for kind in FLA_KINDS:
        for key, tol in (("bshd", TOL64), ("thd", TOL64), ("f32", TOL32)):
            errs = {n: max(r[kind, key][n] for r in got) for n in got[0][kind, key]}
            assert max(errs.values()) < tol, (kind, key, errs)
        assert max(r[kind, "drop"]["out"] for r in got) > 1000 * TOL32, kind
    for r in got:  # one kernel pass per layer; the delta rule from [0 | I] with final states, SSD from zero
        assert {c for c in r["calls"] if c[0] != "chunk_simple_gla"} == {
            ("chunk_gated_delta_rule", True, True), ("chunk_kda", True, True)}
        assert {c for c in r["calls"] if c[0] == "chunk_simple_gla"} == {("chunk_simple_gla", False, True)}


@pytest.mark.parametrize("fla", [False, True], ids=["torch", "fla-standin"])
@pytest.mark.parametrize("kind", FLA_KINDS)
def test_ranks_in_one_process(kind: str, fla: bool) -> None:
    """The one-process harness of the GPU tests (every rank in turn, summaries stacked) equals the reference."""
    for cp, cu in ((2, None), (2, [0, 8, 12, 28]), (4, [0, 16, 24, 56])):
        B, T = (2, 16) if cu is None else (1, cu[-1])
        seq, par = _sequential.make_inputs(kind, B, T, seed=cp)
        if fla:
            with standin() as calls:
                errs = _sequential.errors(kind, seq, par, cu, cp, kernels.FLA, chunk_size=4)
                assert calls
        else:
            errs = _sequential.errors(kind, seq, par, cu, cp, kernels.TORCH, chunk_size=4)
        assert max(errs.values()) < TOL64, (cp, cu, errs)
