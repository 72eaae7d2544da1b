"""TransformerEngine baselines for the GPU attention benchmark (imported only where TE is installed).

``DotProductAttention`` single-GPU and CP ``p2p`` (DualChunkSwap = zigzag, the layout cpscope uses), BSHD and THD,
MHA or GQA (``kv_heads``), bf16, causal, forward + backward; timed with CUDA events, median of ``iters`` after
``warmup`` (the same method as ``torch_cp_baseline.median_ms``), or with a caller's timer (``timer=``). The CP group is bound with ``set_context_parallel_group`` and an auxiliary stream
from ``cpscope.cp_stream()``.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist


def te_available() -> bool:
    """Import TE if installed, and check that torch still has its own cuDNN afterwards.

    TE's core library pulls cuDNN sub-libraries by soname; a system cuDNN found first (seen: 9.14 in
    /usr/lib/x86_64-linux-gnu beside torch's bundled 9.19) shadows torch's, and torch then refuses its cuDNN or
    falls back from cuDNN to flash SDPA for the baselines. ``benchmarks/gpu_checks.sh`` puts torch's cuDNN folder
    first in ``LD_LIBRARY_PATH``; without that, TE is switched off here with the reason, not measured wrongly."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # report why: a silent "off" hides a broken install
        print(f"TransformerEngine unavailable: {type(e).__name__}: {e}", flush=True)
        return False
    try:
        torch.backends.cudnn.version()
    except RuntimeError as e:
        print(f"TransformerEngine off: after importing it torch's cuDNN is shadowed ({e}). Put torch's "
              "nvidia/cudnn/lib first in LD_LIBRARY_PATH (benchmarks/gpu_checks.sh does).", flush=True)
        return False
    return torch.cuda.is_available()


def _median_ms(fn, iters: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _module(heads: int, dim: int, fmt: str, group: Optional[dist.ProcessGroup], kv_heads: Optional[int] = None):
    from transformer_engine.pytorch import DotProductAttention

    import cpscope

    mask = "causal" if fmt != "thd" else "padding_causal"
    attn = DotProductAttention(heads, dim, num_gqa_groups=kv_heads or heads, attn_mask_type=mask, qkv_format=fmt)
    if group is not None and group.size() > 1:
        attn.set_context_parallel_group(group, cpscope.group_ranks(group), cpscope.cp_stream(), "p2p")
    return attn


def _time(step: Callable[[], None], iters: int, timer: Optional[Any]) -> float:
    return timer.median_ms(step) if timer is not None else _median_ms(step, iters)


def measure_te_bshd(seqlen: int, group: Optional[dist.ProcessGroup] = None, heads: int = 32, dim: int = 128,
                    iters: int = 10, kv_heads: Optional[int] = None, timer: Optional[Any] = None) -> float:
    """Median ms of TE causal fwd+bwd on this rank's share of a ``seqlen`` sequence (whole sequence if no group).

    ``kv_heads`` < ``heads``: grouped-query attention (TE's ``num_gqa_groups``). ``timer``: an object with
    ``median_ms(step)`` (``benchmarks/_bench_util.Timer``) instead of the fixed 3 + ``iters`` calls."""
    cp = 1 if group is None else group.size()
    attn = _module(heads, dim, "bshd", group, kv_heads)
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(1, seqlen // cp, h, dim) for h in (heads, kv_heads or heads, kv_heads or heads)]
    q, k, v = (torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
               for s in shapes)
    dout = torch.ones(1, seqlen // cp, heads * dim, device="cuda", dtype=torch.bfloat16)

    def step():
        for t in (q, k, v):
            t.grad = None
        o = attn(q, k, v)
        o.backward(dout.view_as(o))

    return _time(step, iters, timer)


def measure_te_thd(doc_lens: list[int], group: Optional[dist.ProcessGroup] = None, heads: int = 32, dim: int = 128,
                   iters: int = 10, kv_heads: Optional[int] = None, timer: Optional[Any] = None) -> float:
    """Median ms of TE varlen causal fwd+bwd over packed documents (global ``doc_lens``, each divisible by 2·cp).

    ``kv_heads`` and ``timer`` as in :func:`measure_te_bshd`."""
    cp = 1 if group is None else group.size()
    attn = _module(heads, dim, "thd", group, kv_heads)
    cu = torch.tensor([0] + list(torch.tensor(doc_lens).cumsum(0).tolist()), dtype=torch.int32, device="cuda")
    total, max_len = int(sum(doc_lens)), int(max(doc_lens))
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(total // cp, h, dim) for h in (heads, kv_heads or heads, kv_heads or heads)]
    q, k, v = (torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
               for s in shapes)

    def step():
        for t in (q, k, v):
            t.grad = None
        o = attn(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
                 max_seqlen_q=max_len, max_seqlen_kv=max_len)
        o.backward(torch.ones_like(o))

    return _time(step, iters, timer)
