"""Every kernel choice of every family, in small shapes, for NVIDIA compute-sanitizer.

Each config is one family x mode/kernel (conventional; ReplaySSM per-item, flush-every-step and
split, the split step in each records-CTA width and state-kernel register form the family
compiles) x speculative ring loads on/off x compiled row tile x checkpoint dtype, and runs a
short schedule: 6 rows (3 live slots of a 6-slot pool, one faulted row of each kind, the rest pad
rows), rows permuted every step, the slots joining at steps 0, 1 and 3 so that one launch mixes
flush and non-flush rows holding different record counts, 2L + 4 steps (L = 4) so that every slot
flushes and its ring rows are written again after the flush, fresh random inputs every step. The
faulted rows: one names a slot id outside the pool (a new one each step: past the end, negative,
the int32 extremes), and in ReplaySSM configs one names slot 5, whose cursor is corrupted before
every step to a held count no step leaves (L, the capacity, -1, the int32 extremes); the kernels'
guards must give both rows NaN outputs and touch nothing (slot ids are not checked on the host:
the plan skips that read, as in a CUDA graph). Every input is made on the
host and copied in (no PyTorch kernel runs on the device: the only kernels are ours, and
initcheck sees every input initialised by a copy). Outputs are uninitialised device memory
(--outputs empty, for initcheck: copying them back reads every element, so an element the kernel
left unwritten is reported) or NaN-poisoned (--outputs nan: a NaN left is a failed config).
After each config: live rows' outputs finite, pad rows exactly zero, faulted rows all NaN, the
live slots' checkpoints finite and cursors as counted, every other slot's checkpoint, rings and
cursors bit-identical (the corrupted cursor as last written).

The speculative configs (family x verify/snapshot x T = 2 and 4 drafts x verify row tile x
checkpoint dtype, on L = 4 replay plans) run the same rows with per-row draft counts cycling
through 0..T: verify alternates chains (committed by the next verify's fused commit, or by
commit_drafts) and trees (committed by commit_drafts with an accepted path that compacts), and
the schedule must reach early flushes, launches mixing flush and non-flush rows, and ring rows
rewritten after a flush; slot 5's cursor is corrupted in every word pair no launch leaves. The
snapshot baseline writes each live slot's T snapshot slots (one out-of-range snapshot slot on
CUDA, its write skipped) and must leave the rows' own slots, rings and cursors bit-identical.
commit_snapshots is not run: it is PyTorch ops, not a kernel of ours.

    python scripts/sanitize_kernels.py --list            # the configs and their spec URIs (CPU)
    python scripts/sanitize_kernels.py --check-preset    # every URI is in the AOT preset (CPU)
    python scripts/sanitize_kernels.py --ops verify snapshot ...  # the speculative configs only
    compute-sanitizer --tool memcheck python scripts/sanitize_kernels.py [--quick] ...

scripts/sanitize.sh runs it under each tool on the H200; the modules come from the AOT preset
"sanitizer" (tests/support/aot_presets.py), which lists exactly the specs this script loads.
--device cpu runs the same schedules through the PyTorch path (a check of this script's own
bookkeeping; the launch choices do not apply there, and the CPU path checks slot ids on the host
and raises, so the out-of-range row becomes a pad row there).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules below
from sanitize_configs import (
    FULL_STEPS,
    PRESET,
    SPEC_OPS,
    Config,
    SpecConfig,
    all_configs,
    op_of,
)
from sanitize_schedules import ConfigFailed, run_config, run_spec_config

from replayssm_jit.families import FAMILIES
from replayssm_jit.launch.config import LAUNCH_ENV
from replayssm_jit.launch.environment import reload_launch_environment

# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def check_preset(configs: list[Config], complete: bool) -> int:
    """Every URI the configs load is in the AOT preset (and, for the complete set, nothing
    else is); with REPLAYSSM_AOT_DIR set, each is also built there with the current sources."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from support import aot_presets  # the test suites' presets (the module the tests import)

    preset = {s.uri: s for s in aot_presets.PRESETS[PRESET]()}
    needed = {c.uri: c.spec for c in configs}
    missing = sorted(set(needed) - set(preset))
    extra = sorted(set(preset) - set(needed)) if complete else []
    for uri in missing:
        print(f"not in preset {PRESET!r}: {uri}")
    for uri in extra:
        print(f"in preset {PRESET!r} but not loaded: {uri}")
    unbuilt = []
    if os.environ.get("REPLAYSSM_AOT_DIR"):
        from replayssm_jit.jit.build import find_prebuilt

        unbuilt = [uri for uri, spec in sorted(needed.items()) if find_prebuilt(spec) is None]
        for uri in unbuilt:
            print(f"not built (or stale) under REPLAYSSM_AOT_DIR: {uri}")
    problems = [
        f"{len(v)} {what}"
        for v, what in ((missing, "not in the preset"), (extra, "extra"), (unbuilt, "not built"))
        if v
    ]
    built = ", all built" if os.environ.get("REPLAYSSM_AOT_DIR") else ""
    print(
        f"check-preset: {len(configs)} configs load {len(needed)} specs; preset {PRESET!r} has "
        f"{len(preset)}: " + (f"MISMATCH ({', '.join(problems)})" if problems else f"ok{built}")
    )
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--families", nargs="+", choices=sorted(FAMILIES), default=list(FAMILIES),
        help="families to run (default: every registered family)",
    )  # fmt: skip
    parser.add_argument(
        "--quick", action="store_true",
        help="largest and smallest row tiles only, FP32, BF16+SR, e4m3+SR and FP32 + e4m3+SR "
        "checkpoints only",
    )  # fmt: skip
    parser.add_argument(
        "--ops", nargs="+", choices=("decode", *SPEC_OPS), default=["decode", *SPEC_OPS],
        help="the steps to run: decode (every kernel choice), verify (with commits), snapshot",
    )  # fmt: skip
    parser.add_argument("--list", action="store_true", help="print the configs and exit (CPU)")
    parser.add_argument(
        "--check-preset", action="store_true",
        help=f"check that every URI is in the AOT preset {PRESET!r} and exit (CPU)",
    )  # fmt: skip
    parser.add_argument(
        "--steps", type=int, default=FULL_STEPS, help="decode steps per config (2L + 4)"
    )
    parser.add_argument(
        "--outputs", choices=("empty", "nan"), default="empty",
        help="output buffers: uninitialised (initcheck) or NaN-poisoned",
    )  # fmt: skip
    parser.add_argument(
        "--empty-rings", action="store_true",
        help="leave the rings uninitialised where no speculative load reads them (initcheck)",
    )  # fmt: skip
    parser.add_argument(
        "--shard", default="0/1", help="K/N: run every N-th config from the K-th (default 0/1)"
    )
    parser.add_argument(
        "--time-budget", type=float, default=0.0,
        help="seconds after which no further config starts (0: none); the rest count as not run",
    )  # fmt: skip
    parser.add_argument(
        "--formats", default="",
        help="comma-separated checkpoint formats to run, as named in the configs (e.g. "
        "e4m3,e4m3+sr,f32+e4m3+sr; default: every one)",
    )  # fmt: skip
    parser.add_argument(
        "--device", default="cuda", choices=("cuda", "cpu"),
        help="cpu: the same schedules on the PyTorch path (checks this script, not kernels)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    started = time.monotonic()
    os.environ.pop(LAUNCH_ENV, None)  # launch choices come from each config alone
    reload_launch_environment()
    if args.steps < 0:
        parser.error(f"--steps: expected >= 0, got {args.steps}")
    try:
        k, n = (int(v) for v in args.shard.split("/"))
        assert 0 <= k < n
    except (ValueError, AssertionError):
        parser.error(f"--shard: expected K/N with 0 <= K < N, got {args.shard!r}")
    families = [f for f in FAMILIES if f in args.families]  # registry order
    configs = [c for c in all_configs(families, args.quick) if op_of(c) in args.ops]
    if args.formats:
        wanted = set(args.formats.split(","))
        configs = [c for c in configs if c.state + ("+sr" if c.sr else "") in wanted]
    complete = not args.quick and families == list(FAMILIES) and len(args.ops) == 1 + len(SPEC_OPS)
    if args.check_preset:
        return check_preset(configs, complete)
    configs = configs[k::n]
    if args.list:
        for i, cfg in enumerate(configs):
            print(f"{i:4d} {cfg.name:<86} {cfg.uri}")
        counts = {f: sum(c.family == f for c in configs) for f in families}
        specs = len({c.uri for c in configs})
        print(f"{len(configs)} configs ({', '.join(f'{f} {c}' for f, c in counts.items())}), "
              f"{specs} specs")  # fmt: skip
        return 0
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("sanitize_kernels: no CUDA device (--list and --check-preset run without one)")
            return 2
        from replayssm_jit.jit import env
        from replayssm_jit.jit.build import find_prebuilt

        if env.jit_disabled():
            unbuilt = sorted({c.uri for c in configs if find_prebuilt(c.spec) is None})
            if unbuilt:
                print(f"sanitize_kernels: {len(unbuilt)} specs not AOT-built for these sources "
                      f"(build the preset {PRESET!r} with the same REPLAYSSM_JIT_DEBUG): "
                      + ", ".join(unbuilt))  # fmt: skip
                return 2
        no_caching = os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "-")
        print(f"device {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
              f"AOT {os.environ.get('REPLAYSSM_AOT_DIR', '-')}, "
              f"PYTORCH_NO_CUDA_MEMORY_CACHING={no_caching}")  # fmt: skip
    print(f"{len(configs)} configs, {args.steps} steps each, outputs {args.outputs}, "
          f"rings {'empty where unread' if args.empty_rings else 'initialised'}")  # fmt: skip
    ok = failed = 0
    for i, cfg in enumerate(configs):
        if args.time_budget and time.monotonic() - started > args.time_budget:
            print(f"time budget of {args.time_budget:.0f} s spent: {len(configs) - i} not run")
            break
        t0 = time.monotonic()
        # The config's name first: a sanitizer report printed while it runs lands after it.
        print(f"[{i + 1:4d}/{len(configs)}] {cfg.name} ", end="", flush=True)
        try:
            if isinstance(cfg, SpecConfig):
                run_spec_config(cfg, device=device, steps=args.steps, outputs=args.outputs)
            else:
                run_config(cfg, device=device, steps=args.steps, outputs=args.outputs,
                           empty_rings=args.empty_rings)  # fmt: skip
            ok += 1
            status = "ok"
        except Exception as exc:
            failed += 1
            status = "FAIL"
            print()
            if not isinstance(exc, ConfigFailed):
                traceback.print_exc()
            print(f"     {type(exc).__name__}: {exc}")
        print(f"{status} ({time.monotonic() - t0:.2f} s)", flush=True)
        if status == "FAIL" and device.type == "cuda":
            try:
                torch.cuda.synchronize()
            except Exception:
                print("CUDA context lost: stopping")
                break
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # nothing cached left for --leak-check to report
    elapsed = time.monotonic() - started
    ran = ok + failed
    print(f"sanitize_kernels: {len(configs)} configs: {ok} ok, {failed} failed, "
          f"{len(configs) - ran} not run ({elapsed:.1f} s"
          f"{f', {elapsed / ran:.2f} s per config' if ran else ''})")  # fmt: skip
    if failed:
        return 1
    return 3 if ran < len(configs) else 0


if __name__ == "__main__":
    sys.exit(main())
