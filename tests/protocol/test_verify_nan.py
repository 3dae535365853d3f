"""NaN and inf containment in speculative verify (issue 39, item 5): a non-finite value in one
draft's inputs reaches no other row, no draft outside its subtree (its ancestors and siblings), and
nothing committed once that draft is rejected.

Two runs of one schedule differ only in row 0's draft 1 at one step: poisoned (every input of that
draft NaN or inf) against other finite values. Every output outside that draft's subtree, every
checkpoint copy and every cursor must agree bit for bit between the runs, through later flushes.
On the torch path always; on the kernels (gpu marker) per item and split where the policy splits.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from support.verify_formats import FAMS, SEED, start

from replayssm_jit import LaunchConfig, commit_drafts, plan_decode

I32 = torch.int32
L, T, STEPS, POISON_STEP = 4, 3, 10, 3
# Row 0's tree: drafts 1 and 2 are both children of draft 0 (siblings); row 1's is a chain.
TREE = [[-1, 0, 0], [-1, 0, 1]]
CASES = [("mamba2", "f32", None), ("mamba2", "f32", "e4m3"), ("mamba2", "e4m3", None),
         ("gdn", "f32", None), ("gdn", "f32", "e4m3"), ("gdn", "e4m3", None),
         ("kda", "f32", None), ("kda", "e4m3", None)]  # fmt: skip


def _paths(tree: list[int]) -> list[list[int]]:
    """Every root-to-node path of a draft tree (the empty one included)."""
    paths = [[]]
    for j, parent in enumerate(tree):
        paths.append(next(p for p in paths if (p[-1] if p else -1) == parent) + [j])
    return paths


def run_schedule(case, poison: float | None, trees: bool, device: str, config=None):
    """Outputs of every step and the slots' copies and cursors after each; row 0's draft 1 at
    POISON_STEP gets `poison` in every input (None: other finite values) and is rejected."""
    name, state, read = case
    fam = FAMS[name]()
    gen, layout, tensors, opts = start(fam, state, read, L, T, device=device)
    plan = plan_decode(layout, 2, device=device, seed=SEED, config=config, **opts)
    params = {k: v.to(device) for k, v in fam.params(gen).items()}
    other = torch.Generator().manual_seed(SEED + 1)
    rng = random.Random(SEED)
    slots = torch.tensor([1, 3], dtype=I32, device=device)
    tree = TREE if trees else [[-1, 0, 1]] * 2
    parents = torch.tensor(tree, dtype=I32, device=device) if trees else None
    outs, after = [], []
    for step in range(STEPS):
        drafts = fam.drafts(gen, 2, T)
        alternative = fam.drafts(other, 2, T)
        if step == POISON_STEP:
            for key, t in drafts.items():
                t[0, 1] = alternative[key][0, 1] if poison is None else poison
        out = torch.full((2, T, *fam.state_shape()[:2]), math.nan, device=device)
        fam.verify_op(plan, **tensors, **params, **{k: v.to(device) for k, v in drafts.items()},
                      slot_indices=slots, out=out, parents=parents)  # fmt: skip
        outs.append(out.cpu())
        chosen = [rng.choice(_paths(t)) for t in tree]
        if step == POISON_STEP:  # row 0's draft 1 rejected (its sibling, draft 2, kept in a tree)
            chosen[0] = [0, 2] if trees else [0]
        path = torch.tensor([p + [0] * (T - len(p)) for p in chosen], dtype=I32, device=device)
        commit_drafts(plan, **tensors, num_accepted=torch.tensor([len(p) for p in chosen], dtype=I32, device=device),
                      slot_indices=slots, accepted_path=path if trees else None, parents=parents)  # fmt: skip
        copies = layout.checkpoint_names + ("cursors",)
        after.append({n: tensors[n].cpu().view(torch.uint8).clone() for n in copies})
    return outs, after


def assert_contained(case, poison, trees, device, config=None):
    bad_outs, bad = run_schedule(case, poison, trees, device, config)
    good_outs, good = run_schedule(case, None, trees, device, config)
    subtree = [1] if trees else [1, 2]  # row 0's drafts that descend from draft 1
    for step, (b, g) in enumerate(zip(bad_outs, good_outs, strict=True)):
        keep = torch.ones(b.shape[:2], dtype=torch.bool)
        if step == POISON_STEP:
            keep[0, subtree] = False
        assert bool(torch.isfinite(g).all()), f"step {step}: a finite run gave a non-finite output"
        assert torch.equal(b[1].view(torch.uint8), g[1].view(torch.uint8)), (
            f"step {step}: the poisoned draft reached another row"
        )
        assert torch.equal(b[keep].view(torch.uint8), g[keep].view(torch.uint8)), (
            f"step {step}: the poisoned draft reached a draft of its row outside its subtree"
        )
        for n in good[step]:
            assert torch.equal(bad[step][n], good[step][n]), f"step {step}: {n} differs"
    epochs = [good[s]["cursors"].view(I32)[:, 1] for s in (POISON_STEP, STEPS - 1)]
    assert bool((epochs[1][[1, 3]] > epochs[0][[1, 3]]).all()), "no flush after the poisoned step"


@pytest.mark.parametrize("trees", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(x for x in c if x))
def test_torch_path_contains_a_poisoned_draft(case, poison, trees):
    assert_contained(case, poison, trees, "cpu")


KERNELS = [(case, kernel) for case in CASES for kernel in ("per-item", "split")
           if kernel == "per-item" or case[0] == "mamba2" or (case[0] == "gdn" and case[2] is None)]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.usefixtures("no_launch_env")
@pytest.mark.parametrize("trees", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("poison", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("case, kernel", KERNELS,
                         ids=lambda v: v if isinstance(v, str) else "-".join(x for x in v if x))  # fmt: skip
def test_kernels_contain_a_poisoned_draft(case, kernel, poison, trees):
    assert_contained(case, poison, trees, "cuda", LaunchConfig(kernel=kernel))
