"""``python -m cpscope env``: what this machine runs — versions, GPUs, and which kernel each kind of attention block
routes to here, and why. Attach its output (``--json`` for a machine-readable copy) to a bug report.

Every version is read without importing the package where its distribution metadata has it; a package that is absent
(or fails to import) reads ``"not installed"`` (or the import error), never a crash.

Example::

    python -m cpscope env
    python -m cpscope env --json
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata as metadata
import json
import platform
import sys
from types import SimpleNamespace
from typing import Any, Optional

__all__ = ["NAME", "HELP", "DESCRIPTION", "add_arguments", "run", "collect"]

NAME = "env"
HELP = "versions, GPUs and the attention kernel each block kind routes to on this machine"
DESCRIPTION = __doc__.split("\n\nExample::")[0]

NOT_INSTALLED = "not installed"

# (label, distribution names to try, module to import when no distribution has it)
PACKAGES = (
    ("torch", ("torch",), "torch"),
    ("triton", ("triton", "pytorch-triton"), "triton"),
    ("cudnn frontend", ("nvidia-cudnn-frontend",), "cudnn"),
    ("transformer_engine", ("transformer-engine", "transformer_engine", "transformer-engine-torch"),
     "transformer_engine"),
    ("transformers", ("transformers",), "transformers"),
    ("trl", ("trl",), "trl"),
    ("accelerate", ("accelerate",), "accelerate"),
    ("datasets", ("datasets",), "datasets"),
    ("megatron-core", ("megatron-core", "megatron_core"), "megatron.core"),
    ("flash-linear-attention", ("flash-linear-attention", "fla-core"), "fla"),
    ("numpy", ("numpy",), "numpy"),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _version(dists: tuple[str, ...], module: str) -> str:
    for d in dists:
        try:
            return metadata.version(d)
        except metadata.PackageNotFoundError:
            continue
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return NOT_INSTALLED
    except Exception as err:  # noqa: BLE001 - a broken install is reported, never raised
        return f"import fails: {type(err).__name__}: {str(err)[:120]}"
    return str(getattr(mod, "__version__", "installed (version unknown)"))


def _torch_details() -> tuple[dict[str, Any], list[dict[str, Any]], Any]:
    """``(cuda/cudnn versions, GPUs, torch or None)``."""
    try:
        import torch
    except Exception as err:  # noqa: BLE001
        return {"torch import": f"{type(err).__name__}: {err}"}, [], None
    cudnn: Optional[Any] = None
    try:
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception:  # noqa: BLE001
        cudnn = None
    info = {"cuda (torch built with)": torch.version.cuda or "none (CPU build)",
            "cudnn (torch's)": cudnn if cudnn is not None else "not available",
            "cudnn backend (frontend's)": _frontend_backend()}
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                         "compute_capability": f"{p.major}.{p.minor}"})
    return info, gpus, torch


def _frontend_backend() -> Any:
    try:
        import cudnn  # nvidia-cudnn-frontend
    except Exception:  # noqa: BLE001 - absent or broken: not available
        return "not available (no cudnn frontend)"
    try:
        return int(cudnn.backend_version())
    except Exception as err:  # noqa: BLE001
        return f"unknown ({type(err).__name__})"


def _routes(device: Any) -> list[dict[str, str]]:
    """Per kind of attention block, the kernel it runs on ``device`` and why — from today's routing code
    (:mod:`cpscope.attention.blocks` and its ``_kernels`` module: ``route`` / ``on_cudnn`` / ``fallbacks``).

    The one place to switch to the single router's ``routing_table(device)`` when it lands: it returns the same
    rows (kind, kernel, why).
    """
    import torch

    from ..attention import _kernels
    from ..attention.blocks import Varlen

    if device is None or device.type != "cuda":
        return [{"kind": "every block", "kernel": "exact", "why": "no CUDA device: the CPU path (exact math, tiled)"}]
    q = SimpleNamespace(device=device)  # the router reads only the block's device
    cudnn = _kernels.route(q, None, True) == "cudnn"
    why_cudnn = ("cuDNN frontend importable, cuDNN >= 9.6, sm90+" if cudnn else
                 "no cuDNN route here (needs the cuDNN frontend, cuDNN >= 9.6 and sm90+)")
    cu = torch.zeros(2, dtype=torch.int32)
    same = Varlen(cu, cu, 1, 1, (0, 1), (0, 1))
    other = Varlen(cu, torch.zeros(2, dtype=torch.int32), 1, 1, (0, 1), (0, 2))

    def pick(softcap: Optional[float], ok: bool) -> tuple[str, str]:
        if cudnn and ok:
            return "cudnn", why_cudnn
        how = _kernels.route(q, softcap, False)
        reason = why_cudnn if not cudnn else "this kind failed cuDNN's float64 parity check on H200: kept off cuDNN"
        return how, reason + (" -> flash-attention-2 (aten)" if how == "flash" else " -> exact math (softcap)")

    rows = [
        ("dense, plain (no window / softcap)", "cudnn", "aten's cuDNN attention (cpscope's default for dense blocks)"),
        ("packed thd, plain", *(("cudnn", why_cudnn + " (cuDNN ragged attention)") if cudnn else
                                ("flash", why_cudnn + " -> flash-attention-2 varlen (aten)"))),
        ("dense, window in one kernel", *pick(None, _kernels.on_cudnn(8, 8, True, None, (4, 0), None))),
        ("dense, two-sided window (two kernels)", *pick(None, _kernels.on_cudnn(8, 8, False, None, (2, 2), None))),
        ("packed thd, window", *pick(None, _kernels.on_cudnn(8, 8, True, same, (4, 0), None))),
        ("dense, softcap", *pick(30.0, _kernels.on_cudnn(8, 8, True, None, None, 30.0))),
        ("packed thd, softcap + left window", *pick(30.0, _kernels.on_cudnn(8, 8, True, same, (4, 0), 30.0))),
        ("packed thd, softcap (other)", *pick(30.0, _kernels.on_cudnn(8, 8, True, other, None, 30.0))),
        ("dense, v head dim != q/k (MLA)", "cudnn", "aten's cuDNN attention takes any head dims"),
        ("packed thd, v head dim != q/k (MLA)", *(("cudnn", why_cudnn) if cudnn else
                                                  ("flash", why_cudnn + " -> flash-attention-2, v zero-padded"))),
        ("attention sinks (after the merge)", "triton" if _has_triton() else "torch",
         "Triton merge kernel on CUDA" if _has_triton() else "Triton not importable: torch ops"),
    ]
    out = [{"kind": k, "kernel": how, "why": why} for k, how, why in rows]
    for kind, reason in _kernels.fallbacks().items():  # refusals seen in this process (none in a fresh one)
        out.append({"kind": f"refused: {kind[0]} {kind[1:]}", "kernel": "next route", "why": reason})
    return out


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


def collect() -> dict[str, Any]:
    """The report as a dict: ``python``, ``platform``, ``cpscope``, ``packages``, ``cuda``, ``gpus``, ``routes``."""
    from .._version import __version__

    packages = {label: _version(dists, module) for label, dists, module in PACKAGES}
    cuda, gpus, torch = _torch_details()
    device = None
    if torch is not None and gpus:
        device = torch.device("cuda", torch.cuda.current_device())
    try:
        routes = _routes(device if torch is not None else None) if torch is not None else []
    except Exception as err:  # noqa: BLE001 - the report must still print
        routes = [{"kind": "?", "kernel": "?", "why": f"routing could not be read: {type(err).__name__}: {err}"}]
    return {"python": sys.version.split()[0], "platform": platform.platform(), "cpscope": __version__,
            "packages": packages, "cuda": cuda, "gpus": gpus or "no CUDA device", "routes": routes}


def render(report: dict[str, Any]) -> str:
    lines = [f"cpscope {report['cpscope']}  python {report['python']}  {report['platform']}", "", "packages:"]
    lines += [f"  {k:<24} {v}" for k, v in report["packages"].items()]
    lines += ["", "CUDA:"] + [f"  {k:<27} {v}" for k, v in report["cuda"].items()]
    gpus = report["gpus"]
    lines += ["", "GPUs:"] + ([f"  {gpus}"] if isinstance(gpus, str) else
                              [f"  cuda:{g['index']}  {g['name']}  {g['memory_gib']} GiB  sm {g['compute_capability']}"
                               for g in gpus])
    lines += ["", "attention block routing (first GPU):"]
    width = max((len(r["kind"]) for r in report["routes"]), default=10)
    lines += [f"  {r['kind']:<{width}}  {r['kernel']:<7} {r['why']}" for r in report["routes"]]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    report = collect()
    print(json.dumps(report, indent=1, default=str) if args.json else render(report))
    return 0
