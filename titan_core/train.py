"""``python -m titan_core.train`` (for ``torchrun -m``): the same command as ``titan run``."""

from __future__ import annotations

import sys

from titan_core.cli import exit_process, main

if __name__ == "__main__":
    exit_process(main(["run", *sys.argv[1:]]))
