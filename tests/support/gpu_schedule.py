"""A family-agnostic random decode schedule for the GPU tests: wrapper against float64 reference.

Every step: fresh random inputs, the output poisoned with NaN first, rows padded and slots
interleaved in a random order, sequences joining at staggered steps so that one launch mixes
flush and non-flush rows. Live slots' rings start NaN-poisoned (a kernel may read only the
records it holds). Pad rows must come out exactly zero. At the end: every checkpoint against the
reference state at that slot's last flush, cursors (records held, flush epochs, arrival scratch)
against the expected counts, and unnamed slots (state and every ring) bit-identical.

A family plugs in through a `Family` adapter: cache factory, wrapper factory + plan, input
generator, wrapper run call and reference pool step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from replayssm_jit import LaunchConfig
from support.checks import rel_err


class Inputs:
    """One layer's parameters (drawn at construction) and a fresh token batch per `token` call."""

    def token(self, batch: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def run(self, wrapper, tok: dict, slot_indices: torch.Tensor, out: torch.Tensor) -> None:
        """One wrapper.run() writing into `out`."""
        raise NotImplementedError

    def reference(
        self, ref_pool: torch.Tensor, slot_indices: torch.Tensor, tok: dict, pad_slot_id: int
    ) -> torch.Tensor:
        """The float64 conventional pool step (updates ref_pool in place); returns the output."""
        raise NotImplementedError


class Family:
    """Adapter of one kernel family for `run_schedule`."""

    def cache(self, num_slots: int, *, window, state_dtype, act_dtype, pad_slot_id):
        """A fresh SlotCache on CUDA."""
        raise NotImplementedError

    def wrapper(
        self, cache, *, mode: str, batch: int, sr: bool, seed: int, config: LaunchConfig | None
    ):
        """A DecodeWrapper over `cache`, planned for `batch` rows with launch `config`."""
        raise NotImplementedError

    def inputs(self, gen: torch.Generator, act: torch.dtype) -> Inputs:
        raise NotImplementedError

    def out_shape(self, batch: int) -> tuple[int, ...]:
        raise NotImplementedError


@dataclass(frozen=True)
class ScheduleResult:
    out_err: float  # worst relative output error of one step over the live rows
    state_err: float  # relative error of the final checkpoints against the reference
    min_flushes: int  # fewest flushes any live slot went through (every token when conventional)
    steps: int


def run_schedule(
    family: Family,
    batch: int,
    window: int,
    *,
    act: torch.dtype = torch.float32,
    state: torch.dtype = torch.float32,
    mode: str = "replay",
    steps: int | None = None,
    sr: bool = False,
    pad_slot_id: int = -1,
    seed: int = 0,
    switch: tuple[int, str] | None = None,
    config: LaunchConfig | None = None,
) -> ScheduleResult:
    """Decode `steps` tokens through the wrapper and the reference side by side, the wrapper
    planned with launch `config` (its kernel and row tile, where fixed, are checked to be the
    ones planned). `switch` = (step, kernel): from that step on, a wrapper planned with `config`
    but LaunchConfig kernel=kernel takes over the same cache (records held by the first kernel
    carry over)."""
    gen = torch.Generator(device="cuda").manual_seed(1000 * batch + window + seed)
    steps = steps or max(3 * window + 5, 40)
    num_slots = 2 * batch + 5
    cache = family.cache(
        num_slots, window=window, state_dtype=state, act_dtype=act, pad_slot_id=pad_slot_id
    )
    # Unnamed slots hold random bits that must survive untouched.
    cache.state.copy_(torch.randn(cache.state.shape, generator=gen, device="cuda").to(state))
    for ring in cache.rings.values():
        ring.copy_(torch.randn(ring.shape, generator=gen, device="cuda").to(ring.dtype))
    npad = batch // 7
    live = batch - npad
    slots = cache.allocate(live)
    init = torch.randn((live, *cache.state.shape[1:]), generator=gen, device="cuda").to(state)
    cache.reset(slots, init)
    for ring in cache.rings.values():  # held records only: nothing else may be read
        ring[slots.long()] = float("nan")
    untouched = [s for s in range(num_slots) if s not in set(slots.tolist()) and s != pad_slot_id]
    before = {
        name: t[untouched].clone() for name, t in [("state", cache.state), *cache.rings.items()]
    }

    ref_pool = torch.zeros(cache.state.shape, dtype=torch.float64, device="cuda")
    ref_pool[slots.long()] = init.double()
    ref_ckpt = ref_pool.clone()
    start = {s: i % max(window, 1) for i, s in enumerate(slots.tolist())}  # staggered joins

    inputs = family.inputs(gen, act)
    wrapper = family.wrapper(cache, mode=mode, batch=batch, sr=sr, seed=seed, config=config)
    _check_planned(wrapper, config, mode)
    out = torch.empty(family.out_shape(batch), dtype=act, device="cuda")
    worst_out = 0.0
    held = dict.fromkeys(slots.tolist(), 0)
    epochs = dict.fromkeys(slots.tolist(), 0)
    flushes = dict.fromkeys(slots.tolist(), 0)
    for t in range(steps):
        if switch is not None and t == switch[0]:
            wrapper = _planned_with_kernel(family, cache, switch[1], mode, batch, sr, seed, config)
        # conventional steps and ReplaySSM steps that flush every token leave the full state
        every_token = mode == "conventional" or wrapper.kernel == "flush-every-step"
        active = [s for s in slots.tolist() if start[s] <= t]
        row_slots = active + [pad_slot_id] * (batch - len(active))
        perm = torch.randperm(batch, generator=torch.Generator().manual_seed(t)).tolist()
        row_slots = [row_slots[i] for i in perm]
        idx = torch.tensor(row_slots, dtype=torch.int32, device="cuda")
        tok = inputs.token(batch)
        out.fill_(float("nan"))
        inputs.run(wrapper, tok, idx, out)
        y_ref = inputs.reference(ref_pool, idx, tok, pad_slot_id)
        assert not torch.isnan(out).any(), f"step {t}: output element not written (NaN poison left)"
        pad_rows = [i for i, s in enumerate(row_slots) if s == pad_slot_id]
        if pad_rows:
            assert torch.equal(out[pad_rows], torch.zeros_like(out[pad_rows])), (
                "pad rows must be zero"
            )
        live_rows = [i for i, s in enumerate(row_slots) if s != pad_slot_id]
        if live_rows:
            worst_out = max(worst_out, rel_err(out[live_rows], y_ref[live_rows]))
        for s in active:
            if mode == "conventional":
                flushes[s] += 1
                ref_ckpt[s] = ref_pool[s]
            elif every_token or held[s] + 1 >= window:
                held[s] = 0
                epochs[s] += 1
                flushes[s] += 1
                ref_ckpt[s] = ref_pool[s]
            else:
                held[s] += 1
    torch.cuda.synchronize()
    cursors = cache.cursors[slots.long()].cpu()
    assert cursors[:, 0].tolist() == [held[s] for s in slots.tolist()], "record counts"
    assert cursors[:, 1].tolist() == [epochs[s] for s in slots.tolist()], "flush epochs"
    assert cursors[:, 2].tolist() == [0] * live, "arrival scratch reset"
    state_err = rel_err(cache.state[slots.long()], ref_ckpt[slots.long()])
    for name, t in [("state", cache.state), *cache.rings.items()]:
        assert torch.equal(t[untouched], before[name]), f"unnamed slots' {name} changed"
    return ScheduleResult(worst_out, state_err, min(flushes.values()), steps)


def _check_planned(wrapper, config: LaunchConfig | None, mode: str) -> None:
    """The wrapper runs the CUDA kernels, with the kernel and row tile `config` fixed."""
    assert wrapper.backend == "cuda", wrapper.backend
    if config is None:
        return
    if mode == "replay" and config.kernel != "auto":
        assert wrapper.kernel == config.kernel, (wrapper.kernel, config)
    if config.rows_per_cta != "auto":
        rows = wrapper.decode_plan.rows_per_cta
        assert rows == config.rows_per_cta, (rows, config)


def _planned_with_kernel(
    family: Family, cache, kernel: str, mode: str, batch: int, sr, seed, config
):
    """A wrapper over `cache` planned with `config` but LaunchConfig kernel=`kernel`."""
    config = replace(config or LaunchConfig(), kernel=kernel)
    wrapper = family.wrapper(cache, mode=mode, batch=batch, sr=sr, seed=seed, config=config)
    assert wrapper.kernel == kernel, (wrapper.kernel, kernel)
    _check_planned(wrapper, config, mode)
    return wrapper


def assert_kernels_agree(
    family: Family,
    kernels: tuple[str, str],
    *,
    act: torch.dtype,
    state: torch.dtype,
    sr: bool,
    batch: int = 9,
    num_slots: int = 12,
    window: int = 4,
    config: LaunchConfig | None = None,
    launch_flags: int = 0,
    rtol: float = 0.0,
) -> None:
    """Run the same steps (three flush cycles, padded rows, random checkpoints) through two
    ReplaySSM kernels (each planned with `config` and LaunchConfig kernel=kernel) and require
    bit-identical outputs, checkpoints, rings and cursors: for kernels that do the same
    arithmetic in the same order. `config` fixes other launch choices for both, e.g.
    LaunchConfig(speculative_records=False): ring rows read after the cursor, as the split
    kernel does by default at large batch. `launch_flags`: bits the first kernel's launch must
    carry (so that the kernel variant meant is the one compared). `rtol` > 0: agreement to that
    relative error (rel_err) instead of bit for bit, for kernels whose sums round differently;
    cursors still agree exactly and NaN-poisoned ring rows stay in the same places."""

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        if rtol == 0.0:
            return torch.equal(a, b)
        nan = a.isnan()
        if not torch.equal(nan, b.isnan()):
            return False
        return rel_err(a[~nan].double(), b[~nan].double()) <= rtol

    base = config or LaunchConfig()
    pad = -1
    gen = torch.Generator(device="cuda").manual_seed(7)
    inputs = family.inputs(gen, act)
    runs = {}
    for kernel in kernels:
        cache = family.cache(
            num_slots, window=window, state_dtype=state, act_dtype=act, pad_slot_id=pad
        )
        init = torch.Generator().manual_seed(1)
        cache.state.copy_(torch.randn(cache.state.shape, generator=init))
        w = family.wrapper(
            cache, mode="replay", batch=batch, sr=sr, seed=11, config=replace(base, kernel=kernel)
        )
        assert w.kernel == kernel
        if kernel == kernels[0]:
            flags = w.decode_plan.flag_bits
            assert flags & launch_flags == launch_flags, (flags, launch_flags)
        runs[kernel] = (cache, w)
    order = torch.randperm(num_slots, generator=torch.Generator().manual_seed(2))[: batch - 2]
    rows = [int(s) for s in order] + [pad, pad]
    slot_indices = torch.tensor(rows[::2] + rows[1::2], dtype=torch.int32, device="cuda")
    for step in range(3 * window + 2):
        tok = inputs.token(batch)
        outs = []
        for _cache, w in runs.values():
            out = torch.full(family.out_shape(batch), float("nan"), dtype=act, device="cuda")
            inputs.run(w, tok, slot_indices, out)
            outs.append(out)
        assert not outs[0].isnan().any(), step
        assert same(outs[0], outs[1]), step
    (c1, _), (c2, _) = runs.values()
    assert same(c1.state, c2.state)
    assert torch.equal(c1.cursors[:, :2], c2.cursors[:, :2])
    for name in c1.rings:
        assert same(c1.rings[name], c2.rings[name]), name


def split_variant_params(four_warp_cases: list, capped_cases: list) -> list:
    """pytest params (config, flag, case) forcing the split step's large-batch variants (4-warp
    records CTAs, the capped-register state kernel) on the given delta-rule cases (shape, gates
    in kernel, activation, checkpoint, SR, L), named variant-shape-checkpoint."""
    from replayssm_jit.core.dtypes import DTYPE_NAMES
    from replayssm_jit.launch.policy import FLAG_CAPPED_STATE_REGISTERS, FLAG_FEW_RECORDS_WARPS

    variants = [
        ("4-warp-records", LaunchConfig(records_warps=4), FLAG_FEW_RECORDS_WARPS, four_warp_cases),
        ("capped-state", LaunchConfig(capped_state_registers=True), FLAG_CAPPED_STATE_REGISTERS,
         capped_cases),
    ]  # fmt: skip
    return [
        pytest.param(config, flag, case, id=f"{name}-{case[0]}-{DTYPE_NAMES[case[3]]}")
        for name, config, flag, cases in variants
        for case in cases
    ]


def check_schedule(
    run, *args, out_bound=1e-5, state_bound=1e-5, min_flushes=0, say=None, what=None, **kwargs
) -> ScheduleResult:
    """Run a family's schedule (`run`: its run_schedule) and require the worst output and the
    final checkpoints within the bounds of the float64 reference, after at least `min_flushes`
    flushes of every live slot. `say`: print the errors after that label; `what`: named in the
    assertion messages (a loop's variable)."""
    r = run(*args, **kwargs)
    if say is not None:
        print(f"\n{say}: out {r.out_err:.2e} checkpoint {r.state_err:.2e}")
    assert r.min_flushes >= min_flushes, (what, r)
    assert r.out_err < out_bound and r.state_err < state_bound, (what, r)
    return r
