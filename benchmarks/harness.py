"""Timing, sweeps and reporting shared by the benchmarks.

Method: warm-up eagerly, capture a call list into one CUDA graph, replay it untimed a few
times, then time `reps` replays with CUDA events over `rounds` captures; report the median
per-call time. Callers rotate state sets so that one graph touches far more state than L2.

A family's benchmark supplies `bench(shape, batch, window, state_name, args, kernels, config)`
returning result rows, its wrappers planned by `plan_wrappers` (with `launch_config(args,
config)`); `decode_timings` times our conventional and ReplaySSM steps the same way for every
family, `replay_traffic` is the bytes model, `config_rows` makes the rows, and `run_sweep` drives
the config list.

Launch choices (kernel, row tile, flags) are selected through LaunchConfig only: --launch fixes
them for a whole run ("kernel=split,rows_per_cta=16"; fields as replayssm_jit.LaunchConfig), and
--tiling-sweep times every launch variant of a config (`launch_variants`). Outputs go to
benchmarks/scratch/ (git-ignored) unless --out names a folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from replayssm_jit import LaunchConfig
from replayssm_jit.core.dtypes import (
    BLOCK_SCALED_DTYPES,
    DTYPE_BITS,
    NVFP4_BLOCK,
    ROW_SCALED_DTYPES,
    dtype_name,
)
from replayssm_jit.launch.config import parse_launch
from replayssm_jit.launch.environment import launch_environment

# Where experiment outputs go by default (git-ignored; benchmarks/results/ holds one committed
# folder per measured version).
SCRATCH_DIR = Path(__file__).resolve().parent / "scratch"
COPY_CEILING_TBPS = 4.21  # H200 device-to-device copy, read + write (shared/anchors)
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


class CheckpointFormat(NamedTuple):
    """A benchmark's checkpoint: carried dtype, separate mode's read dtype (or None), SR."""

    state: str
    read: str | None
    sr: bool


def parse_format(name: str) -> CheckpointFormat:
    """ "f32", "bf16sr", "e4m3", "f32+e4m3", "f16sr+e4m3sr", ...: carried[+read], each a
    checkpoint dtype with an optional "sr" suffix (stochastic rounding: one flag for the spec)."""
    parts = name.split("+")
    if not 1 <= len(parts) <= 2:
        raise ValueError(f"--states: expected DTYPE or HP+LP, got {name!r}")
    dtypes = [dtype_name(p.removesuffix("sr"), "--states", checkpoint=True) for p in parts]
    return CheckpointFormat(dtypes[0], dtypes[1] if len(parts) == 2 else None,
                            any(p.endswith("sr") for p in parts))  # fmt: skip


def checkpoint_bytes(dtype: str, cols: int) -> int:
    """Bytes of one state row of `cols` elements in `dtype`, with its row or block scales where
    it has them (an NVFP4 head's one FP32 scale, 4 bytes a head, is left out)."""
    blocks = cols // NVFP4_BLOCK if dtype in BLOCK_SCALED_DTYPES else 0
    return DTYPE_BITS[dtype] * cols // 8 + (4 if dtype in ROW_SCALED_DTYPES else 0) + blocks


REPLAY_KERNELS = ("conventional", "cycle", "nonflush", "flush", "staggered")


def time_graph(
    calls: list[Callable[[], object]], *, reps: int = 20, rounds: int = 2, warmup: int = 2
) -> dict:
    """Median microseconds per call of `calls`, captured as one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    per_call = []
    for _ in range(rounds):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        for _ in range(warmup):
            graph.replay()
        torch.cuda.synchronize()
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(reps)
        ]
        for start, end in events:
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        per_call += [s.elapsed_time(e) * 1e3 / len(calls) for s, e in events]
        del graph
    return {
        "us": statistics.median(per_call),
        "min": min(per_call),
        "max": max(per_call),
        "n": len(per_call),
    }


def copy_ceiling(nbytes: float = 4e9, reps: int = 15) -> dict:
    """Device-to-device copy bandwidth, counting bytes read plus written (TB/s); eager, median."""
    n = int(nbytes // 4)
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    us = statistics.median(times)
    return {"us": us, "tbps": 2 * n * 4 / (us * 1e-6) / 1e12}


def environment() -> dict:
    def sh(cmd):
        try:
            return subprocess.run(
                cmd, shell=True, capture_output=True, text=True, timeout=20
            ).stdout.strip()
        except Exception as exc:
            return f"unavailable: {exc}"

    props = torch.cuda.get_device_properties(0)
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": props.name,
        "sms": props.multi_processor_count,
        "l2_mb": round(getattr(props, "L2_cache_size", 0) / 1e6, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        # A snapshot sent to a device names its commit in the environment; that wins over any
        # git checkout around it (the device's copy of the tree may carry a stale .git).
        "git_commit": os.environ.get("REPLAYSSM_GIT_COMMIT")
        or sh("git rev-parse --verify -q HEAD")
        or "unknown",
        "git_dirty": False
        if os.environ.get("REPLAYSSM_GIT_COMMIT")
        else bool(sh("git status --porcelain --untracked-files=no")),
        # The experiments-only launch override; it fills every "auto" field of every plan().
        "replayssm_launch_env": launch_environment().launch,
        "nvidia_smi": sh(
            "nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader"
        ),
    }


def run_environment(device: torch.device, script: str, argv: list[str]) -> dict:
    """Where a study ran, on a CPU or a GPU: the device's name, torch and Python versions, the
    git commit and whether the tree was dirty, the CPU count and the command."""

    def git(*cmd):
        try:
            done = subprocess.run(["git", *cmd], cwd=Path(__file__).resolve().parent,
                                  capture_output=True, text=True)  # fmt: skip
        except OSError:
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    return {"device": name or device.type, "torch": torch.__version__, "commit": git("rev-parse",
            "HEAD"), "dirty": bool(git("status", "--porcelain")), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "command": shlex.join(["python", script, *argv])}  # fmt: skip


def plot_against_steps(curves: dict[str, list[tuple[int, float]]], path: Path, *, ylabel: str,
                       title: str) -> None:  # fmt: skip
    """A log-log plot of each configuration's (step N, value) points, styled by the label's
    first word (conv, replay, shared, separate); values of 0 are left out (no place on a log
    axis). Nothing where matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        print("no matplotlib: no plot", flush=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"conv": "-", "replay": "-.", "shared": "--", "separate": ":"}
    fig, ax = plt.subplots(figsize=(9, 6))
    for label, points in curves.items():
        shown = [(n, v) for n, v in points if v > 0]
        if shown:
            ax.plot(*zip(*shown), styles.get(label.split()[0], "-"), marker=".", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("decode step N")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=float))


# ---------------------------------------------------------------------------------------------
# Sweeps: arguments, the config list, the driver
# ---------------------------------------------------------------------------------------------


def launch_arg(text: str) -> LaunchConfig:
    """--launch: "field=value,..." as a LaunchConfig (argparse reports a bad value)."""
    try:
        return parse_launch(text, "--launch")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--launch: ")) from None


def add_launch_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--launch",
        type=launch_arg,
        default=LaunchConfig(),
        metavar="FIELD=VALUE,...",
        help="launch choices for every plan(), e.g. 'kernel=split,rows_per_cta=16' (fields: "
        "kernel, rows_per_cta, records_warps, capped_state_registers, overlap_prior_kernel, "
        "speculative_records; bools 0/1); default: the launch policy's",
    )


def add_run_args(p: argparse.ArgumentParser) -> None:
    """--launch and --out (the JSON's folder): what every benchmark script takes."""
    add_launch_arg(p)
    p.add_argument(
        "--out",
        type=Path,
        default=SCRATCH_DIR,
        help=f"folder for the JSON (default {SCRATCH_DIR}, git-ignored)",
    )


def launch_config(args, config: LaunchConfig | None = None) -> LaunchConfig:
    """The LaunchConfig a benchmark plans with: `config` (a launch variant, or None) with its
    "auto" fields from --launch."""
    base = getattr(args, "launch", None) or LaunchConfig()
    return (config or LaunchConfig()).with_defaults(base)


def sweep_parser(description: str, shapes: str) -> argparse.ArgumentParser:
    """The arguments every decode benchmark takes (shapes default to `shapes`)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--shapes", default=shapes)
    p.add_argument("--batches", default="1,8,32,64,128,256,512", help='"none" to skip')
    p.add_argument("--windows", default="16", help="L values swept at every batch")
    p.add_argument(
        "--window-sweep", default="4,8,16,32", help="L values swept at --window-sweep-batch"
    )
    p.add_argument("--window-sweep-batch", type=int, default=256)
    p.add_argument("--states", default="f32,bf16")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--min-pool-bytes", type=float, default=1.0e9)
    p.add_argument(
        "--tiling-sweep",
        default="",
        help="shape:batch:L:state,... configs to sweep launch variants at (every row tile of "
        "each kernel)",
    )
    add_run_args(p)
    return p


def sweep_configs(args) -> list[tuple[str, int, int, str]]:
    """(shape, batch, window, state) for every shape x state: the batch sweep at each --windows
    value, then the L sweep at --window-sweep-batch (skipping configs already listed)."""
    batches = "" if args.batches == "none" else args.batches
    configs = []
    for shape in args.shapes.split(","):
        for state in args.states.split(","):
            for batch in [int(b) for b in batches.split(",") if b]:
                for window in map(int, args.windows.split(",")):
                    configs.append((shape, batch, window, state))
            for window in map(int, args.window_sweep.split(",")):
                if (shape, args.window_sweep_batch, window, state) not in configs:
                    configs.append((shape, args.window_sweep_batch, window, state))
    return configs


def tiling_sweep_configs(args) -> list[tuple[str, int, int, str]]:
    return [
        (shape, int(batch), int(window), state)
        for shape, batch, window, state in (c.split(":") for c in args.tiling_sweep.split(",") if c)
    ]


def run_sweep(args, name: str, bench: Callable[..., list[dict]]) -> int:
    """Measure the copy ceiling, then every config and variant sweep; write `name`.json after each."""
    payload = {
        "environment": environment(),
        "command": " ".join(sys.argv),
        "launch": dataclasses.asdict(launch_config(args)),
        "copy": copy_ceiling(),
        "rows": [],
    }
    print(f"copy ceiling measured: {payload['copy']['tbps']:.2f} TB/s", flush=True)
    jobs = [(cfg, lambda cfg=cfg: bench(*cfg, args)) for cfg in sweep_configs(args)]
    jobs += [
        (cfg, lambda cfg=cfg: sweep_variants(bench, cfg, args, model_variants(cfg)))
        for cfg in tiling_sweep_configs(args)
    ]
    if jobs:  # the first timings of a process run slow (seen on the H200): one untimed pass first
        jobs[0][1]()
        torch.cuda.empty_cache()
    for cfg, job in jobs:
        rows = job()
        torch.cuda.empty_cache()
        payload["rows"] += rows
        summary = "  ".join(f"{r['kernel']}={r['us']:.1f}us({r['pct_ceiling']:.0f}%)" for r in rows)
        print(f"{cfg}: {summary}", flush=True)
        write_results(args.out / f"{name}.json", payload)
    return 0


def launch_variants(spec) -> list[tuple[str, LaunchConfig, tuple[str, ...]]]:
    """(label, launch config, kernels) per launch choice of `spec`'s module: every per-item row
    tile (conventional and a ReplaySSM cycle), every flush-every-step tile (a cycle) and every
    split-kernel tile (a ReplaySSM cycle; the largest also without speculative ring loads)."""
    from replayssm_jit.families.spec import spec_tilings

    tilings = [r for r, _ in spec_tilings(spec)]
    out = [
        (f"rows{r}", LaunchConfig(kernel="per-item", rows_per_cta=r), ("conventional", "cycle"))
        for r in tilings
    ]
    out += [
        (f"every{r}", LaunchConfig(kernel="flush-every-step", rows_per_cta=r), ("cycle",))
        for r in tilings
    ]
    out += [
        (f"split{r}", LaunchConfig(kernel="split", rows_per_cta=r), ("cycle",)) for r in tilings
    ]
    nospec = LaunchConfig(kernel="split", rows_per_cta=tilings[0], speculative_records=False)
    out.append((f"split{tilings[0]}-nospec", nospec, ("cycle",)))
    return out


def format_spec(shape: str, window: int, state: str):
    """The spec a benchmark's plan of checkpoint format `state` (parse_format) loads at `shape`:
    BF16 activations, the family's default flags, plus "sr" where the format asks. A window of
    1 is the conventional step's (one copy: a read copy has none)."""
    from replayssm_jit.core.models import get_model
    from replayssm_jit.families import get_family
    from replayssm_jit.jit.presets import model_spec

    model, fmt = get_model(shape), parse_format(state)
    if window == 1 and fmt.read:
        raise ValueError(f"{state}: a read copy has no conventional (L = 1) step")
    flags = (*get_family(model.family).default_flags, *(("sr",) if fmt.sr else ()))
    return model_spec(model, window=window, state_dtype=fmt.state, read_dtype=fmt.read, flags=flags)


def model_variants(cfg) -> list[tuple[str, LaunchConfig, tuple[str, ...]]]:
    """launch_variants of a (shape, batch, L, checkpoint format) config's model spec."""
    shape, _batch, window, state = cfg
    return launch_variants(format_spec(shape, window, state))


def sweep_variants(bench, cfg, args, variants) -> list[dict]:
    """Time `bench` at cfg once per launch variant (its LaunchConfig over --launch)."""
    rows = []
    for label, config, kernels in variants:
        for r in bench(*cfg, args, kernels=kernels, config=config):
            rows.append({**r, "kernel": f"{r['kernel']}@{label}"})
    return rows


# ---------------------------------------------------------------------------------------------
# Our decode steps: state sets, timings, the bytes model, result rows
# ---------------------------------------------------------------------------------------------


def plan_wrappers(wrapper_type, cache, batch: int, args, config, check_slot_values: bool,
                  **options):  # fmt: skip
    """Our conventional and ReplaySSM wrappers (`wrapper_type`) of `cache`, planned for `batch`
    with launch_config(args, config) and the plan `options`; the conventional one is None where
    the cache has a read copy (separate mode runs replay steps only)."""
    config = launch_config(args, config)
    conv = None
    if cache.layout.read_dtype is None:
        conv = wrapper_type(cache, mode="conventional", check_slot_values=check_slot_values)
        conv.plan(batch, config=config, **options)
    replay = wrapper_type(cache, mode="replay", check_slot_values=check_slot_values)
    replay.plan(batch, config=config, **options)
    return conv, replay


def num_sets(set_bytes: float, min_pool_bytes: float) -> int:
    """Disjoint state sets to rotate through so that one graph touches >= min_pool_bytes."""
    return max(2, math.ceil(min_pool_bytes / set_bytes))


def slot_sets(nsets: int, batch: int, gen: torch.Generator) -> list[torch.Tensor]:
    """`nsets` disjoint random int32 slot sets of `batch` slots out of nsets * batch."""
    perm = torch.randperm(nsets * batch, generator=gen, device="cuda").to(torch.int32)
    return [perm[i * batch : (i + 1) * batch].contiguous() for i in range(nsets)]


def decode_timings(
    cache,
    window: int,
    step: Callable,
    conv,
    replay,
    sets: list[torch.Tensor],
    args,
    kernels: Sequence[str] = REPLAY_KERNELS,
) -> dict[str, dict]:
    """Time our steps; step(wrapper, slots) -> a zero-argument call of one decode step.

    conventional: one step per set. cycle: L steps per set (one flush each). nonflush: L - 1
    steps per set from held = 0 (cursors zeroed in the graph). flush: one step per set at
    held = L - 1. amortized: ((L - 1) nonflush + flush) / L, except for the flush-every-step
    kernel, whose every step flushes with nothing held: there it is the cycle's time.
    staggered: the L-step cycle with the slots' cursors spread over 0..L-1, so that each step
    flushes about 1/L of its rows, as in an engine whose requests start at different steps.
    """
    kw = dict(reps=args.reps, rounds=args.rounds)
    res = {}
    if "conventional" in kernels:
        res["conventional"] = time_graph([step(conv, s) for s in sets], **kw)
    if window > 1 and "cycle" in kernels:
        cache.cursors.zero_()
        res["cycle"] = time_graph([step(replay, s) for _ in range(window) for s in sets], **kw)
    if window > 1 and "nonflush" in kernels:
        nonflush = [step(replay, s) for _ in range(window - 1) for s in sets]
        t = time_graph([*nonflush, lambda: cache.cursors.zero_()], **kw)
        res["nonflush"] = {**t, "us": t["us"] * (len(nonflush) + 1) / len(nonflush)}
        t = time_graph(
            [lambda: cache.cursors[:, 0].fill_(window - 1), *[step(replay, s) for s in sets]], **kw
        )
        res["flush"] = {**t, "us": t["us"] * (len(sets) + 1) / len(sets)}
        if replay.kernel == "flush-every-step":
            res["amortized"] = {"us": res.get("cycle", res["nonflush"])["us"]}
        else:
            res["amortized"] = {
                "us": ((window - 1) * res["nonflush"]["us"] + res["flush"]["us"]) / window
            }
    if window > 1 and "staggered" in kernels:
        stagger_cursors(cache, window, step, replay, sets)
        res["staggered"] = time_graph([step(replay, s) for _ in range(window) for s in sets], **kw)
    return res


def stagger_cursors(cache, window: int, step: Callable, replay, sets: list[torch.Tensor]) -> None:
    """Fill every set's ring rows 0..L-2 with real records (L - 1 eager non-flush steps from
    held = 0), then give the i-th slot of each set held = i mod L. An L-step graph then keeps
    each slot's phase: it flushes once and comes back to the same held count."""
    cache.cursors.zero_()
    for _ in range(window - 1):
        for s in sets:
            step(replay, s)()
    for s in sets:
        phase = torch.arange(len(s), device=cache.cursors.device, dtype=torch.int32) % window
        cache.cursors[s.long(), 0] = phase


def replay_traffic(
    state: float, record: float, window: int, read: float | None = None
) -> dict[str, float]:
    """Bytes each step must move: `state` = one batch's checkpoints, `record` = one token's
    records for the batch. Non-flush: read the checkpoint and the held records (mean over
    held = 0..L-2), append one. Flush: read and write the checkpoint, read L - 1 records. With
    a read copy (`read` bytes, separate mode): non-flush steps read it instead of the
    checkpoint; a flush also writes it (the minimum: its early read of the copy is not counted)."""
    mean_held = (window - 2) / 2 if window > 1 else 0
    nonflush = (state if read is None else read) + record * (mean_held + 1)
    flush = 2 * state + (read or 0) + record * (window - 1)
    return {
        "conventional": 2 * state,
        "nonflush": nonflush,
        "flush": flush,
        "amortized": ((window - 1) * nonflush + flush) / window,
    }


def config_rows(
    cfg: tuple, conv, replay, timings: dict[str, dict], traffic: dict[str, float], peers=()
) -> list[dict]:
    """result_rows of one (shape, batch, window, state) config timed on our planned `conv` and
    `replay` wrappers (their ReplaySSM kernel and flags, their row tiles); `peers`: the names of
    other libraries' kernels timed there (no row tile)."""
    shape, batch, window, state = cfg
    return result_rows(
        dict(
            shape=shape,
            batch=batch,
            window=window,
            state=state,
            replay_kernel=replay.kernel,
            replay_flags=replay.decode_plan.flag_bits,
        ),
        timings,
        traffic,
        {
            "conventional": conv.decode_plan.rows_per_cta if conv else None,
            "replay": replay.decode_plan.rows_per_cta,
            **dict.fromkeys(peers),
        },
    )


def result_rows(
    config: dict, timings: dict[str, dict], traffic: dict[str, float], rows_per_cta: dict
) -> list[dict]:
    """One row per timed kernel: time, bytes (a cycle, staggered or not, counts as amortized),
    TB/s, % of ceiling.

    rows_per_cta: per kernel name; missing names take rows_per_cta["replay"].
    """
    rows = []
    # flush-every-step: every step reads and writes the checkpoint (its "flush" row is the fold
    # of L - 1 held records, from another kernel's window)
    every_step = config.get("replay_kernel") == "flush-every-step"
    for kernel, t in timings.items():
        if every_step and kernel in ("cycle", "nonflush", "amortized", "staggered"):
            b = traffic["conventional"]
        else:
            b = traffic["amortized" if kernel in ("cycle", "staggered") else kernel]
        tbps = b / (t["us"] * 1e-6) / 1e12
        rows.append(
            dict(
                **config,
                kernel=kernel,
                us=t["us"],
                min=t.get("min"),
                max=t.get("max"),
                bytes=b,
                tbps=tbps,
                pct_ceiling=100 * tbps / COPY_CEILING_TBPS,
                rows_per_cta=rows_per_cta.get(kernel, rows_per_cta.get("replay")),
            )
        )
    return rows
