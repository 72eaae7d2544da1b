"""``python -m cpscope``: the command line (``env``, ``plan``); see :mod:`cpscope.cli`."""
from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
