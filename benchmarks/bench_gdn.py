"""Gated DeltaNet and KDA decode on one GPU: our conventional and ReplaySSM steps against fla.

For each (shape, batch, window L, checkpoint dtype): our conventional step, the ReplaySSM
non-flush step (mean over held = 0..L-2), the flush step, the amortized step
((L-1) non-flush + 1 flush) / L, one measured L-step cycle, and (fp32 state) fla-core's
fused_recurrent_gated_delta_rule as the conventional peer. Inputs bf16 q, k, v, fp32 raw gates
a, b; gates, beta sigmoid and the q/k L2 norm are computed in every kernel. Our state pool
(>= --min-pool-bytes) is split into disjoint slot sets that consecutive calls rotate through;
fla has no pool form, so it rotates through as many separate initial_state buffers and writes a
new final_state each call (output_final_state=True), [B, HV, K, V] fp32 unless
--fla-state-v-first (fla >= 0.6 offers the [B, HV, V, K] layout we use).

KDA shapes (kimi48b) run our KDA steps against fla's fused_recurrent_kda: the gate a is per
channel [batch, HV, K] with dt_bias [HV * K], and the g records hold K floats per head.
"SHAPE@gdn" runs our GDN steps at a KDA shape's H, HV, K and V, for reference.

    python benchmarks/bench_gdn.py [--out DIR] [--launch kernel=split,rows_per_cta=16]

Writes gdn.json into --out (default benchmarks/scratch/, git-ignored). Kernels, row tiles and
launch flags are the launch policy's unless --launch fixes them (a LaunchConfig for every
plan()); --tiling-sweep times every launch variant (harness.launch_variants) at the configs named.
"""

from __future__ import annotations

import inspect
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
    time_graph,
)

from replayssm_jit import GDNDecodeCache, GDNDecodeWrapper, KDADecodeCache, KDADecodeWrapper
from replayssm_jit.core.models import get_model

ACT = torch.bfloat16


FAMILIES = {
    "gdn": (GDNDecodeCache, GDNDecodeWrapper, "fla.ops.gated_delta_rule",
            "fused_recurrent_gated_delta_rule"),
    "kda": (KDADecodeCache, KDADecodeWrapper, "fla.ops.kda", "fused_recurrent_kda"),
}  # fmt: skip


def parse_shape(shape: str):
    """(model, family): "SHAPE@gdn" is the GDN family at SHAPE's dims."""
    name, _, family = shape.partition("@")
    model = get_model(name)
    return model, family or model.family


def bytes_per_step(H, HV, K, V, batch, window, fmt, act_size=2, gate_width=1):
    carried, read = (
        batch * HV * V * checkpoint_bytes(d, K) for d in (fmt.state, fmt.read or fmt.state)
    )
    record = batch * (HV * V * 4 + H * K * act_size + HV * gate_width * 4)  # u (fp32), k, g
    if fmt.read:  # separate mode also records v and beta
        record += batch * (HV * V * act_size + HV * 4)
    return replay_traffic(carried, record, window, read=read if fmt.read else None)


def fla_timing(family, inputs, HV, K, V, batch, nsets, gen, args):
    """fla's conventional step over `nsets` rotating fp32 initial_state buffers, or None."""
    _, _, module, name = FAMILIES[family]
    try:
        fla_fn = getattr(__import__(module, fromlist=[name]), name)
    except (ImportError, AttributeError) as exc:
        print(f"  fla unavailable: {exc}", flush=True)
        return None
    q, k, v, a, b, A_log, dt_bias = inputs
    v_first = args.fla_state_v_first
    if v_first and "state_v_first" not in inspect.signature(fla_fn).parameters:
        raise SystemExit("--fla-state-v-first: the installed fla has no state_v_first")
    shape = (batch, HV, V, K) if v_first else (batch, HV, K, V)
    bufs = [torch.randn(shape, generator=gen, device="cuda") for _ in range(nsets)]
    kw = dict(state_v_first=True) if v_first else {}
    q, k, v, a, b = q[:, None], k[:, None], v[:, None], a[:, None], b[:, None]

    def call(h0):
        return lambda: fla_fn(
            q, k, v, g=a, beta=b, scale=K**-0.5, initial_state=h0, output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
            use_beta_sigmoid_in_kernel=True, **kw,
        )  # fmt: skip

    t = time_graph([call(h) for h in bufs], reps=args.reps, rounds=args.rounds)
    o, _ = call(bufs[0])()
    assert torch.isfinite(o.float()).all(), "fla: non-finite output"
    return t


_FLA_DONE: set[tuple[str, int]] = set()


def bench_config(
    shape, batch, window, state_name, args, kernels=(*REPLAY_KERNELS, "fla"), config=None,
    check_slot_values=True,
):  # fmt: skip
    """Result rows of one config; our wrappers planned with launch_config(args, config)."""
    model, family = parse_shape(shape)
    cache_type, wrapper_type = FAMILIES[family][:2]
    H, HV, K, V = model.key_heads, model.value_heads, model.d_k, model.d_v
    gate_width = K if family == "kda" else 1  # KDA: a per-channel gate
    fmt = parse_format(state_name)
    row_bytes = checkpoint_bytes(fmt.state, K)
    nsets = num_sets(batch * HV * V * row_bytes, args.min_pool_bytes)
    gen = torch.Generator(device="cuda").manual_seed(batch * 37 + window)
    cache = cache_type(
        nsets * batch,
        num_k_heads=H,
        num_v_heads=HV,
        head_k_dim=K,
        head_v_dim=V,
        window=window,
        state_dtype=fmt.state,
        read_dtype=fmt.read,
        act_dtype=ACT,
        device="cuda",
    )
    slots = torch.arange(cache.num_slots, device="cuda")
    cache.reset(slots, torch.randn(cache.num_slots, HV, V, K, generator=gen, device="cuda"))
    sets = slot_sets(nsets, batch, gen)
    q = torch.randn(batch, H, K, generator=gen, device="cuda").to(ACT)
    k = torch.randn(batch, H, K, generator=gen, device="cuda").to(ACT)
    v = torch.randn(batch, HV, V, generator=gen, device="cuda").to(ACT)
    gate_shape = (batch, HV, K) if family == "kda" else (batch, HV)
    a = -4.0 + 3.0 * torch.rand(gate_shape, generator=gen, device="cuda")
    b = torch.randn(batch, HV, generator=gen, device="cuda")
    A_log = torch.log(0.5 + torch.rand(HV, generator=gen, device="cuda"))
    dt_bias = 0.5 * torch.rand(HV * gate_width, generator=gen, device="cuda") - 0.25
    out = torch.empty(batch, HV, V, dtype=ACT, device="cuda")

    def step(wrapper, slots):
        return lambda: wrapper.run(q, k, v, slots, a=a, b=b, A_log=A_log, dt_bias=dt_bias, out=out)

    wrappers = plan_wrappers(wrapper_type, cache, batch, args, config, check_slot_values,
                             stochastic_rounding=fmt.sr)  # fmt: skip
    if fmt.read:  # separate mode has no conventional step
        kernels = tuple(k for k in kernels if k != "conventional")
    res = decode_timings(cache, window, step, *wrappers, sets, args, kernels)
    assert torch.isfinite(out.float()).all(), "non-finite output"
    traffic = bytes_per_step(H, HV, K, V, batch, window, fmt, gate_width=gate_width)
    if (
        state_name == "f32"
        and "fla" in kernels
        and not args.no_fla
        and (shape, batch) not in _FLA_DONE
    ):
        _FLA_DONE.add((shape, batch))  # fla has no window: once per shape and batch
        inputs = (q, k, v, a, b, A_log, dt_bias)
        t = fla_timing(family, inputs, HV, K, V, batch, nsets, gen, args)
        if t is not None:
            res["fla"] = t
            traffic["fla"] = traffic["conventional"]  # read h0, write a new final state (fp32)
    return config_rows((shape, batch, window, state_name), *wrappers, res, traffic, ("fla",))


def main(argv=None):
    p = sweep_parser(__doc__.splitlines()[0], "qwen4b,qwen122b")
    p.add_argument("--no-fla", action="store_true", help="skip the fla peer")
    p.add_argument(
        "--fla-state-v-first", action="store_true", help="run fla on [B, HV, V, K] states"
    )
    args = p.parse_args(argv)
    return run_sweep(args, "gdn", bench_config)


if __name__ == "__main__":
    sys.exit(main())
