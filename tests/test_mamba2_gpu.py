"""Mamba-2 CUDA kernels against the float64 reference (run on the H200; skipped without CUDA).

Every step: fresh random inputs, the output poisoned with NaN first, rows padded and slots
interleaved, sequences joining at staggered steps so that one launch mixes flush and non-flush
rows. At the end: every checkpoint against the reference state at that slot's last flush,
cursors against the expected record counts, and unnamed slots bit-identical.
"""

import pytest
import torch

from replayssm_jit import Mamba2DecodeCache, Mamba2DecodeWrapper
from replayssm_jit.reference import mamba2_step_pool

pytestmark = pytest.mark.gpu

SHAPES = {  # (H, P, N, G)
    "nano4b": (96, 80, 128, 8),
    "super120b": (128, 64, 128, 8),
    "odd": (6, 24, 64, 3),
}


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (got.double() - ref.double()).norm()
    return (diff / ref.double().norm().clamp_min(1e-300)).item()


class Inputs:
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


def run_schedule(
    shape,
    batch,
    window,
    *,
    act=torch.float32,
    state=torch.float32,
    mode="replay",
    steps=None,
    has_z=False,
    sr=False,
    pad_slot_id=-1,
    seed=0,
):
    """Decode `steps` tokens through the wrapper and the reference side by side; return errors."""
    H, P, N, G = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(1000 * batch + window + seed)
    steps = steps or max(3 * window + 5, 40)
    num_slots = 2 * batch + 5
    cache = Mamba2DecodeCache(
        num_slots,
        num_heads=H,
        headdim=P,
        dstate=N,
        ngroups=G,
        window=window,
        state_dtype=state,
        act_dtype=act,
        device="cuda",
        pad_slot_id=pad_slot_id,
    )
    # Unnamed slots hold random bits that must survive untouched.
    cache.state.copy_(torch.randn(cache.state.shape, generator=gen, device="cuda").to(state))
    for ring in cache.rings.values():
        ring.copy_(torch.randn(ring.shape, generator=gen, device="cuda").to(ring.dtype))
    npad = batch // 7
    live = batch - npad
    slots = cache.allocate(live)
    init = torch.randn((live, H, P, N), generator=gen, device="cuda").to(state)
    cache.reset(slots, init)
    untouched = [s for s in range(num_slots) if s not in set(slots.tolist()) and s != pad_slot_id]
    before = {
        name: t[untouched].clone() for name, t in [("state", cache.state), *cache.rings.items()]
    }

    ref_pool = torch.zeros((num_slots, H, P, N), dtype=torch.float64, device="cuda")
    ref_pool[slots.long()] = init.double()
    ref_ckpt = ref_pool.clone()
    tokens_seen = torch.zeros(num_slots, dtype=torch.long)
    start = {s: i % max(window, 1) for i, s in enumerate(slots.tolist())}  # staggered joins

    inputs = Inputs(H, P, N, G, act, gen, has_z=has_z)
    wrapper = Mamba2DecodeWrapper(cache, mode=mode)
    wrapper.plan(
        batch,
        has_D=True,
        has_z=has_z,
        has_dt_bias=True,
        dt_softplus=True,
        stochastic_rounding=sr,
        seed=seed,
    )
    out = torch.empty((batch, H, P), dtype=act, device="cuda")
    worst_out = 0.0
    for t in range(steps):
        active = [s for s in slots.tolist() if start[s] <= t]
        row_slots = active + [pad_slot_id] * (batch - len(active))
        perm = torch.randperm(batch, generator=torch.Generator().manual_seed(t)).tolist()
        row_slots = [row_slots[i] for i in perm]
        idx = torch.tensor(row_slots, dtype=torch.int32, device="cuda")
        tok = inputs.token(batch)
        out.fill_(float("nan"))
        wrapper.run(
            tok["x"],
            tok["dt"],
            inputs.A,
            tok["B"],
            tok["C"],
            idx,
            D=inputs.D,
            z=tok.get("z"),
            dt_bias=inputs.dt_bias,
            out=out,
        )
        y_ref = mamba2_step_pool(
            ref_pool,
            idx,
            tok["x"],
            tok["dt"],
            inputs.A,
            tok["B"],
            tok["C"],
            D=inputs.D,
            z=tok.get("z"),
            dt_bias=inputs.dt_bias,
            dt_softplus=True,
            pad_slot_id=pad_slot_id,
        )
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
            tokens_seen[s] += 1
            if mode == "conventional" or tokens_seen[s] % window == 0:
                ref_ckpt[s] = ref_pool[s]
    torch.cuda.synchronize()
    expected_held = torch.tensor(
        [0 if mode == "conventional" else int(tokens_seen[s]) % window for s in slots.tolist()],
        dtype=torch.int32,
        device="cuda",
    )
    assert torch.equal(cache.cursors[slots.long(), 0], expected_held), "record counts"
    assert torch.equal(cache.cursors[slots.long(), 2], torch.zeros_like(expected_held)), (
        "arrival scratch reset"
    )
    state_err = rel_err(cache.state[slots.long()], ref_ckpt[slots.long()])
    for name, t in [("state", cache.state), *cache.rings.items()]:
        assert torch.equal(t[untouched], before[name]), f"unnamed slots' {name} changed"
    return worst_out, state_err


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("batch", [1, 7, 64, 256])
@pytest.mark.parametrize("window", [1, 4, 16, 32])
def test_replay_fp32_matches_reference(shape, batch, window):
    out_err, state_err = run_schedule(
        shape, batch, window, steps=256 if batch <= 64 else 3 * window + 8, has_z=shape == "odd"
    )
    assert out_err < 1e-5 and state_err < 1e-5, (out_err, state_err)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("batch", [1, 64, 256])
def test_conventional_fp32_matches_reference(shape, batch):
    out_err, state_err = run_schedule(
        shape, batch, 1, mode="conventional", steps=64, has_z=shape == "odd"
    )
    assert out_err < 1e-5 and state_err < 1e-5, (out_err, state_err)


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
    out_err, state_err = run_schedule(
        shape, 64, 16, act=torch.bfloat16, state=state, sr=sr, steps=64
    )
    print(f"\n{shape} state={state} sr={sr}: out {out_err:.2e} checkpoint {state_err:.2e}")
    assert out_err < out_bound and state_err < state_bound, (out_err, state_err)


def test_vllm_pad_slot_zero():
    out_err, state_err = run_schedule("super120b", 7, 4, pad_slot_id=0, steps=24)
    assert out_err < 1e-5 and state_err < 1e-5


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
    tok = inputs.token(batch)
    w = Mamba2DecodeWrapper(cache, use_cuda_graph=True)
    w.plan(batch)
    ref_pool = torch.zeros((16, H, P, N), dtype=torch.float64, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):  # warm-up outside capture (loads the module)
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
    torch.cuda.synchronize()
    mamba2_step_pool(
        ref_pool,
        slots,
        tok["x"],
        tok["dt"],
        inputs.A,
        tok["B"],
        tok["C"],
        D=inputs.D,
        dt_bias=inputs.dt_bias,
        dt_softplus=True,
    )
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w.run(
            tok["x"],
            tok["dt"],
            inputs.A,
            tok["B"],
            tok["C"],
            slots,
            D=inputs.D,
            dt_bias=inputs.dt_bias,
        )
    for _ in range(2 * window + 1):
        new = inputs.token(batch)
        for k in tok:
            tok[k].copy_(new[k])
        out.fill_(float("nan"))
        graph.replay()
        y_ref = mamba2_step_pool(
            ref_pool,
            slots,
            tok["x"],
            tok["dt"],
            inputs.A,
            tok["B"],
            tok["C"],
            D=inputs.D,
            dt_bias=inputs.dt_bias,
            dt_softplus=True,
        )
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
