"""KDA CUDA kernels against the float64 reference and fla (run on the H200; skipped without CUDA).

The random schedule (padded rows, interleaved slots, staggered joins, NaN-poisoned outputs and
rings, final checkpoints, cursors and untouched slots) is support/gpu_schedule.py's; the inputs,
adapter and the checks both delta-rule suites make are support/delta_gpu.py's, shared with GDN.
Inputs: per-channel gates whose decays exp(g) lie in about [0.55, 1) and differ across the K
channels; raw a, b with A_log, dt_bias ("gates in kernel", fla's gate or the safe gate with a
lower bound) or precomputed g, beta. The modules these tests load are the AOT preset
`kda-tests` (python -m replayssm_jit aot --presets-from tests/support/aot_presets.py --preset
kda-tests).
"""

import inspect
from functools import partial

import pytest
import torch
from support import delta_gpu, gpu_schedule
from support.checks import rel_err

from replayssm_jit import KDADecodeCache, KDADecodeWrapper, LaunchConfig
from replayssm_jit.families.spec import kda_spec, spec_tilings
from replayssm_jit.reference import kda_gates, kda_step_pool

# Launch choices come from each test's LaunchConfig only (REPLAYSSM_LAUNCH would fill "auto").
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_launch_env")]


SHAPES = {  # (H, HV, K, V)
    "kimi48b": (32, 32, 128, 128),  # Kimi-Linear-48B-A3B
    "k3shard": (12, 12, 128, 128),  # a Kimi-K3 tensor-parallel shard
    "gva": (8, 16, 128, 128),  # HV = 2H
}
DELTA = delta_gpu.Delta(KDADecodeCache, KDADecodeWrapper, SHAPES, kda_gates, kda_step_pool,
                        per_channel=True)  # fmt: skip
Inputs = partial(
    delta_gpu.Inputs, DELTA
)  # (H, HV, K, V, act, gen, *, gates_in_kernel, lower_bound)
KDA = partial(delta_gpu.Family, DELTA)  # (shape, *, gates_in_kernel=True, lower_bound=None)
make_cache = partial(delta_gpu.make_cache, DELTA)  # (dims, num_slots, **cache kwargs)
run_schedule = partial(delta_gpu.run_schedule, DELTA)  # (shape, batch, window, **schedule kw)
check = partial(gpu_schedule.check_schedule, run_schedule)  # (run_schedule args, bounds)


@delta_gpu.replay_grid(SHAPES)
def test_replay_fp32_matches_reference(shape, batch, window, kernel):
    delta_gpu.check_replay_fp32(DELTA, shape, batch, window, kernel)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_flush_every_step_fp32_matches_reference(shape, batch):
    config = LaunchConfig(kernel="flush-every-step")
    check(shape, batch, 16, steps=40, config=config, min_flushes=3)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize(
    "first,then",
    [
        ("per-item", "flush-every-step"),
        ("split", "flush-every-step"),
        ("flush-every-step", "split"),
        ("per-item", "split"),
    ],
)
def test_switching_kernels_carries_held_records(shape, first, then):
    """A wrapper planned for another kernel takes over the cache mid-window: records held by one
    kernel are folded or replayed by the next (L = 16, switch after 21 steps)."""
    config = LaunchConfig(kernel=first)
    check(shape, 7, 16, steps=48, switch=(21, then), config=config)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("batch", [1, 7, 64, 256])
def test_conventional_fp32_matches_reference(shape, batch):
    check(shape, batch, 1, mode="conventional", steps=64)


@pytest.mark.parametrize("mode", ["replay", "conventional"])
def test_safe_gate_fp32_matches_reference(mode):
    """Kimi-K3's gate: g = -5 sigmoid(exp(A_log) (a + dt_bias)), formed in the kernel."""
    check("k3shard", 64, 16, lower_bound=-5.0, mode=mode, steps=64)


@pytest.mark.parametrize("shape", ["kimi48b", "gva"])
def test_precomputed_gates_fp32_matches_reference(shape):
    check(shape, 64, 16, gates_in_kernel=False, steps=64, min_flushes=3)


# Provisional bounds (not yet measured on the H200): GDN's measured ones (support/delta_gpu.py).
@pytest.mark.parametrize("shape", ["kimi48b", "k3shard"])
@pytest.mark.parametrize(
    "state, sr, out_bound, state_bound", delta_gpu.LP_CASES, ids=delta_gpu.LP_IDS
)
def test_low_precision_bounded(shape, state, sr, out_bound, state_bound):
    bounds = dict(out_bound=out_bound, state_bound=state_bound)
    say = f"{shape} state={state} sr={sr}"
    check(shape, 64, 16, act=torch.bfloat16, state=state, sr=sr, steps=64, say=say, **bounds)


def test_vllm_pad_slot_zero():
    check("gva", 7, 4, pad_slot_id=0, steps=24)


def test_every_row_tiling():
    """Each row tiling compiled into the module (per-item kernel), forced through rows_per_cta."""
    spec = kda_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=1, window=4)
    tiles = [rows for rows, _ in spec_tilings(spec)]
    assert len(tiles) > 1
    for rows in tiles:
        config = LaunchConfig(kernel="per-item", rows_per_cta=rows)
        check("k3shard", 7, 4, steps=24, config=config, what=rows)


def test_every_split_tile():
    """Each row tile of the split step's state kernel, forced through rows_per_cta (L = 4)."""
    spec = kda_spec(head_k_dim=128, head_v_dim=128, value_heads_per_key_head=1, window=4)
    for rows in [rows for rows, _ in spec_tilings(spec)]:
        config = LaunchConfig(kernel="split", rows_per_cta=rows)
        check("k3shard", 7, 4, steps=24, config=config, what=rows)


# (shape, gates in kernel, activation, checkpoint, SR, L): specializations of the kda-tests preset.
AGREEMENT_CASES = [
    ("kimi48b", True, torch.float32, torch.float32, False, 16),
    ("gva", True, torch.float32, torch.float32, False, 4),
    ("k3shard", False, torch.float32, torch.float32, False, 16),
    ("kimi48b", True, torch.bfloat16, torch.bfloat16, True, 16),
    ("kimi48b", True, torch.bfloat16, torch.float32, False, 16),
]


@pytest.mark.parametrize("shape,gates_in_kernel,act,state,sr,window", AGREEMENT_CASES)
def test_split_agrees_with_per_item(shape, gates_in_kernel, act, state, sr, window):
    """Bit for bit: both kernels contract the same FMAs (docs/tuning-formats.md, KDA)."""
    case = (shape, gates_in_kernel, act, state, sr, window)
    delta_gpu.check_split_agrees(DELTA, case, rtol=0.0)


@pytest.mark.parametrize(
    "config, flag, case",
    gpu_schedule.split_variant_params(AGREEMENT_CASES[:3], AGREEMENT_CASES[2:]),
)
def test_split_variant_agrees_with_per_item(config, flag, case):
    delta_gpu.check_split_agrees(DELTA, case, config=config, launch_flags=flag, rtol=0.0)


def test_split_agrees_with_per_item_without_speculative_loads():
    """Ring rows read after the cursor (the split step's default at large batch)."""
    gpu_schedule.assert_kernels_agree(
        KDA("gva"), ("split", "per-item"), act=torch.float32, state=torch.float32, sr=False,
        config=LaunchConfig(speculative_records=False), rtol=0.0,
    )  # fmt: skip


def test_per_item_matches_flush_every_step_bitwise_at_window_1():
    """At L = 1 every per-item step flushes: the same arithmetic as flush-every-step."""
    gpu_schedule.assert_kernels_agree(
        KDA("gva"), ("per-item", "flush-every-step"), act=torch.float32, state=torch.float32,
        sr=False, window=1,
    )  # fmt: skip


def test_stochastic_rounding_is_deterministic():
    delta_gpu.check_sr_deterministic(DELTA, "k3shard")


def test_records_hold_per_channel_gates():
    """A non-flush step appends g [HV, K] (as the reference forms it) and raw k to ring row n."""
    dims = SHAPES["gva"]
    cache = make_cache(dims, 4, window=16, act_dtype=torch.float32)
    slots = cache.allocate(2)
    gen = torch.Generator(device="cuda").manual_seed(9)
    inputs = Inputs(*dims, torch.float32, gen)
    w = KDADecodeWrapper(cache)
    w.plan(2, config=LaunchConfig(kernel="per-item"))  # small batches may flush every step
    for n in range(3):
        tok = inputs.token(2)
        inputs.run(w, tok, slots, None)
        torch.cuda.synchronize()
        g, _ = inputs.gates(tok)
        assert rel_err(cache.rings["rec_g"][slots.long(), :, n], g) < 1e-6, n
        assert torch.equal(cache.rings["rec_k"][slots.long(), :, n], tok["k"]), n
    assert cache.cursors[slots.long(), 0].tolist() == [3, 3]


def fla_kda_step(fn, q, k, v, g, beta, h0, *, scale):
    """One fla decode step for every row: q, k [B, H, K], v [B, HV, V], g [B, HV, K], beta
    [B, HV], h0 [B, HV, V, K] fp32. Returns (o [B, HV, V], h [B, HV, V, K]). fla keeps [B, HV,
    K, V] unless the installed version offers state_v_first; versions differ in whether they
    take output_final_state (the others return the state they updated in place)."""
    params = inspect.signature(fn).parameters
    v_first = "state_v_first" in params
    kw = dict(scale=scale, use_qk_l2norm_in_kernel=True,
              initial_state=h0.contiguous() if v_first else h0.transpose(-1, -2).contiguous())  # fmt: skip
    if "output_final_state" in params:
        kw["output_final_state"] = True
    if v_first:
        kw["state_v_first"] = True
    o, h = fn(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], **kw)
    return o[:, 0], (h if v_first else h.transpose(-1, -2))


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32])
def test_conventional_matches_fla_fused_recurrent_kda(act):
    """Our conventional step and fla's fused_recurrent_kda from the same states and inputs, step
    by step (16 steps, Kimi-Linear heads), both against the float64 reference."""
    fla_kda = pytest.importorskip("fla.ops.kda")
    fn = fla_kda.fused_recurrent_kda
    assert "initial_state" in inspect.signature(fn).parameters
    H, HV, K, V = SHAPES["kimi48b"]
    batch, num_slots = 16, 40
    gen = torch.Generator(device="cuda").manual_seed(11)
    cache = make_cache((H, HV, K, V), num_slots, window=16, act_dtype=act)
    cache.state.copy_(torch.randn(cache.state.shape, generator=gen, device="cuda"))
    fla_pool = cache.state.clone()
    ref_pool = cache.state.double()
    idx = torch.randperm(num_slots, generator=gen, device="cuda")[:batch].to(torch.int32)
    inputs = Inputs(H, HV, K, V, act, gen)
    ours = KDADecodeWrapper(cache, mode="conventional")
    ours.plan(batch)
    peer_tol, slack = (1e-2, 1e-3) if act == torch.bfloat16 else (1e-4, 1e-6)
    for step in range(16):
        tok = inputs.token(batch)
        g, beta = inputs.gates(tok)
        y_ours = torch.full((batch, HV, V), float("nan"), dtype=act, device="cuda")
        inputs.run(ours, tok, idx, y_ours)
        y_fla, h = fla_kda_step(fn, tok["q"], tok["k"], tok["v"], g.float(), beta.float(),
                                fla_pool[idx.long()], scale=K**-0.5)  # fmt: skip
        fla_pool[idx.long()] = h.to(fla_pool.dtype)
        y_ref = kda_step_pool(ref_pool, idx, tok["q"], tok["k"], tok["v"], g, beta)
        delta_gpu.check_against_peer(step, y_ours, y_fla, y_ref, peer_tol, slack)
    torch.cuda.synchronize()
    assert rel_err(cache.state, fla_pool) < 1e-5
    assert rel_err(cache.state, ref_pool) < 1e-5
