"""Speculative verify and commit on e4m3 / NVFP4 checkpoints and separate mode's read copies, on
the torch path (docs/speculative.md, docs/precision.md), and the CUDA modules' refusal of them.

Bounds (support/verify_formats.py emulates in float64 what the path stores):
  - outputs: relative error 5e-5 against the emulation, which starts from the copy a verify reads,
    decoded exactly; only FP32 arithmetic separates them (the decode tests' 2e-5, with margin for
    the longer windows of a verify: L + T records);
  - the copies stored by an early flush: within one code of the emulation's folded float64 state
    (RN rounds the FP32 value, half a code, a tie possibly the other way; SR under one code);
  - against the same accepted tokens run as plain decode steps (a flush mask forcing the flush
    where the verify flushed early): the same bits wherever the records do not depend on the
    state's rounding order (Mamba-2, any mode; the delta rule in separate mode, whose flush
    recomputes every u from the carried copy); the delta rule's one-copy runs differ (below).
"""

from __future__ import annotations

import random

import pytest
import torch
from support.verify_formats import (
    DTYPES,
    FAMS,
    SEED,
    decoded,
    rel_err,
    run_formats_schedule,
    start,
)
from support.verify_schedule import Cursor

from replayssm_jit import (
    commit_snapshots,
    mamba2_snapshot_verify,
    plan_decode,
    reset_slots,
)
from replayssm_jit.families import FAMILIES
from replayssm_jit.families.schema import COMMIT_READ_RING_PARAMS, binding_params, commit_ring_roles
from replayssm_jit.families.spec import check_cuda_spec, make_spec
from replayssm_jit.jit.build import load_module, render
from replayssm_jit.ops.library import COMMIT_RING_ARGS, plan_handle

I32 = torch.int32

pytestmark = pytest.mark.usefixtures("no_launch_env", "single_thread")

# (family, state, read copy) for every family's formats (NVFP4 and separate where built)
CASES = [
    *[(f, "e4m3", None) for f in ("mamba2", "gdn", "kda")],
    *[(f, "nvfp4", None) for f in ("mamba2", "gdn", "kda")],
    *[(f, "f32", r) for f in ("mamba2", "gdn", "kda") for r in ("e4m3", "bf16", "nvfp4")],
]


def _id(case):
    fam, state, read = case
    return f"{fam}-{state}" + (f"+{read}" if read else "")


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("trees, fused", [(False, True), (False, False), (True, False)],
                         ids=["chain-fused", "chain-explicit", "tree"])  # fmt: skip
def test_verify_schedules_on_formats_match_the_emulation(case, trees, fused):
    run_formats_schedule(case, trees=trees, fused=fused)


@pytest.mark.parametrize("case", [c for c in CASES if c[2] is not None], ids=_id)
def test_tree_commits_through_the_registered_op_on_read_copies(case):
    """torch.ops.replayssm.commit_drafts takes a read copy's rings (GDN's v and beta) after the
    three by role, and moves them as the Python commit_drafts does."""
    run_formats_schedule(case, trees=True, fused=False, via_op=True)


def test_the_registered_commit_refuses_a_read_copy_ring_the_layout_lacks():
    fam = FAMS["mamba2"]()
    _gen, layout, tensors, opts = start(fam, "f32", "e4m3", 4, 3)
    plan = plan_decode(layout, 1, device="cpu", seed=SEED, **opts)
    rings = {role: tensors[n] for role, n in commit_ring_roles(layout.ring_names)}
    before = {k: t.clone() for k, t in tensors.items()}
    with pytest.raises(ValueError, match="read_value_ring: expected none"):
        torch.ops.replayssm.commit_drafts(plan_handle(plan), cursors=tensors["cursors"], **rings,
                                          read_value_ring=tensors["rec_x"],
                                          num_accepted=torch.tensor([1], dtype=I32),
                                          slot_indices=torch.tensor([1], dtype=I32))  # fmt: skip
    assert all(
        torch.equal(t.view(torch.uint8), before[k].view(torch.uint8)) for k, t in tensors.items()
    )


def test_the_cuda_commit_takes_every_ring_of_a_layout():
    """The compiled commit moves a tree path's rows in every ring: a read copy's too (GDN's v and
    beta, which a later flush recomputes u from)."""
    for name in FAMILIES:
        params = [p.name for p in binding_params(FAMILIES[name], "commit_step")]
        assert all(role in params for role in (*COMMIT_RING_ARGS, *COMMIT_READ_RING_PARAMS))
    gdn = FAMS["gdn"]()
    _gen, layout, _tensors, _opts = start(gdn, "f32", "e4m3", 4, 3)
    assert [n for _role, n in commit_ring_roles(layout.ring_names)] == list(layout.ring_names)
    assert len(layout.ring_names) == 5


def test_the_registered_commit_names_a_read_copy_ring_left_out():
    fam = FAMS["gdn"]()
    _gen, layout, tensors, opts = start(fam, "f32", "e4m3", 4, 3)
    plan = plan_decode(layout, 1, device="cpu", seed=SEED, **opts)
    rings = dict(zip(COMMIT_RING_ARGS, (tensors[n] for n in layout.ring_names[:3])))
    before = {k: t.clone() for k, t in tensors.items()}
    with pytest.raises((ValueError, TypeError), match="rec_v|rec_beta"):
        torch.ops.replayssm.commit_drafts(plan_handle(plan), cursors=tensors["cursors"], **rings,
                                          num_accepted=torch.tensor([1], dtype=I32),
                                          slot_indices=torch.tensor([1], dtype=I32))  # fmt: skip
    assert all(
        torch.equal(t.view(torch.uint8), before[k].view(torch.uint8)) for k, t in tensors.items()
    )


@pytest.mark.parametrize("case", [("mamba2", "e4m3", None), ("gdn", "f32", "nvfp4"),
                                  ("kda", "nvfp4", None)], ids=_id)  # fmt: skip
def test_verify_schedules_under_stochastic_rounding(case):
    run_formats_schedule(case, trees=False, fused=True, sr=True)


# ---------------------------------------------------------------------------------------------
# The same accepted tokens as plain decode steps
# ---------------------------------------------------------------------------------------------

# (family, separate mode)
BIT_EXACT = {("mamba2", False), ("mamba2", True), ("gdn", True), ("kda", True)}


def twin_run(case, sr, *, L=4, T=3, steps=16):
    """Verifies with fused commits of random counts on slot 1, and a twin pool that decodes the
    accepted tokens one at a time, its flush forced (flush_mask) on the last token an early
    flush folded; returns the largest difference in codes' bits seen at those flushes (0 where
    every copy's bits agree) and the number of flushes compared."""
    name, state, read = case
    fam = FAMS[name]()
    gen, layout, tensors, opts = start(fam, state, read, L, T, sr=sr)
    twin_layout = fam.layout(state, read, L + T + 1, 1)  # never flushes unasked
    twin = twin_layout.allocate(5, "cpu")
    reset_slots(twin_layout, twin, torch.arange(5), decoded(tensors, "state", torch.arange(5)))
    for n in layout.checkpoint_names:  # (reset encodes from FP32: start from the same bits)
        twin[n].copy_(tensors[n])
    plan = plan_decode(layout, 1, device="cpu", seed=SEED, **opts)
    twin_plan = plan_decode(twin_layout, 1, device="cpu", seed=SEED, flush_mask=True, **opts)
    params = fam.params(gen)
    rng = random.Random(SEED)
    slots, cursor = torch.tensor([1], dtype=I32), Cursor()
    buffered, accepted, compared, differs, worst = [], None, 0, False, 0.0
    for _ in range(steps):
        drafts = fam.drafts(gen, 1, T)
        kw = {} if accepted is None else {"num_accepted": torch.tensor([accepted], dtype=I32)}
        flush = cursor.verify(T, accepted, L, T)
        fam.verify_op(plan, **tensors, **params, **drafts, slot_indices=slots, **kw)
        if flush:
            for i, tok in enumerate(buffered):
                mask = torch.tensor([i == len(buffered) - 1])
                fam.decode_op(twin_plan, **twin, **params, **tok, slot_indices=slots,
                              flush_mask=mask)  # fmt: skip
            buffered, compared = [], compared + 1
            differs |= any(not torch.equal(tensors[n][1].view(torch.uint8),
                                           twin[n][1].view(torch.uint8))
                           for n in layout.checkpoint_names)  # fmt: skip
            index = torch.tensor([1])
            a, b = decoded(tensors, "state", index)[0], decoded(twin, "state", index)[0]
            worst = max(worst, rel_err(a, b))
        accepted = rng.randint(0, T)
        buffered += [{k: v[:, j] for k, v in drafts.items()} for j in range(accepted)]
    return differs, worst, compared


# The unit roundoff of a one-copy format: e4m3's 3 mantissa bits, NVFP4's e2m1 (half its gap
# of 0.5 at 1).
UNIT_ROUNDOFF = {"e4m3": 2.0**-4, "nvfp4": 2.0**-2}


@pytest.mark.parametrize("sr", [False, True], ids=["rn", "sr"])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_verify_then_commit_is_the_decode_steps(case, sr):
    """Bit for bit where BIT_EXACT says. The delta rule's one-copy runs differ: a verify computes
    each draft's u with its own order of FP32 additions (a masked window of L + T records) and,
    after an early flush, from the folded FP32 state rather than its stored copy (as a flushing
    step's output is), where a decode step reads the stored copy. The u's then differ by that
    one rounding of the checkpoint times beta |k^| <= 1, so the next stored checkpoints differ,
    relative to their norm, by less than the format's unit roundoff (measured: up to 0.012 for
    e4m3, 0.045 for NVFP4)."""
    name, state, read = case
    differs, worst, compared = twin_run(case, sr)
    assert compared >= 2
    if (name, read is not None) in BIT_EXACT:
        assert not differs, "the copies' bits differ from the decode steps'"
    else:
        assert worst < UNIT_ROUNDOFF[state], f"relative difference {worst:.3e}"


# ---------------------------------------------------------------------------------------------
# The CUDA modules: every family's verify kernels read e4m3 / NVFP4 checkpoints and read copies
# (GDN's per item only; their GPU test: test_verify_formats_gpu.py); a family whose kernels do
# not (Family.verify_scaled_checkpoint / verify_read_copy unset) refuses such specs
# ---------------------------------------------------------------------------------------------

CUDA_REFUSAL = "^drafts: expected 1 for a CUDA gdn module .*the torch path.*do not yet"


@pytest.fixture
def gdn_without_format_verify(monkeypatch):
    """GDN as a family whose CUDA verify takes neither (the rule check_cuda_spec applies)."""
    import dataclasses

    import replayssm_jit.families.spec as spec_mod

    plain = dataclasses.replace(spec_mod.get_family("gdn"), verify_scaled_checkpoint=False,
                                verify_read_copy=False)  # fmt: skip
    real = spec_mod.get_family
    monkeypatch.setattr(spec_mod, "get_family", lambda n: plain if n == "gdn" else real(n))


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "gdn"], ids=_id)
def test_cuda_modules_with_drafts_on_untaken_formats_are_refused(case, gdn_without_format_verify):
    name, state, read = case
    fam = FAMS[name]()
    spec = fam.layout(state, read, 4, 3)  # the layout (and so its spec) is the torch path's
    spec = plan_decode(spec, 2, device="cpu", **fam.options).spec
    assert spec.has_verify
    with pytest.raises(ValueError, match=CUDA_REFUSAL):
        check_cuda_spec(spec)
    with pytest.raises(ValueError, match=CUDA_REFUSAL):  # every JIT / AOT route renders first
        render(spec)
    with pytest.raises(ValueError, match=CUDA_REFUSAL):
        load_module(spec)


@pytest.mark.parametrize("case", [c for c in CASES if c[0] != "kda" or c[2] is None], ids=_id)
def test_cuda_modules_with_drafts_on_these_formats_render(case):
    """verify_step binds every copy (scales, blocks, the read copy), and the verify kernels are
    instantiated with the read copy's type (KDA has none)."""
    name, state, read = case
    fam = FAMS[name]()
    spec = plan_decode(fam.layout(state, read, 4, 3), 2, device="cpu", **fam.options).spec
    assert check_cuda_spec(spec) is spec
    source = render(spec)
    assert "verify_step(" in source and (name == "kda" or "read_t, kReadSR>;" in source)
    for arg in ("state_scale", "state_block_scale", "read_state", "read_scale", "read_block_scale"):
        assert f"{arg}" in source.split("void verify_step(")[1].split(")")[0], arg


@pytest.mark.parametrize("read", ["e4m3", "bf16", "nvfp4"])
@pytest.mark.parametrize("drafts", [1, 3])
def test_cuda_modules_refuse_a_kda_read_copy(read, drafts):
    """KDA's separate mode runs on the torch path only: its CUDA modules (step and verify) are
    refused, by name, before anything is rendered or built."""
    fam = FAMS["kda"]()
    spec = plan_decode(fam.layout("f32", read, 4, drafts), 2, device="cpu", **fam.options).spec
    refusal = "^read_dtype: expected None for a CUDA kda module .*the torch path.*got '" + read
    for route in (check_cuda_spec, render, load_module):
        with pytest.raises(ValueError, match=refusal):
            route(spec)


def test_gdn_verifies_a_read_copy_per_item_only():
    """The launch policy never splits a GDN verify with a read copy (its split kernels take one
    copy), even where asked to; Mamba-2's splits."""
    from replayssm_jit.launch.policy import can_split_verify

    for name, want in (("gdn", False), ("mamba2", True)):
        fam = FAMS[name]()
        spec = plan_decode(fam.layout("f32", "e4m3", 4, 3), 2, device="cpu", **fam.options).spec
        assert can_split_verify(spec) is want, name
    spec = plan_decode(FAMS["gdn"]().layout("e4m3", None, 4, 3), 2, device="cpu",
                       **FAMS["gdn"]().options).spec  # fmt: skip
    assert can_split_verify(spec)


def test_cuda_plan_is_refused_before_any_build(monkeypatch, gdn_without_format_verify):
    """plan_decode on a CUDA device checks the spec before the launch policy and the load."""
    import replayssm_jit.ops.plan as plan_mod

    fam = FAMS["gdn"]()
    layout = fam.layout("f32", "e4m3", 4, 3)
    monkeypatch.setattr(plan_mod, "resolve_device", lambda d: torch.device("cuda", 0))
    with pytest.raises(ValueError, match=CUDA_REFUSAL):
        plan_decode(layout, 2, device="cuda", **fam.options)


def test_cuda_keeps_the_one_copy_16_bit_specs_with_drafts():
    shape = FAMS["mamba2"]()
    spec = make_spec("mamba2", plan_shape(shape), window=4, drafts=3, state_dtype="bf16")
    assert check_cuda_spec(spec) is spec
    assert check_cuda_spec(make_spec("mamba2", plan_shape(shape), window=4, drafts=1,
                                     state_dtype="e4m3"))  # fmt: skip


def plan_shape(fam):
    return fam.layout("f32", None, 4, 1).shape


def test_formats_take_every_dtype_listed():
    assert set(DTYPES) >= {state for _, state, _ in CASES}


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "mamba2"], ids=_id)
def test_the_snapshot_baseline_refuses_these_formats_and_writes_nothing(case):
    """The snapshot baseline copies plain state slots: on a scaled or two-copy checkpoint it
    would copy codes without their scales, so both of its ops refuse by name, writing nothing."""
    name, state, read = case
    fam = FAMS[name]()
    gen, layout, tensors, opts = start(fam, state, read, 4, 2)
    plan = plan_decode(layout, 1, device="cpu", seed=SEED, **opts)
    before = {k: t.clone() for k, t in tensors.items()}
    slots, snaps = torch.tensor([1]), torch.tensor([[2, 3]])
    refusal = "^plan: expected a layout with one f32/bf16/f16 checkpoint"
    with pytest.raises(ValueError, match=refusal):
        commit_snapshots(plan, state=tensors["state"], snapshot_slots=snaps,
                         num_accepted=torch.tensor([1]), slot_indices=slots)  # fmt: skip
    with pytest.raises(ValueError, match=refusal):
        mamba2_snapshot_verify(plan, state=tensors["state"], **fam.params(gen),
                               **fam.drafts(gen, 1, 2), slot_indices=slots,
                               snapshot_slots=snaps)  # fmt: skip
    for k, t in tensors.items():  # bit for bit (rings hold NaN)
        assert torch.equal(
            t.contiguous().view(torch.uint8), before[k].contiguous().view(torch.uint8)
        ), k
