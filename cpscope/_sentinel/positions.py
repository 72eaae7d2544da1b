"""The sentinel's position checks: cpscope's RoPE, transformers' ``position_ids``, and your own RoPE's positions.

The expected positions are the global zigzag positions of the active group (``cpscope.zigzag_positions``:
restarting at 0 per document in ``thd``). RoPE is checked through the scope it rotated with (its positions follow
from the scope and the offsets): a RoPE that used another group — ``group=`` with the build-time group, a scope
captured at construction — while a runtime scope is bound is reported with the positions that differ. An
activation recompute (in backward) of a sampled RoPE call is checked against the scope of its forward.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..scope import CPScope
from ..sharding import zigzag_positions
from . import recompute
from .agree import hash64
from .comm import describe, group_of, me, same_scope
from .report import Mismatch
from .state import MicrobatchRecord, Tracker, cut_mismatch, in_backward, offsets_list

__all__ = ["on_rope", "on_hf_positions", "check_user_positions", "compare_positions"]


def _expected(cu_or_len: Any, scope: CPScope, n_local: int, device: torch.device) -> tuple[Optional[torch.Tensor], str]:
    """The zigzag positions ``scope`` expects for this layout, or ``(None, why)`` when it cannot hold it at all."""
    try:
        pos = zigzag_positions(cu_or_len, scope.size, scope.rank, device=device)
    except ValueError as e:
        return None, str(e)
    if pos.numel() != n_local:
        return None, f"{describe(scope)} holds {pos.numel()} local tokens of this layout, the tensor has {n_local}"
    return pos, ""


def compare_positions(got: torch.Tensor, expected: torch.Tensor, *, row_offset: bool = False) -> Optional[dict]:
    """``None`` when ``got`` (``[n]`` or ``[b, n]``) equals ``expected`` ``[n]`` in every row (``row_offset``: up to
    a constant per row, as under CP1), else the figures: how many differ, the first, the largest difference."""
    g = got.reshape(-1, got.shape[-1]).to(torch.long)
    e = expected.to(g.device, torch.long)[None, :]
    if g.shape[-1] != e.shape[-1]:
        return {"count": g.shape[-1], "of": e.shape[-1], "first": 0, "got": None, "expected": None,
                "max_delta": None, "note": f"{g.shape[-1]} positions for {e.shape[-1]} local tokens"}
    delta = g - e
    if row_offset:
        delta = delta - delta[:, :1]
    bad = delta != 0
    n_bad = int(bad.sum())
    if not n_bad:
        return None
    row, col = (int(i) for i in torch.nonzero(bad)[0])
    return {"count": n_bad, "of": int(bad.numel()), "row": row, "first": col, "got": int(g[row, col]),
            "expected": int(e[0, col]), "max_delta": int(delta.abs().max())}


def _figures_text(f: dict) -> str:
    if f.get("got") is None:
        return f["note"]
    row = f" (row {f['row']})" if f.get("row") else ""
    return (f"{f['count']} of {f['of']} local positions differ, first at local token {f['first']}{row}: position "
            f"{f['got']}, expected {f['expected']} (max |Δ| {f['max_delta']})")


def on_rope(t: Tracker, scope: CPScope, cu: tuple, qkv_format: str, x: torch.Tensor) -> None:
    """Hook in ``apply_rotary_pos_emb`` (after validation): ``scope`` is what RoPE rotates with, ``cu`` the offsets."""
    shape = tuple(x.shape)
    if in_backward():  # recompute: the forward of this call recorded its scope
        recompute.check(t, _rope_signature(cu, qkv_format, x), x, scope, "RoPE")
        return
    mb = t.current("rope", scope)
    if not mb.sampled:
        return
    t.verdicts.count("rope")
    foreign = t.cuts.foreign({"the rotated tensor": x}, scope)
    if foreign is not None:  # found alike by every rank that cut alike: at once under CP1, else at the next verdict
        t.verdicts.emit([cut_mismatch("RoPE", foreign, scope, mb.where(mb.calls))], consistent=scope.size == 1)
    mb.unverified += 1
    recompute.remember(t, _rope_signature(cu, qkv_format, x), x, scope, mb.where(mb.calls))
    expected = t.expected_scope(mb)
    seq = 0 if qkv_format == "thd" else (shape[1] if qkv_format == "bshd" else shape[0])
    if expected is None or same_scope(expected, scope):
        mb.rope_layouts.append(("thd", tuple(cu)) if qkv_format == "thd" else ("dense", seq * scope.size))
        return
    _report_rope_scope(t, mb, scope, expected, list(cu) if qkv_format == "thd" else None, seq,
                       shape[0] if qkv_format == "thd" else seq)


def _rope_signature(cu: tuple, qkv_format: str, x: torch.Tensor) -> tuple:
    """What a RoPE call is (dense layouts: ``cu = [0, s·cp]`` depends on the scope; ``thd`` offsets do not)."""
    return ("rope", qkv_format, tuple(x.shape), str(x.dtype), hash64(tuple(cu)) if qkv_format == "thd" else None)


def _report_rope_scope(t: Tracker, mb: MicrobatchRecord, scope: CPScope, expected: CPScope, cu: Optional[list],
                       seq: int, n_local: int) -> None:
    """RoPE rotated with ``scope`` while ``expected`` is active: the positions it used against the expected ones."""
    used = zigzag_positions(cu if cu is not None else seq * scope.size, scope.size, scope.rank)
    want, why = _expected(cu if cu is not None else seq * expected.size, expected, n_local, used.device)
    if want is None:
        text, figs = why, {"note": why}
    else:
        figs = compare_positions(used, want) or {"count": 0}
        text = _figures_text(figs) if figs.get("count") else "the positions happen to agree"
    t.verdicts.emit([Mismatch(
        "rope", "positions", me(),
        f"RoPE rotated with {describe(scope)} (its group= / a scope captured at construction) while the active scope "
        f"is {describe(expected)}: {text}", {**figs, "used": describe(scope), "active": describe(expected)},
        **mb.where(mb.calls), group=group_of(expected))],
        consistent=expected.size == 1)


def _check(t: Tracker, got: torch.Tensor, cu: Optional[list], scope: CPScope, what: str, mb: MicrobatchRecord,
           call: Optional[int]) -> None:
    n_local = got.shape[-1]
    layout = list(cu) if cu is not None else n_local * scope.size
    want, why = _expected(layout, scope, n_local, got.device)
    t.verdicts.count("positions")
    mb.unverified += 1
    if want is None:
        figs: Optional[dict] = {"note": why}
        text = why
    else:
        figs = compare_positions(got, want, row_offset=scope.size == 1 and cu is None)
        if figs is None:
            return
        text = _figures_text(figs)
    t.verdicts.emit([Mismatch(
        "positions", what, me(),
        f"{what} are not the zigzag positions of the active {describe(scope)} "
        f"({'packed, cu_seqlens ' + str(list(cu)[:9]) if cu is not None else 'one sequence per row'}): {text}. "
        "Shard inputs and position_ids with cpscope (zigzag_shard / integrations.hf.shard_batch) for the active group",
        figs, **mb.where(call), group=group_of(scope))],
        consistent=scope.size == 1)


def on_hf_positions(t: Tracker, position_ids: Optional[torch.Tensor], scope: CPScope, local_len: int,
                    cu_seqlens: Optional[torch.Tensor], layer_idx: Optional[int]) -> None:
    """Hook in the transformers attention function: the ``position_ids`` the model (its RoPE) received."""
    if position_ids is None or in_backward() or layer_idx not in (None, 0):
        return
    mb = t.current("hf", scope)
    if mb.sampled:
        _check_given(t, position_ids, cu_seqlens, t.expected_scope(mb) or scope, "position_ids (transformers)", mb,
                     layer_idx)


def check_user_positions(t: Tracker, position_ids: torch.Tensor, cu_seqlens: Any, scope: CPScope, where: str) -> None:
    """``cpscope.sentinel.check_positions``: your own RoPE's positions against the zigzag positions of ``scope``."""
    mb = t.current("positions", scope)
    if mb.sampled:
        _check_given(t, position_ids, cu_seqlens, scope, where, mb, None)


def _check_given(t: Tracker, position_ids: torch.Tensor, cu_seqlens: Any, scope: CPScope, what: str,
                 mb: MicrobatchRecord, call: Optional[int]) -> None:
    """Positions as given (``[n]`` / ``[b, n]``; one row when packed with global offsets ``cu_seqlens``)."""
    cu = offsets_list(cu_seqlens) if cu_seqlens is not None else None
    got = position_ids.reshape(1, -1) if cu is not None else position_ids.reshape(-1, position_ids.shape[-1])
    _check(t, got, cu, scope, what, mb, call)
