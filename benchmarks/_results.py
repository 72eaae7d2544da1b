"""Where benchmark results go and how each one records the command that made it (standard library only).

Every JSON a driver writes carries, as its first field, ``"command"``: the command line that reproduces it
(``python benchmarks/<driver>.py ...``, or ``torchrun --nproc_per_node=N benchmarks/<driver>.py ...`` when started
by torchrun). Results kept in the repository live in ``benchmarks/results/`` (:data:`RESULTS_DIR`), listed with
their commands in ``benchmarks/results/README.md``.

Example::

    from _results import dump
    dump({"rows": rows}, os.path.join(args.out, "scope_overhead_cpu.json"))   # adds "command"
"""
from __future__ import annotations

import json
import os
import shlex
import sys
from typing import Any, Optional, Sequence

__all__ = ["RESULTS_DIR", "command_line", "with_command", "dump"]

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(_ROOT, "benchmarks", "results")


def command_line(argv: Optional[Sequence[str]] = None) -> str:
    """The command that started this process, with the script's path relative to the repository root."""
    argv = list(sys.argv if argv is None else argv)
    script = os.path.abspath(argv[0]) if argv else ""
    rel = os.path.relpath(script, _ROOT) if script.startswith(_ROOT + os.sep) else (argv[0] if argv else "")
    launcher = ["python"]
    if os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get("LOCAL_WORLD_SIZE"):
        launcher = ["torchrun", f"--nproc_per_node={os.environ['LOCAL_WORLD_SIZE']}"]
        nnodes = int(os.environ.get("WORLD_SIZE", "1")) // max(int(os.environ["LOCAL_WORLD_SIZE"]), 1)
        if nnodes > 1:
            launcher.append(f"--nnodes={nnodes}")
    return shlex.join(launcher + [rel] + argv[1:])


def with_command(obj: Any, command: Optional[str] = None) -> Any:
    """``obj`` (a dict) with ``"command"`` first; other objects are returned as they are."""
    if not isinstance(obj, dict):
        return obj
    rest = {k: v for k, v in obj.items() if k != "command"}
    return {"command": command or obj.get("command") or command_line(), **rest}


def dump(obj: Any, path: str, *, command: Optional[str] = None) -> str:
    """Write ``obj`` as indented JSON to ``path`` (folders created), with its ``"command"``; returns ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(with_command(obj, command), f, indent=1, default=str)
        f.write("\n")
    return path
