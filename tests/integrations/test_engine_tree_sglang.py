"""SGLang's EAGLE tree verify made as SGLang makes it (Mamba-2: selective_state_update with
x [bs, T, H, P], disable_state_update=True, cache_steps=T, retrieve_parent_token [bs, T]; GDN:
the dispatcher's target_verify, keyword arguments, raw gates, query_start_loc), then its
post-verify update with last_correct_step_indices, on the CPU path against float64
references built step by step over the tree. Pads (-1, by position) stay bit-identical; a
broken parent mapping is shown to fail the comparison."""

from __future__ import annotations

import pytest
import torch

from replayssm_jit import gdn_layout, mamba2_layout
from replayssm_jit.integrations import sglang_tree
from replayssm_jit.integrations.sglang import SGLangLayer
from replayssm_jit.reference import gdn_gates
from replayssm_jit.reference.gdn import gdn_step
from replayssm_jit.reference.mamba2 import mamba2_step

F32, F64, I32, I64 = torch.float32, torch.float64, torch.int32, torch.int64
SLOTS, L, T, BS, LIVE = 8, 4, 4, 4, 3
TOL = 2e-5
H, G, P, N = 4, 2, 8, 16
KH, HV, K, V = 2, 4, 16, 8

pytestmark = pytest.mark.usefixtures("no_launch_env")

# SGLang's retrieve_parent_token rows: step 0 is the root; -1 past it continues the chain.
TREES = [
    [-1, 0, 1, 2],  # a chain
    [-1, 0, 0, 1],  # two children of the root; step 3 under step 1
    [-1, -1, 0, 2],  # step 1 continues from step 0 (outside [0, T)); step 3 under step 2
    [-1, 0, 1, 2],  # the pad row
]
# Per round: the last accepted step of each row (-1: nothing), rows past LIVE left out.
LAST = [[3, 3, 1], [0, 2, -1], [2, 3, 3], [-1, 1, 0]]


def rel(actual, expected):
    a, e = actual.to(F64), expected.to(F64)
    return float(torch.linalg.vector_norm(a - e) / torch.linalg.vector_norm(e))


def tree_parent(row, t):
    """SGLang's kernel: step t > 0 starts after step row[t] where it lies in [0, T), else t-1."""
    if t == 0:
        return None
    return row[t] if 0 <= row[t] < T else t - 1


def path_to(row, last):
    path = []
    while last is not None and last >= 0:
        path.append(last)
        last = tree_parent(row, last)
    return path[::-1]


def over_tree(state, row, step):
    """States after each step and the outputs, each step from its parent's state."""
    states, outs = [], []
    for t in range(T):
        parent = tree_parent(row, t)
        o, s = step(state if parent is None else states[parent], t)
        states.append(s)
        outs.append(o)
    return states, outs


def snapshot(layer):
    return {n: t.clone() for n, t in layer.pool.items()}


def check_pads(layer, before, live_slots):
    for name, t in layer.pool.items():
        for s in range(SLOTS):
            if s not in live_slots:
                assert torch.equal(before[name][s], t[s]), (name, s)


def mamba2_case():
    gen = torch.Generator().manual_seed(21)
    layout = mamba2_layout(num_heads=H, headdim=P, dstate=N, ngroups=G, window=L, drafts=T,
                           act_dtype=F32)  # fmt: skip
    ssm_state = torch.zeros(SLOTS, H, P, N)
    layer = SGLangLayer(layout, ssm_state, max_batch=BS, dt_softplus=True)
    A, D, dt_bias = -(0.5 + torch.rand(H, generator=gen)), torch.randn(H), torch.rand(H) - 0.5
    return gen, layer, ssm_state, (A, D, dt_bias)


def mamba2_round(gen, layer, ssm_state, params, cache_indices, ref, rpt, trees=TREES):
    """One verify as SGLang's mixer makes it; returns out and the reference states per row."""
    A, D, dt_bias = params
    x = torch.randn(BS * T, H, P, generator=gen)
    dt = torch.rand(BS * T, H, generator=gen)
    B = torch.randn(BS * T, G, N, generator=gen)
    C = torch.randn(BS * T, G, N, generator=gen)
    out = torch.full((BS * T, H * P), float("nan"))  # SGLang's preallocated_ssm_out_d
    dt_d = dt[:, :, None].expand(-1, -1, P)  # head-expanded, stride 0
    layer.selective_state_update(
        ssm_state, x.view(BS, T, H, P), dt_d.view(BS, T, H, P),
        A[:, None, None].expand(H, P, N), B.view(BS, T, G, -1), C.view(BS, T, G, -1),
        D[:, None].expand(H, P), z=None, dt_bias=dt_bias[:, None].expand(H, P),
        dt_softplus=True, state_batch_indices=cache_indices, out=out.view(BS, T, H, P),
        disable_state_update=True, intermediate_states_buffer=None, cache_steps=T,
        retrieve_parent_token=rpt, intermediate_state_indices=None,
    )  # fmt: skip
    x4, dt3, B4, C4 = (t.view(BS, T, *t.shape[1:]).to(F64) for t in (x, dt, B, C))
    states = {}
    for r, s in enumerate(cache_indices.tolist()[:LIVE]):

        def step(st, t, r=r):
            o, new = mamba2_step(st[None], x4[r, t][None], dt3[r, t][None], A, B4[r, t][None],
                                 C4[r, t][None], D=D, dt_bias=dt_bias, dt_softplus=True)  # fmt: skip
            return o[0], new[0]

        states[r], outs = over_tree(ref[s], trees[r], step)
        assert rel(out.view(BS, T, H, P)[r], torch.stack(outs)) < TOL, r
    assert torch.equal(out.view(BS, T, H, P)[LIVE:], torch.zeros(BS - LIVE, T, H, P))
    return states


def commit(layer, ref, cache_indices, states, last):
    layer.update_mamba_state_after_mtp_verify(torch.tensor(last, dtype=I64), None, None, None)
    for r, s in enumerate(cache_indices.tolist()[: len(last)]):
        if last[r] >= 0:
            ref[s] = states[r][last[r]]


def test_mamba2_tree_verify_as_sglang_calls_it():
    gen, layer, ssm_state, params = mamba2_case()
    req_to_mamba_slot = torch.tensor([3, 5, 1, 6], dtype=I32)
    cache_indices = layer.pad_rows(req_to_mamba_slot[torch.tensor([1, 2, 3, 0])], LIVE)
    rpt = torch.tensor(TREES, dtype=I64)
    ref = torch.zeros(SLOTS, H, P, N, dtype=F64)
    before = snapshot(layer)
    for last in LAST * 2:  # (enough rounds to flush the window more than once)
        states = mamba2_round(gen, layer, ssm_state, params, cache_indices, ref, rpt)
        commit(layer, ref, cache_indices, states, last)
    check_pads(layer, before, {5, 1, 6})
    assert [path_to(TREES[1], 3), path_to(TREES[2], 1)] == [[0, 1, 3], [0, 1]]


def test_a_broken_parent_mapping_fails_the_comparison(monkeypatch):
    """Reading SGLang's parents as ours verbatim (-1 past step 0 as 'the slot's state') is
    wrong for the third row, and the comparison catches it."""

    def verbatim(self, retrieve_parent_token, slots):
        self.slots.copy_(slots)
        self.parents.copy_(retrieve_parent_token[: self.parents.shape[0]])
        return self.parents

    monkeypatch.setattr(sglang_tree.TreeRows, "map_parents", verbatim)
    gen, layer, ssm_state, params = mamba2_case()
    cache_indices = layer.pad_rows(torch.tensor([5, 1, 6, 3], dtype=I32), LIVE)
    ref = torch.zeros(SLOTS, H, P, N, dtype=F64)
    with pytest.raises(AssertionError):
        mamba2_round(gen, layer, ssm_state, params, cache_indices, ref,
                     torch.tensor(TREES, dtype=I64))  # fmt: skip


def test_gdn_tree_verify_as_sglang_calls_it():
    gen = torch.Generator().manual_seed(22)
    layout = gdn_layout(num_k_heads=KH, num_v_heads=HV, head_k_dim=K, head_v_dim=V, window=L,
                        drafts=T, act_dtype=F32)  # fmt: skip
    ssm_states = torch.zeros(SLOTS, HV, V, K)
    layer = SGLangLayer(layout, ssm_states, max_batch=BS)
    A_log = torch.rand(HV, generator=gen) - 1.0
    dt_bias = 0.5 * torch.randn(HV, generator=gen)
    cache_indices = layer.pad_rows(torch.tensor([5, 1, 6, 3], dtype=I32), LIVE)
    query_start_loc = torch.arange(0, BS * T + 1, T, dtype=I32)
    rpt = torch.tensor(TREES, dtype=I64)
    ref = torch.zeros(SLOTS, HV, V, K, dtype=F64)
    before = snapshot(layer)
    for last in LAST * 2:
        q = torch.randn(1, BS * T, KH, K, generator=gen)
        k = torch.randn(1, BS * T, KH, K, generator=gen)
        v = torch.randn(1, BS * T, HV, V, generator=gen)
        a = torch.randn(BS * T, HV, generator=gen)
        b = torch.randn(BS * T, HV, generator=gen)
        o = layer.target_verify(
            A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b, ssm_states=ssm_states,
            cache_indices=cache_indices, query_start_loc=query_start_loc,
            intermediate_states_buffer=None, intermediate_state_indices=None, cache_steps=T,
            retrieve_parent_token=rpt,
        )  # fmt: skip
        assert o.shape == (1, BS * T, HV, V)
        o4 = o.view(BS, T, HV, V)
        states = {}
        for r, s in enumerate(cache_indices.tolist()[:LIVE]):

            def step(st, t, r=r, q=q, k=k, v=v, a=a, b=b):
                i = r * T + t
                g, beta = gdn_gates(A_log, a[i][None], dt_bias, b[i][None])
                o_t, new = gdn_step(st[None], q[0, i][None], k[0, i][None], v[0, i][None], g,
                                    beta)  # fmt: skip
                return o_t[0], new[0]

            states[r], outs = over_tree(ref[s], TREES[r], step)
            assert rel(o4[r], torch.stack(outs)) < TOL, r
        assert torch.equal(o4[LIVE:], torch.zeros(BS - LIVE, T, HV, V))
        commit(layer, ref, cache_indices, states, last)
    check_pads(layer, before, {5, 1, 6})


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"intermediate_states_buffer": torch.zeros(BS, T, H, P, N)},
            r"intermediate_states_buffer: expected None .* got torch.Size\(\[4, 4, 4, 8, 16\]\)",
        ),
        (
            {"intermediate_state_indices": torch.arange(BS, dtype=I32)},
            "intermediate_state_indices: expected None",
        ),
        ({"disable_state_update": False}, "disable_state_update: expected True .* got False"),
        ({"cache_steps": T + 1}, f"cache_steps: expected None or {T} .* got {T + 1}"),
        (
            {"retrieve_parent_token": torch.tensor([[-1, 0, 3, 1]] * BS)},
            r"retrieve_parent_token: expected an earlier step \(< 2\) .* got 3",
        ),
        (
            {"retrieve_parent_token": torch.zeros(BS, T)},
            "retrieve_parent_token: expected dtype int32 or int64, got torch.float32",
        ),
    ],
    ids=["buffer", "buffer_indices", "state_update", "cache_steps", "later_parent", "float"],
)
def test_what_cannot_be_provided_is_refused_and_changes_nothing(change, message):
    gen, layer, ssm_state, (A, D, dt_bias) = mamba2_case()
    cache_indices = layer.pad_rows(torch.tensor([5, 1, 6, 3], dtype=I32), LIVE)
    x = torch.randn(BS, T, H, P, generator=gen)
    B = torch.randn(BS, T, G, N, generator=gen)
    kw = dict(z=None, dt_bias=dt_bias[:, None].expand(H, P), dt_softplus=True,
              state_batch_indices=cache_indices, out=torch.zeros(BS, T, H, P),
              disable_state_update=True, cache_steps=T)  # fmt: skip
    kw.update(change)
    before = snapshot(layer)
    with pytest.raises((ValueError, TypeError), match=message):
        layer.selective_state_update(ssm_state, x, torch.rand(BS, T, H, 1).expand(-1, -1, -1, P),
                                     A[:, None, None].expand(H, P, N), B, B,
                                     D[:, None].expand(H, P), **kw)  # fmt: skip
    check_pads(layer, before, set())
    with pytest.raises(ValueError, match="expected a tree verify since the last commit"):
        layer.update_mamba_state_after_mtp_verify(torch.tensor([0, 0, 0]), None, None, None)


def test_out_of_range_accepted_steps_are_refused():
    gen, layer, ssm_state, params = mamba2_case()
    cache_indices = layer.pad_rows(torch.tensor([5, 1, 6, 3], dtype=I32), LIVE)
    ref = torch.zeros(SLOTS, H, P, N, dtype=F64)
    mamba2_round(gen, layer, ssm_state, params, cache_indices, ref, torch.tensor(TREES))
    before = snapshot(layer)
    with pytest.raises(
        ValueError, match=r"last_correct_step_indices: expected a step in \[-1, 4\)"
    ):
        layer.update_mamba_state_after_mtp_verify(torch.tensor([0, T, 1]), None, None, None)
    check_pads(layer, before, set())


@pytest.mark.parametrize("values_read", [True, False])
def test_a_commit_that_ignores_the_tree_is_caught(monkeypatch, values_read):
    """Committing the path's length as a chain (steps 0..a-1) instead of the tree path: the op
    refuses it where it reads the counts (it knows the tree from the verify); where it does not
    (CUDA graphs), the wrong states it keeps for the second row fail the next verify's
    comparison."""
    from replayssm_jit.ops import commit as commit_op
    from replayssm_jit.ops.library import OPS

    real = OPS["commit_drafts"]

    def chain(handle, **kw):
        kw["accepted_path"] = None
        return real(handle, **kw)

    monkeypatch.setitem(OPS, "commit_drafts", chain)
    if not values_read:
        monkeypatch.setattr(commit_op, "reads_device_values", lambda plan: False)
    gen, layer, ssm_state, params = mamba2_case()
    cache_indices = layer.pad_rows(torch.tensor([5, 1, 6, 3], dtype=I32), LIVE)
    rpt = torch.tensor(TREES, dtype=I64)
    ref = torch.zeros(SLOTS, H, P, N, dtype=F64)
    states = mamba2_round(gen, layer, ssm_state, params, cache_indices, ref, rpt)
    error, match = (
        (ValueError, "^num_accepted: expected at most") if values_read else (AssertionError, "")
    )
    with pytest.raises(error, match=match):
        commit(layer, ref, cache_indices, states, LAST[0])
        mamba2_round(gen, layer, ssm_state, params, cache_indices, ref, rpt)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_trees_and_accepted_steps(seed):
    """Random trees (parents earlier steps, or values outside [0, T) that continue the chain)
    and random last accepted steps over rounds that cross the window."""
    gen, layer, ssm_state, params = mamba2_case()
    pick = torch.Generator().manual_seed(100 + seed)
    cache_indices = layer.pad_rows(torch.tensor([2, 7, 4, 0], dtype=I32), LIVE)
    ref = torch.zeros(SLOTS, H, P, N, dtype=F64)
    before = snapshot(layer)
    for _ in range(3 * L):
        trees = []
        for _ in range(BS):
            row = [-1]
            for t in range(1, T):
                p = int(torch.randint(-1, t, (1,), generator=pick))
                row.append(p if p >= 0 else int(torch.randint(T, 2**33, (1,), generator=pick)))
            trees.append(row)
        rpt = torch.tensor(trees, dtype=I64)
        states = mamba2_round(gen, layer, ssm_state, params, cache_indices, ref, rpt, trees)
        last = torch.randint(-1, T, (LIVE,), generator=pick).tolist()
        commit(layer, ref, cache_indices, states, last)
    check_pads(layer, before, {2, 7, 4})
