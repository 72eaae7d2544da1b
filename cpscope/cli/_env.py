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
from typing import Any, Optional

__all__ = ["NAME", "HELP", "DESCRIPTION", "add_arguments", "run"]  # the command protocol of cpscope.cli

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
    """Per kind of attention block, the kernel it runs on ``device`` and why — the kernels router's own
    :func:`~cpscope.attention.routing_table` (one row per kind of its decision table), the attention sinks'
    merge, and the graphs cuDNN refused in this process (none in a fresh one).
    """
    import torch

    from ..attention import fallbacks, routing_table

    dev = device if device is not None else torch.device("cpu")
    out = [{"kind": kind, "kernel": route, "why": why} for kind, (route, why) in routing_table(dev).items()]
    triton = dev.type == "cuda" and _has_triton()
    out.append({"kind": "attention sinks (after the merge)", "kernel": "triton" if triton else "torch",
                "why": "Triton merge kernel on CUDA" if triton else
                "torch ops (" + ("Triton not importable" if dev.type == "cuda" else "no CUDA device") + ")"})
    for key, reason in fallbacks().items():  # (direction, route, kind, dtype, head dims, heads, device) -> why
        out.append({"kind": f"refused: {key[2]} {key[0]} on {key[1]} {key[3:]}", "kernel": "next route",
                    "why": reason})
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
