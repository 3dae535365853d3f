"""`python -m replayssm_jit.aot`: see replayssm_jit.jit.aot."""

import sys

from replayssm_jit.jit.aot import main

if __name__ == "__main__":
    sys.exit(main())
