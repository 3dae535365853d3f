"""Autotuning, persisted per device: `python -m replayssm_jit autotune --model M --out FILE`.

It times every launch candidate of a model's decode step (the kernels the spec compiles x its
row tiles) on the present GPU at each batch asked for, and writes the fastest per (spec, mode,
batch) to a JSON file. plan_decode reads the file where one is given (`tuning=FILE`, or the
REPLAYSSM_TUNING environment variable) and falls back to the built-in policy for anything the
file does not cover: another device, spec or mode, or a batch above the largest one timed. A
batch takes the entry of the smallest timed batch at or above it. Fields the caller's
LaunchConfig fixes always win over the file. REPLAYSSM_TUNING is read once per process
(launch/environment.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass, fields, replace
from functools import lru_cache
from pathlib import Path

import torch

from replayssm_jit.launch.config import AUTO, LaunchConfig
from replayssm_jit.launch.environment import TUNING_ENV, launch_environment
from replayssm_jit.launch.policy import can_split
from replayssm_jit.spec import KernelSpec, spec_tilings

FORMAT_VERSION = 1

__all__ = ["TUNING_ENV", "Tuning", "candidates", "load_tuning", "main", "tune", "tuned_config"]


def device_name(device: torch.device) -> str:
    """The name a tuning file is keyed by: the CUDA device's, or "cpu"."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


@dataclass(frozen=True)
class Tuning:
    """A loaded tuning file: the device it was measured on and, per (spec URI, mode), the
    (batch, LaunchConfig) entries in increasing batch."""

    path: str
    device: str
    entries: dict

    def config_for(self, spec: KernelSpec, mode: str, batch: int, device: torch.device):
        """The tuned LaunchConfig of a step, or None where the file does not cover it."""
        if device_name(device) != self.device:
            return None
        for timed, config in self.entries.get((spec.uri, mode), ()):
            if batch <= timed:
                return config
        return None


def _bad(path: str, what: str) -> ValueError:
    return ValueError(f"tuning: {path} is not a tuning file ({what})")


@lru_cache(maxsize=8)
def _load(path: str, mtime_ns: int) -> Tuning:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"tuning: cannot read {path} as JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION:
        raise _bad(
            path,
            f"expected format {FORMAT_VERSION}, got {data.get('format') if isinstance(data, dict) else data!r}",
        )
    if not isinstance(data.get("device"), str) or not isinstance(data.get("entries"), list):
        raise _bad(path, "expected a 'device' string and an 'entries' list")
    entries: dict = {}
    for i, e in enumerate(data["entries"]):
        try:
            key = (str(e["uri"]), str(e["mode"]))
            batch = int(e["batch"])
            config = LaunchConfig(**e["config"])
        except (KeyError, TypeError, ValueError) as exc:
            raise _bad(path, f"entry {i}: {exc}") from None
        entries.setdefault(key, []).append((batch, config))
    for rows in entries.values():
        rows.sort(key=lambda r: r[0])
    return Tuning(path, data["device"], entries)


def load_tuning(path: object) -> Tuning:
    """The tuning file at `path` (a str or Path), read once per modification."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"tuning: expected a path (str or os.PathLike), got {type(path).__name__}")
    path = os.fspath(path)
    try:
        mtime = os.stat(path).st_mtime_ns
    except OSError as exc:
        raise ValueError(f"tuning: cannot read {path} ({exc.strerror})") from None
    return _load(path, mtime)


def tuned_config(config: LaunchConfig, tuning: object, spec: KernelSpec, mode: str, batch: int,
                 device: torch.device) -> LaunchConfig:  # fmt: skip
    """`config` with its "auto" fields taken from the tuning file (the argument, else
    REPLAYSSM_TUNING as read once, else none) where the file covers this step."""
    if tuning is None:
        tuning = launch_environment().tuning
        if tuning is None:
            return config
    loaded = tuning if isinstance(tuning, Tuning) else load_tuning(tuning)
    tuned = loaded.config_for(spec, mode, batch, device)
    if tuned is None:
        return config
    filled = {
        f.name: getattr(tuned, f.name)
        for f in fields(LaunchConfig)
        if getattr(config, f.name) == AUTO and getattr(tuned, f.name) != AUTO
    }
    return replace(config, **filled)


def candidates(spec: KernelSpec, mode: str) -> list[LaunchConfig]:
    """Every launch a step of `spec` can take: its compiled row tiles, and in replay mode each
    ReplaySSM kernel it has (flush-every-step only for FP32 checkpoints, whose rounding it keeps)."""
    tiles = [rows for rows, _ in spec_tilings(spec)]
    if mode == "conventional":
        return [LaunchConfig(rows_per_cta=r) for r in tiles]
    kernels = ["per-item"]
    if spec.state_dtype == "f32" and spec.read_dtype is None:
        kernels.append("flush-every-step")
    if can_split(spec):
        kernels.append("split")
    return [LaunchConfig(kernel=k, rows_per_cta=r) for k in kernels for r in tiles]


def _set_fields(config: LaunchConfig) -> dict:
    return {k: v for k, v in asdict(config).items() if v != AUTO}


def tune(layout, mode: str, batches: list[int], device: torch.device, timer, progress=None) -> dict:
    """Times the policy's launch and every candidate at each batch with `timer(plan, config) ->
    us` and returns the tuning file's content: per batch the fastest (an empty config where the
    policy's own choice is), its time, and the policy's choice and time."""
    from replayssm_jit.ops.plan import plan_decode

    entries = []
    for batch in batches:
        default = plan_decode(layout, batch, device=device, mode=mode, check_slot_values=False)
        default_us = timer(default, LaunchConfig())
        best = (default_us, LaunchConfig())
        for config in candidates(default.spec, mode):
            plan = plan_decode(layout, batch, device=device, mode=mode, config=config,
                               check_slot_values=False)  # fmt: skip
            us = timer(plan, config)
            if us < best[0]:
                best = (us, config)
            if progress is not None:
                progress(batch, config, us)
        entries.append(dict(uri=default.spec.uri, mode=mode, batch=batch,
                            config=_set_fields(best[1]), us=best[0], default_us=default_us,
                            default=dict(kernel=default.kernel, rows_per_cta=default.rows_per_cta)))  # fmt: skip
    return {"format": FORMAT_VERSION, "device": device_name(device), "entries": entries}


def timed_step(plan, layout, min_pool_bytes: float):
    """(step, slot_sets): one decode step of `plan` over the slot set it is given, on random
    model-shaped inputs, and enough disjoint slot sets of layout's pool for `min_pool_bytes`."""
    from replayssm_jit.demo import LAYERS
    from replayssm_jit.models import ModelShape
    from replayssm_jit.ops import gdn_decode, kda_decode, mamba2_decode, reset_slots

    ops = {"mamba2": mamba2_decode, "gdn": gdn_decode, "kda": kda_decode}
    gates = {"dt", "a", "b"}  # FP32 inputs whatever their rank (KDA's a is [batch, HV, K])
    dev, batch = plan.device, plan.batch_size
    shape = plan.layout.shape
    model = ModelShape("tuned", plan.family.name, 1, shape.key_heads, shape.value_heads,
                       shape.key_dim, shape.value_dim)  # fmt: skip
    gen = torch.Generator().manual_seed(batch)
    layer = LAYERS[plan.family.name](model, gen)
    sets = max(2, int(min_pool_bytes // (layout.bytes_per_slot() * batch)) + 1)
    tensors = layout.allocate(sets * batch, dev)
    reset_slots(layout, tensors, torch.arange(sets * batch, device=dev))
    h = torch.randn(batch, shape.value_heads * shape.value_dim, generator=gen, dtype=torch.float64)
    inputs = {k: v.to(dev, torch.float32 if k in gates or v.dim() <= 2 else layout.act_dtype)
              .contiguous() for k, v in layer.inputs(h).items()}  # fmt: skip
    params = {k: v.to(dev, torch.float32) for k, v in layer.params.items()}
    workspace = torch.empty(plan.workspace_floats, dtype=torch.float32, device=dev)
    slot_sets = [torch.arange(i * batch, (i + 1) * batch, dtype=torch.int32, device=dev)
                 for i in range(sets)]  # fmt: skip
    op = ops[plan.family.name]
    kw = {} if plan.replay else {n: None for n in (*layout.ring_names, "cursors")}

    def step(s):
        op(plan, **{**tensors, **kw}, **inputs, **params, slot_indices=s, workspace=workspace)

    return step, slot_sets


def graph_timer(layout, *, steps: int = 16, reps: int = 10, min_pool_bytes: float = 1e9):
    """A timer for tune(): a plan's step over L-step cycles of rotating slot sets (a pool far
    larger than L2), captured in a CUDA graph; the median of `reps` replays, us per step."""

    def timer(plan, config) -> float:
        dev = plan.device
        step, slot_sets = timed_step(plan, layout, min_pool_bytes)
        sets = len(slot_sets)
        for s in slot_sets:  # warm-up (and the JIT, where a module is not built yet)
            step(s)
        torch.cuda.synchronize(dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(steps):
                step(slot_sets[i % sets])
        graph.replay()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / steps)
        return statistics.median(times)

    return timer


def main(argv: list[str] | None = None) -> int:
    from replayssm_jit.families import get_family
    from replayssm_jit.families.layout import family_layout
    from replayssm_jit.models import get_model

    parser = argparse.ArgumentParser(prog="python -m replayssm_jit autotune",
                                     description=__doc__.splitlines()[0])  # fmt: skip
    parser.add_argument("--model", required=True, help="a model of replayssm_jit.models")
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--state-dtype", default="f32")
    parser.add_argument("--act-dtype", default="bf16")
    parser.add_argument("--mode", default="replay", choices=("replay", "conventional"))
    parser.add_argument("--out", type=Path, required=True, help="the tuning file to write")
    args = parser.parse_args(argv)
    try:
        batches = sorted({int(b) for b in args.batches.split(",")})
    except ValueError:
        batches = []
    if not batches or not all(1 <= b <= 65535 for b in batches):
        parser.error(
            f"--batches: expected comma-separated ints in [1, 65535], got {args.batches!r}"
        )
    try:
        model = get_model(args.model)
        layout = family_layout(
            model.family, window=args.window, state_dtype=args.state_dtype,
            act_dtype=args.act_dtype,
            **dict(zip(get_family(model.family).shape_args,
                       (model.key_heads, model.value_heads, model.d_k, model.d_v))),
        )  # fmt: skip
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    if not torch.cuda.is_available():
        parser.error("autotune times kernels: it needs a CUDA device")
    device = torch.device("cuda", torch.cuda.current_device())

    def progress(batch, config, us):
        print(f"  batch {batch:>5} {_set_fields(config)}: {us:.1f} us", file=sys.stderr, flush=True)

    result = tune(layout, args.mode, batches, device, graph_timer(layout), progress)
    args.out.write_text(json.dumps(result, indent=1))
    for e in result["entries"]:
        print(f"{e['uri']} batch {e['batch']}: {e['config']} {e['us']:.1f} us "
              f"(policy {e['default']} {e['default_us']:.1f} us)")  # fmt: skip
    return 0
