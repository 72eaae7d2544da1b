"""The window's plan (``cpscope.attention._halo_plan``) without any process group.

For every rank, the blocks of its :class:`HaloGeometry` compute exactly the (query, key) pairs the global mask
allows for its real queries — documents, causality, the window, padding — each once; and the rows it receives from
each source are exactly the rows that source sends it, which are exactly the distinct keys of other ranks its
queries may see: the halo lower bound, met with equality. Blocks the window masks out are not in the plan.
"""
from __future__ import annotations

import random
import pytest
import torch

from cpscope._pack import pack_for
from cpscope.attention._halo_plan import HaloGeometry, effective_window
from tests.attention._reference import zigzag_index

CPU = torch.device("cpu")


def _cu(lens: list[int]) -> list[int]:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def _rows(r) -> list[int]:
    return list(range(r.start, r.start + r.length)) if r.index is None else r.index.tolist()


def _block_mask(nq: int, nk: int, causal: bool, window) -> torch.Tensor:
    """[nq, nk] bool: the block kernel's mask (bottom-right aligned; -1 unbounded; causal: right 0)."""
    left, right = window if window is not None else (-1, -1)
    off = torch.arange(nk)[None, :] - (torch.arange(nq)[:, None] + nk - nq)
    ok = torch.ones(nq, nk, dtype=torch.bool)
    if left != -1:
        ok &= off >= -left
    if right != -1:
        ok &= off <= right
    return ok & (off <= 0) if causal else ok


def _allowed(cu, real, causal, window) -> torch.Tensor:
    """[T, T] bool over global layout indices: the pairs full attention allows (real tokens only)."""
    left, right = window
    t = cu[-1]
    doc, pos = torch.zeros(t, dtype=torch.long), torch.zeros(t, dtype=torch.long)
    for d, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        doc[a:b], pos[a:b] = d, torch.arange(b - a)
    real_t = pos < torch.tensor(real, dtype=torch.long)[doc] if t else torch.zeros(0, dtype=torch.bool)
    ok = (doc[:, None] == doc[None, :]) & real_t[:, None] & real_t[None, :]
    if causal:
        ok &= pos[None, :] <= pos[:, None]
    if left != -1:
        ok &= pos[None, :] >= pos[:, None] - left
    if right != -1:
        ok &= pos[None, :] <= pos[:, None] + right
    return ok


def check_plan(lens, real, cp, window, causal) -> dict:
    """Every rank's plan against the global mask; returns rank 0's counters."""
    cu = _cu(lens)
    padded = real != lens
    cu_real = _cu(real)
    packs = [pack_for(cu_real, cp, r, cu_seqlens_padded=cu) if padded else pack_for(cu, cp, r) for r in range(cp)]
    band = effective_window(window, causal, max(lens))
    assert band is not None
    geos = [HaloGeometry(p, CPU, band, causal) for p in packs]
    idx = [zigzag_index(cu, cp, r) for r in range(cp)]
    allowed = _allowed(cu, real, causal, band)
    for r, geo in enumerate(geos):
        got = torch.zeros(cu[-1], cu[-1], dtype=torch.long)  # times each global pair is computed
        for src, blocks in geo.blocks.items():
            sent = None if src == r else geos[src].sends[r]  # buffer row -> src's local row
            for blk in blocks:
                qs, ks, kl = _rows(blk.q), _rows(blk.k), _rows(blk.k_local)
                # the compacted rows are the same keys as the source's local rows
                assert (ks if sent is None else sent[ks].tolist()) == kl
                cq, ck = blk.varlen.cu_q_host, blk.varlen.cu_k_host
                for p in range(len(cq) - 1):
                    i, j = torch.nonzero(_block_mask(cq[p + 1] - cq[p], ck[p + 1] - ck[p], blk.causal,
                                                     blk.window), as_tuple=True)
                    gq = idx[r][torch.tensor(qs[cq[p]:cq[p + 1]], dtype=torch.long)[i]]
                    gk = idx[src][torch.tensor(kl[ck[p]:ck[p + 1]], dtype=torch.long)[j]]
                    got.index_put_((gq, gk), torch.ones_like(gq), accumulate=True)
        want = torch.zeros_like(got)
        want[idx[r]] = allowed[idx[r]].long()
        assert torch.equal(got, want), (r, torch.nonzero(got != want)[:8].tolist())
        assert geo.counters()["pairs"] == int(want.sum())
        # halo lower bound: the distinct keys of other ranks this rank's queries may see — received exactly
        mine = torch.zeros(cu[-1], dtype=torch.bool)
        mine[idx[r]] = True
        needed = int((want.sum(0).bool() & ~mine).sum())
        for src, n in geo.recv_rows.items():
            assert geos[src].sends[r].numel() == n
        assert geo.counters()["rows_received"] == needed, (r, geo.recv_rows, needed)
    return geos[0].counters()


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_halo_blocks_are_the_allowed_pairs(cp):
    m = 2 * cp
    rnd = random.Random(cp)
    cases = [([8 * m], [8 * m], (3, 0), True), ([8 * m], [8 * m], (5, 2), False),  # window < chunk
             ([4 * m, m, 3 * m], [4 * m, m, 3 * m], (9, 0), True),  # spans chunks; a document shorter than it
             ([4 * m, 2 * m], [4 * m, 2 * m], (-1, 3), False), ([3 * m, 3 * m], [3 * m, 3 * m], (2, -1), False),
             ([4 * m, 0, 2 * m], [4 * m - 3, 0, m + 1], (3, 0), True),  # padding (real lengths), an empty document
             ([4 * m, 2 * m], [3 * m + 1, 2 * m - 1], (2, 4), False)]
    for _ in range(2):
        lens = [m * rnd.randint(1, 4) for _ in range(rnd.randint(1, 3))]
        causal = rnd.random() < 0.5
        window = (rnd.randint(0, 10), 0 if causal else rnd.choice([-1, rnd.randint(0, 10)]))
        if effective_window(window, causal, max(lens)) is not None:
            cases.append((lens, lens, window, causal))
    for lens, real, window, causal in cases:
        check_plan(lens, real, cp, window, causal)


def test_short_window_sends_only_halos_and_skips_blocks():
    """CP4, one 4096-token sequence, a causal 64-token window: each rank receives at most 2 x 64 rows — rank 0
    (chunk 0 has no left halo) and rank 3 (chunk 4's left neighbour, chunk 3, is its own) 64 — and sends as much;
    it computes 4 (rank 0: 3) of the (query chunk, key chunk) pieces — 2 diagonals and their halos — where the
    causal ring computes 2·cp + 1 = 9 (rank 0: 2 diagonals, chunk 7 against chunks 0..6), the rest being masked
    out."""
    cp, n = 4, 4096
    packs = [pack_for([0, n], cp, r) for r in range(cp)]
    for r, p in enumerate(packs):
        c = HaloGeometry(p, CPU, (64, 0), True).counters()
        edge = r in (0, cp - 1)
        assert c["rows_received"] == c["rows_sent"] == (64 if edge else 128), (r, c)
        halos = 1 if r == 0 else 2  # rank 3's second halo (chunk 3 before chunk 4) is local
        assert c["pieces"] == 2 + halos and c["blocks"] == c["pieces"], c
        chunk = n // (2 * cp)
        band = 2 * (chunk * 65 - 64 * 65 // 2)  # two diagonal blocks: every query sees itself and 64 before
        assert c["pairs"] == band + halos * 64 * 65 // 2, c  # plus the halo triangles
        assert c["area"] == 2 * chunk * chunk + halos * 64 * 64, c


def test_effective_window():
    assert effective_window(None, True, 100) is None
    assert effective_window((99, 0), True, 100) is None  # sees everything causal does
    assert effective_window((98, 3), True, 100) == (98, 0)
    assert effective_window((99, 99), False, 100) is None
    assert effective_window((5, 99), False, 100) == (5, -1)
    assert effective_window((-1, 4), False, 100) == (-1, 4)
