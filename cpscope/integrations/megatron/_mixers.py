"""Why megatron-core's linear-time mixers (Mamba2, gated DeltaNet) stay refused by the runtime-CP adapter.

cpscope binds only what its tests can check against a float64 reference on CPU. megatron-core 0.19.2's
``MambaMixer`` raises ``ImportError`` at construction without the ``mamba_ssm`` package (its forward runs
``mamba_split_conv1d_scan_combined`` / ``mamba_chunk_scan_combined`` Triton kernels and ``causal_conv1d``'s CUDA
kernel), so a hybrid ``MambaModel`` cannot be built on CPU; its ``GatedDeltaNet`` builds where
flash-linear-attention is installed, but its forward runs fla's Triton kernels, CUDA only. Both carry their own CP
path (sequence swapped for heads by all-to-alls over the static group), which would ignore the runtime scope.
:data:`LINEAR_MIXER_REFUSALS` holds the message :func:`cpscope.integrations.megatron.enable_runtime_cp` raises for
each, with what to use instead: transformers' hybrid models through :func:`cpscope.integrations.hf.enable_runtime_cp`,
or cpscope's CP-aware core (:mod:`cpscope.linear`) in one's own mixer.

Example::

    LINEAR_MIXER_REFUSALS["MambaMixer"]      # 'MambaMixer modules (their own CP path ... mamba_ssm ...)'
"""
from __future__ import annotations

__all__ = ["LINEAR_MIXER_REFUSALS"]

LINEAR_MIXER_REFUSALS = {
    "MambaMixer": (
        "MambaMixer modules (their own CP path, MambaContextParallel, swaps sequence for heads with all-to-alls over "
        "the static CP group; megatron-core 0.19.2's MambaMixer cannot be built without the mamba_ssm package "
        "(mamba_split_conv1d_scan_combined / mamba_chunk_scan_combined Triton kernels, RMSNormGated) and runs "
        "causal_conv1d's CUDA kernel, so no CPU build of a hybrid MambaModel exists to verify a binding against; "
        "train Mamba2 hybrids through transformers (Nemotron-H, Bamba, Granite 4, Falcon-H1) with "
        "cpscope.integrations.hf.enable_runtime_cp, or call cpscope.linear.mamba2_scan and "
        "cpscope.linear.causal_conv1d in your own mixer)"),
    "GatedDeltaNet": (
        "GatedDeltaNet modules (their own CP path swaps sequence for heads with all-to-alls over the static CP "
        "group; megatron-core 0.19.2's GatedDeltaNet needs flash-linear-attention, whose chunk_gated_delta_rule and "
        "causal_conv1d are Triton kernels that run on CUDA only, so no CPU run exists to verify a binding against; "
        "train gated-DeltaNet hybrids through transformers (Qwen3.5, Qwen3-Next) with "
        "cpscope.integrations.hf.enable_runtime_cp, or call cpscope.linear.gated_delta_rule and "
        "cpscope.linear.causal_conv1d in your own mixer)"),
}
