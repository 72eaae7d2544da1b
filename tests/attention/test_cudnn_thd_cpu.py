"""cpscope's cuDNN packed-attention wrapper (``cpscope.attention._cudnn_thd``) on CPU, against a fake cuDNN frontend.

The fake implements the part of the frontend's graph API the wrapper uses and *interprets the memory the way cuDNN
documents it*: logical ``[B, h, S, d]`` tensors with strides, a ragged offset per sequence (elements) replacing the
batch stride, sequence lengths with the padding mask, the softmax stats as ``[B, h, S, 1]`` at the given strides,
causal = top-left diagonal with right bound 0 — reading and writing raw CPU pointers from the variant pack. So a
wrapper that hands cuDNN wrong offsets, strides, a head-sliced view or the lse in the wrong layout gets wrong numbers
here; they are compared with a float64 reference (forward, lse and the gradients given the merged lse).
Real cuDNN is checked on GPU (tests/attention/test_gpu.py, benchmarks/check_cudnn_thd.py).
"""
from __future__ import annotations

import ctypes
import math
import types

import pytest
import torch

from cpscope.attention import _cudnn_thd
from cpscope.attention.blocks import Varlen

_SIZE = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4, torch.int32: 4, torch.int64: 8}


class _T:
    """Fake graph tensor: dims, strides, data type, optional ragged offset tensor."""

    def __init__(self, graph, dim=None, stride=None, data_type=None, name=""):
        self.dim, self.stride, self.dtype, self.name, self.ragged = dim, stride, data_type, name, None
        self.uid = graph.next_uid()

    def set_ragged_offset(self, t):
        self.ragged = t
        return self

    def set_output(self, flag):
        return self

    def set_dim(self, d):
        self.dim = list(d)
        return self

    def set_stride(self, s):
        self.stride = list(s)
        return self

    def set_data_type(self, t):
        self.dtype = t
        return self

    def get_uid(self):
        return self.uid


class _Graph:
    def __init__(self, cudnn, io_data_type, intermediate_data_type, compute_data_type, handle):
        self.cudnn, self.io, self.ops, self._uid = cudnn, io_data_type, [], 0

    def next_uid(self):
        self._uid += 1
        return self._uid

    def tensor(self, name="", dim=None, stride=None, data_type=None):
        return _T(self, dim, stride, data_type, name)

    def sdpa(self, name, q, k, v, generate_stats, attn_scale, use_padding_mask, seq_len_q, seq_len_kv,
             diagonal_alignment=None, diagonal_band_right_bound=None):
        assert generate_stats and use_padding_mask
        o, st = _T(self, data_type=self.io, name="o"), _T(self, name="stats")
        self.ops.append(("fwd", dict(q=q, k=k, v=v, o=o, stats=st, sq=seq_len_q, sk=seq_len_kv, scale=attn_scale,
                                     causal=diagonal_band_right_bound == 0, align=diagonal_alignment)))
        return o, st

    def sdpa_backward(self, name, q, k, v, o, dO, stats, attn_scale, use_padding_mask, seq_len_q, seq_len_kv,
                      max_total_seq_len_q, max_total_seq_len_kv, diagonal_alignment=None,
                      diagonal_band_right_bound=None):
        dq, dk, dv = (_T(self, data_type=self.io, name=n) for n in ("dq", "dk", "dv"))
        self.ops.append(("bwd", dict(q=q, k=k, v=v, o=o, do=dO, stats=stats, dq=dq, dk=dk, dv=dv, sq=seq_len_q,
                                     sk=seq_len_kv, scale=attn_scale, causal=diagonal_band_right_bound == 0,
                                     align=diagonal_alignment, max_q=max_total_seq_len_q,
                                     max_k=max_total_seq_len_kv)))
        return dq, dk, dv

    def validate(self):
        pass

    build_operation_graph = check_support = build_plans = validate

    def create_execution_plans(self, modes):
        pass

    def get_workspace_size(self):
        return 0

    # ---- execution: read/write raw CPU memory as cuDNN would
    def execute(self, pack, workspace, handle=None, tensor_uids=None):
        if tensor_uids is not None:  # the ordered form: buffers in the order of tensor_uids
            assert len(set(tensor_uids)) == len(tensor_uids) == len(pack)
            pack = {uid: t.data_ptr() for uid, t in zip(tensor_uids, pack)}
        for kind, p in self.ops:
            (self._fwd if kind == "fwd" else self._bwd)(p, pack)

    def _torch_dtype(self, t):
        dt = self.cudnn.data_type
        return {dt.BFLOAT16: torch.bfloat16, dt.HALF: torch.float16, dt.FLOAT: torch.float32,
                dt.INT32: torch.int32, dt.INT64: torch.int64}[t.dtype]

    def _raw(self, ptr, n, dtype):
        buf = (ctypes.c_char * (n * _SIZE[dtype])).from_address(ptr)
        return torch.frombuffer(buf, dtype=dtype)

    def _ints(self, t, pack):
        n = t.dim[0]
        return self._raw(pack[t.uid], n, self._torch_dtype(t)).tolist()

    def _index(self, t, pack, b, n):
        """Flat element indices of sequence ``b``'s first ``n`` rows: [h, n, d]."""
        _, h, s, d = t.dim
        _, sh, ss, sd = t.stride
        assert n <= s, f"{t.name}: sequence of {n} rows exceeds the graph's S={s}"
        offs = self._ints(t.ragged, pack)
        idx = (offs[b] + torch.arange(h)[:, None, None] * sh + torch.arange(n)[None, :, None] * ss
               + torch.arange(d)[None, None, :] * sd)
        # a packed ragged tensor ends at its last offset: reading or writing past it is a layout bug (and, with raw
        # pointers, memory corruption), so refuse it
        assert n == 0 or int(idx.max()) < offs[-1], f"{t.name}: sequence {b} reaches past the packed tensor's end"
        return idx

    def _load(self, t, pack, b, n):
        idx = self._index(t, pack, b, n)
        if n == 0:
            return torch.zeros(idx.shape, dtype=torch.float64)
        flat = self._raw(pack[t.uid], int(idx.max()) + 1, self._torch_dtype(t))
        return flat[idx].double()

    def _store(self, t, pack, b, n, val):
        idx = self._index(t, pack, b, n)
        if n == 0:
            return
        flat = self._raw(pack[t.uid], int(idx.max()) + 1, self._torch_dtype(t))
        flat[idx.flatten()] = val.to(flat.dtype).flatten()

    def _scores(self, p, pack, b, lq, lk):
        q, k = self._load(p["q"], pack, b, lq), self._load(p["k"], pack, b, lk)
        g = q.shape[0] // k.shape[0]
        s = torch.einsum("hqd,hkd->hqk", q, k.repeat_interleave(g, 0)) * p["scale"]
        if p["causal"]:
            assert p["align"] == self.cudnn.diagonal_alignment.TOP_LEFT
            s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool).triu(1), float("-inf"))
        return q, k, g, s

    def _fwd(self, p, pack):
        for b, (lq, lk) in enumerate(zip(self._ints(p["sq"], pack), self._ints(p["sk"], pack))):
            _, _, g, s = self._scores(p, pack, b, lq, lk)
            v = self._load(p["v"], pack, b, lk).repeat_interleave(g, 0)
            self._store(p["o"], pack, b, lq, torch.softmax(s, -1) @ v)
            self._store(p["stats"], pack, b, lq, torch.logsumexp(s, -1)[..., None])

    def _bwd(self, p, pack):
        lens = list(zip(self._ints(p["sq"], pack), self._ints(p["sk"], pack)))
        assert p["max_q"] >= sum(a for a, _ in lens) and p["max_k"] >= sum(c for _, c in lens)
        for b, (lq, lk) in enumerate(lens):
            q, k, g, s = self._scores(p, pack, b, lq, lk)
            v = self._load(p["v"], pack, b, lk).repeat_interleave(g, 0)
            do, o = self._load(p["do"], pack, b, lq), self._load(p["o"], pack, b, lq)
            lse = self._load(p["stats"], pack, b, lq)  # [h, n, 1]
            pr = torch.exp(s - lse)
            dp = do @ v.transpose(1, 2)
            ds = pr * (dp - (do * o).sum(-1, keepdim=True))
            hk = k.shape[0]
            self._store(p["dq"], pack, b, lq, ds @ k.repeat_interleave(g, 0) * p["scale"])
            self._store(p["dk"], pack, b, lk, (ds.transpose(1, 2) @ q * p["scale"]).unflatten(0, (hk, g)).sum(1))
            self._store(p["dv"], pack, b, lk, (pr.transpose(1, 2) @ do).unflatten(0, (hk, g)).sum(1))


def _fake_cudnn():
    e = types.SimpleNamespace
    m = types.SimpleNamespace(
        data_type=e(BFLOAT16="bf16", HALF="f16", FLOAT="f32", INT32="i32", INT64="i64"),
        diagonal_alignment=e(TOP_LEFT="top_left", BOTTOM_RIGHT="bottom_right"),
        heur_mode=e(A="A", FALLBACK="FALLBACK"), backend_version=lambda: 91900,
        create_handle=lambda: object(), set_stream=lambda handle, stream: None)
    m.pygraph = lambda **kw: _Graph(m, **kw)
    return m


@pytest.fixture(params=["ordered", "mapping"])
def fake(monkeypatch, request):
    monkeypatch.setattr(_cudnn_thd, "_ORDERED_EXECUTE", request.param == "ordered")
    cudnn = _fake_cudnn()
    monkeypatch.setattr(_cudnn_thd, "_cudnn_module", lambda: cudnn)
    monkeypatch.setattr(_cudnn_thd, "_stream", lambda device: 0)
    monkeypatch.setattr(_cudnn_thd, "_handle", lambda device: object())
    _cudnn_thd.clear_cache()
    yield cudnn
    _cudnn_thd.clear_cache()


def _reference(q, k, v, dout, cu_q, cu_k, causal, scale):
    """float64 per-sequence attention: out, lse [h, t], and dq, dk, dv by autograd."""
    qr, kr, vr = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for a, b, c, e in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
        s = torch.einsum("qhd,khd->hqk", qr[a:b], kr[c:e].repeat_interleave(g, 1)) * scale
        if causal:
            s = s.masked_fill(torch.ones(b - a, e - c, dtype=torch.bool).triu(1), float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vr[c:e].repeat_interleave(g, 1)))
        lses.append(torch.logsumexp(s, -1))
    out, lse = torch.cat(outs), torch.cat(lses, 1)
    out.backward(dout.double())
    return out.detach(), lse.detach(), qr.grad, kr.grad, vr.grad


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("shape", ["equal", "q_half", "kv_half", "heads_view"])
@pytest.mark.parametrize("h_kv", [4, 2])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_forward_backward_vs_float64(fake, causal, h_kv, shape):
    if causal and shape in ("q_half", "kv_half"):
        pytest.skip("the ring issues causal blocks only with equal q/k lengths")
    torch.manual_seed(0)
    h, d = 4, 8
    cu = [0, 6, 16, 20, 32]
    cu_q = [x // 2 for x in cu] if shape == "q_half" else cu
    cu_k = [x // 2 for x in cu] if shape == "kv_half" else cu
    hh, hk = (2 * h, 2 * h_kv) if shape == "heads_view" else (h, h_kv)
    q, dout = torch.randn(cu_q[-1], hh, d).bfloat16(), torch.randn(cu_q[-1], hh, d).bfloat16()
    k, v = torch.randn(cu_k[-1], hk, d).bfloat16(), torch.randn(cu_k[-1], hk, d).bfloat16()
    if shape == "heads_view":  # head slices (strided views), as the ring's head-split diagonal passes them
        q, dout, k, v = q[:, h:], dout[:, h:], k[:, :h_kv], v[:, :h_kv]
    lens = lambda c: [b - a for a, b in zip(c[:-1], c[1:])]  # noqa: E731
    t = lambda c: torch.tensor(c, dtype=torch.int32)  # noqa: E731
    vl = Varlen(t(cu_q), t(cu_k), max(lens(cu_q)), max(lens(cu_k)), tuple(cu_q), tuple(cu_k))
    scale = 1 / math.sqrt(d)
    out, lse = _cudnn_thd.forward(q, k, v, vl, scale=scale, causal=causal)
    ref = _reference(q, k, v, dout, cu_q, cu_k, causal, scale)
    assert lse.shape == (h, cu_q[-1]) and lse.dtype == torch.float32 and lse.t().is_contiguous()  # [t, h] memory
    assert _rel(out, ref[0]) < 1e-2 and _rel(lse, ref[1]) < 1e-5
    # backward with the reference's (merged) out and lse, as the ring calls it
    dq, dk, dv = _cudnn_thd.backward(dout, q, k, v, ref[0].bfloat16(), ref[1].float(), vl, scale=scale,
                                     causal=causal)
    for got, want in zip((dq, dk, dv), ref[2:]):
        assert got.shape == want.shape and _rel(got, want) < 2e-2


def test_graphs_are_cached_and_bucketed(fake):
    h, d = 2, 8
    q = torch.randn(20, h, d).bfloat16()
    for cu in ((0, 6, 16, 20), (0, 10, 14, 20)):  # same count, longest 10 and 10 -> same bucket
        t = torch.tensor(cu, dtype=torch.int32)
        vl = Varlen(t, t, max(b - a for a, b in zip(cu[:-1], cu[1:])), 10, cu, cu)
        _cudnn_thd.forward(q, q, q, vl, scale=0.3, causal=True)
    assert len(_cudnn_thd._graphs) == 1


def test_bad_inputs_raise_value_error(fake):
    q = torch.randn(8, 2, 4).bfloat16()
    t = torch.tensor([0, 8], dtype=torch.int32)
    half = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="as many queries as keys"):
        _cudnn_thd.forward(q, q[:4], q[:4], Varlen(t, half, 8, 4, (0, 8), (0, 4)), scale=0.5, causal=True)
    with pytest.raises(ValueError, match="fp16/bf16"):
        _cudnn_thd.forward(q.float(), q.float(), q.float(), Varlen(t, t, 8, 8, (0, 8), (0, 8)), scale=0.5,
                           causal=False)
    with pytest.raises(ValueError, match="different numbers of sequences"):
        _cudnn_thd.forward(q, q, q, Varlen(t, t, 8, 8, (0, 8), (0, 4, 8)), scale=0.5, causal=False)


def test_not_available_on_cpu():
    assert _cudnn_thd.available(torch.device("cpu")) is False


def test_batch_bucketing_pads_with_empty_sequences(fake, monkeypatch):
    torch.manual_seed(1)
    cu = (0, 6, 16, 20)  # 3 sequences -> 4 with an empty one
    q, k, v, dout = (torch.randn(20, 2, 8).bfloat16() for _ in range(4))
    t = torch.tensor(cu, dtype=torch.int32)
    vl = Varlen(t, t, 10, 10, cu, cu)
    res = {}
    for bucket in (False, True):
        monkeypatch.setattr(_cudnn_thd, "_BUCKET_BATCH", bucket)
        o, lse = _cudnn_thd.forward(q, k, v, vl, scale=0.3, causal=True)
        res[bucket] = (o, lse, *_cudnn_thd.backward(dout, q, k, v, o, lse, vl, scale=0.3, causal=True))
    assert {key[1] for key in _cudnn_thd._graphs} == {3, 4}  # graphs for 3 and for 4 (bucketed) sequences
    for a, b in zip(res[True], res[False]):
        assert torch.equal(a, b)
