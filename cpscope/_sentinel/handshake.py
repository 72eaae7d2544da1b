"""The sentinel's handshake: before the first check on a group, its members agree on how the sentinel runs.

Sampling runs collectives that every member of a group must enter together, so every member must have the sentinel
on, with the same ``every``, the same policy and checks, at the same unit. At a group's first sampled unit each
member publishes these choices in the job's rendezvous store (``torch.distributed``'s default store: no collective,
so a member that is not there cannot leave another waiting inside one) and waits, at most ``timeout`` seconds, for
every other member's. Every member then compares the same rows and raises the same :class:`SentinelError`, naming
the ranks and the choices that differ; a member that never publishes (the sentinel is off there, or was switched on
later) is named by the members that waited for it.

Without a default store (a group made another way) the handshake is one timed all-gather instead.

Example::

    rows = handshake(scope, {"every": 100, "index": 0}, timeout=300.0)   # every member's choices, or SentinelError
"""
from __future__ import annotations

import json
import threading
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from ..scope import CPScope
from .agree import disagreements
from .comm import collective_device, exchange, group_of, me
from .report import Mismatch, SentinelError

__all__ = ["handshake", "check_rows", "options_code"]

_ROUNDS: dict[str, int] = {}  # handshakes so far per group name, in this process (every member counts alike)
_LOCK = threading.Lock()

LABELS = {"rows": "rows (checked per rank)", "every": "every", "index": "unit index (sampling counter)", "policy": "on_mismatch",
          "checks": "checks switched on (attention, gradients, positions, loss, labels)", "on": "sentinel on"}


def _store() -> Optional[Any]:
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _group_name(scope: CPScope) -> str:
    name = getattr(scope.group, "group_name", None)
    return str(name) if name else "/".join(map(str, group_of(scope)))


def handshake(scope: CPScope, values: dict[str, int], *, timeout: float) -> list[dict[str, int]]:
    """Every member's ``values`` (same keys everywhere), in group order; ``SentinelError`` on every member that
    publishes when a member is missing after ``timeout`` seconds or the values differ."""
    members = list(group_of(scope))
    name = _group_name(scope)
    with _LOCK:
        n = _ROUNDS.get(name, 0)
        _ROUNDS[name] = n + 1
    store = _store()
    if store is None:
        rows = exchange(scope.group, values, collective_device(scope.group), timeout=timeout, what="handshake")
    else:
        rows = _through_store(store, f"cpscope-sentinel/{name}/{n}", members, values, timeout)
    check_rows(rows, members)
    return rows


def _through_store(store: Any, base: str, members: list[int], values: dict[str, int],
                   timeout: float) -> list[dict[str, int]]:
    store.set(f"{base}/{me()}", json.dumps(values))
    keys = [f"{base}/{r}" for r in members]
    try:  # waits in the store (no polling: at scale, thousands of ranks may wait at once)
        store.wait(keys, timedelta(seconds=timeout))
    except RuntimeError:  # a timeout (DistStoreError is one), or the store gone
        missing = [r for r in members if not store.check([f"{base}/{r}"])]
        if missing:
            raise SentinelError([Mismatch(
                "agreement", "sentinel on", r,
                f"rank {r} of the group {members} did not reach the sentinel's first check on this group within "
                f"{timeout:g} s: switch the sentinel on at the same point on every rank (before the loop), with "
                f"the same options — or rank {r} stalled or died", {"missing": missing, "timeout_s": timeout},
                group=tuple(members)) for r in missing]) from None
    return [json.loads(store.get(k).decode()) for k in keys]


def check_rows(rows: list[dict[str, int]], members: list[int]) -> None:
    """Raise the same :class:`SentinelError` on every member when the rows differ (they are the same rows there)."""
    fields = [f for f in rows[0] if f not in ("global_rank", "cp_rank")]
    problems = disagreements(rows, members=members, fields=fields)
    if not problems:
        return
    ms = []
    for p in problems:
        per_rank = ", ".join(f"rank {members[i]}: {r.get(p.field)}" for i, r in enumerate(rows))
        msg = (f"the ranks of the group {members} run the sentinel with another {LABELS.get(p.field, p.field)} — "
               f"{per_rank}: sampled units would run collectives on some ranks only; switch it on at the same point "
               "on every rank, with the same options")
        ms.extend(Mismatch("agreement", LABELS.get(p.field, p.field), r, msg, p.figures, group=tuple(members))
                  for r in (p.ranks or (-1,)))
    raise SentinelError(ms)


def options_code(opts: Any) -> dict[str, int]:
    """The options that decide which collectives a sampled unit runs, as digest fields."""
    pol = opts.on_mismatch
    policy = 3 if callable(pol) else {"raise": 1, "log": 2}.get(pol, 0)
    checks = sum(int(bool(b)) << i for i, b in enumerate(
        (opts.attention, opts.gradients, opts.positions, opts.loss, opts.labels is not None)))
    return {"on": 1, "every": int(opts.every), "policy": policy, "checks": checks, "rows": int(opts.rows)}

