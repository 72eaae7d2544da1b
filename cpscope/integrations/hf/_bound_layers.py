"""The token-mixing layers of transformers' hybrid decoders, bound to the CP scope: their forward on zigzag shards.

Each mixin below replaces one family's ``forward`` (through :func:`cpscope.integrations._swap.swap_class`, so the
module keeps its class name, parameters and ``state_dict``) with the same computation whose token-mixing steps —
the causal short convolution and the recurrence — are cpscope's CP-aware core functions
(:func:`cpscope.linear.causal_conv1d`, :func:`cpscope.linear.gated_delta_rule`, :func:`cpscope.linear.mamba2_scan`):

* :class:`GatedDeltaNetCP` — gated DeltaNet (Qwen3.5 ``in_proj_qkv/z/b/a``, Qwen3-Next ``in_proj_qkvz/ba``);
* :class:`KimiDeltaAttentionCP` — Kimi Delta Attention (per-channel gate);
* :class:`Mamba2MixerCP` — Mamba2 (Nemotron-H, Bamba, Granite 4 hybrids; Falcon-H1 with its multipliers);
* :class:`ShortConvCP` — LFM2's gated short convolution.

Every forward reads the active scope **once** and hands its group to each core call; the packed batch's global
document offsets come from the ``cu_seq_lens_q`` / ``cu_seq_lens_k`` keyword arguments that transformers passes to
every layer, read by the attention function's own helper (one source of truth), so each document starts from a zero
state. With a cache (generation) the layer runs its own forward at CP1 and raises under CP > 1.

Example::

    swap_class(layer.linear_attn, GatedDeltaNetCP)     # enable_runtime_cp does this for every mixer
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ...linear import causal_conv1d, gated_delta_rule, mamba2_scan
from ...scope import CPScope, resolve_scope
from ._inputs import check_mask, packed_offsets

__all__ = ["GatedDeltaNetCP", "KimiDeltaAttentionCP", "Mamba2MixerCP", "ShortConvCP", "MIXINS"]

_CACHE_KEYS = ("cache", "cache_params", "past_key_values")


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32 at least (the models' ``.float()`` against fp16 overflow), float64 kept."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


class _BoundMixer:
    """Shared prelude: the scope (once), the cache / mask refusals and the packed offsets of this forward."""

    _cpscope_conv_name = "conv1d"

    # The attributes the mixin's forward reads; a module lacking one is not bound by it.
    _cpscope_needs: tuple[str, ...] = ()

    @classmethod
    def _cpscope_binds(cls, module: nn.Module) -> bool:
        """Whether this mixin's forward can run ``module`` (it has every attribute the forward reads)."""
        return all(hasattr(module, name) for name in cls._cpscope_needs)

    def forward(self, hidden_states: torch.Tensor, cache: Any = None, attention_mask: Optional[torch.Tensor] = None,
                **kwargs: Any) -> torch.Tensor:
        scope = resolve_scope()  # read once, here in forward; every core call below gets its group
        if cache is None:
            cache = next((kwargs[k] for k in _CACHE_KEYS if kwargs.get(k) is not None), None)
        if cache is not None:
            if scope.size > 1:
                raise ValueError(
                    f"{type(self).__name__} (layer {getattr(self, 'layer_idx', '?')}): generation does not run "
                    f"under context parallelism (a cache was passed under CP{scope.size}); generate outside the scope"
                )
            return super().forward(hidden_states, cache=cache, attention_mask=attention_mask,  # type: ignore[misc]
                                   **{k: v for k, v in kwargs.items() if k not in _CACHE_KEYS})
        if attention_mask is not None:
            check_mask(attention_mask)  # padding cannot be honoured (packed rows carry documents instead)
        cu, _ = packed_offsets(kwargs)
        if cu is not None and hidden_states.shape[0] != 1:
            raise ValueError(f"{type(self).__name__}: packed documents (cu_seq_lens) with batch size "
                             f"{hidden_states.shape[0]}; pack into one row")
        self._cpscope_fire_hooks()
        return self._cpscope_mix(hidden_states, scope, cu)

    def _cpscope_fire_hooks(self) -> None:
        """accelerate offloading: the conv weight is read directly (not through its forward), so fire its hook."""
        hook = getattr(getattr(self, self._cpscope_conv_name), "_hf_hook", None)
        if hook is not None:
            hook.pre_forward(getattr(self, self._cpscope_conv_name))

    def _cpscope_conv(self, x: torch.Tensor, scope: CPScope, cu: Any, activation: Optional[str]) -> torch.Tensor:
        """The depthwise causal conv of ``x [b, t, d]`` (channels last) under ``scope``, then ``activation``."""
        conv: nn.Conv1d = getattr(self, self._cpscope_conv_name)
        y = causal_conv1d(x.to(conv.weight.dtype), conv.weight.squeeze(1), conv.bias, cu_seqlens=cu,
                          group=scope.group)
        if activation is not None:
            from transformers.activations import ACT2FN

            y = ACT2FN[activation](y)
        return y.to(x.dtype)

    def _cpscope_mix(self, hidden_states: torch.Tensor, scope: CPScope, cu: Any) -> torch.Tensor:
        raise NotImplementedError


class GatedDeltaNetCP(_BoundMixer):
    """Gated DeltaNet (Qwen3.5 / Qwen3-Next ``*GatedDeltaNet``) on zigzag shards."""

    _cpscope_needs = ("conv1d", "A_log", "dt_bias", "norm", "out_proj", "key_dim", "value_dim", "head_k_dim",
                      "head_v_dim", "activation")
    _NEXT = ("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering")  # Qwen3-Next's projections
    _SPLIT = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")  # Qwen3.5's

    @classmethod
    def _cpscope_binds(cls, module: nn.Module) -> bool:
        return super()._cpscope_binds(module) and any(all(hasattr(module, n) for n in names)
                                             for names in (cls._NEXT, cls._SPLIT))

    def _cpscope_project(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(mixed_qkv [b, t, conv_dim], z [b, t, hv, dv], b [b, t, hv], a [b, t, hv])`` as the model computes."""
        batch, seqlen = h.shape[:2]
        if hasattr(self, "in_proj_qkvz"):  # Qwen3-Next: interleaved per key head
            q, k, v, z, b, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(h), self.in_proj_ba(h))
            mixed = torch.cat([t.reshape(batch, seqlen, -1) for t in (q, k, v)], dim=-1)
            return mixed, z, b, a
        z = self.in_proj_z(h).reshape(batch, seqlen, -1, self.head_v_dim)
        return self.in_proj_qkv(h), z, self.in_proj_b(h), self.in_proj_a(h)

    def _cpscope_mix(self, hidden_states: torch.Tensor, scope: CPScope, cu: Any) -> torch.Tensor:
        batch, seqlen = hidden_states.shape[:2]
        mixed, z, b, a = self._cpscope_project(hidden_states)
        mixed = self._cpscope_conv(mixed, scope, cu, self.activation)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(batch, seqlen, -1, self.head_k_dim)  # [b, t, hk, dk]
        k = k.reshape(batch, seqlen, -1, self.head_k_dim)
        v = v.reshape(batch, seqlen, -1, self.head_v_dim)  # [b, t, hv, dv]
        beta = b.sigmoid()
        g = -_wide(self.A_log).exp() * F.softplus(_wide(a) + self.dt_bias)  # [b, t, hv], log decay
        o = gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, group=scope.group, use_qk_l2norm=True)
        o = self.norm(o.reshape(-1, o.shape[-1]), z.reshape(-1, z.shape[-1]))
        return self.out_proj(o.reshape(batch, seqlen, -1))


class KimiDeltaAttentionCP(_BoundMixer):
    """Kimi Delta Attention (``KimiLinearDeltaAttention``: a per-channel gate) on zigzag shards."""

    _cpscope_needs = ("q_proj", "k_proj", "v_proj", "conv1d", "forget_gate", "b_proj", "g_a_proj", "g_b_proj",
                      "o_norm", "o_proj", "qkv_dim", "head_dim", "activation")

    def _cpscope_mix(self, hidden_states: torch.Tensor, scope: CPScope, cu: Any) -> torch.Tensor:
        h = hidden_states
        batch, seqlen = h.shape[:2]
        shape = (batch, seqlen, -1, self.head_dim)
        mixed = torch.cat([self.q_proj(h), self.k_proj(h), self.v_proj(h)], dim=-1)
        mixed = self._cpscope_conv(mixed, scope, cu, self.activation)
        q, k, v = (t.reshape(shape) for t in torch.split(mixed, [self.qkv_dim] * 3, dim=-1))  # [b, t, h, d]
        g = self.forget_gate(h)  # [b, t, h, d] per-channel log decay
        beta = torch.sigmoid(self.b_proj(h))
        o = gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, group=scope.group, use_qk_l2norm=True)
        gate = self.g_b_proj(self.g_a_proj(h)).view(shape)
        return self.o_proj(self.o_norm(o, gate).reshape(batch, seqlen, -1))


class Mamba2MixerCP(_BoundMixer):
    """Mamba2 mixers (Nemotron-H, Bamba, Granite 4 hybrid, Falcon-H1) on zigzag shards: conv, then the SSD scan."""

    _cpscope_needs = ("in_proj", "conv1d", "A_log", "D", "dt_bias", "norm", "out_proj", "intermediate_size",
                      "conv_dim", "num_heads", "head_dim", "n_groups", "ssm_state_size", "chunk_size",
                      "time_step_limit", "activation")

    def _cpscope_mix(self, hidden_states: torch.Tensor, scope: CPScope, cu: Any) -> torch.Tensor:
        dtype = hidden_states.dtype
        batch, seqlen = hidden_states.shape[:2]
        h = hidden_states
        if hasattr(self, "ssm_in_multiplier"):  # Falcon-H1's muP multipliers
            h = h * self.ssm_in_multiplier
        projected = self.in_proj(h)
        if hasattr(self, "mup_vector"):
            projected = projected * self.mup_vector
        gate, xbc, dt = projected.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        xbc = self._cpscope_conv(xbc, scope, cu, self.activation)
        groups_state = self.n_groups * self.ssm_state_size
        x, b, c = torch.split(xbc, [self.intermediate_size, groups_state, groups_state], dim=-1)
        y = mamba2_scan(
            x.reshape(batch, seqlen, self.num_heads, self.head_dim), dt, -torch.exp(_wide(self.A_log)),
            b.reshape(batch, seqlen, self.n_groups, self.ssm_state_size),
            c.reshape(batch, seqlen, self.n_groups, self.ssm_state_size),
            D=self.D, dt_bias=self.dt_bias, dt_softplus=True, dt_limit=tuple(self.time_step_limit),
            chunk_size=self.chunk_size, cu_seqlens=cu, group=scope.group,
        ).reshape(batch, seqlen, -1)  # [b, t, h * p], the D skip included
        if getattr(self, "mamba_rms_norm", True):
            y = self.norm(y, gate)
        else:  # Falcon-H1 without its gated norm
            y = y * F.silu(gate)
        return self.out_proj(y.to(dtype))


class ShortConvCP(_BoundMixer):
    """LFM2's gated short convolution (``Lfm2ShortConv``) on zigzag shards."""

    _cpscope_conv_name = "conv"
    _cpscope_needs = ("in_proj", "conv", "out_proj")

    def _cpscope_mix(self, hidden_states: torch.Tensor, scope: CPScope, cu: Any) -> torch.Tensor:
        b, c, x = self.in_proj(hidden_states).chunk(3, dim=-1)  # [b, t, d] each
        y = c * self._cpscope_conv(b * x, scope, cu, None)
        return self.out_proj(y.contiguous())


# The mixins, in the order they are tried (the first whose ``_cpscope_binds`` accepts a module binds it).
MIXINS: tuple[type[_BoundMixer], ...] = (KimiDeltaAttentionCP, GatedDeltaNetCP, Mamba2MixerCP, ShortConvCP)
