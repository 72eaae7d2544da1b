"""megatron-core's Mamba2 and gated-DeltaNet mixers stay refused by the runtime-CP adapter, with the reason.

megatron-core 0.19.2 cannot build a hybrid ``MambaModel`` on CPU: its ``MambaMixer`` raises ``ImportError`` without
``mamba_ssm`` (CUDA / Triton kernels); its ``GatedDeltaNet`` runs flash-linear-attention's Triton kernels, CUDA only.
So nothing on CPU can verify a binding, and ``enable_runtime_cp`` refuses both with a message naming the packages and
what to use instead (transformers' hybrids through ``cpscope.integrations.hf.enable_runtime_cp``, or
``cpscope.linear``).
"""
from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")

import cpscope.linear  # noqa: E402
from cpscope.integrations.megatron import enable_runtime_cp  # noqa: E402
from cpscope.integrations.megatron._mixers import LINEAR_MIXER_REFUSALS  # noqa: E402


def _model_with(mixer: str) -> torch.nn.Module:
    """A module tree holding a stand-in of megatron-core's ``mixer`` class (the refusal reads class names)."""
    model = torch.nn.Module()
    model.config = SimpleNamespace(num_moe_experts=None)
    model.add_module("mixer", type(mixer, (torch.nn.Module,), {})())
    return model


@pytest.mark.parametrize("mixer,needs", [("MambaMixer", ("mamba_ssm", "causal_conv1d", "MambaContextParallel")),
                                         ("GatedDeltaNet", ("flash-linear-attention", "Triton", "CUDA only"))])
def test_linear_mixers_are_refused_with_the_reason_and_the_alternative(mixer, needs):
    with pytest.raises(ValueError) as err:
        enable_runtime_cp(_model_with(mixer))
    message = str(err.value)
    assert message.startswith("enable_runtime_cp: not supported with runtime CP: ") and f"{mixer} modules" in message
    for word in needs + ("static CP group", "cpscope.integrations.hf.enable_runtime_cp", "cpscope.linear."):
        assert word in message, (word, message)
    for name in ("mamba2_scan", "gated_delta_rule", "causal_conv1d"):  # what the messages point to exists
        if f"cpscope.linear.{name}" in message:
            assert callable(getattr(cpscope.linear, name))
    assert set(LINEAR_MIXER_REFUSALS) == {"MambaMixer", "GatedDeltaNet"}


def test_the_reason_holds_megatron_mamba_mixer_needs_mamba_ssm():
    """The premise of the refusal: without mamba_ssm, megatron-core's MambaMixer cannot even be constructed."""
    if importlib.util.find_spec("mamba_ssm") is not None:
        pytest.skip("mamba_ssm is installed here")
    from megatron.core.ssm import mamba_mixer

    assert mamba_mixer.HAVE_MAMBA_SSM is False
    with pytest.raises(ImportError, match="mamba-ssm"):
        mamba_mixer.MambaMixer(SimpleNamespace(), submodules=None, d_model=8)  # raises before reading either
