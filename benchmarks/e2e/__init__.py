"""End-to-end decode-step replica (issue 37): configs, layers, replica, run, plots.

Entry point: python benchmarks/e2e.py --model M --batch 1,8 --context 1024 --mode ...
(docs/e2e.md). This package sits outside replayssm_jit, which never imports it.
"""
