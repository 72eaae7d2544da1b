"""Real TransformerEngine (2.20.2) attention features under cpscope's binding on 2 GPUs (``@pytest.mark.gpu``).

A ``DotProductAttention`` built without CP, with a sliding window (``window_size=(31, 0)``), with sinks
(``softmax_type="learnable"``) or with multi-latent head dims (``kv_channels=(64, 32)``), runs CP2 under
``runtime_cp`` through :class:`ScopedDotProductAttention` with each CP comm type TE runs the feature with; each
rank's output and q/k/v gradients match the same module at CP1 on the full tokens, cut with zigzag indices, and the
learnable offset's gradient summed over the CP group matches its CP1 gradient (bf16: ‖a−b‖/‖b‖ ≤ 1e-2). A comm type
TE does not run the feature with raises ``ValueError`` before TE runs; ``"auto"`` picks one that does.

Run: ``python -m pytest tests/integrations/test_te_features_gpu.py`` on a machine with 2 GPUs and TE installed.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

te = pytest.importorskip("transformer_engine.pytorch")

import cpscope  # noqa: E402
from cpscope.integrations.te import ScopedDotProductAttention  # noqa: E402
from cpscope.sharding import zigzag_indices, zigzag_shard  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402
from tests.integrations.test_te_gpu import _assert_rel, _device, _needs_two_gpus  # noqa: E402

pytestmark = pytest.mark.gpu

H, HKV, D, DV, SEQ, BATCH = 8, 2, 64, 32, 256, 2
CASES = {  # feature -> (DotProductAttention keywords, the comm types to run, one to refuse)
    "window": (dict(window_size=(31, 0)), ("all_gather", "a2a", "auto"), "p2p"),
    "sinks": (dict(softmax_type="learnable"), ("a2a", "auto"), "all_gather"),
    "mla": (dict(kv_channels=(D, DV)), ("p2p", "auto"), "a2a"),
}


def _inputs(dv: int, device: torch.device) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    q = torch.randn(BATCH, SEQ, H, D, generator=gen)
    k = torch.randn(BATCH, SEQ, HKV, D, generator=gen)
    v = torch.randn(BATCH, SEQ, HKV, dv, generator=gen)
    dout = torch.randn(BATCH, SEQ, H * dv, generator=gen)  # TE returns [b, s, h*dv]
    return [t.to(device=device, dtype=torch.bfloat16) for t in (q, k, v, dout)]


def _run(attn: Any, core: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    core.zero_grad(set_to_none=True)
    out = attn(q, k, v)
    out.backward(dout)  # outside the scope
    offset = getattr(core, "softmax_offset", None)
    sink_grad = None if offset is None or offset.grad is None else offset.grad.detach().clone()
    return [out.detach(), q.grad, k.grad, v.grad], sink_grad


def _feature_at_cp2(feature: str) -> bool:
    device = _device()
    g2 = cpscope.new_cp_groups([2])[2]
    kw, comms, refused = CASES[feature]
    kw = {"kv_channels": D, **kw}
    dv = kw["kv_channels"][1] if isinstance(kw["kv_channels"], tuple) else D
    core = te.DotProductAttention(H, num_gqa_groups=HKV, qkv_format="bshd", attn_mask_type="causal", **kw).to(device)
    q, k, v, dout = _inputs(dv, device)
    with cpscope.runtime_cp(None):
        ref, ref_sink = _run(ScopedDotProductAttention(core), core, q, k, v, dout)
    for comm in comms:
        attn = ScopedDotProductAttention(core, cp_comm_type=comm)
        with cpscope.runtime_cp(g2):
            scope = cpscope.capture_scope()
            got, sink = _run(attn, core, *(zigzag_shard(t, seq_dim=1) for t in (q, k, v, dout)))
        idx = zigzag_indices(SEQ, scope.size, scope.rank, device=device)
        for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
            _assert_rel(g, r.index_select(1, idx), f"{feature} {comm} CP2 {name}")
        if ref_sink is not None:
            dist.all_reduce(sink, group=g2)
            _assert_rel(sink, ref_sink, f"{feature} {comm} CP2 softmax_offset grad")
    with cpscope.runtime_cp(g2), pytest.raises(ValueError, match="TransformerEngine 2.20.2 runs"):
        ScopedDotProductAttention(core, cp_comm_type=refused)(*(zigzag_shard(t, seq_dim=1) for t in (q, k, v)))
    return True


@pytest.mark.parametrize("feature", sorted(CASES))
def test_te_feature_at_cp2_matches_cp1(feature):
    _needs_two_gpus()
    assert run_ranks(2, _feature_at_cp2, feature, backend="nccl") == [True, True]
