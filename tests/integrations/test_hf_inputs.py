"""The HF attention function's per-tensor input checks go through cpscope's one per-tensor cache
(``cpscope._tensor_cache.derived``): remembered per tensor (one host sync, not one per layer), forgotten when the
tensor changes — also behind torch's back — and emptied by ``cpscope.clear_caches()``."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import cpscope  # noqa: E402
from cpscope import _tensor_cache  # noqa: E402
from cpscope.integrations import hf as cphf  # noqa: E402
from cpscope.integrations.hf._inputs import check_mask  # noqa: E402
from cpscope.scope import resolve_scope  # noqa: E402


def test_a_checked_mask_is_remembered_and_cleared():
    cpscope.clear_caches()
    mask = torch.ones(2, 8, dtype=torch.int64)
    check_mask(mask)
    assert _tensor_cache.stats()["derived"] == 1  # remembered: later layers read no mask
    check_mask(mask)
    assert _tensor_cache.stats()["derived"] == 1
    cpscope.clear_caches()
    assert _tensor_cache.stats()["derived"] == 0


def test_a_mask_written_behind_torchs_back_is_checked_again():
    """A loader that refills the buffer a mask tensor views (no in-place version bump): the padding is refused, not
    waved through by what was remembered for the old content."""
    buf = np.ones((2, 8), dtype=np.int64)
    mask = torch.from_numpy(buf)
    check_mask(mask)
    buf[1, :3] = 0
    with pytest.raises(ValueError, match=r"3 zeros \(padding\)"):
        check_mask(mask)
    mask[1, :3] = 1  # through torch: fine again
    check_mask(mask)


def test_position_ids_and_host_ints_are_remembered_per_tensor():
    cpscope.clear_caches()
    scope = resolve_scope(None)  # CP1: one sequence per row, positions from 0
    buf = np.arange(8, dtype=np.int64)[None].copy()
    pid = torch.from_numpy(buf)
    cphf._check_position_ids(pid, scope, 8)
    n = torch.tensor(8)
    assert cphf._host_int(n) == 8 and _tensor_cache.stats()["derived"] == 2
    buf[0, 4:] = np.arange(4)  # a second document, written behind torch's back: not one sequence per row
    with pytest.raises(ValueError, match="local token 4 has position 0, expected 4"):
        cphf._check_position_ids(pid, scope, 8)
    n.fill_(5)
    assert cphf._host_int(n) == 5
