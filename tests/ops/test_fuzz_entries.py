"""Fuzzing every public entry (hypothesis, issue 21 section 1).

Each fuzzed call either succeeds and matches the reference (the float64 oracles of
replayssm_jit.reference, by relative error, and the documented cursor, ring and pad rules), or
raises a ValueError/TypeError whose message names the argument with the expected and the actual
value, and changes nothing (every tensor of the cache, bit for bit, NaN-aware). NaN/Inf inputs
stay inside their own batch row. The command lines (`python -m replayssm_jit demo|aot`, called
in-process with the work stubbed out) end a bad argument list as argparse does: SystemExit(2)
with the usage and an "error:" line on stderr, which is a clear error for a command line.

The entries and the property are in tests/support/fuzz/ (a new op joins by registering an entry); the
profiles in tests/conftest.py: "ci" by default, "long" with HYPOTHESIS_PROFILE=long. The session
summary prints how many calls each entry made. FUZZ_TRACE=1 (with -s) prints every call.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support import fuzz
from support.fuzz.core import check_call

import replayssm_jit
from replayssm_jit import commit_drafts, mamba2_decode, plan_decode
from replayssm_jit.families.base import HeadShape
from replayssm_jit.families.spec import KernelSpec, make_spec

CPU = sorted(name for name, e in fuzz.ENTRIES.items() if "cpu" in e.devices)
CUDA = sorted(name for name, e in fuzz.ENTRIES.items() if "cuda" in e.devices)


def _fuzz(name: str, device: str) -> None:
    e = fuzz.ENTRIES[name]
    examples = max(1, round(settings().max_examples * e.weight))

    @settings(max_examples=examples)
    @given(data=st.data())
    def prop(data):
        check_call(e, e.build(data.draw, device))

    prop()


@pytest.mark.parametrize("name", CPU)
def test_entry_on_cpu(name, no_launch_env):
    _fuzz(name, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("name", CUDA)
def test_entry_on_cuda(name, no_launch_env):
    """The same entries on CUDA tensors: the kernels (JIT-built with nvcc, or the AOT
    `sanitizer` preset's modules, whose shapes, windows, drafts, dtypes and flags the decode,
    plan, verify and snapshot entries keep to on CUDA)."""
    assert torch.cuda.is_available()
    _fuzz(name, "cuda")


def test_every_public_entry_is_fuzzed():
    """Each name of replayssm_jit.__all__ (and each command) is reached by some entry."""
    covered = {c for e in fuzz.ENTRIES.values() for c in e.covers}
    commands = {"python -m replayssm_jit", "python -m replayssm_jit demo",
                "python -m replayssm_jit aot", "python -m replayssm_jit autotune"}  # fmt: skip
    missing = sorted(set(replayssm_jit.__all__) - covered) + sorted(commands - covered)
    assert not missing, f"public entries no fuzz entry covers: {missing}"
    assert all(e.devices for e in fuzz.ENTRIES.values())


# Found by the fuzzing: flags given as a str were taken as its characters ("dz" was ("d", "z")),
# a non-iterable's TypeError named nothing, and a KernelSpec built directly took any flags.
@pytest.mark.parametrize("flags", ["dz", 5])
def test_make_spec_names_flags_of_a_wrong_type(flags):
    with pytest.raises((TypeError, ValueError), match="^flags: "):
        make_spec("mamba2", HeadShape(2, 4, 16, 16), flags=flags)


def test_kernel_spec_rejects_unknown_flags():
    with pytest.raises(ValueError, match="^flags: "):
        KernelSpec("mamba2", (("p", 16), ("n", 16), ("hpg", 2)), 4, 1, "bf16", "f32", ("bogus",))


# --- found by the CUDA fuzz (decode.op, long profile) -----------------------------------------
# The kernels took the checkpoint's slot stride but indexed the rings and cursors as slot * block:
# a padded cursors pool was accepted and a GDN step wrote slot 1's cursor into the padding and
# slot 0's words. The checks then wanted those pools packed; now every kernel takes each slot
# tensor's slot stride (vLLM's cache pages pad them all), so a padded pool steps as a packed one
# (tests/ops/test_paged_slots.py carves a whole layout out of one buffer of pages).


def _op_case(family: str, *, window: int = 4, drafts: int = 1):
    """A small CPU cache of `family` (random checkpoints), its replay plan for batch 2, and the
    op's arguments for one step on slots 2 and 0."""
    from support.fuzz.families import ADAPTERS

    fam = ADAPTERS[family]
    shape = fam.shapes["cpu"][1]
    cache = fam.cache_cls(3, **shape, window=window, drafts=drafts, device="cpu")
    gen = torch.Generator().manual_seed(5)
    cache.state.copy_(0.3 * torch.randn(cache.state.shape, generator=gen))
    wrapper = fam.wrapper_cls(cache)
    wrapper.plan(2)
    args = {
        **fam.token(gen, 2, shape, {}, torch.bfloat16, "cpu"),
        **fam.params(gen, shape, {}, "cpu"),
    }
    args["slot_indices"] = torch.tensor([2, 0], dtype=torch.int32)
    return fam, cache, wrapper.decode_plan, args


def _padded_slots(t: torch.Tensor, pad: int, offset: int = 0) -> torch.Tensor:
    """A copy of slot pool `t` whose slots lie `pad` elements further apart (as the fuzz's
    "pad-aligned" variant builds it), starting `offset` elements into its buffer."""
    block = t[0].numel()
    buf = torch.zeros(t.shape[0] * (block + pad) + offset, dtype=t.dtype)
    view = torch.as_strided(buf, t.shape, (block + pad, *t.stride()[1:]), offset)
    view.copy_(t)
    return view


@pytest.mark.parametrize(
    "family, name",
    [("mamba2", n) for n in ("rec_x", "rec_b", "rec_dt", "cursors")]
    + [(f, n) for f in ("gdn", "kda") for n in ("rec_u", "rec_k", "rec_g", "cursors")],
)
def test_a_padded_ring_or_cursor_pool_steps_as_the_packed_one(family, name):
    fam, cache, plan, args = _op_case(family)
    layout = next(t for t in cache.layout.tensors() if t.name == name)
    twin = {k: t.clone() for k, t in cache.tensors.items()}
    twin[name] = _padded_slots(twin[name], max(1, layout.alignment // twin[name].element_size()))
    assert twin[name].stride(0) > twin[name][0].numel()
    got = fam.op(plan, **twin, **args)
    want = fam.op(plan, **cache.tensors, **args)
    assert torch.equal(got, want)
    for k, t in cache.tensors.items():
        assert torch.equal(twin[k], t), k
    type(cache).from_tensors(cache.layout, **twin)  # (accepted)


@pytest.mark.parametrize("name", ["rec_x", "rec_b"])
def test_a_ring_or_cursor_pool_whose_slots_overlap_is_named_and_changes_nothing(name):
    fam, cache, plan, args = _op_case("mamba2")
    pool = dict(cache.tensors)
    t = pool[name]
    pool[name] = torch.as_strided(t, t.shape, (t[0].numel() // 2, *t.stride()[1:]))
    before = {k: v.clone() for k, v in pool.items()}
    heads = cache.layout.shape
    out = torch.full((2, heads.value_heads, heads.value_dim), float("nan"), dtype=torch.bfloat16)
    with pytest.raises(
        ValueError,
        match=f"^{name}: expected slots {t[0].numel()} or more "
        f"elements apart .*slot stride of {t[0].numel() // 2}",
    ):
        fam.op(plan, **pool, **args, out=out)
    for k, v in pool.items():
        assert torch.equal(v, before[k]), f"{k} changed"
    assert out.isnan().all()


@pytest.mark.parametrize("family", ["mamba2", "gdn", "kda"])
def test_a_padded_checkpoint_pool_steps_as_the_packed_one(family):
    """The checkpoint's slot stride is the kernels' to honour: padded slots stay valid."""
    fam, cache, plan, args = _op_case(family)
    twin = {k: t.clone() for k, t in cache.tensors.items()}
    twin["state"] = _padded_slots(twin["state"], 16 // twin["state"].element_size())
    got = fam.op(plan, **twin, **args)
    want = fam.op(plan, **cache.tensors, **args)
    assert torch.equal(got, want)
    for k, t in cache.tensors.items():
        assert torch.equal(twin[k], t), k


def test_cursors_need_16_byte_alignment_for_the_verify_kernels():
    """Verify and commit access a cursor's four words in one 16-byte load or store: packed
    cursors 8 bytes off a 16-byte boundary are rejected (they were accepted at 8)."""
    _, cache, plan, args = _op_case("mamba2")
    pool = dict(cache.tensors)
    pool["cursors"] = _padded_slots(pool["cursors"], 0, offset=2)
    assert pool["cursors"].data_ptr() % 16 == 8
    with pytest.raises(ValueError, match="^cursors: expected 16-byte aligned slots"):
        mamba2_decode(plan, **pool, **args)


def test_commit_drafts_takes_padded_cursors():
    """The commit kernel takes the cursors' and rings' slot strides too."""
    _, cache, _, _ = _op_case("gdn", drafts=2)
    plan = plan_decode(cache.layout, 2, device="cpu")
    tensors = dict(cache.tensors)
    tensors["cursors"] = _padded_slots(tensors["cursors"], 4)
    before = tensors["cursors"].clone()
    commit_drafts(plan, tensors, num_accepted=torch.zeros(2, dtype=torch.int32),
                  slot_indices=torch.tensor([2, 0], dtype=torch.int32))  # fmt: skip
    assert torch.equal(
        tensors["cursors"], before
    )  # (nothing pending: a commit of 0 changes nothing)


# --- the CUDA speculative entries keep to the AOT `sanitizer` preset --------------------------


@settings(max_examples=60)
@given(data=st.data())
def test_cuda_speculative_entries_load_only_sanitizer_specs(data):
    """Every module the CUDA verify.op / snapshot.op entries can plan (the T = 1 plan variant
    too) is in the preset, so the GPU run needs no other build."""
    from support.aot_presets import PRESETS
    from support.fuzz.families import ADAPTERS, adapters_on
    from support.fuzz.verify import DTYPES, STATE_DTYPES

    preset = {s.uri for s in PRESETS["sanitizer"]()}
    fam = ADAPTERS[data.draw(st.sampled_from(adapters_on("cuda")))]
    shape = data.draw(st.sampled_from(fam.shapes["cuda"]))
    state = data.draw(st.sampled_from(STATE_DTYPES))
    options = fam.draw_options(data.draw, "cuda", state)
    for drafts in (1, 2, 4):
        layout = fam.cache_cls.make_layout(**shape, window=4, drafts=drafts, state_dtype=state,
                                           act_dtype=DTYPES["cuda"][0])  # fmt: skip
        spec = plan_decode(layout, 2, device="cpu", **options).spec
        assert spec.uri in preset, spec.uri
