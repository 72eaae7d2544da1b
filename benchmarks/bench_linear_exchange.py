#!/usr/bin/env python3
"""Bytes each rank sends per layer for the CP state hand-over of cpscope.linear, against the alternatives (CPU, no
GPU, no process group: counted from the tensors each scheme moves).

* ``cpscope all-gather`` — what :func:`cpscope.linear._summaries.incoming_states` all-gathers: per document piece
  (2 per rank) the transition ``A`` and the state ``b`` in fp32; a ring all-gather sends ``(cp-1)`` times the own
  part; backward reduce-scatters the same amount again.
* ``state chain`` — the minimal sequential ring along the zigzag order (0→1→…→cp−1→cp−1→…→0): each rank sends 2
  states (no ``A``), but in ``2·cp−1`` dependent hops.
* ``layout a2a`` — the layout-converting all-to-all of Megatron's ``context_parallel_layout`` / PyTorch's GDN CP:
  the layer's inputs to the contiguous (or head-sharded) layout and its output back, each sending ``(cp−1)/cp`` of
  the local activations (bf16), forward; the same again in backward.

Usage::

    python benchmarks/bench_linear_exchange.py            # table for GDN (Qwen3-Next), Mamba2 (Nemotron-H), conv
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

__all__ = ["Layer", "LAYERS", "bytes_per_rank", "main"]

FP32, BF16 = 4, 2


@dataclass(frozen=True)
class Layer:
    name: str
    heads: int  # state heads (value heads for GDN)
    state: tuple[int, int]  # per-head state [K, V] (GDN) / [P, N] (Mamba2) / [W-1, D] (conv, 1 "head")
    transition: int  # numbers in one head's transition: K*K (delta rule), 1 (Mamba2), (W-1)^2 (conv)
    summary_bytes: int  # bytes per number of the exchanged summary
    in_per_token: int  # numbers per token the layout a2a moves in (q, k, v, g, beta / x, dt, B, C / x)
    out_per_token: int  # numbers per token it moves back (the output)


LAYERS = (
    # Qwen3-Next gated DeltaNet: 16 q/k heads x 128, 32 value heads x 128
    Layer("GDN (Qwen3-Next)", 32, (128, 128), 128 * 128, FP32, 2 * 16 * 128 + 32 * 128 + 2 * 32, 32 * 128),
    # Nemotron-H Mamba2: 128 heads x 64, 8 groups x state 128
    Layer("Mamba2 (Nemotron-H)", 128, (64, 128), 1, FP32, 128 * 64 + 128 + 2 * 8 * 128, 128 * 64),
    # a short conv over the Mamba2 in-projection (8192 + 2*8*128 channels), kernel 4
    Layer("short conv W=4", 1, (3, 10240), 9, BF16, 10240, 10240),
)


def bytes_per_rank(layer: Layer, cp: int, tokens: int, docs: int = 1) -> dict[str, float]:
    """Bytes one rank sends per layer, forward + backward, for ``tokens`` global tokens in ``docs`` documents."""
    pieces = 2 * docs
    summary = pieces * layer.heads * (layer.state[0] * layer.state[1] + layer.transition) * layer.summary_bytes
    state = pieces * layer.heads * layer.state[0] * layer.state[1] * layer.summary_bytes
    local = tokens // cp
    a2a = (cp - 1) / cp * local * (layer.in_per_token + layer.out_per_token) * BF16
    return {
        "cpscope all-gather": 2 * (cp - 1) * summary,
        "state chain": 2 * state,
        "layout a2a": 2 * a2a,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536, 131072])
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    args = ap.parse_args(argv)
    print("| layer | cp | tokens | cpscope all-gather | state chain (2cp-1 hops) | layout a2a | a2a / all-gather |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for layer in LAYERS:
        for cp in args.cp:
            for t in args.tokens:
                b = bytes_per_rank(layer, cp, t)
                mib = {k: v / 2**20 for k, v in b.items()}
                print(f"| {layer.name} | {cp} | {t} | {mib['cpscope all-gather']:.2f} MiB | "
                      f"{mib['state chain']:.2f} MiB | {mib['layout a2a']:.1f} MiB | "
                      f"{b['layout a2a'] / b['cpscope all-gather']:.1f}x |")


if __name__ == "__main__":
    main()
