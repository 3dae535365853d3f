"""GDN CUDA kernels against the float64 reference (run on the H200; skipped without CUDA).

The random schedule (padded rows, interleaved slots, staggered joins, NaN poison, final
checkpoints, cursors and untouched slots) lives in support/gpu_schedule.py, shared with Mamba-2
and KDA; the inputs (per-head decays in ~[0.55, 1), raw a, b or precomputed g, beta), the
adapter and the checks both delta-rule suites make, in support/delta_gpu.py, shared with KDA.
"""

from functools import partial

import pytest
import torch
from support import delta_gpu, gpu_schedule
from support.checks import rel_err

from replayssm_jit import GDNDecodeCache, GDNDecodeWrapper, LaunchConfig
from replayssm_jit.families.spec import gdn_spec, spec_tilings
from replayssm_jit.reference import gdn_gates, gdn_step_pool

# Launch choices come from each test's LaunchConfig only (REPLAYSSM_LAUNCH would fill "auto").
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_launch_env")]


SHAPES = {  # (H, HV, K, V)
    "qwen4b": (16, 32, 128, 128),
    "qwen122b": (16, 64, 128, 128),
    "k64": (4, 8, 64, 64),
}
DELTA = delta_gpu.Delta(GDNDecodeCache, GDNDecodeWrapper, SHAPES, gdn_gates, gdn_step_pool,
                        per_channel=False)  # fmt: skip
Inputs = partial(delta_gpu.Inputs, DELTA)  # (H, HV, K, V, act, gen, *, gates_in_kernel=True)
GDN = partial(delta_gpu.Family, DELTA)  # (shape, *, gates_in_kernel=True)
make_cache = partial(delta_gpu.make_cache, DELTA)  # (dims, num_slots, **cache kwargs)
run_schedule = partial(delta_gpu.run_schedule, DELTA)  # (shape, batch, window, **schedule kw)
check = partial(gpu_schedule.check_schedule, run_schedule)  # (run_schedule args, bounds)


def tilings(shape, state_dtype):
    """The row tiles compiled into `shape`'s module for `state_dtype` checkpoints."""
    H, HV, K, V = SHAPES[shape]
    spec = gdn_spec(
        head_k_dim=K, head_v_dim=V, value_heads_per_key_head=HV // H, state_dtype=state_dtype
    )
    return [rows for rows, _ in spec_tilings(spec)]


@delta_gpu.replay_grid(SHAPES)
def test_replay_fp32_matches_reference(shape, batch, window, kernel):
    delta_gpu.check_replay_fp32(DELTA, shape, batch, window, kernel)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("batch", [1, 7, 64])
@pytest.mark.parametrize("window", [1, 4, 16])
def test_flush_every_step_fp32_matches_reference(shape, batch, window):
    """The per-item kernel flushing every token (the default below one (row, head) pair per SM
    with FP32 checkpoints): the checkpoint is the full state after every step."""
    config = LaunchConfig(kernel="flush-every-step")
    check(shape, batch, window, steps=40, config=config, min_flushes=3)


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
    check(shape, 7, 16, steps=48, switch=(21, then), config=config)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("batch", [1, 64, 256])
def test_conventional_fp32_matches_reference(shape, batch):
    check(shape, batch, 1, mode="conventional", steps=64)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("batch", [7, 64])
def test_precomputed_gates_fp32_matches_reference(shape, batch):
    check(shape, batch, 16, gates_in_kernel=False, steps=64, min_flushes=3)


@pytest.mark.parametrize("shape", ["qwen4b", "qwen122b"])
@pytest.mark.parametrize(
    "state, sr, out_bound, state_bound", delta_gpu.LP_CASES, ids=delta_gpu.LP_IDS
)
def test_low_precision_bounded(shape, state, sr, out_bound, state_bound):
    bounds = dict(out_bound=out_bound, state_bound=state_bound)
    say = f"{shape} state={state} sr={sr}"
    check(shape, 64, 16, act=torch.bfloat16, state=state, sr=sr, steps=64, say=say, **bounds)


def test_vllm_pad_slot_zero():
    check("k64", 7, 4, pad_slot_id=0, steps=24)


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
        say = f"rows_per_cta={rows} state={state}"
        check("qwen4b", 7, 4, act=act, state=state, steps=24, config=config, say=say, what=rows,
              out_bound=out_bound, state_bound=state_bound)  # fmt: skip


@pytest.mark.parametrize("shape", ["qwen4b", "k64"])
def test_every_split_tile(shape):
    """Each row tile of the split kernel's state kernel, forced through LaunchConfig
    rows_per_cta (L = 4, padded rows)."""
    for rows in tilings(shape, "f32"):
        config = LaunchConfig(kernel="split", rows_per_cta=rows)
        check(shape, 7, 4, steps=24, config=config, say=f"split rows={rows}", what=rows)


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
    delta_gpu.check_split_agrees(DELTA, (shape, gates_in_kernel, act, state, sr, window))


@pytest.mark.parametrize(
    "config, flag, case", gpu_schedule.split_variant_params(BITWISE_CASES[1:4], BITWISE_CASES[2:])
)
def test_split_variant_matches_per_item_bitwise(config, flag, case):
    """The 4-warp records CTAs and the capped-register state kernel (large batches) do the
    per-item kernel's arithmetic in the same order too."""
    delta_gpu.check_split_agrees(DELTA, case, config=config, launch_flags=flag)


@pytest.mark.parametrize("shape", ["qwen122b", "k64"])
def test_split_matches_per_item_bitwise_without_speculative_loads(shape):
    """The ring rows read after the cursor (the split kernel's default at large batch) give the
    same bits on both kernels."""
    gpu_schedule.assert_kernels_agree(
        GDN(shape, gates_in_kernel=True), ("split", "per-item"), act=torch.float32,
        state=torch.float32, sr=False, config=LaunchConfig(speculative_records=False),
    )  # fmt: skip


def test_stochastic_rounding_is_deterministic():
    delta_gpu.check_sr_deterministic(DELTA, "qwen4b")


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
