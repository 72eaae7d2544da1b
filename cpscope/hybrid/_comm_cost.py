"""The cost of one attention call (forward + backward) under each communication variant, fitted on the machine.

Every variant of :func:`cpscope.context_parallel_attention` (``comm=``) computes the same rows; they differ in
what they move and how often they synchronise. For a microbatch of documents with padded lengths ``Lp_i``
(``T = Σ Lp_i`` tokens, ``Lp_i`` a multiple of ``2·cp``), ``h`` query heads, ``g`` k/v heads, head dim ``d``
and ``e`` bytes per element, the time of one call on each rank of a CP group of size ``cp`` is modelled as::

    time_v = a_v · attn + b_v · tokens + c_v · bytes_v + r_v · rounds_v + k_v        (seconds, all ≥ 0)

    attn     = f · Σ Lp_i² · h · d / cp        # f = 1/2 causal, 1 full: the attention FLOPs of one rank
    tokens   = T · h · d / cp                  # per-token work: rescales, merges, copies
    bytes_v  = what one rank receives:  p2p, all_gather   2 · g · d · e · T · (cp − 1) / cp          (K and V)
                                        a2a               2 · (h + g) · d · e · T · (cp − 1) / cp²
                                        a2a+p2p (inner a, ring over r = cp / a)
                                                          2 · (h + g) · d · e · T · (a − 1) / (a · cp)
                                                          + 2 · (g / a) · d · e · T · (r − 1) / r
    rounds_v = peers exchanged with: cp − 1 (p2p: ring steps; all_gather, a2a: the peers of one collective);
               a2a+p2p (a − 1) + (r − 1)
    call     = 1

(backward moves about twice what forward does; the fitted coefficients absorb such constant factors).
A sliding ``window`` (:meth:`CommCostModel.time`'s ``window=``) changes two terms: ``attn`` counts the pairs the
window leaves, and ``p2p`` receives only the halo rows of :func:`halo_rows` instead of the ring's K/V. ``attn``,
``tokens`` and ``bytes`` add up over the documents of a microbatch, ``rounds`` and ``call`` do not: the
planner reads the first part as each document's own cost and the second as the microbatch's fixed cost. At
``cp = 1`` no variant communicates and all run the same local kernel: the model uses the ``"local"`` fit
(``cp = 1`` samples) for every variant there.

The five coefficients of each (dtype, variant) are fitted to timed calls by exact non-negative least squares on
relative residuals (:meth:`CommCostModel.fit`); :mod:`cpscope.train._calibrate` times them over the CP groups
of a job and caches the result on disk (:func:`cache_path`). A model is plain data (JSON): loading one needs no
GPU and no process group.

Example::

    >>> true = CommCostModel({"bfloat16": {"p2p": (2e-14, 3e-12, 4e-13, 1.5e-4, 2e-4)}})
    >>> kw = dict(heads=32, head_dim=128, dtype="bfloat16")
    >>> samples = [Sample("p2p", "bfloat16", cp, (n,), 32, g, 128, True, None,
    ...                   true.time("p2p", [n], cp=cp, kv_heads=g, **kw))
    ...            for cp in (2, 4) for g in (32, 8) for n in (8192, 65536, 131072)]
    >>> cost = CommCostModel.fit(samples)      # e.g. what calibrate() measured
    >>> cost.variants("bfloat16")
    ('p2p',)
    >>> est, ref = (m.time("p2p", [32768] * 2, cp=4, kv_heads=8, **kw) for m in (cost, true))
    >>> abs(est / ref - 1) < 1e-9
    True
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import numpy as np
import numpy.typing as npt

from .._variants import VARIANTS, check_variants
from ._comm_features import (BYTES, FEATURES, LOCAL, Sample, check_shape, default_inner, dtype_name, features,
                             halo_rows, padded, parts, variant_allowed, window_pairs)
from ._nnls import nnls

__all__ = [
    "FEATURES",
    "LOCAL",
    "CommCostModel",
    "Sample",
    "cache_dir",
    "cache_key",
    "cache_path",
    "default_inner",
    "dtype_name",
    "halo_rows",
    "load_cached",
    "variant_allowed",
]

logger = logging.getLogger(__name__)

FORMAT = 1  # version of the JSON layout


@dataclass(frozen=True, eq=False)
class CommCostModel:
    """Fitted seconds of one attention call per (dtype, variant); see the module docstring for the formula.

    Attributes:
        coefficients: ``{dtype: {variant: (attn, tokens, bytes, rounds, call)}}``; variant ``"local"`` is the
            ``cp = 1`` fit.
        meta: what the calibration ran on (device, world size, CP sizes, versions, ``inner``, ...).
        samples: the measurements it was fitted to.

    Example::

        from cpscope.hybrid import CommCostModel
        model = CommCostModel.load("comm_cost.json")     # written by benchmarks/calibrate_comm.py on your machine
        model.time("a2a", [65536], cp=4, heads=32, kv_heads=8, head_dim=128, dtype="bfloat16")   # seconds, fwd + bwd
    """

    coefficients: Mapping[str, Mapping[str, tuple[float, ...]]]
    meta: Mapping[str, Any] = field(default_factory=dict)
    samples: tuple[Sample, ...] = ()

    def __post_init__(self) -> None:
        for dt, per_variant in self.coefficients.items():
            dtype_name(dt)
            check_variants(per_variant, what=f"the variants of the cost model's {dt} fit", extra=(LOCAL,))
            for v, coef in per_variant.items():
                if len(coef) != len(FEATURES) or not all(math.isfinite(c) and c >= 0 for c in coef):
                    raise ValueError(f"coefficients of {dt}/{v} must be {len(FEATURES)} finite numbers ≥ 0, "
                                     f"got {coef!r}")

    # -- queries --------------------------------------------------------------------------------------------
    def dtypes(self) -> tuple[str, ...]:
        return tuple(sorted(self.coefficients))

    def variants(self, dtype: Any) -> tuple[str, ...]:
        """The variants fitted for ``dtype``, in :data:`VARIANTS` order (``"local"`` not included)."""
        per = self.coefficients.get(dtype_name(dtype), {})
        return tuple(v for v in VARIANTS if v in per)

    @property
    def inner(self) -> Optional[int]:
        """The ``a2a+p2p`` sub-group size the calibration was asked for (``meta["inner"]``), or ``None``
        (then each CP size uses :func:`default_inner`)."""
        value = self.meta.get("inner")
        return None if value is None else int(value)

    def _coef(self, variant: str, dtype: str, cp: int) -> np.ndarray:
        per = self.coefficients.get(dtype)
        if per is None:
            raise ValueError(f"the cost model has no fit for dtype {dtype!r}; calibrated: {list(self.dtypes())}")
        key = LOCAL if cp == 1 and LOCAL in per else variant
        if key not in per:
            raise ValueError(f"the cost model has no fit for variant {variant!r} at dtype {dtype!r}; "
                             f"calibrated: {sorted(per)}")
        return np.asarray(per[key], dtype=np.float64)

    def split(self, variant: str, *, cp: int, heads: int, kv_heads: int, head_dim: int, dtype: Any,
              causal: bool = True, inner: Optional[int] = None) -> tuple[float, float, float]:
        """``(q2, q1, fixed)`` seconds: a document of padded length ``Lp`` costs ``q2 · Lp² + q1 · Lp`` and
        a call adds ``fixed`` (what the planner tabulates)."""
        check_shape(cp, heads, kv_heads, head_dim)
        dt = dtype_name(dtype)
        coef = self._coef(variant, dt, cp)
        if cp > 1 and not variant_allowed(variant, cp, heads, kv_heads, inner):
            raise ValueError(f"variant {variant!r} cannot run at cp={cp} with heads={heads}, kv_heads={kv_heads}"
                             f", inner={inner}")
        w2, w1, fixed = parts(LOCAL if cp == 1 else variant, cp, heads, kv_heads, head_dim, BYTES[dt], causal,
                               inner)
        return float(w2 @ coef), float(w1 @ coef), float(fixed @ coef)

    def time(self, variant: str, lengths: npt.ArrayLike, *, cp: int, heads: int, kv_heads: int, head_dim: int,
             dtype: Any, causal: bool = True, inner: Optional[int] = None,
             window: Optional[tuple[int, int]] = None) -> float:
        """Predicted seconds of one call (forward + backward) on a microbatch of documents ``lengths`` (global,
        unpadded) at ``cp``; ``window`` (``(left, right)``) prices a sliding window (see the module docstring).

        Raises:
            ValueError: bad shapes, a dtype or variant the model was not fitted for, or a variant that cannot
                run at this ``cp`` (:func:`variant_allowed`).
        """
        q2, q1, fixed = self.split(variant, cp=cp, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                   dtype=dtype, causal=causal, inner=inner)
        lp = padded(lengths, cp)
        if window is None:
            return float(q2 * np.sum(lp * lp) + q1 * np.sum(lp) + fixed)
        dt = dtype_name(dtype)
        w2, w1, base = parts(LOCAL if cp == 1 else variant, cp, heads, kv_heads, head_dim, BYTES[dt], causal, inner)
        feats = w2 / (0.5 if causal else 1.0) * window_pairs(lp, window, causal) + w1 * float(np.sum(lp)) + base
        if cp > 1 and variant == "p2p":
            feats[2] = 2.0 * kv_heads * head_dim * BYTES[dt] * halo_rows(lp, cp, window, causal)
        return float(feats @ self._coef(variant, dt, cp))

    # -- fitting --------------------------------------------------------------------------------------------
    @classmethod
    def fit(cls, samples: Iterable[Sample], meta: Optional[Mapping[str, Any]] = None) -> "CommCostModel":
        """Fit every (dtype, variant) present in ``samples`` (non-negative least squares, relative residuals).

        Deterministic: the same samples give the same model on every rank. A (dtype, variant) needs at least one
        sample; features the samples do not vary (e.g. ``rounds`` and ``call`` at a single CP size) cannot be
        told apart and the fit gives their sum to one of them.

        Raises:
            ValueError: no samples, or a sample with a non-positive or non-finite time.
        """
        samples = tuple(Sample(*s) for s in samples)
        if not samples:
            raise ValueError("CommCostModel.fit: no samples")
        rows: dict[tuple[str, str], list[Sample]] = {}
        for s in samples:
            if not (math.isfinite(s.seconds) and s.seconds > 0):
                raise ValueError(f"CommCostModel.fit: every measured time must be finite and > 0, got {s}")
            rows.setdefault((dtype_name(s.dtype), s.variant), []).append(s)
        coefficients: dict[str, dict[str, tuple[float, ...]]] = {}
        for (dt, v), group in sorted(rows.items()):
            x = np.stack([features(s) for s in group])
            y = np.array([s.seconds for s in group])
            coefficients.setdefault(dt, {})[v] = tuple(float(c) for c in nnls(x, y, relative=True))
        model = cls(coefficients=coefficients, meta=dict(meta or {}), samples=samples)
        logger.debug("CommCostModel.fit on %d samples: %s", len(samples), coefficients)
        return model

    def residuals(self) -> list[tuple[Sample, float]]:
        """``(sample, predicted / measured − 1)`` for every sample: how well the fit explains its data."""
        out = []
        for s in self.samples:
            pred = self.time(s.variant if s.variant != LOCAL else "p2p", s.lengths, cp=s.cp, heads=s.heads,
                             kv_heads=s.kv_heads, head_dim=s.head_dim, dtype=s.dtype, causal=s.causal,
                             inner=s.inner)
            out.append((s, pred / s.seconds - 1.0))
        return out

    # -- storage --------------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "features": list(FEATURES), "meta": dict(self.meta),
                "coefficients": {dt: {v: list(c) for v, c in per.items()} for dt, per in self.coefficients.items()},
                "samples": [s._asdict() for s in self.samples]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "CommCostModel":
        if data.get("format") != FORMAT or list(data.get("features", ())) != list(FEATURES):
            raise ValueError(f"not a cpscope communication cost model of format {FORMAT} "
                             f"(format={data.get('format')!r}, features={data.get('features')!r})")
        samples = tuple(Sample(**{**s, "lengths": tuple(s["lengths"])}) for s in data.get("samples", ()))
        coefficients = {dt: {v: tuple(float(x) for x in c) for v, c in per.items()}
                        for dt, per in data["coefficients"].items()}
        return cls(coefficients=coefficients, meta=dict(data.get("meta", {})), samples=samples)

    def save(self, path: Union[str, os.PathLike]) -> Path:
        """Write the model as JSON (atomically: a temporary file renamed over ``path``); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "CommCostModel":
        """Read a model written by :meth:`save` (no GPU, no torch needed)."""
        return cls.from_json(json.loads(Path(path).read_text()))


# -- the on-disk cache ------------------------------------------------------------------------------------------
def cache_dir() -> Path:
    """``$CPSCOPE_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/cpscope``, else ``~/.cache/cpscope``."""
    env = os.environ.get("CPSCOPE_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "cpscope"


def cache_key(*, device: str, world_size: int, cp_sizes: Sequence[int], torch_version: str,
              cpscope_version: str) -> dict[str, Any]:
    """What a calibration is valid for: the device name, the world size, the CP sizes timed and the versions."""
    return {"device": str(device), "world_size": int(world_size), "cp_sizes": sorted(int(c) for c in cp_sizes),
            "torch": str(torch_version), "cpscope": str(cpscope_version)}


def cache_path(key: Mapping[str, Any], directory: Optional[Union[str, os.PathLike]] = None) -> Path:
    """``<cache_dir>/comm_cost-<device>-w<world>-cp<sizes>-torch<v>-cpscope<v>.json`` (names made file-safe).

    Example::

        >>> k = cache_key(device="NVIDIA H200", world_size=2, cp_sizes=[1, 2], torch_version="2.6.0+cu124",
        ...               cpscope_version="0.1.0")
        >>> cache_path(k, "/c").name
        'comm_cost-NVIDIA_H200-w2-cp1_2-torch2.6.0_cu124-cpscope0.1.0.json'
    """
    def safe(text: str) -> str:
        return re.sub(r"[^A-Za-z0-9.-]+", "_", text).strip("_") or "unknown"

    sizes = "_".join(str(c) for c in key["cp_sizes"])
    name = (f"comm_cost-{safe(key['device'])}-w{int(key['world_size'])}-cp{sizes}-torch{safe(key['torch'])}"
            f"-cpscope{safe(key['cpscope'])}.json")
    return Path(directory if directory is not None else cache_dir()) / name


def load_cached(key: Mapping[str, Any], directory: Optional[Union[str, os.PathLike]] = None
                ) -> Optional[CommCostModel]:
    """The cached model for ``key``, or ``None`` when there is none (a file for another key is never used)."""
    path = cache_path(key, directory)
    if not path.is_file():
        return None
    model = CommCostModel.load(path)
    stored = {k: model.meta.get(k) for k in key}
    if stored != dict(key):
        raise ValueError(f"cost-model cache file {path} holds a calibration for {stored}, not {dict(key)}")
    return model
