"""Prefix caching (issue 20, section 4): materialize_slots gives a slot's exact FP32 state at any
position without changing anything, and a slot loaded with it (reset_slots) decodes on as the
original does. The CPU path runs in CI; the same tests run the kernels on a GPU."""

from __future__ import annotations

import pytest
import torch
from support.checks import rel_err
from support.verify_schedule import GDNFamily, KDAFamily, Mamba2Family

from replayssm_jit import LaunchConfig, materialize_slots, plan_decode, reset_slots

pytestmark = pytest.mark.usefixtures("no_launch_env")


SMALL = {
    "mamba2": Mamba2Family(6, 16, 32, 3),
    "gdn": GDNFamily(2, 4, 32, 32),
    "kda": KDAFamily(2, 4, 32, 32),
}
MODELS = {
    "mamba2": Mamba2Family(128, 64, 128, 8),
    "gdn": GDNFamily(16, 32, 128, 128),
    "kda": KDAFamily(32, 32, 128, 128),
}
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


def _family(name, device):
    return (SMALL if device == "cpu" else MODELS)[name]


def _setup(name, device, L, batch, seed):
    fam, dev = _family(name, device), torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    layout = fam.layout(L, 1, torch.float32, act_dtype=torch.float32)
    params = fam.params(gen, dev)
    return fam, dev, gen, layout, params


def _windowed_plan(layout, batch, dev):
    """A replay plan that keeps records in the window: the launch policy may pick the
    flush-every-step kernel for small GPU batches, whose cursor never leaves 0."""
    return plan_decode(layout, batch, device=dev, config=LaunchConfig(kernel="per-item"))


def _step(fam, plan, tensors, params, gen, dev, slots):
    token = {k: v[:, 0] for k, v in fam.drafts(len(slots), 1, gen, dev, torch.float32).items()}
    return token, fam.decode_op()(plan, **tensors, **params, **token, slot_indices=slots)


def _decode_with(fam, plan, tensors, params, token, slots):
    return fam.decode_op()(plan, **tensors, **params, **token, slot_indices=slots)


def _fold_params(name, params):
    return {"A": params["A"]} if name == "mamba2" else {}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["mamba2", "gdn", "kda"])
@pytest.mark.parametrize("L,steps", [(4, 3), (4, 4), (16, 37)])
def test_materialize_is_the_conventional_state_and_changes_nothing(device, name, L, steps):
    fam, dev, gen, layout, params = _setup(name, device, L, 3, seed=L + steps)
    batch = 3
    replay, conv = layout.allocate(batch + 1, dev), layout.allocate(batch + 1, dev)
    slots = torch.arange(1, batch + 1, dtype=torch.int32, device=dev)
    init = 0.3 * torch.randn((batch, *fam.state_shape()), generator=gen, device=dev)
    reset_slots(layout, replay, slots, init)
    reset_slots(layout, conv, slots, init)
    plan = _windowed_plan(layout, batch, dev)
    cplan = plan_decode(layout, batch, device=dev, mode="conventional")
    for _ in range(steps):
        token, _ = _step(fam, plan, replay, params, gen, dev, slots)
        _decode_with(fam, cplan, conv, params, token, slots)
    held = replay["cursors"][slots.long(), 0]
    assert held.tolist() == [steps % L] * batch  # (the case's position in its window)
    before = {k: v.clone() for k, v in replay.items()}
    got = materialize_slots(plan, replay, slots, **_fold_params(name, params))
    assert got.dtype == torch.float32 and got.shape == (batch, *fam.state_shape())
    assert rel_err(got, conv["state"][slots.long()]) < 1e-5
    for k, v in replay.items():
        assert torch.equal(v, before[k]), k  # nothing written, bit for bit
    # Repeated ids and a list of ints give the same rows.
    again = materialize_slots(plan, replay, [3, 1, 3], **_fold_params(name, params))
    assert torch.equal(again, got[[2, 0, 2]])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["mamba2", "gdn", "kda"])
def test_a_loaded_prefix_decodes_on_as_the_original(device, name):
    """Materialize at position p (mid-window), load into fresh slots, decode both on with the
    same tokens: outputs and states agree to 1e-5 at every step, across several flushes."""
    L, p, q, batch = 4, 6, 13, 2
    fam, dev, gen, layout, params = _setup(name, device, L, batch, seed=11)
    tensors = layout.allocate(2 * batch, dev)
    orig = torch.arange(batch, dtype=torch.int32, device=dev)
    copy = torch.arange(batch, 2 * batch, dtype=torch.int32, device=dev)
    reset_slots(layout, tensors, orig, 0.3 * torch.randn((batch, *fam.state_shape()),
                                                         generator=gen, device=dev))  # fmt: skip
    plan = _windowed_plan(layout, batch, dev)
    for _ in range(p):
        _step(fam, plan, tensors, params, gen, dev, orig)
    prefix = materialize_slots(plan, tensors, orig, **_fold_params(name, params))
    reset_slots(layout, tensors, copy, prefix)
    assert tensors["cursors"][orig.long(), 0].tolist() == [p % L] * batch
    for step in range(q):
        token, y = _step(fam, plan, tensors, params, gen, dev, orig)
        y_loaded = _decode_with(fam, plan, tensors, params, token, copy)
        assert rel_err(y_loaded, y) < 1e-5, step
    a = materialize_slots(plan, tensors, orig, **_fold_params(name, params))
    b = materialize_slots(plan, tensors, copy, **_fold_params(name, params))
    assert rel_err(b, a) < 1e-5


def test_a_broken_fold_is_caught():
    """The first test can fail: folding the held records in the wrong order (or dropping one)
    leaves the materialized state far from the conventional one."""
    fam, dev, gen, layout, params = _setup("mamba2", "cpu", 16, 2, seed=3)
    tensors = layout.allocate(2, dev)
    slots = torch.arange(2, dtype=torch.int32)
    reset_slots(layout, tensors, slots, 0.3 * torch.randn((2, *fam.state_shape()), generator=gen))
    plan = plan_decode(layout, 2, device=dev)
    for _ in range(9):
        _step(fam, plan, tensors, params, gen, dev, slots)
    good = materialize_slots(plan, tensors, slots, A=params["A"])
    tensors["cursors"][:, 0] -= 1  # one record fewer folded
    dropped = materialize_slots(plan, tensors, slots, A=params["A"])
    assert rel_err(dropped, good) > 1e-3


def test_materialize_checks_its_arguments_and_changes_nothing():
    fam, dev, gen, layout, params = _setup("mamba2", "cpu", 4, 2, seed=5)
    tensors = layout.allocate(3, dev)
    slots = torch.arange(2, dtype=torch.int32)
    reset_slots(layout, tensors, slots)
    plan = plan_decode(layout, 2, device=dev)
    _step(fam, plan, tensors, params, gen, dev, slots)
    before = {k: v.clone() for k, v in tensors.items()}
    with pytest.raises(TypeError, match="A"):
        materialize_slots(plan, tensors, slots)  # Mamba-2 needs A
    with pytest.raises(TypeError, match="A: expected"):
        materialize_slots(plan, tensors, slots, A=params["A"].double())
    with pytest.raises(TypeError, match="D"):
        materialize_slots(plan, tensors, slots, A=params["A"], D=params["D"])
    with pytest.raises(ValueError, match="slots"):
        materialize_slots(plan, tensors, [0, 3], A=params["A"])
    with pytest.raises(TypeError, match="plan"):
        materialize_slots(layout, tensors, slots, A=params["A"])
    tensors["cursors"][2, 0] = 99  # a cursor no step leaves
    with pytest.raises(ValueError, match="got 99 in slot 2"):
        materialize_slots(plan, tensors, [2], A=params["A"])
    tensors["cursors"][2, 0] = 0
    for k, v in tensors.items():
        assert torch.equal(v, before[k]), k
    _, _, _, glayout, _ = _setup("gdn", "cpu", 4, 2, seed=6)
    gtensors = glayout.allocate(2, dev)
    gplan = plan_decode(glayout, 2, device=dev)
    with pytest.raises(TypeError, match="A"):
        materialize_slots(gplan, gtensors, [0], A=params["A"])  # GDN's records carry their decays
