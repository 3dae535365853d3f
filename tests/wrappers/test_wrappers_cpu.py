"""Mamba-2 cache and wrapper on CPU tensors (the PyTorch path: plan() compiles nothing), slot-id
validation, and the checks shared by both families' caches and wrappers."""

import pytest
import torch

from replayssm_jit import (
    GDNDecodeCache,
    GDNDecodeWrapper,
    Mamba2DecodeCache,
    Mamba2DecodeWrapper,
    SlotCache,
    mamba2_layout,
    mamba2_spec,
)

pytestmark = pytest.mark.usefixtures("no_launch_env")

SHAPE = dict(num_heads=4, headdim=16, dstate=32, ngroups=2)
GDN_SHAPE = dict(num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=16)


def planned_wrapper(*, batch=2, has_z=False, **kwargs):
    """A CPU cache of 6 slots (window 4) and a wrapper planned for `batch` rows, with inputs."""
    cache = Mamba2DecodeCache(6, **SHAPE, window=4, device="cpu")
    wrapper = Mamba2DecodeWrapper(cache, **kwargs)
    wrapper.plan(batch, has_z=has_z)
    gen = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    inputs = dict(
        x=torch.randn(batch, 4, 16, generator=gen).to(bf),
        dt=torch.randn(batch, 4, generator=gen),
        A=-torch.rand(4, generator=gen),
        B=torch.randn(batch, 2, 32, generator=gen).to(bf),
        C=torch.randn(batch, 2, 32, generator=gen).to(bf),
        slot_indices=cache.allocate(batch),
        D=torch.randn(4, generator=gen),
        dt_bias=torch.randn(4, generator=gen),
    )
    if has_z:
        inputs["z"] = torch.randn(batch, 4, 16, generator=gen).to(bf)
    return cache, wrapper, inputs


def run(wrapper, inputs, **override):
    a = {**inputs, **override}
    positional = [a.pop(name) for name in ("x", "dt", "A", "B", "C", "slot_indices")]
    return wrapper.run(*positional, **a)


def snapshot(cache):
    return {name: t.clone() for name, t in cache.tensors.items()}


def unchanged(cache, before):
    return all(torch.equal(cache.tensors[name], t) for name, t in before.items())


# --- plan() and run() on the CPU ---------------------------------------------------------------


def test_plan_on_cpu_compiles_nothing():
    cache, wrapper, _ = planned_wrapper()
    assert wrapper.decode_plan.backend == "cpu" and wrapper.decode_plan.module is None
    assert wrapper.kernel == "per-item" and wrapper.decode_plan.workspace_floats == 0
    assert wrapper.spec == mamba2_spec(headdim=16, dstate=32, heads_per_group=2, window=4)
    assert wrapper.batch_size == 2 and wrapper.window == 4
    conventional = Mamba2DecodeWrapper(cache, mode="conventional")
    assert conventional.plan(2).window == 1 and conventional.kernel == "conventional"
    assert conventional.window == 1


@pytest.mark.parametrize("mode", ["replay", "conventional"])
@pytest.mark.parametrize("has_z", [False, True])
def test_valid_cpu_arguments_run(mode, has_z):
    cache, wrapper, inputs = planned_wrapper(mode=mode, has_z=has_z)
    before = snapshot(cache)
    out = run(wrapper, inputs)
    assert out.shape == (2, 4, 16) and out.dtype == torch.bfloat16 and out.isfinite().all()
    assert out.abs().sum() > 0
    if mode == "replay":
        assert cache.records_held(inputs["slot_indices"]).tolist() == [1, 1]
        assert torch.equal(cache.state, before["state"])  # no flush yet: the checkpoint stays
    else:
        assert not torch.equal(cache.state, before["state"])
        assert torch.equal(cache.cursors, before["cursors"])
    # a pad row reads and writes nothing and gets a zero output
    buffer = torch.full((2, 4, 16), float("nan"), dtype=torch.bfloat16)
    slots = torch.tensor([-1, int(inputs["slot_indices"][1])], dtype=torch.int32)
    result = run(wrapper, inputs, slot_indices=slots, out=buffer)
    assert result is buffer and result[0].eq(0).all() and result[1].isfinite().all()


def test_run_before_plan_and_wrong_batch():
    cache = Mamba2DecodeCache(4, **SHAPE, device="cpu")
    with pytest.raises(RuntimeError, match="plan"):
        Mamba2DecodeWrapper(cache).run(*[torch.zeros(1)] * 6)
    with pytest.raises(RuntimeError, match="plan"):
        _ = Mamba2DecodeWrapper(cache).kernel
    _, wrapper, inputs = planned_wrapper()
    with pytest.raises(ValueError, match=r"^x: expected shape \[2, 4, 16\], got \[3, 4, 16\]$"):
        run(wrapper, inputs, x=torch.zeros(3, 4, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="mode"):
        Mamba2DecodeWrapper(cache, mode="fast")


# --- bad arguments: named, with the expected and the actual value, before anything changes ------


@pytest.mark.parametrize(
    "slots, error, match",
    [
        (
            [0, 6],
            ValueError,
            r"^slot_indices: expected values in \[0, 6\) or pad_slot_id=-1, got 6$",
        ),
        ([1, 1], ValueError, "^slot_indices: expected distinct slots per batch, got slot 1 twice$"),
        ([0, 1, 2], ValueError, r"^slot_indices: expected shape \[2\], got \[3\]$"),
    ],
)
def test_bad_slot_ids_are_rejected(slots, error, match):
    cache, wrapper, inputs = planned_wrapper()
    before = snapshot(cache)
    with pytest.raises(error, match=match):
        run(wrapper, inputs, slot_indices=torch.tensor(slots, dtype=torch.int32))
    assert unchanged(cache, before)


def _bad_inputs():
    bf, f32 = torch.bfloat16, torch.float32
    return [
        (
            dict(x=torch.zeros(2, 4, 16)),
            TypeError,
            "x: expected dtype torch.bfloat16, got torch.float32",
        ),
        (
            dict(x=torch.zeros(2, 4, 32, dtype=bf)[..., ::2]),
            ValueError,
            "x: expected a unit stride",
        ),
        (dict(dt=torch.zeros(2, 3)), ValueError, r"dt: expected shape \[2, 4\], got \[2, 3\]"),
        (dict(A=torch.zeros(4, dtype=torch.float64)), TypeError, "A: expected dtype torch.float32"),
        (dict(A=torch.zeros(8)[::2]), ValueError, "A: expected a contiguous tensor"),
        (dict(B=torch.zeros(2, 1, 32, dtype=bf)), ValueError, r"B: expected shape \[2, 2, 32\]"),
        (
            dict(C=torch.zeros(2, 2, 33, dtype=bf)[..., 1:]),
            ValueError,
            "C: expected 16-byte aligned rows",
        ),
        (dict(D=None), ValueError, r"D: expected a tensor \(plan\(\) had has_D=True\), got None"),
        (
            dict(dt_bias=None),
            ValueError,
            r"dt_bias: expected a tensor \(plan\(\) had has_dt_bias=True\)",
        ),
        (
            dict(z=torch.zeros(2, 4, 16, dtype=bf)),
            ValueError,
            r"z: expected None \(plan\(\) had has_z=False\), got a tensor",
        ),
        (
            dict(out=torch.empty(2, 4, 16, dtype=f32)),
            TypeError,
            "out: expected dtype torch.bfloat16",
        ),
        (
            dict(slot_indices=torch.tensor([0, 1])),
            TypeError,
            "slot_indices: expected dtype torch.int32, got torch.int64",
        ),
        (
            dict(seed=torch.zeros(1, dtype=torch.int64)),
            ValueError,
            "seed: expected an int .*plan with device_seed=True",
        ),
    ]


@pytest.mark.parametrize("index", range(len(_bad_inputs())))
def test_run_names_the_bad_argument(index):
    override, error, match = _bad_inputs()[index]
    cache, wrapper, inputs = planned_wrapper()
    before = snapshot(cache)
    with pytest.raises(error, match=f"^{match}"):
        run(wrapper, inputs, **override)
    assert unchanged(cache, before)


def test_slot_value_check_can_be_skipped_but_not_the_layout_checks():
    """check_slot_values=False (and graph mode) skip the host read of the slot values: repeated
    ids are then the caller's responsibility; shape, dtype and device are always checked."""
    for kwargs in (dict(check_slot_values=False), dict(use_cuda_graph=True)):
        _, wrapper, inputs = planned_wrapper(**kwargs)
        assert wrapper.decode_plan.check_slot_values is False
        # The CPU path reads its slot ids anyway (no sync to save): bad ones still raise.
        with pytest.raises(ValueError, match="^slot_indices: expected distinct slots"):
            run(wrapper, inputs, slot_indices=torch.tensor([1, 1], dtype=torch.int32))
        with pytest.raises(TypeError, match="^slot_indices: expected dtype torch.int32"):
            run(wrapper, inputs, slot_indices=torch.tensor([0, 1]))


def test_graph_mode_writes_a_buffer_fixed_at_plan():
    _, wrapper, inputs = planned_wrapper(use_cuda_graph=True)
    first = run(wrapper, inputs)
    assert run(wrapper, inputs) is first


# --- caches -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(window=0), ValueError, r"^window: expected in \[1, 256\], got 0$"),
        (dict(window=300), ValueError, r"^window: expected in \[1, 256\], got 300$"),
        (dict(window=100000), ValueError, r"^window: expected in \[1, 256\], got 100000$"),
        (dict(drafts=0), ValueError, r"^drafts: expected in \[1, 16\], got 0$"),
        (dict(drafts=17), ValueError, r"^drafts: expected in \[1, 16\], got 17$"),
        (dict(window=True), TypeError, "^window: expected an int, got bool True$"),
        (dict(drafts=True), TypeError, "^drafts: expected an int, got bool True$"),
        (dict(window=4.0), TypeError, "^window: expected an int"),
        (dict(pad_slot_id=1.5), TypeError, "^pad_slot_id: expected an int, got float 1.5$"),
        (dict(pad_slot_id=True), TypeError, "^pad_slot_id: expected an int"),
        (
            dict(pad_slot_id=4),
            ValueError,
            r"^pad_slot_id: expected a negative id or a slot in \[0, 4\)",
        ),
        (dict(ngroups=3), ValueError, "^ngroups: expected a divisor of num_heads=4, got 3$"),
        (dict(dstate=12), ValueError, "^dstate: expected a multiple of 8"),
        (
            dict(state_dtype="bfloat16"),
            TypeError,
            r"^state_dtype: expected one of \['bf16', 'e4m3', 'f16', 'f32', 'nvfp4'\]",
        ),
        (dict(state_dtype=torch.float64), TypeError, "^state_dtype: expected one of"),
        (dict(act_dtype="half"), TypeError, "^act_dtype: expected one of"),
        (dict(device="tpu"), ValueError, "^device: expected a torch device, got 'tpu'"),
    ],
)
def test_cache_rejects_bad_arguments_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        Mamba2DecodeCache(4, **{**SHAPE, "device": "cpu", **kwargs})


def test_cache_takes_short_dtype_names():
    cache = Mamba2DecodeCache(2, **SHAPE, state_dtype="bf16", act_dtype="f16", device="cpu")
    assert cache.state.dtype == torch.bfloat16 and cache.act_dtype == torch.float16
    assert (
        cache.rings["rec_x"].dtype == torch.float16 and cache.rings["rec_dt"].dtype == torch.float32
    )
    assert cache.layout == mamba2_layout(**SHAPE, state_dtype=torch.bfloat16, act_dtype="f16")


def test_cache_shapes_follow_the_layout():
    cache = Mamba2DecodeCache(3, **SHAPE, window=4, drafts=2, device="cpu")
    shapes = {name: tuple(t.shape) for name, t in cache.tensors.items()}
    assert shapes == {
        "state": (3, 4, 16, 32),
        "rec_x": (3, 4, 6, 16),
        "rec_b": (3, 2, 6, 32),
        "rec_dt": (3, 4, 6),
        "cursors": (3, 4),
    }
    assert list(cache.rings) == ["rec_x", "rec_b", "rec_dt"]


@pytest.mark.parametrize(
    "slots, error, match",
    [
        (
            [4],
            ValueError,
            r"^slots: expected slot ids in \[0, 4\) other than pad_slot_id=-1, got 4$",
        ),
        ([-1], ValueError, r"^slots: expected slot ids in \[0, 4\)"),
        ([True], TypeError, "^slots: expected int slot ids, got bool True$"),
        ([1.0], TypeError, "^slots: expected int slot ids, got float 1.0$"),
        (
            torch.tensor([1.0]),
            TypeError,
            "^slots: expected an integer tensor, got dtype torch.float32$",
        ),
        (torch.tensor([[1]]), ValueError, r"^slots: expected a 1-D tensor, got shape \[1, 1\]$"),
        ("01", TypeError, "^slots: expected an int tensor or a list of ints, got str$"),
        (3, TypeError, "^slots: expected an int tensor or a list of ints, got int$"),
    ],
)
def test_cache_validates_slot_ids_strictly(slots, error, match):
    cache = Mamba2DecodeCache(4, **SHAPE, device="cpu")
    cache.allocate(4)
    before = snapshot(cache)
    for method in (cache.reset, cache.free, cache.records_held):
        with pytest.raises(error, match=match):
            method(slots)
    assert unchanged(cache, before)


def test_cache_allocate_free_and_the_pad_slot():
    cache = Mamba2DecodeCache(4, **SHAPE, device="cpu", pad_slot_id=0)
    slots = cache.allocate(3)
    assert slots.tolist() == [1, 2, 3]  # slot 0 is the pad slot, never handed out
    with pytest.raises(ValueError, match=r"^count: expected 0 to 0 free slots, got 1$"):
        cache.allocate(1)
    with pytest.raises(TypeError, match="^count: expected an int"):
        cache.allocate(1.0)
    with pytest.raises(ValueError, match="other than pad_slot_id=0, got 0"):
        cache.reset([0])
    with pytest.raises(
        ValueError, match=r"^slots: expected allocated slot ids, each once, got 2 \(given twice\)"
    ):
        cache.free([2, 2])
    cache.free([2])
    with pytest.raises(ValueError, match=r"got 2 \(not allocated\)"):
        cache.free([2])
    assert cache.allocate(1).tolist() == [2]


def test_cache_over_caller_owned_tensors():
    """SlotCache.from_tensors wraps an engine's own tensors (named as the layout's) in place."""
    layout = mamba2_layout(**SHAPE, window=4)
    tensors = layout.allocate(3, "cpu")
    cache = SlotCache.from_tensors(layout, pad_slot_id=0, **tensors)
    assert cache.num_slots == 3 and cache.state is tensors["state"] and cache.pad_slot_id == 0
    with pytest.raises(ValueError, match=r"^tensors: expected exactly \['state', 'rec_x'"):
        SlotCache.from_tensors(layout, state=tensors["state"])
    with pytest.raises(ValueError, match=r"^rec_b: expected shape \[3, 2, 5, 32\]"):
        SlotCache.from_tensors(layout, **{**tensors, "rec_b": torch.zeros(3, 2, 4, 32)})
    wrapper = Mamba2DecodeWrapper(cache)
    wrapper.plan(1)
    x = torch.randn(1, 4, 16).to(torch.bfloat16)
    B = torch.randn(1, 2, 32).to(torch.bfloat16)
    slots = torch.tensor([2], dtype=torch.int32)
    out = wrapper.run(
        x, torch.randn(1, 4), -torch.rand(4), B, B, slots, D=torch.ones(4), dt_bias=torch.zeros(4)
    )
    assert out.isfinite().all() and int(tensors["cursors"][2, 0]) == 1


# --- a wrapper of one family and a cache of the other ----------------------------------------


def test_wrapper_rejects_the_other_familys_cache():
    m2 = Mamba2DecodeCache(2, **SHAPE, device="cpu")
    gdn = GDNDecodeCache(2, **GDN_SHAPE, device="cpu")
    with pytest.raises(
        TypeError,
        match="^cache: expected a gdn SlotCache, got Mamba2DecodeCache of family 'mamba2'$",
    ):
        GDNDecodeWrapper(m2)
    with pytest.raises(
        TypeError, match="^cache: expected a mamba2 SlotCache, got GDNDecodeCache of family 'gdn'$"
    ):
        Mamba2DecodeWrapper(gdn)
    with pytest.raises(TypeError, match="^cache: expected a mamba2 SlotCache, got Tensor$"):
        Mamba2DecodeWrapper(torch.zeros(2))
    # a plain SlotCache over the right layout is fine
    Mamba2DecodeWrapper(SlotCache(mamba2_layout(**SHAPE), 2, device="cpu")).plan(1)
