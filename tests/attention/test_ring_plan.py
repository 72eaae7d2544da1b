"""The ring's plan (``cpscope.attention._ring_plan``) without any process group: over all its steps, every rank's
blocks compute exactly the (query, key) pairs that full attention over the whole sequences allows — each once.

For every step the plan says which K/V the rank holds (``RingStep.src``), which of its Q rows and which of the held
K/V rows the block reads (``q_rows`` / ``kv_rows``), and how the block masks (``RingStep.causal``, the block's
``Varlen`` grouping). The pairs those imply are compared with the pairs the global mask allows, computed from the
global offsets alone (zigzag indices from ``tests/attention/_reference.py``).
"""
from __future__ import annotations

from collections import Counter
from typing import Optional

import pytest
import torch

from cpscope._pack import pack_for
from cpscope.attention._ring_plan import RingPlan, plan_for_pack
from tests.attention._reference import zigzag_index

CPU = torch.device("cpu")


def _cu(lens: list[int]) -> list[int]:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def _doc_pos(cu: list[int]) -> tuple[list[int], list[int]]:
    """Document and position of every global token."""
    doc, pos = [], []
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        doc += [i] * (b - a)
        pos += list(range(b - a))
    return doc, pos


def _block_pairs(qs: list[int], ks: list[int], causal: bool, cu_q: tuple, cu_k: tuple) -> list[tuple[int, int]]:
    """(query, key) pairs of one block: sequence i of the queries against sequence i of the keys; causal with
    flash's bottom-right alignment."""
    pairs = []
    for (a, b), (c, e) in zip(zip(cu_q[:-1], cu_q[1:]), zip(cu_k[:-1], cu_k[1:])):
        n_q, n_k = b - a, e - c
        for i in range(n_q):
            for j in range(n_k):
                if not causal or j - n_k <= i - n_q:
                    pairs.append((qs[a + i], ks[c + j]))
    return pairs


def _plan_pairs(plan: RingPlan, ids_of, varlen: bool) -> list[tuple[int, int]]:
    """Every (query, key) pair the plan's blocks compute on its rank, over all steps."""
    pairs = []
    q_ids = ids_of(plan.rank, "q")
    for i in range(plan.size):
        st = plan.step(i)
        assert st.src == (plan.rank - i) % plan.size and st.index == i
        k_ids = ids_of(st.src, "k")
        if varlen:
            qs = plan.q_rows(q_ids, st).tolist()
            ks = plan.kv_rows(k_ids, st).tolist()
            pairs += _block_pairs(qs, ks, st.causal, st.varlen.cu_q_host, st.varlen.cu_k_host)
        else:  # dense [1, s]: one sequence per block
            qs = plan.q_rows(q_ids[None], st)[0].tolist()
            ks = plan.kv_rows(k_ids[None], st)[0].tolist()
            assert st.varlen is None
            pairs += _block_pairs(qs, ks, st.causal, (0, len(qs)), (0, len(ks)))
    return pairs


def _allowed(cu: list[int], q_ids: list[int], causal: bool, real_len: Optional[list[int]] = None) -> set:
    """The pairs full attention allows for these queries (real keys of the same document; causal: not later)."""
    doc, pos = _doc_pos(cu)
    real = real_len if real_len is not None else [b - a for a, b in zip(cu[:-1], cu[1:])]
    return {(q, k) for q in q_ids for k in range(cu[-1])
            if doc[k] == doc[q] and pos[k] < real[doc[k]] and (not causal or pos[k] <= pos[q])}


def _check(pairs: list[tuple[int, int]], want: set, keep_q=lambda q: True) -> None:
    pairs = [p for p in pairs if keep_q(p[0])]
    twice = [p for p, n in Counter(pairs).items() if n > 1]
    assert not twice, f"pairs computed twice: {twice[:5]}"
    assert set(pairs) == want, (sorted(set(pairs) - want)[:5], sorted(want - set(pairs))[:5])


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lens", [[16], [8, 24, 0, 16]], ids=["one", "docs"])
def test_varlen_steps_cover_the_mask_once(cp, causal, lens):
    lens = [n * cp for n in lens]  # every document divisible by 2cp
    cu = _cu(lens)
    for rank in range(cp):
        plan = plan_for_pack(pack_for(tuple(cu), cp, rank), CPU, causal=causal, scale=1.0)
        pairs = _plan_pairs(plan, lambda r, _: zigzag_index(cu, cp, r), varlen=True)
        _check(pairs, _allowed(cu, zigzag_index(cu, cp, rank).tolist(), causal))


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_dense_steps_cover_the_mask_once(cp, causal):
    s = 4 * cp  # global sequence length
    for rank in range(cp):
        plan = RingPlan(varlen=False, causal=causal, scale=1.0, rank=rank, size=cp, local_len=s // cp)
        pairs = _plan_pairs(plan, lambda r, _: zigzag_index([0, s], cp, r), varlen=False)
        _check(pairs, _allowed([0, s], zigzag_index([0, s], cp, rank).tolist(), causal))


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_padded_steps_see_real_keys_only(cp, causal):
    """Padded documents (layout vs real offsets): real queries see exactly the real keys they may; without a causal
    mask the K/V travel compacted to their real rows (``send_kv``) and the blocks read them as such."""
    real = [5, 3 * cp, 0, 4 * cp + 1]
    lay = [-(-n // (2 * cp)) * 2 * cp for n in real]
    cu, cu_real = _cu(lay), _cu(real)
    doc, pos = _doc_pos(cu)

    def ids_of(r: int, what: str) -> torch.Tensor:
        ids = zigzag_index(cu, cp, r)
        if what == "k" and not causal:  # what rank r sends: its real rows
            ids = ids.index_select(0, pack_for(tuple(cu_real), cp, r, cu_seqlens_padded=tuple(cu)).real_rows(CPU))
        return ids

    for rank in range(cp):
        pack = pack_for(tuple(cu_real), cp, rank, cu_seqlens_padded=tuple(cu))
        plan = plan_for_pack(pack, CPU, causal=causal, scale=1.0)
        assert plan.compact == (not causal)
        if plan.compact:
            mine = zigzag_index(cu, cp, rank)
            assert plan.send_kv(mine).tolist() == ids_of(rank, "k").tolist()
        q_ids = zigzag_index(cu, cp, rank).tolist()
        is_real = lambda q: pos[q] < real[doc[q]]  # noqa: E731 - padding rows are zeroed after the ring
        _check(_plan_pairs(plan, ids_of, varlen=True), _allowed(cu, [q for q in q_ids if is_real(q)], causal, real),
               keep_q=is_real)
