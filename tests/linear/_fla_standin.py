"""A stand-in for flash-linear-attention on a machine without a GPU.

``standin()`` puts three fake modules in ``sys.modules`` — ``fla.ops.gated_delta_rule``, ``fla.ops.kda``,
``fla.ops.simple_gla`` — whose chunk functions check each call against fla 0.6.0's documented contract (keyword
names, one packed row with ``cu_seqlens``, ``cu_seqlens_cpu`` on the host and equal to ``cu_seqlens``, one initial
state per run of shape ``[N, HV, K, V]`` (``[N, H, V, K]`` with ``state_v_first``), fp32 initial states for KDA,
outputs cast to ``q``'s dtype) and then compute with cpscope's torch kernels; and it makes
``cpscope.linear._fla.usable`` say yes. So cpscope's fla path — the adapter, the geometry handed to the kernel, the
summaries, the exchange, the read — runs on CPU exactly as on a GPU, with the torch chunk code in place of Triton.
Each call is recorded in ``CALLS`` (name, keyword arguments).

``FLA_KEYWORDS`` lists the keywords cpscope passes to each function; ``test_kernels`` checks them against the
installed fla's signatures.
"""
from __future__ import annotations

import contextlib
import sys
import types
from typing import Any, Iterator
from unittest import mock

import torch

from cpscope.linear import _fla
from cpscope.linear._kernels import torch_delta_rule, torch_simple_gla

CALLS: list[tuple[str, dict[str, Any]]] = []

_DELTA_KW = ("scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel", "cu_seqlens",
             "cu_seqlens_cpu")
FLA_KEYWORDS = {
    ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"): _DELTA_KW,
    ("fla.ops.kda", "chunk_kda"): _DELTA_KW,
    ("fla.ops.simple_gla", "chunk_simple_gla"): ("scale", "initial_state", "output_final_state", "state_v_first",
                                                 "cu_seqlens", "cu_seqlens_cpu"),
}


def _check(name: str, keywords: tuple[str, ...], q: torch.Tensor, v: torch.Tensor, kw: dict[str, Any],
           state_shape: tuple[int, int]) -> None:
    unknown = set(kw) - set(keywords)
    assert not unknown, f"{name}: keywords fla does not take: {sorted(unknown)}"
    cu, cu_cpu, s0 = kw.get("cu_seqlens"), kw.get("cu_seqlens_cpu"), kw.get("initial_state")
    runs = q.shape[0]
    if cu is not None:
        assert q.shape[0] == 1, f"{name}: cu_seqlens needs one packed row, got batch {q.shape[0]}"
        assert cu.dtype in (torch.int32, torch.int64) and cu.device == q.device, (cu.dtype, cu.device)
        assert int(cu[-1]) == q.shape[1], f"{name}: cu_seqlens[-1]={int(cu[-1])} for {q.shape[1]} tokens"
        runs = cu.numel() - 1
        if cu_cpu is not None:
            assert cu_cpu.device.type == "cpu" and cu_cpu.tolist() == cu.tolist(), (cu_cpu, cu)
    if s0 is not None:
        want = (runs, v.shape[2], *state_shape)
        assert tuple(s0.shape) == want, f"{name}: initial_state {tuple(s0.shape)}, fla wants {want}"
        if name == "chunk_kda":
            assert s0.dtype in (torch.float32, torch.float64), f"chunk_kda: initial_state must be fp32, got {s0.dtype}"
    CALLS.append((name, dict(kw)))


def _delta(name: str):
    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, **kw: Any):
        if name == "chunk_kda":
            assert g.dim() == 4, "chunk_kda takes a per-channel gate"
        else:
            assert g.dim() == 3, "chunk_gated_delta_rule takes one gate per head"
        _check(name, _DELTA_KW, q, v, kw, (k.shape[-1], v.shape[-1]))
        o, final = torch_delta_rule(q, k, v, g, beta, **kw)
        return o.to(q.dtype), final  # fla returns o in q's dtype, the final state in fp32

    return fn


def _simple_gla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, **kw: Any):
    keywords = FLA_KEYWORDS["fla.ops.simple_gla", "chunk_simple_gla"]
    state = (v.shape[-1], k.shape[-1]) if kw.get("state_v_first") else (k.shape[-1], v.shape[-1])
    _check("chunk_simple_gla", keywords, q, v, kw, state)
    o, final = torch_simple_gla(q, k, v, g, **kw)
    return o.to(q.dtype), final


@contextlib.contextmanager
def standin() -> Iterator[list]:
    """Within the block, cpscope's fla path runs on CPU with the checked stand-ins; yields :data:`CALLS`."""
    mods = {}
    for (mod_name, fn_name), _ in FLA_KEYWORDS.items():
        mod = types.ModuleType(mod_name)
        setattr(mod, fn_name, _simple_gla if fn_name == "chunk_simple_gla" else _delta(fn_name))
        mods[mod_name] = mod
    CALLS.clear()
    with mock.patch.dict(sys.modules, mods), mock.patch.object(_fla, "usable", lambda x, gated_backward=False: True):
        yield CALLS
