"""The adapters' class-swap helper: swap in, idempotence, restore, copies, pickling, threads, per-call attributes."""
from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch

from cpscope.integrations import _swap


class Doubling(torch.nn.Linear):
    """A base class importable by name (pickle finds the swapped class's parts through it)."""


class Scaled(_swap.ForwardSignature):
    """Multiplies the base forward's output by the module's ``_cpscope_factor``; records the bound arguments."""

    def forward(self, *args, **kwargs):
        call = self._cpscope_signature.bind(*args, **kwargs)
        self.__dict__.setdefault("_cpscope_seen", []).append(sorted(call.arguments))
        return super().forward(*call.args, **call.kwargs) * self._cpscope_factor


class Negated:
    def forward(self, x):
        return -super().forward(x)


def _module() -> Doubling:
    torch.manual_seed(0)
    return Doubling(3, 2)


def test_swap_keeps_name_state_dict_and_parameters():
    m = _module()
    x = torch.randn(4, 3)
    plain, keys, weight = m(x), list(m.state_dict()), m.weight
    assert _swap.swap_class(m, Scaled, _cpscope_factor=3.0)
    assert isinstance(m, Doubling) and type(m) is not Doubling and type(m).__name__ == "Doubling"
    assert type(m).__qualname__ == Doubling.__qualname__ and type(m).__module__ == Doubling.__module__
    assert list(m.state_dict()) == keys and m.weight is weight
    torch.testing.assert_close(m(x), 3 * plain)
    assert m._cpscope_seen == [["input"]]  # the base forward's signature, without self
    assert _swap.original_class(m) is Doubling


def test_swap_is_idempotent_and_another_mixin_drops_the_old_state():
    m = _module()
    x = torch.randn(2, 3)
    assert _swap.swap_class(m, Scaled, _cpscope_factor=2.0)
    cls = type(m)
    m(x)
    assert not _swap.swap_class(m, Scaled, _cpscope_factor=5.0)  # same class, state updated, the rest kept
    assert type(m) is cls and m._cpscope_factor == 5.0 and len(m._cpscope_seen) == 1
    assert _swap.swapped_class(Doubling, Scaled) is cls  # one class per (base, mixin)
    assert _swap.swap_class(m, Negated)
    assert type(m).__mro__[1] is Negated and _swap.original_class(m) is Doubling  # never a subclass of a swap
    assert not [k for k in vars(m) if k.startswith("_cpscope_")]
    torch.testing.assert_close(m(x), -Doubling.forward(m, x))


def test_unswap_restores_class_and_removes_every_cpscope_attribute():
    model = torch.nn.Sequential(_module(), torch.nn.ReLU(), _module())
    _swap.swap_class(model[0], Scaled, _cpscope_factor=2.0)
    _swap.swap_class(model[2], Negated)
    model[2].__dict__["_cpscope_cache"] = {}  # stored later by the mixin: removed as well
    model[2].keep = 1  # not the swap's: kept
    assert _swap.unswap_all(model) == ["0", "2"]
    assert type(model[0]) is Doubling and type(model[2]) is Doubling and model[2].keep == 1
    assert not [k for m in model for k in vars(m) if k.startswith("_cpscope_")]
    assert _swap.unswap_all(model) == [] and not _swap.unswap(model[1])


def test_state_names_must_carry_the_prefix():
    m = _module()
    with pytest.raises(ValueError, match="_cpscope_"):
        _swap.swap_class(m, Scaled, factor=2.0)
    assert type(m) is Doubling  # refused before anything changed


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_keep_the_swapped_class(how):
    m = _module()
    _swap.swap_class(m, Scaled, _cpscope_factor=4.0)
    twin = copy.deepcopy(m) if how == "deepcopy" else pickle.loads(pickle.dumps(m))
    x = torch.randn(2, 3)
    assert type(twin) is type(m) and twin.weight is not m.weight
    torch.testing.assert_close(twin(x), m(x))
    assert _swap.unswap(twin) and type(twin) is Doubling and type(m) is not Doubling


@pytest.mark.parametrize("how", ["swap", "deepcopy", "pickle"])
def test_several_mixins_compose_in_one_class(how):
    """swap_class takes several mixins: one class (Scaled's forward, then Negated's, then the base), both
    behaviours, the prepare hook of each, copies and pickling rebuild it, and unswap removes it."""
    m = _module()
    x = torch.randn(2, 3)
    plain = m(x)
    assert _swap.swap_class(m, (Scaled, Negated), _cpscope_factor=3.0)
    cls = type(m)
    assert cls.__bases__ == (Scaled, Negated, Doubling) and _swap.original_class(m) is Doubling
    assert cls._cpscope_mixins == (Scaled, Negated) and cls._cpscope_mixin == (Scaled, Negated)
    assert _swap.swapped_class(Doubling, (Scaled, Negated)) is cls  # one class per (base, mixins)
    assert _swap.swapped_class(Doubling, (Scaled,)) is _swap.swapped_class(Doubling, Scaled)
    assert not _swap.swap_class(m, (Scaled, Negated), _cpscope_factor=3.0)  # idempotent
    twin = {"swap": m, "deepcopy": copy.deepcopy(m), "pickle": pickle.loads(pickle.dumps(m))}[how]
    assert type(twin) is cls
    torch.testing.assert_close(twin(x), -3 * plain)  # -(3 * base): both mixins ran
    assert twin._cpscope_seen[-1] == ["input"]  # Scaled's prepare hook gave the base forward's signature
    assert _swap.unswap(twin) and type(twin) is Doubling
    torch.testing.assert_close(twin(x), plain)


def test_mixins_must_be_classes():
    m = _module()
    for bad in ((), (Scaled, "Negated"), "Scaled"):
        with pytest.raises(ValueError, match="mixins must be a class"):
            _swap.swap_class(m, bad)
    assert type(m) is Doubling


def test_concurrent_swaps_create_one_class():
    class Fresh(torch.nn.Linear):
        pass

    barrier = threading.Barrier(8)
    seen: list[type] = []

    def run() -> None:
        m = Fresh(2, 2)
        barrier.wait()
        _swap.swap_class(m, Negated)
        seen.append(type(m))

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 8 and len(set(seen)) == 1


def test_call_with_attributes_restores_also_on_exception():
    class Obj:
        a, b = 1, 2

    obj = Obj()

    def read() -> tuple:
        return obj.a, obj.b

    assert _swap.call_with_attributes(obj, {"a": 10, "b": 20}, read) == (10, 20)
    assert (obj.a, obj.b) == (1, 2)

    def fail() -> None:
        assert (obj.a, obj.b) == (5, 2)
        raise RuntimeError("planted failure")

    with pytest.raises(RuntimeError, match="planted failure"):
        _swap.call_with_attributes(obj, {"a": 5}, fail)
    assert (obj.a, obj.b) == (1, 2)
