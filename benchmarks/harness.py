"""Timing and reporting shared by the benchmarks.

Method: warm-up eagerly, capture a call list into one CUDA graph, replay it untimed a few
times, then time `reps` replays with CUDA events over `rounds` captures; report the median
per-call time. Callers rotate state sets so that one graph touches far more state than L2.
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

COPY_CEILING_TBPS = 4.21  # H200 device-to-device copy, read + write (shared/anchors)


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
        "git_commit": sh("git rev-parse HEAD") or "unknown",
        "git_dirty": bool(sh("git status --porcelain --untracked-files=no")),
        "nvidia_smi": sh(
            "nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader"
        ),
    }


def write_results(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=float))
