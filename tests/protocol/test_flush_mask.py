"""The flush mask (issue 36, item 2): a plan with flush_mask=True takes a [batch] mask whose
nonzero rows flush at this step whatever their record count, so that their checkpoint is then
the whole state after the token (SGLang's prefix tracking copies it). On the torch path, for
Mamba-2, GDN and KDA with FP32 and BF16 checkpoints: masked rows' checkpoints against the
float64 reference, unmasked rows bit for bit an unmasked call's, cursors, later steps, and the
checks of a bad mask. A one-module build per family (nvcc) shows the flag compiles; the kernels
against this path are tests/protocol/test_flush_mask_gpu.py."""

from __future__ import annotations

import json
import random

import pytest
import torch
from support.checks import rel_err
from support.verify_schedule import GDNFamily, KDAFamily, Mamba2Family

from replayssm_jit import LaunchConfig, plan_decode, reset_slots
from replayssm_jit.ops import decode as decode_module
from replayssm_jit.ops.torch_path import Rows

pytestmark = pytest.mark.usefixtures("no_launch_env")

FAMILIES = {
    "mamba2": Mamba2Family(6, 16, 32, 3),
    "gdn": GDNFamily(2, 4, 32, 16),
    "kda": KDAFamily(2, 4, 32, 16),
}
L = 8
# Batch rows: four live slots and a pad row; slot 0 and the last slot are never named.
ROW_SLOTS = [1, 2, -1, 3, 4]
MASK = [True, False, False, True, False]  # the pad row's False, as SGLang fills it
NUM_SLOTS = 6
# Relative errors against float64: FP32 arithmetic, and a BF16 checkpoint's (or output's)
# rounding, 2^-9 per element at most.
TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3}
OUT_TOL = 5e-3  # bf16 outputs


def _pools(fam, state_dtype, gen):
    """Two identical pools (rings NaN: a row that replays a row its cursor does not hold shows
    it) and the float64 states of their live slots."""
    layout = fam.layout(L, 1, state_dtype)
    first = layout.allocate(NUM_SLOTS, "cpu")
    for name in layout.ring_names:
        first[name].fill_(float("nan"))
    init = 0.3 * torch.randn((NUM_SLOTS, *fam.state_shape()), generator=gen)
    reset_slots(layout, first, list(range(NUM_SLOTS)), init)
    second = {k: v.clone() for k, v in first.items()}
    truth = first["state"].double().clone()  # the checkpoints as stored, exactly
    return layout, first, second, truth


def _plan(layout, flagged):
    # per-item: keeps records in the window (a policy may flush every step at small batches)
    options = {"flush_mask": True} if flagged else {}
    return plan_decode(layout, len(ROW_SLOTS), device="cpu",
                       config=LaunchConfig(kernel="per-item"), **options)  # fmt: skip


def _token(fam, gen):
    drafts = fam.drafts(len(ROW_SLOTS), 1, gen, "cpu", torch.bfloat16)
    return {k: v[:, 0] for k, v in drafts.items()}


def _reference(fam, truth, params, token):
    """float64 outputs and states of every batch row (pad rows from slot 0, unused)."""
    slots = [max(s, 0) for s in ROW_SLOTS]
    p64 = {k: v.double() for k, v in params.items()}
    d64 = {k: v.double()[:, None] for k, v in token.items()}
    return fam.oracle_step(truth[slots], p64, d64, 0)


def _step(fam, plan, pool, params, token, mask=None):
    kw = {} if mask is None else {"flush_mask": mask}
    slots = torch.tensor(ROW_SLOTS, dtype=torch.int32)
    return fam.decode_op()(plan, **pool, **params, **token, slot_indices=slots, **kw)


def _advance(truth, s):
    """The float64 truth of the live rows after a step (s: every row's state)."""
    for r, slot in enumerate(ROW_SLOTS):
        if slot >= 0:
            truth[slot] = s[r]


def masked_step_case(name, state_dtype, held, seed):
    """`held` plain steps on two twin pools, then one step with MASK on one (a flagged plan)
    and none on the other (a plan without the flag), then L + 3 further masked steps; asserts
    every promise of the module notes (AssertionError where one fails)."""
    fam = FAMILIES[name]
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    layout, masked, plain, truth = _pools(fam, state_dtype, gen)
    kept = {k: v[[0, NUM_SLOTS - 1]].clone() for k, v in masked.items()}
    params = fam.params(gen, "cpu")
    flagged, unflagged = _plan(layout, True), _plan(layout, False)
    tol = TOL[state_dtype]
    live_rows = [r for r, s in enumerate(ROW_SLOTS) if s >= 0]
    for _ in range(held):  # a flagged plan given no mask forces nothing
        token = _token(fam, gen)
        y, s = _reference(fam, truth, params, token)
        out = _step(fam, flagged, masked, params, token)
        _step(fam, unflagged, plain, params, token)
        assert rel_err(out[live_rows], y[live_rows]) < OUT_TOL
        _advance(truth, s)

    # The masked step.
    token = _token(fam, gen)
    y, s = _reference(fam, truth, params, token)
    mask = torch.tensor(MASK)
    out = _step(fam, flagged, masked, params, token, mask)
    out_plain = _step(fam, unflagged, plain, params, token)
    assert rel_err(out[live_rows], y[live_rows]) < OUT_TOL
    assert torch.equal(out[2], torch.zeros_like(out[2])), "pad row"
    for r, slot in enumerate(ROW_SLOTS):
        if slot < 0:
            continue
        if MASK[r]:  # flushed now: the checkpoint is the state after this token
            assert masked["cursors"][slot].tolist() == [0, 1, 0, 0], (slot, held)
            e = rel_err(masked["state"][slot], s[r])
            assert e < tol, f"slot {slot}: checkpoint relative error {e:.3g} (held {held})"
        else:  # as an unmasked call, bit for bit
            assert masked["cursors"][slot].tolist() == [held + 1, 0, 0, 0], (slot, held)
            assert torch.equal(out[r].view(torch.int16), out_plain[r].view(torch.int16))
            for k in masked:
                assert torch.equal(masked[k][slot].view(torch.uint8),
                                   plain[k][slot].view(torch.uint8)), (k, slot)  # fmt: skip
    _advance(truth, s)

    # Later steps: random masks; a cursor model and, after each flush, the checkpoint.
    held_of = {slot: (0 if MASK[r] else held + 1) for r, slot in enumerate(ROW_SLOTS) if slot >= 0}
    epoch_of = {slot: (1 if MASK[r] else 0) for r, slot in enumerate(ROW_SLOTS) if slot >= 0}
    for step in range(L + 3):
        bits = [rng.random() < 0.25 for _ in ROW_SLOTS]
        token = _token(fam, gen)
        y, s = _reference(fam, truth, params, token)
        out = _step(fam, flagged, masked, params, token, torch.tensor(bits, dtype=torch.uint8))
        assert rel_err(out[live_rows], y[live_rows]) < OUT_TOL, step
        assert torch.equal(out[2], torch.zeros_like(out[2])), "pad row"
        for r, slot in enumerate(ROW_SLOTS):
            if slot < 0:
                continue
            before = held_of[slot]
            flushed = bits[r] or before + 1 >= L
            held_of[slot] = 0 if flushed else before + 1
            epoch_of[slot] += int(flushed)
            assert masked["cursors"][slot].tolist() == [held_of[slot], epoch_of[slot], 0, 0]
            if flushed:
                e = rel_err(masked["state"][slot], s[r])
                assert e < tol, f"step {step}, slot {slot}: checkpoint error {e:.3g}"
                if state_dtype != torch.float32:  # the truth goes on from the rounded state
                    s[r] = masked["state"][slot].double()
        _advance(truth, s)
    for k, v in masked.items():  # slots no row names: bit for bit
        assert torch.equal(v[[0, NUM_SLOTS - 1]].view(torch.uint8), kept[k].view(torch.uint8)), k


@pytest.mark.parametrize("held", [0, 1, L - 2])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_masked_rows_flush_at_their_token(name, state_dtype, held):
    masked_step_case(name, state_dtype, held, seed=held + 10 * len(name))


def test_a_step_that_ignores_the_mask_is_caught(monkeypatch):
    """The case above fails for a torch path that drops the mask (rows flush only at L)."""
    monkeypatch.setattr(
        decode_module, "Rows", lambda *args, flush_mask=None, **kw: Rows(*args, **kw)
    )
    for name in FAMILIES:
        with pytest.raises(AssertionError):
            masked_step_case(name, torch.float32, 1, seed=3)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_no_mask_and_an_all_false_mask_are_todays_step(name):
    """A flagged plan given None or an all-False mask is bit for bit a plan without the flag,
    over more than a window of steps."""
    fam = FAMILIES[name]
    gen = torch.Generator().manual_seed(7)
    layout, a, b, _ = _pools(fam, torch.bfloat16, gen)
    c = {k: v.clone() for k, v in a.items()}
    params = fam.params(gen, "cpu")
    flagged, unflagged = _plan(layout, True), _plan(layout, False)
    none = torch.zeros(len(ROW_SLOTS), dtype=torch.bool)
    for _ in range(L + 3):
        token = _token(fam, gen)
        outs = [_step(fam, unflagged, a, params, token), _step(fam, flagged, b, params, token),
                _step(fam, flagged, c, params, token, none)]  # fmt: skip
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    for k in a:
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
        assert torch.equal(a[k].view(torch.uint8), c[k].view(torch.uint8)), k


def _bad_masks():
    B = len(ROW_SLOTS)
    return [
        ("unflagged", torch.ones(B, dtype=torch.bool), ValueError,
         r"flush_mask: expected None \(a plan without flush_mask=True"),
        ("flagged", torch.ones(B, dtype=torch.int32), TypeError,
         r"flush_mask: expected dtype one of \[torch.bool, torch.uint8\], got torch.int32"),
        ("flagged", torch.ones(B, dtype=torch.float32), TypeError,
         "flush_mask: expected dtype .* got torch.float32"),
        ("flagged", torch.ones(B + 1, dtype=torch.bool), ValueError,
         r"flush_mask: expected shape \[5\], got \[6\]"),
        ("flagged", torch.ones(B, 1, dtype=torch.bool), ValueError,
         r"flush_mask: expected shape \[5\], got \[5, 1\]"),
        ("flagged", torch.ones(2 * B, dtype=torch.bool)[::2], ValueError,
         "flush_mask: expected a contiguous tensor, got strides"),
        ("flagged", torch.ones(B, dtype=torch.bool, device="meta"), ValueError,
         "flush_mask: expected device cpu, got meta"),
        ("flagged", [True] * B, TypeError, "flush_mask: expected a torch.Tensor, got list"),
    ]  # fmt: skip


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_bad_masks_raise_naming_flush_mask_and_change_nothing(name):
    fam = FAMILIES[name]
    gen = torch.Generator().manual_seed(8)
    layout, pool, _, _ = _pools(fam, torch.float32, gen)
    params = fam.params(gen, "cpu")
    plans = {"flagged": _plan(layout, True), "unflagged": _plan(layout, False)}
    token = _token(fam, gen)
    _step(fam, plans["flagged"], pool, params, token)  # one record held
    before = {k: v.clone() for k, v in pool.items()}
    shape = layout.shape
    out = torch.full((len(ROW_SLOTS), shape.value_heads, shape.value_dim), 7.0,
                     dtype=torch.bfloat16)  # fmt: skip
    for which, mask, error, message in _bad_masks():
        with pytest.raises(error, match=message):
            slots = torch.tensor(ROW_SLOTS, dtype=torch.int32)
            fam.decode_op()(plans[which], **pool, **params, **token, slot_indices=slots,
                            out=out, flush_mask=mask)  # fmt: skip
        assert (out == 7.0).all(), which
        for k, v in pool.items():
            assert torch.equal(v.view(torch.uint8), before[k].view(torch.uint8)), (k, message)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_flag_needs_a_replay_decode_spec(name):
    """The flag is refused where no step would honour a mask: a conventional plan (it writes
    every state anyway) and a layout with drafts (a verify takes no mask)."""
    fam = FAMILIES[name]
    with pytest.raises(ValueError, match=r"flags: 'flush_mask' .* got window=1 and drafts=1"):
        plan_decode(fam.layout(L, 1, torch.float32), 2, device="cpu", mode="conventional",
                    flush_mask=True)  # fmt: skip
    with pytest.raises(ValueError, match=r"flags: 'flush_mask' .* got window=8 and drafts=2"):
        plan_decode(fam.layout(L, 2, torch.float32), 2, device="cpu", flush_mask=True)
    plan = plan_decode(fam.layout(L, 1, torch.float32), 2, device="cpu", flush_mask=True)
    assert "flush_mask" in plan.spec.flags and plan.spec.uri.count("flush_mask") == 1


# --- nvcc: one flagged module per family compiles ----------------------------------------------


@pytest.mark.nvcc
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_flagged_module_compiles_and_loads(name, jit_cache, tmp_path, monkeypatch):
    """A spec with the flush_mask flag renders REPLAYSSM_FLUSH_MASK 1 (one without it 0),
    compiles for sm_90a and loads with its replay step, whose binding takes flush_mask."""
    import shutil

    from replayssm_jit.families import get_family
    from replayssm_jit.families.spec import family_spec
    from replayssm_jit.jit import build
    from replayssm_jit.jit.aot import build_aot

    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH")
    dims = ({"headdim": 16, "dstate": 32, "heads_per_group": 2} if name == "mamba2" else
            {"head_k_dim": 32, "head_v_dim": 32, "value_heads_per_key_head": 2})  # fmt: skip
    flags = (*get_family(name).default_flags, "flush_mask")
    spec = family_spec(name, window=L, flags=flags, **dims)
    plain = family_spec(name, window=L, **dims)
    assert "#define REPLAYSSM_FLUSH_MASK 1" in build.render(spec)
    assert "#define REPLAYSSM_FLUSH_MASK 0" in build.render(plain)
    monkeypatch.setenv("REPLAYSSM_CACHE_DIR", str(tmp_path / "aot-build-cache"))
    build_aot([spec], tmp_path / "aot", jobs=1, archs=["9.0a"])
    manifest = json.loads((tmp_path / "aot" / spec.uri / "manifest.json").read_text())
    assert manifest["uri"] == spec.uri and "flush_mask" in spec.uri
    monkeypatch.setenv("REPLAYSSM_AOT_DIR", str(tmp_path / "aot"))
    monkeypatch.setenv("REPLAYSSM_DISABLE_JIT", "1")
    module = build.load_module(spec)
    assert callable(module.replay_step) and callable(module.conventional_step)
