"""The functional ops on tensors a test allocates from the layout description, with no cache
object: the engine path. CPU tensors run the PyTorch path; the float64 oracles are the truth."""

from __future__ import annotations

import pytest
import torch
from support.checks import rel_err

from replayssm_jit import (
    LaunchConfig,
    gdn_decode,
    gdn_layout,
    mamba2_decode,
    mamba2_layout,
    plan_decode,
)
from replayssm_jit.reference import gdn_gates, gdn_step_pool, mamba2_step_pool

WINDOW = 4
STEPS = 3 * WINDOW + 2  # at least three flush cycles


def _engine_tensors(layout, num_slots, gen):
    """What an engine would do: allocate every per-slot tensor from the layout (here random
    bits, so untouched slots are visible), then zero the cursors of the live slots."""
    tensors = {}
    for t in layout.tensors():
        if t.dtype == torch.int32:
            tensors[t.name] = torch.zeros(t.shape(num_slots), dtype=t.dtype)
        else:
            tensors[t.name] = torch.randn(t.shape(num_slots), generator=gen).to(t.dtype)
    return tensors


class Mamba2Case:
    layout = staticmethod(lambda: mamba2_layout(num_heads=4, headdim=16, dstate=16, ngroups=2,
                                                window=WINDOW, act_dtype=torch.float32))  # fmt: skip
    decode = staticmethod(mamba2_decode)

    def __init__(self, gen):
        self.A = -(0.5 + torch.rand(4, generator=gen))
        self.D, self.dt_bias = torch.randn(4, generator=gen), torch.randn(4, generator=gen) * 0.1

    def token(self, batch, gen):
        return {
            "x": torch.randn(batch, 4, 16, generator=gen),
            "dt": torch.randn(batch, 4, generator=gen),
            "B": torch.randn(batch, 2, 16, generator=gen),
            "C": torch.randn(batch, 2, 16, generator=gen),
        }

    def op_inputs(self, tok):
        return {**tok, "A": self.A, "D": self.D, "dt_bias": self.dt_bias}

    def reference(self, pool, slots, tok):
        return mamba2_step_pool(  # (updates the pool in place)
            pool, slots, **tok, A=self.A, D=self.D, dt_bias=self.dt_bias, dt_softplus=True
        )


class GDNCase:
    layout = staticmethod(lambda: gdn_layout(num_k_heads=2, num_v_heads=4, head_k_dim=16,
                                             head_v_dim=16, window=WINDOW, act_dtype=torch.float32))  # fmt: skip
    decode = staticmethod(gdn_decode)

    def __init__(self, gen):
        self.A_log = torch.log(torch.rand(4, generator=gen) * 4 + 0.5)
        self.dt_bias = torch.randn(4, generator=gen) * 0.1

    def token(self, batch, gen):
        return {
            "q": torch.randn(batch, 2, 16, generator=gen),
            "k": torch.randn(batch, 2, 16, generator=gen),
            "v": torch.randn(batch, 4, 16, generator=gen),
            "a": torch.randn(batch, 4, generator=gen),
            "b": torch.randn(batch, 4, generator=gen),
        }

    def op_inputs(self, tok):
        return {**tok, "A_log": self.A_log, "dt_bias": self.dt_bias}

    def reference(self, pool, slots, tok):
        g, beta = gdn_gates(self.A_log, tok["a"], self.dt_bias, tok["b"])
        return gdn_step_pool(pool, slots, tok["q"], tok["k"], tok["v"], g, beta)


@pytest.mark.parametrize("case_cls", [Mamba2Case, GDNCase], ids=["mamba2", "gdn"])
@pytest.mark.parametrize("kernel", ["auto", "flush-every-step"])
def test_ops_on_tensors_allocated_from_the_layout(case_cls, kernel):
    gen = torch.Generator().manual_seed(7)
    case = case_cls(gen)
    layout = case.layout()
    num_slots, batch = 9, 5
    tensors = _engine_tensors(layout, num_slots, gen)
    live = torch.tensor([6, 1, 3, 8], dtype=torch.int32)
    slots = torch.cat([live, torch.tensor([-1], dtype=torch.int32)])  # the last row is padding
    init = torch.randn((len(live), *tensors["state"].shape[1:]), generator=gen)
    tensors["state"][live.long()] = init
    untouched = [s for s in range(num_slots) if s not in live.tolist()]
    before = {name: t[untouched].clone() for name, t in tensors.items()}
    pool = tensors["state"].double().clone()

    plan = plan_decode(layout, batch, device="cpu", config=LaunchConfig(kernel=kernel))
    assert plan.backend == "cpu" and plan.module is None and plan.workspace_floats == 0
    out = torch.full((batch, layout.shape.value_heads, layout.shape.value_dim), float("nan"))
    flushes = 0
    for _ in range(STEPS):
        tok = case.token(batch, gen)
        epochs = tensors["cursors"][live.long(), 1].clone()
        out.fill_(float("nan"))
        case.decode(plan, **tensors, **case.op_inputs(tok), slot_indices=slots, out=out)
        flushes += int((tensors["cursors"][live.long(), 1] - epochs).sum())
        ref = case.reference(pool, slots.long(), tok)
        assert torch.isfinite(out).all()
        assert rel_err(out[:4], ref[:4]) < 1e-5
        assert torch.equal(out[4], torch.zeros_like(out[4]))  # pad row: exact zeros
    # Live checkpoints equal the reference where the last step flushed (flush-every-step: always).
    held = tensors["cursors"][live.long(), 0]
    if kernel == "flush-every-step":
        assert torch.equal(held, torch.zeros_like(held)) and flushes == STEPS * len(live)
        assert rel_err(tensors["state"][live.long()], pool[live.long()]) < 1e-5
    else:
        assert flushes == len(live) * (STEPS // WINDOW)
        assert torch.equal(held, torch.full_like(held, STEPS % WINDOW))
    assert torch.equal(tensors["cursors"][:, 2], torch.zeros(num_slots, dtype=torch.int32))
    for name, t in tensors.items():  # slots no row names stay bit-identical
        assert torch.equal(t[untouched], before[name]), name


@pytest.mark.parametrize("case_cls", [Mamba2Case, GDNCase], ids=["mamba2", "gdn"])
def test_a_failed_op_changes_nothing(case_cls):
    gen = torch.Generator().manual_seed(3)
    case = case_cls(gen)
    layout = case.layout()
    tensors = _engine_tensors(layout, 4, gen)
    plan = plan_decode(layout, 2, device="cpu")
    snapshot = {k: v.clone() for k, v in tensors.items()}
    tok = case.op_inputs(case.token(2, gen))
    out = torch.full((2, layout.shape.value_heads, layout.shape.value_dim), 7.0)
    bad_cursors = tensors["cursors"][:3]  # fewer slots than the state pool
    with pytest.raises(ValueError, match=r"^cursors: expected 4 slots \(as state\), got 3"):
        case.decode(plan, **{**tensors, "cursors": bad_cursors}, **tok,
                    slot_indices=torch.tensor([0, 1], dtype=torch.int32), out=out)  # fmt: skip
    with pytest.raises(ValueError, match=r"^slot_indices: expected values in \[0, 4\)"):
        case.decode(plan, **tensors, **tok, slot_indices=torch.tensor([0, 4], dtype=torch.int32),
                    out=out)  # fmt: skip
    ring = layout.ring_names[0]
    with pytest.raises(TypeError, match=rf"^{ring}: expected dtype"):
        case.decode(plan, **{**tensors, ring: tensors[ring].double()}, **tok,
                    slot_indices=torch.tensor([0, 1], dtype=torch.int32), out=out)  # fmt: skip
    with pytest.raises(TypeError, match="^cursors: expected a torch.Tensor, got NoneType"):
        case.decode(plan, **{**tensors, "cursors": None}, **tok,
                    slot_indices=torch.tensor([0, 1], dtype=torch.int32), out=out)  # fmt: skip
    for name, t in tensors.items():
        assert torch.equal(t, snapshot[name]), name
    assert torch.equal(out, torch.full_like(out, 7.0))


def test_layout_describes_every_slot_tensor():
    m = mamba2_layout(num_heads=128, headdim=64, dstate=128, ngroups=8, window=16, drafts=2)
    assert [(t.name, t.per_slot_shape, t.dtype) for t in m.tensors()] == [
        ("state", (128, 64, 128), torch.float32),
        ("rec_x", (128, 18, 64), torch.bfloat16),
        ("rec_b", (8, 18, 128), torch.bfloat16),
        ("rec_dt", (128, 18), torch.float32),
        ("cursors", (4,), torch.int32),
    ]
    g = gdn_layout(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128,
                   state_dtype="bf16")  # fmt: skip
    assert [(t.name, t.per_slot_shape, t.dtype) for t in g.tensors()] == [
        ("state", (32, 128, 128), torch.bfloat16),
        ("rec_u", (32, 17, 128), torch.float32),
        ("rec_k", (16, 17, 128), torch.bfloat16),
        ("rec_g", (32, 17), torch.float32),
        ("cursors", (4,), torch.int32),
    ]
    assert (
        g.bytes_per_slot()
        == 32 * 128 * 128 * 2 + 32 * 17 * 128 * 4 + 16 * 17 * 128 * 2 + 32 * 17 * 4 + 16
    )
    allocated = g.allocate(3, "cpu")
    assert {k: tuple(v.shape) for k, v in allocated.items()} == {
        t.name: t.shape(3) for t in g.tensors()
    }
