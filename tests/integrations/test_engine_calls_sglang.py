"""SGLang's GDN decode calls made as SGLang's kernel dispatcher makes them (keyword-only
arguments, q/k/v [1, B, ...], raw gates [B, HV], query_start_loc, PAD_SLOT_ID -1), with the pad
rows of a CUDA graph mapped from mamba_cache_indices, on the CPU path against the float64
references; a pad row never touches the live slot its request index 0 names."""

from __future__ import annotations

import pytest
import torch

from replayssm_jit import gdn_layout
from replayssm_jit.integrations.sglang import PAD_SLOT_ID, SGLangLayer, mamba_slots
from replayssm_jit.reference import gdn_gates
from replayssm_jit.reference.gdn import gdn_step

F32, F64, I32, I64 = torch.float32, torch.float64, torch.int32, torch.int64
KH, HV, K, V = 2, 4, 16, 8
SLOTS, L, MAX_BS = 8, 4, 6
TOL = 2e-5

pytestmark = pytest.mark.usefixtures("no_launch_env")


def rel(actual, expected):
    a, e = actual.to(F64), expected.to(F64)
    return float(torch.linalg.vector_norm(a - e) / torch.linalg.vector_norm(e))


def setup():
    layout = gdn_layout(num_k_heads=KH, num_v_heads=HV, head_k_dim=K, head_v_dim=V, window=L,
                        act_dtype=F32)  # fmt: skip
    ssm_states = torch.zeros(SLOTS, HV, V, K)  # SGLang's mamba pool for this layer
    return SGLangLayer(layout, ssm_states, max_batch=MAX_BS), ssm_states


def test_pad_rows_never_alias_a_live_slot():
    """The issue's case: req_pool_indices [1, 2, 0, 0] (two live rows, two CUDA-graph pads with
    request index 0) gave slots [5, 1, 3, 3]; slot 3 belongs to request 0, live elsewhere."""
    layer, _ = setup()
    req_to_mamba_slot = torch.tensor([3, 5, 1, 7], dtype=I32)
    req_pool_indices = torch.tensor([1, 2, 0, 0], dtype=I64)
    mamba_cache_indices = req_to_mamba_slot[req_pool_indices]  # SGLang's get_mamba_indices
    assert mamba_cache_indices.tolist() == [5, 1, 3, 3]
    for live in (2, torch.tensor(2)):
        assert layer.pad_rows(mamba_cache_indices, live).tolist() == [5, 1, -1, -1]
        got = mamba_slots(req_pool_indices, req_to_mamba_slot, live)
        assert got.tolist() == [5, 1, -1, -1]
    # A replay with more live rows reuses the same buffers.
    assert layer.pad_rows(mamba_cache_indices, 3).tolist() == [5, 1, 3, -1]


def tokens(gen, bs):
    q = torch.randn(1, bs, KH, K, generator=gen)
    k = torch.randn(1, bs, KH, K, generator=gen)
    v = torch.randn(1, bs, HV, V, generator=gen)
    a = torch.randn(bs, HV, generator=gen)
    b = torch.randn(bs, HV, generator=gen)
    return q, k, v, a, b


def oracle(ref, slots, q, k, v, a, b, A_log, dt_bias):
    o = torch.zeros(len(slots), HV, V, dtype=F64)
    for r, s in enumerate(slots):
        if s == PAD_SLOT_ID:
            continue
        g, beta = gdn_gates(A_log, a[r][None], dt_bias, b[r][None])
        o_r, st = gdn_step(ref[s][None], q[0, r][None], k[0, r][None], v[0, r][None], g, beta)
        o[r], ref[s] = o_r[0], st[0]
    return o


@pytest.mark.parametrize("packed", [False, True], ids=["decode", "packed_decode"])
def test_gdn_decode_as_sglang_calls_it(packed):
    gen = torch.Generator().manual_seed(11)
    layer, ssm_states = setup()
    A_log = torch.rand(HV, generator=gen) - 1.0
    dt_bias = 0.5 * torch.randn(HV, generator=gen)
    req_to_mamba_slot = torch.tensor([3, 5, 1, 7, 6], dtype=I32)
    req_pool_indices = torch.tensor([1, 2, 4, 0, 0], dtype=I64)  # 3 live rows, 2 pads
    bs, live = 5, 3
    ref = torch.zeros(SLOTS, HV, V, K, dtype=F64)
    before = {n: t.clone() for n, t in layer.pool.items()}
    for _ in range(2 * L + 1):
        cache_indices = layer.pad_rows(req_to_mamba_slot[req_pool_indices], live)
        slots = cache_indices.tolist()
        q, k, v, a, b = tokens(gen, bs)
        if packed:
            mixed_qkv = torch.cat([q[0].flatten(1), k[0].flatten(1), v[0].flatten(1)], dim=1)
            o = layer.packed_decode(mixed_qkv, a, b, A_log=A_log, dt_bias=dt_bias,
                                    scale=K**-0.5, ssm_states=ssm_states,
                                    cache_indices=cache_indices, num_v_heads=HV,
                                    head_v_dim=V)  # fmt: skip
        else:
            o = layer.decode(q, k, v, a, b, A_log=A_log, dt_bias=dt_bias, ssm_states=ssm_states,
                             cache_indices=cache_indices,
                             query_start_loc=torch.arange(bs + 1, dtype=I32))  # fmt: skip
        assert o.shape == (1, bs, HV, V)
        assert rel(o[0], oracle(ref, slots, q, k, v, a, b, A_log, dt_bias)) < TOL
        assert torch.equal(o[0, live:], torch.zeros(bs - live, HV, V))
    for name, t in layer.pool.items():  # slot 3 is request 0's: the pads must not touch it
        for s in (0, 2, 3, 4, 7):
            assert torch.equal(before[name][s], t[s]), (name, s)


def test_unsupported_dispatcher_inputs_are_refused_and_change_nothing():
    gen = torch.Generator().manual_seed(12)
    layer, ssm_states = setup()
    q, k, v, a, b = tokens(gen, 2)
    before = {n: t.clone() for n, t in layer.pool.items()}
    with pytest.raises(TypeError, match="not supported yet"):
        layer.decode(q, k, v, a, b, A_log=torch.zeros(HV), dt_bias=torch.zeros(HV),
                     ssm_states=ssm_states, cache_indices=torch.tensor([1, 2], dtype=I32),
                     query_start_loc=torch.arange(3, dtype=I32),
                     intermediate_states_buffer=torch.zeros(1))  # fmt: skip
    for name, t in layer.pool.items():
        assert torch.equal(before[name], t), name


def test_pad_rows_traces_whole_and_allocates_nothing():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    layer, _ = setup()
    indices = torch.tensor([5, 1, 3, 3], dtype=I64)
    explained = torch._dynamo.explain(layer.pad_rows)(indices, torch.tensor(2))
    assert explained.graph_break_count == 0, explained.break_reasons
    with Recorder() as rec:
        got = layer.pad_rows(indices, torch.tensor(2))
    assert got.tolist() == [5, 1, -1, -1]
    assert not {"empty", "zeros", "clone", "arange", "full"} & set(rec.ops), rec.ops


def test_mamba2_decode_as_sglang_calls_it():
    """x_h [bs, H, P], dt and the parameters head-expanded, state_batch_indices
    cache_indices.unsqueeze(-1), pads -1 from pad_rows."""
    from replayssm_jit import mamba2_layout
    from replayssm_jit.reference.mamba2 import mamba2_step

    H, G, P, N = 4, 2, 8, 16
    gen = torch.Generator().manual_seed(13)
    layout = mamba2_layout(num_heads=H, headdim=P, dstate=N, ngroups=G, window=L, act_dtype=F32)
    ssm_state = torch.zeros(SLOTS, H, P, N)
    layer = SGLangLayer(layout, ssm_state, max_batch=MAX_BS, dt_softplus=True)
    A, D, dt_bias = -(0.5 + torch.rand(H, generator=gen)), torch.randn(H), torch.rand(H) - 0.5
    A_expanded = A.view(H, 1, 1).expand(H, P, N)
    D_expanded = D.view(H, 1).expand(H, P)
    ref = torch.zeros(SLOTS, H, P, N, dtype=F64)
    before = {n: t.clone() for n, t in layer.pool.items()}
    req_to_mamba_slot = torch.tensor([3, 5, 1], dtype=I32)
    cache_indices = layer.pad_rows(req_to_mamba_slot[torch.tensor([1, 2, 0, 0])], 2)
    for _ in range(2 * L + 1):
        x_h = torch.randn(4, H, P, generator=gen)
        dt = torch.rand(4, H, generator=gen)
        B_h, C_h = torch.randn(4, G, N, generator=gen), torch.randn(4, G, N, generator=gen)
        out = torch.empty_like(x_h)
        layer.selective_state_update(
            ssm_state, x_h, dt[:, :, None].expand(-1, -1, P), A_expanded, B_h, C_h, D_expanded,
            z=None, dt_bias=dt_bias.view(H, 1).expand(H, P), dt_softplus=True,
            state_batch_indices=cache_indices.unsqueeze(-1), out=out,
        )  # fmt: skip
        o, new = mamba2_step(ref[[5, 1]], x_h[:2], dt[:2], A, B_h[:2], C_h[:2], D=D,
                             dt_bias=dt_bias, dt_softplus=True)  # fmt: skip
        ref[[5, 1]] = new
        assert rel(out[:2], o) < TOL and torch.equal(out[2:], torch.zeros(2, H, P))
    for name, t in layer.pool.items():
        for s in (0, 2, 3, 4, 6, 7):
            assert torch.equal(before[name][s], t[s]), (name, s)
    with pytest.raises(ValueError, match="disable_state_update: expected False for a one-token"):
        layer.selective_state_update(
            ssm_state, x_h, dt[:, :, None].expand(-1, -1, P), A_expanded, B_h, C_h, D_expanded,
            dt_bias=dt_bias.view(H, 1).expand(H, P), dt_softplus=True,
            state_batch_indices=cache_indices, out=out, disable_state_update=True,
        )  # fmt: skip


# --- prefix tracking: mamba_track_mask -------------------------------------------------------

TRACK_INTERVAL = 3  # SGLang's track interval, in tokens: not a multiple of the window L
M2 = (4, 2, 8, 16)  # Mamba-2 H, G, P, N


def _track_layer(family, track_prefix=True, drafts=1):
    from replayssm_jit import mamba2_layout

    if family == "mamba2":
        H, G, P, N = M2
        layout = mamba2_layout(num_heads=H, headdim=P, dstate=N, ngroups=G, window=L,
                               drafts=drafts, act_dtype=F32)  # fmt: skip
        state = torch.zeros(SLOTS, H, P, N)
        return SGLangLayer(layout, state, max_batch=MAX_BS, track_prefix=track_prefix,
                           dt_softplus=True), state  # fmt: skip
    layout = gdn_layout(num_k_heads=KH, num_v_heads=HV, head_k_dim=K, head_v_dim=V, window=L,
                        drafts=drafts, act_dtype=F32)  # fmt: skip
    state = torch.zeros(SLOTS, HV, V, K)
    return SGLangLayer(layout, state, max_batch=MAX_BS, track_prefix=track_prefix), state


class _Calls:
    """One family's SGLang step with its float64 oracle (the rows' states in `ref`)."""

    def __init__(self, call, gen):
        self.call, self.gen = call, gen
        if call == "mamba2":
            H = M2[0]
            self.A, self.D = -(0.5 + torch.rand(H, generator=gen)), torch.randn(H, generator=gen)
            self.dt_bias = torch.rand(H, generator=gen) - 0.5
        else:
            self.A_log = torch.rand(HV, generator=gen) - 1.0
            self.dt_bias = 0.5 * torch.randn(HV, generator=gen)

    def step(self, layer, state, cache_indices, ref, **kw):
        """One step of every row; returns its outputs [bs, heads, dim] and the oracle's."""
        gen, bs, slots = self.gen, cache_indices.shape[0], cache_indices.tolist()
        if self.call == "mamba2":
            from replayssm_jit.reference.mamba2 import mamba2_step

            H, G, P, N = M2
            x, dt = torch.randn(bs, H, P, generator=gen), torch.rand(bs, H, generator=gen)
            B, C = torch.randn(bs, G, N, generator=gen), torch.randn(bs, G, N, generator=gen)
            out = torch.empty_like(x)
            layer.selective_state_update(
                state, x, dt[:, :, None].expand(-1, -1, P), self.A.view(H, 1, 1).expand(H, P, N),
                B, C, self.D.view(H, 1).expand(H, P), z=None,
                dt_bias=self.dt_bias.view(H, 1).expand(H, P), dt_softplus=True,
                state_batch_indices=cache_indices.unsqueeze(-1), out=out, **kw,
            )  # fmt: skip
            want = torch.zeros(bs, H, P, dtype=F64)
            live = [r for r, s in enumerate(slots) if s != PAD_SLOT_ID]
            rows = [slots[r] for r in live]
            y, new = mamba2_step(ref[rows], x[live], dt[live], self.A, B[live], C[live], D=self.D,
                                 dt_bias=self.dt_bias, dt_softplus=True)  # fmt: skip
            want[live], ref[rows] = y, new
            return out, want
        q, k, v, a, b = tokens(gen, bs)
        args = dict(A_log=self.A_log, dt_bias=self.dt_bias, ssm_states=state,
                    cache_indices=cache_indices, **kw)  # fmt: skip
        if self.call == "packed_decode":
            mixed_qkv = torch.cat([q[0].flatten(1), k[0].flatten(1), v[0].flatten(1)], dim=1)
            o = layer.packed_decode(mixed_qkv, a, b, scale=K**-0.5, num_v_heads=HV,
                                    head_v_dim=V, **args)  # fmt: skip
        else:
            o = layer.decode(q, k, v, a, b, query_start_loc=torch.arange(bs + 1, dtype=I32),
                             **args)  # fmt: skip
        return o[0], oracle(ref, slots, q, k, v, a, b, self.A_log, self.dt_bias)


@pytest.mark.parametrize("call", ["decode", "packed_decode", "mamba2"])
def test_prefix_tracking_copies_the_whole_state_at_each_interval(call):
    """SGLang's decode with prefix tracking: the step gets mamba_track_mask (seq_len % interval
    == 0 on live rows, False on pads), then SGLang copies ssm_states[cache_indices[i]] to
    ssm_states[mamba_track_indices[i]] for the masked rows (track_mamba_states_if_needed, here
    as Python). Every copied state is the float64 state at that token, also mid-window; the
    pad rows' slot (request 0's) and the unnamed slots are untouched."""
    gen = torch.Generator().manual_seed(31)
    family = "mamba2" if call == "mamba2" else "gdn"
    layer, state = _track_layer(family)
    calls = _Calls(call, gen)
    state.copy_(0.3 * torch.randn(state.shape, generator=gen))  # (cursors zero: checkpoints)
    ref = state.to(F64)
    req_to_mamba_slot = torch.tensor([3, 5, 1, 7, 6], dtype=I32)
    req_pool_indices = torch.tensor([1, 2, 4, 0, 0], dtype=I64)  # 3 live rows, 2 pads
    bs, live = 5, 3
    track_indices = torch.tensor([0, 2, 4, 0, 0], dtype=I64)  # SGLang zero-fills pad rows
    seq_lens = torch.tensor([4, 6, 7, 1, 1])
    before = {n: t.clone() for n, t in layer.pool.items()}
    mid_window = 0
    for _ in range(3 * L + 1):
        cache_indices = layer.pad_rows(req_to_mamba_slot[req_pool_indices], live)
        slots = cache_indices.tolist()
        seq_lens += 1
        mask = (seq_lens % TRACK_INTERVAL == 0) & (torch.arange(bs) < live)
        held = layer.pool["cursors"][[max(s, 0) for s in slots], 0].tolist()
        out, want = calls.step(layer, state, cache_indices, ref, mamba_track_mask=mask)
        assert rel(out, want) < TOL
        assert torch.equal(out[live:], torch.zeros_like(out[live:]))
        for i in mask.nonzero().flatten().tolist():  # SGLang's copy after the step
            state[track_indices[i]] = state[slots[i]]
            assert layer.pool["cursors"][slots[i], 0] == 0  # flushed: nothing held
            assert rel(state[track_indices[i]], ref[slots[i]]) < TOL
            mid_window += held[i] + 1 < L  # (a flush the window alone would not have made)
    assert mid_window >= 4
    for name, t in layer.pool.items():  # request 0's slot and the unnamed ones
        for s in (3, 7) if name == "state" else (0, 2, 3, 4, 7):
            assert torch.equal(before[name][s], t[s]), (name, s)


@pytest.mark.parametrize("call", ["decode", "packed_decode", "mamba2"])
def test_track_masks_are_checked_by_name_and_change_nothing(call):
    gen = torch.Generator().manual_seed(32)
    family = "mamba2" if call == "mamba2" else "gdn"
    calls = _Calls(call, gen)
    plain, plain_state = _track_layer(family, track_prefix=False)
    tracked, tracked_state = _track_layer(family)
    slots = torch.tensor([1, 2, -1], dtype=I32)
    ref = torch.zeros(SLOTS, *plain_state.shape[1:], dtype=F64)
    bad = [
        (plain, plain_state, torch.ones(3, dtype=torch.bool), ValueError,
         r"mamba_track_mask: expected None \(a layer made without track_prefix=True"),
        (tracked, tracked_state, torch.ones(3, dtype=I32), TypeError,
         r"mamba_track_mask: expected dtype one of \[torch.bool, torch.uint8\], got torch.int32"),
        (tracked, tracked_state, torch.ones(4, dtype=torch.bool), ValueError,
         r"mamba_track_mask: expected shape \[3\], got \[4\]"),
        (tracked, tracked_state, torch.ones(6, dtype=torch.bool)[::2], ValueError,
         "mamba_track_mask: expected a contiguous tensor"),
    ]  # fmt: skip
    for layer, state, mask, error, message in bad:
        before = {n: t.clone() for n, t in layer.pool.items()}
        with pytest.raises(error, match=message):
            calls.step(layer, state, slots, ref, mamba_track_mask=mask)
        for name, t in layer.pool.items():
            assert torch.equal(before[name], t), (name, message)


def test_track_prefix_needs_a_layout_without_drafts_and_verifies_take_no_mask():
    for family in ("mamba2", "gdn"):
        with pytest.raises(ValueError, match="track_prefix: expected False with drafts=2"):
            _track_layer(family, drafts=2)
        with pytest.raises(TypeError, match="track_prefix: expected a bool, got str"):
            _track_layer(family, track_prefix="yes")
    # A tree verify (a layout with drafts) refuses a mask rather than drop it.
    layer, state = _track_layer("mamba2", track_prefix=False, drafts=2)
    H, G, P, N = M2
    x = torch.zeros(2, 2, H, P)
    with pytest.raises(ValueError, match="mamba_track_mask: expected None with a tree verify"):
        layer.selective_state_update(
            state, x, torch.zeros(2, 2, H, P), -torch.ones(H, P, N), torch.zeros(2, 2, G, N),
            torch.zeros(2, 2, G, N), None, dt_bias=None, dt_softplus=True,
            state_batch_indices=torch.tensor([1, 2], dtype=I32), out=torch.empty_like(x),
            disable_state_update=True, cache_steps=2, mamba_track_mask=torch.ones(2, dtype=bool),
        )  # fmt: skip
    layer, state = _track_layer("gdn", track_prefix=False, drafts=2)
    with pytest.raises(TypeError, match="not supported yet"):
        layer.target_verify(torch.zeros(HV), torch.zeros(HV), torch.zeros(1, 4, KH, K),
                            torch.zeros(1, 4, KH, K), torch.zeros(1, 4, HV, V),
                            torch.zeros(4, HV), torch.zeros(4, HV), ssm_states=state,
                            cache_indices=torch.tensor([1, 2], dtype=I32),
                            query_start_loc=torch.tensor([0, 2, 4], dtype=I32), cache_steps=2,
                            mamba_track_mask=torch.ones(2, dtype=torch.bool))  # fmt: skip
