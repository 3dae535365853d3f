"""GDN CUDA kernels against the float64 reference (run on the H200; skipped without CUDA).

The random schedule (padded rows, interleaved slots, staggered joins, NaN poison, final
checkpoints, cursors and untouched slots) lives in gpu_schedule.py, shared with Mamba-2.
Inputs: fresh random q, k, v every step (q and k normalised in the kernel) and realistic gates
(decays exp(g) in ~[0.55, 1), beta in (0, 1)), raw a, b with A_log, dt_bias ("gates in kernel")
or precomputed g, beta.
"""

import pytest
import torch
from support import gpu_schedule
from support.gpu_schedule import rel_err

from replayssm_jit import GDNDecodeCache, GDNDecodeWrapper, LaunchConfig
from replayssm_jit.families.spec import gdn_spec, spec_tilings
from replayssm_jit.launch.config import LAUNCH_ENV
from replayssm_jit.reference import gdn_gates, gdn_step_pool

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _no_launch_env(launch_env):
    """Launch choices come from each test's LaunchConfig only (REPLAYSSM_LAUNCH is for
    experiments and would fill the fields a test leaves "auto")."""
    launch_env(LAUNCH_ENV, None)


SHAPES = {  # (H, HV, K, V)
    "qwen4b": (16, 32, 128, 128),
    "qwen122b": (16, 64, 128, 128),
    "k64": (4, 8, 64, 64),
}


class Inputs(gpu_schedule.Inputs):
    """Per-layer gate parameters plus a fresh token batch per call."""

    def __init__(self, H, HV, K, V, act, gen, *, gates_in_kernel=True):
        dev = "cuda"
        self.H, self.HV, self.K, self.V, self.act, self.gen = H, HV, K, V, act, gen
        self.gates_in_kernel = gates_in_kernel
        # exp(A_log) in [0.5, 1.5); a + dt_bias in [-4.25, -0.75]: g in [-0.6, -0.007]
        self.A_log = torch.log(0.5 + torch.rand(HV, generator=gen, device=dev))
        self.dt_bias = 0.5 * torch.rand(HV, generator=gen, device=dev) - 0.25

    def token(self, batch):
        g, dev, act = self.gen, "cuda", self.act
        t = dict(
            q=torch.randn(batch, self.H, self.K, generator=g, device=dev).to(act),
            k=torch.randn(batch, self.H, self.K, generator=g, device=dev).to(act),
            v=torch.randn(batch, self.HV, self.V, generator=g, device=dev).to(act),
            a=-4.0 + 3.0 * torch.rand(batch, self.HV, generator=g, device=dev),
            b=torch.randn(batch, self.HV, generator=g, device=dev),
        )
        if not self.gates_in_kernel:  # the caller forms the gates (rounded to fp32)
            t["g"], t["beta"] = (
                x.float() for x in gdn_gates(self.A_log, t["a"], self.dt_bias, t["b"])
            )
        return t

    def gate_kwargs(self, tok):
        """The gate keyword arguments of wrapper.run for this gate mode."""
        if self.gates_in_kernel:
            return dict(a=tok["a"], b=tok["b"], A_log=self.A_log, dt_bias=self.dt_bias)
        return dict(g=tok["g"], beta=tok["beta"])

    def gates(self, tok):
        """(g, beta) of the reference: exact from a, b, or the fp32 g, beta the kernel got."""
        if self.gates_in_kernel:
            return gdn_gates(self.A_log, tok["a"], self.dt_bias, tok["b"])
        return tok["g"], tok["beta"]

    def run(self, wrapper, tok, slot_indices, out):
        wrapper.run(tok["q"], tok["k"], tok["v"], slot_indices, out=out, **self.gate_kwargs(tok))

    def reference(self, ref_pool, slot_indices, tok, pad_slot_id):
        g, beta = self.gates(tok)
        return gdn_step_pool(
            ref_pool, slot_indices, tok["q"], tok["k"], tok["v"], g, beta, pad_slot_id=pad_slot_id
        )


class GDN(gpu_schedule.Family):
    def __init__(self, shape, *, gates_in_kernel=True):
        self.H, self.HV, self.K, self.V = SHAPES[shape]
        self.gates_in_kernel = gates_in_kernel

    def cache(self, num_slots, *, window, state_dtype, act_dtype, pad_slot_id):
        return make_cache(
            (self.H, self.HV, self.K, self.V),
            num_slots,
            window=window,
            state_dtype=state_dtype,
            act_dtype=act_dtype,
            pad_slot_id=pad_slot_id,
        )

    def wrapper(self, cache, *, mode, batch, sr, seed, config=None):
        wrapper = GDNDecodeWrapper(cache, mode=mode)
        wrapper.plan(
            batch, gates_in_kernel=self.gates_in_kernel, stochastic_rounding=sr, seed=seed,
            config=config,
        )  # fmt: skip
        return wrapper

    def inputs(self, gen, act):
        return Inputs(
            self.H, self.HV, self.K, self.V, act, gen, gates_in_kernel=self.gates_in_kernel
        )

    def out_shape(self, batch):
        return (batch, self.HV, self.V)


def make_cache(dims, num_slots, **kwargs):
    H, HV, K, V = dims
    return GDNDecodeCache(
        num_slots,
        num_k_heads=H,
        num_v_heads=HV,
        head_k_dim=K,
        head_v_dim=V,
        device="cuda",
        **kwargs,
    )


def run_schedule(shape, batch, window, *, gates_in_kernel=True, **kwargs):
    """Decode through the wrapper and the reference side by side (see gpu_schedule)."""
    family = GDN(shape, gates_in_kernel=gates_in_kernel)
    return gpu_schedule.run_schedule(family, batch, window, **kwargs)


def tilings(shape, state_dtype):
    """The row tiles compiled into `shape`'s module for `state_dtype` checkpoints."""
    H, HV, K, V = SHAPES[shape]
    spec = gdn_spec(
        head_k_dim=K, head_v_dim=V, value_heads_per_key_head=HV // H, state_dtype=state_dtype
    )
    return [rows for rows, _ in spec_tilings(spec)]


def fp32_steps(batch, window):
    # 256 steps, or at batch 256 enough for 3 flushes of the last slot to join (keeps the
    # float64 reference affordable).
    return 256 if batch <= 64 else 4 * window + 8


@pytest.mark.parametrize("kernel", ["split", "per-item"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("batch", [1, 7, 64, 256])
@pytest.mark.parametrize("window", [1, 4, 16, 32])
def test_replay_fp32_matches_reference(shape, batch, window, kernel):
    config = LaunchConfig(kernel=kernel)
    r = run_schedule(shape, batch, window, steps=fp32_steps(batch, window), config=config)
    assert r.min_flushes >= 3, r
    assert r.out_err < 1e-5 and r.state_err < 1e-5, r


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("batch", [1, 7, 64])
@pytest.mark.parametrize("window", [1, 4, 16])
def test_flush_every_step_fp32_matches_reference(shape, batch, window):
    """The per-item kernel flushing every token (the default below one (row, head) pair per SM
    with FP32 checkpoints): the checkpoint is the full state after every step."""
    config = LaunchConfig(kernel="flush-every-step")
    r = run_schedule(shape, batch, window, steps=40, config=config)
    assert r.out_err < 1e-5 and r.state_err < 1e-5 and r.min_flushes >= 3, r


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize(
    "first,then",
    [
        ("split", "flush-every-step"),
        ("per-item", "flush-every-step"),
        ("flush-every-step", "split"),
    ],
)
def test_switching_kernels_carries_held_records(shape, first, then):
    """A wrapper planned for another batch takes over the cache mid-window: records held by one
    kernel are folded or replayed by the next (L = 16, switch after 21 steps)."""
    config = LaunchConfig(kernel=first)
    r = run_schedule(shape, 7, 16, steps=48, switch=(21, then), config=config)
    assert r.out_err < 1e-5 and r.state_err < 1e-5, r


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("batch", [1, 64, 256])
def test_conventional_fp32_matches_reference(shape, batch):
    r = run_schedule(shape, batch, 1, mode="conventional", steps=64)
    assert r.out_err < 1e-5 and r.state_err < 1e-5, r


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("batch", [7, 64])
def test_precomputed_gates_fp32_matches_reference(shape, batch):
    r = run_schedule(shape, batch, 16, gates_in_kernel=False, steps=64)
    assert r.min_flushes >= 3, r
    assert r.out_err < 1e-5 and r.state_err < 1e-5, r


# Bounds for bf16 activations and 16-bit checkpoints, about 3x what the H200 measured on
# 2026-11-29 (64 rows, L = 16, 64 steps; out / checkpoint relative error, qwen4b ~ qwen122b):
# f32 state 1.7e-3 / 1.3e-7, bf16 2.2e-3 / 1.8e-3, bf16 + SR 2.6e-3 / 2.6e-3, f16 1.7e-3 /
# 2.3e-4, f16 + SR 1.7e-3 / 3.2e-4 (benchmarks/results/HISTORY.md, session 8).
LP_CASES = [
    # (state dtype, sr, output bound, checkpoint bound)
    (torch.float32, False, 5e-3, 1e-6),
    (torch.bfloat16, False, 7e-3, 6e-3),
    (torch.bfloat16, True, 8e-3, 8e-3),
    (torch.float16, False, 5e-3, 7e-4),
    (torch.float16, True, 5e-3, 1e-3),
]


@pytest.mark.parametrize("shape", ["qwen4b", "qwen122b"])
@pytest.mark.parametrize(
    "state, sr, out_bound, state_bound",
    LP_CASES,
    ids=["f32", "bf16", "bf16-sr", "f16", "f16-sr"],
)
def test_low_precision_bounded(shape, state, sr, out_bound, state_bound):
    r = run_schedule(shape, 64, 16, act=torch.bfloat16, state=state, sr=sr, steps=64)
    print(f"\n{shape} state={state} sr={sr}: out {r.out_err:.2e} checkpoint {r.state_err:.2e}")
    assert r.out_err < out_bound and r.state_err < state_bound, r


def test_vllm_pad_slot_zero():
    r = run_schedule("k64", 7, 4, pad_slot_id=0, steps=24)
    assert r.out_err < 1e-5 and r.state_err < 1e-5, r


@pytest.mark.parametrize(
    "act, state, out_bound, state_bound",
    # bf16: measured 3.5e-3 / 3.3e-3 at every tiling (L = 4, 24 steps)
    [(torch.float32, torch.float32, 1e-5, 1e-5), (torch.bfloat16, torch.bfloat16, 1e-2, 1e-2)],
    ids=["f32", "bf16"],
)
def test_every_row_tiling(act, state, out_bound, state_bound):
    """Each row tiling compiled into the module (per-item kernel), forced through LaunchConfig
    rows_per_cta."""
    tiles = tilings("qwen4b", state)
    assert len(tiles) > 1
    for rows in tiles:
        config = LaunchConfig(kernel="per-item", rows_per_cta=rows)
        r = run_schedule("qwen4b", 7, 4, act=act, state=state, steps=24, config=config)
        print(f"\nrows_per_cta={rows} state={state}: out {r.out_err:.2e} ckpt {r.state_err:.2e}")
        assert r.out_err < out_bound and r.state_err < state_bound, (rows, r)


@pytest.mark.parametrize("shape", ["qwen4b", "k64"])
def test_every_split_tile(shape):
    """Each row tile of the split kernel's state kernel, forced through LaunchConfig
    rows_per_cta (L = 4, padded rows)."""
    for rows in tilings(shape, "f32"):
        config = LaunchConfig(kernel="split", rows_per_cta=rows)
        r = run_schedule(shape, 7, 4, steps=24, config=config)
        print(f"\nsplit rows={rows}: out {r.out_err:.2e} ckpt {r.state_err:.2e}")
        assert r.out_err < 1e-5 and r.state_err < 1e-5, (rows, r)


# (shape, gates in kernel, activation, checkpoint, SR, L): specializations the H200 preset prebuilds.
BITWISE_CASES = [
    ("qwen122b", True, torch.float32, torch.float32, False, 4),
    ("k64", True, torch.float32, torch.float32, False, 4),
    ("qwen4b", False, torch.float32, torch.float32, False, 16),
    ("qwen4b", True, torch.bfloat16, torch.bfloat16, True, 16),
    ("qwen122b", True, torch.bfloat16, torch.float32, False, 16),
]


@pytest.mark.parametrize("shape,gates_in_kernel,act,state,sr,window", BITWISE_CASES)
def test_split_matches_per_item_bitwise(shape, gates_in_kernel, act, state, sr, window):
    """The split kernel does the per-item kernel's arithmetic in the same order."""
    family = GDN(shape, gates_in_kernel=gates_in_kernel)
    gpu_schedule.assert_kernels_agree(
        family, ("split", "per-item"), act=act, state=state, sr=sr, window=window
    )


@pytest.mark.parametrize(
    "config, flag, case", gpu_schedule.split_variant_params(BITWISE_CASES[1:4], BITWISE_CASES[2:])
)
def test_split_variant_matches_per_item_bitwise(config, flag, case):
    """The 4-warp records CTAs and the capped-register state kernel (large batches) do the
    per-item kernel's arithmetic in the same order too."""
    shape, gates_in_kernel, act, state, sr, window = case
    family = GDN(shape, gates_in_kernel=gates_in_kernel)
    gpu_schedule.assert_kernels_agree(
        family, ("split", "per-item"), act=act, state=state, sr=sr, window=window,
        config=config, launch_flags=flag,
    )  # fmt: skip


@pytest.mark.parametrize("shape", ["qwen122b", "k64"])
def test_split_matches_per_item_bitwise_without_speculative_loads(shape):
    """The ring rows read after the cursor (the split kernel's default at large batch) give the
    same bits on both kernels."""
    gpu_schedule.assert_kernels_agree(
        GDN(shape, gates_in_kernel=True), ("split", "per-item"), act=torch.float32,
        state=torch.float32, sr=False, config=LaunchConfig(speculative_records=False),
    )  # fmt: skip


def sr_run(seed):
    """The bf16 checkpoints after 40 SR steps (2 flushes per slot at L=16) with `seed`."""
    dims = SHAPES["qwen4b"]
    cache = make_cache(dims, 8, window=16, state_dtype=torch.bfloat16)
    slots = cache.allocate(4)
    gen = torch.Generator(device="cuda").manual_seed(7)
    cache.reset(slots, torch.randn((4, *cache.state.shape[1:]), generator=gen, device="cuda"))
    inputs = Inputs(*dims, torch.bfloat16, gen)
    w = GDNDecodeWrapper(cache)
    w.plan(4, stochastic_rounding=True, seed=seed)
    for _ in range(40):
        inputs.run(w, inputs.token(4), slots, None)
    torch.cuda.synchronize()
    return cache.state.clone()


def test_stochastic_rounding_is_deterministic():
    first = sr_run(1234)
    assert torch.equal(first, sr_run(1234)), "same seed must give the same bits"
    assert not torch.equal(first, sr_run(4321)), "the seed must key the rounding noise"


def test_cuda_graph_capture_and_replay():
    dims = _, HV, K, V = SHAPES["qwen4b"]
    batch, window = 8, 4
    cache = make_cache(dims, 16, window=window)
    slots = cache.allocate(batch)
    gen = torch.Generator(device="cuda").manual_seed(3)
    inputs = Inputs(*dims, torch.bfloat16, gen)
    tok = inputs.token(batch)
    w = GDNDecodeWrapper(cache, use_cuda_graph=True)
    w.plan(batch)
    ref_pool = torch.zeros((16, HV, V, K), dtype=torch.float64, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):  # warm-up outside capture (loads the module)
        inputs.run(w, tok, slots, None)
    torch.cuda.synchronize()
    inputs.reference(ref_pool, slots, tok, cache.pad_slot_id)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w.run(tok["q"], tok["k"], tok["v"], slots, **inputs.gate_kwargs(tok))
    for step in range(2 * window + 1):  # crosses two flushes: cursors advance on the device
        new = inputs.token(batch)
        for k in tok:
            tok[k].copy_(new[k])
        out.fill_(float("nan"))
        graph.replay()
        y_ref = inputs.reference(ref_pool, slots, tok, cache.pad_slot_id)
        torch.cuda.synchronize()
        assert rel_err(out, y_ref) < 1e-2, step
    held = (2 * window + 2) % window
    assert cache.cursors[slots.long(), 0].tolist() == [held] * batch


def test_bad_input_touches_nothing():
    dims = SHAPES["qwen4b"]
    cache = make_cache(dims, 8, window=4)
    slots = cache.allocate(2)
    gen = torch.Generator(device="cuda").manual_seed(5)
    inputs = Inputs(*dims, torch.bfloat16, gen)
    tok = inputs.token(2)
    w = GDNDecodeWrapper(cache)
    w.plan(2)
    snapshot = (
        cache.state.clone(),
        cache.cursors.clone(),
        {k: v.clone() for k, v in cache.rings.items()},
    )
    dev = "cuda"
    misaligned_q = torch.zeros(2, 16, 136, dtype=torch.bfloat16, device=dev)[..., 1:129]
    cases = [
        (dict(slot_indices=torch.tensor([0, 99], dtype=torch.int32, device=dev)), ValueError, "slot_indices"),
        (dict(slot_indices=torch.tensor([1, 1], dtype=torch.int32, device=dev)), ValueError, "slot_indices"),
        (dict(slot_indices=slots.long()), TypeError, "slot_indices"),
        (dict(q=tok["q"].float()), TypeError, "q"),
        (dict(k=tok["k"][:, :4]), ValueError, "k"),
        (dict(v=tok["v"][:, :, :64]), ValueError, "v"),
        (dict(a=tok["a"].double()), TypeError, "a"),
        (dict(b=tok["b"][:, :8]), ValueError, "b"),
        (dict(A_log=inputs.A_log.cpu()), ValueError, "A_log"),
        (dict(A_log=None), ValueError, "A_log"),
        (dict(dt_bias=inputs.dt_bias[:4]), ValueError, "dt_bias"),
        (dict(g=tok["a"]), ValueError, "g"),  # precomputed gates with gates_in_kernel=True
        (dict(beta=tok["b"]), ValueError, "beta"),
        (dict(q=tok["q"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "q"),
        (dict(q=misaligned_q), ValueError, "q"),
        (dict(out=torch.empty(2, 32, 128, dtype=torch.float32, device=dev)), TypeError, "out"),
    ]  # fmt: skip
    for override, error, name in cases:
        args = dict(
            q=tok["q"], k=tok["k"], v=tok["v"], slot_indices=slots, a=tok["a"], b=tok["b"],
            A_log=inputs.A_log, dt_bias=inputs.dt_bias, g=None, beta=None, out=None,
        )  # fmt: skip
        args.update(override)
        with pytest.raises(error, match=rf"^{name}\b"):
            w.run(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("slot_indices"), **args)
    torch.cuda.synchronize()
    assert torch.equal(cache.state, snapshot[0]) and torch.equal(cache.cursors, snapshot[1])
    assert all(torch.equal(cache.rings[k], v) for k, v in snapshot[2].items())
