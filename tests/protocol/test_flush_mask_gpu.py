"""The flush mask on the kernels (issue 36, item 2; marked gpu): every decode kernel that
decides a step (per-item with and without speculative ring loads, split with each records-warp
count a family compiles, flush-every-step) steps rows under random masks beside the torch path
(the CPU op on copies of the same tensors): outputs and checkpoints agree to FP32 rounding (a
BF16 checkpoint to its rounding), cursors exactly; pad rows get zeros, and slots no row names
stay bit for bit. A captured CUDA graph then replays with the mask's values changed between
replays, as SGLang's graphs do, and gives the eager kernels' bits."""

from __future__ import annotations

import pytest
import torch
from support.checks import rel_err
from support.verify_schedule import GDNFamily, KDAFamily, Mamba2Family

from replayssm_jit import LaunchConfig, plan_decode, reset_slots

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_launch_env")]

FAMILIES = {
    "mamba2": Mamba2Family(16, 64, 128, 2),
    "gdn": GDNFamily(2, 4, 128, 128),
    "kda": KDAFamily(4, 4, 128, 128),
}
L, STEPS = 8, 2 * 8 + 3
ROW_SLOTS = [1, 2, -1, 3, 4, 5]  # a pad row among them; slots 0 and 6 never named
NUM_SLOTS = 7
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-3}
# Outputs: FP32 summation order; with BF16 checkpoints also a rounding that may fall either side
# of a tie-close value on the two paths (one bf16 step in a few elements).
OUT_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-3}


def _configs():
    """(family, LaunchConfig, state dtype): every decode kernel choice of each family."""
    for name in FAMILIES:
        warps = (8,) if name == "mamba2" else (8, 4)
        configs = [LaunchConfig(kernel="per-item", speculative_records=True),
                   LaunchConfig(kernel="per-item", speculative_records=False),
                   *(LaunchConfig(kernel="split", records_warps=w) for w in warps)]  # fmt: skip
        for config in configs:
            for dtype in (torch.float32, torch.bfloat16):
                yield pytest.param(name, config, dtype, id=f"{name}-{_config_id(config)}-{dtype}")
        yield pytest.param(name, LaunchConfig(kernel="flush-every-step"), torch.float32,
                           id=f"{name}-flush-every-step")  # fmt: skip


def _config_id(config):
    if config.kernel == "split":
        return f"split-w{config.records_warps}"
    return f"per-item-spec{int(config.speculative_records)}"


def _setup(name, state_dtype, seed):
    fam = FAMILIES[name]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    layout = fam.layout(L, 1, state_dtype, act_dtype=torch.float32)
    pool = layout.allocate(NUM_SLOTS, "cuda")
    for ring in layout.ring_names:
        pool[ring].fill_(float("nan"))
    init = 0.3 * torch.randn((NUM_SLOTS, *fam.state_shape()), generator=gen, device="cuda")
    reset_slots(layout, pool, list(range(NUM_SLOTS)), init)
    params = fam.params(gen, "cuda")
    return fam, gen, layout, pool, params


def _token(fam, gen):
    drafts = fam.drafts(len(ROW_SLOTS), 1, gen, "cuda", torch.float32)
    return {k: v[:, 0] for k, v in drafts.items()}


@pytest.mark.parametrize("name,config,state_dtype", list(_configs()))
def test_kernels_follow_the_mask_as_the_torch_path_does(name, config, state_dtype):
    fam, gen, layout, pool, params = _setup(name, state_dtype, seed=3)
    cpu = {k: v.to("cpu", copy=True) for k, v in pool.items()}  # the torch path's twin
    kept = {k: v[[0, NUM_SLOTS - 1]].clone() for k, v in pool.items()}
    batch = len(ROW_SLOTS)
    plan = plan_decode(layout, batch, device="cuda", flush_mask=True, config=config)
    # The torch path steps split and per-item alike; flush-every-step it takes from the plan.
    every = config.kernel == "flush-every-step"
    twin_config = LaunchConfig(kernel="flush-every-step" if every else "per-item")
    twin = plan_decode(layout, batch, device="cpu", flush_mask=True, config=twin_config)
    assert plan.kernel == config.kernel and twin.kernel == twin_config.kernel
    workspace = torch.empty(plan.workspace_floats, device="cuda")
    slots = torch.tensor(ROW_SLOTS, dtype=torch.int32, device="cuda")
    masks = torch.rand(STEPS, batch, generator=gen, device="cuda") < 0.3
    masks[:, 2] = True  # the pad row's byte is never read
    op = fam.decode_op()
    flushes = 0
    for step in range(STEPS):
        token = _token(fam, gen)
        held = pool["cursors"][:, 0].clone()
        out = op(plan, **pool, **params, **token, slot_indices=slots, workspace=workspace,
                 flush_mask=masks[step])  # fmt: skip
        want = op(twin, **cpu, **{k: v.cpu() for k, v in {**params, **token}.items()},
                  slot_indices=slots.cpu(), flush_mask=masks[step].cpu())  # fmt: skip
        torch.cuda.synchronize()
        assert rel_err(out.cpu(), want) < OUT_TOL[state_dtype], step
        assert torch.equal(out[2], torch.zeros_like(out[2]))
        assert torch.equal(pool["cursors"].cpu(), cpu["cursors"]), step
        e = rel_err(pool["state"].cpu(), cpu["state"])
        assert e < TOL[state_dtype], f"step {step}: checkpoint relative error {e:.3g}"
        forced = [s for r, s in enumerate(ROW_SLOTS) if s >= 0 and masks[step, r]
                  and held[s] + 1 < L and not every]  # fmt: skip
        flushes += len(forced)
        for s in forced:  # flushed now though the window held room
            assert pool["cursors"][s, 0].item() == 0
    assert every or flushes > 5
    for k, v in pool.items():
        assert torch.equal(v[[0, NUM_SLOTS - 1]].view(torch.uint8), kept[k].view(torch.uint8)), k


@pytest.mark.parametrize("kernel", ["per-item", "split"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_captured_step_reads_the_mask_at_each_replay(name, kernel):
    fam, gen, layout, pool, params = _setup(name, torch.float32, seed=4)
    eager_pool = {k: v.clone() for k, v in pool.items()}
    batch = len(ROW_SLOTS)
    config = LaunchConfig(kernel=kernel)
    plan = plan_decode(layout, batch, device="cuda", flush_mask=True, config=config,
                       check_slot_values=False)  # fmt: skip
    workspace = torch.empty(plan.workspace_floats, device="cuda")
    slots = torch.tensor(ROW_SLOTS, dtype=torch.int32, device="cuda")
    tokens = [_token(fam, gen) for _ in range(STEPS)]
    masks = torch.rand(STEPS, batch, generator=gen, device="cuda") < 0.3
    static = {k: v.clone() for k, v in tokens[0].items()}
    mask = torch.zeros(batch, dtype=torch.bool, device="cuda")
    out = torch.empty(batch, layout.shape.value_heads, layout.shape.value_dim, device="cuda")
    op = fam.decode_op()

    def step(tensors, inputs, flush_mask, result):
        op(plan, **tensors, **params, **inputs, slot_indices=slots, workspace=workspace,
           out=result, flush_mask=flush_mask)  # fmt: skip

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a scratch copy
        step({k: v.clone() for k, v in pool.items()}, static, mask, out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(pool, static, mask, out)
    eager_out = torch.empty_like(out)
    for t in range(STEPS):
        for k, v in tokens[t].items():
            static[k].copy_(v)
        mask.copy_(masks[t])
        graph.replay()
        step(eager_pool, tokens[t], masks[t], eager_out)
        torch.cuda.synchronize()
        assert torch.equal(out, eager_out), t
    for k, v in pool.items():
        assert torch.equal(v.view(torch.uint8), eager_pool[k].view(torch.uint8)), k
    assert int(pool["cursors"][:, 1].sum()) > 0
