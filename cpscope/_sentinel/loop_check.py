"""The sentinel in ``run_microbatches``: microbatch markers, agreement on the pack, layout of labels, loss count.

For every microbatch the loop runs, :func:`watch` marks it (so sampling follows microbatches of each group). On a
sampled microbatch of a CP group it first checks, with one small collective, that the members agree on the pack
(CP size, members, offsets, local length, the documents, the microbatch index) — at the microbatch's first
attention call, once the core's agreement digest showed every member sampling it (so a member without the sentinel
never leaves another inside this collective), before that call's exchange — then that the **labels are the next tokens** once the group's
tokens are put back in zigzag order: a microbatch sharded by another scheme (a contiguous split), or labels shifted
after sharding, breaks that. On sampled steps it checks **loss normalisation**: the world-sum of the targets the
loss uses (labels ≠ ``ignore_index``) must equal ``num_targets`` on every rank.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from ..scope import CPScope, scope_for
from .agree import comm_code, disagreements, hash64
from .comm import collective_device, describe, exchange, exchange_objects, gather_zigzag, group_of, me
from .reference import segment_ids
from .report import Mismatch
from .state import MicrobatchRecord, Tracker, offsets_list

__all__ = ["watch", "check_microbatch", "check_labels", "check_loss"]

_FIELDS = ("members", "cp_size", "step", "microbatch", "local_len", "offsets", "docs", "seqs", "comm")
# a disagreement here would hang or crash the model's collectives: raised whatever the policy
_STRUCTURAL = {"members", "cp_size", "local_len", "comm"}


def watch(t: Tracker, microbatches: Iterable[Any], num_targets: int) -> Iterator[Any]:
    """Yield the microbatches of one ``run_microbatches`` call, each marked and (when sampled) checked."""
    step, step_sampled = t.sampler.step()
    step_sampled = step_sampled and t.opts.loss
    used = 0
    device: Optional[torch.device] = None
    for mb in microbatches:
        scope = scope_for(getattr(mb, "group", None))
        state = t.begin_microbatch(scope, step=step)
        try:
            if state.sampled:  # its collectives: at the first attention call, after the core's digest
                state.due.append(lambda mb=mb, scope=scope, state=state: check_microbatch(t, mb, scope, state))
            if step_sampled:
                labels = mb.labels
                used += int((labels != t.opts.ignore_index).sum())
                device = labels.device
        except BaseException:
            t.end_microbatch(state, flush=False)
            raise
        try:
            yield mb
        except GeneratorExit:  # the loop stopped (an exception in forward / backward): no collectives now
            t.end_microbatch(state, flush=False)
            raise
        t.end_microbatch(state)
    if step_sampled and not t.stood_down:  # (stood down: the step boundary raises on every rank)
        check_loss(t, used, num_targets, device, step)


def check_microbatch(t: Tracker, mb: Any, scope: CPScope, state: MicrobatchRecord) -> None:
    """Agreement on the pack over the microbatch's group, then the labels' layout."""
    cu = offsets_list(mb.cu_seqlens)
    n_local = int(mb.input_ids.numel())
    where = dict(step=state.step, microbatch=state.index)
    if scope.size > 1:
        members = list(group_of(scope))
        seqs = tuple(int(x) for x in getattr(mb, "seqs", ()))
        vals = {"global_rank": me(), "cp_rank": scope.rank, "cp_size": scope.size, "members": hash64(tuple(members)),
                "step": state.step, "microbatch": state.index, "local_len": n_local,
                "offsets": hash64((tuple(cu), _real(mb))), "docs": len(cu) - 1, "seqs": hash64(seqs),
                "comm": comm_code(getattr(mb, "comm", None))}
        t.verdicts.count("agreement")
        rows = exchange(scope.group, vals, collective_device(scope.group, mb.input_ids.device),
                        timeout=t.opts.timeout)
        problems = disagreements(rows, members=members, fields=_FIELDS)
        if problems:
            details = exchange_objects(scope.group, {"cu": cu[:17], "seqs": list(seqs[:16]), "local_len": n_local})
            ms = []
            shown = "; ".join(f"rank {members[i]}: cu_seqlens {d['cu']}, seqs {d['seqs']}, {d['local_len']} local "
                              "tokens" for i, d in enumerate(details))
            for p in problems:
                for r in p.ranks or (-1,):
                    text = p.message if ms else f"{p.message} — the packs: {shown}"
                    ms.append(Mismatch("agreement", p.field, r, text, {**p.figures, "details": details},
                                       group=tuple(members), **where))
            t.verdicts.emit(ms, consistent=True, force_raise=any(p.field in _STRUCTURAL for p in problems))
            return  # (log policy) the labels check needs an agreed pack
    if t.opts.labels == "next_token":
        check_labels(t, mb, scope, cu, state)


def _real(mb: Any) -> Optional[tuple]:
    """The microbatch's real offsets, when it describes padding (``cu_seqlens_real``)."""
    real = getattr(mb, "cu_seqlens_real", None)
    return None if real is None else tuple(offsets_list(real))


def check_labels(t: Tracker, mb: Any, scope: CPScope, cu: list, state: MicrobatchRecord) -> None:
    """The labels must be the next token of the same document in the zigzag-ordered microbatch."""
    cp = scope.size
    ids = mb.input_ids.reshape(-1).to(torch.int64)
    labels = mb.labels.reshape(-1).to(torch.int64)
    if ids.numel() != labels.numel() or cu[-1] != ids.numel() * cp:
        t.verdicts.emit([Mismatch("layout", "lengths", me(),
                         f"the microbatch holds {ids.numel()} local tokens and {labels.numel()} labels, but "
                         f"cu_seqlens[-1]={cu[-1]} at {describe(scope)} means {cu[-1] // cp} local tokens",
                         {}, step=state.step, microbatch=state.index, group=group_of(scope))],
               consistent=cp == 1)
        return
    t.verdicts.count("layout")
    dev = collective_device(scope.group, ids.device) if cp > 1 else ids.device
    full = gather_zigzag(torch.stack([ids, labels]).to(dev), cu, scope, dim=1, timeout=t.opts.timeout)  # [2, T]
    fid, flab = full[0], full[1]
    seg = segment_ids(cu, dev)
    target = flab != t.opts.ignore_index
    ok = torch.zeros_like(target)
    ok[:-1] = (seg[1:] == seg[:-1]) & (fid[1:] == flab[:-1])
    bad = target & ~ok
    n_bad = int(bad.sum())
    if not n_bad:
        return
    first = int(torch.nonzero(bad)[0])
    doc = int(seg[first])
    nxt = int(fid[first + 1]) if first + 1 < fid.numel() and int(seg[first + 1]) == doc else None
    t.verdicts.emit([Mismatch(
        "layout", "labels", -1,
        f"{n_bad} of {int(target.sum())} targets are not the next token of their document once the group's tokens "
        f"are put back in zigzag order (first: document {doc}, position {first - cu[doc]}: target {int(flab[first])}, "
        f"next token {nxt}): the microbatch was not sharded in cpscope's zigzag layout (a foreign sharder), or its "
        "labels were made after sharding. (Labels that are not next-token targets: sentinel(labels=None).)",
        {"bad": n_bad, "targets": int(target.sum()), "first_doc": doc, "first_pos": first - cu[doc]},
        step=state.step, microbatch=state.index, group=group_of(scope))], consistent=True)


def check_loss(t: Tracker, used: int, num_targets: int, device: Optional[torch.device], step: Optional[int]) -> None:
    """World collective: Σ_ranks targets used == the ``num_targets`` each rank divides its loss sum by."""
    if not dist.is_initialized():
        world, rows = 1, [[used, num_targets]]
    else:
        world = dist.get_world_size()
        gathered = exchange(None, {"used": used, "num_targets": num_targets}, collective_device(None, device),
                            timeout=t.opts.timeout, what="loss normalisation")
        rows = [[r["used"], r["num_targets"]] for r in gathered]
    t.verdicts.count("loss-normalisation")
    total = sum(r[0] for r in rows)
    bad = [r for r in range(world) if rows[r][1] != total]
    if not bad:
        return
    per_rank = {r: {"targets_used": rows[r][0], "num_targets": rows[r][1]} for r in range(world)}
    ms = [Mismatch(
        "loss-normalisation", "num_targets", r,
        f"rank {r} divides its loss sum by num_targets={rows[r][1]}, but the targets the loss uses sum to {total} "
        f"over the world (per rank used/divisor: {[tuple(x) for x in rows]}); the world-sum of the losses is then "
        f"{total / rows[r][1] if rows[r][1] else float('inf'):.4g}x the per-token mean. Count the real targets of "
        "the global batch once (cpscope.train.global_num_targets)",
        {"num_targets": rows[r][1], "world_targets": total, "per_rank": per_rank}, step=step)
        for r in bad]
    t.verdicts.emit(ms, consistent=True)
