"""Property-based (Hypothesis) stateful test of the scope runtime against a trivially correct model.

Random sequences of enter / exit / raise-inside / nested decorated calls / thread switches / asyncio task switches /
build-time changes / snapshot re-entry are driven on every rank of real gloo pools (2 and 4 ranks, real groups of
size 1, 2 and 4), and after every step the active group, size and rank must equal the model's: a plain stack.
"""
from __future__ import annotations

import asyncio
import threading

import torch.distributed as dist
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

import cpscope
from tests.distributed import run_ranks

STEPS = {"n": 0, "checks": 0}


class _Planted(Exception):
    """The exception the machine raises on purpose inside a scope."""


def _expected(group):
    if group is None or group.size() == 1:
        return (None, 1, 0)
    return (group, group.size(), dist.get_rank(group))


def _reads():
    return (cpscope.current_cp_group(), cpscope.cp_size(), cpscope.cp_rank())


def _make_machine(groups: dict):
    keys = sorted(groups)  # e.g. [0 (a real size-1 group), 1 (None), 2, 4]
    choice = st.sampled_from(keys)

    class ScopeMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.open: list[cpscope.runtime_cp] = []
            self.model: list = []  # the model: a stack of bound groups
            self.build = None

        def expect(self):
            top = self.model[-1] if self.model else self.build
            return _expected(top)

        def check(self, where="main"):
            got, want = _reads(), self.expect()
            STEPS["checks"] += 1
            assert got == want, f"{where}: active {got} != model {want}"

        @rule(k=choice)
        def enter(self, k):
            cm = cpscope.runtime_cp(groups[k])
            cm.__enter__()
            self.open.append(cm)
            self.model.append(groups[k])

        @precondition(lambda self: self.open)
        @rule()
        def exit(self):
            self.open.pop().__exit__(None, None, None)
            self.model.pop()

        @rule(k=choice)
        def raise_inside(self, k):
            try:
                with cpscope.runtime_cp(groups[k]):
                    self.model.append(groups[k])
                    self.check("inside raising scope")
                    raise _Planted("planted")
            except _Planted:  # only ours: a RuntimeError from ContextVar.reset (a bug) must surface
                pass
            finally:
                self.model.pop()

        @rule(ks=st.lists(choice, min_size=1, max_size=4), fail_at=st.integers(-1, 3))
        def nested_decorated(self, ks, fail_at):
            def make(d):
                @cpscope.runtime_cp(groups[ks[d]])
                def call(depth):
                    self.model.append(groups[ks[depth]])
                    try:
                        self.check(f"decorated depth {depth}")
                        if depth == fail_at:
                            raise ValueError("planted")
                        if depth + 1 < len(ks):
                            fns[depth + 1](depth + 1)
                            self.check(f"after inner call at depth {depth}")
                    finally:
                        self.model.pop()

                return call

            fns = [make(d) for d in range(len(ks))]
            try:
                fns[0](0)
            except ValueError:
                assert 0 <= fail_at < len(ks)

        @rule(k=choice)
        def thread_switch(self, k):
            errors = []

            def body():
                try:
                    # A new thread sees no binding of ours: only the build-time group.
                    assert _reads() == _expected(self.build), "thread inherited a binding"
                    with cpscope.runtime_cp(groups[k]):
                        assert _reads() == _expected(groups[k])
                    assert _reads() == _expected(self.build)
                except BaseException as e:  # noqa: BLE001
                    errors.append(e)

            t = threading.Thread(target=body)
            t.start()
            t.join()
            assert not errors, errors
            self.check("after thread")

        @rule(ks=st.lists(choice, min_size=1, max_size=3))
        def task_switch(self, ks):
            outer = self.expect()

            async def task(k, inherited):
                assert _reads() == inherited  # a task copies the context it was created in
                with cpscope.runtime_cp(groups[k]):
                    await asyncio.sleep(0)  # other tasks run and bind meanwhile
                    assert _reads() == _expected(groups[k])
                assert _reads() == inherited

            async def main():
                await asyncio.gather(*(task(k, outer) for k in ks))
                assert _reads() == outer

            asyncio.run(main())
            self.check("after asyncio")

        @rule(k=choice)
        def set_build_time(self, k):
            cpscope.set_build_time_cp_group(groups[k])
            self.build = groups[k]

        @rule(k=choice)
        def snapshot_reenter(self, k):
            snap = cpscope.capture_scope()
            want = self.expect()
            with cpscope.runtime_cp(groups[k]):
                with snap.bind():
                    assert _reads() == want
                assert _reads() == _expected(groups[k])

        @invariant()
        def agrees_with_model(self):
            STEPS["n"] += 1
            self.check()

        def teardown(self):
            while self.open:
                self.open.pop().__exit__(None, None, None)
            cpscope.set_build_time_cp_group(None)
            assert _reads() == (None, 1, 0)

    return ScopeMachine


def _w_stateful(max_examples: int, steps: int):
    world = dist.get_world_size()
    regs = cpscope.new_cp_groups([s for s in (1, 2, 4) if world % s == 0])
    groups = dict(regs)
    groups[0] = dist.new_group([dist.get_rank()], use_local_synchronization=True)  # a real size-1 group
    STEPS["n"] = STEPS["checks"] = 0
    machine = _make_machine(groups)
    run_state_machine_as_test(
        machine,
        settings=settings(max_examples=max_examples, stateful_step_count=steps, deadline=None, database=None,
                          derandomize=False),
    )
    return STEPS["n"], STEPS["checks"]


def test_stateful_scope_matches_model_on_4_ranks():
    results = run_ranks(4, _w_stateful, 80, 50)
    for steps, checks in results:
        assert steps >= 2000 and checks >= steps  # thousands of steps per rank, every one checked


def test_stateful_scope_matches_model_on_2_ranks():
    results = run_ranks(2, _w_stateful, 40, 50)
    assert all(steps >= 1000 for steps, _ in results)
