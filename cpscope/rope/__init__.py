"""CP-aware rotary position embedding: RoPE at the global positions of the local zigzag tokens.

* :mod:`~cpscope.rope._api` — :func:`apply_rotary_pos_emb`, :class:`RotaryEmbedding`, :func:`rotary_freqs`.
* :mod:`~cpscope.rope._kernel` — the Triton kernel used on CUDA; :mod:`~cpscope.rope._te` — TransformerEngine's
  fused RoPE, used when TE is importable (optional, imported only then); :mod:`~cpscope.rope._torch_math` — the plain
  torch math, eager (CPU, inside a user's ``torch.compile``) or ``torch.compile``-d (CUDA without Triton or TE).
  ``checked_rope_inputs``, ``te_rope`` and ``call_te_rope`` are shared with :mod:`cpscope.integrations.te` (not part
  of the public API).

Example::

    freqs = cpscope.RotaryEmbedding(rot_dim=64)(max_seqlen=8192)
    with cpscope.runtime_cp(groups[2]):
        q = cpscope.apply_rotary_pos_emb(q_local, freqs, qkv_format="bshd")
"""
from ._te import call_te_rope, te_rope
from ._api import RotaryEmbedding, apply_rotary_pos_emb, checked_rope_inputs, rotary_freqs

__all__ = ["apply_rotary_pos_emb", "RotaryEmbedding", "rotary_freqs"]
