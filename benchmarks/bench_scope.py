"""Cost of a runtime_cp scope and of a scope read, with the backward read check on and off.

Usage:  python benchmarks/bench_scope.py [--repeats 15] [--number 200000] [--json PATH] [--compare-scope PATH]
                                        [--compare-label TEXT]

Spawns 2 gloo ranks (a real CP2 group needs them); rank 0 times, in the same process and interleaved:
  * floor  — a minimal context manager that does ``token = var.set(v)`` / ``var.reset(token)``, plus ``var.get()``
  * cp2    — ``with runtime_cp(group_of_2): current_cp_group()``
  * none   — ``with runtime_cp(None): current_cp_group()``
  * reuse  — the same ``runtime_cp`` object entered repeatedly (decorator-like reuse)
Times are CPU time of the timing thread (``time.thread_time``), so that a busy shared machine's other processes do not
count. Reports ns per iteration (median of the repeats) and the ratio to the floor (``ratio_to_floor``: the median over
repeats of each case over the floor measured just before it, robust to load drift; ``ratio_of_medians_to_floor``
beside it). Target: cp2 ≤ 2x with the backward read check on.

Then the cost of one scope read — what every CP consumer (sharding, RoPE, attention, the modules, the HF / TE
adapters) pays once per call — inside a bound CP2 scope, check on (the default) vs off, same run, interleaved:
  * read_floor          — a bare ``var.get()``
  * capture_on / _off   — ``capture_scope()`` (what ``resolve_scope()`` and the adapters call)
  * cp_size_on / _off   — ``cp_size()``
  * module_on / _off    — ``ContextParallelAttention.active_scope()`` (the module's read, via ``runtime_scope_or``)
  * rope_on / _off      — a whole small consumer call, ``apply_rotary_pos_emb`` on a ``[1, 8, 2, 16]`` CP2 shard
                          (one scope read inside), timed with ``--number / 100`` calls
  * capture_outside_on / _off — ``capture_scope()`` outside every scope (the read that also probes for torch
                          checkpoint's recompute hooks)
With ``--compare-scope PATH`` (another version's ``cpscope/scope.py`` that imports nothing of cpscope, e.g. the one
before the backward check moved out: ``git show b33ddf4:cpscope/scope.py > /tmp/scope_old.py``), the enter + read + exit cases also run with that module,
loaded side by side and interleaved in the same loop (``old_cp2``, ``old_none``, …).

Reports ns per read (medians), the ratio on / off (median of the per-repeat ratios of back-to-back samples; the
on/off order alternates between repeats) and the check's cost in ns per read (difference of the medians).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
import timeit
from contextvars import ContextVar

import torch.distributed as dist
import torch.multiprocessing as mp

from _results import dump

_VAR: ContextVar = ContextVar("bare", default=None)


class _Bare:
    """The floor: the least a ContextVar-based scope can do."""

    __slots__ = ("_v", "_t")

    def __init__(self, v):
        self._v = v

    def __enter__(self):
        self._t = _VAR.set(self._v)
        return self._v

    def __exit__(self, *exc):
        _VAR.reset(self._t)


def _enter_read_exit_cases(args, group):
    """``with runtime_cp(g): current_cp_group()`` and its variants, beside the floor (check on: the default)."""
    import cpscope

    runtime_cp, current = cpscope.runtime_cp, cpscope.current_cp_group
    reuse = runtime_cp(group)

    def floor():
        with _Bare(group):
            _VAR.get()

    def cp2():
        with runtime_cp(group):
            current()

    def none():
        with runtime_cp(None):
            current()

    def reused():
        with reuse:
            current()

    cases = {"floor": floor, "cp2": cp2, "none": none, "reuse_cp2": reused}
    if args.compare_scope:
        cases.update(_other_scope_cases(args.compare_scope, group))
    return cases


def _read_cases():
    """One scope read per call, each with the check on and off: ``{name: (callable, check on?)}``."""
    import torch

    import cpscope

    attn = cpscope.ContextParallelAttention()
    capture, size = cpscope.capture_scope, cpscope.cp_size
    t = torch.randn(1, 8, 2, 16)  # [b, s_local, h, d]: a CP2 shard of a 16-token sequence
    freqs = cpscope.rotary_freqs(16, 16)

    def rope():
        cpscope.apply_rotary_pos_emb(t, freqs, qkv_format="bshd")

    reads = {"read_floor": (_VAR.get, True)}
    for name, fn in (("capture", capture), ("cp_size", size), ("module", attn.active_scope), ("rope", rope)):
        reads[f"{name}_on"], reads[f"{name}_off"] = (fn, True), (fn, False)
    return reads


def _timed(fn, number):
    """ns per call, in CPU time of this thread: time the OS gives other processes (a shared machine) is not counted."""
    return timeit.timeit(fn, number=number, timer=time.thread_time) / number * 1e9


def _measure(args, group):
    import cpscope

    cases, reads = _enter_read_exit_cases(args, group), _read_cases()
    outside = {"capture_outside_on": (cpscope.capture_scope, True), "capture_outside_off": (cpscope.capture_scope, False)}
    samples = {k: [] for k in (*cases, *reads, *outside)}
    for i in range(args.repeats):  # part 1, outside every scope: interleaved so that drift hits all alike
        for name, fn in cases.items():
            samples[name].append(_timed(fn, args.number))
        for name, (fn, check) in (outside.items() if i % 2 == 0 else list(outside.items())[::-1]):
            cpscope.set_backward_read_check(check)  # a read with nothing bound: the recompute-hook probe too
            samples[name].append(_timed(fn, args.number))
        cpscope.set_backward_read_check(True)
    with cpscope.runtime_cp(group):  # part 2: reads inside a bound CP2 scope, check on vs off back to back
        _VAR.set(group)
        for i in range(args.repeats):
            for name, (fn, check) in (reads.items() if i % 2 == 0 else list(reads.items())[::-1]):
                cpscope.set_backward_read_check(check)
                samples[name].append(_timed(fn, max(1, args.number // 100) if name.startswith("rope") else args.number))
        cpscope.set_backward_read_check(True)
    return _summary(args, samples, cases, reads)


def _paired(samples, a, b):
    """The median over repeats of ``a / b`` measured back to back (robust to load drift between repeats)."""
    return round(statistics.median(x / y for x, y in zip(samples[a], samples[b])), 3)


def _summary(args, samples, cases, reads):
    import platform

    import torch

    med = {k: statistics.median(v) for k, v in samples.items()}
    pairs = ("capture", "cp_size", "module", "rope", "capture_outside")
    return {
        "ns_per_iter": {k: round(med[k], 1) for k in cases},
        "ratio_to_floor": {k: _paired(samples, k, "floor") for k in cases if k != "floor"},
        "ratio_of_medians_to_floor": {k: round(med[k] / med["floor"], 3) for k in cases if k != "floor"},
        "read_ns": {k: round(med[k], 1) for k in (*reads, "capture_outside_on", "capture_outside_off")},
        "read_check_ratio_on_off": {p: _paired(samples, f"{p}_on", f"{p}_off") for p in pairs},
        "read_check_cost_ns": {p: round(med[f"{p}_on"] - med[f"{p}_off"], 1) for p in pairs},
        "repeats": args.repeats,
        "number": args.number,
        "compared_scope": args.compare_label or args.compare_scope,
        "env": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                "loadavg": [round(x, 2) for x in os.getloadavg()]},
    }


def _other_scope_cases(path, group):
    """The enter + read + exit cases with another version of ``scope.py``, loaded standalone."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("_compared_scope", path)
    other = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = other
    spec.loader.exec_module(other)
    rcp, current = other.runtime_cp, other.current_cp_group
    reuse = rcp(group)

    def cp2():
        with rcp(group):
            current()

    def none():
        with rcp(None):
            current()

    def reused():
        with reuse:
            current()

    return {"old_cp2": cp2, "old_none": none, "old_reuse_cp2": reused}


def _worker(rank, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import cpscope

    group = cpscope.new_cp_groups([2])[2]
    if rank == 0:
        result = _measure(args, group)
        print(json.dumps(result, indent=1))
        print(f"{'case':<12}{'ns/iter':>10}{'x floor':>10}")
        for k, v in result["ns_per_iter"].items():
            print(f"{k:<12}{v:>10.1f}{result['ratio_to_floor'].get(k, 1.0):>10.2f}")
        print(f"{'read':<16}{'on ns':>10}{'off ns':>10}{'on/off':>10}{'cost ns':>10}")
        for p in ("capture", "cp_size", "module", "rope", "capture_outside"):
            r = result["read_ns"]
            print(f"{p:<16}{r[p + '_on']:>10.1f}{r[p + '_off']:>10.1f}"
                  f"{result['read_check_ratio_on_off'][p]:>10.3f}{result['read_check_cost_ns'][p]:>10.1f}")
        if args.json:
            dump(result, args.json)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--number", type=int, default=200_000)
    ap.add_argument("--json", default=None)
    ap.add_argument("--compare-scope", default=None, help="another version's cpscope/scope.py, timed side by side")
    ap.add_argument("--compare-label", default=None, help="what --compare-scope is (recorded in the JSON)")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port, args), nprocs=2)


if __name__ == "__main__":
    main()
