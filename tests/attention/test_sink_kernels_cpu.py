"""Sinks on a block's final ``(out, lse)`` (``cpscope.attention._sink_kernels``) against a float64 softmax with the
sink as one extra logit (no value), and the sinks' gradient against autograd through that softmax. CPU runs the torch
path; ``tests/attention/test_kernels_gpu.py`` runs the same check on the Triton kernels.
"""
from __future__ import annotations

import pytest
import torch

from cpscope.attention import _sink_kernels


def check_sinks(device: str, layout: str, dtype=torch.bfloat16) -> float:
    """Worst relative error of out', lse' and dsinks; also asserts a row that saw no key gets out 0, lse = sink."""
    g = torch.Generator(device=device).manual_seed(4)
    b, s, h, d = 2, 64, 4, 16
    scores = torch.randn(b, h, s, 24, device=device, dtype=torch.float64, generator=g) * 3
    scores[:, :, 0] = float("-inf")  # row 0 sees no key
    vals = torch.randn(b, h, 24, d, device=device, dtype=torch.float64, generator=g)
    sinks = torch.randn(h, device=device, dtype=torch.float64, generator=g).requires_grad_(True)
    dout = torch.randn(b, s, h, d, device=device, dtype=torch.float64, generator=g)
    # reference: the sink as one more column of the softmax, with a zero value
    full = torch.cat([scores, sinks.view(1, h, 1, 1).expand(b, h, s, 1)], -1)
    ref_out = torch.einsum("bhqk,bhkd->bqhd", torch.softmax(full, -1)[..., :-1], vals)
    ref_lse = torch.logsumexp(full, -1)
    (ref_out * dout).sum().backward()
    # the block's own statistics, then the sinks merged in
    lse = torch.logsumexp(scores, -1).float()
    out = torch.einsum("bhqk,bhkd->bqhd", torch.softmax(scores, -1).nan_to_num(0.0), vals).to(dtype)
    if layout == "thd":
        out, lse, dout = out[0].contiguous(), lse[0].contiguous(), dout[:1]
        ref_out, ref_lse = ref_out[:1], ref_lse[:1]
    _sink_kernels.merge_sinks_(out, lse, sinks.detach().float())
    got_out = out if layout != "thd" else out.unsqueeze(0)
    got_lse = lse if layout != "thd" else lse.unsqueeze(0)
    assert torch.all(got_out[:, 0] == 0) and torch.allclose(got_lse[:, :, 0].double(), sinks.detach().expand(
        got_lse.shape[0], h)), "a row that saw no key: out 0, lse = sink"
    terms = _sink_kernels.sink_terms(dout.to(dtype) if layout != "thd" else dout[0].to(dtype), out, lse,
                                     sinks.detach().float())
    dsinks = terms.reshape(-1, h).sum(0)
    rel = lambda a, r: ((a.double() - r).norm() / r.norm()).item()  # noqa: E731
    errs = [rel(got_out, ref_out), rel(got_lse, ref_lse)]
    if layout != "thd":
        errs.append(rel(dsinks, sinks.grad))
    else:  # one batch row: its own sinks gradient
        s1 = sinks.detach().clone().requires_grad_(True)
        f1 = torch.cat([scores[:1], s1.view(1, h, 1, 1).expand(1, h, s, 1)], -1)
        (torch.einsum("bhqk,bhkd->bqhd", torch.softmax(f1, -1)[..., :-1], vals[:1]) * dout).sum().backward()
        errs.append(rel(dsinks, s1.grad))
    return max(errs)


@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_sinks_torch_path_vs_float64(layout):
    assert check_sinks("cpu", layout) < 1e-2
