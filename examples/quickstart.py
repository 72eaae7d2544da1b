# Run: torchrun --nproc-per-node 2 examples/quickstart.py    (CPU, gloo; the same code runs on GPUs with "nccl")
import torch
import torch.distributed as dist

import cpscope

dist.init_process_group("gloo")
groups = cpscope.new_cp_groups([1, 2])        # collective, once: {1: None, 2: <group of 2 ranks>}
torch.manual_seed(0)                          # every rank builds the same batch of packed documents
heads, dim = 4, 16
freqs = cpscope.rotary_freqs(dim, 256)        # RoPE angles covering the global length

# Hybrid CP: each microbatch picks its CP size; here a long pack on CP2, then a short one without CP.
for cp, lengths in [(2, [96, 160]), (1, [40, 24])]:
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)  # global
    q, k, v = (torch.randn(sum(lengths), heads, dim, requires_grad=True) for _ in range(3))
    with cpscope.runtime_cp(groups[cp]):      # bound for this microbatch's forward only
        ql, kl, vl = (cpscope.zigzag_shard(t, seq_dim=0, cu_seqlens=cu_seqlens) for t in (q, k, v))
        ql = cpscope.apply_rotary_pos_emb(ql, freqs, qkv_format="thd", cu_seqlens=cu_seqlens)
        kl = cpscope.apply_rotary_pos_emb(kl, freqs, qkv_format="thd", cu_seqlens=cu_seqlens)
        out = cpscope.context_parallel_attention(ql, kl, vl, qkv_format="thd", cu_seqlens=cu_seqlens)
    out.sum().backward()                      # backward uses the group captured in forward

    # The same attention on the whole pack without CP, cut to this rank's rows: equal.
    rq, rk = (cpscope.apply_rotary_pos_emb(t, freqs, qkv_format="thd", cu_seqlens=cu_seqlens, group=None)
              for t in (q, k))
    full = cpscope.context_parallel_attention(rq, rk, v, qkv_format="thd", cu_seqlens=cu_seqlens, group=None)
    mine = cpscope.zigzag_shard(full, seq_dim=0, cu_seqlens=cu_seqlens, group=groups[cp])
    err = (out - mine).abs().max().item()
    print(f"rank {dist.get_rank()}: CP{cp} on {out.shape[0]} of {sum(lengths)} tokens, max |out - full| = {err:.1e}")
    assert err < 1e-5
dist.destroy_process_group()
