"""Per-kernel device time of one decode step (torch.profiler), for the benchmarks' configs.

For each (shape, batch, L, state): the conventional step, a ReplaySSM non-flush step at
held = --held (default L // 2) and a flush step (held = L - 1), each over every slot set, with
each kernel's mean duration per step (the split kernel's records and state kernels apart) next
to the step's CUDA-event time (eager launches, so launch gaps included). A programmatic dependent
launch starts before its primary ends, so the two kernels' durations can add up to more than the
step. At batch 1 with FP32 checkpoints the default kernel is flush-every-step: there every phase
flushes, and its steady state is --held 0. --launch fixes launch choices as in the benchmarks
(a LaunchConfig for every plan(), e.g. "kernel=split,rows_per_cta=32").

    python benchmarks/profile_steps.py --family mamba2 --shapes super120b [--out DIR]

Writes profile_FAMILY.json into --out (default benchmarks/scratch/, git-ignored).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gdn
import bench_mamba2
from harness import add_run_args

BENCHES = {"mamba2": bench_mamba2, "gdn": bench_gdn}


def kernel_label(name: str) -> str:
    """'records', 'state' or 'per-item' from a demangled kernel name."""
    for pattern, label in (
        ("::Records<", "records"),
        ("::State<", "state"),
        ("::Kernel<", "per-item"),
    ):
        if pattern in name:
            return label
    return re.sub(r"[<(].*", "", name)[:40]


def profile_calls(calls, prepare) -> tuple[dict[str, float], float]:
    """Mean device microseconds per kernel label over `calls`, and the events time of them all."""
    prepare()
    for call in calls:  # warm (and, for non-flush, the same held count as the timed run)
        call()
    prepare()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start.record()
        for call in calls:
            call()
        end.record()
        torch.cuda.synchronize()
    per_label: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_label[kernel_label(event.name)] += event.time_range.elapsed_us() / len(calls)
    return dict(per_label), start.elapsed_time(end) * 1e3 / len(calls)


def make_profiler(window: int, held: int, results: list, config: dict, single: bool):
    def decode_timings(cache, window_, step, conv, replay, sets, args, kernels=()):
        # eager steps: the wrappers were planned with check_slot_values=False (no host read of
        # the slot ids, so no sync between launches)
        assert conv is None or not conv.decode_plan.check_slot_values
        assert not replay.decode_plan.check_slot_values

        def at_held(h):
            return lambda: cache.cursors[:, 0].fill_(h)

        phases = {
            "conventional": ([step(conv, s) for s in sets], lambda: None),
            f"nonflush@held{held}": ([step(replay, s) for s in sets], at_held(held)),
            "flush": ([step(replay, s) for s in sets], at_held(window - 1)),
        }
        if conv is None:  # separate mode runs replay steps only
            del phases["conventional"]
        if single:  # one step per phase, nothing timed (for a kernel profiler such as ncu)
            for calls, prepare in phases.values():
                prepare()
                calls[0]()
            torch.cuda.synchronize()
            return {}
        for phase, (calls, prepare) in phases.items():
            kernels_us, step_us = profile_calls(calls, prepare)
            row = {**config, "phase": phase, "step_us": step_us, "kernels_us": kernels_us,
                   "replay_kernel": replay.kernel}  # fmt: skip
            results.append(row)
            parts = "  ".join(f"{k}={v:.1f}" for k, v in sorted(kernels_us.items()))
            print(f"{config} {phase}: step {step_us:.1f} us  [{parts}]", flush=True)
        return {}

    return decode_timings


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=sorted(BENCHES), required=True)
    p.add_argument("--shapes", required=True)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--held", type=int, default=None)
    p.add_argument("--states", default="f32")
    p.add_argument("--min-pool-bytes", type=float, default=1.0e9)
    p.add_argument("--single", action="store_true", help="one untimed step per phase (for ncu)")
    add_run_args(p)
    args = p.parse_args(argv)
    held = args.window // 2 if args.held is None else args.held
    bench = BENCHES[args.family]
    results: list[dict] = []
    for shape in args.shapes.split(","):
        for state in args.states.split(","):
            config = dict(shape=shape, batch=args.batch, window=args.window, state=state)
            bench.decode_timings = make_profiler(args.window, held, results, config, args.single)
            bench_args = argparse.Namespace(
                min_pool_bytes=args.min_pool_bytes, reps=1, rounds=1, launch=args.launch
            )
            kernels = ("conventional", "cycle")
            bench.bench_config(
                shape, args.batch, args.window, state, bench_args, kernels=kernels,
                check_slot_values=False,
            )  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"profile_{args.family}.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
