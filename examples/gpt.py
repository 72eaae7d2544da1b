"""A small GPT whose attention and RoPE run under whatever CP scope is active.

The model never sees a process group: :func:`cpscope.apply_rotary_pos_emb` and
:func:`cpscope.attention.context_parallel_attention` read the group bound by ``runtime_cp`` in the caller.
Inputs are packed ``thd``: ``input_ids`` ``[T_local]`` (this rank's zigzag tokens), ``cu_seqlens`` the **global**
padded document offsets, ``max_seqlen`` the longest global document. Under CP1 it is an ordinary GPT.

``GPTConfig(checkpoint=True)`` checkpoints every block with :func:`cpscope.checkpoint` (its recompute in backward
re-enters the CP scope of the forward).

Example::

    model = GPT(GPTConfig(vocab_size=256, hidden=64, n_layers=2, n_heads=4))
    with cpscope.runtime_cp(groups[2]):
        logits = model(mb.input_ids, cu_seqlens=mb.cu_seqlens, max_seqlen=mb.max_seqlen)   # [T_local, vocab]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

import cpscope
from cpscope.attention import context_parallel_attention
from cpscope.rope import RotaryEmbedding, apply_rotary_pos_emb

__all__ = ["GPTConfig", "GPT", "Block"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    hidden: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: Optional[int] = None  # < n_heads: grouped-query attention
    mlp_ratio: int = 4
    rope_base: float = 10000.0
    checkpoint: bool = False  # activation checkpointing of every block (cpscope.checkpoint: recompute in scope)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    def __post_init__(self) -> None:
        if self.hidden % self.n_heads or self.n_heads % self.kv_heads or self.head_dim % 2:
            raise ValueError(
                f"GPTConfig: hidden={self.hidden} must divide into n_heads={self.n_heads} heads of even size, and "
                f"n_heads must be a multiple of n_kv_heads={self.kv_heads}"
            )


@torch.compiler.disable  # under torch.compile the CP part stays eager: scope read, index math, ring collectives
def _rope_and_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, freqs: torch.Tensor,
                        cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    q = apply_rotary_pos_emb(q, freqs, qkv_format="thd", cu_seqlens=cu_seqlens)  # global positions
    k = apply_rotary_pos_emb(k, freqs, qkv_format="thd", cu_seqlens=cu_seqlens)
    return context_parallel_attention(q, k, v, qkv_format="thd", causal=True, cu_seqlens=cu_seqlens,
                                      max_seqlen=max_seqlen)  # [t, h, d]


class Block(nn.Module):
    """Pre-norm transformer block: RMSNorm → QKV → RoPE → CP attention → proj; RMSNorm → MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, h, hkv = cfg.head_dim, cfg.n_heads, cfg.kv_heads
        self.norm1 = nn.RMSNorm(cfg.hidden, eps=1e-6)
        self.qkv = nn.Linear(cfg.hidden, (h + 2 * hkv) * d, bias=False)
        self.proj = nn.Linear(h * d, cfg.hidden, bias=False)
        self.norm2 = nn.RMSNorm(cfg.hidden, eps=1e-6)
        self.fc1 = nn.Linear(cfg.hidden, cfg.mlp_ratio * cfg.hidden, bias=False)
        self.fc2 = nn.Linear(cfg.mlp_ratio * cfg.hidden, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        if self.cfg.checkpoint and torch.is_grad_enabled():  # the recompute re-enters this forward's CP scope
            return cpscope.checkpoint(self._forward, x, freqs, cu_seqlens, max_seqlen)
        return self._forward(x, freqs, cu_seqlens, max_seqlen)

    def _forward(self, x: torch.Tensor, freqs: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        cfg = self.cfg
        t = x.shape[0]
        d, h, hkv = cfg.head_dim, cfg.n_heads, cfg.kv_heads
        q, k, v = self.qkv(self.norm1(x)).split([h * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.view(t, h, d), k.view(t, hkv, d), v.view(t, hkv, d)  # [t, heads, d]
        o = _rope_and_attention(q, k, v, freqs, cu_seqlens, max_seqlen)  # [t, h, d]
        x = x + self.proj(o.reshape(t, h * d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


class GPT(nn.Module):
    """Token embedding, ``n_layers`` :class:`Block` s, final RMSNorm and an (untied) LM head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.hidden, eps=1e-6)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, base=cfg.rope_base)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / (2 * self.cfg.n_layers) ** 0.5 if name.endswith(("proj.weight", "fc2.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, input_ids: torch.Tensor, *, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        """``input_ids`` ``[T_local]`` → logits ``[T_local, vocab]`` (``cu_seqlens`` / ``max_seqlen`` global)."""
        freqs = self.rotary(max_seqlen, device=input_ids.device)  # [max_seqlen, 1, 1, head_dim] fp32
        x = self.embed(input_ids)  # [t, hidden]
        for block in self.blocks:
            x = block(x, freqs, cu_seqlens, max_seqlen)
        return self.lm_head(self.norm(x))
