"""The torch.library ops (replayssm_jit/ops/library.py): schemas, opcheck, and torch.compile of a
multi-layer decode step over per-layer views of one engine pool, bit for bit against eager. The
CPU path runs everything here; the CUDA-graph test needs a GPU."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import replayssm_jit
from replayssm_jit import gdn_layout, mamba2_decode, mamba2_layout, plan_decode
from replayssm_jit.launch.policy import FLAG_SPLIT
from replayssm_jit.ops.decode import resolve_workspace
from replayssm_jit.ops.library import COMMIT_RING_ARGS, OPS, lookup_plan, plan_handle, release_plan

F32, I32 = torch.float32, torch.int32
LAYERS, SLOTS, BATCH, L, T = 2, 6, 4, 4, 2
WIDTH = 64  # the hidden size: H * P of both families' value side (4 heads of 16)
SLOT_IDS = [3, 0, 5, -1]  # the last row is padding
M2_OPTIONS = dict(has_D=True, has_z=True, has_dt_bias=True, dt_softplus=True)
GDN_OPTIONS = dict(use_qk_l2norm=True, gates_in_kernel=True)


def _layouts():
    m2 = mamba2_layout(num_heads=4, headdim=16, dstate=16, ngroups=2, window=L, drafts=T,
                       act_dtype=F32)  # fmt: skip
    gdn = gdn_layout(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16, window=L,
                     drafts=T, act_dtype=F32)  # fmt: skip
    return m2, gdn


def _pool(layout, gen):
    """One engine pool per tensor name, [LAYERS, SLOTS, ...]: a layer's tensors are views of it."""
    pool = {}
    for t in layout.tensors():
        shape = (LAYERS, *t.shape(SLOTS))
        if t.dtype == I32:
            pool[t.name] = torch.zeros(shape, dtype=I32)
        else:
            pool[t.name] = (0.1 * torch.randn(shape, generator=gen)).to(t.dtype)
    return pool


def _layer(pool, i):
    return {name: t[i] for name, t in pool.items()}


class Stack:
    """LAYERS x (a Mamba-2 layer, then a GDN layer), each layer's inputs cut from the hidden
    state by views and its output added back with exact float ops (so eager and compiled agree
    bit for bit whatever the fusion)."""

    def __init__(self, gen):
        self.m2_layout, self.gdn_layout = _layouts()
        self.m2 = plan_handle(plan_decode(self.m2_layout, BATCH, device="cpu", **M2_OPTIONS))
        self.gdn = plan_handle(plan_decode(self.gdn_layout, BATCH, device="cpu", **GDN_OPTIONS))
        self.A = [-(0.5 + torch.rand(4, generator=gen)) for _ in range(LAYERS)]
        self.D = [torch.randn(4, generator=gen) for _ in range(LAYERS)]
        self.m2_bias = [torch.rand(4, generator=gen) - 0.5 for _ in range(LAYERS)]
        self.A_log = [torch.log(0.5 + torch.rand(4, generator=gen)) for _ in range(LAYERS)]
        self.gdn_bias = [torch.rand(4, generator=gen) - 0.5 for _ in range(LAYERS)]

    def step(self, m2_pool, gdn_pool, h, slots):
        outs = []
        for i in range(LAYERS):
            heads = h.view(BATCH, 4, 16)
            out = torch.empty(BATCH, 4, 16)
            torch.ops.replayssm.mamba2_decode(
                self.m2, **_layer(m2_pool, i), x=heads, dt=h[:, :4], A=self.A[i],
                B=heads[:, :2], C=heads[:, 2:], z=heads, D=self.D[i], dt_bias=self.m2_bias[i],
                slot_indices=slots, out=out,
            )  # fmt: skip
            h = h * 0.5 + out.view(BATCH, WIDTH)
            outs.append(out)
            heads = h.view(BATCH, 4, 16)
            out = torch.empty(BATCH, 4, 16)
            torch.ops.replayssm.gdn_decode(
                self.gdn, **_layer(gdn_pool, i), q=heads[:, :2], k=heads[:, 2:], v=heads,
                a=h[:, :4], b=h[:, 4:8], A_log=self.A_log[i], dt_bias=self.gdn_bias[i],
                slot_indices=slots, out=out,
            )  # fmt: skip
            h = h * 0.5 + out.view(BATCH, WIDTH)
            outs.append(out)
        return h, outs


def _clone(pool):
    return {name: t.clone() for name, t in pool.items()}


def _run(fn, pools, hs, slots):
    m2_pool, gdn_pool = _clone(pools[0]), _clone(pools[1])
    results = [fn(m2_pool, gdn_pool, h, slots) for h in hs]
    return m2_pool, gdn_pool, results


@pytest.fixture
def stack_inputs():
    gen = torch.Generator().manual_seed(11)
    stack = Stack(gen)
    pools = (_pool(stack.m2_layout, gen), _pool(stack.gdn_layout, gen))
    hs = [torch.randn(BATCH, WIDTH, generator=gen) for _ in range(L + 2)]  # crosses a flush
    return stack, pools, hs, torch.tensor(SLOT_IDS, dtype=I32)


def _assert_same(got, want):
    for (gm, gg, gr), (wm, wg, wr) in [(got, want)]:
        for name in gm:
            assert torch.equal(gm[name], wm[name]), f"mamba2 pool {name}"
        for name in gg:
            assert torch.equal(gg[name], wg[name]), f"gdn pool {name}"
        for (gh, gouts), (wh, wouts) in zip(gr, wr):
            assert torch.equal(gh, wh)
            assert all(torch.equal(a, b) for a, b in zip(gouts, wouts))


# ---------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------


def test_every_op_is_registered_with_its_written_tensors_declared():
    m2_step = {"state", "rec_x", "rec_b", "rec_dt", "cursors", "out", "workspace"}
    delta_step = {"state", "rec_u", "rec_k", "rec_g", "cursors", "out", "workspace"}
    # a decode step (and a verify's early flush, every format on the torch path) also writes the
    # checkpoint's scales and separate mode's read copy
    copies = {"state_scale", "read_state", "read_scale", "state_block_scale", "read_block_scale"}
    m2, gdn = m2_step | copies, delta_step | copies | {"rec_v", "rec_beta"}
    kda = gdn  # separate mode on the torch path too
    written = {
        "mamba2_decode": m2,
        "gdn_decode": gdn,
        "kda_decode": kda,
        "mamba2_verify": m2,
        "gdn_verify": gdn,
        "kda_verify": kda,
        "commit_drafts": {
            "cursors",
            "value_ring",
            "key_ring",
            "decay_ring",
            "read_value_ring",
            "read_scalar_ring",
        },
        "mamba2_snapshot_verify": {"state", "out"},
        "gdn_snapshot_verify": {"state", "out"},
        "kda_snapshot_verify": {"state", "out"},
        "commit_snapshots": {"state"},
    }
    assert set(OPS) == set(written)
    for name, expected in written.items():
        schema = getattr(torch.ops.replayssm, name).default._schema
        got = {a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write}
        assert got == expected, name
        assert schema.arguments[0].name == "plan" and not schema.returns, name


def test_written_tensors_count_as_modified_with_their_optional_arguments_left_out():
    """A call that leaves workspace and the seeds at their defaults (the form that fails
    inside torch.library.custom_op's kernels on torch <= 2.11) runs and bumps the version of
    every tensor it was given to write."""
    gen = torch.Generator().manual_seed(2)
    stack = Stack(gen)
    pool = _pool(stack.m2_layout, gen)
    h = torch.randn(BATCH, WIDTH, generator=gen)
    heads = h.view(BATCH, 4, 16)
    layer, out = _layer(pool, 0), torch.empty(BATCH, 4, 16)
    before = {name: t._version for name, t in layer.items()} | {"out": out._version}
    torch.ops.replayssm.mamba2_decode(
        stack.m2, **layer, x=heads, dt=h[:, :4], A=stack.A[0], B=heads[:, :2], C=heads[:, 2:],
        z=heads, D=stack.D[0], dt_bias=stack.m2_bias[0],
        slot_indices=torch.tensor(SLOT_IDS, dtype=I32), out=out)  # fmt: skip
    after = {name: t._version for name, t in layer.items()} | {"out": out._version}
    assert all(after[name] > before[name] for name in before), (before, after)
    assert torch.isfinite(out[torch.tensor(SLOT_IDS) >= 0]).all()


def test_plan_handles():
    m2, _ = _layouts()
    plan = plan_decode(m2, 2, device="cpu")
    handle = plan_handle(plan)
    assert plan_handle(plan) == handle and lookup_plan(handle) is plan
    other = plan_handle(plan_decode(m2, 2, device="cpu"))  # an equal plan, another object
    assert other != handle
    release_plan(other)
    with pytest.raises(ValueError, match=r"^plan: expected a handle from plan_handle\(\)"):
        lookup_plan(other)
    with pytest.raises(TypeError, match="^plan: expected a DecodePlan"):
        plan_handle(m2)
    assert replayssm_jit.ops.plan_handle is plan_handle


def test_the_registered_op_matches_the_functional_op_and_checks_the_same(stack_inputs):
    stack, pools, hs, slots = stack_inputs
    plan = lookup_plan(stack.m2)
    heads = hs[0].view(BATCH, 4, 16)
    tok = dict(x=heads, dt=hs[0][:, :4], A=stack.A[0], B=heads[:, :2], C=heads[:, 2:], z=heads,
               D=stack.D[0], dt_bias=stack.m2_bias[0], slot_indices=slots)  # fmt: skip
    a, b = _clone(pools[0]), _clone(pools[0])
    want = mamba2_decode(plan, **_layer(a, 0), **tok, seed=5)
    out = torch.empty_like(want)
    assert (
        torch.ops.replayssm.mamba2_decode(stack.m2, **_layer(b, 0), **tok, out=out, seed=5) is None
    )
    assert torch.equal(out, want) and all(torch.equal(a[n], b[n]) for n in a)
    with pytest.raises(ValueError, match=r"^slot_indices: expected values in \[0, 6\)"):
        bad = torch.tensor([0, 1, 2, 6], dtype=I32)
        torch.ops.replayssm.mamba2_decode(stack.m2, **_layer(b, 0), **{**tok, "slot_indices": bad},
                                          out=out)  # fmt: skip
    with pytest.raises(ValueError, match="^seed, seed_tensor: expected at most one"):
        torch.ops.replayssm.mamba2_decode(stack.m2, **_layer(b, 0), **tok, out=out, seed=1,
                                          seed_tensor=torch.ones(1, dtype=torch.int64))  # fmt: skip
    with pytest.raises(ValueError, match="^plan: expected a mamba2 plan, got a gdn plan"):
        torch.ops.replayssm.mamba2_decode(stack.gdn, **_layer(b, 0), **tok, out=out)
    assert all(torch.equal(a[n], b[n]) for n in a)  # failed calls changed nothing


# ---------------------------------------------------------------------------------------------
# opcheck on every op
# ---------------------------------------------------------------------------------------------


def _opcheck_cases():
    """(op name, args, kwargs) for every op, each on per-layer views of a pool."""
    gen = torch.Generator().manual_seed(5)
    stack = Stack(gen)
    m2_pool, gdn_pool = _pool(stack.m2_layout, gen), _pool(stack.gdn_layout, gen)
    slots = torch.tensor(SLOT_IDS, dtype=I32)
    h = torch.randn(BATCH, WIDTH, generator=gen)
    heads = h.view(BATCH, 4, 16)
    m2_tok = dict(x=heads, dt=h[:, :4], A=stack.A[0], B=heads[:, :2], C=heads[:, 2:], z=heads,
                  D=stack.D[0], dt_bias=stack.m2_bias[0], slot_indices=slots)  # fmt: skip
    gdn_tok = dict(q=heads[:, :2], k=heads[:, 2:], v=heads, a=h[:, :4], b=h[:, 4:8],
                   A_log=stack.A_log[0], dt_bias=stack.gdn_bias[0], slot_indices=slots)  # fmt: skip
    hd = torch.randn(BATCH, T, WIDTH, generator=gen)
    dheads = hd.view(BATCH, T, 4, 16)
    m2_drafts = dict(x=dheads, dt=hd[..., :4], A=stack.A[0], B=dheads[:, :, :2],
                     C=dheads[:, :, 2:], z=dheads, D=stack.D[0], dt_bias=stack.m2_bias[0],
                     slot_indices=slots)  # fmt: skip
    gdn_drafts = dict(q=dheads[:, :, :2], k=dheads[:, :, 2:], v=dheads, a=hd[..., :4],
                      b=hd[..., 4:8], A_log=stack.A_log[0], dt_bias=stack.gdn_bias[0],
                      slot_indices=slots)  # fmt: skip
    out, dout = torch.empty(BATCH, 4, 16), torch.empty(BATCH, T, 4, 16)
    m2_rings = [m2_pool[n][1] for n in stack.m2_layout.ring_names]
    # A verify left in layer 1's cursors, so that the commit has drafts to accept.
    torch.ops.replayssm.mamba2_verify(stack.m2, **_layer(m2_pool, 1), **m2_drafts, out=dout)
    accepted = torch.tensor([1, 2, 0, 0], dtype=I32)
    # Three free slots (1, 2, 4) for three live rows: one draft each, distinct snapshot slots.
    snapshots = torch.tensor([[1, 2], [2, 4], [4, 1], [0, 0]], dtype=I32)
    one_draft = torch.tensor([1, 1, 1, 0], dtype=I32)
    return [
        ("mamba2_decode", (stack.m2,), {**_layer(m2_pool, 0), **m2_tok, "out": out}),
        ("gdn_decode", (stack.gdn,), {**_layer(gdn_pool, 0), **gdn_tok, "out": out, "seed": 3}),
        ("mamba2_verify", (stack.m2,), {**_layer(m2_pool, 0), **m2_drafts, "out": dout}),
        ("gdn_verify", (stack.gdn,), {**_layer(gdn_pool, 0), **gdn_drafts, "out": dout,
                                      "parents": torch.tensor([[-1, 0]] * BATCH, dtype=I32)}),
        ("commit_drafts", (stack.m2,), dict(cursors=m2_pool["cursors"][1], value_ring=m2_rings[0],
                                            key_ring=m2_rings[1], decay_ring=m2_rings[2],
                                            num_accepted=accepted, slot_indices=slots)),
        ("mamba2_snapshot_verify", (stack.m2,), dict(state=m2_pool["state"][0], **m2_drafts,
                                                     out=dout, snapshot_slots=snapshots,
                                                     num_drafts=one_draft)),
        ("gdn_snapshot_verify", (stack.gdn,), dict(state=gdn_pool["state"][0], **gdn_drafts,
                                                   out=dout, snapshot_slots=snapshots,
                                                   num_drafts=one_draft)),
        ("commit_snapshots", (stack.gdn,), dict(state=gdn_pool["state"][0],
                                                snapshot_slots=snapshots, num_accepted=accepted,
                                                slot_indices=slots)),
    ]  # fmt: skip


@pytest.mark.parametrize("case", _opcheck_cases(), ids=lambda case: case[0])
def test_opcheck(case):
    name, args, kwargs = case
    torch.library.opcheck(getattr(torch.ops.replayssm, name).default, args, kwargs)


# ---------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------


def test_a_compiled_multi_layer_step_has_no_graph_break(stack_inputs):
    stack, pools, hs, slots = stack_inputs
    m2_pool, gdn_pool = _clone(pools[0]), _clone(pools[1])
    explained = torch._dynamo.explain(stack.step)(m2_pool, gdn_pool, hs[0], slots)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    nodes = [n for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]
    calls = [str(n.target) for n in nodes if "replayssm" in str(n.target)]
    assert sorted(calls) == sorted(["replayssm.gdn_decode", "replayssm.mamba2_decode"] * LAYERS)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_multi_layer_step_matches_eager_bit_for_bit(stack_inputs, backend):
    stack, pools, hs, slots = stack_inputs
    torch._dynamo.reset()
    compiled = torch.compile(stack.step, fullgraph=True, backend=backend)
    want = _run(stack.step, pools, hs, slots)
    got = _run(compiled, pools, hs, slots)
    _assert_same(got, want)
    # The step really ran (records and a flush on every layer's live slots; pad slot untouched).
    assert torch.equal(got[0]["cursors"][:, [3, 0, 5], 1], torch.ones(LAYERS, 3, dtype=I32))
    for pool, fresh in zip(got[:2], pools):
        for name in pool:
            assert torch.equal(pool[name][:, [1, 2, 4]], fresh[name][:, [1, 2, 4]]), name


def test_the_compiled_code_writes_the_pool_views_in_place(stack_inputs):
    """Inductor's code calls each op on views of the pool inputs, with no clone or copy of a
    pool (functionalization's copies reinplaced away)."""
    from torch._inductor.utils import run_and_get_code

    stack, pools, hs, slots = stack_inputs
    torch._dynamo.reset()
    compiled = torch.compile(stack.step, fullgraph=True)
    m2_pool, gdn_pool = _clone(pools[0]), _clone(pools[1])
    _, codes = run_and_get_code(compiled, m2_pool, gdn_pool, hs[0], slots)
    code = "\n".join(codes)
    calls = re.findall(r"torch\.ops\.replayssm\.(\w+)\.default\(", code)
    assert sorted(calls) == sorted(["mamba2_decode", "gdn_decode"] * LAYERS), calls
    assert "auto_functionalized" not in code
    # No copy of any pool-sized tensor: no clone, no copy_, no pool-sized empty buffer.
    assert not re.search(r"\bclone\(|\.copy_\(|aten\.copy", code), code
    pool_shapes = {tuple(t.shape) for p in (m2_pool, gdn_pool) for t in p.values()}
    layer_shapes = {s[1:] for s in pool_shapes}
    for shape in pool_shapes | layer_shapes:
        sizes = re.escape(", ".join(map(str, shape)))
        assert not re.search(rf"empty_strided\w*\(\({sizes},?\)", code), (shape, code)
    # And it computed the same as eager.
    want = _run(stack.step, pools, hs[:1], slots)
    assert all(torch.equal(m2_pool[n], want[0][n]) for n in m2_pool)
    assert all(torch.equal(gdn_pool[n], want[1][n]) for n in gdn_pool)


def test_a_compiled_verify_then_commit_matches_eager():
    gen = torch.Generator().manual_seed(2)
    stack = Stack(gen)
    fresh = _pool(stack.m2_layout, gen)
    slots = torch.tensor(SLOT_IDS, dtype=I32)
    hd = torch.randn(BATCH, T, WIDTH, generator=gen)
    accepted = torch.tensor([2, 1, 0, 0], dtype=I32)
    names = stack.m2_layout.ring_names

    def spec_step(pool, hd):
        dheads = hd.view(BATCH, T, 4, 16)
        outs = []
        for i in range(LAYERS):
            out = torch.empty(BATCH, T, 4, 16)
            torch.ops.replayssm.mamba2_verify(
                stack.m2, **_layer(pool, i), x=dheads, dt=hd[..., :4], A=stack.A[i],
                B=dheads[:, :, :2], C=dheads[:, :, 2:], z=dheads, D=stack.D[i],
                dt_bias=stack.m2_bias[i], slot_indices=slots, out=out,
            )  # fmt: skip
            rings = {arg: pool[name][i] for arg, name in zip(COMMIT_RING_ARGS, names)}
            torch.ops.replayssm.commit_drafts(stack.m2, cursors=pool["cursors"][i], **rings,
                                              num_accepted=accepted, slot_indices=slots)  # fmt: skip
            outs.append(out)
        return outs

    torch._dynamo.reset()
    compiled = torch.compile(spec_step, fullgraph=True)
    want_pool, got_pool = _clone(fresh), _clone(fresh)
    want, got = spec_step(want_pool, hd), compiled(got_pool, hd)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(got_pool[n], want_pool[n]) for n in fresh)
    assert torch.equal(
        got_pool["cursors"][:, [3, 0], 0], torch.tensor([[2, 1]] * LAYERS, dtype=I32)
    )


@pytest.mark.gpu
def test_cuda_graphs_reduce_overhead_matches_eager():
    """mode="reduce-overhead" (CUDA graphs) over a multi-layer step on per-layer views of one
    pool: bit for bit against eager over two flush cycles, the pool written in place, no skip."""
    from torch._dynamo.utils import counters

    dev, d = torch.device("cuda"), 64  # P = N = K = V = 64: head sizes the GPU tests build
    width = 4 * d
    m2_layout = mamba2_layout(num_heads=4, headdim=d, dstate=d, ngroups=2, window=L, drafts=T,
                              act_dtype=F32)  # fmt: skip
    gdn_layout_ = gdn_layout(num_k_heads=2, num_v_heads=4, head_k_dim=d, head_v_dim=d, window=L,
                             drafts=T, act_dtype=F32)  # fmt: skip
    m2_plan = plan_decode(m2_layout, BATCH, device=dev, check_slot_values=False, **M2_OPTIONS)
    gdn_plan = plan_decode(gdn_layout_, BATCH, device=dev, check_slot_values=False, **GDN_OPTIONS)
    m2, gdn = plan_handle(m2_plan), plan_handle(gdn_plan)
    gen = torch.Generator().manual_seed(13)
    static = dict(
        A=-(0.5 + torch.rand(4, generator=gen)), D=torch.randn(4, generator=gen),
        m2_bias=torch.rand(4, generator=gen) - 0.5,
        A_log=torch.log(0.5 + torch.rand(4, generator=gen)),
        gdn_bias=torch.rand(4, generator=gen) - 0.5,
        m2_ws=torch.empty(max(m2_plan.workspace_floats, 1)),
        gdn_ws=torch.empty(max(gdn_plan.workspace_floats, 1)),
        slots=torch.tensor(SLOT_IDS, dtype=I32),
    )  # fmt: skip
    static = {k: v.to(dev) for k, v in static.items()}
    pools = tuple({n: t.to(dev) for n, t in _pool(lay, gen).items()}
                  for lay in (m2_layout, gdn_layout_))  # fmt: skip
    hs = [torch.randn(BATCH, width, generator=gen).to(dev) for _ in range(2 * L + 1)]

    def step(m2_pool, gdn_pool, h):
        for i in range(LAYERS):
            heads = h.view(BATCH, 4, d)
            out = torch.empty(BATCH, 4, d, device=dev)
            torch.ops.replayssm.mamba2_decode(
                m2, **_layer(m2_pool, i), x=heads, dt=h[:, :4], A=static["A"], B=heads[:, :2],
                C=heads[:, 2:], z=heads, D=static["D"], dt_bias=static["m2_bias"],
                slot_indices=static["slots"], out=out, workspace=static["m2_ws"],
            )  # fmt: skip
            h = h * 0.5 + out.view(BATCH, width)
            heads = h.view(BATCH, 4, d)
            out = torch.empty(BATCH, 4, d, device=dev)
            torch.ops.replayssm.gdn_decode(
                gdn, **_layer(gdn_pool, i), q=heads[:, :2], k=heads[:, 2:], v=heads,
                a=h[:, :4], b=h[:, 4:8], A_log=static["A_log"], dt_bias=static["gdn_bias"],
                slot_indices=static["slots"], out=out, workspace=static["gdn_ws"],
            )  # fmt: skip
            h = h * 0.5 + out.view(BATCH, width)
        return h

    want_pools, got_pools = tuple(map(_clone, pools)), tuple(map(_clone, pools))
    # CUDA graphs may write only static inputs (else inductor skips them): an engine's pools are.
    for t in [*static.values(), *(t for p in got_pools for t in p.values())]:
        torch._dynamo.mark_static_address(t)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True, mode="reduce-overhead")
    ptrs = [t.data_ptr() for p in got_pools for t in p.values()]
    for h in hs:
        want = step(*want_pools, h)
        got = compiled(*got_pools, h.clone()).clone()  # (the graph's output buffer is reused)
        torch.cuda.synchronize()
        assert torch.equal(got, want)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert [t.data_ptr() for p in got_pools for t in p.values()] == ptrs
    for got_pool, want_pool in zip(got_pools, want_pools):
        assert all(torch.equal(got_pool[n], want_pool[n]) for n in want_pool)


def test_workspace_is_required_only_where_the_launch_reads_it():
    """A plan's workspace_floats covers both its steps (the larger need), but only the split
    kernels read it: a per-item verify of a plan whose standard step splits (or the reverse)
    takes no workspace, and one that reads it must get workspace_floats elements."""
    m2, _ = _layouts()
    cpu_plan = plan_decode(m2, 2, device="cpu")
    step_split = dataclasses.replace(cpu_plan, flag_bits=FLAG_SPLIT, workspace_floats=64,
                                     verify_kernel="per-item")  # fmt: skip
    verify_split = dataclasses.replace(cpu_plan, workspace_floats=64, verify_kernel="split")
    assert step_split.reads_workspace() and not step_split.reads_workspace(verify=True)
    assert verify_split.reads_workspace(verify=True) and not verify_split.reads_workspace()
    empty = torch.empty(0)
    assert resolve_workspace(step_split, empty, verify=True) is empty
    assert resolve_workspace(verify_split, empty) is empty
    assert resolve_workspace(step_split, None, verify=True).numel() == 0
    assert resolve_workspace(verify_split, None, verify=True).numel() == 64
    for plan, verify in ((step_split, False), (verify_split, True)):
        with pytest.raises(ValueError, match=r"^workspace: expected at least 64 float32 elements"):
            resolve_workspace(plan, empty, verify=verify)


def test_commit_ring_args_name_every_familys_rings():
    """commit_drafts' rings by role hold for every family's first three rings (those with drafts)."""
    from replayssm_jit.families import FAMILIES

    for fam in FAMILIES.values():
        value, key, decay = fam.rings[:3]
        assert (value.heads, value.width, key.heads, key.width) == (
            "value",
            "value_dim",
            "key",
            "key_dim",
        ), fam.name
        assert decay.heads == "value" and not decay.read_copy_only, fam.name
