"""Stochastic-rounding steps of one package checkout, for side-by-side runs of two versions.

Run once per checkout (PYTHONPATH picks it) in the same device call: per model shape, batch and
16-bit checkpoint dtype, the amortized ReplaySSM step (a CUDA graph of one window of L steps
from empty rings, so every slot flushes once) with stochastic rounding and (--rounding rn,sr)
with round-to-nearest beside it, as the median of CUDA event timings over graph replays, over a
state pool larger than the L2. Prints JSON lines.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import replayssm_jit as rj

SHAPES = {  # name: (family, key heads, value heads, key dim, value dim)
    "super120b": ("mamba2", 8, 128, 128, 64),
    "nano4b": ("mamba2", 8, 96, 128, 80),
    "qwen4b": ("gdn", 16, 32, 128, 128),
    "qwen122b": ("gdn", 16, 64, 128, 128),
    "kimi48b": ("kda", 32, 32, 128, 128),
}
L = 16


def make(family, G, H, N, P, slots, state_dtype):
    if family == "mamba2":
        cache = rj.Mamba2DecodeCache(slots, num_heads=H, headdim=P, dstate=N, ngroups=G,
                                     window=L, state_dtype=state_dtype, device="cuda")  # fmt: skip
        wrapper_type = rj.Mamba2DecodeWrapper
    else:
        cache_type = rj.KDADecodeCache if family == "kda" else rj.GDNDecodeCache
        cache = cache_type(slots, num_k_heads=G, num_v_heads=H, head_k_dim=N, head_v_dim=P,
                           window=L, state_dtype=state_dtype, device="cuda")  # fmt: skip
        wrapper_type = rj.KDADecodeWrapper if family == "kda" else rj.GDNDecodeWrapper
    try:
        return cache, wrapper_type(cache, check_slot_values=False)
    except TypeError:  # 0.1's GDN wrapper had no such option (graph capture reads no ids anyway)
        return cache, wrapper_type(cache)


def inputs(family, G, H, N, P, batch, gen):
    def r(*s, dtype=torch.bfloat16):
        return torch.randn(*s, generator=gen, device="cuda").to(dtype)

    if family == "mamba2":
        return dict(x=r(batch, H, P), dt=r(batch, H, dtype=torch.float32) - 1,
                    A=-(0.5 + torch.rand(H, generator=gen, device="cuda")), B=r(batch, G, N),
                    C=r(batch, G, N), D=r(H, dtype=torch.float32),
                    dt_bias=0.1 * r(H, dtype=torch.float32))  # fmt: skip
    channels = (N,) if family == "kda" else ()  # KDA: a decay per key channel
    return dict(q=r(batch, G, N), k=r(batch, G, N), v=r(batch, H, P),
                a=r(batch, H, *channels, dtype=torch.float32), b=r(batch, H, dtype=torch.float32),
                A_log=torch.log(torch.rand(H, generator=gen, device="cuda") * 4 + 0.5),
                dt_bias=0.1 * r(H * (N if channels else 1), dtype=torch.float32))  # fmt: skip


def step(family, wrapper, t, slots, out):
    if family == "mamba2":
        return wrapper.run(t["x"], t["dt"], t["A"], t["B"], t["C"], slots, D=t["D"],
                           dt_bias=t["dt_bias"], out=out)  # fmt: skip
    if hasattr(rj, "plan_decode"):  # 0.2 names the gates
        return wrapper.run(t["q"], t["k"], t["v"], slots, a=t["a"], b=t["b"], A_log=t["A_log"],
                           dt_bias=t["dt_bias"], out=out)  # fmt: skip
    return wrapper.run(t["q"], t["k"], t["v"], t["a"], t["b"], slots, A_log=t["A_log"],
                       dt_bias=t["dt_bias"], out=out)  # fmt: skip


def measure(name, batch, state_dtype, reps, min_pool_bytes, sr=True):
    family, G, H, N, P = SHAPES[name]
    per_slot = H * P * N * 2
    slots = max(batch, -(-min_pool_bytes // per_slot))
    cache, wrapper = make(family, G, H, N, P, slots, state_dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    cache.state.copy_(torch.randn(cache.state.shape, generator=gen, device="cuda").to(state_dtype))
    wrapper.plan(batch, stochastic_rounding=sr, seed=3)
    groups = slots // batch
    slot_sets = [torch.arange(g * batch, (g + 1) * batch, dtype=torch.int32, device="cuda")
                 for g in range(groups)]  # fmt: skip
    toks = [inputs(family, G, H, N, P, batch, gen) for _ in range(L)]
    out = torch.empty((batch, H, P), dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for t in toks:  # warm-up, and load the module
            step(family, wrapper, t, slot_sets[0], out)
    torch.cuda.current_stream().wait_stream(stream)
    graphs = []
    for s in slot_sets[: min(groups, 8)]:  # rotate slot groups: the pool outgrows the L2
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for t in toks:
                step(family, wrapper, t, s, out)
        graphs.append(g)
    times = []
    for i in range(reps + 3):
        g = graphs[i % len(graphs)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) * 1e3 / L)
    return {"shape": name, "batch": batch, "state": str(state_dtype).split(".")[-1],
            "rounding": "sr" if sr else "rn", "kernel": wrapper.kernel,
            "amortized_us": statistics.median(times)}  # fmt: skip


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--label", required=True)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--batches", default="1,8,256")
    p.add_argument("--reps", type=int, default=24)
    p.add_argument("--min-pool-bytes", type=int, default=1 << 30)
    p.add_argument("--rounding", default="sr", help="comma list of rn, sr (each in turn)")
    args = p.parse_args()
    for name in args.shapes.split(","):
        for batch in map(int, args.batches.split(",")):
            for dtype in (torch.bfloat16, torch.float16):
                for rounding in args.rounding.split(","):
                    row = measure(name, batch, dtype, args.reps, args.min_pool_bytes,
                                  sr=rounding == "sr")  # fmt: skip
                    print(json.dumps({"label": args.label, **row}), flush=True)


if __name__ == "__main__":
    main()
