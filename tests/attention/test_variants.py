"""Communication variants (all_gather, a2a, a2a+p2p) and their selection: every variant's rows and gradients equal a
float64 full-sequence reference cut per rank, on 2 and 4 gloo ranks; the variant rides with the scope into backward
and recompute; bad choices raise before any collective."""
from __future__ import annotations

import contextlib
import random

import pytest
import torch
import torch.distributed as dist

import cpscope
from cpscope.attention import ContextParallelAttention, context_parallel_attention
from cpscope.attention import _dispatch
from tests.attention._reference import zigzag_index
from tests.attention._virtual import check_virtual
from tests.attention.test_ring_cpu import _case, _cu, _reference, _to_layout
from tests.distributed import run_ranks

D = 8
TOL = {torch.float32: 2e-5, torch.float64: 1e-10}
# (q heads, k/v heads, dense batch rows): MHA one row (all_gather's dense kernels), GQA two rows (its varlen route),
# MQA; a2a / a2a+p2p take the head counts that divide by their all-to-all size
HEADS = {"all_gather": [(4, 4, 1), (8, 2, 2), (4, 1, 1)], "a2a": [(4, 4, 1), (8, 4, 2)],
         "a2a+p2p": [(4, 4, 1), (4, 2, 2)]}


def _docs(seed: int, unit: int) -> list[int]:
    """2-4 documents (one of them empty, sometimes) or, every third seed, one document."""
    rnd = random.Random(seed)
    if seed % 3 == 2:
        return [unit * rnd.randint(2, 4)]
    lens = [unit * rnd.randint(1, 4) for _ in range(rnd.randint(2, 4))]
    if seed % 3 == 1:
        lens.insert(1, 0)
    return lens


def check(group, comm, fmt: str, causal: bool, h: int, h_kv: int, *, batch: int = 1, seed: int = 0,
          dtype=torch.float32, scale=None, how: str = "arg", module=None, lens=None, ckpt: bool = False) -> float:
    """One call on this rank, asserted against the reference; returns the worst abs error.

    ``how``: ``"arg"`` (``comm=`` given, group bound by a plain scope), ``"scope"`` (``runtime_cp(group,
    comm=comm)``, attention called with ``comm=None``), ``"module"`` (``module`` under a plain scope). ``ckpt``: the
    call runs inside :func:`cpscope.checkpoint`.
    """
    cp = 1 if group is None else group.size()
    r = 0 if group is None else dist.get_rank(group)
    seq = 8 * cp
    cu = _cu(lens if lens is not None else _docs(seed, 2 * cp)) if fmt == "thd" else [0, seq]
    q, k, v, dout = _case(fmt, h, h_kv, seed, cu, seq, batch)
    ref = _reference(q, k, v, dout, causal, cu if fmt == "thd" else None, scale)
    idx = zigzag_index(cu, cp, r)
    loc = [_to_layout(t[:, idx], fmt).to(dtype).requires_grad_(True) for t in (q, k, v)]
    kw = dict(qkv_format=fmt, causal=causal, softmax_scale=scale)
    if fmt == "thd":
        kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)

    def attend(*qkv):
        if how == "module":
            return module(*qkv, **({"cu_seqlens": kw["cu_seqlens"]} if fmt == "thd" else {}))
        return context_parallel_attention(*qkv, **kw, comm=comm if how == "arg" else None)

    with cpscope.runtime_cp(group, comm=comm if how == "scope" else None):
        out = cpscope.checkpoint(attend, *loc) if ckpt else attend(*loc)
    assert out.shape == loc[0].shape and out.dtype == dtype
    out.backward(_to_layout(dout[:, idx], fmt).to(dtype))  # outside the scope, as in training
    tol, worst = TOL[dtype], 0.0
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in loc)), ref):
        want = _to_layout(want[:, idx], fmt)
        err = (got.double() - want).abs().max().item() if want.numel() else 0.0
        assert err <= tol, f"{comm} {name}: max abs err {err:.3g} > {tol} ({fmt}, causal={causal}, cp={cp}, " \
                           f"rank={r}, heads {h}/{h_kv}, batch {batch}, cu={cu})"
        worst = max(worst, err)
    return worst


@contextlib.contextmanager
def recording():
    """Record which variant's forward / backward functions run (``"a2a.forward"``, ...), on this rank.

    Windowed calls run the halo functions: ``"p2p"`` or ``"all_gather"`` by their exchange (inside the
    hierarchical variant, called without one, they are its middle: not recorded)."""
    from cpscope.attention import _allgather as allgather, _halo as halo, _ring as ring, _ulysses as ulysses

    def by_exchange(n):
        return lambda a: None if len(a) < n else {"p2p": "p2p", "gather": "all_gather"}[a[n - 1]]

    seen: list[str] = []
    wrapped = [(allgather, "forward", lambda a: "all_gather"), (allgather, "backward", lambda a: "all_gather"),
               (ulysses, "forward", lambda a: "a2a" if a[5] is None else "a2a+p2p"),
               (ulysses, "backward", lambda a: "a2a" if a[4] is None else "a2a+p2p"),
               (ring, "ring_forward", lambda a: "p2p"), (ring, "ring_backward", lambda a: "p2p"),
               (halo, "halo_forward", by_exchange(7)), (halo, "halo_backward", by_exchange(9))]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in wrapped]
    for (mod, name, tag), (_, _, orig) in zip(wrapped, saved):
        def wrapper(*a, _orig=orig, _tag=tag, _what=name.rsplit("_", 1)[-1], **kw):
            if _tag(a) is not None:
                seen.append(f"{_tag(a)}.{_what}")
            return _orig(*a, **kw)

        setattr(mod, name, wrapper)
    try:
        yield seen
    finally:
        for mod, name, orig in saved:
            setattr(mod, name, orig)


# ------------------------------------------------------------------------------------------------ the matrix


def _matrix(world: int, comm: str, fmt: str) -> float:
    cpscope.set_backward_read_check(True)
    group = cpscope.new_cp_groups([world], hierarchical=True)[world]
    worst = 0.0
    with recording() as seen:
        for s, (h, h_kv, batch) in enumerate(HEADS[comm]):
            for causal in (True, False):
                worst = max(worst, check(group, comm, fmt, causal, h, h_kv, batch=batch, seed=3 * s + causal))
    assert seen == [f"{comm}.forward", f"{comm}.backward"] * (2 * len(HEADS[comm])), seen  # no other variant ran
    return worst


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("world,comm", [(2, "all_gather"), (4, "all_gather"), (2, "a2a"), (4, "a2a"),
                                        (4, "a2a+p2p")])
def test_variant_matches_reference(world, comm, fmt):
    assert max(run_ranks(world, _matrix, world, comm, fmt)) <= TOL[torch.float32]


def _float64() -> None:
    group = cpscope.new_cp_groups([2], hierarchical=True)[2]
    for comm in ("all_gather", "a2a"):
        for fmt, causal in (("bshd", True), ("thd", False), ("thd", True)):
            check(group, comm, fmt, causal, 4, 2, batch=2, seed=5, dtype=torch.float64, scale=0.3)


def test_float64_inputs_and_custom_scale():
    run_ranks(2, _float64)


@pytest.mark.parametrize("comm", ["all_gather", "a2a"])
def test_virtual_cp8_threads(comm):
    """cp=8 on 8 virtual ranks (threads, one process): the harness the one-GPU check runs, here against float64."""
    for fmt, causal, heads, batch in (("thd", True, (8, 8), 1), ("bshd", False, (16, 8), 2), ("bshd", True, (8, 8), 1)):
        check_virtual(comm, 8, fmt, causal=causal, heads=heads, lens=[16, 0, 48, 32], seq=32, batch=batch)


# ------------------------------------------------------------------------------------------------ selection


def _mixed() -> None:
    """CP2 a2a, CP4 all_gather, CP1, CP4 a2a+p2p: forwards first, backwards after, outside every scope."""
    cpscope.set_backward_read_check(True)
    groups = cpscope.new_cp_groups([1, 2, 4], hierarchical=True)
    steps = [(2, "a2a", "thd"), (4, "all_gather", "bshd"), (1, "a2a", "thd"), (4, "a2a+p2p", "sbhd")]
    pending = []
    with recording() as seen:
        for seed, (cp, comm, fmt) in enumerate(steps):
            group = groups[cp]
            r = 0 if group is None else dist.get_rank(group)
            cu = _cu(_docs(seed, 2 * cp)) if fmt == "thd" else [0, 8 * cp]
            q, k, v, dout = _case(fmt, 4, 2, 40 + seed, cu, 8 * cp, 1)
            ref = _reference(q, k, v, dout, True, cu if fmt == "thd" else None, None)
            idx = zigzag_index(cu, cp, r)
            loc = [_to_layout(t[:, idx], fmt).float().requires_grad_(True) for t in (q, k, v)]
            extra = {"cu_seqlens": torch.tensor(cu, dtype=torch.int32)} if fmt == "thd" else {}
            with cpscope.runtime_cp(group, comm=comm):
                out = context_parallel_attention(*loc, qkv_format=fmt, **extra)
            pending.append((out, loc, dout, ref, idx, fmt))
        assert seen == ["a2a.forward", "all_gather.forward", "p2p.forward", "a2a+p2p.forward"], seen
        for out, loc, dout, ref, idx, fmt in reversed(pending):
            out.backward(_to_layout(dout[:, idx], fmt).float())
            for got, want in zip((out, *(t.grad for t in loc)), ref):
                torch.testing.assert_close(got.double(), _to_layout(want[:, idx], fmt), atol=2e-5, rtol=0)
        assert seen[4:] == ["a2a+p2p.backward", "p2p.backward", "all_gather.backward", "a2a.backward"], seen


def test_mixed_variants_across_microbatches():
    run_ranks(4, _mixed)


def _recompute() -> None:
    """cpscope.checkpoint: the recompute (in backward, outside every scope) runs the forward's variant."""
    cpscope.set_backward_read_check(True)
    groups = cpscope.new_cp_groups([2, 4], hierarchical=True)
    for cp, comm, how, fmt in ((2, "a2a", "scope", "thd"), (4, "all_gather", "scope", "bshd"),
                               (4, "a2a+p2p", "arg", "thd")):
        with recording() as seen:
            check(groups[cp], comm, fmt, True, 4, 2, seed=11, how=how, ckpt=True)
        assert seen == [f"{comm}.forward", f"{comm}.forward", f"{comm}.backward"], seen  # forward, recompute, backward
    attn = ContextParallelAttention(qkv_format="sbhd", causal=False, comm="all_gather")
    with recording() as seen:
        check(groups[2], None, "sbhd", False, 4, 1, seed=12, how="module", module=attn, ckpt=True)
    assert seen == ["all_gather.forward", "all_gather.forward", "all_gather.backward"], seen


def test_recompute_keeps_the_variant():
    run_ranks(4, _recompute)


def _scope_rules() -> None:
    group = cpscope.new_cp_groups([2], hierarchical=True)[2]
    x = torch.randn(1, 8, 4, D)
    with recording() as seen:
        with cpscope.runtime_cp(group, comm="a2a"):
            assert cpscope.capture_scope().comm == "a2a"
            context_parallel_attention(x, x, x)  # the scope's variant
            context_parallel_attention(x, x, x, comm="all_gather")  # comm= beats the scope
            ContextParallelAttention()(x, x, x)  # the scope's variant
            ContextParallelAttention(comm="all_gather")(x, x, x)  # the module's beats the scope
            with cpscope.runtime_cp(group):  # a new binding: the default variant again
                assert cpscope.capture_scope().comm is None
                context_parallel_attention(x, x, x)
            context_parallel_attention(x, x, x, group=group)  # an explicit group carries no variant: the default
    assert seen == ["a2a.forward", "all_gather.forward", "a2a.forward", "all_gather.forward", "p2p.forward",
                    "p2p.forward"], seen


def test_explicit_comm_beats_scope_and_nesting():
    run_ranks(2, _scope_rules)


def test_scope_carries_comm_without_process_group():
    with cpscope.runtime_cp(None, comm="all_gather") as scope:
        assert scope.comm == "all_gather" and scope.size == 1 and "comm='all_gather'" in repr(scope)
        assert cpscope.capture_scope() is scope
    assert cpscope.capture_scope().comm is None
    assert cpscope.runtime_cp(None, comm="a2a+p2p:4").scope.comm == "a2a+p2p:4"
    for bad in ("ring", "a2a+p2p:1", "a2a+p2p:x", "A2A", 3):
        with pytest.raises(ValueError, match="comm must be one of"):
            cpscope.runtime_cp(None, comm=bad)
        with pytest.raises(ValueError, match="comm must be one of"):
            ContextParallelAttention(comm=bad)
        with pytest.raises(ValueError, match="comm must be one of"):
            context_parallel_attention(*[torch.randn(1, 4, 2, 8)] * 3, comm=bad, group=None)
    # CP1: every variant is plain local attention, whatever the heads
    check(None, "a2a", "thd", True, 4, 1, lens=[6, 10])
    check(None, "a2a+p2p", "bshd", False, 3, 1)


def test_default_auto_rule():
    q = lambda cp, h, hk: _dispatch.VariantQuery(cp, h, hk, 128, "bshd", True, (1024,))  # noqa: E731
    assert _dispatch.default_rule(q(1, 32, 8)) == "p2p"
    assert _dispatch.default_rule(q(4, 32, 8)) == "a2a"
    assert _dispatch.default_rule(q(8, 32, 4)) == "all_gather"  # k/v heads do not divide, 8x fewer of them
    assert _dispatch.default_rule(q(4, 32, 1)) == "all_gather"  # MQA
    assert _dispatch.default_rule(q(4, 6, 3)) == "p2p"


def _auto() -> None:
    cpscope.set_backward_read_check(True)
    group = cpscope.new_cp_groups([4], hierarchical=True)[4]
    with recording() as seen:
        check(group, "auto", "thd", True, 8, 4)  # heads divide by 4: a2a
        check(group, "auto", "bshd", True, 4, 1, how="scope")  # MQA: all_gather
        check(group, "auto", "bshd", False, 4, 2)  # neither: p2p
    assert [s.split(".")[0] for s in seen[::2]] == ["a2a", "all_gather", "p2p"], seen
    queries = []

    def chooser(query):
        queries.append(query)
        return "a2a+p2p:2"

    old = cpscope.attention.set_auto_chooser(chooser)
    try:
        with recording() as seen:
            check(group, "auto", "thd", True, 4, 2, lens=[8, 24])
        assert seen == ["a2a+p2p.forward", "a2a+p2p.backward"]
        assert queries == [_dispatch.VariantQuery(4, 4, 2, D, "thd", True, (8, 24), torch.float32, "cpu")]
        cpscope.attention.set_auto_chooser(lambda query: "ulysses")
        x = torch.randn(1, 4, 4, D)
        with pytest.raises(ValueError, match="returned 'ulysses'"):
            context_parallel_attention(x, x, x, comm="auto", group=group)
    finally:
        cpscope.attention.set_auto_chooser(old)
    check(group, "auto", "bshd", True, 4, 4)  # ranks still in step


def test_auto_rule_and_chooser_hook():
    run_ranks(4, _auto)


def _bad_choices() -> str:
    groups = cpscope.new_cp_groups([2, 4], hierarchical=True)
    x, mqa = torch.randn(1, 4, 4, D), torch.randn(1, 4, 1, D)
    three = torch.randn(1, 4, 3, D)
    with pytest.raises(ValueError, match=r"q heads \(3\) must divide.*replicated.*would work for these heads: "
                                         r"\[1, 3\].*'all_gather'"):
        context_parallel_attention(three, mqa, mqa, comm="a2a", group=groups[2])
    six = torch.randn(1, 4, 6, D)
    with pytest.raises(ValueError, match=r"q heads \(6\).*CP size 4.*would work for these heads: \[1, 2, 3, 6\]"):
        context_parallel_attention(six, six, six, comm="a2a", group=groups[4])
    with pytest.raises(ValueError, match=r"inner size n with 1 < n < cp.*cp=2.*proper divisors of cp: none"):
        context_parallel_attention(x, x, x, comm="a2a+p2p", group=groups[2])
    with pytest.raises(ValueError, match=r"'a2a\+p2p:3'.*must divide the CP size 4"):
        context_parallel_attention(x, x, x, comm="a2a+p2p:3", group=groups[4])
    with pytest.raises(ValueError, match=r"inner size n with 1 < n < cp, n dividing cp=4 and the q heads 3;"):
        context_parallel_attention(three, mqa, mqa, comm="a2a+p2p", group=groups[4])
    with pytest.raises(ValueError, match="divisible by 2\\*cp=8"):  # the shared checks come first
        context_parallel_attention(x[:, :3], x[:, :3], x[:, :3], comm="all_gather", group=groups[4])
    return str(context_parallel_attention(x, x, x, comm="a2a", group=groups[4]).shape)  # ranks still in step


def test_bad_choices_raise_before_any_collective():
    assert run_ranks(4, _bad_choices) == ["torch.Size([1, 4, 4, 8])"] * 4


# ------------------------------------------------------------------------------------------------ TE adapter


class _FakeTE(torch.nn.Module):
    """The parts of TE's DotProductAttention the adapter uses: CP attributes, heads, set_context_parallel_group."""

    def __init__(self, heads: int, kv_heads: int):
        super().__init__()
        self.num_attention_heads, self.num_gqa_groups, self.tp_size = heads, kv_heads, 1
        self.qkv_format, self.attn_mask_type = "bshd", "causal"
        self.cp_group = self.cp_global_ranks = self.cp_stream = None
        self.cp_comm_type = "p2p"
        self.bound: list[tuple] = []

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type="p2p"):
        self.cp_group, self.cp_global_ranks, self.cp_stream, self.cp_comm_type = (cp_group, cp_global_ranks,
                                                                                   cp_stream, cp_comm_type)
        self.bound.append((cp_group, cp_global_ranks, cp_comm_type))


def _te() -> None:
    from cpscope.integrations.te import bind_te_cp

    group = cpscope.new_cp_groups([4], hierarchical=True)[4]
    me = dist.get_rank()

    def bound(fake, scope, **kw):
        with bind_te_cp(fake, scope, stream_provider=lambda device: "stream", **kw):
            return fake.cp_group, fake.cp_global_ranks, fake.cp_comm_type

    with cpscope.runtime_cp(group, comm="a2a+p2p") as scope:
        pair, ranks, comm = bound(_FakeTE(8, 4), scope)
    assert comm == "a2a+p2p" and ranks == [0, 1, 2, 3]
    assert [cpscope.group_ranks(g) for g in pair] == [[me - me % 2, me - me % 2 + 1], [me % 2, me % 2 + 2]]
    with cpscope.runtime_cp(group, comm="auto") as scope:
        assert bound(_FakeTE(8, 4), scope)[2] == "a2a"
        assert bound(_FakeTE(8, 1), scope)[2] == "all_gather"
        assert bound(_FakeTE(8, 4), scope, cp_comm_type="p2p")[2] == "p2p"  # explicit beats the scope
        with pytest.raises(ValueError, match="would work for these heads"):
            bound(_FakeTE(6, 6), scope, cp_comm_type="a2a")
    with cpscope.runtime_cp(group, comm="all_gather") as scope:
        g, _, comm = bound(_FakeTE(8, 4), scope)
        assert g is group and comm == "all_gather"
    fake = _FakeTE(8, 4)
    bound(fake, cpscope.runtime_cp(None, comm="a2a+p2p:2").scope)  # CP1: TE gets no group and its own comm type
    assert fake.bound[0] == (None, None, "p2p") and fake.cp_comm_type == "p2p"


def test_te_adapter_passes_the_variant():
    run_ranks(4, _te)


def _compiled() -> list[float]:
    """A compiled module with a variant (the collectives stay eager behind ``torch.compiler.disable``)."""
    groups = cpscope.new_cp_groups([2], hierarchical=True)
    errs = []
    for comm in ("all_gather", "a2a"):
        attn = ContextParallelAttention(qkv_format="thd", comm=comm)
        f = torch.compile(lambda q, k, v, cu: attn(q, k, v, cu_seqlens=cu) * 2, backend="eager")
        cu = [0, 8, 24]
        q, k, v, dout = _case("thd", 4, 2, 9, cu, 0)
        ref = _reference(q, k, v, 2 * dout, True, cu, None)
        idx = zigzag_index(cu, 2, dist.get_rank())
        loc = [t[0, idx].float().requires_grad_(True) for t in (q, k, v)]
        with cpscope.runtime_cp(groups[2]):
            out = f(*loc, torch.tensor(cu, dtype=torch.int32))
        out.backward(dout[0, idx].float())
        for got, want in zip((out / 2, *(t.grad for t in loc)), ref):
            errs.append((got.double() - want[0, idx]).abs().max().item())
    return errs


def test_compiled_module_with_a_variant():
    for errs in run_ranks(2, _compiled):
        assert len(errs) == 8 and max(errs) <= TOL[torch.float32], errs


@pytest.mark.parametrize("comm", ["all_gather", "a2a"])
def test_packed_blocks_through_the_cudnn_wrapper(comm, monkeypatch):
    """The variants' varlen block descriptors through cpscope's cuDNN packed-block wrapper (the GPU's default route
    for thd), against the fake cuDNN frontend of test_cudnn_thd_cpu, on 4 virtual ranks in bf16."""
    from cpscope.attention._kernels import cudnn_frontend, cudnn_thd
    from tests.attention.test_cudnn_thd_cpu import _fake_cudnn

    cudnn = _fake_cudnn()
    monkeypatch.setattr(cudnn_frontend, "module", lambda: cudnn)
    monkeypatch.setattr(cudnn_frontend, "stream", lambda device: 0)
    monkeypatch.setattr(cudnn_frontend, "handle", lambda device: object())
    monkeypatch.setattr(cudnn_frontend, "available", lambda device: True)  # the router takes packed blocks there
    routed = []
    real = cudnn_thd.forward
    monkeypatch.setattr(cudnn_thd, "forward", lambda *a, **kw: routed.append(a[3]) or real(*a, **kw))
    cudnn_frontend.clear_cache()
    try:
        for causal in (True, False):
            check_virtual(comm, 4, "thd", causal=causal, heads=(8, 4), lens=[16, 0, 48, 32], d=8,
                          dtype=torch.bfloat16, tol=2e-2)
    finally:
        cudnn_frontend.clear_cache()
    assert routed  # the wrapper ran
