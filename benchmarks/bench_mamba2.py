"""Mamba-2 decode on one GPU: our conventional step against our ReplaySSM steps.

For each (shape, batch, window L, checkpoint format): the conventional step, the ReplaySSM
non-flush step (mean over held = 0..L-2), the flush step, the amortized step
((L-1) non-flush + 1 flush) / L, and one measured L-step cycle. State pool >= --min-pool-bytes,
split into disjoint slot sets that consecutive calls rotate through.

--states takes checkpoint formats (harness.parse_format): a dtype (f32, bf16, f16, e4m3: one
copy, shared mode), "HP+LP" for separate mode (e.g. f32+e4m3: FP32 carried, e4m3 read copy;
no conventional step), each with an "sr" suffix on the dtype for stochastic rounding (bf16sr,
e4m3sr, f16sr+e4m3).

    python benchmarks/bench_mamba2.py [--out DIR] [--launch kernel=split,rows_per_cta=16]

Writes mamba2.json into --out (default benchmarks/scratch/, git-ignored). Kernels, row tiles and
launch flags are the launch policy's unless --launch fixes them (a LaunchConfig for every
plan()); --tiling-sweep times every launch variant (harness.launch_variants) at the configs named.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (
    REPLAY_KERNELS,
    checkpoint_bytes,
    config_rows,
    decode_timings,
    num_sets,
    parse_format,
    plan_wrappers,
    replay_traffic,
    run_sweep,
    slot_sets,
    sweep_parser,
)

from replayssm_jit import Mamba2DecodeCache, Mamba2DecodeWrapper
from replayssm_jit.core.models import get_model


def bytes_per_step(H, P, N, G, batch, window, fmt, act_size=2):
    carried, read = (
        batch * H * P * checkpoint_bytes(d, N) for d in (fmt.state, fmt.read or fmt.state)
    )
    record = batch * (H * P * act_size + G * N * act_size + H * 4)  # x, B, dt
    return replay_traffic(carried, record, window, read=read if fmt.read else None)


def bench_config(
    shape, batch, window, state_name, args, kernels=REPLAY_KERNELS, config=None,
    check_slot_values=True,
):  # fmt: skip
    """Result rows of one config; wrappers planned with launch_config(args, config)."""
    model = get_model(shape)
    H, P, N, G = model.value_heads, model.d_v, model.d_k, model.key_heads
    fmt = parse_format(state_name)
    nsets = num_sets(batch * H * P * checkpoint_bytes(fmt.state, N), args.min_pool_bytes)
    gen = torch.Generator(device="cuda").manual_seed(batch * 31 + window)
    cache = Mamba2DecodeCache(
        nsets * batch,
        num_heads=H,
        headdim=P,
        dstate=N,
        ngroups=G,
        window=window,
        state_dtype=fmt.state,
        read_dtype=fmt.read,
        act_dtype=torch.bfloat16,
        device="cuda",
    )
    slots = torch.arange(cache.num_slots, device="cuda")
    cache.reset(slots, torch.randn(cache.num_slots, H, P, N, generator=gen, device="cuda"))
    sets = slot_sets(nsets, batch, gen)
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

    wrappers = plan_wrappers(Mamba2DecodeWrapper, cache, batch, args, config, check_slot_values,
                             stochastic_rounding=fmt.sr)  # fmt: skip
    if fmt.read:  # separate mode has no conventional step
        kernels = tuple(k for k in kernels if k != "conventional")
    res = decode_timings(cache, window, step, *wrappers, sets, args, kernels)
    assert torch.isfinite(out.float()).all(), "non-finite output"
    traffic = bytes_per_step(H, P, N, G, batch, window, fmt)
    return config_rows((shape, batch, window, state_name), *wrappers, res, traffic)


def main(argv=None):
    args = sweep_parser(__doc__.splitlines()[0], "super120b,nano4b").parse_args(argv)
    return run_sweep(args, "mamba2", bench_config)


if __name__ == "__main__":
    sys.exit(main())
