"""Sliding windows, attention sinks, softcapping and multi-latent head dims on every variant: rows and gradients
(q, k, v and sinks) equal an independent float64 full-sequence reference cut per rank, on 2 and 4 gloo ranks.

One rank task runs a whole (world size, variant) matrix — layouts x causal/full x MHA/GQA/MQA x {window, sinks,
softcap, MLA, all of them} — so the pool's start-up is paid once. Windows are drawn per case from short ones
(inside one chunk: the halo of one neighbour), ones spanning several chunks, one-sided and, without a causal mask,
right-reaching ones; documents shorter than the window and empty ones occur in ``thd``.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

import cpscope
from cpscope.attention import ContextParallelAttention, context_parallel_attention
from tests.attention._reference import reference_attention, zigzag_index
from tests.distributed import run_ranks

D, DV = 8, 12  # q/k head dim; v head dim of the MLA cases
TOL = 2e-5  # fp32 inputs against the float64 reference
HEADS = [(4, 4), (4, 2), (4, 1)]  # MHA, GQA, MQA
FEATURES = ("window", "sinks", "softcap", "mla", "all")
CAUSAL_WINDOWS = [(3, 0), (6, 0), (1, 0), (9, 0)]
FULL_WINDOWS = [(3, 2), (6, 5), (-1, 3), (2, -1), (0, 9)]


def _cu(lens: list[int]) -> list[int]:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def _lens(seed: int, unit: int) -> list[int]:
    """2-4 documents of 1-4 units (a unit is 2·cp tokens: chunks of 1-4), one of them empty every other seed."""
    rnd = random.Random(seed)
    lens = [unit * rnd.randint(1, 4) for _ in range(rnd.randint(2, 4))]
    if seed % 2:
        lens.insert(1, 0)
    return lens


def features(name: str, causal: bool, seed: int) -> dict[str, Any]:
    """The keywords of one feature case (``dv``: v's head dim; ``sinks``: whether to draw them)."""
    windows = CAUSAL_WINDOWS if causal else FULL_WINDOWS
    every = {"window": windows[seed % len(windows)], "sinks": True, "softcap": 1.5, "dv": DV}
    keys = {"window": ("window",), "sinks": ("sinks",), "softcap": ("softcap",), "mla": ("dv",),
            "all": tuple(every)}[name]
    return {k: every[k] for k in keys}


def _inputs(fmt: str, h: int, h_kv: int, dv: int, seed: int, cu: list[int], seq: int, batch: int, sinks: bool):
    """Full float64 q, k, v, dout ``[b, t, h, d]`` (b = 1 for thd) and sinks ``[h]`` (or None)."""
    g = torch.Generator().manual_seed(seed)
    b, t = (1, cu[-1]) if fmt == "thd" else (batch, seq)
    q = torch.randn(b, t, h, D, generator=g, dtype=torch.float64)
    k = torch.randn(b, t, h_kv, D, generator=g, dtype=torch.float64)
    v = torch.randn(b, t, h_kv, dv, generator=g, dtype=torch.float64)
    dout = torch.randn(b, t, h, dv, generator=g, dtype=torch.float64)
    s = torch.randn(h, generator=g, dtype=torch.float64) if sinks else None
    return q, k, v, dout, s


def _reference(q, k, v, dout, sinks, idx, *, causal, cu, window, softcap):
    """float64 out, dq, dk, dv over the whole sequences, and the sinks' gradient of the rows ``idx`` only."""
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    s = None if sinks is None else sinks.clone().requires_grad_(True)
    out = torch.stack([reference_attention(q[i], k[i], v[i], causal=causal, cu=cu, window=window, sinks=s,
                                           softcap=softcap) for i in range(len(q))])
    own = None
    if s is not None:  # this rank's rows only: what its sinks receive
        (own,) = torch.autograd.grad((out[:, idx] * dout[:, idx]).sum(), s, retain_graph=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad, own


def _to_layout(x: torch.Tensor, fmt: str) -> torch.Tensor:  # canonical [b, t, h, d] -> fmt
    return x[0] if fmt == "thd" else (x.transpose(0, 1) if fmt == "sbhd" else x)


def check(group, comm: Optional[str], fmt: str, causal: bool, h: int, h_kv: int, feats: dict, *, seed: int = 0,
          batch: int = 2, lens: Optional[list[int]] = None, module: bool = False, wrap=None) -> float:
    """One call on this rank against the reference (forward, dq/dk/dv, the sinks' gradient); the worst error.

    ``module``: through :class:`ContextParallelAttention` (window / softcap at construction, sinks per call);
    ``wrap(fn, *tensors)``: runs the call (e.g. inside a checkpoint).
    """
    cp = 1 if group is None else group.size()
    r = 0 if group is None else dist.get_rank(group)
    seq = 8 * cp
    cu = _cu(lens if lens is not None else _lens(seed, 2 * cp)) if fmt == "thd" else [0, seq]
    window, softcap = feats.get("window"), feats.get("softcap")
    q, k, v, dout, sinks = _inputs(fmt, h, h_kv, feats.get("dv", D), seed, cu, seq, batch, feats.get("sinks", False))
    idx = zigzag_index(cu, cp, r)
    ref = _reference(q, k, v, dout, sinks, idx, causal=causal, cu=cu if fmt == "thd" else None, window=window,
                     softcap=softcap)
    loc = [_to_layout(t[:, idx], fmt).float().requires_grad_(True) for t in (q, k, v)]
    sk = None if sinks is None else sinks.float().requires_grad_(True)
    extra = {"cu_seqlens": torch.tensor(cu, dtype=torch.int32)} if fmt == "thd" else {}

    def attend(qq, kk, vv, ss):
        if module:
            attn = ContextParallelAttention(qkv_format=fmt, causal=causal, comm=comm, window=window, softcap=softcap)
            return attn(qq, kk, vv, sinks=ss, **extra)
        return context_parallel_attention(qq, kk, vv, qkv_format=fmt, causal=causal, comm=comm, window=window,
                                          softcap=softcap, sinks=ss, **extra)

    with cpscope.runtime_cp(group):
        out = wrap(attend, *loc, sk) if wrap is not None else attend(*loc, sk)
    out.backward(_to_layout(dout[:, idx], fmt).float())  # outside the scope, as in training
    got = [out, *(t.grad for t in loc)]
    want = [_to_layout(x[:, idx], fmt) for x in ref[:4]]
    if sk is not None:
        got.append(sk.grad)
        want.append(ref[4])
    worst = 0.0
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        assert a is not None and a.shape == b.shape, f"{name}: {None if a is None else a.shape} vs {b.shape}"
        err = (a.double() - b).abs().max().item() if b.numel() else 0.0
        assert err <= TOL * max(1.0, b.abs().max().item()), \
            f"{comm} {name}: max abs err {err:.3g} ({fmt}, causal={causal}, cp={cp}, rank={r}, heads {h}/{h_kv}, " \
            f"{feats}, cu={cu})"
        worst = max(worst, err)
    return worst


# ------------------------------------------------------------------------------------------------ the matrix


def _matrix(world: int, comm: str, formats: tuple[str, ...]) -> int:
    cpscope.set_backward_read_check(True)
    group = cpscope.new_cp_groups([world], hierarchical=True)[world]
    n = 0
    for fmt in formats:
        for causal in (True, False):
            for s, (h, h_kv) in enumerate(HEADS):
                for j, name in enumerate(FEATURES):
                    seed = 100 * s + 10 * j + causal
                    check(group, comm, fmt, causal, h, h_kv, features(name, causal, seed), seed=seed)
                    n += 1
    return n


@pytest.mark.parametrize("world,comm", [(2, "p2p"), (4, "p2p"), (2, "all_gather"), (4, "all_gather"), (2, "a2a"),
                                        (4, "a2a"), (4, "a2a+p2p"), (2, "auto"), (4, "auto")])
def test_features_match_reference(world, comm):
    assert run_ranks(world, _matrix, world, comm, ("bshd", "sbhd", "thd")) == [90] * world


# ------------------------------------------------------------------------------------------------ module, recompute


def _recompute(world: int) -> None:
    """The module (window / softcap at construction, sinks per call) and three recomputes — cpscope.checkpoint,
    torch's checkpoint with ``context_fn=cpscope.scope_context_fn()``, a reentrant checkpoint — with every feature:
    backward runs outside the scope with the backward read check on, so a recompute reading the scope would raise."""
    import torch.utils.checkpoint as tc

    cpscope.set_backward_read_check(True)
    group = cpscope.new_cp_groups([world], hierarchical=True)[world]
    ways = {
        "cpscope": lambda fn, *a: cpscope.checkpoint(fn, *a),
        "torch": lambda fn, *a: tc.checkpoint(fn, *a, use_reentrant=False, context_fn=cpscope.scope_context_fn()),
        "reentrant": lambda fn, *a: cpscope.checkpoint(fn, *a, use_reentrant=True),
    }
    for i, (comm, fmt, causal) in enumerate([("p2p", "thd", True), ("all_gather", "bshd", False), ("a2a", "sbhd", True),
                                             ("p2p", "bshd", False)]):
        feats = features("all", causal, i)
        check(group, comm, fmt, causal, 4, 2, feats, seed=40 + i, module=True)
        for name, way in ways.items():
            check(group, comm, fmt, causal, 4, 1 + i % 2, feats, seed=50 + i, wrap=way)
    # a2a with other GQA ratios: k/v heads replicated to a multiple of the CP size (6/3 at CP2; 12/3, 12/6 at CP4)
    for h, h_kv in ((6, 3),) if world == 2 else ((12, 3), (12, 6)):
        check(group, "a2a", "thd", True, h, h_kv, features("all", True, h_kv), seed=h_kv)


@pytest.mark.parametrize("world", [2, 4])
def test_module_and_recompute_with_features(world):
    run_ranks(world, _recompute, world)


# ------------------------------------------------------------------------------------------------ padding


def _padded(world: int) -> None:
    """Padded layouts (thd: cu_seqlens_padded; bshd: real row lengths) with a window and sinks on every variant
    that masks padding: padding rows are zero, real rows and all gradients equal the reference of the real tokens."""
    cpscope.set_backward_read_check(True)
    group = cpscope.new_cp_groups([world], hierarchical=True)[world]
    r, m = dist.get_rank(group), 2 * world
    comms = ["p2p", "all_gather", "a2a"] + (["a2a+p2p"] if world == 4 else [])
    for i, (comm, causal) in enumerate([(c, True) for c in comms] + [("p2p", False)]):
        for fmt in ("thd", "bshd"):
            real, lay = ([3 * m - 3, 0, m + 1, 2 * m], [3 * m, 0, 2 * m, 2 * m]) if fmt == "thd" else \
                ([4 * m - 5, 4 * m], [4 * m, 4 * m])
            _check_padded(group, comm, fmt, causal, real, lay, features("all", causal, i), seed=60 + i, r=r)


def _check_padded(group, comm, fmt, causal, real, lay, feats, *, seed, r) -> None:
    cp = group.size()
    h, h_kv, dv, window, softcap = 4, 2, feats["dv"], feats["window"], feats["softcap"]
    g = torch.Generator().manual_seed(seed)
    n = sum(real)
    q, dout = torch.randn(n, h, D, generator=g, dtype=torch.float64), torch.randn(n, h, dv, generator=g,
                                                                                   dtype=torch.float64)
    k, v = torch.randn(n, h_kv, D, generator=g, dtype=torch.float64), torch.randn(n, h_kv, dv, generator=g,
                                                                                   dtype=torch.float64)
    sinks = torch.randn(h, generator=g, dtype=torch.float64)
    where = torch.cat([torch.arange(a, a + b) for a, b in zip(_cu(lay)[:-1], real)])  # real tokens in the layout
    idx = zigzag_index(_cu(lay), cp, r)
    of_layout = torch.full((sum(lay),), -1, dtype=torch.long)
    of_layout[where] = torch.arange(n)
    mine = of_layout[idx]  # the real token of each local row, -1 at padding
    ref = _reference(*(t[None] for t in (q, k, v, dout)), sinks, mine[mine >= 0], causal=causal, cu=_cu(real),
                     window=window, softcap=softcap)

    def local(x):  # real tokens -> local rows of the layout (zeros at padding)
        full = x.new_zeros((sum(lay), *x.shape[1:]))
        full[where] = x
        return full[idx]

    loc = [local(t).float().requires_grad_(True) for t in (q, k, v)]
    sk = sinks.float().requires_grad_(True)
    if fmt == "thd":
        kw = {"cu_seqlens": torch.tensor(_cu(real), dtype=torch.int32),
              "cu_seqlens_padded": torch.tensor(_cu(lay), dtype=torch.int32)}
        args = loc
    else:  # rows of global length lay[0], real lengths as cu_seqlens
        kw = {"cu_seqlens": torch.tensor(_cu(real), dtype=torch.int32)}
        args = [t.view(len(lay), -1, *t.shape[1:]) for t in loc]
    with cpscope.runtime_cp(group):
        out = context_parallel_attention(*args, qkv_format=fmt, causal=causal, comm=comm, window=window,
                                         softcap=softcap, sinks=sk, **kw)
    out = out.reshape(-1, *out.shape[2:]) if fmt != "thd" else out
    out.backward(local(dout).float())
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in loc)), ref[:4]):
        exp = torch.zeros_like(got, dtype=torch.float64)
        exp[mine >= 0] = want[0][mine[mine >= 0]]
        err = (got.double() - exp).abs().max().item()
        assert err <= TOL * max(1.0, exp.abs().max().item()), f"{comm} {fmt} padded {name}: {err:.3g}"
    assert (sk.grad.double() - ref[4]).abs().max().item() <= TOL * 10, f"{comm} {fmt} padded dsinks"


@pytest.mark.parametrize("world", [2, 4])
def test_padding_with_features(world):
    run_ranks(world, _padded, world)


# ------------------------------------------------------------------------------------------------ bad input, auto


def _bad_input() -> str:
    """Every bad feature raises a ValueError naming the values on every rank, before any collective: the ranks are
    still in step after them (a last good call)."""
    group = cpscope.new_cp_groups([2], hierarchical=True)[2]
    x = torch.randn(1, 8, 4, D)
    bad = [({"window": (-2, 0)}, r"window=\(-2, 0\).*below -1"), ({"window": (3, -5)}, r"window=\(3, -5\)"),
           ({"window": (3,)}, r"pair \(left, right\).*\(3,\)"), ({"window": (1.5, 0)}, r"ints.*\(1\.5, 0\)"),
           ({"window": "3"}, r"pair.*'3'"), ({"window": (True, 0)}, r"ints.*\(True, 0\)"),
           ({"sinks": torch.zeros(3)}, r"sinks must have shape \[4\].*\(3,\)"),
           ({"sinks": torch.zeros(4, 1)}, r"shape \[4\].*\(4, 1\)"),
           ({"sinks": torch.zeros(4, dtype=torch.int64)}, r"floating point.*torch.int64"),
           ({"sinks": torch.zeros(4, device="meta")}, r"device cpu.*meta"), ({"sinks": [0.0] * 4}, "list"),
           ({"softcap": 0.0}, r"softcap.*> 0.*0\.0"), ({"softcap": -1}, r"softcap.*-1"),
           ({"softcap": float("inf")}, r"softcap.*inf"), ({"softcap": float("nan")}, r"softcap.*nan"),
           ({"softcap": True}, r"softcap.*True")]
    for comm in ("p2p", "all_gather", "a2a"):
        for kw, match in bad:
            with pytest.raises(ValueError, match=match):
                context_parallel_attention(x, x, x, comm=comm, group=group, **kw)
    with pytest.raises(ValueError, match=r"v must have k's heads.*k/v heads 4 vs 2"):
        context_parallel_attention(x, x, x[:, :, :2], group=group)
    with pytest.raises(ValueError, match=r"v must have k's heads and batch and sequence.*\(1, 4, 4, 8\)"):
        context_parallel_attention(x, x, x[:, :4], group=group)
    with pytest.raises(ValueError, match=r"v must have k's heads and tokens.*\(8, 4, 8\) and v \(6, 4, 8\)"):
        context_parallel_attention(x[0], x[0], x[0, :6], qkv_format="thd", cu_seqlens=[0, 16], group=group)
    for kw, match in (({"window": (-3, 0)}, "below -1"), ({"softcap": 0}, "softcap")):
        with pytest.raises(ValueError, match=match):
            ContextParallelAttention(**kw)
    out = context_parallel_attention(x, x, x[..., :6], group=group, window=(3, 0), sinks=torch.zeros(4),
                                     softcap=5.0)
    return str(tuple(out.shape))


def test_bad_features_raise_before_any_collective():
    assert run_ranks(2, _bad_input) == ["(1, 8, 4, 6)"] * 2


def _auto_window() -> None:
    """``comm="auto"`` with a short window picks the halo exchange (p2p) where a2a would run without it; the
    query carries the window."""
    from cpscope.attention import _dispatch as variants
    from tests.attention.test_variants import recording

    cpscope.set_backward_read_check(True)
    group = cpscope.new_cp_groups([4], hierarchical=True)[4]
    queries = []
    old = variants.set_auto_chooser(lambda qr: queries.append(qr) or variants.default_rule(qr))
    try:
        with recording() as seen:
            check(group, "auto", "thd", True, 4, 4, {"window": (1, 0)}, seed=7, lens=[64, 32])
            check(group, "auto", "thd", True, 4, 4, {}, seed=7, lens=[64, 32])
    finally:
        variants.set_auto_chooser(old)
    assert [s.split(".")[0] for s in seen[::2]] == ["p2p", "a2a"], seen
    assert [qr.window for qr in queries] == [(1, 0), None]


def test_auto_knows_windows():
    run_ranks(4, _auto_window)
    from cpscope.attention._dispatch import VariantQuery, default_rule

    q = lambda **kw: VariantQuery(4, 32, 8, 128, "thd", True, (65536,), **kw)  # noqa: E731
    assert default_rule(q()) == "a2a" and default_rule(q(window=(255, 0))) == "p2p"
    assert default_rule(q(window=(60000, 0))) == "a2a"  # the window barely restricts: the halo is most of the ring
    g = VariantQuery(4, 32, 2, 128, "bshd", True, (8192,) * 2, window=(127, 0))
    assert default_rule(g) == "p2p" and default_rule(dataclasses.replace(g, window=None)) == "all_gather"


def test_cost_model_window_term_matches_the_plan():
    """``halo_rows`` (the cost model's closed form, used by the auto rule) equals the plan's largest per-rank
    receipt for unpadded packs; and the cost model prices a window's p2p by it."""
    from cpscope._pack import pack_for
    from cpscope.attention._halo_plan import HaloGeometry
    from cpscope.hybrid._comm_cost import CommCostModel, halo_rows

    for cp, lens, window, causal in ((4, [4096], (256, 0), True), (2, [64, 32, 96], (9, 0), True),
                                     (4, [128, 64], (5, 20), False), (3, [96, 36], (-1, 4), False)):
        cu = _cu(lens)
        got = max(HaloGeometry(pack_for(cu, cp, r), torch.device("cpu"), window if not causal else (window[0], 0),
                               causal).counters()["rows_received"] for r in range(cp))
        assert halo_rows(lens, cp, window, causal) == got, (cp, lens, window)
    coef = {"bfloat16": {v: (1e-14, 1e-12, 1e-10, 1e-5, 1e-4) for v in ("p2p", "all_gather", "a2a")}}
    model = CommCostModel(coef)
    kw = dict(cp=4, heads=32, kv_heads=8, head_dim=128, dtype="bfloat16")
    plain, windowed = (model.time("p2p", [65536], window=w, **kw) for w in (None, (255, 0)))
    assert windowed < plain / 10
    assert model.time("a2a", [65536], window=(255, 0), **kw) > windowed
