"""Document lengths for ``python -m cpscope plan``: read from a file or a local dataset, or drawn from a built-in
distribution, and cut into the global batches of a few training steps.

Sources (exactly one):

* ``--lengths FILE`` — by extension: ``.txt`` (one length per line, or ``length count`` / ``length,count`` per line:
  a histogram), ``.csv`` (a column of lengths, ``--column``, default the first; a ``count`` column makes it a
  histogram), ``.json`` (a list of lengths, a ``{length: count}`` histogram, a list of ``[length, count]`` pairs, or
  an object with a ``lengths`` list — e.g. a benchmark result), ``.jsonl`` (one object per line: ``--column``
  holds an int, or a list whose length is the document's: token ids), ``.parquet`` (``--column``; needs pyarrow).
* ``--dataset NAME`` — ``datasets.load_dataset(NAME)`` from the local cache only (``HF_DATASETS_OFFLINE``):
  ``--column`` holds lengths or token ids, or text that ``--tokenizer`` (loaded locally) tokenizes.
* ``--dist sft|longtail|uniform-long`` — the planner's synthetic mixes (:mod:`cpscope.hybrid._data`), step ``i``
  drawn with seed ``seed + i`` (what ``benchmarks/bench_hybrid.py --simulate`` plans for seeds 0, 1, 2).

Example::

    >>> src = Synthetic("sft", seed=0)
    >>> steps = src.steps(n_steps=2, docs_per_step=128, tokens_per_step=None)
    >>> [len(s) for s in steps], int(steps[0].max()) >= 122880
    ([128, 128], True)
"""
from __future__ import annotations

import contextlib
import csv
import importlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np

from ..hybrid import long_tail_lengths, sft_like_lengths, uniform_lengths

__all__ = ["DISTRIBUTIONS", "Pool", "Synthetic", "from_dataset", "from_file"]

# name -> (description, generator(n, seed))
DISTRIBUTIONS: dict[str, tuple[str, Callable[[int, int], np.ndarray]]] = {
    "sft": ("SFT-like: log-normal median 1024 (sigma 1.0, 128-16k) and 1 in 128 documents of 120k-128k "
            "(sft_like_lengths)", lambda n, seed: sft_like_lengths(n, seed=seed)),
    "longtail": ("long-tail pretraining: log-normal median 2048, sigma 1.5, 128-128k (long_tail_lengths)",
                 lambda n, seed: long_tail_lengths(n, seed=seed)),
    "uniform-long": ("uniform long: uniform in 32k-128k, multiples of 128 (uniform_lengths)",
                     lambda n, seed: uniform_lengths(n, seed=seed)),
}


def _cut(pool: np.ndarray, n_steps: int, docs_per_step: Optional[int], tokens_per_step: Optional[int],
         rng: Optional[np.random.Generator]) -> list[np.ndarray]:
    """``n_steps`` consecutive global batches from ``pool`` (shuffled first when ``rng``), each ``docs_per_step``
    documents or, else, documents until ``tokens_per_step`` tokens; the pool is reused (reshuffled) if short."""
    if (docs_per_step is None) == (tokens_per_step is None):
        raise ValueError("give exactly one of docs_per_step and tokens_per_step")
    order = rng.permutation(pool.size) if rng is not None else np.arange(pool.size)
    seq, pos, steps = pool[order], 0, []
    for _ in range(n_steps):
        take: list[np.ndarray] = []
        count, tokens = 0, 0
        while (count < docs_per_step) if docs_per_step else (tokens < tokens_per_step):
            if pos == seq.size:
                seq, pos = (pool[rng.permutation(pool.size)] if rng is not None else pool), 0
            if docs_per_step:
                chunk = seq[pos:pos + docs_per_step - count]
            else:
                need = np.searchsorted(np.cumsum(seq[pos:]), tokens_per_step - tokens) + 1
                chunk = seq[pos:pos + need]
            take.append(chunk)
            count, tokens, pos = count + chunk.size, tokens + int(chunk.sum()), pos + chunk.size
        steps.append(np.concatenate(take))
    return steps


@dataclass
class Pool:
    """Lengths read from a file or dataset; :meth:`steps` cuts them into global batches (shuffled with ``seed``
    unless ``shuffle`` is off)."""

    lengths: np.ndarray
    source: str
    seed: int = 0
    shuffle: bool = True

    def steps(self, n_steps: int, docs_per_step: Optional[int], tokens_per_step: Optional[int]) -> list[np.ndarray]:
        rng = np.random.default_rng(self.seed) if self.shuffle else None
        return _cut(self.lengths, n_steps, docs_per_step, tokens_per_step, rng)


@dataclass
class Synthetic:
    """A built-in distribution of :data:`DISTRIBUTIONS`; step ``i`` is drawn with seed ``seed + i``."""

    name: str
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in DISTRIBUTIONS:
            raise ValueError(f"unknown distribution {self.name!r}; choose one of {sorted(DISTRIBUTIONS)}")

    @property
    def source(self) -> str:
        return f"--dist {self.name} (seed {self.seed}): {DISTRIBUTIONS[self.name][0]}"

    def steps(self, n_steps: int, docs_per_step: Optional[int], tokens_per_step: Optional[int]) -> list[np.ndarray]:
        draw = DISTRIBUTIONS[self.name][1]
        if docs_per_step is not None:
            return [draw(docs_per_step, self.seed + i) for i in range(n_steps)]
        out = []
        for i in range(n_steps):  # enough documents for the token budget, then cut at it
            n = 64
            while True:
                lengths = draw(n, self.seed + i)
                if lengths.sum() >= tokens_per_step:
                    out.append(_cut(lengths, 1, None, tokens_per_step, None)[0])
                    break
                n *= 4
        return out


def _checked(values: Any, counts: Any, where: str) -> np.ndarray:
    """Lengths (expanded from a histogram when ``counts``), checked: positive ints, at least one."""
    try:
        lengths = np.asarray(values, dtype=np.float64).ravel()
        reps = None if counts is None else np.asarray(counts, dtype=np.float64).ravel()
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: lengths must be numbers ({err})") from None
    for name, arr in (("length", lengths), ("count", reps)):
        if arr is not None and (not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr))):
            raise ValueError(f"{where}: every {name} must be an integer, got {arr[arr != np.round(arr)][:5].tolist()}")
    if np.any(lengths <= 0) or (reps is not None and np.any(reps < 0)):
        raise ValueError(f"{where}: lengths must be > 0 and counts ≥ 0")
    out = lengths.astype(np.int64) if reps is None else np.repeat(lengths.astype(np.int64), reps.astype(np.int64))
    if out.size == 0:
        raise ValueError(f"{where}: no document lengths found")
    return out


def _doc_length(value: Any, where: str) -> int:
    """A length from one record's field: an int, or a list / array of token ids (its length)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, (list, tuple, np.ndarray)):
        return len(value)
    raise ValueError(f"{where}: expected a length (int) or token ids (list), got {type(value).__name__}; text needs "
                     f"--dataset with --tokenizer")


def _read_text(path: Path) -> np.ndarray:
    rows = [line.replace(",", " ").split() for line in path.read_text().splitlines()]
    rows = [r for r in rows if r and not r[0].startswith("#")]
    widths = {len(r) for r in rows}
    if widths - {1, 2} or len(widths) > 1:
        raise ValueError(f"{path}: each line must be 'length' or 'length count' (one form for the whole file)")
    cols = list(zip(*rows)) if rows else [()]
    return _checked(cols[0], cols[1] if widths == {2} else None, str(path))


def _read_csv(path: Path, column: Optional[str]) -> np.ndarray:
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    if not rows:
        raise ValueError(f"{path}: empty")
    header = rows[0] if not rows[0][0].strip().lstrip("-").isdigit() else None
    body = rows[1:] if header else rows
    names = [h.strip() for h in header] if header else [str(i) for i in range(len(rows[0]))]
    col = column if column is not None else names[0]
    if col not in names:
        raise ValueError(f"{path}: no column {col!r}; columns: {names}")
    i = names.index(col)
    counts = [r[names.index("count")] for r in body] if "count" in names and col != "count" else None
    return _checked([r[i] for r in body], counts, str(path))


def _read_json(path: Path, column: Optional[str]) -> np.ndarray:
    data = json.loads(path.read_text())
    if isinstance(data, dict) and (column or "lengths") in data:
        data = data[column or "lengths"]
    if isinstance(data, dict):  # {length: count}
        return _checked([int(k) for k in data], list(data.values()), str(path))
    if isinstance(data, list) and data and isinstance(data[0], (list, tuple)):  # [[length, count], ...]
        return _checked([r[0] for r in data], [r[1] for r in data], str(path))
    if isinstance(data, list):
        return _checked(data, None, str(path))
    raise ValueError(f"{path}: expected a list of lengths, a {{length: count}} object or an object with "
                     f"{column or 'lengths'!r}")


def _read_jsonl(path: Path, column: Optional[str]) -> np.ndarray:
    if column is None:
        raise ValueError(f"{path}: a JSONL file needs --column (the field holding a length or token ids)")
    out = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                record = json.loads(line)
                if column not in record:
                    raise ValueError(f"{path}:{n}: no field {column!r}; fields: {sorted(record)}")
                out.append(_doc_length(record[column], f"{path}:{n}"))
    return _checked(out, None, str(path))


def _read_parquet(path: Path, column: Optional[str]) -> np.ndarray:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    table = pq.read_table(path, columns=None if column is None else [column])
    name = column if column is not None else table.column_names[0]
    values = table.column(name).to_pylist()
    return _checked([_doc_length(v, f"{path}[{name}]") for v in values], None, str(path))


def from_file(path: str, column: Optional[str] = None, *, seed: int = 0, shuffle: bool = True) -> Pool:
    """The lengths in ``path`` (see the module docstring for the formats).

    Raises:
        ValueError: a missing file, an unknown extension, a missing column, a value that is not a positive integer
            (or token ids), Parquet without pyarrow.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"no such file: {path}")
    readers = {".txt": lambda: _read_text(p), ".csv": lambda: _read_csv(p, column),
               ".json": lambda: _read_json(p, column), ".jsonl": lambda: _read_jsonl(p, column),
               ".parquet": lambda: _read_parquet(p, column)}
    ext = p.suffix.lower()
    if ext not in readers:
        raise ValueError(f"{path}: unknown length file type {ext!r}; expected one of {sorted(readers)}")
    return Pool(readers[ext](), f"{path}" + (f" [{column}]" if column else ""), seed, shuffle)


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """datasets / huggingface_hub offline for the block, also where they were imported before (they read the
    ``HF_*_OFFLINE`` variables once, at import: setting the variables alone let an earlier import go to the network
    and wait for its timeout); the settings are restored afterwards."""
    saved: list[tuple[Any, str, Any]] = []
    for modname, attrs in (("datasets.config", ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")),
                           ("huggingface_hub.constants", ("HF_HUB_OFFLINE",))):
        mod = sys.modules.get(modname)
        if mod is None:
            try:
                mod = importlib.import_module(modname)
            except ImportError:
                continue
        for attr in attrs:
            if hasattr(mod, attr):
                saved.append((mod, attr, getattr(mod, attr)))
                setattr(mod, attr, True)
    env = {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    os.environ.update({k: "1" for k in env})
    try:
        yield
    finally:
        for mod, attr, value in reversed(saved):
            setattr(mod, attr, value)
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def from_dataset(name: str, *, split: str = "train", column: Optional[str] = None, tokenizer: Optional[str] = None,
                 config: Optional[str] = None, max_docs: Optional[int] = None, seed: int = 0,
                 shuffle: bool = True) -> Pool:
    """Lengths of a ``datasets`` dataset loaded from the local cache only (no download): ``column`` holds lengths
    or token ids, or text that ``tokenizer`` (a transformers tokenizer, local files only) tokenizes.

    Raises:
        ValueError: datasets / transformers not installed, the dataset or tokenizer not in the local cache, a
            missing column, text without a tokenizer.
    """
    try:
        import datasets
    except ImportError:
        raise ValueError("--dataset needs the datasets package (pip install datasets)") from None
    try:
        with _offline():
            ds = datasets.load_dataset(name, config, split=split)
    except Exception as err:  # noqa: BLE001 - any loading failure: report it as bad input, with its reason
        raise ValueError(f"could not load dataset {name!r} (split {split!r}) from the local cache (offline: nothing "
                         f"is downloaded): {type(err).__name__}: {str(err)[:300]}") from None
    if max_docs is not None:
        ds = ds.select(range(min(max_docs, len(ds))))
    col = column or ("input_ids" if "input_ids" in ds.column_names else None)
    if col is None or col not in ds.column_names:
        raise ValueError(f"dataset {name!r}: give --column, one of {ds.column_names}")
    values = ds[col]
    if values and isinstance(values[0], str):
        values = _tokenize(values, tokenizer, name, col)
    lengths = _checked([_doc_length(v, f"dataset {name!r}[{col}]") for v in values], None, f"dataset {name!r}")
    return Pool(lengths, f"dataset {name} ({split}) [{col}]" + (f", tokenizer {tokenizer}" if tokenizer else ""),
                seed, shuffle)


def _tokenize(texts: list[str], tokenizer: Optional[str], name: str, col: str) -> list[int]:
    if tokenizer is None:
        raise ValueError(f"dataset {name!r}: column {col!r} holds text; give --tokenizer NAME to count its tokens")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError("--tokenizer needs the transformers package") from None
    try:
        tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    except Exception as err:  # noqa: BLE001
        raise ValueError(f"could not load tokenizer {tokenizer!r} from the local cache: {str(err)[:300]}") from None
    return [len(ids) for ids in tok(texts, add_special_tokens=True)["input_ids"]]
