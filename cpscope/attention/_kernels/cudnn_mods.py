"""What one attention block asks of a cuDNN SDPA graph beyond plain attention: a diagonal band (sliding window,
causal) and a softcap on the scores.

cpscope's convention (flash-attention's): query ``i`` of a sequence with ``n_q`` queries and ``n_k`` keys sees key
``j`` iff ``-left <= j - (i + n_k - n_q) <= right`` (``-1``: unbounded; ``right`` is 0 when causal), i.e. the band
is relative to the bottom-right-aligned diagonal.

Two ways to tell cuDNN:

* **no softcap** — the graph's own band options (``diagonal_band_left_bound`` / ``_right_bound`` with the
  diagonal alignment): cuDNN skips the tiles outside the band, so a window costs O(rows x window). cuDNN's left
  bound counts the diagonal (keys ``i - L + 1 .. i``), hence ``L = left + 1``.
* **softcap** — a score modifier (``score_mod`` / ``score_mod_bprop``): ``s -> softcap * tanh(s / softcap)``, and
  its gradient ``dS * (1 - tanh^2)``. The frontend disables its band and padding options once a score modifier is
  set, so the modifier builds the band (and, for packed sequences, the padding mask) itself from index arithmetic:
  ``gen_index`` rows / columns, comparisons against the bounds, ``binary_select`` to a large negative.

Masked scores become ``-1e9``, not ``-inf`` (as in the frontend's own score-modifier samples): softcapped scores are
bounded by ``softcap``, so this is exact for every row that sees a key; rows that see none are the caller's to fix
(:meth:`~cpscope.attention._mods.Band.masked_prefix` says which rows of a block those are).

The modifier's constants (``softcap``, ``1 / softcap``, the masked value, a dense block's bounds) are pass-by-value
scalars bound at every execute from host tensors (``fixed``, below): cuDNN 9.19 refuses the frontend's
compile-time constants (``CUDNN_ATTR_TENSOR_CONSTANT_VALUE`` needs cuDNN 9.22), as H200 showed. The policy's
``cudnn_constants="runtime"`` uses the frontend's runtime scalars (``tensor_scalar``) instead.

Example::

    band = Band.of(causal=True, window=(255, 0))
    kwargs, fixed = sdpa_options(cudnn, graph, named, band, softcap=None, square=True)   # the diagonal options
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from .._mods import Band
from .._policy import kernel_policy

__all__ = ["sdpa_options", "ScoreMod", "MASKED"]

MASKED = -1e9  # the score given to masked (query, key) pairs inside a score modifier


def _flags(cudnn: Any, band: Optional[Band], square: bool) -> dict:
    """The graph's own band options. ``square`` (every sequence has as many queries as keys): the top-left and
    bottom-right diagonals coincide, and top-left is what the frontend supports most widely."""
    if band is None:
        return {}
    align = cudnn.diagonal_alignment.TOP_LEFT if square else cudnn.diagonal_alignment.BOTTOM_RIGHT
    kw: dict[str, Any] = {"diagonal_alignment": align}
    if band.right != -1:
        kw["diagonal_band_right_bound"] = band.right
    if band.left != -1:
        kw["diagonal_band_left_bound"] = band.left + 1
    return kw


class ScoreMod:
    """The softcap (and the masks it displaces) as a cuDNN score modifier pair.

    The masks take the forms the frontend itself used to build them from pointwise ops (before cuDNN had a band
    operation): padding ``row < seq_q and col < seq_kv``; the right bound ``row + hi >= col`` (``row >= col`` for the
    square causal mask, the form on which H200 showed cuDNN skipping the tiles above the diagonal); the left bound
    ``col + wl > row``; each applied with its own ``binary_select``. Index arithmetic is in fp32 (exact below 2**24
    tokens): cuDNN 9.19's fused kernels refuse int32 operands of pointwise arithmetic and int32 graph inputs of
    pointwise operations (H200), so every tensor the masks read is fp32 — except the square causal mask alone, which
    compares int32 indices as the frontend's causal sample does.

    ``lens``: fp32 ``[B, 1, 1, 1]`` graph tensors ``(seq_q, seq_kv)`` for packed sequences, else None (dense).
    ``bounds``: ``(wl, hi)`` per sequence as fp32 graph tensors ``[B, 1, 1, 1]`` (packed blocks, bottom-right band:
    ``hi = n_k - n_q + right``, ``wl = left + 1 - (n_k - n_q)``), or None: ``band`` is then relative to the top-left
    diagonal (``hi = right``, ``wl = left + 1``; dense blocks, see :meth:`Band.top_left`) and the bounds are constants.
    ``named`` receives the graph tensors of the constants, :attr:`fixed` their host values to bind at execute.
    The same object serves the forward graph (:meth:`forward`) and the backward graph (:meth:`forward` for the
    recomputed scores, then :meth:`bprop`): the backward reuses the ``tanh`` its forward part made.
    """

    def __init__(self, cudnn: Any, graph: Any, named: dict, softcap: float, band: Optional[Band], square: bool,
                 lens: Optional[tuple] = None, bounds: Optional[tuple] = None) -> None:
        # no reference to ``graph`` is kept: the graph keeps this object's methods (its score modifier), and a
        # graph cuDNN refuses to build must be freed by reference counting (no cycle)
        self.cudnn, self.named, self.fixed = cudnn, named, {}
        self.band, self.square, self.lens = band, square, lens
        self.cap, self.inv_cap, self.masked = self._const(graph, "cap", softcap), \
            self._const(graph, "inv_cap", 1 / softcap), self._const(graph, "masked", MASKED)
        self.tanh: Any = None
        self.bounds = bounds
        if band is not None and bounds is None:  # top-left band: the same bounds for every sequence
            self.bounds = (self._const(graph, "wl", band.left + 1), self._const(graph, "hi", band.right))

    def _const(self, graph: Any, name: str, value: float) -> Any:
        """A scalar of the graph: a pass-by-value tensor bound from a host tensor at execute (see module docs)."""
        if kernel_policy().cudnn_constants == "runtime":
            return graph.tensor_scalar(float(value), self.cudnn.scalar_type.RUNTIME_PARAM)
        name = "const_" + name
        t = graph.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], is_pass_by_value=True,
                              data_type=self.cudnn.data_type.FLOAT)
        self.named[name] = t
        self.fixed[name] = torch.full((1, 1, 1, 1), float(value), dtype=torch.float32)
        return t

    def _typed(self, t: Any, dtype: Any) -> Any:
        t.set_data_type(dtype)
        return t

    def _masks(self, g: Any, ref: Any) -> list:
        """Boolean graph tensors, each a condition for a (query, key) pair to be seen (none: all are)."""
        dt, band = self.cudnn.data_type, self.band
        if band is None and self.lens is None:
            return []
        causal_only = self.lens is None and self.square and band == Band(-1, 0)
        it = dt.INT32 if causal_only else dt.FLOAT  # int32 indices: the frontend's own causal form, as measured
        row = self._typed(g.gen_index(input=ref, axis=2, compute_data_type=it), it)
        col = self._typed(g.gen_index(input=ref, axis=3, compute_data_type=it), it)

        def cmp(op: str, a: Any, b: Any) -> Any:
            return self._typed(getattr(g, op)(input=a, comparison=b, compute_data_type=dt.BOOLEAN), dt.BOOLEAN)

        def add(a: Any, b: Any) -> Any:
            return self._typed(g.add(a, b, compute_data_type=dt.FLOAT), dt.FLOAT)

        masks = []
        if self.lens is not None:
            pad = g.logical_and(cmp("cmp_lt", row, self.lens[0]), cmp("cmp_lt", col, self.lens[1]),
                                compute_data_type=dt.BOOLEAN)
            masks.append(self._typed(pad, dt.BOOLEAN))
        if band is not None and band.right != -1:
            causal = self.square and band.right == 0
            masks.append(cmp("cmp_ge", row, col) if causal else cmp("cmp_ge", add(row, self.bounds[1]), col))
        if band is not None and band.left != -1:
            masks.append(cmp("cmp_gt", add(col, self.bounds[0]), row))
        return masks

    def forward(self, g: Any, scores: Any) -> Any:
        """``softcap * tanh(scores / softcap)``, masked (``scores`` are already scaled by the softmax scale)."""
        self.tanh = g.tanh(g.mul(scores, self.inv_cap))
        out = g.mul(self.tanh, self.cap)
        for keep in self._masks(g, out):
            out = g.binary_select(input0=out, input1=self.masked, mask=keep)
        return out

    def bprop(self, g: Any, d_scores: Any) -> Any:
        """The gradient through the softcap: ``dS * (1 - tanh^2)`` (masked pairs have ``dS = 0`` already: their
        probabilities are 0)."""
        return g.sub(d_scores, g.mul(d_scores, g.mul(self.tanh, self.tanh)))


def sdpa_options(cudnn: Any, graph: Any, named: dict, band: Optional[Band], softcap: Optional[float], square: bool,
                 lens: Optional[tuple] = None, bounds: Optional[tuple] = None, backward: bool = False,
                 mask_lens: Optional[tuple] = None) -> tuple[dict, dict]:
    """``(kwargs, fixed)``: keyword arguments for ``graph.sdpa`` / ``graph.sdpa_backward`` — the band options without
    a softcap, else the score-modifier pair — and the host tensors to bind at every execute (by their names in
    ``named``). ``lens``: the int32 sequence lengths of packed blocks (or of a dense block with a padding mask);
    without a softcap they turn the padding mask on, with one they bound the kernel's rows and columns while the
    modifier masks with ``mask_lens`` (fp32 copies) and ``bounds`` (see :class:`ScoreMod`)."""
    if softcap is None:
        kw = _flags(cudnn, band, square)
        if lens is not None:
            kw.update(use_padding_mask=True, seq_len_q=lens[0], seq_len_kv=lens[1])
        return kw, {}
    mod = ScoreMod(cudnn, graph, named, softcap, band, square, mask_lens, bounds)
    kw = {"score_mod": mod.forward}
    if backward:
        kw["score_mod_bprop"] = mod.bprop
    if lens is not None:
        kw.update(seq_len_q=lens[0], seq_len_kv=lens[1])
    return kw, mod.fixed
