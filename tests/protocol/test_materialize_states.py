"""materialize_states (issue 36, item 3): the engines' batched prefix states over a [layers, batch]
slot table give, row for row, the same bits as materialize_slots, for every family and checkpoint
format (a read copy included: both read the carried copy); pad rows keep their bits; a fold in
the wrong record order is caught; a failed call changes nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.checks import rel_err

from replayssm_jit import materialize_slots, materialize_states, plan_decode, reset_slots
from replayssm_jit.families import get_family
from replayssm_jit.families.layout import family_layout
from replayssm_jit.ops import registry
from replayssm_jit.ops.prefix import materialize_states_cuda
from replayssm_jit.ops.torch_path.checkpoint import Copy, store_state

pytestmark = pytest.mark.usefixtures("no_launch_env")

SHAPES = {
    "mamba2": dict(num_heads=6, headdim=32, dstate=32, ngroups=3),
    "gdn": dict(num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=32),
    "kda": dict(num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=32),
}
# (state_dtype, read_dtype): every carried format alone, and an FP32 carried copy with each
# read copy (KDA has no separate mode).
FORMATS = [
    ("f32", None),
    ("bf16", None),
    ("f16", None),
    ("e4m3", None),
    ("nvfp4", None),
    ("f32", "bf16"),
    ("f32", "e4m3"),
    ("f32", "nvfp4"),
]
CASES = [
    pytest.param(name, state, read, id=f"{name}-{state}-{read or 'noread'}")
    for name in SHAPES
    for state, read in FORMATS
    if not (name == "kda" and read)
]
NUM_SLOTS, LAYERS, BATCH = 7, 2, 9


def _layout(name, state, read):
    # CAP = 6 rows either way: drafts where the format takes them (a draft row holds records
    # too), a longer window where it does not.
    window, drafts = (4, 2) if read is None and state in ("f32", "bf16", "f16") else (5, 1)
    return family_layout(name, window=window, drafts=drafts, state_dtype=state,
                         read_dtype=read, act_dtype=torch.bfloat16, **SHAPES[name])  # fmt: skip


def _ring_values(name: str, ring: torch.Tensor, gen) -> torch.Tensor:
    """Random records of a ring's kind: positive dt, negative log-decays, betas in (0, 1)."""
    u = torch.rand(ring.shape, generator=gen)
    if name == "rec_dt":
        return 0.05 + 0.5 * u
    if name == "rec_g":
        return -0.5 * u
    if name == "rec_beta":
        return u
    return 0.5 * torch.randn(ring.shape, generator=gen)


def _random_pool(layout, gen, dev):
    """A fresh pool: random checkpoints (and a different random read copy), random records in
    every ring row and cursors holding 0..CAP-1 records (drawn on the CPU)."""
    pool = layout.allocate(NUM_SLOTS, dev)
    state_shape = _state_shape(layout)
    slots = torch.arange(NUM_SLOTS, dtype=torch.int32, device=dev)
    reset_slots(layout, pool, slots, 0.3 * torch.randn(state_shape, generator=gen))
    read = Copy.named(pool, "read")
    if read is not None:  # a read copy unlike the carried one: reading it would show
        values = 0.3 * torch.randn(state_shape, generator=gen)
        store_state(read, slots.long(), values.to(dev), None)
    for name in layout.ring_names:
        pool[name].copy_(_ring_values(name, pool[name], gen).to(pool[name].dtype))
    held = (torch.randperm(NUM_SLOTS, generator=gen) % layout.capacity).int()  # every count
    pool["cursors"][:, 0] = held.to(dev)
    return pool


def _state_shape(layout):
    codes = layout.tensors()[0]
    per_slot = list(codes.per_slot_shape)
    if layout.state_dtype == torch.float4_e2m1fn_x2:
        per_slot[-1] *= 2
    return (NUM_SLOTS, *per_slot)


def _params(name, layout, gen, dev):
    if name != "mamba2":
        return {}
    return {"A": -(0.5 + 1.5 * torch.rand(layout.shape.value_heads, generator=gen)).to(dev)}


def _setup(name, state, read, seed, device="cpu"):
    gen, dev = torch.Generator().manual_seed(seed), torch.device(device)
    layout = _layout(name, state, read)
    plan = plan_decode(layout, BATCH, device=dev)
    pools = [_random_pool(layout, gen, dev) for _ in range(LAYERS)]
    params = [_params(name, layout, gen, dev) for _ in range(LAYERS)]
    # Per layer: a pad, a repeat of slot 3, then every slot (so every held count) in random order.
    table = torch.full((LAYERS, BATCH), -1, dtype=torch.int32)
    table[:, 1] = 3
    for layer in range(LAYERS):
        table[layer, 2:] = torch.randperm(NUM_SLOTS, generator=gen)
    out = torch.randn((LAYERS, BATCH, *_state_shape(layout)[1:]), generator=gen)
    return plan, pools, params, table.to(dev), out.to(dev)


def _mismatches(plan, pools, params, table, out) -> list[str]:
    """Rows of materialize_states' output that differ in any bit from materialize_slots' (pad
    rows from what they held before)."""
    before = out.clone()
    materialize_states(plan, pools, table, out, params)
    bad = []
    for layer, (pool, given) in enumerate(zip(pools, params)):
        for b, slot in enumerate(table[layer].tolist()):
            want = before[layer, b] if slot < 0 else materialize_slots(plan, pool, [slot],
                                                                       **given)[0]  # fmt: skip
            if not torch.equal(out[layer, b], want):
                bad.append(f"layer {layer} row {b} slot {slot}")
    return bad


@pytest.mark.parametrize("name,state,read", CASES)
def test_the_same_bits_as_materialize_slots_and_nothing_written(single_thread, name, state, read):
    plan, pools, params, table, out = _setup(name, state, read, seed=len(name) + len(state))
    held = torch.stack([p["cursors"][:, 0] for p in pools])
    assert set(held.flatten().tolist()) == set(range(plan.layout.capacity))  # 0..CAP-1 held
    snapshot = [{k: v.clone() for k, v in p.items()} for p in pools]
    assert _mismatches(plan, pools, params, table, out) == []
    for pool, saved in zip(pools, snapshot):
        for k, v in pool.items():
            assert torch.equal(v.view(torch.uint8), saved[k].view(torch.uint8)), k


def test_a_fold_in_reverse_record_order_is_caught(single_thread, monkeypatch):
    """The first test can fail: a fold_rows that folds the held records last to first gives
    other bits than materialize_slots."""
    plan, pools, params, table, out = _setup("gdn", "f32", None, seed=2)
    fam = get_family("gdn")
    good = registry.FAMILY_OPS[fam]

    def reversed_fold(plan, tensors, rows, held, params):
        # Each row's held records last to first: position p reads record held - 1 - p.
        position = torch.arange(plan.layout.capacity)
        source = torch.where(position < held[:, None], held[:, None] - 1 - position, position)
        flipped = dict(tensors)
        for name in plan.layout.ring_names:
            ring = tensors[name][rows]
            index = source.view(len(rows), 1, -1, *[1] * (ring.dim() - 3)).expand_as(ring)
            flipped[name] = tensors[name].clone().index_copy_(0, rows, ring.gather(2, index))
        return good.fold_rows(plan, flipped, rows, held, params)

    monkeypatch.setitem(registry.FAMILY_OPS, fam,
                        dataclasses.replace(good, fold_rows=reversed_fold))  # fmt: skip
    assert _mismatches(plan, pools, params, table, out) != []


def test_a_failed_call_changes_nothing(single_thread):
    plan, pools, params, table, out = _setup("mamba2", "f32", None, seed=4)
    before = out.clone()
    wrong = [
        (dict(slot_table=table.long()), TypeError, "slot_table: expected dtype torch.int32"),
        (dict(slot_table=table[:1]), ValueError, "slot_table: expected shape [2, *]"),
        (dict(params=[params[0], {}]), TypeError, "params[1]: expected A"),
        (dict(out=out[:, :3]), ValueError, "out[0]: expected shape [9,"),
        (dict(slot_table=torch.where(table == 3, NUM_SLOTS, table).int()), ValueError,
         f"slot_table[0, 1]: expected a pad (negative) or a slot in [0, {NUM_SLOTS}), got 7"),
    ]  # fmt: skip
    for change, error, message in wrong:
        args = dict(plans=plan, pools=pools, slot_table=table, out=out, params=params) | change
        with pytest.raises(error, match=message.replace("[", r"\[").replace("(", r"\(")
                           .replace(")", r"\)").replace("*", r"\*")):  # fmt: skip
            materialize_states(**args)
        assert torch.equal(out, before)
    pools[1]["cursors"][5, 0] = plan.layout.capacity  # a corrupted cursor in the last layer
    with pytest.raises(ValueError, match="expected cursors holding 0..5 records, got 6"):
        materialize_states(plan, pools, table, out, params)
    assert torch.equal(out, before)  # the first layer was not written either


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(SHAPES))
def test_on_cuda_no_sync_and_capturable(name):
    """On a GPU (not yet run): no host sync (sync debug mode raises on one), a CUDA graph
    replays it, and every row is within FP32 rounding of materialize_slots' (bits on the CPU
    path only: cuBLAS may pick another kernel for CAP-1 records than for a slot's own count)."""
    plan, pools, params, table, out = _setup(name, "f32", "e4m3" if name != "kda" else None,
                                             seed=7, device="cuda")  # fmt: skip
    before = out.clone()
    materialize_states(plan, pools, table, out, params)  # warm-up, outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        materialize_states(plan, pools, table, out, params)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    eager = out.clone()
    out.copy_(before)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        materialize_states(plan, pools, table, out, params)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    for layer, (pool, given) in enumerate(zip(pools, params)):
        for b, slot in enumerate(table[layer].tolist()):
            if slot < 0:
                assert torch.equal(out[layer, b], before[layer, b])
            else:
                want = materialize_slots(plan, pool, [slot], **given)[0]
                assert rel_err(out[layer, b], want) < 1e-6, (layer, b, slot)


@pytest.mark.gpu
@pytest.mark.parametrize("name,state,read", CASES)
def test_the_kernel_agrees_with_materialize_slots(name, state, read):
    """The module binding (not yet run on a GPU): each row within FP32 rounding of
    materialize_slots' (it folds the records one by one), pad rows keep their bits."""
    plan, pools, params, table, out = _setup(name, state, read, seed=9, device="cuda")
    before = out.clone()
    materialize_states_cuda(plan, pools, table, out, params)
    for layer, (pool, given) in enumerate(zip(pools, params)):
        for b, slot in enumerate(table[layer].tolist()):
            if slot < 0:
                assert torch.equal(out[layer, b], before[layer, b])
            else:
                want = materialize_slots(plan, pool, [slot], **given)[0]
                assert rel_err(out[layer, b], want) < 1e-5, (layer, b, slot)
