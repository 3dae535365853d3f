"""Mamba-2 CUDA kernels against the float64 reference (run on the H200; skipped without CUDA).

The random schedule (padded rows, interleaved slots, staggered joins, NaN poison, final
checkpoints, cursors and untouched slots) lives in support/gpu_schedule.py, shared with GDN and
KDA.
"""

from functools import partial

import pytest
import torch
from support import gpu_schedule
from support.checks import rel_err

from replayssm_jit import LaunchConfig, Mamba2DecodeCache, Mamba2DecodeWrapper
from replayssm_jit.families.spec import mamba2_spec, spec_tilings
from replayssm_jit.reference import mamba2_step_pool

# Launch choices come from each test's LaunchConfig only (REPLAYSSM_LAUNCH would fill "auto").
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_launch_env")]


SHAPES = {  # (H, P, N, G)
    "nano4b": (96, 80, 128, 8),
    "super120b": (128, 64, 128, 8),
    "odd": (6, 24, 64, 3),
}


class Inputs(gpu_schedule.Inputs):
    """Per-layer parameters plus a fresh token batch per call."""

    def __init__(self, H, P, N, G, act, gen, *, has_z):
        dev = "cuda"
        self.H, self.P, self.N, self.G, self.act, self.gen, self.has_z = H, P, N, G, act, gen, has_z
        self.A = -(0.5 + 1.5 * torch.rand(H, generator=gen, device=dev))
        self.D = torch.randn(H, generator=gen, device=dev)
        self.dt_bias = 0.1 * torch.randn(H, generator=gen, device=dev)

    def token(self, batch):
        g, dev, act = self.gen, "cuda", self.act
        t = dict(
            x=torch.randn(batch, self.H, self.P, generator=g, device=dev).to(act),
            dt=torch.randn(batch, self.H, generator=g, device=dev) * 0.5 - 1.0,
            B=(torch.randn(batch, self.G, self.N, generator=g, device=dev) / self.N**0.25).to(act),
            C=(torch.randn(batch, self.G, self.N, generator=g, device=dev) / self.N**0.25).to(act),
        )
        if self.has_z:
            t["z"] = torch.randn(batch, self.H, self.P, generator=g, device=dev).to(act)
        return t

    def run(self, wrapper, tok, slot_indices, out):
        wrapper.run(
            tok["x"],
            tok["dt"],
            self.A,
            tok["B"],
            tok["C"],
            slot_indices,
            D=self.D,
            z=tok.get("z"),
            dt_bias=self.dt_bias,
            out=out,
        )

    def reference(self, ref_pool, slot_indices, tok, pad_slot_id):
        return mamba2_step_pool(
            ref_pool,
            slot_indices,
            tok["x"],
            tok["dt"],
            self.A,
            tok["B"],
            tok["C"],
            D=self.D,
            z=tok.get("z"),
            dt_bias=self.dt_bias,
            dt_softplus=True,
            pad_slot_id=pad_slot_id,
        )


class Mamba2(gpu_schedule.Family):
    def __init__(self, shape, *, has_z=False):
        self.H, self.P, self.N, self.G = SHAPES[shape]
        self.has_z = has_z

    def cache(self, num_slots, *, window, state_dtype, act_dtype, pad_slot_id):
        return Mamba2DecodeCache(
            num_slots,
            num_heads=self.H,
            headdim=self.P,
            dstate=self.N,
            ngroups=self.G,
            window=window,
            state_dtype=state_dtype,
            act_dtype=act_dtype,
            device="cuda",
            pad_slot_id=pad_slot_id,
        )

    def wrapper(self, cache, *, mode, batch, sr, seed, config=None):
        wrapper = Mamba2DecodeWrapper(cache, mode=mode)
        wrapper.plan(
            batch,
            has_D=True,
            has_z=self.has_z,
            has_dt_bias=True,
            dt_softplus=True,
            stochastic_rounding=sr,
            seed=seed,
            config=config,
        )
        return wrapper

    def inputs(self, gen, act):
        return Inputs(self.H, self.P, self.N, self.G, act, gen, has_z=self.has_z)

    def out_shape(self, batch):
        return (batch, self.H, self.P)


def run_schedule(shape, batch, window, *, has_z=False, **kwargs) -> gpu_schedule.ScheduleResult:
    """Decode through the wrapper and the reference side by side (see gpu_schedule)."""
    return gpu_schedule.run_schedule(Mamba2(shape, has_z=has_z), batch, window, **kwargs)


check = partial(gpu_schedule.check_schedule, run_schedule)  # (run_schedule args, bounds)


@pytest.mark.parametrize("kernel", ["split", "per-item"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("batch", [1, 7, 64, 256])
@pytest.mark.parametrize("window", [1, 4, 16, 32])
def test_replay_fp32_matches_reference(shape, batch, window, kernel):
    steps = 256 if batch <= 64 else 3 * window + 8
    check(
        shape, batch, window, steps=steps, has_z=shape == "odd", config=LaunchConfig(kernel=kernel)
    )


def test_replay_defaults_to_split_kernel():
    fam = Mamba2("super120b")
    cache = fam.cache(
        4, window=16, state_dtype=torch.float32, act_dtype=torch.bfloat16, pad_slot_id=-1
    )
    w = fam.wrapper(cache, mode="replay", batch=4, sr=False, seed=0)
    assert w.kernel == "split"


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_split_tile(shape):
    """Each row tile of the split kernel's state kernel, forced through LaunchConfig
    rows_per_cta (L = 4, padded rows)."""
    H, P, N, G = SHAPES[shape]
    spec = mamba2_spec(headdim=P, dstate=N, heads_per_group=H // G, window=4, act_dtype="f32")
    for rows, _ in spec_tilings(spec):
        config = LaunchConfig(kernel="split", rows_per_cta=rows)
        say = f"split rows={rows}"
        check(shape, 7, 4, steps=24, has_z=shape == "odd", config=config, say=say, what=rows)


# (shape, activation, checkpoint, SR, L): specializations the H200 preset prebuilds.
BITWISE_CASES = [
    ("super120b", torch.float32, torch.float32, False, 4),
    ("nano4b", torch.float32, torch.float32, False, 4),
    ("odd", torch.float32, torch.float32, False, 4),
    ("super120b", torch.bfloat16, torch.bfloat16, True, 16),
    ("nano4b", torch.bfloat16, torch.float16, False, 16),
    ("super120b", torch.bfloat16, torch.float32, False, 16),
]


@pytest.mark.parametrize("shape,act,state,sr,window", BITWISE_CASES)
def test_split_matches_per_item_bitwise(shape, act, state, sr, window):
    """The split kernel does the per-item kernel's arithmetic in the same order."""
    family = Mamba2(shape, has_z=shape == "odd")
    gpu_schedule.assert_kernels_agree(
        family, ("split", "per-item"), act=act, state=state, sr=sr, window=window
    )


@pytest.mark.parametrize("shape", ["super120b", "nano4b"])
def test_split_matches_per_item_bitwise_without_speculative_loads(shape):
    """The ring rows read after the cursor (the split kernel's default at large batch) give the
    same bits on both kernels."""
    gpu_schedule.assert_kernels_agree(
        Mamba2(shape), ("split", "per-item"), act=torch.float32, state=torch.float32, sr=False,
        config=LaunchConfig(speculative_records=False),
    )  # fmt: skip


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("batch", [1, 7, 64])
@pytest.mark.parametrize("window", [1, 4, 16])
def test_flush_every_step_fp32_matches_reference(shape, batch, window):
    """The per-item kernel flushing every token (the default below one (row, head) pair per SM
    with FP32 checkpoints): the checkpoint is the full state after every step."""
    config = LaunchConfig(kernel="flush-every-step")
    check(shape, batch, window, steps=40, has_z=shape == "odd", config=config, min_flushes=3)


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
    check(shape, 7, 16, steps=48, switch=(21, then), has_z=shape == "odd", config=config)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("batch", [1, 64, 256])
def test_conventional_fp32_matches_reference(shape, batch):
    check(shape, batch, 1, mode="conventional", steps=64, has_z=shape == "odd")


# Bounds for 16-bit activations/checkpoints, measured on the H200 and documented in the README.
LP_CASES = [
    # (state dtype, sr, output bound, checkpoint bound)
    (torch.float32, False, 1e-2, 1e-5),
    (torch.bfloat16, False, 3e-2, 2e-2),
    (torch.bfloat16, True, 3e-2, 2e-2),
    (torch.float16, False, 1e-2, 2e-3),
    (torch.float16, True, 1e-2, 2e-3),
]


@pytest.mark.parametrize("shape", ["super120b", "nano4b"])
@pytest.mark.parametrize("state, sr, out_bound, state_bound", LP_CASES)
def test_low_precision_bounded(shape, state, sr, out_bound, state_bound):
    bounds = dict(out_bound=out_bound, state_bound=state_bound)
    say = f"{shape} state={state} sr={sr}"
    check(shape, 64, 16, act=torch.bfloat16, state=state, sr=sr, steps=64, say=say, **bounds)


@pytest.mark.parametrize("shape", ["super120b", "nano4b"])
@pytest.mark.parametrize("state, sr, out_bound, state_bound", LP_CASES[1:])
def test_sixteen_bit_batch_one_flushes_every_step_within_bounds(
    shape, state, sr, out_bound, state_bound
):
    """At batch 1 the policy flushes a 16-bit checkpoint every token (rounded every token, as
    the conventional step rounds it): within the windowed step's bounds over 64 tokens."""
    fam = Mamba2(shape)
    cache = fam.cache(4, window=16, state_dtype=state, act_dtype=torch.bfloat16, pad_slot_id=-1)
    assert fam.wrapper(cache, mode="replay", batch=1, sr=sr, seed=0).kernel == "flush-every-step"
    bounds = dict(out_bound=out_bound, state_bound=state_bound)
    config = LaunchConfig(kernel="flush-every-step")
    check(shape, 1, 16, act=torch.bfloat16, state=state, sr=sr, steps=64, config=config, **bounds)


def test_vllm_pad_slot_zero():
    check("super120b", 7, 4, pad_slot_id=0, steps=24)


def test_stochastic_rounding_is_deterministic():
    results = []
    for _ in range(2):
        H, P, N, G = SHAPES["super120b"]
        cache = Mamba2DecodeCache(
            8,
            num_heads=H,
            headdim=P,
            dstate=N,
            ngroups=G,
            window=2,
            state_dtype=torch.bfloat16,
            device="cuda",
        )
        slots = cache.allocate(4)
        gen = torch.Generator(device="cuda").manual_seed(7)
        inputs = Inputs(H, P, N, G, torch.bfloat16, gen, has_z=False)
        w = Mamba2DecodeWrapper(cache)
        w.plan(4, stochastic_rounding=True, seed=1234)
        for _ in range(6):
            tok = inputs.token(4)
            w.run(
                tok["x"],
                tok["dt"],
                inputs.A,
                tok["B"],
                tok["C"],
                slots,
                D=inputs.D,
                dt_bias=inputs.dt_bias,
            )
        results.append(cache.state.clone())
    assert torch.equal(results[0], results[1])


def test_cuda_graph_capture_and_replay():
    H, P, N, G = SHAPES["super120b"]
    batch, window = 8, 4
    cache = Mamba2DecodeCache(
        16, num_heads=H, headdim=P, dstate=N, ngroups=G, window=window, device="cuda"
    )
    slots = cache.allocate(batch)
    gen = torch.Generator(device="cuda").manual_seed(3)
    inputs = Inputs(H, P, N, G, torch.bfloat16, gen, has_z=False)
    tok = inputs.token(batch)  # static buffers: refilled in place before every replay
    w = Mamba2DecodeWrapper(cache, use_cuda_graph=True)
    w.plan(batch)
    ref_pool = torch.zeros((16, H, P, N), dtype=torch.float64, device="cuda")

    def ours():
        return w.run(tok["x"], tok["dt"], inputs.A, tok["B"], tok["C"], slots,
                     D=inputs.D, dt_bias=inputs.dt_bias)  # fmt: skip

    def reference():
        return mamba2_step_pool(ref_pool, slots, tok["x"], tok["dt"], inputs.A, tok["B"], tok["C"],
                                D=inputs.D, dt_bias=inputs.dt_bias, dt_softplus=True)  # fmt: skip

    s = torch.cuda.Stream()
    with torch.cuda.stream(s):  # warm-up outside capture (loads the module)
        ours()
    torch.cuda.synchronize()
    reference()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ours()
    for _ in range(2 * window + 1):
        new = inputs.token(batch)
        for k in tok:
            tok[k].copy_(new[k])
        out.fill_(float("nan"))
        graph.replay()
        y_ref = reference()
        torch.cuda.synchronize()
        assert rel_err(out, y_ref) < 1e-2


def test_bad_input_touches_nothing():
    H, P, N, G = SHAPES["super120b"]
    cache = Mamba2DecodeCache(
        8, num_heads=H, headdim=P, dstate=N, ngroups=G, window=4, device="cuda"
    )
    slots = cache.allocate(2)
    gen = torch.Generator(device="cuda").manual_seed(5)
    inputs = Inputs(H, P, N, G, torch.bfloat16, gen, has_z=False)
    tok = inputs.token(2)
    w = Mamba2DecodeWrapper(cache)
    w.plan(2)
    snapshot = (
        cache.state.clone(),
        cache.cursors.clone(),
        {k: v.clone() for k, v in cache.rings.items()},
    )
    cases = [
        (
            dict(slot_indices=torch.tensor([0, 99], dtype=torch.int32, device="cuda")),
            ValueError,
            "slot_indices",
        ),
        (
            dict(slot_indices=torch.tensor([1, 1], dtype=torch.int32, device="cuda")),
            ValueError,
            "slot_indices",
        ),
        (dict(slot_indices=slots.long()), TypeError, "slot_indices"),
        (dict(x=tok["x"].float()), TypeError, "x"),
        (dict(B=tok["B"][:, :4]), ValueError, "B"),
        (dict(dt=tok["dt"].double()), TypeError, "dt"),
        (dict(A=inputs.A.cpu()), ValueError, "A"),
        (dict(x=tok["x"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "x"),
    ]
    for override, error, name in cases:
        args = dict(
            x=tok["x"], dt=tok["dt"], A=inputs.A, B=tok["B"], C=tok["C"], slot_indices=slots
        )
        args.update(override)
        with pytest.raises(error, match=name):
            w.run(
                args["x"],
                args["dt"],
                args["A"],
                args["B"],
                args["C"],
                args["slot_indices"],
                D=inputs.D,
                dt_bias=inputs.dt_bias,
            )
    with pytest.raises(ValueError, match="D"):
        w.run(tok["x"], tok["dt"], inputs.A, tok["B"], tok["C"], slots, dt_bias=inputs.dt_bias)
    torch.cuda.synchronize()
    assert torch.equal(cache.state, snapshot[0]) and torch.equal(cache.cursors, snapshot[1])
    assert all(torch.equal(cache.rings[k], v) for k, v in snapshot[2].items())
