"""`python -m bench`: list every benchmark; `python -m bench NAME [args]`: run one.

`python -m bench NAME args` is `python -m bench.NAME args`: the module's `main(args)` runs and its
return value is the exit status.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence

from bench.registry import listing, lookup


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "list"):
        try:
            print(listing(), flush=True)
        except BrokenPipeError:  # `python -m bench | head`: the reader left; no traceback
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    try:
        entry = lookup(args[0])
    except KeyError as e:
        print(f"python -m bench: {e.args[0]}", file=sys.stderr)
        return 2
    module = importlib.import_module(entry.module)
    sys.argv = [f"python -m bench {entry.name}", *args[1:]]
    return int(module.main(args[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
