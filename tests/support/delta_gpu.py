"""What the GDN and KDA GPU suites share (gdn/test_gdn_gpu.py, kda/test_kda_gpu.py): the token
inputs, the `gpu_schedule.Family` adapter, the cache, the stochastic-rounding run and the checks
whose logic is the same for both. A `Delta` names what differs: the cache and wrapper classes,
the shapes, the gate function and reference step, and whether the decay is per key channel (KDA:
a [B, HV, K], dt_bias [HV * K]) or per head (GDN: a [B, HV], dt_bias [HV]).

Inputs: fresh random q, k, v every step (q and k normalised in the kernel) and realistic gates
(decays exp(g) in about [0.55, 1), beta in (0, 1)), raw a, b with A_log, dt_bias ("gates in
kernel") or the precomputed g, beta the caller forms from them (rounded to FP32).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import pytest
import torch

from replayssm_jit import LaunchConfig

from . import gpu_schedule
from .checks import rel_err


@dataclass(frozen=True)
class Delta:
    """One delta-rule family as its GPU suite drives it."""

    cache_class: type
    wrapper_class: type
    shapes: dict[str, tuple[int, int, int, int]]  # name -> (H, HV, K, V)
    gates: Callable  # (A_log, a, dt_bias, b[, lower_bound]) -> float64 (g, beta)
    step_pool: Callable  # the float64 conventional pool step of the reference
    per_channel: bool  # KDA's decay per key channel; GDN's per head

    def form_gates(self, A_log, a, dt_bias, b, lower_bound=None):
        """(g, beta) from raw projections; the lower bound (KDA's safe gate) only where set."""
        bound = () if lower_bound is None else (lower_bound,)
        return self.gates(A_log, a, dt_bias, b, *bound)


class Inputs(gpu_schedule.Inputs):
    """Per-layer gate parameters plus a fresh token batch per call."""

    def __init__(self, delta, H, HV, K, V, act, gen, *, gates_in_kernel=True, lower_bound=None):
        dev = "cuda"
        self.delta = delta
        self.H, self.HV, self.K, self.V, self.act, self.gen = H, HV, K, V, act, gen
        self.gates_in_kernel, self.lower_bound = gates_in_kernel, lower_bound
        self.decay = (HV, K) if delta.per_channel else (HV,)
        # exp(A_log) in [0.5, 1.5); a + dt_bias in [-4.25, -0.75]: g in about [-0.6, -0.007]
        self.A_log = torch.log(0.5 + torch.rand(HV, generator=gen, device=dev))
        biases = HV * K if delta.per_channel else HV
        self.dt_bias = 0.5 * torch.rand(biases, generator=gen, device=dev) - 0.25

    def token(self, batch):
        g, dev, act = self.gen, "cuda", self.act
        t = dict(
            q=torch.randn(batch, self.H, self.K, generator=g, device=dev).to(act),
            k=torch.randn(batch, self.H, self.K, generator=g, device=dev).to(act),
            v=torch.randn(batch, self.HV, self.V, generator=g, device=dev).to(act),
            a=-4.0 + 3.0 * torch.rand(batch, *self.decay, generator=g, device=dev),
            b=torch.randn(batch, self.HV, generator=g, device=dev),
        )
        if not self.gates_in_kernel:  # the caller forms the gates (rounded to fp32)
            t["g"], t["beta"] = (x.float() for x in self._formed(t))
        return t

    def _formed(self, tok):
        return self.delta.form_gates(self.A_log, tok["a"], self.dt_bias, tok["b"], self.lower_bound)

    def gate_kwargs(self, tok):
        """The gate keyword arguments of wrapper.run for this gate mode."""
        if self.gates_in_kernel:
            return dict(a=tok["a"], b=tok["b"], A_log=self.A_log, dt_bias=self.dt_bias)
        return dict(g=tok["g"], beta=tok["beta"])

    def gates(self, tok):
        """(g, beta) of the reference: exact from a, b, or the fp32 g, beta the kernel got."""
        if self.gates_in_kernel:
            return self._formed(tok)
        return tok["g"], tok["beta"]

    def run(self, wrapper, tok, slot_indices, out):
        wrapper.run(tok["q"], tok["k"], tok["v"], slot_indices, out=out, **self.gate_kwargs(tok))

    def reference(self, ref_pool, slot_indices, tok, pad_slot_id):
        g, beta = self.gates(tok)
        return self.delta.step_pool(
            ref_pool, slot_indices, tok["q"], tok["k"], tok["v"], g, beta, pad_slot_id=pad_slot_id
        )


class Family(gpu_schedule.Family):
    """The `gpu_schedule` adapter of a delta-rule family at one of its shapes."""

    def __init__(self, delta, shape, *, gates_in_kernel=True, lower_bound=None):
        self.delta = delta
        self.H, self.HV, self.K, self.V = delta.shapes[shape]
        self.gates_in_kernel, self.lower_bound = gates_in_kernel, lower_bound

    def cache(self, num_slots, *, window, state_dtype, act_dtype, pad_slot_id):
        return make_cache(self.delta, (self.H, self.HV, self.K, self.V), num_slots, window=window,
                          state_dtype=state_dtype, act_dtype=act_dtype,
                          pad_slot_id=pad_slot_id)  # fmt: skip

    def wrapper(self, cache, *, mode, batch, sr, seed, config=None):
        wrapper = self.delta.wrapper_class(cache, mode=mode)
        bound = {} if self.lower_bound is None else {"lower_bound": self.lower_bound}
        wrapper.plan(batch, gates_in_kernel=self.gates_in_kernel, stochastic_rounding=sr,
                     seed=seed, config=config, **bound)  # fmt: skip
        return wrapper

    def inputs(self, gen, act):
        gates = dict(gates_in_kernel=self.gates_in_kernel, lower_bound=self.lower_bound)
        return Inputs(self.delta, self.H, self.HV, self.K, self.V, act, gen, **gates)

    def out_shape(self, batch):
        return (batch, self.HV, self.V)


def make_cache(delta, dims, num_slots, **kwargs):
    H, HV, K, V = dims
    return delta.cache_class(num_slots, num_k_heads=H, num_v_heads=HV, head_k_dim=K,
                             head_v_dim=V, device="cuda", **kwargs)  # fmt: skip


def run_schedule(delta, shape, batch, window, *, gates_in_kernel=True, lower_bound=None, **kw):
    """Decode through the wrapper and the reference side by side (see gpu_schedule)."""
    family = Family(delta, shape, gates_in_kernel=gates_in_kernel, lower_bound=lower_bound)
    return gpu_schedule.run_schedule(family, batch, window, **kw)


def fp32_steps(batch, window):
    # 256 steps, or at batch 256 enough for 3 flushes of the last slot to join (keeps the
    # float64 reference affordable).
    return 256 if batch <= 64 else 4 * window + 8


# Bounds for bf16 activations and 16-bit checkpoints, about 3x what the H200 measured for GDN on
# 2026-11-29 (64 rows, L = 16, 64 steps; out / checkpoint relative error, qwen4b ~ qwen122b):
# f32 state 1.7e-3 / 1.3e-7, bf16 2.2e-3 / 1.8e-3, bf16 + SR 2.6e-3 / 2.6e-3, f16 1.7e-3 /
# 2.3e-4, f16 + SR 1.7e-3 / 3.2e-4 (benchmarks/results/HISTORY.md, session 8). KDA's are
# provisional: GDN's, not yet measured for KDA on the H200.
LOW_PRECISION = {  # test id: (state dtype, sr, output bound, checkpoint bound)
    "f32": (torch.float32, False, 5e-3, 1e-6),
    "bf16": (torch.bfloat16, False, 7e-3, 6e-3),
    "bf16-sr": (torch.bfloat16, True, 8e-3, 8e-3),
    "f16": (torch.float16, False, 5e-3, 7e-4),
    "f16-sr": (torch.float16, True, 5e-3, 1e-3),
}
LP_CASES, LP_IDS = list(LOW_PRECISION.values()), list(LOW_PRECISION)


def replay_grid(shapes):
    """The parametrization of test_replay_fp32_matches_reference: kernel x shape x batch x
    window, applied in the order the suites always stacked it (the test ids stay the same)."""
    marks = [
        pytest.mark.parametrize("kernel", ["split", "per-item"]),
        pytest.mark.parametrize("shape", sorted(shapes)),
        pytest.mark.parametrize("batch", [1, 7, 64, 256]),
        pytest.mark.parametrize("window", [1, 4, 16, 32]),
    ]

    def apply(test):
        for mark in reversed(marks):  # the bottom decorator is applied first
            test = mark(test)
        return test

    return apply


def check_replay_fp32(delta, shape, batch, window, kernel):
    """FP32 ReplaySSM through `kernel` follows the reference over at least three flushes."""
    steps, config = fp32_steps(batch, window), LaunchConfig(kernel=kernel)
    run = partial(run_schedule, delta)
    gpu_schedule.check_schedule(
        run, shape, batch, window, steps=steps, config=config, min_flushes=3
    )


def check_split_agrees(delta, case, **kw):
    """The split kernel against the per-item one on `case` (shape, gates in kernel, activation,
    checkpoint, SR, L), bit for bit unless `kw` says otherwise (gpu_schedule)."""
    shape, gates_in_kernel, act, state, sr, window = case
    gpu_schedule.assert_kernels_agree(
        Family(delta, shape, gates_in_kernel=gates_in_kernel), ("split", "per-item"), act=act,
        state=state, sr=sr, window=window, **kw,
    )  # fmt: skip


def sr_run(delta, shape, seed):
    """The bf16 checkpoints after 40 SR steps (2 flushes per slot at L = 16) with `seed`."""
    dims = delta.shapes[shape]
    cache = make_cache(delta, dims, 8, window=16, state_dtype=torch.bfloat16)
    slots = cache.allocate(4)
    gen = torch.Generator(device="cuda").manual_seed(7)
    cache.reset(slots, torch.randn((4, *cache.state.shape[1:]), generator=gen, device="cuda"))
    inputs = Inputs(delta, *dims, torch.bfloat16, gen)
    w = delta.wrapper_class(cache)
    w.plan(4, stochastic_rounding=True, seed=seed)
    for _ in range(40):
        inputs.run(w, inputs.token(4), slots, None)
    torch.cuda.synchronize()
    return cache.state.clone()


def check_sr_deterministic(delta, shape):
    """The same seed gives the same bits; another seed other bits."""
    first = sr_run(delta, shape, 1234)
    assert torch.equal(first, sr_run(delta, shape, 1234)), "same seed must give the same bits"
    assert not torch.equal(first, sr_run(delta, shape, 4321)), (
        "the seed must key the rounding noise"
    )


def check_against_peer(step, y_ours, y_peer, y_ref, peer_tol, slack):
    """One step of ours against a peer's (fla) output and both against the float64 reference:
    within `peer_tol` of the peer, and no worse than twice the peer's error plus `slack`."""
    assert not torch.isnan(y_ours).any() and not torch.isnan(y_peer).any(), step
    e_peer, e_ours, e_fla = rel_err(y_ours, y_peer), rel_err(y_ours, y_ref), rel_err(y_peer, y_ref)
    assert e_peer < peer_tol, (step, e_peer)
    assert e_ours <= 2 * e_fla + slack, (step, e_ours, e_fla)
