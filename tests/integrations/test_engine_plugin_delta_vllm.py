"""The vLLM plugin on GDN (Qwen3-Next / Qwen3.5) and KDA (Kimi-Linear) layers, through a fake
vLLM written from vLLM's code (fake_vllm.py): register() rebinds the decode names the layers'
modules call and registers lifecycle subclasses through register_oot; the layers' own core
methods then decode on ReplaySSM, leave the prefill to vLLM's chunk kernels, and after a
prefill writes ssm_state[idx] the next decode starts from that state (float64 references).
A plugin that skips the reset fails the same comparison. Pads and slots no row names keep
every bit; register() twice changes nothing; without REPLAYSSM_VLLM nothing is patched."""

from __future__ import annotations

import logging
import types

import pytest
import torch
from fake_vllm import (
    GDN,
    KDA,
    M2,
    EngineKernelReached,
    ForwardContext,
    Mamba2AttentionMetadata,
)
from fake_vllm import install as install_fake_vllm
from vllm_page_runs import gdn_metadata

from replayssm_jit.core.cursor_words import CURSOR_HELD
from replayssm_jit.integrations.vllm import hooks, plugin
from replayssm_jit.reference import gdn_gates
from replayssm_jit.reference.gdn import gdn_step
from replayssm_jit.reference.kda import kda_step
from replayssm_jit.reference.mamba2 import mamba2_step

F32, F64, I32 = torch.float32, torch.float64, torch.int32
KH, HV, K, V = 2, 4, 16, 8  # GDN key heads, value heads, head dims
KD = 16  # KDA head dim (K = V), HV heads
SLOTS, L = 9, 4
TOL = 2e-5
PREFIX = "model.layers.0.linear_attn"

pytestmark = pytest.mark.usefixtures("no_launch_env")


def rel(actual, expected):
    a, e = actual.to(F64), expected.to(F64)
    return float(torch.linalg.vector_norm(a - e) / max(torch.linalg.vector_norm(e), 1e-30))


@pytest.fixture
def vllm(monkeypatch):
    """The fake vLLM, the setting on, a fresh process-wide backend."""
    monkeypatch.setenv("REPLAYSSM_VLLM", "1")
    monkeypatch.setenv("REPLAYSSM_VLLM_WINDOW", str(L))
    monkeypatch.setattr(plugin.BACKEND, "_layers", {})
    monkeypatch.setattr(hooks, "_DRAFTS", {})
    monkeypatch.setattr(hooks, "_RESETS", {})
    return install_fake_vllm(monkeypatch, lower_bound=-5.0)


# ---------------------------------------------------------------------------------------------
# register(): what it patches, twice, and without the setting
# ---------------------------------------------------------------------------------------------


def test_register_rebinds_the_decode_names_and_registers_the_layer_classes(vllm):
    gdn, kda, custom_op = vllm[GDN], vllm[KDA], vllm["vllm.model_executor.custom_op"]
    originals = (
        gdn.fused_sigmoid_gating_delta_rule_update,
        gdn.fused_recurrent_gated_delta_rule_packed_decode,
        kda.fused_recurrent_kda,
    )
    prefill = (gdn.fla_chunk_gated_delta_rule, kda.chunk_kda_with_fused_gate)  # fmt: skip
    assert plugin.register() is True
    ssu = vllm["vllm.model_executor.layers.mamba.ops.ssu_dispatch"]
    triton = vllm["vllm.config.mamba"].MambaBackendEnum.TRITON
    backend_cls = ssu._BACKEND_REGISTRY[triton]
    assert backend_cls.__name__ == "ReplaySSMSSUBackend"
    entries = (
        gdn.fused_sigmoid_gating_delta_rule_update,
        gdn.fused_recurrent_gated_delta_rule_packed_decode,
        kda.fused_recurrent_kda,
    )
    assert [e.__wrapped__ for e in entries] == list(originals)
    assert (gdn.fla_chunk_gated_delta_rule, kda.chunk_kda_with_fused_gate) == prefill
    oot = dict(custom_op.op_registry_oot)
    assert set(oot) == {"QwenGatedDeltaNetAttention", "KimiGatedDeltaNetAttention", "MambaMixer2"}
    layer = gdn.QwenGatedDeltaNetAttention(PREFIX, KH, HV, K, V, torch.zeros(HV), torch.zeros(HV))
    assert type(layer) is oot["QwenGatedDeltaNetAttention"]
    assert isinstance(layer, gdn.QwenGatedDeltaNetAttention)
    # Twice: the same entries and classes, nothing wrapped twice, no duplicate registration.
    assert plugin.register() is True
    assert (gdn.fused_sigmoid_gating_delta_rule_update,
            gdn.fused_recurrent_gated_delta_rule_packed_decode,
            kda.fused_recurrent_kda) == entries  # fmt: skip
    assert custom_op.op_registry_oot == oot
    assert ssu._BACKEND_REGISTRY[triton] is backend_cls


@pytest.mark.parametrize(
    ("mode", "pages", "num_spec", "why"),
    [("all", "1", 0, "'all'"), ("align", "0", 0, "REPLAYSSM_VLLM_PAGES=1"),
     ("align", "1", 2, "num_speculative_tokens 2")],
)  # fmt: skip
def test_prefix_caching_is_refused_where_the_copies_would_miss_our_entries(
    vllm, monkeypatch, mode, pages, num_spec, why
):
    """vLLM's block copies would leave the rings and cursors behind, or copy a draft's block
    (silently wrong outputs): every hooked layer class refuses these modes, naming
    mamba_cache_mode and why; "none" builds (align mode itself: test_engine_align_vllm.py)."""
    monkeypatch.setenv("REPLAYSSM_VLLM_PAGES", pages)
    plugin.register()
    config = vllm["vllm.config"].get_current_vllm_config()
    config.speculative_config = types.SimpleNamespace(num_speculative_tokens=num_spec)
    A, gen = torch.zeros(HV), torch.Generator().manual_seed(0)
    builds = {
        "gdn": lambda: vllm[GDN].QwenGatedDeltaNetAttention(PREFIX, KH, HV, K, V, A, A),
        "kda": lambda: vllm[KDA].KimiGatedDeltaNetAttention(PREFIX, HV, K, A, A),
        "mamba2": lambda: Mamba2Run(vllm, gen),
    }
    for build in builds.values():
        config.cache_config.mamba_cache_mode = mode
        with pytest.raises(ValueError, match=rf"mamba_cache_mode: expected .*got '{mode}'.*{why}"):
            build()
        config.cache_config.mamba_cache_mode = "none"
        build()  # (the same class builds without prefix caching)


def test_with_the_real_vllm_the_names_and_classes_are_installed(monkeypatch):
    pytest.importorskip("vllm")
    monkeypatch.setenv("REPLAYSSM_VLLM", "1")
    import importlib

    from vllm.model_executor import custom_op

    saved = dict(custom_op.op_registry_oot)
    modules = {m: importlib.import_module(m) for m in hooks.DECODE_NAMES}
    names = {(m, n): getattr(mod, n) for m, mod in modules.items() for n in hooks.DECODE_NAMES[m]}
    try:
        plugin.register()
        for (m, n), fn in names.items():
            assert getattr(modules[m], n).__wrapped__ is fn
        assert any(c.__name__.startswith("ReplaySSM") for c in custom_op.op_registry_oot.values())
    finally:
        for (m, n), fn in names.items():
            setattr(modules[m], n, fn)
        custom_op.op_registry_oot.clear()
        custom_op.op_registry_oot.update(saved)


def test_without_the_setting_nothing_is_patched(vllm, monkeypatch, caplog):
    monkeypatch.delenv("REPLAYSSM_VLLM")
    gdn, kda = vllm[GDN], vllm[KDA]
    before = (gdn.fused_sigmoid_gating_delta_rule_update, kda.fused_recurrent_kda)
    with caplog.at_level(logging.INFO, "replayssm_jit.vllm"):
        assert plugin.register() is False
    assert "REPLAYSSM_VLLM=1" in caplog.text
    assert (gdn.fused_sigmoid_gating_delta_rule_update, kda.fused_recurrent_kda) == before
    assert vllm["vllm.model_executor.custom_op"].op_registry_oot == {}
    with pytest.raises(EngineKernelReached):
        gdn.fused_sigmoid_gating_delta_rule_update()


def test_another_plugins_layer_class_is_left_alone_with_its_decode(vllm, caplog):
    custom_op, gdn = vllm["vllm.model_executor.custom_op"], vllm[GDN]

    class Theirs(gdn.QwenGatedDeltaNetAttention):
        pass

    gdn.QwenGatedDeltaNetAttention.register_oot(Theirs)
    decode = gdn.fused_sigmoid_gating_delta_rule_update
    with caplog.at_level(logging.WARNING, "replayssm_jit.vllm"):
        assert plugin.register() is True
    assert custom_op.op_registry_oot["QwenGatedDeltaNetAttention"] is Theirs
    assert "cannot be reset" in caplog.text
    # Its decode stays vLLM's: ReplaySSM without the reset would replay stale records.
    assert gdn.fused_sigmoid_gating_delta_rule_update is decode
    assert getattr(vllm[KDA].fused_recurrent_kda, "_replayssm_entry", False)


# ---------------------------------------------------------------------------------------------
# HeldReset: the device-side reset itself
# ---------------------------------------------------------------------------------------------


def test_held_reset_zeroes_live_rows_and_keeps_pads_bit_identical():
    gen = torch.Generator().manual_seed(3)
    cursors = torch.randint(1, 7, (SLOTS, 4), generator=gen, dtype=I32)
    reset = hooks.HeldReset(cursors, pad_slot_id=0)
    buffers = [t.data_ptr() for t in (reset.target, reset.is_pad, reset.scratch, reset.rows)]
    before = cursors.clone()
    # Pads: the null block 0, PAD_SLOT_ID -1, an id past the pool; int64 and [n, 1] accepted.
    reset(torch.tensor([[3], [0], [-1], [7], [SLOTS + 4]], dtype=torch.int64))
    assert torch.equal(cursors[[3, 7]], torch.zeros(2, 4, dtype=I32))
    keep = [s for s in range(SLOTS) if s not in (3, 7)]
    assert torch.equal(cursors[keep], before[keep])
    reset(torch.tensor([5], dtype=I32))
    assert torch.equal(cursors[5], torch.zeros(4, dtype=I32))
    assert buffers == [t.data_ptr() for t in (reset.target, reset.is_pad, reset.scratch,
                                              reset.rows)]  # fmt: skip
    with pytest.raises(TypeError, match="slots: expected an integer tensor, got dtype"):
        reset(torch.tensor([1.0]))


# ---------------------------------------------------------------------------------------------
# GDN: Qwen's _forward_core, prefill -> decode -> recycled slot -> decode
# ---------------------------------------------------------------------------------------------


class GDNRun:
    """Drives the fake Qwen layer and keeps the float64 reference per slot."""

    def __init__(self, mods, gen, packed=False):
        self.mods, self.gen = mods, gen
        self.A_log, self.dt_bias = (
            torch.rand(HV, generator=gen) - 1.0,
            torch.rand(HV, generator=gen),
        )
        self.layer = mods[GDN].QwenGatedDeltaNetAttention(
            PREFIX, KH, HV, K, V, self.A_log, self.dt_bias, packed_decode=packed
        )
        self.state = torch.zeros(SLOTS, HV, V, K)
        self.layer.kv_cache = (torch.zeros(SLOTS, 1), self.state)
        self.ref: dict[int, torch.Tensor] = {}

    def step(self, decodes, prefills=(), lens=()):
        md = gdn_metadata(decodes, prefills, lens)
        n = md.num_actual_tokens
        mixed = torch.randn(n, 2 * KH * K + HV * V, generator=self.gen)
        a, b = torch.randn(n, HV, generator=self.gen), torch.randn(n, HV, generator=self.gen)
        out = torch.zeros(n, HV, V)
        self.mods["vllm.forward_context"]._current = ForwardContext({PREFIX: md})
        self.layer._forward_core(mixed, b, a, out)
        q, k, v = self.layer.rearrange_mixed_qkv(mixed)
        g, beta = gdn_gates(self.A_log, a, self.dt_bias, b)
        errors = {}
        for r, s in enumerate(decodes):
            if s <= 0:  # the null block 0 or vLLM's PAD_SLOT_ID -1
                assert torch.equal(out[r], torch.zeros(HV, V)), "a pad row's output"
                continue
            o, new = gdn_step(self.ref[s][None], q[0, r][None], k[0, r][None], v[0, r][None],
                              g[r][None], beta[r][None])  # fmt: skip
            self.ref[s] = new[0]
            errors[s] = rel(out[r], o[0])
        for s in prefills:  # what vLLM wrote is the new sequence's state
            self.ref[s] = self.state[s].to(F64)
        return errors


def snapshot(layer, slots):
    return {n: t[slots].clone() for n, t in layer.pool.items()}


@pytest.mark.parametrize("broken", [False, True], ids=["reset", "broken-no-reset"])
def test_gdn_decode_after_a_prefill_starts_from_the_written_state(vllm, monkeypatch, broken):
    assert plugin.register() is True
    if broken:  # a plugin that forgets the reset: the recycled slot replays stale records
        monkeypatch.setattr(hooks, "reset_held", lambda layer, slots: None)
    run = GDNRun(vllm, torch.Generator().manual_seed(11))
    run.step([], [2, 5], [3, 2])
    for _ in range(3):
        assert max(run.step([2, 5, 0]).values()) < TOL
    layer = plugin.BACKEND.layer(run.state)
    assert layer.pool["cursors"][5, CURSOR_HELD] > 0  # the recycled slot holds records
    quiet = [0, 1, 3, 4, 6, 8]
    before = snapshot(layer, quiet)
    # A mixed batch: slot 2 decodes (peeled off), slot 5 is a new request's, 7 a fresh one.
    assert run.step([2], [5, 7], [2, 3])[2] < TOL
    if not broken:
        assert torch.equal(layer.pool["cursors"][[5, 7]], torch.zeros(2, 4, dtype=I32))
    errors = [run.step([2, 5, 7, 0, -1]) for _ in range(3)]
    after = snapshot(layer, quiet)
    assert all(torch.equal(before[n], after[n]) for n in before), "pads and unnamed slots"
    assert len(vllm[GDN].prefill_calls) == 2  # the prefill stayed vLLM's
    if broken:
        assert errors[0][5] > 1e-2 and errors[0][7] < TOL
    else:
        assert max(max(e.values()) for e in errors) < TOL


def test_gdn_packed_decode_routes_to_replayssm(vllm):
    assert plugin.register() is True
    run = GDNRun(vllm, torch.Generator().manual_seed(12), packed=True)
    run.step([], [1, 4], [2, 2])
    gen = run.gen
    for _ in range(2):
        md = gdn_metadata([1, 4, 0], [], [])
        mixed = torch.randn(3, 2 * KH * K + HV * V, generator=gen)
        a, b = torch.randn(3, HV, generator=gen), torch.randn(3, HV, generator=gen)
        out = torch.zeros(3, HV, V)
        vllm["vllm.forward_context"]._current = ForwardContext({PREFIX: md})
        run.layer._forward_core(mixed, b, a, out)
        q, k, v = run.layer.rearrange_mixed_qkv(mixed)
        g, beta = gdn_gates(run.A_log, a, run.dt_bias, b)
        for r, s in enumerate([1, 4]):
            o, new = gdn_step(run.ref[s][None], q[0, r][None], k[0, r][None], v[0, r][None],
                              g[r][None], beta[r][None])  # fmt: skip
            run.ref[s] = new[0]
            assert rel(out[r], o[0]) < TOL
        assert torch.equal(out[2], torch.zeros(HV, V))


# ---------------------------------------------------------------------------------------------
# KDA: Kimi-Linear's _forward (fla's fused_recurrent_kda with g, beta formed by vLLM)
# ---------------------------------------------------------------------------------------------


class KDARun:
    def __init__(self, mods, gen):
        self.mods, self.gen, self.kda = mods, gen, mods[KDA]
        self.A_log = (torch.rand(HV, generator=gen) - 1.0).reshape(1, 1, HV, 1)
        self.dt_bias = 0.5 * torch.randn(HV * KD, generator=gen)
        self.layer = self.kda.KimiGatedDeltaNetAttention(PREFIX, HV, KD, self.A_log, self.dt_bias)
        self.state = torch.zeros(SLOTS, HV, KD, KD)
        self.layer.kv_cache = (torch.zeros(SLOTS, 1), self.state)
        self.ref: dict[int, torch.Tensor] = {}

    def step(self, decodes, prefills=(), lens=()):
        md = gdn_metadata(decodes, prefills, lens)
        n, gen = md.num_actual_tokens, self.gen
        q, k, v = (torch.randn(n, HV * KD, generator=gen) for _ in range(3))
        g1 = torch.randn(1, n, HV, KD, generator=gen)
        beta = torch.randn(n, HV, generator=gen).sigmoid()[None]  # Kimi's forward: sigmoid
        out = torch.zeros(1, n, HV, KD)
        self.mods["vllm.forward_context"]._current = ForwardContext({PREFIX: md})
        self.layer._forward(q, k, v, g1, beta, out)
        g = self.kda.fused_kda_gate(g1[0].flatten(-2), self.A_log, KD, self.dt_bias, -5.0)
        errors = {}
        for r, s in enumerate(decodes):  # with a prefill, Kimi runs them through the chunk kernel
            if s <= 0:  # the null block 0 or vLLM's PAD_SLOT_ID -1
                assert torch.equal(out[0, r], torch.zeros(HV, KD)), "a pad row's output"
                continue
            o, new = kda_step(self.ref[s][None], *(t[r].view(1, HV, KD) for t in (q, k, v)),
                              g[r][None], beta[0, r][None])  # fmt: skip
            self.ref[s] = new[0]
            errors[s] = rel(out[0, r], o[0])
        for s in list(decodes if prefills else ()) + list(prefills):
            self.ref[s] = self.state[s].to(F64)  # every non-spec row went through the chunk
        return errors


@pytest.mark.parametrize("broken", [None, ("flush",), ("flush", "reset")],
                         ids=["ok", "no-flush", "no-flush-no-reset"])  # fmt: skip
def test_kda_decode_after_a_prefill_starts_from_the_written_state(vllm, monkeypatch, broken):
    """Kimi-Linear's layer runs a mixed batch's decode rows through the chunk kernel from
    ssm_state[idx]: their held records are folded in first (flush_held), or that start state
    is stale; the prefill's slots are reset after (reset_held; the flush, which covers every
    non-spec row here, resets them too). A plugin that does neither fails."""
    assert plugin.register() is True
    for name in broken or ():
        monkeypatch.setattr(hooks, f"{name}_held", lambda *args: None)
    run = KDARun(vllm, torch.Generator().manual_seed(21))
    run.step([], [2, 5], [3, 2])
    for _ in range(3):
        assert max(run.step([2, 5, 0]).values()) < TOL
    layer = plugin.BACKEND.layer(run.state)
    assert "gates_in_kernel" not in layer.flags  # fla's form: vLLM forms g and beta
    assert layer.pool["cursors"][[2, 5], CURSOR_HELD].min() > 0
    quiet = [0, 1, 3, 4, 6, 8]
    before = snapshot(layer, quiet)
    mixed = run.step([2], [5, 7], [2, 3])  # slot 2 decodes; slot 5 recycled for a new request
    assert (mixed[2] > 1e-2) if broken else (mixed[2] < TOL)
    if broken is None:
        assert torch.equal(layer.pool["cursors"][[2, 5, 7]], torch.zeros(3, 4, dtype=I32))
    assert all(torch.equal(before[n], t) for n, t in snapshot(layer, quiet).items())
    errors = [run.step([2, 5, 7, 0, -1]) for _ in range(3)]
    assert len(vllm[KDA].prefill_calls) == 2
    if broken == ("flush", "reset"):
        assert errors[0][5] > 1e-2 and errors[0][7] < TOL
    elif not broken:
        assert max(max(e.values()) for e in errors) < TOL
        # flush_held on its own: slot 2's checkpoint becomes its current state; pads keep bits.
        before = snapshot(layer, quiet)
        hooks.flush_held(layer, torch.tensor([2, 0, -1, SLOTS], dtype=I32))
        assert torch.equal(layer.pool["cursors"][2], torch.zeros(4, dtype=I32))
        assert rel(run.state[2], run.ref[2]) < TOL
        assert all(torch.equal(before[n], t) for n, t in snapshot(layer, quiet).items())


# ---------------------------------------------------------------------------------------------
# Mamba-2: mamba_mixer2.conv_ssm_forward (the chunked scan, then ssm_state[idx_p] = states)
# ---------------------------------------------------------------------------------------------

H, G, P, N = 4, 2, 8, 16


class Mamba2Run:
    def __init__(self, mods, gen):
        self.mods, self.gen = mods, gen
        self.A = -(0.5 + torch.rand(H, generator=gen))
        self.D, self.dt_bias = torch.randn(H, generator=gen), torch.rand(H, generator=gen) - 0.5
        self.layer = mods[M2].MambaMixer2(PREFIX, H, P, G, N, self.A, self.D, self.dt_bias)
        self.state = torch.zeros(SLOTS, H, P, N)
        self.layer.kv_cache = (torch.zeros(SLOTS, 1), self.state)
        self.ref: dict[int, torch.Tensor] = {}

    def step(self, decodes, prefills=(), lens=()):
        nd, n_p = len(decodes), sum(lens)
        loc_p = torch.tensor([0, *torch.tensor(list(lens) or [0]).cumsum(0).tolist()], dtype=I32)
        md = Mamba2AttentionMetadata(
            num_prefills=len(prefills), num_prefill_tokens=n_p, num_decodes=nd,
            num_decode_tokens=nd, has_initial_states_p=torch.zeros(len(prefills), dtype=bool),
            query_start_loc_p=loc_p[: len(lens) + 1],
            state_indices_tensor_p=torch.tensor(prefills, dtype=I32),
            state_indices_tensor_d=torch.tensor(decodes, dtype=I32),
        )  # fmt: skip
        n = nd + n_p
        x, B, C = (torch.randn(n, d, generator=self.gen) for d in (H * P, G * N, G * N))
        dt = -3.0 + 3.5 * torch.rand(n, H, generator=self.gen)
        out = torch.zeros(n, H * P)
        self.mods["vllm.forward_context"]._current = ForwardContext({PREFIX: md})
        self.layer.conv_ssm_forward(torch.cat([x, B, C, dt], dim=-1), out)
        errors = {}
        for r, s in enumerate(decodes):
            if s <= 0:  # the null block 0 or vLLM's PAD_SLOT_ID -1
                assert torch.equal(out[r], torch.zeros(H * P)), "a pad row's output"
                continue
            o, new = mamba2_step(self.ref[s][None], x[r].view(1, H, P), dt[r][None], self.A,
                                 B[r].view(1, G, N), C[r].view(1, G, N), D=self.D,
                                 dt_bias=self.dt_bias, dt_softplus=True)  # fmt: skip
            self.ref[s] = new[0]
            errors[s] = rel(out[r], o[0].flatten())
        for s in prefills:
            self.ref[s] = self.state[s].to(F64)
        return errors


@pytest.mark.parametrize("broken", [False, True], ids=["reset", "broken-no-reset"])
def test_mamba2_decode_after_a_prefill_starts_from_the_written_state(vllm, monkeypatch, broken):
    assert plugin.register() is True
    if broken:
        monkeypatch.setattr(hooks, "reset_held", lambda layer, slots: None)
    run = Mamba2Run(vllm, torch.Generator().manual_seed(31))
    run.step([], [2, 5], [3, 2])
    for _ in range(3):
        assert max(run.step([2, 5, 0]).values()) < TOL
    layer = plugin.BACKEND.layer(run.state)
    assert layer.pool["cursors"][5, CURSOR_HELD] > 0
    quiet = [0, 1, 3, 4, 6, 8]
    before = snapshot(layer, quiet)
    assert run.step([2], [5, 7], [2, 3])[2] < TOL  # decodes and prefills split, as vLLM does
    if not broken:
        assert torch.equal(layer.pool["cursors"][[5, 7]], torch.zeros(2, 4, dtype=I32))
    errors = [run.step([2, 5, 7, 0, -1]) for _ in range(3)]
    assert all(torch.equal(before[n], t) for n, t in snapshot(layer, quiet).items())
    assert len(vllm[M2].prefill_calls) == 2
    if broken:
        assert errors[0][5] > 1e-2 and errors[0][7] < TOL
    else:
        assert max(max(e.values()) for e in errors) < TOL
