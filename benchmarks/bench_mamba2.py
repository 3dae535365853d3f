"""Mamba-2 decode on one GPU: our conventional step against our ReplaySSM steps.

For each (shape, batch, window L, checkpoint dtype): the conventional step, the ReplaySSM
non-flush step (mean over held = 0..L-2), the flush step, the amortized step
((L-1) non-flush + 1 flush) / L, and one measured L-step cycle. State pool >= --min-pool-bytes,
split into disjoint slot sets that consecutive calls rotate through.

    python benchmarks/bench_mamba2.py --out benchmarks/results/DIR
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import COPY_CEILING_TBPS, copy_ceiling, environment, time_graph, write_results

from replayssm_jit import Mamba2DecodeCache, Mamba2DecodeWrapper
from replayssm_jit.models import get_model
from replayssm_jit.ops.mamba2 import ROWS_ENV
from replayssm_jit.spec import mamba2_tilings

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def bytes_per_step(H, P, N, G, batch, window, state_size, act_size=2):
    state = batch * H * P * N * state_size
    record = batch * (H * P * act_size + G * N * act_size + H * 4)
    mean_held = (window - 2) / 2 if window > 1 else 0
    nonflush = state + record * (mean_held + 1)  # read checkpoint + replayed records, append one
    flush = 2 * state + record * (window - 1)
    return {
        "conventional": 2 * state,
        "nonflush": nonflush,
        "flush": flush,
        "amortized": ((window - 1) * nonflush + flush) / window,
    }


def bench_config(
    shape, batch, window, state_name, args, kernels=("conventional", "cycle", "nonflush", "flush")
):
    model = get_model(shape)
    H, P, N, G = model.value_heads, model.d_v, model.d_k, model.key_heads
    state_dtype = DTYPES[state_name]
    esize = torch.finfo(state_dtype).bits // 8
    set_bytes = batch * H * P * N * esize
    nsets = max(2, math.ceil(args.min_pool_bytes / set_bytes))
    gen = torch.Generator(device="cuda").manual_seed(batch * 31 + window)
    cache = Mamba2DecodeCache(
        nsets * batch,
        num_heads=H,
        headdim=P,
        dstate=N,
        ngroups=G,
        window=window,
        state_dtype=state_dtype,
        act_dtype=torch.bfloat16,
        device="cuda",
    )
    cache.state.copy_(torch.randn(cache.state.shape, generator=gen, device="cuda").to(state_dtype))
    perm = torch.randperm(nsets * batch, generator=gen, device="cuda").to(torch.int32)
    sets = [perm[i * batch : (i + 1) * batch].contiguous() for i in range(nsets)]
    x = torch.randn(batch, H, P, generator=gen, device="cuda").to(torch.bfloat16)
    dt = torch.randn(batch, H, generator=gen, device="cuda") * 0.5 - 1
    B = (torch.randn(batch, G, N, generator=gen, device="cuda") / N**0.25).to(torch.bfloat16)
    C = (torch.randn(batch, G, N, generator=gen, device="cuda") / N**0.25).to(torch.bfloat16)
    A = -(0.5 + torch.rand(H, generator=gen, device="cuda"))
    D = torch.randn(H, generator=gen, device="cuda")
    dt_bias = 0.1 * torch.randn(H, generator=gen, device="cuda")
    out = torch.empty(batch, H, P, dtype=torch.bfloat16, device="cuda")

    def step(wrapper, slots):
        return lambda: wrapper.run(x, dt, A, B, C, slots, D=D, dt_bias=dt_bias, out=out)

    conv = Mamba2DecodeWrapper(cache, mode="conventional")
    conv.plan(batch)
    replay = Mamba2DecodeWrapper(cache, mode="replay")
    replay.plan(batch)
    kw = dict(reps=args.reps, rounds=args.rounds)
    res = {"conventional": time_graph([step(conv, s) for s in sets], **kw)}
    if window > 1:
        cache.cursors.zero_()
        cycle = [step(replay, s) for _ in range(window) for s in sets]
        res["cycle"] = time_graph(cycle, **kw)
    if window > 1 and "nonflush" in kernels:
        nonflush = [step(replay, s) for _ in range(window - 1) for s in sets]
        t = time_graph([*nonflush, lambda: cache.cursors.zero_()], **kw)
        res["nonflush"] = {**t, "us": t["us"] * (len(nonflush) + 1) / len(nonflush)}
        t = time_graph(
            [lambda: cache.cursors[:, 0].fill_(window - 1), *[step(replay, s) for s in sets]], **kw
        )
        res["flush"] = {**t, "us": t["us"] * (nsets + 1) / nsets}
        res["amortized"] = {
            "us": ((window - 1) * res["nonflush"]["us"] + res["flush"]["us"]) / window
        }
    assert torch.isfinite(out.float()).all(), "non-finite output"
    nbytes = bytes_per_step(H, P, N, G, batch, window, esize)
    rows = []
    for kernel, t in res.items():
        b = nbytes["amortized" if kernel == "cycle" else kernel]
        tbps = b / (t["us"] * 1e-6) / 1e12
        rows.append(
            dict(
                shape=shape,
                batch=batch,
                window=window,
                state=state_name,
                kernel=kernel,
                us=t["us"],
                min=t.get("min"),
                max=t.get("max"),
                bytes=b,
                tbps=tbps,
                pct_ceiling=100 * tbps / COPY_CEILING_TBPS,
                rows_per_cta=replay.rows_per_cta if kernel != "conventional" else conv.rows_per_cta,
            )
        )
    return rows


def sweep_tilings(shape, batch, window, state_name, args):
    """Time the conventional step and one ReplaySSM cycle at every compiled row tiling."""
    model = get_model(shape)
    tilings = [r for r, _ in mamba2_tilings(model.d_v, model.d_k, state_name)]
    rows = []
    for tiling in tilings:
        os.environ[ROWS_ENV] = str(tiling)
        try:
            for r in bench_config(
                shape, batch, window, state_name, args, kernels=("conventional", "cycle")
            ):
                rows.append({**r, "kernel": f"{r['kernel']}@rows{tiling}"})
        finally:
            del os.environ[ROWS_ENV]
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="super120b,nano4b")
    p.add_argument("--batches", default="1,8,32,64,128,256,512")
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
        "--tiling-sweep", default="", help="shape:batch:L:state,... configs to sweep row tilings at"
    )
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    configs = []
    if args.batches == "none":
        args.batches = ""
    for shape in args.shapes.split(","):
        for state in args.states.split(","):
            for batch in [int(b) for b in args.batches.split(",") if b]:
                for window in map(int, args.windows.split(",")):
                    configs.append((shape, batch, window, state))
            for window in map(int, args.window_sweep.split(",")):
                if (shape, args.window_sweep_batch, window, state) not in configs:
                    configs.append((shape, args.window_sweep_batch, window, state))
    sweeps = [c.split(":") for c in args.tiling_sweep.split(",") if c]
    payload = {
        "environment": environment(),
        "command": " ".join(sys.argv),
        "copy": copy_ceiling(),
        "rows": [],
    }
    print(f"copy ceiling measured: {payload['copy']['tbps']:.2f} TB/s", flush=True)
    for cfg in configs:
        rows = bench_config(*cfg, args)
        torch.cuda.empty_cache()
        payload["rows"] += rows
        summary = "  ".join(f"{r['kernel']}={r['us']:.1f}us({r['pct_ceiling']:.0f}%)" for r in rows)
        print(f"{cfg}: {summary}", flush=True)
        write_results(args.out / "mamba2.json", payload)
    for shape, batch, window, state in sweeps:
        rows = sweep_tilings(shape, int(batch), int(window), state, args)
        payload["rows"] += rows
        print("  ".join(f"{r['kernel']}={r['us']:.1f}us" for r in rows), flush=True)
        write_results(args.out / "mamba2.json", payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
