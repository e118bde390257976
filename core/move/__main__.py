"""Regenerate the state tables in docs/move.md: ``python -m capsulefs.core.move docs/move.md``."""

import sys

from ..fsutil import atomic_write
from ._describe import update_doc

if __name__ == "__main__":
    for path in sys.argv[1:]:
        with open(path, encoding="utf-8") as f:
            old = f.read()
        new = update_doc(old)
        if new != old:
            atomic_write(path, new.encode("utf-8"))
