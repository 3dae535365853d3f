"""Faults stay inside their slot: NaN/Inf inputs or checkpoints, out-of-range slot ids and
corrupted cursors reach no other row's output and no other slot's tensors, bit for bit.

Each test runs a faulted pool beside a clean twin: the same slots, rows and inputs, except
that the faulted rows' inputs (or slots) carry the fault in one and finite values in the other.
Every other row's output and every other slot's tensors must agree bit for bit at every step.
The CPU variants run the PyTorch path; the GPU ones every kernel choice of the launch policy.
"""

from __future__ import annotations

import math

import pytest
import torch

from replayssm_jit import (
    LaunchConfig,
    gdn_decode,
    gdn_layout,
    mamba2_decode,
    mamba2_layout,
    plan_decode,
)

STEPS = {"cuda": 1000, "cpu": 100}  # the CPU path's steps cost milliseconds each
NUM_SLOTS = 12
BATCH = 8
WINDOW = 4
LIVE = [7, 2, 9, 0, 5, 11, 3]  # row i names LIVE[i]; the last row is a pad row
NAN_ROW, INF_ROW, POISONED_SLOT_ROW = 1, 4, 5  # faulted rows (their slots: 2, 5, 11)

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]
GPU_KERNELS = ["conventional", "per-item", "flush-every-step", "split"]


class Mamba2:
    """Small heads on the CPU; nemotron-3-super-120b's heads (an AOT-built module) on the GPU."""

    decode = staticmethod(mamba2_decode)

    def __init__(self, device: str, state_dtype: torch.dtype, gen: torch.Generator):
        self.H, self.G, self.P, self.N = (128, 8, 64, 128) if device == "cuda" else (4, 2, 16, 16)
        self.layout = mamba2_layout(
            num_heads=self.H, ngroups=self.G, headdim=self.P, dstate=self.N, window=WINDOW,
            state_dtype=state_dtype, act_dtype=torch.bfloat16,
        )  # fmt: skip
        self.params = {
            "A": -(0.5 + torch.rand(self.H, generator=gen)),
            "D": torch.randn(self.H, generator=gen),
            "dt_bias": 0.1 * torch.randn(self.H, generator=gen),
        }
        self.options = dict(has_D=True, has_dt_bias=True, dt_softplus=True)

    def token(self, gen: torch.Generator) -> dict[str, torch.Tensor]:
        b = BATCH
        return {
            "x": torch.randn(b, self.H, self.P, generator=gen).to(torch.bfloat16),
            "dt": torch.randn(b, self.H, generator=gen) * 0.5 - 1.0,
            "B": (torch.randn(b, self.G, self.N, generator=gen) / self.N**0.25).to(torch.bfloat16),
            "C": (torch.randn(b, self.G, self.N, generator=gen) / self.N**0.25).to(torch.bfloat16),
        }

    poison_input = "x"  # the input a faulted row's NaN / Inf goes into

    def out_shape(self):
        return (BATCH, self.H, self.P)


class GDN:
    """Small heads on the CPU; qwen3.5-4b's heads (an AOT-built module) on the GPU."""

    decode = staticmethod(gdn_decode)

    def __init__(self, device: str, state_dtype: torch.dtype, gen: torch.Generator):
        self.H, self.HV, self.K, self.V = (16, 32, 128, 128) if device == "cuda" else (2, 4, 16, 16)
        self.layout = gdn_layout(
            num_k_heads=self.H, num_v_heads=self.HV, head_k_dim=self.K, head_v_dim=self.V,
            window=WINDOW, state_dtype=state_dtype, act_dtype=torch.bfloat16,
        )  # fmt: skip
        self.params = {
            "A_log": torch.log(0.5 + torch.rand(self.HV, generator=gen)),
            "dt_bias": 0.5 * torch.rand(self.HV, generator=gen) - 0.25,
        }
        self.options = dict(use_qk_l2norm=True)

    def token(self, gen: torch.Generator) -> dict[str, torch.Tensor]:
        b = BATCH
        return {
            "q": torch.randn(b, self.H, self.K, generator=gen).to(torch.bfloat16),
            "k": torch.randn(b, self.H, self.K, generator=gen).to(torch.bfloat16),
            "v": torch.randn(b, self.HV, self.V, generator=gen).to(torch.bfloat16),
            "a": -4.0 + 3.0 * torch.rand(b, self.HV, generator=gen),
            "b": torch.randn(b, self.HV, generator=gen),
        }

    poison_input = "k"  # a key reaches the state only through the delta rule's correction

    def out_shape(self):
        return (BATCH, self.HV, self.V)


FAMILIES = {"mamba2": Mamba2, "gdn": GDN}


def _pool(case, device: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Every slot tensor, random (so that a stray write shows), cursors zero."""
    tensors = {}
    for t in case.layout.tensors():
        if t.name == "cursors":
            tensors[t.name] = torch.zeros(t.shape(NUM_SLOTS), dtype=t.dtype)
        else:
            tensors[t.name] = torch.randn(t.shape(NUM_SLOTS), generator=gen).to(t.dtype)
    return {name: t.to(device) for name, t in tensors.items()}


def _clone(tensors):
    return {name: t.clone() for name, t in tensors.items()}


def _assert_slots_equal(a, b, slots, what):
    for name in a:
        assert torch.equal(a[name][slots], b[name][slots]), (
            f"{what}: {name} of slots {slots} differ"
        )


def _plan(case, device, kernel, *, check_slot_values=True):
    mode = "conventional" if kernel == "conventional" else "replay"
    config = None if kernel in ("conventional", "auto") else LaunchConfig(kernel=kernel)
    return plan_decode(
        case.layout, BATCH, device=device, mode=mode, config=config,
        check_slot_values=check_slot_values, **case.options,
    )  # fmt: skip


def _kernels(device):
    return GPU_KERNELS if device == "cuda" else ["conventional", "auto"]


@pytest.mark.parametrize(
    "device,state_dtype",
    [
        pytest.param("cpu", torch.float32, id="cpu-f32"),
        pytest.param("cuda", torch.float32, id="cuda-f32", marks=pytest.mark.gpu),
        pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=pytest.mark.gpu),
    ],
)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_nan_and_inf_stay_in_their_row_and_slot(device, family, state_dtype):
    """Over 1,000 steps (100 on the CPU, in FP32 only): NaN inputs in one row, Inf inputs in another (every 7th and 11th step),
    and a NaN / Inf checkpoint in a third row's slot from the start. The other rows' outputs and
    the other slots' tensors match the clean twin bit for bit at every step."""
    gen = torch.Generator().manual_seed(2101)
    case = FAMILIES[family](device, state_dtype, gen)
    params = {k: v.to(device) for k, v in case.params.items()}
    slots = torch.tensor([*LIVE, -1], dtype=torch.int32, device=device)
    faulted_rows = [NAN_ROW, INF_ROW, POISONED_SLOT_ROW]
    clean_rows = [r for r in range(BATCH) if r not in faulted_rows]
    clean_slots = [s for s in range(NUM_SLOTS) if s not in [LIVE[r] for r in faulted_rows]]
    for kernel in _kernels(device):
        plan = _plan(case, device, kernel)
        clean = _pool(case, device, gen)
        faulty = _clone(clean)
        poisoned = LIVE[POISONED_SLOT_ROW]
        faulty["state"][poisoned].view(-1)[::3] = math.nan
        faulty["state"][poisoned].view(-1)[1::3] = math.inf
        out_clean = torch.empty(case.out_shape(), dtype=torch.bfloat16, device=device)
        out_faulty = torch.empty_like(out_clean)
        for step in range(STEPS[device]):
            tok = {k: v.to(device) for k, v in case.token(gen).items()}
            bad = {k: v.clone() for k, v in tok.items()}
            if step % 7 == 0:
                bad[case.poison_input][NAN_ROW] = math.nan
            if step % 11 == 0:
                bad[case.poison_input][INF_ROW] = -math.inf
            out_clean.fill_(math.nan)
            out_faulty.fill_(math.nan)
            case.decode(plan, **clean, **params, **tok, slot_indices=slots, out=out_clean)
            case.decode(plan, **faulty, **params, **bad, slot_indices=slots, out=out_faulty)
            assert torch.equal(out_faulty[clean_rows], out_clean[clean_rows]), (kernel, step)
            assert bool(torch.isfinite(out_clean[clean_rows]).all()), (kernel, step)
        _assert_slots_equal(faulty, clean, clean_slots, kernel)
        # The fault is visible where it was: the poisoned slot's outputs are not all finite.
        assert not bool(torch.isfinite(out_faulty[POISONED_SLOT_ROW]).all()), kernel


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_corrupted_cursor_faults_only_its_row(device, family):
    """A held count no step leaves (the window, the ring capacity, -1, the int32 extremes): the
    row's outputs are NaN and its slot's tensors stay as they were; the rest match the twin in
    which that row is padded."""
    gen = torch.Generator().manual_seed(2102)
    case = FAMILIES[family](device, torch.float32, gen)
    params = {k: v.to(device) for k, v in case.params.items()}
    row = 3
    slots = torch.tensor([*LIVE, -1], dtype=torch.int32, device=device)
    twin_slots = slots.clone()
    twin_slots[row] = -1
    others = [r for r in range(BATCH) if r != row and int(slots[r]) != -1]
    corrupt = [WINDOW, case.layout.capacity, -1, -(2**31), 2**31 - 1]
    for kernel in [k for k in _kernels(device) if k != "conventional"]:
        plan = _plan(case, device, kernel)
        twin = _pool(case, device, gen)
        pool = _clone(twin)
        out = torch.empty(case.out_shape(), dtype=torch.bfloat16, device=device)
        out_twin = torch.empty_like(out)
        for step in range(4 * WINDOW + 1):
            pool["cursors"][LIVE[row], 0] = corrupt[step % len(corrupt)]
            before = _clone(pool)
            tok = {k: v.to(device) for k, v in case.token(gen).items()}
            if device == "cpu":  # eager mode refuses it; the kernels' NaN guard is for graphs
                with pytest.raises(ValueError, match="^cursors: expected a cursor a step leaves"):
                    case.decode(plan, **pool, **params, **tok, slot_indices=slots, out=out)
                _assert_slots_equal(pool, before, list(range(NUM_SLOTS)), f"{kernel} {step}")
                pool["cursors"][LIVE[row], 0] = 0
                continue
            case.decode(plan, **pool, **params, **tok, slot_indices=slots, out=out)
            case.decode(plan, **twin, **params, **tok, slot_indices=twin_slots, out=out_twin)
            assert bool(torch.isnan(out[row]).all()), (kernel, step)
            assert torch.equal(out[others], out_twin[others]), (kernel, step)
            _assert_slots_equal(pool, before, [LIVE[row]], f"{kernel} step {step}")
        if device == "cpu":
            continue
        rest = [s for s in range(NUM_SLOTS) if s != LIVE[row]]
        _assert_slots_equal(pool, twin, rest, kernel)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_out_of_range_slot_id_is_refused_on_the_cpu(family):
    """The CPU path always reads slot ids on the host: an id outside the pool is a ValueError
    naming slot_indices, raised before anything is written."""
    gen = torch.Generator().manual_seed(2103)
    case = FAMILIES[family]("cpu", torch.float32, gen)
    pool = _pool(case, "cpu", gen)
    before = _clone(pool)
    plan = _plan(case, "cpu", "auto")
    out = torch.full(case.out_shape(), math.nan, dtype=torch.bfloat16)
    for bad in (NUM_SLOTS, -2, 2**31 - 1):
        slots = torch.tensor([*LIVE[:-1], bad, -1], dtype=torch.int32)
        with pytest.raises(ValueError, match="slot_indices"):
            case.decode(plan, **pool, **case.params, **case.token(gen), slot_indices=slots, out=out)
    _assert_slots_equal(pool, before, list(range(NUM_SLOTS)), "after refused calls")
    assert bool(torch.isnan(out).all())


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("kernel", GPU_KERNELS)
def test_graph_replay_with_faulted_ids_and_cursors_touches_nothing(family, kernel):
    """A captured step replayed after its slot ids were overwritten with out-of-range ones (past
    the end, negative, int32 extremes) and, in ReplaySSM, one cursor corrupted: those rows' outputs
    are NaN, every other row and slot match an eager twin in which those rows are padded."""
    device = "cuda"
    gen = torch.Generator().manual_seed(2104)
    case = FAMILIES[family](device, torch.float32, gen)
    params = {k: v.to(device) for k, v in case.params.items()}
    plan = _plan(case, device, kernel, check_slot_values=False)
    pool = _pool(case, device, gen)
    twin = _clone(pool)
    tok = {k: v.to(device) for k, v in case.token(gen).items()}
    slots = torch.tensor([*LIVE, -1], dtype=torch.int32, device=device)
    out = torch.empty(case.out_shape(), dtype=torch.bfloat16, device=device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture (loads the module)
        case.decode(plan, **_clone(pool), **params, **tok, slot_indices=slots, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        case.decode(plan, **pool, **params, **tok, slot_indices=slots, out=out)
    replay = kernel != "conventional"
    id_row, cursor_row = 2, 5
    out_twin = torch.empty_like(out)
    for step, bad_id in enumerate([NUM_SLOTS, -2, 2**31 - 1, -(2**31), NUM_SLOTS + 7] * 3):
        fresh = {k: v.to(device) for k, v in case.token(gen).items()}
        for name, t in tok.items():
            t.copy_(fresh[name])
        faulted = [id_row] + ([cursor_row] if replay else [])
        slots.copy_(torch.tensor([*LIVE, -1], dtype=torch.int32))
        slots[id_row] = bad_id
        if replay:
            pool["cursors"][LIVE[cursor_row], 0] = WINDOW + step
        twin_slots = torch.tensor([*LIVE, -1], dtype=torch.int32, device=device)
        twin_slots[faulted] = -1
        before = _clone(pool)
        out.fill_(math.nan)
        graph.replay()
        case.decode(plan, **twin, **params, **tok, slot_indices=twin_slots, out=out_twin)
        torch.cuda.synchronize()
        assert bool(torch.isnan(out[faulted]).all()), (step, bad_id)
        others = [r for r in range(BATCH) if r not in faulted]
        assert torch.equal(out[others], out_twin[others]), (step, bad_id)
        if replay:
            _assert_slots_equal(pool, before, [LIVE[cursor_row]], f"step {step}")
    rest = [s for s in range(NUM_SLOTS) if not (replay and s == LIVE[cursor_row])]
    _assert_slots_equal(pool, twin, rest, kernel)
