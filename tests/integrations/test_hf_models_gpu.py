"""Today's decoders under ``attn_implementation="cpscope"`` on 2 GPUs (``@pytest.mark.gpu``): bf16 at CP2 (NCCL,
cuDNN / fused kernels for windows, soft-capping, sinks and MLA head dims) vs. the same weights with
``attn_implementation="eager"`` in float32 on one GPU.

The tiny configs of ``test_hf_models`` at 512 tokens with a 96-token window (several zigzag chunks at CP2); MoE layers
route every token to every expert (``num_experts_per_tok`` = experts) so that bf16 rounding cannot flip a top-k
choice. Checked: each rank's logits (‖a−b‖/‖b‖ ≤ 2e-2), the CP-summed loss (≤ 1e-2 relative) and the CP-summed
gradients of all parameters as one vector (≤ 3e-2).

Run: ``python -m pytest tests/integrations/test_hf_models_gpu.py`` on a machine with 2 GPUs.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import cpscope  # noqa: E402
from cpscope.integrations import hf as cphf  # noqa: E402
from tests.attention._reference import zigzag_index  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402
from tests.integrations.test_hf_models import VOCAB, _CLASSES, _config, _grads  # noqa: E402

pytestmark = pytest.mark.gpu

SEQ, WINDOW = 512, 96
DOCS = [128, 256, 128]
FAMILIES = ("gpt_oss", "gemma2", "mistral", "qwen3", "deepseek_v3")


def _gpu_config(family: str):
    cfg = _config(family)
    cfg.max_position_embeddings = 2 * SEQ
    if getattr(cfg, "sliding_window", None):
        cfg.sliding_window = WINDOW
    for experts in ("num_local_experts", "n_routed_experts"):
        if getattr(cfg, experts, None):
            cfg.num_experts_per_tok = getattr(cfg, experts)  # every expert: no top-k choice to flip
    return cfg


def _pair(family: str, device: torch.device, dtype: torch.dtype = torch.bfloat16):
    cls = getattr(transformers, _CLASSES[family])
    cfg = _gpu_config(family)
    torch.manual_seed(0)
    model = cls._from_config(copy.deepcopy(cfg), attn_implementation="cpscope")
    ref = cls._from_config(copy.deepcopy(cfg), attn_implementation="eager")
    ref.load_state_dict(model.state_dict())
    return model.to(device, dtype), ref.to(device, torch.float32)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _family_at_cp2(family: str, packed: bool, device_type: str = "cuda") -> bool:
    """(``device_type="cpu"``: the same checks in float32 on gloo, to try the test itself without a GPU.)"""
    cuda = device_type == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    g2 = cpscope.new_cp_groups([2])[2]
    model, ref = _pair(family, device, torch.bfloat16 if cuda else torch.float32)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (1 if packed else 2, SEQ), generator=gen).to(device)
    batch = {"input_ids": ids, "labels": ids}
    spans = [(0, SEQ)]
    if packed:
        batch["position_ids"] = torch.cat([torch.arange(n) for n in DOCS]).unsqueeze(0).to(device)
        starts = torch.cumsum(torch.tensor([0] + DOCS[:-1]), 0).tolist()
        spans = [(s, s + n) for s, n in zip(starts, DOCS)]
    logits = torch.cat([ref(input_ids=ids[:, a:b], use_cache=False).logits for a, b in spans], 1)
    target = torch.full_like(ids, -100)
    for a, b in spans:
        target[:, a:b - 1] = ids[:, a + 1:b]
    ref_loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), target.reshape(-1), ignore_index=-100)
    ref_loss.backward()
    with cpscope.runtime_cp(g2):
        out = model(**cphf.shard_batch(batch))
    out.loss.backward()
    cu = [0] + torch.cumsum(torch.tensor(DOCS), 0).tolist() if packed else [0, SEQ]
    idx = zigzag_index(cu, 2, dist.get_rank(g2)).to(device)
    assert _rel(out.logits, logits.detach().index_select(1, idx)) <= 2e-2, family
    loss = out.loss.detach().float().clone()
    dist.all_reduce(loss, group=g2)
    assert abs(float(loss) - float(ref_loss)) <= 1e-2 * float(ref_loss), (family, float(loss), float(ref_loss))
    grads, ref_grads = _grads(model), _grads(ref)
    for g in grads.values():
        dist.all_reduce(g, group=g2)
    flat = torch.cat([grads[n].float().flatten() for n in sorted(grads)])
    ref_flat = torch.cat([ref_grads[n].float().flatten() for n in sorted(ref_grads)])
    assert _rel(flat, ref_flat) <= 3e-2, (family, _rel(flat, ref_flat))
    return True


@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "packed"])
def test_models_at_cp2_match_eager_on_one_gpu(packed):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    for family in FAMILIES:
        assert run_ranks(2, _family_at_cp2, family, packed, backend="nccl") == [True, True]
