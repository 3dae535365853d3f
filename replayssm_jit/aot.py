"""`python -m replayssm_jit.aot ...` is `python -m replayssm_jit aot ...`: module folders, or with
`wheel` the installable `replayssm-jit-cache` wheel (see replayssm_jit.jit.aot)."""

from __future__ import annotations

import sys

from replayssm_jit.jit.aot import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
