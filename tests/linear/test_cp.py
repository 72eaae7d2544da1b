"""cpscope.linear under CP1 / CP2 / CP3 / CP4 (gloo ranks): forward and every gradient equal a float64 sequential
reference on the full sequences, cut per rank, for the gated delta rule (GDN's scalar gate with grouped values, KDA's
per-channel gate), Mamba2's scan and the short convolution, in bshd rows and thd packs of uneven documents (one of
them cut into 1-token chunks at its CP size). Deliberate breaks of the state hand-over fail by orders of magnitude.
"""
from __future__ import annotations

import pytest

from tests.distributed import run_ranks
from tests.linear._cases import KINDS, run_case

TOL64 = 1e-10  # float64 inputs: the chunked / CP path against the float64 per-token loop
TOL32 = 1e-4  # float32 inputs (computed in fp32, summaries in fp32) against the float64 loop
LAYOUTS = ("bshd", "thd")


def _all_cases(cp: int) -> dict:
    """Every (kind, layout) on this rank; thd through the active scope, bshd with an explicit group=."""
    out = {}
    for kind in KINDS:
        for layout in LAYOUTS:
            out[kind, layout, "float64"] = run_case(kind, layout, cp, seed=cp, use_scope=layout == "thd")
        if cp == 2:
            out[kind, "thd", "float32"] = run_case(kind, "thd", cp, seed=7, dtype="float32")
    return out


def _breaks(cp: int) -> dict:
    return {(kind, mode): run_case(kind, "thd", cp, seed=3, break_mode=mode)
            for kind in KINDS for mode in ("drop", "cross")}


def _worst(per_rank: list[dict], key: tuple) -> dict[str, float]:
    return {name: max(r[key][name] for r in per_rank) for name in per_rank[0][key]}


@pytest.fixture(scope="module")
def results() -> dict:
    return {cp: run_ranks(cp, _all_cases, cp) for cp in (2, 4)}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_cp1_equals_reference(kind: str, layout: str) -> None:
    errs = run_case(kind, layout, 1, seed=1)
    assert max(errs.values()) < TOL64, errs
    errs32 = run_case(kind, layout, 1, seed=2, dtype="float32")
    assert max(errs32.values()) < TOL32, errs32


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_cp_equals_reference(results: dict, cp: int, kind: str, layout: str) -> None:
    errs = _worst(results[cp], (kind, layout, "float64"))
    assert max(errs.values()) < TOL64, errs


@pytest.mark.parametrize("kind", KINDS)
def test_cp2_float32_equals_reference(results: dict, kind: str) -> None:
    errs = _worst(results[2], (kind, "thd", "float32"))
    assert max(errs.values()) < TOL32, errs


def test_cp3_equals_reference() -> None:
    got = run_ranks(3, _all_cases, 3)
    for kind in KINDS:
        for layout in LAYOUTS:
            errs = _worst(got, (kind, layout, "float64"))
            assert max(errs.values()) < TOL64, (kind, layout, errs)


def test_deliberate_breaks_fail_by_orders_of_magnitude() -> None:
    """A state not handed from one chunk to the next, or handed across a document boundary, moves the output (and
    the gradients) by far more than the tolerance: the tests above can fail."""
    got = run_ranks(2, _breaks, 2)
    for kind in KINDS:
        for mode in ("drop", "cross"):
            errs = _worst(got, (kind, mode))
            assert errs["out"] > 1000 * TOL32, (kind, mode, errs)  # 1e7 x the float64 tolerance
