"""The CUDA glue of ``cpscope.attention.blocks`` on CPU, against fake aten kernels: which placeholders a dense
block's backward receives when blocks run on several devices.

The dense kernels' backward takes placeholder outputs of their forward (cum_seq_q/k, philox seed/offset). Each
device must get those of a forward on that same device, whatever order the devices run in, and the kept
placeholders must never be a tensor returned to the caller. Two devices are stood in by ``cpu`` and ``meta``
tensors; the real kernels are checked on GPU (tests/attention/test_gpu.py).
"""
from __future__ import annotations

import pytest
import torch

from cpscope.attention import blocks


class _FakeKernel:
    """One fake aten overload: records its calls, answers with ``fn``."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def default(self, *args, **kwargs):
        self.calls.append(args)
        return self.fn(*args, **kwargs)


class _FakeAten:
    """Fake dense cuDNN / flash kernels whose placeholders name the device they were made for."""

    def __init__(self):
        self.seeds: dict[tuple[str, str], torch.Tensor] = {}

        def forward(kernel):
            def fn(q, k, v, *args, **kwargs):  # [b, h, s, d] views
                b, h, s, d = q.shape
                seed = torch.full((), 1000 + len(self.seeds), dtype=torch.long, device=q.device)
                self.seeds[(kernel, q.device.type)] = seed
                lse_shape = (b, h, s, 1) if kernel == "cudnn" else (b, h, s)
                return (torch.zeros(b, h, s, d, device=q.device), torch.zeros(lse_shape, device=q.device), None,
                        None, s, s, seed, torch.zeros((), dtype=torch.long, device=q.device), None)
            return fn

        def backward(*args, **kwargs):
            dout, q, k, v = args[:4]
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

        self._scaled_dot_product_cudnn_attention = _FakeKernel(forward("cudnn"))
        self._scaled_dot_product_flash_attention = _FakeKernel(forward("flash"))
        self._scaled_dot_product_cudnn_attention_backward = _FakeKernel(backward)
        self._scaled_dot_product_flash_attention_backward = _FakeKernel(backward)


@pytest.fixture
def fake_aten(monkeypatch):
    aten = _FakeAten()
    monkeypatch.setattr(blocks, "_aten", aten)
    monkeypatch.setattr(blocks, "_AUX", {})
    return aten


@pytest.mark.parametrize("use_cudnn", [True, False])
def test_dense_placeholders_per_device(fake_aten, monkeypatch, use_cudnn):
    monkeypatch.setattr(blocks, "_USE_CUDNN", use_cudnn)
    kernel = "cudnn" if use_cudnn else "flash"
    bwd = getattr(fake_aten, f"_scaled_dot_product_{kernel}_attention_backward")
    seed_at = 6 if use_cudnn else 12  # where the seed sits among the backward's arguments
    qs = {dev: torch.zeros(1, 4, 2, 8, device=dev) for dev in ("cpu", "meta")}
    outs = {dev: blocks._cuda_forward(q, q, q, 0.5, True, None) for dev, q in qs.items()}  # cpu first, then meta
    assert set(blocks._AUX) == {(kernel, torch.device("cpu")), (kernel, torch.device("meta"))}
    for dev in ("meta", "cpu"):  # backward in the other order
        q, (out, lse) = qs[dev], outs[dev]
        blocks._cuda_backward(torch.zeros_like(out), q, q, q, out, lse, 0.5, True, None)
        assert bwd.calls[-1][seed_at] is fake_aten.seeds[(kernel, dev)], dev  # that device's own forward's
    # what is kept never shares memory with what a block returned (cpu: meta tensors have no memory)
    kept = {t.untyped_storage().data_ptr() for (_, dev), aux in blocks._AUX.items() if dev.type == "cpu"
            for t in aux if t is not None}
    out, lse = outs["cpu"]
    assert kept and kept.isdisjoint({out.untyped_storage().data_ptr(), lse.untyped_storage().data_ptr()})


def test_dense_backward_without_forward_on_that_device_raises(fake_aten):
    q = torch.zeros(1, 4, 2, 8)
    out, lse = blocks._cuda_forward(q, q, q, 0.5, False, None)
    m = q.to("meta")
    with pytest.raises(RuntimeError, match="meta"):
        blocks._cuda_backward(m, m, m, m, m, lse.to("meta"), 0.5, False, None)
    blocks._cuda_backward(torch.zeros_like(out), q, q, q, out, lse, 0.5, False, None)  # its own device: fine
