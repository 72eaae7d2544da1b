"""The scope survives autograd: the backward read check, scope-preserving checkpoint, microbatches, other threads.

Layered: pure tests (no process group; fake ``CPScope`` objects stand in for groups) for the backward read check
(on by default), the recompute binding and ``MicrobatchScope``; then 4-rank gloo tests with the real ring
attention + RoPE against a float64 full-sequence reference cut per rank, in schedules that separate a microbatch's
forward from its backward.
"""
from __future__ import annotations

import contextlib
import functools
import math
import threading
from typing import Any, Callable, Optional

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import cpscope
from cpscope.microbatch import MicrobatchScope
from cpscope.backward_check import ScopeReadInBackwardError
from cpscope.recompute import checkpoint, scope_context_fn, scoped
from cpscope.scope import CP1, CPScope, capture_scope
from tests.distributed import run_ranks

# Stand-ins for real groups in pure tests: the scope machinery never calls into them.
S2 = CPScope(object(), 2, 1)
S4 = CPScope(object(), 4, 3)


@pytest.fixture
def debug_reads():
    """The backward read check is on by default: tests using this fixture rely on it (and leave it on)."""
    assert cpscope.backward_read_check_enabled()
    yield
    cpscope.set_backward_read_check(True)


class _ReadsScopeInBackward(torch.autograd.Function):
    """A *buggy* CP-aware op: scales the gradient by ``cp_size()`` read in backward (instead of from ctx)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * cpscope.cp_size()


class _ScopeOnCtx(torch.autograd.Function):
    """The correct pattern: resolve in forward, keep on ctx; backward scales by the captured size."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.scope = cpscope.resolve_scope()
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * ctx.scope.size


def _in_thread(fn: Callable[[], Any]) -> None:
    """Run ``fn`` on a fresh thread (as CUDA's autograd device threads would) and re-raise what it raised."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if errors:
        raise errors[0]


# ----------------------------------------------------------------------------------------------------------------
# The backward read check (default on): reading the ContextVar inside backward raises


def test_debug_mode_catches_function_backward_read(debug_reads):
    x = torch.ones(3, requires_grad=True)
    with S2.bind():
        y = _ReadsScopeInBackward.apply(x)
        assert cpscope.cp_size() == 2  # reads in forward are fine
    with pytest.raises(ScopeReadInBackwardError, match="_ReadsScopeInBackwardBackward"):
        y.sum().backward()


def test_debug_mode_catches_tensor_hook_read(debug_reads):
    x = torch.ones(3, requires_grad=True)
    with S2.bind():
        y = x * 2
    y.register_hook(lambda g: g * cpscope.cp_size())
    with pytest.raises(ScopeReadInBackwardError):
        y.sum().backward()


def test_debug_mode_catches_reads_on_another_thread(debug_reads):
    x = torch.ones(3, requires_grad=True)
    with S2.bind():
        y = _ReadsScopeInBackward.apply(x)
    with pytest.raises(ScopeReadInBackwardError):
        _in_thread(lambda: y.sum().backward())


def test_debug_mode_catches_queue_callback_read(debug_reads):
    # Engine callbacks run with no current autograd node but inside the graph task: still backward.
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    seen: list[BaseException] = []

    def callback() -> None:
        try:
            cpscope.cp_size()
        except ScopeReadInBackwardError as e:
            seen.append(e)

    y.register_hook(lambda g: torch.autograd.Variable._execution_engine.queue_callback(callback))
    y.sum().backward()
    assert len(seen) == 1 and "callback of the backward pass" in str(seen[0])


def test_debug_mode_catches_plain_torch_checkpoint_recompute_read(debug_reads):
    # torch's checkpoint recomputes without re-binding: a scope read in the recompute is the Megatron bug.
    # (Read before the first saved tensor: non-reentrant recompute stops early once it has what backward needs.)
    x = torch.ones(3, requires_grad=True)
    with S2.bind():
        y = torch_checkpoint.checkpoint(lambda t: cpscope.cp_size() * t.sin(), x, use_reentrant=False)
    with pytest.raises(ScopeReadInBackwardError):
        y.sum().backward()


def test_debug_mode_off_and_correct_patterns_pass(debug_reads):
    x = torch.ones(3, requires_grad=True)
    with S4.bind():
        y = _ScopeOnCtx.apply(x)
        h = x * 1.0
    h.register_hook(scoped(lambda g: g * cpscope.cp_size(), S4))  # explicit re-entry is allowed
    with S2.bind():  # a different scope bound during backward changes nothing
        (y.sum() + h.sum()).backward()
    assert torch.equal(x.grad, torch.full((3,), 8.0))
    x.grad = None
    with S2.bind():
        y = _ReadsScopeInBackward.apply(x)
    with cpscope.allow_scope_reads_in_backward():  # the expert opt-out, restored on exit
        assert not cpscope.backward_read_check_enabled()
        y.sum().backward()  # no error (and, outside every scope, the buggy op sees CP1 -- a wrong grad)
    assert cpscope.backward_read_check_enabled()
    assert torch.equal(x.grad, torch.ones(3))


def test_bind_restores_and_allows_reads_in_backward(debug_reads):
    binder = S2.bind()
    x = torch.ones(3, requires_grad=True)
    seen: list[int] = []

    def hook(g: torch.Tensor) -> torch.Tensor:
        with binder:
            with binder:  # re-entrant: each ``with`` keeps its own tokens
                seen.append(cpscope.cp_size())
            seen.append(cpscope.cp_size())
        return g

    y = x * 1.0
    y.register_hook(hook)
    with S4.bind():
        y.sum().backward()
        assert capture_scope() is S4  # restored after the hook
    assert seen == [2, 2]


# ----------------------------------------------------------------------------------------------------------------
# Recompute re-enters the captured scope (pure)


def _recording(seen: list[CPScope]) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(t: torch.Tensor) -> torch.Tensor:
        seen.append(capture_scope())
        return t.sin() * capture_scope().size

    return fn


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("backward_scope", [None, CP1, S4])
def test_checkpoint_recompute_sees_forward_scope(debug_reads, use_reentrant, backward_scope):
    seen: list[CPScope] = []
    x = torch.linspace(0.1, 1.0, 4, requires_grad=True)
    with S2.bind():
        y = checkpoint(_recording(seen), x, use_reentrant=use_reentrant)
    assert capture_scope() is CP1
    with backward_scope.bind() if backward_scope is not None else contextlib.nullcontext():
        y.sum().backward()
    assert seen == [S2, S2]  # the forward call and the recompute
    torch.testing.assert_close(x.grad, 2 * x.detach().cos())


def test_checkpoint_recompute_on_another_thread(debug_reads):
    seen: list[CPScope] = []
    x = torch.linspace(0.1, 1.0, 4, requires_grad=True)
    with S4.bind():
        y = checkpoint(_recording(seen), x)
        _in_thread(lambda: y.sum().backward())  # the thread does not see S4; the recompute re-enters it
    assert seen == [S4, S4]
    torch.testing.assert_close(x.grad, 4 * x.detach().cos())


def test_scope_context_fn_with_torch_checkpoint_and_user_context(debug_reads):
    seen: list[CPScope] = []
    entered: list[str] = []

    @contextlib.contextmanager
    def mark(name: str):
        entered.append(name)
        yield

    def user_context_fn():
        return mark("forward"), mark("recompute")

    x = torch.linspace(0.1, 1.0, 4, requires_grad=True)
    ctx_fn = scope_context_fn(user_context_fn)
    with S2.bind():
        y = torch_checkpoint.checkpoint(_recording(seen), x, use_reentrant=False, context_fn=ctx_fn)
    with S4.bind():
        z = torch_checkpoint.checkpoint(_recording(seen), x, use_reentrant=False, context_fn=ctx_fn)
    (y.sum() + z.sum()).backward()  # one context_fn object, each checkpoint keeps its own capture
    assert seen[:2] == [S2, S4] and sorted(seen[2:], key=lambda s: s.size) == [S2, S4]
    assert entered == ["forward", "forward", "recompute", "recompute"]
    torch.testing.assert_close(x.grad, 6 * x.detach().cos())


def test_hf_style_partial_checkpoint_kwargs(debug_reads):
    # transformers binds gradient_checkpointing_kwargs with functools.partial onto torch's checkpoint
    # (PreTrainedModel._activation_checkpointing_enable); the same context_fn then serves every layer and step.
    ckpt = functools.partial(torch_checkpoint.checkpoint, use_reentrant=False, context_fn=scope_context_fn())
    seen: list[CPScope] = []
    x = torch.linspace(0.1, 1.0, 4, requires_grad=True)
    outs = []
    for s in (S2, CP1, S4):
        with s.bind():
            outs.append(ckpt(_recording(seen), x))
    for out in reversed(outs):  # backward in another order, nothing bound
        out.sum().backward()
    assert seen == [S2, CP1, S4, S4, CP1, S2]


def test_nested_checkpoint_and_bad_arguments(debug_reads):
    seen: list[CPScope] = []
    x = torch.linspace(0.1, 1.0, 4, requires_grad=True)
    inner = _recording(seen)
    with S2.bind():
        y = checkpoint(lambda t: checkpoint(inner, t * 1.0), x)
    y.sum().backward()
    assert set(seen) == {S2} and len(seen) >= 2
    with pytest.raises(ValueError, match="CPScope"):
        scoped(lambda: None, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="CPScope"):
        MicrobatchScope(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="callable"):
        scope_context_fn(3)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------------------------
# MicrobatchScope (pure)


def test_microbatch_carries_scope_through_interleaved_schedule(debug_reads):
    a, b = MicrobatchScope(S2), MicrobatchScope(S4)
    xa = torch.ones(3, requires_grad=True)
    xb = torch.ones(3, requires_grad=True)
    hook_seen: list[int] = []

    def fwd(x: torch.Tensor) -> torch.Tensor:
        y = _ScopeOnCtx.apply(x)
        return y

    ya = a.forward(fwd, xa)
    yb = b.forward(fwd, xb)
    a.register_hook(ya, lambda g: hook_seen.append(cpscope.cp_size()))
    assert capture_scope() is CP1  # forward restored the loop's scope
    with pytest.raises(AttributeError):
        a.scope = S4  # type: ignore[misc]
    b_bound: list[Optional[CPScope]] = []
    with S4.bind():  # B's scope bound while A runs backward, on another thread
        _in_thread(lambda: a.backward(ya.sum()))
        b_bound.append(capture_scope())
    b.backward(yb.sum())
    assert torch.equal(xa.grad, torch.full((3,), 2.0)) and torch.equal(xb.grad, torch.full((3,), 4.0))
    assert hook_seen == [2] and b_bound == [S4]
    assert MicrobatchScope.capture().scope is CP1 and MicrobatchScope.of(None).scope is CP1


# ----------------------------------------------------------------------------------------------------------------
# Distributed: real ring attention + RoPE over CP groups, float64 full-sequence reference

B, L, H, D = 1, 16, 2, 8  # L divisible by 2·4


def _ref_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Plain non-interleaved RoPE at positions 0..L-1: [b, L, h, d]."""
    a = freqs[: x.shape[1], 0, 0, :][None, :, None, :].to(x.dtype)  # [1, L, 1, d]
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * a.cos() + rot * a.sin()


def _ref_freqs(d: int, n: int) -> torch.Tensor:
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat((ang, ang), dim=-1)[:, None, None, :].float()  # [n, 1, 1, d] fp32, TE layout


def _reference(q, k, v, w, freqs):
    """Full-sequence float64 causal attention after RoPE; returns (out, dq, dk, dv) for loss = sum(out * w)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    qr, kr = _ref_rope(q, freqs), _ref_rope(k, freqs)
    s = torch.einsum("bqhd,bkhd->bhqk", qr, kr) / math.sqrt(q.shape[-1])
    mask = torch.ones(L, L, dtype=torch.bool).tril()
    p = s.masked_fill(~mask, float("-inf")).softmax(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _block(q, k, v, freqs, seen: Optional[list] = None):
    """RoPE + ring attention reading the active scope; records the scope it ran under."""
    if seen is not None:
        seen.append(cpscope.current_cp_group())
    from cpscope.attention import context_parallel_attention
    from cpscope.rope import apply_rotary_pos_emb

    q = apply_rotary_pos_emb(q, freqs, qkv_format="bshd")
    k = apply_rotary_pos_emb(k, freqs, qkv_format="bshd")
    return context_parallel_attention(q, k, v, qkv_format="bshd", causal=True)


class _Mb:
    """One microbatch of the test: full tensors (same on every rank), its local leaves, output and loss."""

    def __init__(self, seed: int, group: Any) -> None:
        g = torch.Generator().manual_seed(seed)
        self.full = [torch.randn(B, L, H, D, generator=g, dtype=torch.float64) for _ in range(4)]  # q k v w
        self.group, self.mb = group, MicrobatchScope.of(group)
        self.seen: list = []

    def forward(self, mode: str, freqs: torch.Tensor) -> None:
        from cpscope.sharding import zigzag_shard

        def step():
            q, k, v, w = (zigzag_shard(t, seq_dim=1) for t in self.full)
            self.leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            if mode == "plain":
                out = _block(*self.leaves, freqs, self.seen)
            elif mode == "torch_context_fn":  # torch's own checkpoint with cpscope's documented context_fn
                out = torch_checkpoint.checkpoint(_block, *self.leaves, freqs, self.seen, use_reentrant=False,
                                                  context_fn=scope_context_fn())
            elif mode.startswith("torch_plain"):  # torch's checkpoint as is: the recompute reads the scope
                out = torch_checkpoint.checkpoint(_block, *self.leaves, freqs, None,
                                                  use_reentrant=(mode == "torch_plain_reentrant"))
            else:
                out = checkpoint(_block, *self.leaves, freqs, self.seen, use_reentrant=(mode == "reentrant"))
            self.out = out
            return (out * w).sum()

        self.loss = self.mb.forward(step)

    def check(self, freqs: torch.Tensor) -> None:
        from tests.attention._reference import zigzag_index

        out, dq, dk, dv = _reference(*self.full, freqs)
        cp = 1 if self.group is None else self.group.size()
        rank = 0 if self.group is None else torch.distributed.get_rank(self.group)
        idx = zigzag_index([0, out.shape[1]], cp, rank)  # independent of cpscope's index math

        def cut(t: torch.Tensor) -> torch.Tensor:
            return t[:, idx]
        torch.testing.assert_close(self.out, cut(out), rtol=1e-9, atol=1e-9)
        for got, want, name in zip(self.leaves, (dq, dk, dv), "qkv"):
            torch.testing.assert_close(got.grad, cut(want), rtol=1e-9, atol=1e-9, msg=lambda m: f"d{name}: {m}")


def _interleaved(mode: str, sizes: tuple[int, int]) -> list:
    """Forward A (CP sizes[0]), forward B (CP sizes[1]); backward A outside any scope, backward B under CP1."""
    assert cpscope.backward_read_check_enabled()  # proves nothing in backward / recompute reads the ContextVar
    groups = cpscope.new_cp_groups([1, 2, 4])
    freqs = _ref_freqs(D, L)
    a, b = _Mb(1, groups[sizes[0]]), _Mb(2, groups[sizes[1]])
    a.forward(mode, freqs)
    b.forward(mode, freqs)
    a.mb.backward(a.loss)  # nothing bound
    with cpscope.runtime_cp(None):  # a DIFFERENT scope bound during B's backward
        b.mb.backward(b.loss)
    a.check(freqs)
    b.check(freqs)
    calls = 1 if mode == "plain" else 2  # forward call (+ recompute)
    assert a.seen == [a.group] * calls, a.seen
    assert b.seen == [b.group] * calls, b.seen
    return [len(a.seen), len(b.seen)]


@pytest.mark.parametrize(
    "mode,sizes",
    [("plain", (2, 4)), ("checkpoint", (2, 4)), ("reentrant", (4, 2)), ("checkpoint", (2, 1)),
     ("torch_context_fn", (4, 2))],
)
def test_interleaved_microbatches_grads_match_reference(mode, sizes):
    calls = 1 if mode == "plain" else 2
    assert run_ranks(4, _interleaved, mode, sizes) == [[calls, calls]] * 4


def _backward_on_thread() -> None:
    """Checkpointed A under CP2, B under CP4; A's backward (with recompute) runs on another thread, check on."""
    assert cpscope.backward_read_check_enabled()
    groups = cpscope.new_cp_groups([1, 2, 4])
    freqs = _ref_freqs(D, L)
    a, b = _Mb(3, groups[2]), _Mb(4, groups[4])
    a.forward("checkpoint", freqs)
    with cpscope.runtime_cp(groups[4]):  # the loop has moved on to B
        b.forward("plain", freqs)
        _in_thread(lambda: a.mb.backward(a.loss))
    _in_thread(lambda: b.mb.backward(b.loss))
    a.check(freqs)
    b.check(freqs)
    assert a.seen == [groups[2], groups[2]] and b.seen == [groups[4]]


def test_backward_on_another_thread_uses_forward_groups():
    run_ranks(4, _backward_on_thread)


def _plain_torch_checkpoint_raises(mode: str) -> str:
    """torch.utils.checkpoint without cpscope's help, backward outside the scope: the recompute's first scope read
    (RoPE, before any collective) raises on every rank -- never a CP1 recompute of CP2 shards, never a hang."""
    groups = cpscope.new_cp_groups([2])
    freqs = _ref_freqs(D, L)
    a = _Mb(5, groups[2])
    a.forward(mode, freqs)
    with pytest.raises(ScopeReadInBackwardError, match="read inside autograd backward") as err:
        a.mb.backward(a.loss)
    return type(err.value).__name__


@pytest.mark.parametrize("mode", ["torch_plain_non_reentrant", "torch_plain_reentrant"])
def test_plain_torch_checkpoint_raises_on_every_rank(mode):
    assert run_ranks(2, _plain_torch_checkpoint_raises, mode, timeout=120) == ["ScopeReadInBackwardError"] * 2


# ----------------------------------------------------------------------------------------------------------------
# Legitimate paths that must not trip the (default-on) check


def test_double_backward_through_scoped_checkpoint(debug_reads):
    seen: list[CPScope] = []
    x = torch.linspace(0.1, 1.0, 4, dtype=torch.float64, requires_grad=True)
    with S2.bind():
        y = checkpoint(_recording(seen), x)  # 2 sin(x)
    h = x * 1.0
    h.register_hook(scoped(lambda g: g * cpscope.cp_size(), S4))  # a scoped hook in the first backward
    (g,) = torch.autograd.grad(y.sum() + h.sum(), x, create_graph=True)  # 2 cos(x) + 4, outside every scope
    torch.testing.assert_close(g, 2 * x.detach().cos() + 4)
    g.sum().backward()  # the second backward: d/dx sum(2 cos x) = -2 sin x
    torch.testing.assert_close(x.grad, -2 * x.detach().sin())
    assert set(seen) == {S2} and len(seen) >= 2


def test_compiled_module_with_scoped_checkpoint(debug_reads):
    seen: list[CPScope] = []

    class Block(torch.nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return checkpoint(_recording(seen), t * 2) + 1

    block = torch.compile(Block(), backend="eager")
    x = torch.linspace(0.1, 1.0, 4, requires_grad=True)
    with S2.bind():
        y = block(x)
    y.sum().backward()  # the recompute runs in backward, outside every scope
    assert seen[-1] is S2 and set(seen) == {S2}
    torch.testing.assert_close(x.grad, 4 * torch.cos(2 * x.detach()))


def test_explicit_binding_inside_backward_is_allowed(debug_reads):
    # A hook (or custom recompute) that binds a scope itself inside backward reads what it chose: allowed. A read
    # without a binding of its own -- even with the caller's scope bound around backward -- raises.
    x = torch.ones(3, requires_grad=True)
    sizes: list[int] = []

    s4 = S4.bind()  # one binder object, entered nested inside backward (its tokens pile up and unwind)

    def binds(g: torch.Tensor) -> torch.Tensor:
        with s4:
            sizes.append(cpscope.cp_size())
            with cpscope.runtime_cp(None):
                sizes.append(cpscope.cp_size())
                with s4:
                    sizes.append(cpscope.cp_size())
                sizes.append(cpscope.cp_size())
            with S2.bind():
                sizes.append(cpscope.cp_size())
        with pytest.raises(ScopeReadInBackwardError):
            cpscope.cp_size()  # the hook's own bindings are gone: a read now is a plain read in backward
        return g

    y = x * 2
    y.register_hook(binds)
    y.sum().backward()
    assert sizes == [4, 1, 4, 1, 2]
    assert capture_scope() is CP1
    y = x * 2
    y.register_hook(lambda g: g * cpscope.cp_size())
    with S2.bind(), pytest.raises(ScopeReadInBackwardError, match="set_backward_read_check"):
        y.sum().backward()


def test_backward_read_check_switches():
    assert cpscope.backward_read_check_enabled()
    assert cpscope.set_backward_read_check(False) is True and not cpscope.backward_read_check_enabled()
    assert cpscope.set_backward_read_check(True) is False

    @cpscope.allow_scope_reads_in_backward()
    def opted_out() -> bool:
        return cpscope.backward_read_check_enabled()

    assert opted_out() is False and cpscope.backward_read_check_enabled()
    with pytest.raises(ValueError, match="True or False, got str 'no'"):
        cpscope.set_backward_read_check("no")  # type: ignore[arg-type]
    assert not hasattr(cpscope, "set_debug_autograd_reads") and not hasattr(cpscope, "Microbatch")


# ----------------------------------------------------------------------------------------------------------------
# CUDA: backward really runs on autograd's device thread, which does not see the caller's ContextVars


@pytest.mark.gpu
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_cuda_recompute_on_device_thread_sees_captured_scope(debug_reads, use_reentrant):
    threads: list[int] = []
    seen: list[CPScope] = []
    inherited: list[Optional[CPScope]] = []

    def fn(t: torch.Tensor) -> torch.Tensor:
        threads.append(threading.get_ident())
        seen.append(capture_scope())
        return t.sin() * 2

    def hook(g: torch.Tensor) -> torch.Tensor:
        from cpscope.scope import _ACTIVE

        inherited.append(_ACTIVE.get())  # raw ContextVar (no debug check): what a naive read would see
        return g

    x = torch.linspace(0.1, 1.0, 8, device="cuda", requires_grad=True)
    with S2.bind():
        y = checkpoint(fn, x, use_reentrant=use_reentrant)
        y.register_hook(hook)
        y.sum().backward()  # S2 still bound in this thread
    assert inherited == [None]  # the device thread does not see S2
    assert seen == [S2, S2] and threads[1] != threading.get_ident()
    torch.testing.assert_close(x.grad, 2 * x.detach().cos())


@pytest.mark.gpu
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_cuda_plain_checkpoint_read_on_device_thread_raises(debug_reads, use_reentrant):
    """On CUDA the recompute runs on autograd's device thread, which does not see the caller's S2: a read there
    would silently be CP1. The default check raises instead, even with S2 still bound in the caller's thread."""
    threads: list[int] = []

    def fn(t: torch.Tensor) -> torch.Tensor:
        threads.append(threading.get_ident())
        n = cpscope.cp_size()  # read first: torch's non-reentrant recompute stops once the saved tensors exist
        return t.sin() * n

    x = torch.linspace(0.1, 1.0, 8, device="cuda", requires_grad=True)
    with S2.bind():
        y = torch_checkpoint.checkpoint(fn, x, use_reentrant=use_reentrant)
        with pytest.raises(ScopeReadInBackwardError):
            y.sum().backward()
    assert len(threads) == 2 and threads[1] != threading.get_ident()  # the recompute ran on the device thread


def test_module_read_in_plain_checkpoint_recompute_is_caught_by_default():
    """ContextParallelAttention with nothing bound: a recompute in backward must still trip the default check."""
    import torch.utils.checkpoint as tuc

    from cpscope.attention import ContextParallelAttention

    attn = ContextParallelAttention(qkv_format="bshd", causal=True)
    q, k, v = (torch.randn(1, 8, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = tuc.checkpoint(lambda a, b, c: attn(a, b, c), q, k, v, use_reentrant=False)
    with pytest.raises(cpscope.ScopeReadInBackwardError, match="cpscope.checkpoint"):
        out.sum().backward()


def test_scoped_wrapper_called_concurrently_from_threads_keeps_each_binding():
    """Interleaved calls of one scoped() wrapper: A enters, B enters, A leaves first, then B."""
    import threading

    from cpscope.scope import CPScope

    fake = CPScope(object(), 2, 1)  # a stand-in group object: nothing here talks to it
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen, errors = {}, []

    def body(name):
        seen[name] = cpscope.capture_scope()
        if name == "a":
            a_in.set()
            b_in.wait(5)
        else:
            b_in.set()
            a_out.wait(5)  # leave only after A has left
        return name

    f = cpscope.scoped(body, fake)

    def run(name):
        try:
            f(name)
            seen[name + "_after"] = cpscope.capture_scope()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            if name == "a":
                a_out.set()

    ta = threading.Thread(target=run, args=("a",))
    tb = threading.Thread(target=run, args=("b",))
    ta.start()
    a_in.wait(5)
    tb.start()
    ta.join(10)
    tb.join(10)
    assert not errors, errors
    assert seen["a"] is fake and seen["b"] is fake
    assert seen["a_after"].is_cp1 and seen["b_after"].is_cp1


# ----------------------------------------------------------------------------------------------------------------
# The switch is thread-safe; torch's recompute is recognised by its hook's code object


def test_allowances_exiting_out_of_order_on_two_threads_leave_the_check_on():
    """Thread A enters, B enters, A exits, B exits: the check must be back on (it stayed off for good before)."""
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    during: list[bool] = []

    def a() -> None:
        with cpscope.allow_scope_reads_in_backward():
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def b() -> None:
        a_in.wait(5)
        with cpscope.allow_scope_reads_in_backward():
            b_in.set()
            a_out.wait(5)
            during.append(cpscope.backward_read_check_enabled())  # A left, B still inside: still allowed

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert during == [False]
    assert cpscope.backward_read_check_enabled()
    x = torch.ones(3, requires_grad=True)
    y = _ReadsScopeInBackward.apply(x)
    with pytest.raises(ScopeReadInBackwardError):
        y.sum().backward()  # and it really checks again


def test_allowance_and_switch_combine():
    with cpscope.allow_scope_reads_in_backward():
        assert cpscope.set_backward_read_check(True) is True  # the switch stays on; the allowance still holds
        assert not cpscope.backward_read_check_enabled()
    previous = cpscope.set_backward_read_check(False)
    with cpscope.allow_scope_reads_in_backward():
        pass
    assert previous is True and not cpscope.backward_read_check_enabled()  # exiting did not turn the switch on
    cpscope.set_backward_read_check(True)
    assert cpscope.backward_read_check_enabled()


def _saved_outside_backward(y: torch.Tensor) -> None:
    """Unpack a saved tensor of ``y``'s node outside every backward: torch's non-reentrant checkpoint recomputes
    there with no graph task, exactly what autograd's CUDA device thread shows (graph task -1)."""
    y.grad_fn._saved_self  # MulBackward0 of ``sin(t) * (t * n)``: unpacking ``sin(t)`` runs the recompute


def test_torch_recompute_outside_a_graph_task_is_recognised(debug_reads):
    from cpscope import backward_check

    seen: list[tuple[int, int]] = []

    def fn(t: torch.Tensor) -> torch.Tensor:
        task = backward_check.graph_task_id()
        n = cpscope.cp_size()  # read before the first saved tensor (the recompute stops early after the last)
        seen.append((task, n))
        return t.sin() * (t * n)

    x = torch.ones(3, requires_grad=True)
    with S2.bind():
        y = torch_checkpoint.checkpoint(fn, x, use_reentrant=False)
    with pytest.raises(ScopeReadInBackwardError, match="recompute of a non-reentrant torch.utils.checkpoint"):
        _saved_outside_backward(y)  # plain torch checkpoint, nothing bound: the device-thread bug, caught
    assert seen == [(-1, 2)] and not backward_check.in_backward()
    with S2.bind():
        z = checkpoint(fn, x)  # cpscope.checkpoint re-binds S2 around the recompute: allowed
    _saved_outside_backward(z)
    assert seen[1:] == [(-1, 2), (-2, 2)]


def _recomputation_hook_lookalike(t: torch.Tensor) -> torch.Tensor:
    """A user's saved-tensor hook whose name starts like torch's recompute hooks: not a recompute."""
    return t


def test_recompute_detection_uses_the_hook_code_object_and_falls_back_to_names():
    from cpscope import backward_check as bc

    assert bc._RECOMPUTE_UNPACK is not None and bc._RECOMPUTE_UNPACK.co_name == "unpack_hook"
    assert bc._resolve_recompute_code(object()) is None  # a torch without the class: the name-based fallback

    lookalike = (_recomputation_hook_lookalike, _recomputation_hook_lookalike)
    assert not bc._is_torch_recompute(lookalike, bc._RECOMPUTE_UNPACK)
    assert bc._is_torch_recompute(lookalike, None)  # the fallback matches names (and says so in a warning)
    with torch.autograd.graph.saved_tensors_hooks(*lookalike):  # in forward: reads are fine
        assert cpscope.cp_size() == 1 and bc.graph_task_id() == -1
    captured: list[Any] = []

    def fn(t: torch.Tensor) -> torch.Tensor:
        captured.append(torch._C._autograd._top_saved_tensors_default_hooks(False))
        return t.sin() * 2

    x = torch.ones(3, requires_grad=True)
    y = torch_checkpoint.checkpoint(fn, x, use_reentrant=False)
    y.sum().backward()
    forward_hooks, recompute_hooks = captured
    assert bc._is_torch_recompute(recompute_hooks, bc._RECOMPUTE_UNPACK)
    assert bc._is_torch_recompute(recompute_hooks, None)
    assert not bc._is_torch_recompute(forward_hooks, bc._RECOMPUTE_UNPACK)  # the checkpointed forward's own hooks
    assert not bc._is_torch_recompute(None, bc._RECOMPUTE_UNPACK)
