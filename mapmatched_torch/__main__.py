"""``python -m mapmatched_torch``: the ``mapmatched-torch`` command line (see :mod:`mapmatched_torch.cli`)."""

from __future__ import annotations

import sys

from .cli import main

__all__: list = []

if __name__ == "__main__":
    sys.exit(main())
