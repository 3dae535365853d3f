"""`python -m replayssm_jit autotune --model M --out FILE`: time every launch candidate of a
model's decode step (the kernels its spec compiles x its row tiles) on the present GPU at each
batch asked for, and write the fastest per (spec, mode, batch) to a tuning file
(replayssm_jit/launch/tuning.py reads it). With `--drafts T` (T > 1) it times the verify of T
drafts with its commit fused instead, over its verify kernels x tiles ("verify" entries)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from replayssm_jit.cli.demo import LAYERS
from replayssm_jit.core.models import ModelShape, get_model
from replayssm_jit.families import get_family
from replayssm_jit.families.layout import family_layout
from replayssm_jit.launch.config import LaunchConfig
from replayssm_jit.launch.tuning import FORMAT_VERSION, candidates, device_name, set_fields
from replayssm_jit.ops import plan_decode, reset_slots
from replayssm_jit.ops.registry import family_ops

__all__ = ["graph_timer", "main", "timed_step", "timed_verify", "tune"]


def tune(layout, mode: str, batches: list[int], device: torch.device, timer, progress=None) -> dict:
    """Times the policy's launch and every candidate at each batch with `timer(plan, config) ->
    us` and returns the tuning file's content: per batch the fastest (an empty config where the
    policy's own choice is), its time, and the policy's choice and time. Mode "verify" (a layout
    with drafts) times replay plans over the verify candidates."""
    plan_mode = "replay" if mode == "verify" else mode
    entries = []
    for batch in batches:
        default = plan_decode(layout, batch, device=device, mode=plan_mode, check_slot_values=False)
        default_us = timer(default, LaunchConfig())
        best = (default_us, LaunchConfig())
        for config in candidates(default.spec, mode):
            plan = plan_decode(layout, batch, device=device, mode=plan_mode, config=config,
                               check_slot_values=False)  # fmt: skip
            us = timer(plan, config)
            if us < best[0]:
                best = (us, config)
            if progress is not None:
                progress(batch, config, us)
        entries.append(dict(uri=default.spec.uri, mode=mode, batch=batch,
                            config=set_fields(best[1]), us=best[0], default_us=default_us,
                            default=_chosen(default, mode)))  # fmt: skip
    return {"format": FORMAT_VERSION, "device": device_name(device), "entries": entries}


def _chosen(plan, mode: str) -> dict:
    """The policy's choice a tuning entry records: the verify kernel and tile in mode "verify"."""
    if mode == "verify":
        return dict(verify_kernel=plan.verify_kernel, verify_rows_per_cta=plan.verify_rows_per_cta)
    return dict(kernel=plan.kernel, rows_per_cta=plan.rows_per_cta)


def _timed_pool(plan, layout, min_pool_bytes: float, tokens: int):
    """(tensors, inputs, params, workspace, slot_sets, gen) of a timed call: random model-shaped
    inputs (`tokens` per row, stacked on dim 1 where more than one) and enough disjoint slot sets
    of layout's pool for `min_pool_bytes`."""
    gates = {"dt", "a", "b"}  # FP32 inputs whatever their rank (KDA's a is [batch, HV, K])
    dev, batch = plan.device, plan.batch_size
    shape = plan.layout.shape
    model = ModelShape("tuned", plan.family.name, 1, shape.key_heads, shape.value_heads,
                       shape.key_dim, shape.value_dim)  # fmt: skip
    gen = torch.Generator().manual_seed(batch)
    layer = LAYERS[plan.family](model, gen)
    sets = max(2, int(min_pool_bytes // (layout.bytes_per_slot() * batch)) + 1)
    tensors = layout.allocate(sets * batch, dev)
    reset_slots(layout, tensors, torch.arange(sets * batch, device=dev))
    width = shape.value_heads * shape.value_dim
    per_token = [layer.inputs(torch.randn(batch, width, generator=gen, dtype=torch.float64))
                 for _ in range(tokens)]  # fmt: skip
    inputs = {}
    for k, v in per_token[0].items():
        value = v if tokens == 1 else torch.stack([t[k] for t in per_token], dim=1)
        dtype = torch.float32 if k in gates or v.dim() <= 2 else layout.act_dtype
        inputs[k] = value.to(dev, dtype).contiguous()
    params = {k: v.to(dev, torch.float32) for k, v in layer.params.items()}
    workspace = torch.empty(plan.workspace_floats, dtype=torch.float32, device=dev)
    slot_sets = [torch.arange(i * batch, (i + 1) * batch, dtype=torch.int32, device=dev)
                 for i in range(sets)]  # fmt: skip
    return tensors, inputs, params, workspace, slot_sets, gen


def timed_step(plan, layout, min_pool_bytes: float):
    """(step, slot_sets): one decode step of `plan` over the slot set it is given, on random
    model-shaped inputs, and enough disjoint slot sets of layout's pool for `min_pool_bytes`."""
    tensors, inputs, params, workspace, slot_sets, _ = _timed_pool(plan, layout, min_pool_bytes, 1)
    op = family_ops(plan.family).decode
    kw = {} if plan.replay else {n: None for n in (*layout.ring_names, "cursors")}

    def step(s):
        op(plan, **{**tensors, **kw}, **inputs, **params, slot_indices=s, workspace=workspace)

    return step, slot_sets


def timed_verify(plan, layout, min_pool_bytes: float):
    """(step, slot_sets) as timed_step's, for a verify of T = layout.drafts drafts per row with
    its commit fused: a slot set's first verify accepts nothing (no drafts are pending after the
    reset), each later one 1..T of the last one's drafts per row (random, fixed per set), so the
    held records and the flushes vary as in decoding."""
    tensors, inputs, params, workspace, slot_sets, gen = _timed_pool(
        plan, layout, min_pool_bytes, layout.drafts
    )
    op = family_ops(plan.family).verify
    batch, dev = plan.batch_size, plan.device
    later = {id(s): torch.randint(1, layout.drafts + 1, (batch,), generator=gen,
                                  dtype=torch.int32).to(dev) for s in slot_sets}  # fmt: skip
    accepted = {id(s): torch.zeros(batch, dtype=torch.int32, device=dev) for s in slot_sets}

    def step(s):
        op(plan, **tensors, **inputs, **params, slot_indices=s, num_accepted=accepted[id(s)],
           workspace=workspace)  # fmt: skip
        accepted[id(s)] = later[id(s)]  # (rebound, not copied: a captured graph has no extra node)

    return step, slot_sets


def graph_timer(layout, *, steps: int = 16, reps: int = 10, min_pool_bytes: float = 1e9,
                timed=timed_step):  # fmt: skip
    """A timer for tune(): a plan's step (`timed`: timed_step, or timed_verify) over L-step
    cycles of rotating slot sets (a pool far larger than L2), captured in a CUDA graph; the
    median of `reps` replays, us per step."""

    def timer(plan, config) -> float:
        dev = plan.device
        step, slot_sets = timed(plan, layout, min_pool_bytes)
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
    parser = argparse.ArgumentParser(prog="python -m replayssm_jit autotune",
                                     description=__doc__.splitlines()[0])  # fmt: skip
    parser.add_argument("--model", required=True, help="a model of replayssm_jit.core.models")
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--state-dtype", default="f32")
    parser.add_argument("--act-dtype", default="bf16")
    parser.add_argument("--mode", default="replay", choices=("replay", "conventional"))
    parser.add_argument("--drafts", type=int, default=1,
                        help="T > 1: time the verify of T drafts (replay mode)")  # fmt: skip
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
    verify = args.drafts > 1
    if verify and args.mode != "replay":
        parser.error(f"--mode: expected 'replay' with --drafts {args.drafts}, got {args.mode!r}")
    try:
        model = get_model(args.model)
        layout = family_layout(
            model.family, window=args.window, drafts=args.drafts, state_dtype=args.state_dtype,
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
        print(f"  batch {batch:>5} {set_fields(config)}: {us:.1f} us", file=sys.stderr, flush=True)

    mode, timed = ("verify", timed_verify) if verify else (args.mode, timed_step)
    result = tune(layout, mode, batches, device, graph_timer(layout, timed=timed), progress)
    args.out.write_text(json.dumps(result, indent=1))
    for e in result["entries"]:
        print(f"{e['uri']} batch {e['batch']}: {e['config']} {e['us']:.1f} us "
              f"(policy {e['default']} {e['default_us']:.1f} us)")  # fmt: skip
    return 0
