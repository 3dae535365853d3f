"""End-to-end decode step, conventional against ReplaySSM (issue 37; docs/e2e.md).

    python benchmarks/e2e.py --model M --batch 1,8 --context 1024 --mode conventional,replay_fp32

The harness lives in benchmarks/e2e/ (configs, layers, replica, run, plots).
"""

from __future__ import annotations

import sys
from pathlib import Path

# The repository root, so that the benchmarks.e2e package imports from a checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.e2e.run import main

if __name__ == "__main__":
    sys.exit(main())
