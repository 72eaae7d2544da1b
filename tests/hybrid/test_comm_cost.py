"""The per-variant attention cost model, ``comm="auto"`` (choose) and the collective calibration (gloo ranks).

The calibration also runs with ``ring_stand_in`` (every variant runs the ring); the machinery (collective timing,
agreement, cache, fit, choice) is what is tested here.
"""
from __future__ import annotations

import inspect
import json
import os

import numpy as np
import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import cpscope
from cpscope._variants import VARIANTS
from cpscope.hybrid._comm_cost import (
    FEATURES,
    CommCostModel,
    Sample,
    cache_key,
    cache_path,
    default_inner,
    load_cached,
    variant_allowed,
)
from cpscope.hybrid._cheapest_variant import choose, predict
from cpscope.train._auto import cached_cost
from tests.distributed import run_ranks

TRUE = {  # a plausible machine: per-feature coefficients of each variant
    "local": (2.0e-14, 3.0e-12, 0.0, 0.0, 2.0e-4),
    "p2p": (2.2e-14, 3.5e-12, 4.0e-13, 1.5e-4, 2.0e-4),
    "all_gather": (2.1e-14, 3.0e-12, 9.0e-13, 1.0e-4, 3.0e-4),
    "a2a": (2.0e-14, 4.0e-12, 1.5e-12, 5.0e-5, 4.0e-4),
}
SHAPES = [(32, 32), (32, 8), (32, 4)]  # (heads, kv_heads)


def synthetic_samples(noise: float = 0.0, seed: int = 0) -> list[Sample]:
    """Samples of TRUE at cp 1, 2, 4, 8 over sizes, document splits and k/v heads."""
    model = CommCostModel({"bfloat16": TRUE})
    rng = np.random.default_rng(seed)
    out = []
    for cp in (1, 2, 4, 8):
        for heads, kv in SHAPES:
            for tokens in (8192, 32768, 131072):
                for docs in (1, 8):
                    lengths = tuple([tokens // docs] * docs)
                    for v in (["local"] if cp == 1 else ["p2p", "all_gather", "a2a"]):
                        if v == "a2a" and not variant_allowed(v, cp, heads, kv):
                            continue
                        t = model.time("p2p" if v == "local" else v, lengths, cp=cp, heads=heads, kv_heads=kv,
                                       head_dim=128, dtype="bfloat16")
                        t *= 1.0 + noise * rng.standard_normal()
                        out.append(Sample(v, "bfloat16", cp, lengths, heads, kv, 128, True, None, t))
    return out


# -- the model -------------------------------------------------------------------------------------------------
def test_fit_recovers_every_variant_exactly_from_noiseless_samples() -> None:
    est = CommCostModel.fit(synthetic_samples())
    assert est.variants("bfloat16") == ("p2p", "all_gather", "a2a") and est.dtypes() == ("bfloat16",)
    for v, coef in TRUE.items():
        np.testing.assert_allclose(est.coefficients["bfloat16"][v], coef, rtol=1e-6, atol=1e-20)
    assert max(abs(r) for _, r in est.residuals()) < 1e-8


def test_fit_with_noise_predicts_within_a_few_percent() -> None:
    est = CommCostModel.fit(synthetic_samples(noise=0.02, seed=1))
    exact = CommCostModel({"bfloat16": TRUE})
    for v in ("p2p", "all_gather", "a2a"):
        for lengths in ([65536], [4096] * 16):
            kw = dict(cp=4, heads=32, kv_heads=8, head_dim=128, dtype="bfloat16")
            assert est.time(v, lengths, **kw) == pytest.approx(exact.time(v, lengths, **kw), rel=0.05)


def test_formula_by_hand() -> None:
    c = (1e-14, 2e-12, 3e-13, 4e-5, 5e-4)
    m = CommCostModel({"float32": {"p2p": c, "a2a": c, "all_gather": c}})
    lp, h, g, d, e, cp = 4096.0, 16, 4, 64, 4, 4
    base = c[0] * 0.5 * lp * lp * h * d / cp + c[1] * lp * h * d / cp + c[4]
    kw = dict(cp=cp, heads=h, kv_heads=g, head_dim=d, dtype="float32")
    assert m.time("p2p", [4096], **kw) == pytest.approx(base + c[2] * 2 * g * d * e * lp * 3 / 4 + c[3] * 3)
    assert m.time("all_gather", [4096], **kw) == pytest.approx(base + c[2] * 2 * g * d * e * lp * 3 / 4 + c[3] * 3)
    assert m.time("a2a", [4096], **kw) == pytest.approx(base + c[2] * 2 * (h + 4) * d * e * lp * 3 / 16 + c[3] * 3)
    assert m.time("p2p", [4093], **kw) == pytest.approx(m.time("p2p", [4096], **kw))  # 4093 → 4096
    full = m.time("p2p", [4096], causal=False, **kw)
    assert full - m.time("p2p", [4096], **kw) == pytest.approx(c[0] * 0.5 * lp * lp * h * d / cp)


def test_json_roundtrip_and_cache_files(tmp_path) -> None:
    key = cache_key(device="NVIDIA H200", world_size=8, cp_sizes=[8, 1, 2, 4], torch_version="2.6.0+cu124",
                    cpscope_version="0.1.0")
    model = CommCostModel.fit(synthetic_samples(), meta={**key, "inner": None})
    path = model.save(cache_path(key, tmp_path))
    assert path.name == "comm_cost-NVIDIA_H200-w8-cp1_2_4_8-torch2.6.0_cu124-cpscope0.1.0.json"
    back = load_cached(key, tmp_path)
    assert back is not None and back.to_json() == model.to_json() and back.samples == model.samples
    assert load_cached({**key, "world_size": 4}, tmp_path) is None  # another key: no file, no reuse
    path.rename(cache_path({**key, "world_size": 4}, tmp_path))
    with pytest.raises(ValueError, match="holds a calibration for"):
        load_cached({**key, "world_size": 4}, tmp_path)  # a file whose contents are for another job
    with pytest.raises(ValueError, match="format"):
        CommCostModel.from_json({"format": 99})
    # the runtime lookup: by device / world / versions, the file whose CP sizes include the one asked
    model.save(cache_path(key, tmp_path))
    found = cached_cost(device="NVIDIA H200", world_size=8, cp=4, torch_version="2.6.0+cu124",
                        cpscope_version="0.1.0", directory=str(tmp_path))
    assert found is not None and found.to_json() == model.to_json()
    assert cached_cost(device="NVIDIA H200", world_size=8, cp=16, torch_version="2.6.0+cu124",
                       cpscope_version="0.1.0", directory=str(tmp_path)) is None
    assert cached_cost(device="NVIDIA H100", world_size=8, torch_version="2.6.0+cu124", cpscope_version="0.1.0",
                       directory=str(tmp_path)) is None


def test_cache_dir_override(tmp_path, monkeypatch) -> None:
    from cpscope.hybrid._comm_cost import cache_dir

    monkeypatch.setenv("CPSCOPE_CACHE_DIR", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "x"
    monkeypatch.delenv("CPSCOPE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "cpscope"


def test_bad_models_and_queries() -> None:
    with pytest.raises(ValueError, match="finite numbers"):
        CommCostModel({"bfloat16": {"p2p": (1.0, -1.0, 0, 0, 0)}})
    with pytest.raises(ValueError, match="unknown communication variant 'ring'"):
        CommCostModel({"bfloat16": {"ring": (0, 0, 0, 0, 0)}})
    with pytest.raises(ValueError, match="int8"):
        CommCostModel({"int8": {"p2p": (0, 0, 0, 0, 0)}})
    m = CommCostModel({"bfloat16": TRUE})
    kw = dict(cp=4, heads=32, kv_heads=8, head_dim=128)
    with pytest.raises(ValueError, match="no fit for dtype 'float32'"):
        m.time("p2p", [1024], dtype="float32", **kw)
    with pytest.raises(ValueError, match="no fit for variant 'a2a\\+p2p'"):
        m.time("a2a+p2p", [1024], dtype="bfloat16", inner=2, **kw)
    with pytest.raises(ValueError, match="cannot run at cp=4 with heads=6"):
        m.time("a2a", [1024], cp=4, heads=6, kv_heads=6, head_dim=64, dtype="bfloat16")
    with pytest.raises(ValueError, match=r"heads \(32\) must be a multiple of kv_heads \(5\)"):
        m.time("p2p", [1024], cp=4, heads=32, kv_heads=5, head_dim=128, dtype="bfloat16")
    with pytest.raises(ValueError, match="> 0"):
        m.time("p2p", [1024, 0], dtype="bfloat16", **kw)
    with pytest.raises(ValueError, match="no samples"):
        CommCostModel.fit([])
    with pytest.raises(ValueError, match="finite and > 0"):
        CommCostModel.fit([Sample("p2p", "bfloat16", 2, (64,), 4, 4, 8, True, None, 0.0)])


def test_variant_rules() -> None:
    assert variant_allowed("p2p", 8, 3, 1) and variant_allowed("all_gather", 16, 12, 4)
    assert variant_allowed("a2a", 8, 32, 8) and not variant_allowed("a2a", 16, 32, 8)  # k/v heads must split too
    assert not variant_allowed("a2a", 8, 12, 4)  # 12 query heads do not split over 8 ranks
    assert not variant_allowed("a2a", 4, 24, 6)  # 6 k/v heads do not split over 4
    assert variant_allowed("a2a", 1, 7, 7)  # CP1: nothing to split
    assert variant_allowed("a2a+p2p", 8, 32, 8) and default_inner(8, 32, 8) == 4  # the default sub-group size
    assert not variant_allowed("a2a+p2p", 4, 16, 1) and default_inner(4, 16, 1) is None  # MQA: nothing to split
    assert not variant_allowed("a2a+p2p", 2, 32, 8)  # no proper sub-group
    assert variant_allowed("a2a+p2p", 8, 32, 8, inner=2) and not variant_allowed("a2a+p2p", 8, 32, 8, inner=8)
    with pytest.raises(ValueError, match="unknown communication variant 'ulysses'"):
        variant_allowed("ulysses", 2, 8, 8)


# -- comm="auto": choose ------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    cp=st.sampled_from([1, 2, 4, 8, 16]),
    heads_kv=st.sampled_from([(32, 32), (32, 8), (32, 1), (12, 4), (48, 6), (8, 8)]),
    lengths=st.lists(st.integers(min_value=1, max_value=200_000), min_size=1, max_size=12),
    causal=st.booleans(),
    dtype=st.sampled_from(["bfloat16", "float16"]),
)
def test_choose_is_the_argmin_over_allowed_variants(cp, heads_kv, lengths, causal, dtype) -> None:
    heads, kv = heads_kv
    model = CommCostModel({"bfloat16": TRUE, "float16": {k: tuple(2 * x for x in c) for k, c in TRUE.items()}})
    kw = dict(cp=cp, heads=heads, kv_heads=kv, head_dim=128, dtype=dtype, causal=causal)
    got = choose(model, lengths, **kw)
    if cp == 1:
        assert got == "p2p"
        return
    allowed = [v for v in ("p2p", "all_gather", "a2a") if variant_allowed(v, cp, heads, kv)]
    times = {v: model.time(v, lengths, **kw) for v in allowed}
    assert got in allowed and times[got] == min(times.values())
    assert predict(model, lengths, **kw) == pytest.approx(times)
    if got == "a2a":
        assert heads % cp == 0
    assert choose(model, lengths, candidates=("p2p",), **kw) == "p2p"


def test_choose_differs_by_microbatch() -> None:
    model = CommCostModel({"bfloat16": TRUE})
    kw = dict(heads=32, kv_heads=8, head_dim=128, dtype="bfloat16")
    picks = {choose(model, lengths, cp=cp, **kw) for cp in (2, 8) for lengths in ([524288], [2048] * 8)}
    assert len(picks) >= 2  # different microbatches get different variants under one model
    assert choose(model, [2048] * 8, cp=8, heads=12, kv_heads=4, head_dim=128, dtype="bfloat16") != "a2a"


def test_choose_ties_go_to_the_ring_and_errors_name_values() -> None:
    same = (1e-14, 1e-12, 1e-13, 1e-4, 1e-4)
    tie = CommCostModel({"bfloat16": {"p2p": same, "all_gather": same}})
    assert choose(tie, [4096], cp=2, heads=8, kv_heads=8, head_dim=64, dtype="bfloat16") == "p2p"
    only_a2a = CommCostModel({"bfloat16": {"a2a": same}})
    with pytest.raises(ValueError, match=r"no communication variant is both fitted .*'a2a'.* cp=8, heads=12"):
        choose(only_a2a, [4096], cp=8, heads=12, kv_heads=4, head_dim=64, dtype="bfloat16")
    with pytest.raises(ValueError, match="unknown communication variant .ring."):
        choose(tie, [4096], cp=2, heads=8, kv_heads=8, head_dim=64, dtype="bfloat16", candidates=("ring",))
    with pytest.raises(ValueError, match="no fit for dtype 'float32'"):
        choose(tie, [4096], cp=2, heads=8, kv_heads=8, head_dim=64, dtype="float32")


# -- calibration: collective, on gloo ranks --------------------------------------------------------------------
SMALL = dict(heads=4, kv_heads=(4, 2), head_dim=8, tokens=(32, 64), docs=(1, 2), warmup=1, repeats=2,
             progress=False)


def _calibrate_with_stand_in(directory: str) -> str:
    from cpscope.train._calibrate import calibrate
    from tests._stand_in import ring_stand_in

    groups = cpscope.new_cp_groups([1, 2])
    model = calibrate(groups, attention=ring_stand_in, directory=directory, **SMALL)
    assert model.meta["stand_in"] is True and model.meta["world_size"] == dist.get_world_size()
    return json.dumps(model.to_json(), sort_keys=True)


def test_calibration_on_gloo_ranks_agrees_and_is_cached(tmp_path) -> None:
    out = run_ranks(2, _calibrate_with_stand_in, str(tmp_path))
    assert out[0] == out[1]  # every rank fitted the same model from the same (max-reduced) timings
    files = os.listdir(tmp_path)
    assert len(files) == 1 and files[0].startswith("comm_cost-cpu-") and "-w2-cp1_2-" in files[0]
    model = CommCostModel.load(tmp_path / files[0])  # loadable here, in a process without a process group
    assert json.dumps(model.to_json(), sort_keys=True) == out[0]
    assert model.variants("float32") == ("p2p", "all_gather", "a2a")  # a2a: 4 heads split over 2 ranks
    cps = {s.cp for s in model.samples}
    assert cps == {1, 2} and {s.variant for s in model.samples if s.cp == 1} == {"local"}
    assert len(model.samples) == 8 + 8 * 3  # cp1: 2 kv × 2 sizes × 2 splits; cp2: the same × 3 variants
    assert all(s.seconds > 0 and sum(s.lengths) % 4 == 0 for s in model.samples)
    for s in model.samples:
        assert all(length % 4 == 0 for length in s.lengths)  # multiples of 2 · max cp
    assert all(np.isfinite(c).all() for per in model.coefficients.values() for c in per.values())
    assert len(FEATURES) == 5
    got = choose(model, [64], cp=2, heads=4, kv_heads=2, head_dim=8, dtype="float32")
    assert got in VARIANTS


def _calibrate_default() -> str:
    from cpscope.train._calibrate import calibrate

    groups = cpscope.new_cp_groups([1, 2])
    try:
        calibrate(groups, cache=False, **SMALL)
    except RuntimeError as err:
        return str(err)
    return "ran"


def test_calibration_needs_comm_keyword_or_a_stand_in() -> None:
    has_comm = "comm" in inspect.signature(cpscope.context_parallel_attention).parameters
    out = run_ranks(2, _calibrate_default)
    if has_comm:  # the attention takes comm=: the real calibration runs
        assert out == ["ran", "ran"]
    else:
        assert all("takes no comm=" in o and "stand-in" in o for o in out)


def _calibrate_bad_args() -> bool:
    from cpscope.train._calibrate import calibrate
    from tests._stand_in import ring_stand_in

    groups = cpscope.new_cp_groups([1, 2])
    for kwargs, match in (({"variants": ("ring",)}, "variants must be"), ({"kv_heads": (3,)}, "multiple of"),
                          ({"repeats": 0}, "repeats"), ({"tokens": ()}, "tokens")):
        with pytest.raises(ValueError, match=match):
            calibrate(groups, attention=ring_stand_in, cache=False, **{**SMALL, **kwargs})
    return True


def test_calibration_bad_arguments_raise_before_any_collective() -> None:
    assert run_ranks(2, _calibrate_bad_args) == [True, True]


def test_calibration_outside_a_process_group_raises() -> None:
    from cpscope.train._calibrate import calibrate

    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(ValueError, match="collective"):
        calibrate()


def test_split_lengths() -> None:
    from cpscope.train._calibrate import _split_lengths

    assert _split_lengths(64, 2, 4) == (32, 32)
    assert _split_lengths(70, 3, 8) == (24, 24, 24)
    assert _split_lengths(8, 4, 4) == (4, 4, 4, 4)  # at least one step per document


# -- the hook for cpscope.attention's comm="auto" ----------------------------------------------------------
class Query:  # the fields of cpscope.attention._dispatch.VariantQuery that the chooser reads
    def __init__(self, cp, heads, kv_heads, head_dim=128, causal=True, seq_lens=(), dtype="bfloat16"):
        self.cp, self.heads, self.kv_heads, self.head_dim = cp, heads, kv_heads, head_dim
        self.causal, self.seq_lens, self.dtype = causal, seq_lens, dtype


def test_auto_chooser_answers_like_choose_and_falls_back() -> None:
    from cpscope.train._auto import auto_chooser

    hier = {**TRUE, "a2a+p2p": (2.0e-14, 3.0e-12, 1.0e-13, 1.0e-6, 1.0e-6)}  # cheap: wins where it may run
    model = CommCostModel({"bfloat16": hier})
    pick = auto_chooser(model)
    assert pick(Query(1, 32, 8, seq_lens=(4096,))) == "p2p"
    assert pick(Query(8, 32, 8, seq_lens=(65536,))) == "a2a+p2p:4"  # named with the default sub-group size
    assert auto_chooser(model, inner=2)(Query(8, 32, 8, seq_lens=(65536,))) == "a2a+p2p:2"
    q = Query(2, 32, 8, seq_lens=(2048,) * 8)
    assert pick(q) == choose(model, q.seq_lens, cp=2, heads=32, kv_heads=8, head_dim=128, dtype="bfloat16")
    assert pick(Query(4, 32, 8, seq_lens=())) == "p2p"  # nothing to price: the fallback
    assert auto_chooser(model, fallback=lambda _: "all_gather")(Query(4, 32, 8, dtype="float32",
                                                                      seq_lens=(64,))) == "all_gather"
    import torch

    assert pick(Query(2, 32, 8, seq_lens=(2048,) * 8, dtype=torch.bfloat16)) == pick(q)  # torch dtypes too


def test_auto_chooser_plugs_into_the_attention_dispatch_when_present() -> None:
    dispatch = pytest.importorskip("cpscope.attention._dispatch")
    from cpscope.train._auto import auto_chooser

    if not hasattr(dispatch, "VariantQuery"):
        pytest.skip("no VariantQuery in this cpscope.attention")
    import torch

    model = CommCostModel({"bfloat16": TRUE})
    query = dispatch.VariantQuery(cp=4, heads=32, kv_heads=8, head_dim=128, qkv_format="thd", causal=True,
                                  seq_lens=(8192, 4096), dtype=torch.bfloat16)
    previous = dispatch.set_auto_chooser(auto_chooser(model))
    try:
        assert dispatch.choose_variant(query) == choose(model, [8192, 4096], cp=4, heads=32, kv_heads=8,
                                                        head_dim=128, dtype="bfloat16")
    finally:
        dispatch.set_auto_chooser(previous)


def test_use_calibration_installs_the_chooser_or_names_what_is_missing(tmp_path) -> None:
    import torch

    from cpscope.attention import _dispatch as dispatch
    from cpscope.train._auto import use_calibration

    with pytest.raises(ValueError, match=r"no calibrated communication cost model cached for 'cpu-.*world size 1"):
        use_calibration(directory=str(tmp_path))  # nothing cached there
    model = CommCostModel({"bfloat16": TRUE})
    query = dispatch.VariantQuery(cp=4, heads=32, kv_heads=8, head_dim=128, qkv_format="thd", causal=True,
                                  seq_lens=(1024,) * 8, dtype=torch.bfloat16)
    want = choose(model, [1024] * 8, cp=4, heads=32, kv_heads=8, head_dim=128, dtype="bfloat16")
    previous = dispatch.set_auto_chooser(None)
    try:
        assert use_calibration(model) is model and dispatch.choose_variant(query) == want
    finally:
        dispatch.set_auto_chooser(previous)


def _load_or_calibrate_twice(directory: str) -> bool:
    from cpscope.train._calibrate import load_or_calibrate
    from tests._stand_in import ring_stand_in

    groups = cpscope.new_cp_groups([1, 2])
    tiny = {**SMALL, "kv_heads": (4,), "tokens": (32,), "docs": (1,)}
    first = load_or_calibrate(groups, directory=directory, attention=ring_stand_in, **tiny)

    def never(*args, **kwargs):
        raise AssertionError("calibrated although every rank has the cached model")

    again = load_or_calibrate(groups, directory=directory, attention=never, **tiny)
    assert json.dumps(again.to_json(), sort_keys=True) == json.dumps(first.to_json(), sort_keys=True)
    assert {s.variant for s in first.samples} == {"local", "p2p", "all_gather", "a2a"}
    return True


def test_load_or_calibrate_reuses_the_cache_on_every_rank(tmp_path) -> None:
    assert run_ranks(2, _load_or_calibrate_twice, str(tmp_path)) == [True, True]


# -- any CP size: the cost model's rules are the attention's rules ---------------------------------------------
@pytest.mark.parametrize("cp", [3, 5, 6, 9, 10, 12, 24])
@pytest.mark.parametrize("heads_kv", [(12, 12), (12, 4), (30, 10), (24, 6), (18, 3), (36, 12), (8, 8)])
def test_variant_rules_match_the_attention_at_any_cp_size(cp: int, heads_kv: tuple[int, int]) -> None:
    from cpscope.attention._hierarchical import check_inner_size, default_inner_size
    from cpscope.attention._ulysses import check_heads

    h, g = heads_kv
    assert default_inner(cp, h, g) == default_inner_size(cp, h, g)
    try:
        check_heads(h, g, cp, variant="a2a", cp=cp)
        a2a_runs = True
    except ValueError:
        a2a_runs = False
    assert variant_allowed("a2a", cp, h, g) == a2a_runs
    try:
        check_inner_size(None, cp, h, g)
        hier_runs = True
    except ValueError:
        hier_runs = False
    assert variant_allowed("a2a+p2p", cp, h, g) == hier_runs
    for inner in range(1, cp + 1):  # an explicit inner size: allowed exactly where the dispatch takes it
        try:
            check_inner_size(inner, cp, h, g)
            runs = True
        except ValueError:
            runs = False
        assert variant_allowed("a2a+p2p", cp, h, g, inner=inner) == runs, inner


def test_formula_at_non_power_of_two_sizes() -> None:
    c = (1e-14, 2e-12, 3e-13, 4e-5, 5e-4)
    m = CommCostModel({"float32": {"p2p": c, "a2a": c, "all_gather": c, "a2a+p2p": c}})
    h, g, d, e = 12, 6, 64, 4
    for cp, inner in ((3, None), (6, 3), (6, 2), (12, 6), (12, 3)):
        lp = 4096.0 + (-4096) % (2 * cp)  # padded to 2·cp: 4098 at CP3, 4104 at CP6, 4104 at CP12
        assert lp % (2 * cp) == 0
        kw = dict(cp=cp, heads=h, kv_heads=g, head_dim=d, dtype="float32")
        base = c[0] * 0.5 * lp * lp * h * d / cp + c[1] * lp * h * d / cp + c[4]
        ring = base + c[2] * 2 * g * d * e * lp * (cp - 1) / cp + c[3] * (cp - 1)
        assert m.time("p2p", [4096], **kw) == pytest.approx(ring)
        if inner is None:
            assert m.time("a2a", [4096], **kw) == pytest.approx(
                base + c[2] * 2 * (h + g) * d * e * lp * (cp - 1) / cp**2 + c[3] * (cp - 1))
            continue
        a, r = inner, cp // inner
        hier = (base + c[2] * (2 * (h + g) * d * e * lp * (a - 1) / (a * cp) + 2 * (g / a) * d * e * lp * (r - 1) / r)
                + c[3] * ((a - 1) + (r - 1)))
        assert m.time("a2a+p2p", [4096], inner=inner, **kw) == pytest.approx(hier)


def test_choose_prices_the_window_at_any_cp_size() -> None:
    """A window reaches the cost model (fewer pairs; the ring receives only halos): at CP3 a 256-token window on
    64k tokens turns Ulysses' win into the ring's, and the chooser passes the query's window through."""
    from cpscope.train._auto import auto_chooser

    model = CommCostModel({"bfloat16": TRUE})
    kw = dict(cp=3, heads=12, kv_heads=12, head_dim=128, dtype="bfloat16")
    times = predict(model, [65536], window=(256, 0), **kw)
    assert times == {v: model.time(v, [65536], window=(256, 0), **kw) for v in times}
    assert choose(model, [65536], **kw) == "a2a" and choose(model, [65536], window=(256, 0), **kw) == "p2p"
    q = Query(3, 12, 12, seq_lens=(65536,))
    assert auto_chooser(model)(q) == "a2a"
    q.window = (256, 0)
    assert auto_chooser(model)(q) == "p2p"
