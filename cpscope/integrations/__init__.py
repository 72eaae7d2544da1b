"""Optional adapters that drop cpscope into models written for other libraries.

Each submodule imports its library only when it is itself imported (or, for TransformerEngine, when first used);
``import cpscope`` and ``import cpscope.integrations`` import none of them.

* :mod:`cpscope.integrations.hf` — ``import cpscope.integrations.hf`` registers the attention function
  ``"cpscope"`` with Hugging Face transformers; :func:`cpscope.integrations.hf.shard_batch` shards a batch
  (``input_ids``, ``labels`` shifted before sharding, ``position_ids``, packed ``cu_seq_lens``) for the active scope.
* :mod:`cpscope.integrations.te` — :class:`~cpscope.integrations.te.ScopedDotProductAttention` binds the active
  group to a TransformerEngine ``DotProductAttention`` for each forward and restores its build-time settings;
  :func:`~cpscope.integrations.te.te_apply_rotary_pos_emb` calls TE's (fused) RoPE with the active CP size / rank.
* :mod:`cpscope.integrations.megatron` — :func:`~cpscope.integrations.megatron.enable_runtime_cp` makes a
  megatron-core 0.19.2 model follow each microbatch's CP group (imports megatron-core only when called); the data
  bridge and :class:`~cpscope.integrations.megatron.PlannerScheduler` (Megatron's scheduler interface);
  :func:`~cpscope.integrations.megatron.packed_seq_scope` turns a ``PackedSeqParams`` into a cpscope scope.

Example::

    import cpscope.integrations.hf  # registers "cpscope" with transformers
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="cpscope")
"""

__all__: list[str] = []  # a namespace: each adapter is its own module, imported only when used
