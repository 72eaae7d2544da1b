"""A fake cuDNN frontend for CPU tests of cpscope's cuDNN graph wrappers, and a float64 block reference.

The fake implements the part of the frontend's graph API the wrappers use and *interprets the memory the way cuDNN
documents it*: logical ``[B, h, S, d]`` tensors with strides, a ragged offset per sequence (elements) replacing the
batch stride where set, sequence lengths with the padding mask, the softmax stats as ``[B, h, S, 1]`` at the given
strides, diagonal bands (top-left or bottom-right aligned; cuDNN's left bound counts the diagonal), and score
modifiers evaluated op by op (``gen_index``, comparisons, ``binary_select``, ``tanh``, arithmetic) on the real scores
— reading and writing raw CPU pointers from the variant pack. A wrapper that hands cuDNN wrong offsets, strides,
bounds or a wrong modifier gets wrong numbers here. Nothing here imports cpscope.
"""
from __future__ import annotations

import ctypes
import types
from typing import Optional, Sequence

import torch

_SIZE = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4, torch.int32: 4, torch.int64: 8}


class _T:
    """Fake graph tensor: dims, strides, data type, optional ragged offset tensor, optional constant value."""

    def __init__(self, graph, dim=None, stride=None, data_type=None, name="", value=None):
        self.dim, self.stride, self.dtype, self.name, self.ragged, self.value = dim, stride, data_type, name, None, value
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


class _V:
    """A value inside a score modifier's evaluation (a torch tensor standing for a graph tensor)."""

    def __init__(self, t):
        self.t = t

    def set_data_type(self, dtype):
        return self


class _Eval:
    """The graph a score modifier receives: each op computes on the scores of one sequence ``[h, n_q, n_k]``."""

    def __init__(self, owner, pack, b):
        self.owner, self.pack, self.b = owner, pack, b

    def _val(self, x):
        if isinstance(x, _V):
            return x.t
        if isinstance(x, _T):
            if x.value is not None:
                return torch.tensor(x.value, dtype=torch.float64)
            vals = self.owner._ints(x, self.pack)  # [B, 1, 1, 1], or [1, 1, 1, 1] broadcast over the batch
            return torch.tensor(float(vals[self.b if len(vals) > 1 else 0]), dtype=torch.float64)  # host or device
        raise TypeError(f"score modifier operand {x!r}")

    def _bin(self, fn):
        return lambda a, b, compute_data_type=None, name="": _V(fn(self._val(a), self._val(b)))

    def __getattr__(self, op):
        ops = {"mul": torch.mul, "sub": torch.sub, "add": torch.add, "div": torch.div,
               "logical_and": torch.logical_and}
        if op in ops:
            return self._bin(ops[op])
        cmps = {"cmp_ge": torch.ge, "cmp_le": torch.le, "cmp_lt": torch.lt, "cmp_gt": torch.gt}
        if op in cmps:
            return lambda input, comparison, compute_data_type=None, name="": _V(
                cmps[op](self._val(input), self._val(comparison)))
        raise AttributeError(op)

    def tanh(self, input, compute_data_type=None, name=""):
        return _V(torch.tanh(self._val(input)))

    def gen_index(self, input, axis, compute_data_type=None, name=""):
        ref = self._val(input)  # [h, n_q, n_k]: graph axis 2 (rows) is dim 1, axis 3 (columns) dim 2
        shape = [1, 1, 1]
        shape[axis - 1] = ref.shape[axis - 1]
        return _V(torch.arange(ref.shape[axis - 1], dtype=torch.float64).view(shape).expand_as(ref))

    def binary_select(self, input0, input1, mask, compute_data_type=None, name=""):
        return _V(torch.where(self._val(mask).bool(), self._val(input0), self._val(input1)))


class _Graph:
    def __init__(self, cudnn, io_data_type, intermediate_data_type, compute_data_type, handle):
        self.cudnn, self.io, self.ops, self._uid = cudnn, io_data_type, [], 0

    def next_uid(self):
        self._uid += 1
        return self._uid

    def tensor(self, name="", dim=None, stride=None, data_type=None, is_pass_by_value=False):
        return _T(self, dim, stride, data_type, name)

    def tensor_scalar(self, value, scalar_type):
        assert scalar_type == self.cudnn.scalar_type.RUNTIME_PARAM, "cuDNN 9.19 has no compile-time constants"
        return _T(self, [1, 1, 1, 1], [1, 1, 1, 1], self.cudnn.data_type.FLOAT, "const", value=float(value))

    @staticmethod
    def _mask_params(kw):
        left = kw.get("diagonal_band_left_bound")
        assert left is None or left >= 1, "cuDNN's left bound counts the diagonal: >= 1"
        if kw.get("score_mod") is not None:
            assert left is None and kw.get("diagonal_band_right_bound") is None and not kw.get("use_padding_mask"), \
                "the frontend refuses bands and the padding mask beside a score modifier"
        return dict(align=kw.get("diagonal_alignment"), left=left, right=kw.get("diagonal_band_right_bound"),
                    padding=bool(kw.get("use_padding_mask")), sq=kw.get("seq_len_q"), sk=kw.get("seq_len_kv"),
                    mod=kw.get("score_mod"), bprop=kw.get("score_mod_bprop"), scale=kw["attn_scale"])

    def sdpa(self, name, q, k, v, generate_stats, attn_scale, **kw):
        assert generate_stats
        o, st = _T(self, data_type=self.io, name="o"), _T(self, name="stats")
        p = self._mask_params(dict(kw, attn_scale=attn_scale))
        self.ops.append(("fwd", dict(p, q=q, k=k, v=v, o=o, stats=st)))
        return o, st

    def sdpa_backward(self, name, q, k, v, o, dO, stats, attn_scale, max_total_seq_len_q=None,
                      max_total_seq_len_kv=None, **kw):
        dq, dk, dv = (_T(self, data_type=self.io, name=n) for n in ("dq", "dk", "dv"))
        p = self._mask_params(dict(kw, attn_scale=attn_scale))
        self.ops.append(("bwd", dict(p, q=q, k=k, v=v, o=o, do=dO, stats=stats, dq=dq, dk=dk, dv=dv,
                                     max_q=max_total_seq_len_q, max_k=max_total_seq_len_kv)))
        return dq, dk, dv

    def validate(self):
        pass

    build_operation_graph = check_support = build_plans = validate

    def create_execution_plans(self, modes):
        # as nvidia-cudnn-frontend 1.32 does (cudnn/_pygraph.py): each heuristic mode is queried on its own, and a
        # mode with no plan is caught and kept in a local of this frame — a reference cycle (frame -> exception ->
        # traceback -> frame) that keeps this frame, and every caller's frame above it, until the cyclic collector
        # runs. Here the FALLBACK mode never has a plan.
        failure, any_ok = None, False
        for mode in modes:
            try:
                if mode == "FALLBACK":
                    raise RuntimeError("cudnnGraphNotSupportedError: no fallback plan (fake)")
            except RuntimeError as exc:
                failure = exc
                continue
            any_ok = True
        if not any_ok and failure is not None:
            raise failure

    def get_workspace_size(self):
        return 0

    # ---- execution: read/write raw CPU memory as cuDNN would
    def execute(self, pack, workspace, handle=None, tensor_uids=None):
        if tensor_uids is not None:  # the ordered form: buffers in the order of tensor_uids
            assert len(set(tensor_uids)) == len(tensor_uids) == len(pack)
            pack = {uid: t.data_ptr() for uid, t in zip(tensor_uids, pack)}
        pack = {uid: p if isinstance(p, int) else p.data_ptr() for uid, p in pack.items()}  # the mapping form
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
        """The values of a small ``[n, 1, 1, 1]`` tensor (offsets, lengths, bounds, host scalars)."""
        n = t.dim[0]
        return self._raw(pack[t.uid], n, self._torch_dtype(t)).tolist()

    def _index(self, t, pack, b, n):
        """Flat element indices of sequence ``b``'s first ``n`` rows: [h, n, d]."""
        _, h, s, d = t.dim
        sb, sh, ss, sd = t.stride
        assert n <= s, f"{t.name}: sequence of {n} rows exceeds the graph's S={s}"
        base = self._ints(t.ragged, pack)[b] if t.ragged is not None else b * sb
        idx = (base + torch.arange(h)[:, None, None] * sh + torch.arange(n)[None, :, None] * ss
               + torch.arange(d)[None, None, :] * sd)
        if t.ragged is not None:
            # a packed ragged tensor ends at its last offset: reading or writing past it is a layout bug (and, with
            # raw pointers, memory corruption), so refuse it
            end = self._ints(t.ragged, pack)[-1]
            assert n == 0 or int(idx.max()) < end, f"{t.name}: sequence {b} reaches past the packed tensor's end"
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

    def _lens(self, p, pack):
        if p["sq"] is not None:
            return list(zip(self._ints(p["sq"], pack), self._ints(p["sk"], pack)))
        assert not p["padding"]
        return [(p["q"].dim[2], p["k"].dim[2])] * p["q"].dim[0]

    def _scores(self, p, pack, b, lq, lk):
        q, k = self._load(p["q"], pack, b, lq), self._load(p["k"], pack, b, lk)
        g = q.shape[0] // k.shape[0]
        s = torch.einsum("hqd,hkd->hqk", q, k.repeat_interleave(g, 0)) * p["scale"]
        if p["mod"] is not None:
            return q, k, g, p["mod"](_Eval(self, pack, b), _V(s)).t
        diff = torch.arange(lk)[None, :] - torch.arange(lq)[:, None]  # j - i
        if p["align"] == self.cudnn.diagonal_alignment.BOTTOM_RIGHT:
            diff = diff - (lk - lq)
        keep = torch.ones(lq, lk, dtype=torch.bool)
        if p["right"] is not None:
            keep &= diff <= p["right"]
        if p["left"] is not None:
            keep &= diff > -p["left"]
        return q, k, g, s.masked_fill(~keep, float("-inf"))

    def _fwd(self, p, pack):
        for b, (lq, lk) in enumerate(self._lens(p, pack)):
            _, _, g, s = self._scores(p, pack, b, lq, lk)
            v = self._load(p["v"], pack, b, lk).repeat_interleave(g, 0)
            self._store(p["o"], pack, b, lq, torch.softmax(s, -1) @ v)  # rows with no key: NaN, as garbage
            self._store(p["stats"], pack, b, lq, torch.logsumexp(s, -1)[..., None])

    def _bwd(self, p, pack):
        lens = self._lens(p, pack)
        if p["max_q"] is not None:
            assert p["max_q"] >= sum(a for a, _ in lens) and p["max_k"] >= sum(c for _, c in lens)
        for b, (lq, lk) in enumerate(lens):
            q, k, g, s = self._scores(p, pack, b, lq, lk)
            v = self._load(p["v"], pack, b, lk).repeat_interleave(g, 0)
            do, o = self._load(p["do"], pack, b, lq), self._load(p["o"], pack, b, lq)
            lse = self._load(p["stats"], pack, b, lq)  # [h, n, 1]
            pr = torch.exp(s - lse)
            dp = do @ v.transpose(1, 2)
            ds = pr * (dp - (do * o).sum(-1, keepdim=True))
            if p["bprop"] is not None:
                ds = p["bprop"](_Eval(self, pack, b), _V(ds)).t
            hk = k.shape[0]
            self._store(p["dq"], pack, b, lq, ds @ k.repeat_interleave(g, 0) * p["scale"])
            self._store(p["dk"], pack, b, lk, (ds.transpose(1, 2) @ q * p["scale"]).unflatten(0, (hk, g)).sum(1))
            self._store(p["dv"], pack, b, lk, (pr.transpose(1, 2) @ do).unflatten(0, (hk, g)).sum(1))


def fake_cudnn():
    """A module-like namespace standing in for ``cudnn``."""
    e = types.SimpleNamespace
    m = types.SimpleNamespace(
        data_type=e(BFLOAT16="bf16", HALF="f16", FLOAT="f32", INT32="i32", INT64="i64", BOOLEAN="bool"),
        diagonal_alignment=e(TOP_LEFT="top_left", BOTTOM_RIGHT="bottom_right"),
        scalar_type=e(COMPILE_TIME_CONST="const", RUNTIME_PARAM="runtime"),
        heur_mode=e(A="A", FALLBACK="FALLBACK"), backend_version=lambda: 91900,
        create_handle=lambda: object(), set_stream=lambda handle, stream: None)
    m.pygraph = lambda **kw: _Graph(m, **kw)
    return m


# ----------------------------------------------------------------------------------------------------------------
# float64 reference of one block (the block API's contract)


def visible(n_q: int, n_k: int, causal: bool, window: Optional[tuple], device=None) -> torch.Tensor:
    """``[n_q, n_k]`` bool: query ``i`` sees key ``j`` iff ``-left <= j - (i + n_k - n_q) <= right`` (-1: unbounded;
    ``right`` is 0 when causal)."""
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0 if right == -1 else min(right, 0)
    diff = torch.arange(n_k, device=device)[None, :] - torch.arange(n_q, device=device)[:, None] - (n_k - n_q)
    keep = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    if left != -1:
        keep &= diff >= -left
    if right != -1:
        keep &= diff <= right
    return keep


def block_reference(q, k, v, dout, *, scale: float, causal: bool, window=None, softcap=None,
                    cu_q: Optional[Sequence[int]] = None, cu_k: Optional[Sequence[int]] = None):
    """float64 ``(out, lse, dq, dk, dv)`` of one block: dense ``[b, s, h, d]`` (lse ``[b, h, s]``) or, with
    ``cu_q``/``cu_k``, packed ``[t, h, d]`` (lse ``[h, t]``). Rows that see no key: out 0, lse -inf, no gradient."""
    qr, kr, vr = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    packed = cu_q is not None
    if not packed:
        segs = [(qr[i], kr[i], vr[i]) for i in range(q.shape[0])]
    else:
        segs = [(qr[a:b], kr[c:e], vr[c:e]) for a, b, c, e in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])]
    outs, lses = [], []
    for qs, ks, vs in segs:  # [n, h, d]
        g = qs.shape[1] // ks.shape[1]
        s = torch.einsum("qhd,khd->hqk", qs, ks.repeat_interleave(g, 1)) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        keep = visible(qs.shape[0], ks.shape[0], causal, window, q.device)
        s = s.masked_fill(~keep, float("-inf"))
        lse = torch.logsumexp(s, -1)  # [h, n]
        p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
        outs.append(torch.einsum("hqk,khd->qhd", p, vs.repeat_interleave(g, 1)))
        lses.append(lse)
    out = torch.stack(outs) if not packed else torch.cat(outs)
    lse = torch.stack(lses) if not packed else torch.cat(lses, 1)
    out.backward(dout.double())
    return out.detach(), lse.detach(), qr.grad, kr.grad, vr.grad


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


__all__ = ["fake_cudnn", "visible", "block_reference", "rel"]
