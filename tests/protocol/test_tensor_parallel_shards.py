"""Tensor-parallel head shards (issue 20, section 5): the heads of every family split into 2, 4
and 8 shards, each with its own layout, plan and ops as a rank would hold them, give outputs and
states bit-identical to the unsharded run. Shards run as separate calls on one device (the
multi-GPU machines are not lent); the launch choices are fixed so that every shard runs the
kernel and tile the unsharded step does."""

from __future__ import annotations

import pytest
import torch
from support.verify_schedule import GDNFamily, KDAFamily, Mamba2Family

from replayssm_jit import LaunchConfig, plan_decode, reset_slots

pytestmark = pytest.mark.usefixtures("no_launch_env")

# Key heads (Mamba-2 groups, GDN key heads) divisible by 8; two value heads per key head.
FAMILIES = {
    "mamba2": Mamba2Family(16, 16, 32, 8),
    "gdn": GDNFamily(8, 16, 32, 32),
    "kda": KDAFamily(8, 16, 32, 32),
}
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]
# Which tensors split along value heads and which along key heads, with their head dim.
VALUE_SPLIT = {"A": 0, "D": 0, "dt_bias": 0, "A_log": 0, "x": 1, "dt": 1, "v": 1, "a": 1, "b": 1}
KEY_SPLIT = {"B": 1, "C": 1, "q": 1, "k": 1}


def shard_family(fam, n: int):
    if isinstance(fam, Mamba2Family):
        return Mamba2Family(fam.H // n, fam.P, fam.N, fam.G // n)
    return type(fam)(fam.H // n, fam.HV // n, fam.K, fam.V)


def take(tensors: dict, i: int, n: int) -> dict:
    """Shard i of n of each named input (along its head dim)."""
    out = {}
    for name, t in tensors.items():
        dim = VALUE_SPLIT.get(name, KEY_SPLIT.get(name))
        out[name] = t.chunk(n, dim=dim)[i].contiguous()
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("shards", [2, 4, 8])
@pytest.mark.parametrize("mode", ["replay", "conventional"])
def test_head_shards_are_bit_identical_to_the_whole(device, name, shards, mode):
    fam, dev, batch, L, steps = FAMILIES[name], torch.device(device), 3, 4, 11
    gen = torch.Generator(device=dev).manual_seed(shards)
    config = LaunchConfig(kernel="per-item", rows_per_cta=16) if mode == "replay" else None
    layout = fam.layout(L, 1, torch.float32, act_dtype=torch.float32)
    slots = torch.tensor([2, 0, 3], dtype=torch.int32, device=dev)
    init = 0.3 * torch.randn((batch, *fam.state_shape()), generator=gen, device=dev)
    whole = layout.allocate(4, dev)
    reset_slots(layout, whole, slots, init)
    plan = plan_decode(layout, batch, device=dev, mode=mode, config=config)
    parts = []
    for i in range(shards):
        sub = shard_family(fam, shards)
        sub_layout = sub.layout(L, 1, torch.float32, act_dtype=torch.float32)
        tensors = sub_layout.allocate(4, dev)
        reset_slots(sub_layout, tensors, slots, init.chunk(shards, dim=1)[i])
        sub_plan = plan_decode(sub_layout, batch, device=dev, mode=mode, config=config)
        parts.append((tensors, sub_plan))
    params = fam.params(gen, dev)
    op = fam.decode_op()
    for step in range(steps):
        token = {k: v[:, 0] for k, v in fam.drafts(batch, 1, gen, dev, torch.float32).items()}
        y = op(plan, **whole, **params, **token, slot_indices=slots)
        ys = [
            op(sub_plan, **tensors, **take(params, i, shards), **take(token, i, shards),
               slot_indices=slots)
            for i, (tensors, sub_plan) in enumerate(parts)
        ]  # fmt: skip
        assert torch.equal(torch.cat(ys, dim=1), y), step
    for key in whole:
        if key == "cursors":
            for tensors, _ in parts:
                assert torch.equal(tensors[key], whole[key])
            continue
        # Every slot tensor is [slots, heads, ...]: the shards' heads in order make the whole.
        assert torch.equal(torch.cat([t[key] for t, _ in parts], dim=1), whole[key]), key
