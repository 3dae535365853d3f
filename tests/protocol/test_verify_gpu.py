"""Speculative verify and commit through the CUDA kernels (issue 17), against the float64
per-draft snapshot oracle of tests/support/verify_schedule.py: every model shape, T in {2, 4, 8}, L in
{4, 16}, batches {1, 7, 64, 256}, chains with fused commits, trees with explicit commits and
per-row draft counts, pad rows; outputs, cursors and every flushed checkpoint. A small-shape CPU
run of the same schedules checks the oracle and the CPU path in CI.
"""

from __future__ import annotations

import random

import pytest
import torch
from support.checks import rel_err
from support.verify_schedule import GDNFamily, KDAFamily, Mamba2Family, run_schedule

from replayssm_jit import LaunchConfig, commit_drafts, commit_snapshots, plan_decode, reset_slots

pytestmark = pytest.mark.usefixtures("no_launch_env")

MODELS = {
    "super120b": Mamba2Family(128, 64, 128, 8),
    "nano4b": Mamba2Family(96, 80, 128, 8),
    "qwen4b": GDNFamily(16, 32, 128, 128),
    "qwen122b": GDNFamily(16, 64, 128, 128),
    "kimi48b": KDAFamily(32, 32, 128, 128),
    "kimi-k3-shard": KDAFamily(12, 12, 128, 128),
    "kda-gva": KDAFamily(8, 16, 128, 128),
}
SMALL = {
    "mamba2": Mamba2Family(6, 16, 32, 3),
    "gdn": GDNFamily(2, 4, 32, 32),
    "kda": KDAFamily(2, 4, 32, 32),
}


# --- CPU: the schedules themselves -------------------------------------------------------------


@pytest.mark.parametrize("fam", sorted(SMALL))
@pytest.mark.parametrize("mode", ["fused-chain", "explicit-chain", "tree-variable"])
@pytest.mark.parametrize("T,L", [(2, 1), (4, 4)])
def test_schedule_on_cpu_path(fam, mode, T, L):
    worst = run_schedule(SMALL[fam], device="cpu", batch=3, T=T, L=L, steps=12, seed=T + L,
                         fused=mode == "fused-chain", trees=mode == "tree-variable",
                         variable=mode == "tree-variable", state_dtype=torch.float32,
                         act_dtype=torch.float32)  # fmt: skip
    assert worst["flushes"] > 0


# --- GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("T", [2, 4, 8])
@pytest.mark.parametrize("L", [4, 16])
@pytest.mark.parametrize("batch", [1, 7, 64, 256])
def test_verify_chain_fused_commit(model, T, L, batch):
    steps = 40 if batch <= 64 else 16
    worst = run_schedule(MODELS[model], device="cuda", batch=batch, T=T, L=L, steps=steps,
                         seed=batch * 31 + T, fused=True, act_dtype=torch.float32)  # fmt: skip
    assert worst["flushes"] > 0, worst


# KDA verifies per item only (a forced "split" plans per-item: tests/kda/test_kda_cpu.py).
KERNELS = [(model, kernel) for model in sorted(MODELS) for kernel in ("split", "per-item")
           if kernel == "per-item" or not isinstance(MODELS[model], KDAFamily)]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("model,kernel", KERNELS)
@pytest.mark.parametrize("T", [2, 4, 8])
@pytest.mark.parametrize("mode", ["fused-chain", "tree-variable"])
def test_verify_kernels(model, T, kernel, mode):
    """Each verify kernel, whatever the policy would pick at this batch."""
    tree = mode == "tree-variable"
    worst = run_schedule(MODELS[model], device="cuda", batch=7, T=T, L=16, steps=30, seed=T + 5,
                         fused=not tree, trees=tree, variable=tree, act_dtype=torch.float32,
                         config=LaunchConfig(kernel=kernel), verify_kernel=kernel)  # fmt: skip
    assert worst["flushes"] > 0, worst


@pytest.mark.gpu
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("T", [4, 8])
@pytest.mark.parametrize("pad", [-1, 0])
def test_verify_trees_variable_drafts_explicit_commit(model, T, pad):
    worst = run_schedule(MODELS[model], device="cuda", batch=7, T=T, L=16, steps=30, seed=T,
                         trees=True, variable=True, fused=False, pad_slot_id=pad,
                         act_dtype=torch.float32)  # fmt: skip
    assert worst["flushes"] > 0, worst


@pytest.mark.gpu
@pytest.mark.parametrize("model", sorted(MODELS))
def test_verify_200_steps(model):
    worst = run_schedule(MODELS[model], device="cuda", batch=64, T=4, L=16, steps=200, seed=7,
                         fused=True, variable=True, act_dtype=torch.float32)  # fmt: skip
    assert worst["flushes"] > 20, worst


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["super120b", "qwen4b", "kimi48b"])
def test_replay_verify_agrees_with_snapshot_baseline_1000_steps(model):
    """Our verify + commit and our conventional spec baseline (one snapshot per draft, then a
    copy of the accepted one), fed the same drafts and accept counts, agree at every step."""
    fam, dev, batch, T, L = MODELS[model], torch.device("cuda"), 8, 4, 16
    gen = torch.Generator(device=dev).manual_seed(3)
    rng = random.Random(3)
    layout = fam.layout(L, T, torch.float32, act_dtype=torch.float32)
    live = torch.arange(batch, dtype=torch.int32, device=dev)
    snaps = (batch + live[:, None] * T + torch.arange(T, device=dev)).to(torch.int32)
    replay = layout.allocate(batch, dev)
    conv = layout.allocate(batch + batch * T, dev)
    init = 0.3 * torch.randn(replay["state"].shape, generator=gen, device=dev)
    reset_slots(layout, replay, live, init)
    conv["state"][:batch] = init
    params = fam.params(gen, dev)
    plan = plan_decode(layout, batch, device=dev)
    cplan = plan  # the snapshot kernels come with the verify kernels in a replay plan's module
    worst, accepted = 0.0, None
    for step in range(1000):
        drafts = fam.drafts(batch, T, gen, dev, torch.float32)
        kw = {} if accepted is None else {"num_accepted": accepted}
        y = fam.verify(plan, replay, params, drafts, live, **kw)
        y_conv = fam.snapshot(cplan, conv["state"], params, drafts, live, snaps)
        e = rel_err(y, y_conv)
        worst = max(worst, e)
        assert e < 1e-5, f"step {step}: {e:.3g}"
        accepted = torch.tensor([rng.randint(1, T) for _ in range(batch)], dtype=torch.int32,
                                device=dev)  # fmt: skip
        commit_snapshots(cplan, state=conv["state"], snapshot_slots=snaps, num_accepted=accepted,
                         slot_indices=live)  # fmt: skip
    assert worst > 0


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["super120b", "qwen122b", "kimi48b"])
def test_verify_in_cuda_graph_clamps_bad_device_values(model):
    """Inside a captured graph nothing is checked on the host: accept counts above the pending
    drafts, parents at or past their own index and draft counts past T are clamped, slot ids out
    of range fault their row, and no slot other than the named ones changes."""
    fam, dev, batch, T, L = MODELS[model], torch.device("cuda"), 6, 4, 4
    gen = torch.Generator(device=dev).manual_seed(5)
    layout = fam.layout(L, T, torch.float32, act_dtype=torch.float32)
    tensors = layout.allocate(batch + 2, dev)
    slots = torch.arange(batch, dtype=torch.int32, device=dev)
    reset_slots(layout, tensors, slots, 0.3 * torch.randn((batch, *fam.state_shape()),
                                                         generator=gen, device=dev))  # fmt: skip
    params = fam.params(gen, dev)
    plan = plan_decode(layout, batch, device=dev, check_slot_values=False)
    drafts = fam.drafts(batch, T, gen, dev, torch.float32)
    num_drafts = torch.full((batch,), T, dtype=torch.int32, device=dev)
    parents = torch.tensor([list(range(-1, T - 1))] * batch, dtype=torch.int32, device=dev)
    accepted = torch.zeros(batch, dtype=torch.int32, device=dev)
    out = torch.empty(batch, T, *fam.state_shape()[:2], device=dev)
    kept = {name: t[batch:].clone() for name, t in tensors.items()}
    fam.verify(plan, tensors, params, drafts, slots, out=out, num_drafts=num_drafts,
               parents=parents, num_accepted=accepted)  # fmt: skip
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fam.verify(plan, tensors, params, drafts, slots, out=out, num_drafts=num_drafts,
                   parents=parents, num_accepted=accepted)  # fmt: skip
    for _ in range(3):
        accepted.copy_(torch.tensor([99, -5, 2, 4, 1, 3], dtype=torch.int32))
        parents.copy_(torch.tensor([[-1, 5, 9, -7]] * batch, dtype=torch.int32))
        num_drafts.copy_(torch.tensor([T + 3, -2, 0, 1, T, 2], dtype=torch.int32))
        slots.copy_(torch.tensor([0, 1, 2, 3, 4, 1000], dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert out[5].isnan().all() and not out[:5].isnan().any()
        cur = tensors["cursors"][:batch].tolist()
        assert all(0 <= c[0] <= L + T - 1 and 0 <= c[3] <= T and c[2] == 0 for c in cur), cur
    for name, t in tensors.items():
        assert torch.equal(t[batch:].view(torch.uint8), kept[name].view(torch.uint8)), name
    commit_drafts(plan, tensors, num_accepted=torch.full((batch,), 9, dtype=torch.int32,
                  device=dev), slot_indices=torch.arange(batch, dtype=torch.int32, device=dev))  # fmt: skip
    cur = tensors["cursors"][:batch].tolist()
    assert all(c[3] == 0 and 0 <= c[0] <= L + T - 1 for c in cur), cur
