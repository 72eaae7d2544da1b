"""cpscope's command line: ``python -m cpscope <command>``, one module per command.

* ``env`` (:mod:`cpscope.cli._env`) — versions, GPUs, and which kernel each kind of attention block routes to here.
* ``plan`` (:mod:`cpscope.cli._plan`) — the hybrid-CP plan of a length distribution on a cluster and model shape,
  with the predicted step time, memory per rank and gain against every static CP size.

Every command answers ``--help``; torch and the optional packages are imported only by the command that needs them.

Example::

    >>> from cpscope.cli import main
    >>> main(["plan", "--dist", "sft", "--gpus-per-node", "8", "--preset", "llama3-8b", "--json"])  # doctest: +SKIP
    0
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

from . import _env as env, _plan as plan

__all__ = ["main"]  # parser() stays importable (tests, docs tooling)

COMMANDS = (env, plan)  # each: NAME, HELP, add_arguments(parser), run(args) -> int


def parser() -> argparse.ArgumentParser:
    """The ``python -m cpscope`` argument parser, one subcommand per module of :data:`COMMANDS`."""
    ap = argparse.ArgumentParser(prog="python -m cpscope", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.NAME, help=cmd.HELP, description=cmd.DESCRIPTION,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        cmd.add_arguments(p)
        p.set_defaults(run=cmd.run)
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``python -m cpscope`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    A ``ValueError`` (bad input: a missing file, a shape that does not divide, a package not installed) is printed
    as one line on stderr with status 2, never as a traceback.
    """
    ap = parser()
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    if getattr(args, "run", None) is None:
        ap.print_help()
        return 0
    try:
        return int(args.run(args))
    except ValueError as err:
        print(f"python -m cpscope {args.command}: error: {err}", file=sys.stderr)
        return 2
