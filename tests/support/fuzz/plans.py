"""Plan entries: plan_decode(layout, batch, ...) and a wrapper's constructor and plan(), with
launch configs, REPLAYSSM_LAUNCH, seeds and the families' plan options."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from replayssm_jit import LaunchConfig, SlotCache, plan_decode
from replayssm_jit.core.dtypes import DTYPE_NAMES
from replayssm_jit.families import FAMILIES
from replayssm_jit.families.layout import family_layout
from replayssm_jit.families.spec import checkpoint_tilings
from replayssm_jit.launch.config import LAUNCH_ENV

from .core import Call, EnvPatch, Validity, entry
from .families import ADAPTERS, adapters_on
from .layouts import draw_device
from .values import INT32_MAX, INT32_MIN, draw_bool, draw_choice, draw_int, is_int

MAX_BATCH = 65535
STATES = (torch.float32, torch.bfloat16, torch.float16)
ACTS = {"cpu": (torch.float32, torch.bfloat16), "cuda": (torch.bfloat16,)}
PLAN_NAMES = {
    "layout", "batch_size", "mode", "pad_slot_id", "check_slot_values", "seed", "device",
    "config", "plan()", "flags", "scale", LAUNCH_ENV, "config.kernel", "config.rows_per_cta",
    "config.records_warps", "config.capped_state_registers", "use_qk_l2norm", "gates_in_kernel",
    "stochastic_rounding", "device_seed", "has_D", "has_z", "has_dt_bias", "dt_softplus",
    "read_copy_round_to_nearest", "flush_mask",
}  # fmt: skip


def draw_layout(draw, device: str):
    fam = ADAPTERS[draw(st.sampled_from(adapters_on(device)))]
    shape = draw(st.sampled_from(fam.shapes[device]))
    state = draw(st.sampled_from(STATES))
    window = 4 if device == "cuda" else draw(st.sampled_from([1, 4, 16]))
    layout = family_layout(fam.name, **shape, window=window, drafts=1, state_dtype=state,
                           act_dtype=draw(st.sampled_from(ACTS[device])))  # fmt: skip
    return fam, shape, layout


def draw_options(draw, fam, layout, device: str, v: Validity, replay: bool) -> dict:
    """The family's plan options: a valid set (on CUDA the sanitizer preset's), then perhaps one
    changed to another value, good or bad, or an unknown one. `replay`: the plan's mode."""
    opts = fam.draw_options(draw, device, layout.state_dtype)
    kind = draw(st.sampled_from(["keep", "keep", "flip", "scale"]))
    if v.spend(draw):
        kind = draw(st.sampled_from(["type", "unknown", "scale"]))
    bools = sorted(fam_opts(fam))
    if kind == "flip" and device == "cpu":
        name = draw(st.sampled_from(bools))
        opts[name] = not opts.get(name, fam_opts(fam)[name])
    elif kind == "type":
        name = draw(st.sampled_from(bools))
        opts[name] = draw(st.sampled_from([1, 0, None, "True", 1.0]))
        v.mark(False, f"{name}={opts[name]!r}")
    elif kind == "unknown":
        opts[draw(st.sampled_from(["foo", "has_d", "scale" if fam.name == "mamba2" else "z"]))] = 1
        v.mark(False, "an unknown option")
    elif kind == "scale" and fam.name in ("gdn", "kda"):
        scale = draw(st.sampled_from([0.5, 3, -1.0, 0.0, None, math.nan, math.inf, True, "0.5"]))
        opts["scale"] = scale
        good = scale is None or (
            isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale)
        )
        v.mark(good, f"scale={scale!r}")
    resolved = {**fam_opts(fam), **{k: x for k, x in opts.items() if k in fam_opts(fam)}}
    if all(isinstance(resolved[k], bool) for k in resolved):
        sixteen = layout.state_dtype != torch.float32
        if resolved["stochastic_rounding"] and not sixteen:
            v.mark(False, "stochastic rounding of an f32 state")
        if resolved["device_seed"] and not resolved["stochastic_rounding"]:
            v.mark(False, "device_seed without stochastic rounding")
        if resolved.get("flush_mask") and not (
            replay and layout.window >= 2 and layout.drafts == 1
        ):
            v.mark(False, "flush_mask without a ReplaySSM decode step")
        if resolved.get("read_copy_round_to_nearest"):  # (these layouts have no read copy)
            v.mark(False, "read_copy_round_to_nearest without a read copy")
    return opts


def fam_opts(fam) -> dict[str, bool]:
    """The family's bool plan options and their defaults."""
    from replayssm_jit.families import FAMILIES

    return {name: default for name, (_, default) in FAMILIES[fam.name].plan_options.items()}


def expected_flags(fam, opts: dict) -> tuple[str, ...]:
    from replayssm_jit.families import FAMILIES

    family = FAMILIES[fam.name]
    return tuple(sorted(flag for name, (flag, default) in family.plan_options.items()
                        if opts.get(name, default)))  # fmt: skip


def draw_config(draw, fam, layout, replay: bool, device: str, v: Validity):
    """None, or a LaunchConfig whose overrides are marked as the launch policy documents them."""
    if draw(st.integers(0, 2)) == 0:
        return None, {}
    fields: dict = {}
    kernel = draw(st.sampled_from(["auto", "per-item", "flush-every-step", "split"]))
    if kernel != "auto":
        fields["kernel"] = kernel
        if kernel == "split" and replay:
            # (the sanitizer shapes split)
            v.mark(True if device == "cuda" else None, "split")
    s = layout.shape
    dtypes = (layout.state_dtype, layout.read_dtype)
    names = tuple(DTYPE_NAMES[d] if d is not None else None for d in dtypes)
    tiles = [r for r, _ in checkpoint_tilings(s.value_dim, s.key_dim, names)]
    if draw(st.booleans()):
        rows = draw(st.sampled_from([3, 1000] if v.spend(draw) else tiles))
        fields["rows_per_cta"] = rows
        v.mark(rows in tiles, f"rows_per_cta={rows} of {tiles}")
    if draw(st.booleans()):
        warps = draw(st.sampled_from([4, 16] if v.spend(draw) else [8]))
        fields["records_warps"] = warps
        v.mark(warps in FAMILIES[fam.name].launch.records_warps, f"records_warps={warps}")
    if draw(st.booleans()):
        capped = draw(st.booleans())
        fields["capped_state_registers"] = capped
        v.mark(
            not capped or FAMILIES[fam.name].launch.capped_state_registers,
            f"capped_state_registers={capped}",
        )
    for name in ("overlap_prior_kernel", "speculative_records"):
        if draw(st.booleans()):
            fields[name] = draw(st.booleans())
    return LaunchConfig(**fields), fields


def draw_env(draw, v: Validity) -> tuple[str | None, str]:
    """REPLAYSSM_LAUNCH: unset, a kernel for the plans that leave it "auto", or a bad text."""
    env = draw(
        st.sampled_from([None, None, None, "kernel=per-item", "kernel=flush-every-step", " "])
    )
    if v.spend(draw):
        env = draw(st.sampled_from(["kernel=fast", "bogus=1"]))
    if env in ("kernel=fast", "bogus=1"):
        v.mark(False, f"{LAUNCH_ENV}={env!r}")
    kernel = env.partition("=")[2] if env and env.startswith("kernel=") else "auto"
    return env, kernel


def check_plan_result(plan, *, fam, layout, device, batch, mode, pad, check_values, seed, opts,
                      kernel_asked) -> None:  # fmt: skip
    replay = mode == "replay"
    assert plan.layout is layout and plan.batch_size == batch and plan.mode == mode
    assert plan.device.type == device and plan.backend == device
    assert plan.pad_slot_id == pad and plan.check_slot_values == check_values
    assert plan.seed == seed & (2**63 - 1)
    spec = plan.spec
    assert spec.window == (layout.window if replay else 1) and spec.drafts == layout.drafts
    assert spec.flags == expected_flags(fam, opts), (spec.flags, opts)
    if fam.name in ("gdn", "kda"):
        scale = opts.get("scale")
        want = layout.shape.key_dim**-0.5 if scale is None else float(scale)
        extra = {"lower_bound": None} if fam.name == "kda" else {}
        assert plan.family_options == {"scale": want, **extra}
    else:
        assert plan.family_options == {}
    if not replay:
        assert plan.kernel == "conventional"
    elif device == "cpu":
        assert plan.kernel == (
            "flush-every-step" if kernel_asked == "flush-every-step" else "per-item"
        )
    elif kernel_asked != "auto":
        assert plan.kernel == kernel_asked
    assert (plan.workspace_floats > 0) == (plan.kernel == "split")


@entry("plan_decode", covers=("plan_decode", "DecodePlan", "LaunchConfig"))
def build_plan_decode(draw, device):
    v = Validity()
    fam, _shape, layout = draw_layout(draw, device)
    layout_arg = layout
    if v.spend(draw):
        layout_arg = draw(st.sampled_from([None, {}, "mamba2", layout.shape]))
        v.mark(False, f"layout {layout_arg!r}")
    batch, ok = draw_int(draw, 1, MAX_BATCH, likely=st.integers(1, 300), v=v)
    v.mark(ok, f"batch_size={batch!r}")
    mode, ok = draw_choice(draw, ("replay", "conventional"), v=v)
    v.mark(ok, f"mode={mode!r}")
    pad, ok = draw_int(
        draw, INT32_MIN, INT32_MAX, likely=st.sampled_from([-1, 0, 3, INT32_MIN]), v=v
    )
    v.mark(ok, f"pad_slot_id={pad!r}")
    check_values, ok = draw_bool(draw, v=v)
    v.mark(ok, f"check_slot_values={check_values!r}")
    seed = draw(st.sampled_from([True, 1.5, None, "0"]) if v.spend(draw) else st.integers())
    v.mark(is_int(seed), f"seed={seed!r}")
    dev = draw_device(draw, device, v)
    replay = mode == "replay"
    opts = draw_options(draw, fam, layout, device, v, replay)
    config, fields = draw_config(draw, fam, layout, replay, device, v)
    env, env_kernel = draw_env(draw, v)
    kernel_asked = fields.get("kernel", env_kernel)

    def run():
        with EnvPatch({LAUNCH_ENV: env}):
            return plan_decode(layout_arg, batch, device=dev, mode=mode, pad_slot_id=pad,
                               check_slot_values=check_values, config=config, seed=seed, **opts)  # fmt: skip

    def check(plan):
        check_plan_result(plan, fam=fam, layout=layout, device=device, batch=batch, mode=mode,
                          pad=pad, check_values=check_values, seed=seed, opts=opts,
                          kernel_asked=kernel_asked)  # fmt: skip

    return Call(run, PLAN_NAMES, check=check, valid=v.valid, why=v.why)


@entry("wrapper.plan", covers=("Mamba2DecodeWrapper", "GDNDecodeWrapper", "KDADecodeWrapper"))
def build_wrapper_plan(draw, device):
    v = Validity()
    fam, _shape, layout = draw_layout(draw, device)
    pad = draw(st.sampled_from([-1, 0]))
    cache = SlotCache(layout, 3, device=device, pad_slot_id=pad)
    cache.state.normal_()
    mode, ok_mode = draw_choice(draw, ("replay", "conventional"), v=v)
    graph, ok_graph = draw_bool(draw, v=v)
    if device == "cuda" and graph is True:
        graph = False
    check_values, ok_check = draw_bool(draw, v=v)
    cache_arg = cache
    if v.spend(draw):
        other = next(a for a in ADAPTERS.values() if a is not fam)
        cache_arg = draw(st.sampled_from([None, {}, layout, "other"]))
        if cache_arg == "other":
            cache_arg = other.cache_cls(2, **other.shapes[device][0], device=device)
    if cache_arg is not cache or not (ok_mode and ok_graph and ok_check):
        v.mark(cache_arg is cache, "cache")
        v.mark(ok_mode, f"mode={mode!r}")
        v.mark(ok_graph, f"use_cuda_graph={graph!r}")
        v.mark(ok_check, f"check_slot_values={check_values!r}")

        def construct():
            return fam.wrapper_cls(cache_arg, mode=mode, use_cuda_graph=graph,
                                   check_slot_values=check_values)  # fmt: skip

        names = {"cache", "mode", "use_cuda_graph", "check_slot_values"}
        return Call(construct, names, watch=lambda: dict(cache.tensors), valid=v.valid, why=v.why)
    wrapper = fam.wrapper_cls(
        cache, mode=mode, use_cuda_graph=graph, check_slot_values=check_values
    )
    if draw(st.booleans()):
        wrapper.plan(draw(st.integers(1, 4)), **fam.draw_options(draw, device, layout.state_dtype))
    batch, ok = draw_int(draw, 1, MAX_BATCH, likely=st.integers(1, 64), v=v)
    v.mark(ok, f"batch_size={batch!r}")
    seed = draw(st.sampled_from([True, 1.5, None]) if v.spend(draw) else st.integers())
    v.mark(is_int(seed), f"seed={seed!r}")
    opts = draw_options(draw, fam, layout, device, v, mode == "replay")
    config, fields = draw_config(draw, fam, layout, mode == "replay", device, v)
    env, env_kernel = draw_env(draw, v)
    kernel_asked = fields.get("kernel", env_kernel)

    def run():
        with EnvPatch({LAUNCH_ENV: env}):
            return wrapper.plan(batch, config=config, seed=seed, **opts)

    def check(spec):
        plan = wrapper.decode_plan
        assert spec is plan.spec and wrapper.spec is spec and wrapper.batch_size == batch
        check_plan_result(plan, fam=fam, layout=layout, device=device, batch=batch, mode=mode,
                          pad=pad, check_values=check_values and not graph, seed=seed, opts=opts,
                          kernel_asked=kernel_asked)  # fmt: skip
        assert wrapper.window == (layout.window if mode == "replay" else 1)
        assert wrapper._workspace.numel() >= plan.workspace_floats
        if graph:
            s = layout.shape
            assert wrapper._out.shape == (batch, s.value_heads, s.value_dim)
            assert wrapper._out.dtype == layout.act_dtype
        else:
            assert wrapper._out is None

    def watch():
        return {**cache.tensors, "_plan": wrapper._plan, "_out": wrapper._out,
                "_workspace": wrapper._workspace}  # fmt: skip

    return Call(run, PLAN_NAMES, watch=watch, check=check, valid=v.valid, why=v.why)
