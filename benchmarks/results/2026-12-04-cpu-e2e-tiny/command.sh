#!/bin/sh
# The CPU example run of the end-to-end harness (tiny dims, torch path; no timings).
set -e
cd "$(dirname "$0")/../../.."
OMP_NUM_THREADS=1 python benchmarks/e2e.py --tiny --device cpu --model all --batch 1,4 --context 64 \
    --check-steps 256 --check-batch 2 --out benchmarks/results/2026-12-04-cpu-e2e-tiny
