"""The caches, plan() and the layouts keep their promises, for every family: bad input raises a
ValueError/TypeError naming the argument, and a failed call changes nothing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replayssm_jit import (
    GDNDecodeCache,
    GDNDecodeWrapper,
    LaunchConfig,
    Mamba2DecodeCache,
    Mamba2DecodeWrapper,
    mamba2_layout,
)

SHAPES = {
    "mamba2": (Mamba2DecodeCache, Mamba2DecodeWrapper,
               dict(num_heads=4, headdim=16, dstate=16, ngroups=2)),
    "gdn": (GDNDecodeCache, GDNDecodeWrapper,
            dict(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16)),
}  # fmt: skip
FAMILIES = sorted(SHAPES)


def make_cache(family, num_slots=6, **kwargs):
    cache_cls, _, shape = SHAPES[family]
    return cache_cls(num_slots, **shape, **{"window": 4, "device": "cpu", **kwargs})


def snapshot(cache):
    return {name: t.clone() for name, t in cache.tensors.items()}, list(cache._free)


def assert_unchanged(cache, snap):
    tensors, free = snap
    for name, t in cache.tensors.items():
        assert torch.equal(t, tensors[name]), name
    assert cache._free == free


@pytest.mark.parametrize("family", FAMILIES)
def test_allocate_rejects_negative_and_non_int_counts(family):
    cache = make_cache(family)
    snap = snapshot(cache)
    with pytest.raises(ValueError, match=r"^count: expected 0 to 6 free slots, got -1"):
        cache.allocate(-1)
    with pytest.raises(ValueError, match=r"^count: expected 0 to 6 free slots, got 7"):
        cache.allocate(7)
    for bad in (True, 1.0, "2"):
        with pytest.raises(TypeError, match="^count: expected an int"):
            cache.allocate(bad)
    assert_unchanged(cache, snap)
    assert cache.allocate(0).numel() == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_free_rejects_repeats_so_no_slot_serves_two_sequences(family):
    cache = make_cache(family)
    cache.allocate(2)
    snap = snapshot(cache)
    with pytest.raises(
        ValueError, match=r"^slots: expected allocated slot ids, each once, got 0 \(given twice\)"
    ):
        cache.free([0, 0])
    with pytest.raises(ValueError, match=r"not allocated"):
        cache.free([3])
    assert_unchanged(cache, snap)
    cache.free([0, 1])
    again = cache.allocate(6).tolist()
    assert len(set(again)) == 6


@pytest.mark.parametrize("family", FAMILIES)
def test_reset_and_records_held_reject_the_pad_id_and_bad_ids(family):
    cache = make_cache(family)
    cache.allocate(6)
    cache.state.normal_()
    cache.cursors.fill_(3)
    snap = snapshot(cache)
    bad_ids = [
        (torch.tensor([-1]), ValueError, "other than pad_slot_id=-1, got -1"),
        (torch.tensor([6]), ValueError, r"in \[0, 6\).* got 6"),
        (torch.tensor([0.0]), TypeError, "expected an integer tensor, got dtype torch.float32"),
        ([1.0], TypeError, "expected int slot ids"),
        ([True], TypeError, "expected int slot ids"),
        (torch.tensor([[0]]), ValueError, "expected a 1-D tensor"),
        ("0", TypeError, "expected an int tensor or a list of ints"),
    ]
    for ids, error, match in bad_ids:
        with pytest.raises(error, match=f"^slots: .*{match}"):
            cache.reset(ids)
        with pytest.raises(error, match=f"^slots: .*{match}"):
            cache.records_held(ids)
    with pytest.raises(ValueError, match=r"^initial_state: expected shape"):
        cache.reset([0], torch.zeros(2, *cache.state.shape[1:]))
    assert_unchanged(cache, snap)
    cache.reset([2])
    assert torch.equal(cache.state[2], torch.zeros_like(cache.state[2]))
    assert torch.equal(cache.cursors[2], torch.zeros(4, dtype=torch.int32))
    assert cache.records_held([1, 3]).tolist() == [3, 3]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_reserved_pad_slot_is_never_handed_out(family):
    cache = make_cache(family, pad_slot_id=0)
    assert 0 not in cache.allocate(5).tolist()
    with pytest.raises(ValueError, match="^slots: .*other than pad_slot_id=0, got 0"):
        cache.reset([0])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(window=True), TypeError, "^window: expected an int, got bool"),
        (dict(drafts=True), TypeError, "^drafts: expected an int, got bool"),
        (dict(window=0), ValueError, r"^window: expected in \[1, 256\], got 0"),
        (dict(window=300), ValueError, r"^window: expected in \[1, 256\], got 300"),
        (dict(window=100000), ValueError, r"^window: expected in \[1, 256\], got 100000"),
        (dict(drafts=17), ValueError, r"^drafts: expected in \[1, 16\], got 17"),
        (dict(state_dtype="fp8"), TypeError, "^state_dtype: expected one of"),
        (dict(state_dtype=torch.float64), TypeError, "^state_dtype: expected one of"),
        (dict(act_dtype=torch.int32), TypeError, "^act_dtype: expected one of"),
        (dict(pad_slot_id=1.5), TypeError, "^pad_slot_id: expected an int, got float"),
        (dict(pad_slot_id=6), ValueError, r"^pad_slot_id: expected a negative id or a slot in \[0, 6\)"),
    ],
)  # fmt: skip
def test_cache_rejects_what_plan_would_reject(family, kwargs, error, match):
    with pytest.raises(error, match=match):
        make_cache(family, **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_bad_device_is_a_value_error(family):
    cache_cls, _, shape = SHAPES[family]
    with pytest.raises(ValueError, match="^device: expected a torch device"):
        cache_cls(4, **shape, device="cuda:banana")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="^device: .*CUDA is not available"):
            cache_cls(4, **shape, device="cuda")


@pytest.mark.parametrize("family", FAMILIES)
def test_short_dtype_names_are_dtypes(family):
    cache = make_cache(family, state_dtype="bf16", act_dtype="f32")
    assert cache.state.dtype == torch.bfloat16 and cache.act_dtype == torch.float32


def test_bad_head_shapes_are_named():
    with pytest.raises(ValueError, match="^ngroups: expected a divisor of num_heads=4, got 3"):
        Mamba2DecodeCache(4, num_heads=4, headdim=16, dstate=16, ngroups=3, device="cpu")
    with pytest.raises(TypeError, match="^headdim: expected an int, got bool"):
        Mamba2DecodeCache(4, num_heads=4, headdim=True, dstate=16, ngroups=2, device="cpu")
    with pytest.raises(ValueError, match="^head_k_dim: expected a multiple of 8"):
        GDNDecodeCache(4, num_k_heads=2, num_v_heads=4, head_k_dim=12, head_v_dim=16, device="cpu")
    with pytest.raises(ValueError, match="^num_slots: expected a positive int, got 0"):
        Mamba2DecodeCache(0, num_heads=4, headdim=16, dstate=16, ngroups=2, device="cpu")


@pytest.mark.parametrize("family", FAMILIES)
def test_wrapper_rejects_the_other_familys_cache(family):
    other = next(f for f in FAMILIES if f != family)
    _, wrapper_cls, _ = SHAPES[family]
    with pytest.raises(TypeError, match=f"^cache: expected a {family} SlotCache, got .*'{other}'"):
        wrapper_cls(make_cache(other))
    with pytest.raises(TypeError, match=f"^cache: expected a {family} SlotCache, got dict"):
        wrapper_cls({})


@pytest.mark.parametrize("family", FAMILIES)
def test_every_wrapper_takes_the_same_constructor_options(family):
    _, wrapper_cls, _ = SHAPES[family]
    wrapper = wrapper_cls(make_cache(family), mode="conventional", use_cuda_graph=False,
                          check_slot_values=False)  # fmt: skip
    assert wrapper.check_slot_values is False and wrapper.window == 1
    with pytest.raises(TypeError, match="^check_slot_values: expected a bool"):
        wrapper_cls(make_cache(family), check_slot_values=1)
    with pytest.raises(ValueError, match="^mode: expected one of"):
        wrapper_cls(make_cache(family), mode="fast")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_failed_plan_keeps_the_previous_plan(family):
    _, wrapper_cls, _ = SHAPES[family]
    wrapper = wrapper_cls(make_cache(family))
    spec = wrapper.plan(3)
    plan = wrapper.decode_plan
    assert plan.backend == "cpu" and plan.module is None  # nothing compiled for a CPU cache
    for kwargs, error, match in (
        (dict(batch_size=0), ValueError, "^batch_size: expected a positive int"),
        # an f32 state has no stochastic rounding
        (dict(batch_size=2, stochastic_rounding=True), ValueError, "^flags: 'sr'"),
        (
            dict(batch_size=2, stochastic_rounding=1),
            TypeError,
            "^stochastic_rounding: expected a bool",
        ),
        (dict(batch_size=2, config="split"), TypeError, "^config: expected a LaunchConfig"),
        (dict(batch_size=2, seed=1.5), TypeError, "^seed: expected an int"),
    ):
        with pytest.raises(error, match=match):
            wrapper.plan(**kwargs)
        assert wrapper.decode_plan is plan and wrapper.spec == spec and wrapper.batch_size == 3
    with pytest.raises(ValueError, match="^config.kernel: expected 'auto' or one of"):
        LaunchConfig(kernel="fast")


@pytest.mark.parametrize("family", FAMILIES)
def test_run_before_plan(family):
    _, wrapper_cls, _ = SHAPES[family]
    wrapper = wrapper_cls(make_cache(family))
    args = [None] * (6 if family == "mamba2" else 4)
    with pytest.raises(RuntimeError, match=r"run\(\) called before plan\(\)"):
        wrapper.run(*args)


# --- fuzzing: slot ids and counts -----------------------------------------------------------

slot_values = st.one_of(
    st.integers(-3, 9),
    st.booleans(),
    st.floats(-2, 8),
    st.just(float("nan")),
    st.none(),
    st.text(max_size=2),
)


@settings(max_examples=150, deadline=None)
@given(
    family=st.sampled_from(FAMILIES),
    op=st.sampled_from(["free", "reset", "records_held", "allocate"]),
    ids=st.one_of(st.lists(slot_values, max_size=4), slot_values),
    as_tensor=st.booleans(),
)
def test_fuzzed_slot_ids_succeed_or_raise_and_change_nothing(family, op, ids, as_tensor):
    cache = make_cache(family)
    cache.allocate(3)  # slots 0-2 taken, 3-5 free
    cache.state.normal_()
    snap = snapshot(cache)
    arg = ids
    if as_tensor and isinstance(ids, list):
        try:
            arg = torch.tensor(ids)
        except (TypeError, ValueError, RuntimeError):
            arg = ids
    try:
        result = getattr(cache, op)(arg)
    except (TypeError, ValueError) as exc:
        assert str(exc).split(":")[0] in ("slots", "count"), str(exc)
        assert_unchanged(cache, snap)
        return
    if op == "allocate":
        assert len(set(result.tolist())) == len(result) and -1 not in result.tolist()
    elif op == "free":
        assert len(cache._free) == 3 + len(arg) and len(set(cache._free)) == len(cache._free)
    elif op == "records_held":
        assert_unchanged(cache, snap)


@settings(max_examples=60, deadline=None)
@given(
    window=st.one_of(st.integers(-2, 300), st.booleans(), st.floats(0, 20), st.none()),
    drafts=st.one_of(st.integers(-1, 20), st.booleans()),
    headdim=st.one_of(st.integers(-1, 130), st.booleans()),
)
def test_fuzzed_layouts_are_valid_or_named(window, drafts, headdim):
    try:
        layout = mamba2_layout(num_heads=4, headdim=headdim, dstate=16, ngroups=2,
                               window=window, drafts=drafts)  # fmt: skip
    except (TypeError, ValueError) as exc:
        assert str(exc).split(":")[0] in ("window", "drafts", "headdim"), str(exc)
        return
    assert isinstance(window, int) and not isinstance(window, bool) and 1 <= window <= 256
    assert isinstance(drafts, int) and not isinstance(drafts, bool) and 1 <= drafts <= 16
    assert layout.capacity == window + drafts


def test_scalar_rings_need_only_element_alignment():
    """rec_dt [H, CAP] float32 of an odd head count is 120 bytes a slot: valid (scalar reads)."""
    cache = Mamba2DecodeCache(4, num_heads=6, headdim=24, dstate=64, ngroups=3, window=4,
                              act_dtype="f32", device="cpu")  # fmt: skip
    wrapper = Mamba2DecodeWrapper(cache)
    wrapper.plan(2)
    gen = torch.Generator().manual_seed(0)
    out = wrapper.run(
        torch.randn(2, 6, 24, generator=gen), torch.randn(2, 6, generator=gen),
        -torch.rand(6, generator=gen), torch.randn(2, 3, 64, generator=gen),
        torch.randn(2, 3, 64, generator=gen), cache.allocate(2),
        D=torch.randn(6, generator=gen), dt_bias=torch.randn(6, generator=gen),
    )  # fmt: skip
    assert torch.isfinite(out).all()
    assert [t.alignment for t in cache.layout.tensors()] == [16, 16, 16, 4, 16]
    tensors = dict(cache.tensors)
    wide = torch.zeros(4 * 6 * 5 * 24 + 1)  # rec_x rows one float off a 16-byte boundary
    tensors["rec_x"] = wide[1:].view(4, 6, 5, 24)
    with pytest.raises(ValueError, match="^rec_x: expected 16-byte aligned slots"):
        Mamba2DecodeCache.from_tensors(cache.layout, **tensors)


def test_a_seed_tensor_needs_a_device_seed_plan():
    cache = Mamba2DecodeCache(4, num_heads=4, headdim=16, dstate=16, ngroups=2, window=4,
                              state_dtype="bf16", device="cpu")  # fmt: skip
    wrapper = Mamba2DecodeWrapper(cache)
    with pytest.raises(ValueError, match="^flags: 'device_seed' .* needs 'sr'"):
        wrapper.plan(1, device_seed=True)
    wrapper.plan(1, stochastic_rounding=True, device_seed=True)
    assert "device_seed" in wrapper.spec.flags and wrapper.spec.uri.endswith("_sr")
    gen = torch.Generator().manual_seed(1)
    args = (
        torch.randn(1, 4, 16, generator=gen).bfloat16(), torch.randn(1, 4, generator=gen),
        -torch.rand(4, generator=gen), torch.randn(1, 2, 16, generator=gen).bfloat16(),
        torch.randn(1, 2, 16, generator=gen).bfloat16(), cache.allocate(1),
    )  # fmt: skip
    kw = dict(D=torch.randn(4, generator=gen), dt_bias=torch.randn(4, generator=gen))
    with pytest.raises(TypeError, match="^seed: expected dtype torch.int64"):
        wrapper.run(*args, **kw, seed=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="^seed: expected a tensor of 1 element"):
        wrapper.run(*args, **kw, seed=torch.zeros(2, dtype=torch.int64))
    assert torch.isfinite(wrapper.run(*args, **kw, seed=torch.tensor([5]))).all()
