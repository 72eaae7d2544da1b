"""CP-aware RoPE: the local output (and gradient) equals a float64 full-sequence reference cut per rank, for
CP 1/2/4 on real gloo groups and CP 1..4 simulated in one process; runtime group switches; the freqs table
module; bad input. GPU tests compare the torch paths with TransformerEngine's fused kernel."""
from __future__ import annotations

import random

import pytest
import torch

import cpscope
from cpscope.rope import RotaryEmbedding, apply_rotary_pos_emb, rotary_freqs
from cpscope.sharding import zigzag_position_ids
from tests.distributed import run_ranks
from tests.test_sharding import cu_of, fake_scope, ref_local_tokens

SEQ_DIM = {"bshd": 1, "sbhd": 0, "thd": 0}
HEAD_DIM = 8


# ----------------------------------------------------------------------------------------------------------------
# Independent float64 reference: per channel, as TE defines it (freqs need not be symmetric)


def ref_rope_tokens(x: torch.Tensor, angles: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x: [N, ..., d] float64, angles: [N, rot_dim] float64 (one row per token). Channels past rot_dim pass."""
    rd = angles.shape[-1]
    shape = [angles.shape[0]] + [1] * (x.dim() - 2)
    cos = [torch.cos(angles[:, j]).reshape(shape) for j in range(rd)]
    sin = [torch.sin(angles[:, j]).reshape(shape) for j in range(rd)]
    cols = []
    for j in range(rd):
        if interleaved:
            partner = -x[..., j + 1] if j % 2 == 0 else x[..., j - 1]
        else:
            partner = -x[..., j + rd // 2] if j < rd // 2 else x[..., j - rd // 2]
        cols.append(x[..., j] * cos[j] + partner * sin[j])
    cols += [x[..., j] for j in range(rd, x.shape[-1])]
    return torch.stack(cols, dim=-1)


def ref_rope_full(x: torch.Tensor, freqs: torch.Tensor, layout: str, doc_lens: list[int], interleaved: bool):
    """Full-sequence RoPE in float64: positions 0..L-1 (per document in thd)."""
    table = freqs.reshape(freqs.shape[0], freqs.shape[-1]).double()
    pos = torch.cat([torch.arange(n) for n in doc_lens]) if doc_lens else torch.zeros(0, dtype=torch.long)
    d = SEQ_DIM[layout]
    xt = x.movedim(d, 0)  # tokens first
    return ref_rope_tokens(xt, table[pos], interleaved).movedim(0, d)


def _doc_lens(layout: str, cp: int, rng: random.Random) -> list[int]:
    if layout == "thd":
        return [2 * cp * rng.randint(0, 3) for _ in range(rng.randint(1, 4))]
    return [2 * cp * rng.randint(1, 3)]


def _tensor(layout: str, total: int, g: torch.Generator, dtype=torch.float32) -> torch.Tensor:
    shape = {"bshd": (2, total, 3, HEAD_DIM), "sbhd": (total, 2, 3, HEAD_DIM), "thd": (total, 3, HEAD_DIM)}[layout]
    return torch.randn(shape, generator=g, dtype=dtype)


def check_case(cp: int, rank: int, layout: str, interleaved: bool, rot_dim: int, seed: int, table: str) -> None:
    """Compare cpscope's local RoPE (active scope) with the reference cut at this rank's tokens: fwd and grad."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    doc_lens = _doc_lens(layout, cp, rng)
    total = sum(doc_lens)
    global_len = max(doc_lens) if layout == "thd" else total  # tight: freqs exactly cover the global length
    if table == "module":
        freqs = RotaryEmbedding(rot_dim, interleaved=interleaved)(global_len)
    else:  # arbitrary angles: exercises the per-channel convention
        freqs = torch.rand(global_len, 1, 1, rot_dim, generator=g) * 50
    x = _tensor(layout, total, g)
    w = _tensor(layout, total, g)
    d = SEQ_DIM[layout]

    x64 = x.double().requires_grad_(True)
    ref = ref_rope_full(x64, freqs, layout, doc_lens, interleaved)
    (ref * w.double()).sum().backward()

    idx = torch.tensor(ref_local_tokens(doc_lens, cp, rank)[0], dtype=torch.long)
    x_local = x.index_select(d, idx).requires_grad_(True)
    cu = torch.tensor(cu_of(doc_lens), dtype=torch.int32) if layout == "thd" else None
    out = apply_rotary_pos_emb(x_local, freqs, qkv_format=layout, cu_seqlens=cu, interleaved=interleaved)
    assert out.dtype == x_local.dtype and out.shape == x_local.shape
    what = f"cp={cp} rank={rank} {layout} interleaved={interleaved} rot_dim={rot_dim} docs={doc_lens}"
    torch.testing.assert_close(out, ref.detach().index_select(d, idx).float(), atol=1e-6, rtol=1e-6, msg=what)
    (out * w.index_select(d, idx)).sum().backward()
    torch.testing.assert_close(x_local.grad, x64.grad.index_select(d, idx).float(), atol=1e-6, rtol=1e-6, msg=what)


CASES = [
    (layout, interleaved, rot_dim, table)
    for layout in ("bshd", "sbhd", "thd")
    for interleaved in (False, True)
    for rot_dim, table in ((HEAD_DIM, "module"), (HEAD_DIM // 2, "random"))
]


# ----------------------------------------------------------------------------------------------------------------
# In one process: CP1 unbound, and every rank of CP 2..4 simulated (RoPE needs no communication)


@pytest.mark.parametrize("layout,interleaved,rot_dim,table", CASES)
def test_rope_cp1_unbound(layout, interleaved, rot_dim, table):
    check_case(1, 0, layout, interleaved, rot_dim, seed=7, table=table)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_rope_simulated_ranks(cp):
    for i, case in enumerate(CASES):
        for rank in range(cp):
            with fake_scope(cp, rank).bind():
                check_case(cp, rank, *case[:3], seed=100 * cp + i, table=case[3])


# ----------------------------------------------------------------------------------------------------------------
# Real groups on the pools


def _rope_pool_task(sizes):
    groups = cpscope.new_cp_groups(sizes)
    for cp in sizes:
        with cpscope.runtime_cp(groups[cp]):
            assert cpscope.cp_size() == cp
            for i, case in enumerate(CASES):
                check_case(cp, cpscope.cp_rank(), *case[:3], seed=10 * cp + i, table=case[3])
    return True


@pytest.mark.parametrize("world,sizes", [(2, [1, 2]), (4, [1, 2, 4])])
def test_rope_matches_full_reference_on_groups(world, sizes):
    assert run_ranks(world, _rope_pool_task, sizes) == [True] * world


def _mixed_microbatches_task():
    groups = cpscope.new_cp_groups([1, 2, 4])
    cpscope.set_backward_read_check(True)  # nothing may read the scope in backward
    seen = []
    for step, cp in enumerate([4, 1, 2, 1, 4, 2]):
        with cpscope.runtime_cp(groups[cp]):
            rank = cpscope.cp_rank()
            assert cpscope.cp_size() == cp
            doc_lens = [2 * cp * 2, 2 * cp]
            cu = cu_of(doc_lens)
            want = ref_local_tokens(doc_lens, cp, rank)[1]
            assert zigzag_position_ids(torch.tensor(cu, dtype=torch.int32)).tolist() == want
            assert zigzag_position_ids(4 * cp).tolist() == ref_local_tokens([4 * cp], cp, rank)[1]
            check_case(cp, rank, "thd", step % 2 == 1, HEAD_DIM, seed=step, table="module")
            check_case(cp, rank, "bshd", False, HEAD_DIM // 2, seed=step, table="random")
            seen.append((cp, rank))
    return seen


def test_mixed_cp_sizes_on_same_ranks():
    out = run_ranks(4, _mixed_microbatches_task)
    for r, seen in enumerate(out):
        assert seen == [(4, r), (1, 0), (2, r % 2), (1, 0), (4, r), (2, r % 2)]


# ----------------------------------------------------------------------------------------------------------------
# Dtypes, the table module


def test_low_precision_keeps_dtype():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 8, 2, HEAD_DIM, generator=g)
    freqs = rotary_freqs(HEAD_DIM, 16)
    with fake_scope(2, 1).bind():
        out = apply_rotary_pos_emb(x.bfloat16(), freqs, qkv_format="bshd")
        out64 = apply_rotary_pos_emb(x.double(), freqs, qkv_format="bshd")
    assert out.dtype == torch.bfloat16 and out64.dtype == torch.float64
    idx = torch.tensor(ref_local_tokens([16], 2, 1)[1])
    ref = ref_rope_tokens(x.double().movedim(1, 0), freqs[idx, 0, 0].double(), False).movedim(0, 1)
    torch.testing.assert_close(out64, ref, atol=1e-6, rtol=1e-6)  # float32 angles, float64 math
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_embedding_table(interleaved):
    rd, base, S = 6, 500.0, 33
    rope = RotaryEmbedding(rd, base=base, interleaved=interleaved)
    t = rope(S)
    assert t.shape == (S, 1, 1, rd) and t.dtype == torch.float32
    inv = [base ** (-2.0 * j / rd) for j in range(rd // 2)]
    for p in (0, 1, 17, S - 1):
        ang = [p * f for f in inv]
        want = [a for a in ang for _ in range(2)] if interleaved else ang + ang
        torch.testing.assert_close(t[p, 0, 0].double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=1e-6)
    shorter = rope(10)
    assert shorter.data_ptr() == t.data_ptr() and shorter.shape[0] == 10  # cached, sliced
    longer = rope(40)
    assert longer.shape[0] == 40 and torch.equal(longer[:S], t)
    assert torch.equal(rotary_freqs(rd, S, base=base, interleaved=interleaved), t)
    with pytest.raises(ValueError, match=r"rot_dim must be a positive even int, got 5"):
        RotaryEmbedding(5)
    with pytest.raises(ValueError, match=r"max_seqlen must be a non-negative int, got -1"):
        rope(-1)


def test_sizes_accept_numpy_integers_and_refuse_bools():
    np = pytest.importorskip("numpy")
    want = rotary_freqs(6, 12, base=500.0)
    assert torch.equal(rotary_freqs(np.int64(6), np.int32(12), base=np.float32(500.0)), want)
    rope = RotaryEmbedding(np.int16(6), base=np.float64(500.0))
    assert rope.rot_dim == 6 and type(rope.rot_dim) is int
    assert torch.equal(rope(np.uint8(12)), want)
    for bad in (True, np.True_, 6.0, np.float32(6.0)):
        with pytest.raises(ValueError, match="rot_dim must be a positive even int"):
            RotaryEmbedding(bad)
        with pytest.raises(ValueError, match="max_seqlen must be a non-negative int"):
            rope(bad)
    with pytest.raises(ValueError, match="base must be a finite number > 0, got True"):
        rotary_freqs(6, 12, base=True)


def test_rotary_embedding_table_written_in_place_changes_no_later_table():
    rope = RotaryEmbedding(4)
    want = rotary_freqs(4, 16)
    t = rope(16)
    t.add_(3.0)  # the caller's table is theirs; the next one is rebuilt
    again = rope(8)
    assert torch.equal(again, want[:8]) and again.data_ptr() != t.data_ptr()
    fresh = RotaryEmbedding(4)
    with torch.inference_mode():  # a table made here has no version counter: a new one each time, never cached
        a = fresh(8)
        b = fresh(8)
    assert torch.equal(a, want[:8]) and a.data_ptr() != b.data_ptr()


# ----------------------------------------------------------------------------------------------------------------
# The compiled path: only a failure of the compiler turns compilation off, for that case only; OOM propagates


@pytest.fixture
def compile_state(monkeypatch):
    """A clean compiled-path state; returns the module that keeps it and the list of calls the (fake) compiled kernel
    received."""
    from cpscope.rope import _torch_math

    calls = []
    monkeypatch.setattr(_torch_math, "_compile_off", set())
    monkeypatch.setattr(_torch_math, "_compiled", None)
    return _torch_math, calls


def _rope_inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    t = torch.randn(1, 8, 2, HEAD_DIM, generator=g, dtype=dtype)
    freqs = rotary_freqs(HEAD_DIM, 8)
    ref = ref_rope_full(t.double(), freqs, "bshd", [8], False)
    return t, freqs, ref


def _fake_compiled(calls, failure=None):
    from cpscope.rope._torch_math import rope_math

    def compiled(t, angles, interleaved):
        calls.append(t.dtype)
        if failure is not None and t.dtype == torch.float32:
            raise failure
        return rope_math(t, angles, interleaved)

    return lambda fn: compiled


def test_compile_oom_propagates_and_compilation_stays_on(compile_state, monkeypatch, caplog):
    api, calls = compile_state
    t, freqs, ref = _rope_inputs()
    monkeypatch.setattr(api, "_compile", _fake_compiled(calls, RuntimeError("CUDA out of memory. Tried to allocate")))
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        apply_rotary_pos_emb(t, freqs, qkv_format="bshd", group=None, impl="compiled")
    assert api._compile_off == set() and not caplog.records
    monkeypatch.setattr(api, "_compiled", None)
    monkeypatch.setattr(api, "_compile", _fake_compiled(calls))  # memory is back: the compiled kernel runs
    out = apply_rotary_pos_emb(t, freqs, qkv_format="bshd", group=None, impl="compiled")
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert calls == [torch.float32, torch.float32]


def test_oom_wrapped_by_the_compiler_propagates(compile_state, monkeypatch):
    from torch._dynamo.exc import BackendCompilerFailed

    api, calls = compile_state
    t, freqs, _ = _rope_inputs()
    wrapped = BackendCompilerFailed(lambda *a: None, torch.OutOfMemoryError("CUDA out of memory"), None)
    monkeypatch.setattr(api, "_compile", _fake_compiled(calls, wrapped))
    with pytest.raises(BackendCompilerFailed):
        apply_rotary_pos_emb(t, freqs, qkv_format="bshd", group=None, impl="compiled")
    assert api._compile_off == set()


def test_compile_error_turns_compilation_off_for_that_case_only(compile_state, monkeypatch, caplog):
    api, calls = compile_state

    def failing_backend(gm, example_inputs):
        raise RuntimeError("planted compiler failure: no working C++ compiler")

    real_compile = torch.compile
    compiled_calls = []

    def compile_fn(fn):  # a real torch.compile whose backend fails for float32, and works (eager) for float64
        broken, works = real_compile(fn, backend=failing_backend, dynamic=True), real_compile(fn, backend="eager")

        def run(t, angles, interleaved):
            compiled_calls.append(t.dtype)
            return (broken if t.dtype == torch.float32 else works)(t, angles, interleaved)

        return run

    monkeypatch.setattr(api, "_compile", compile_fn)
    t, freqs, ref = _rope_inputs()
    with caplog.at_level("WARNING", logger="cpscope.rope._torch_math"):
        for _ in range(3):
            out = apply_rotary_pos_emb(t, freqs, qkv_format="bshd", group=None, impl="compiled")
            torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)  # the eager path, same rows
        out64 = apply_rotary_pos_emb(t.double(), freqs, qkv_format="bshd", group=None, impl="compiled")
    torch.testing.assert_close(out64, ref, atol=1e-6, rtol=1e-6)
    assert compiled_calls == [torch.float32, torch.float64]  # tried once for float32; float64 still compiled
    assert api._compile_off == {("cpu", torch.float32, 4, False, False)}
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "planted compiler failure" in warnings[0].getMessage()


# ----------------------------------------------------------------------------------------------------------------
# Bad input: ValueError naming the values, before any work


def _bad(match, t, freqs, cp=2, rank=0, **kw):
    with fake_scope(cp, rank).bind():
        with pytest.raises(ValueError, match=match):
            apply_rotary_pos_emb(t, freqs, **kw)


F16 = rotary_freqs(4, 16)


def test_bad_thd_local_length():
    _bad(r"holds 5 local tokens.*cu_seqlens\[-1\]=8 with CP size 2", torch.zeros(5, 1, 4), F16,
         qkv_format="thd", cu_seqlens=[0, 8])


def test_bad_document_not_divisible():
    _bad(r"divisible by 2\*cp=4: document 1 has length 6", torch.zeros(5, 1, 4), F16,
         qkv_format="thd", cu_seqlens=[0, 4, 10])


def test_bad_sequence_not_divisible():
    _bad(r"divisible by 2\*cp=4, got 6", torch.zeros(1, 3, 1, 4), F16, qkv_format="bshd")
    _bad(r"divisible by 2\*cp=8, got 12", torch.zeros(3, 1, 1, 4), F16, cp=4, qkv_format="sbhd")


def test_bad_freqs_too_short():
    _bad(r"freqs covers 7 positions but the global sequence length is 8", torch.zeros(1, 4, 1, 4),
         rotary_freqs(4, 7), qkv_format="bshd")
    _bad(r"freqs covers 7 positions but the longest document is 8", torch.zeros(6, 1, 4), rotary_freqs(4, 7),
         qkv_format="thd", cu_seqlens=[0, 4, 12])
    with pytest.raises(ValueError, match=r"freqs covers 7 positions but the global sequence length is 8"):
        apply_rotary_pos_emb(torch.zeros(8, 1, 1, 4), rotary_freqs(4, 7), qkv_format="sbhd")  # CP1 too


def test_bad_cu_seqlens():
    t = torch.zeros(4, 1, 4)
    _bad(r"must start at 0, got 4", t, F16, qkv_format="thd", cu_seqlens=[4, 12])
    _bad(r"non-decreasing.*cu_seqlens\[2\]=4 < cu_seqlens\[1\]=8", t, F16, qkv_format="thd", cu_seqlens=[0, 8, 4, 8])
    _bad(r"got dtype torch.float32", t, F16, qkv_format="thd", cu_seqlens=torch.tensor([0.0, 8.0]))
    _bad(r"must hold integers, got \[0, 8.5\]", t, F16, qkv_format="thd", cu_seqlens=[0, 8.5])
    _bad(r"needs cu_seqlens", t, F16, qkv_format="thd")
    _bad(r"cu_seqlens is only used with qkv_format='thd', got qkv_format='bshd'", torch.zeros(1, 4, 1, 4), F16,
         qkv_format="bshd", cu_seqlens=[0, 8])


def test_bad_freqs_shape():
    t = torch.zeros(1, 4, 1, 4)
    _bad(r"shape \[max_seqlen, 1, 1, rot_dim\], got \(16, 4\)", t, F16.reshape(16, 4), qkv_format="bshd")
    _bad(r"shape \[max_seqlen, 1, 1, rot_dim\], got \(16, 2, 1, 4\)", t, F16.expand(16, 2, 1, 4), qkv_format="bshd")
    _bad(r"floating-point.*torch.int64", t, torch.zeros(16, 1, 1, 4, dtype=torch.long), qkv_format="bshd")


def test_bad_rot_dim():
    t = torch.zeros(1, 4, 1, 4)
    _bad(r"rot_dim \(freqs.shape\[-1\]\) = 6 exceeds the head dimension 4", t, rotary_freqs(6, 16), qkv_format="bshd")
    _bad(r"positive even number, got 3", t, torch.zeros(16, 1, 1, 3), qkv_format="bshd")


def test_bad_layout():
    _bad(r"qkv_format must be one of .* got 'bhsd'", torch.zeros(1, 4, 1, 4), F16, qkv_format="bhsd")
    _bad(r"must be 4-D for qkv_format='sbhd'.*got shape \(4, 1, 4\)", torch.zeros(4, 1, 4), F16, qkv_format="sbhd")
    _bad(r"must be 3-D for qkv_format='thd'.*got shape \(1, 4, 1, 4\)", torch.zeros(1, 4, 1, 4), F16,
         qkv_format="thd", cu_seqlens=[0, 8])
    _bad(r"impl must be one of", torch.zeros(1, 4, 1, 4), F16, qkv_format="bshd", impl="cuda")
    _bad(r"impl='triton' needs Triton and a CUDA tensor", torch.zeros(1, 4, 1, 4), F16, qkv_format="bshd",
         impl="triton")


# ----------------------------------------------------------------------------------------------------------------
# GPU: compiled torch path and TE's fused kernel agree with the eager path (and hence the reference)


def _gpu_case(cp, rank, layout, interleaved, rot_dim, impl):
    """CPU eager (checked against the reference above) vs CUDA eager and CUDA ``impl``: forward and gradient."""
    g = torch.Generator().manual_seed(cp * 10 + rank)
    doc_lens = [2 * cp * 3, 2 * cp, 2 * cp * 5] if layout == "thd" else [2 * cp * 4]
    total = sum(doc_lens)
    freqs = rotary_freqs(rot_dim, max(doc_lens) + 3, interleaved=interleaved)
    idx = torch.tensor(ref_local_tokens(doc_lens, cp, rank)[0])
    d = SEQ_DIM[layout]
    x0 = _tensor(layout, total, g).index_select(d, idx)
    w0 = torch.randn(x0.shape, generator=g)
    cu = torch.tensor(cu_of(doc_lens), dtype=torch.int32) if layout == "thd" else None
    outs = []
    for device, which in (("cpu", "eager"), ("cuda", "eager"), ("cuda", impl)):
        x = x0.to(device).clone().requires_grad_(True)
        with fake_scope(cp, rank).bind():
            y = apply_rotary_pos_emb(
                x, freqs.to(device), qkv_format=layout, cu_seqlens=None if cu is None else cu.to(device),
                interleaved=interleaved, impl=which,
            )
        (y * w0.to(device)).sum().backward()
        outs.append((y.detach().cpu(), x.grad.cpu()))
    for y, gx in outs[1:]:
        torch.testing.assert_close(y, outs[0][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gx, outs[0][1], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["compiled", "te"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_gpu_paths_match_eager(impl, cp):
    if impl == "te":
        pytest.importorskip("transformer_engine.pytorch")
    for layout in ("bshd", "sbhd", "thd"):
        for interleaved in (False, True):
            for rot_dim in (HEAD_DIM, HEAD_DIM // 2):
                for rank in range(cp):
                    _gpu_case(cp, rank, layout, interleaved, rot_dim, impl)


@pytest.mark.parametrize("base", [0, -1.0, float("nan"), float("inf")])
def test_rope_base_must_be_finite_positive(base):
    with pytest.raises(ValueError, match="RoPE base must be a finite number > 0"):
        cpscope.rotary_freqs(8, 16, base=base)
    with pytest.raises(ValueError, match="RoPE base must be a finite number > 0"):
        cpscope.RotaryEmbedding(8, base=base)


# ----------------------------------------------------------------------------------------------------------------
# The Triton kernel (the CUDA default), run on CPU under Triton's interpreter: equal to the float64 reference


@pytest.fixture
def interpreted_rope_kernel(monkeypatch):
    pytest.importorskip("triton")
    from cpscope.rope import _kernel as _rope_kernel

    from cpscope.attention._policy import use_kernel_policy

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _rope_kernel._kernel.cache_clear()
    with use_kernel_policy(triton_on_cpu=True):
        yield _rope_kernel
    _rope_kernel._kernel.cache_clear()


@pytest.mark.parametrize("layout", ["thd", "bshd", "sbhd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot_dim", [HEAD_DIM, 4])
def test_triton_kernel_matches_reference(interpreted_rope_kernel, layout, interleaved, rot_dim):
    """impl="triton" (fwd and grad) equals the float64 reference at every rank of a simulated CP2, also for a strided
    input view (q sliced out of a fused qkv tensor) and a table whose two halves differ."""
    rng = random.Random(3)
    cp = 2
    doc_lens = _doc_lens(layout, cp, rng)
    total = sum(doc_lens)
    g = torch.Generator().manual_seed(5)
    table = torch.randn(max(total, 1), 1, 1, rot_dim, generator=g, dtype=torch.float64)  # asymmetric halves
    fused = torch.randn(*_tensor(layout, total, g).shape[:-1], 2 * HEAD_DIM, generator=g, dtype=torch.float64)
    x = fused[..., :HEAD_DIM]  # a strided view, as q out of a qkv projection
    ref = ref_rope_full(x, table, layout, doc_lens, interleaved)
    cu = cu_of(doc_lens) if layout == "thd" else None
    d = SEQ_DIM[layout]
    for r in range(cp):
        idx = torch.tensor(ref_local_tokens(doc_lens, cp, r)[0], dtype=torch.long)
        local = x.index_select(d, idx).float()
        strided = torch.cat([local, torch.zeros_like(local)], dim=-1)[..., :HEAD_DIM].requires_grad_(True)
        with fake_scope(cp, r).bind():
            out = apply_rotary_pos_emb(strided, table.float(), qkv_format=layout, cu_seqlens=cu,
                                       interleaved=interleaved, impl="triton")
        want = ref.index_select(d, idx)
        assert out.dtype == torch.float32 and torch.allclose(out.double(), want, atol=1e-5)
        gout = torch.randn(out.shape, generator=g, dtype=torch.float64)
        out.backward(gout.float())
        xf = x.clone().requires_grad_(True)  # reference gradient: through the full tensor, cut at the local rows
        gfull = torch.zeros_like(ref)
        gfull.index_copy_(d, idx, gout)
        ref_rope_full(xf, table, layout, doc_lens, interleaved).backward(gfull)
        assert torch.allclose(strided.grad.double(), xf.grad.index_select(d, idx), atol=1e-5)
