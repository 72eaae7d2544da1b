"""A stream of new pack shapes on the GPU, the way a loader feeds CP1 (issue 31): every pack's forward and gradients
against a float64 per-document reference — each new shape builds new graphs, so each is checked, not only the first
(cuDNN's kernel cache with dynamic-shape graphs gave a relative error of 1.14 and NaN gradients on the second shape,
then illegal memory accesses: H100, cuDNN 9.19, frontend 1.32; cpscope does not use it) — and, with Python's cyclic
collector off for the whole stream, nothing the calls allocated is still held afterwards (the cuDNN frontend's
plan-search cycle once kept each new shape's tensors: 3.4 GiB over 100 packs of 16k tokens).

With ``KernelPolicy.defer_builds`` on, a new graph key runs on flash-attention-2 once and is built on its second
sighting: every call is checked too, on both kernels and where forward and backward ran on different ones.

``python -m pytest -m gpu tests/attention/test_pack_stream_gpu.py``
"""
from __future__ import annotations

import gc
import random

import pytest
import torch

import cpscope
from cpscope.attention._kernels import cudnn_frontend, deferral
from cpscope.attention._policy import use_kernel_policy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

H, H_KV, D = 8, 2, 128


def _packs(n: int, tokens: int, seed: int = 0) -> list[list[int]]:
    rng, out = random.Random(seed), []
    for _ in range(n):
        docs = rng.randint(1, 12)
        cuts = sorted(rng.sample(range(1, tokens), docs - 1))
        out.append([0, *cuts, tokens])
    return out


def _reference(q, k, v, dout, cu):
    """float64 causal attention per document (GQA by repeating k/v heads): out, dq, dk, dv."""
    q, k, v = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    outs = []
    for a, e in zip(cu[:-1], cu[1:]):
        qa, ka, va = q[a:e].transpose(0, 1), k[a:e].transpose(0, 1), v[a:e].transpose(0, 1)
        ka, va = (x.repeat_interleave(H // H_KV, dim=0) for x in (ka, va))
        s = (qa @ ka.transpose(1, 2)) / D ** 0.5
        n = e - a
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        outs.append((s.softmax(-1) @ va).transpose(0, 1))
    out = torch.cat(outs)
    return (out, *torch.autograd.grad(out, (q, k, v), dout.double()))


def _rel(a, b) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def _call(q, k, v, dout, cu):
    cu_t = torch.tensor(cu, dtype=torch.int32, device=q.device)
    out = cpscope.context_parallel_attention(q, k, v, qkv_format="thd", cu_seqlens=cu_t,
                                             max_seqlen=max(e - a for a, e in zip(cu[:-1], cu[1:])), causal=True,
                                             group=None)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


def test_every_new_pack_shape_matches_float64():
    dev = torch.device("cuda")
    cudnn_frontend.clear_cache()
    g = torch.Generator(device=dev).manual_seed(0)
    for i, cu in enumerate(_packs(10, 4096)):
        t = cu[-1]
        q, k, v = (torch.randn(t, h, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(True)
                   for h in (H, H_KV, H_KV))
        dout = torch.randn(t, H, D, device=dev, dtype=torch.bfloat16, generator=g)
        got, want = _call(q, k, v, dout, cu), _reference(q, k, v, dout, cu)
        errs = [_rel(a, b) for a, b in zip(got, want)]
        assert max(errs) < 2e-2, f"pack {i} (documents {len(cu) - 1}): out/dq/dk/dv relative errors {errs}"
    assert len(cudnn_frontend.cached_graphs()) >= 4  # the stream did build new graphs


def test_a_stream_of_new_shapes_holds_nothing_with_the_collector_off():
    dev = torch.device("cuda")
    cudnn_frontend.clear_cache()
    g = torch.Generator(device=dev).manual_seed(1)
    t = 8192
    q, k, v = (torch.randn(t, h, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(True)
               for h in (H, H_KV, H_KV))
    dout = torch.randn(t, H, D, device=dev, dtype=torch.bfloat16, generator=g)
    _call(q, k, v, dout, [0, t])  # the process's first call (handles, libraries) before the baseline
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    gc.disable()
    try:
        for cu in _packs(8, t, seed=2):
            _call(q, k, v, dout, cu)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
    finally:
        gc.enable()
    assert held <= 1 << 20, f"{held / 2**20:.1f} MiB held after 8 new pack shapes with the cyclic collector off"


def test_deferred_builds_over_a_stream_of_new_shapes_match_float64():
    """Each new pack twice with deferred builds: the first call of a new graph key on flash-attention-2 (nothing
    built), the second on cuDNN (built then) — forward and gradients against float64 on every call."""
    dev = torch.device("cuda")
    if not cudnn_frontend.available(dev):
        pytest.skip("no cuDNN frontend here: packed blocks run on flash-attention-2 anyway")
    cpscope.clear_caches()  # the graphs and the keys seen
    g = torch.Generator(device=dev).manual_seed(3)
    with use_kernel_policy(defer_builds=True):
        for i, cu in enumerate(_packs(10, 4096, seed=3)):
            for sighting in range(2):
                t = cu[-1]
                q, k, v = (torch.randn(t, h, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(True)
                           for h in (H, H_KV, H_KV))
                dout = torch.randn(t, H, D, device=dev, dtype=torch.bfloat16, generator=g)
                got, want = _call(q, k, v, dout, cu), _reference(q, k, v, dout, cu)
                errs = [_rel(a, b) for a, b in zip(got, want)]
                assert max(errs) < 2e-2, f"pack {i} call {sighting}: out/dq/dk/dv relative errors {errs}"
                if i == 0 and sighting == 0:  # a fresh process state: the first sighting builds nothing
                    assert cudnn_frontend.cached_graphs() == [] and len(deferral.seen_keys()) == 2
        assert len(cudnn_frontend.cached_graphs()) >= 2  # second sightings built their graphs
