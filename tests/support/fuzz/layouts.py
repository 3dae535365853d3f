"""Layout and spec entries: family_layout / mamba2_layout / gdn_layout / kda_layout, the
CacheLayout methods (tensors, ring_names, capacity, bytes_per_slot, allocate, check_tensors), and
make_spec / family_spec / mamba2_spec / gdn_spec / kda_spec."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from replayssm_jit import gdn_layout, gdn_spec, kda_layout, kda_spec, mamba2_layout, mamba2_spec
from replayssm_jit.core.dtypes import MAX_DRAFTS, MAX_HEADS, MAX_WINDOW
from replayssm_jit.families import FAMILIES
from replayssm_jit.families.base import HeadShape
from replayssm_jit.families.layout import family_layout
from replayssm_jit.families.spec import family_spec, make_spec

from .core import Call, Validity, entry
from .values import draw_int, is_int, slot_tensor_variant

ROLES = ("key_heads", "value_heads", "key_dim", "value_dim")
DTYPE_FORMS = {
    torch.float32: torch.float32, torch.bfloat16: torch.bfloat16, torch.float16: torch.float16,
    "f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16,
}  # fmt: skip
BAD_DTYPES = (torch.float64, torch.int32, torch.uint8, "float32", "bfloat16", "fp8", None, 4, "")
SHORT = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
# Head dims with a row tiling at every key dim of KEY_DIMS (the others: the spec decides).
VALUE_DIMS = (16, 32, 64)
KEY_DIMS = (16, 32, 64, 128)


def draw_dtype(draw, v: Validity, name: str) -> object:
    if not v.spend(draw):
        return draw(st.sampled_from(list(DTYPE_FORMS)))
    value = draw(st.sampled_from(BAD_DTYPES))
    v.mark(False, f"{name} {value!r}")
    return value


def draw_head_dims(draw, fam, v: Validity, state, *, heads: bool = True) -> dict[str, object]:
    """The family's shape arguments by role (heads: with the two head counts), marked by the
    rules: positive ints, key heads dividing value heads, key dims of whole 16-byte chunks."""
    vec = 16 // (4 if state in (torch.float32, "f32") else 2)
    names = dict(zip(ROLES, fam.shape_args))
    dims: dict[str, object] = {}
    if heads:
        key_heads, ok_k = draw_int(draw, 1, MAX_HEADS, likely=st.sampled_from([1, 2, 3, 4]), v=v)
        v.mark(ok_k, f"{names['key_heads']}={key_heads!r}")
        if ok_k and draw(st.integers(0, 3)):
            value_heads = key_heads * draw(st.integers(1, 3)) + (1 if v.spend(draw) else 0)
            ok = value_heads % key_heads == 0 and value_heads <= MAX_HEADS
        else:
            value_heads, ok = draw_int(draw, 1, MAX_HEADS, likely=st.sampled_from([1, 2, 4]), v=v)
            if ok and ok_k and value_heads % key_heads:
                ok = False
        v.mark(ok, f"{names['value_heads']}={value_heads!r} for {key_heads!r}")
        dims.update(key_heads=key_heads, value_heads=value_heads)
    odd = [8, 12, 24, 2048, 4096] if v.spend(draw) else KEY_DIMS
    key_dim, ok = draw_int(draw, 1, None, likely=st.sampled_from(odd), v=v)
    if ok:
        ok = key_dim % max(vec, 8) == 0 and key_dim <= 32 * vec * 8
        if ok and key_dim not in KEY_DIMS:
            ok = None  # (a valid key dim; whether the value rows then tile is the spec's call)
    v.mark(ok, f"{names['key_dim']}={key_dim!r}")
    odd = [8, 24, 3, 7] if v.spend(draw) else VALUE_DIMS
    value_dim, ok = draw_int(draw, 1, None, likely=st.sampled_from(odd), v=v)
    if ok and value_dim not in VALUE_DIMS:
        ok = None
    v.mark(ok, f"{names['value_dim']}={value_dim!r}")
    return {**dims, "key_dim": key_dim, "value_dim": value_dim}


def _expected_tensors(fam, shape: dict, cap: int, state, act) -> list:
    """(name, per-slot shape, dtype) of every slot tensor, as README's table lists them."""
    kh, vh, kd, vd = (shape[r] for r in ROLES)
    if fam.name == "mamba2":
        rings = [("rec_x", (vh, cap, vd), act), ("rec_b", (kh, cap, kd), act),
                 ("rec_dt", (vh, cap), torch.float32)]  # fmt: skip
    else:
        g_shape = (vh, cap, kd) if fam.decay_per_channel else (vh, cap)
        rings = [("rec_u", (vh, cap, vd), torch.float32), ("rec_k", (kh, cap, kd), act),
                 ("rec_g", g_shape, torch.float32)]  # fmt: skip
    return [("state", (vh, vd, kd), state), *rings, ("cursors", (4,), torch.int32)]


def _check_layout(layout, fam, shape, window, drafts, state, act):
    state, act = DTYPE_FORMS[state], DTYPE_FORMS[act]
    assert layout.family is fam and (layout.window, layout.drafts) == (window, drafts)
    assert layout.capacity == window + drafts
    assert (layout.state_dtype, layout.act_dtype) == (state, act)
    assert [getattr(layout.shape, r) for r in ROLES] == [shape[r] for r in ROLES]
    want = _expected_tensors(fam, shape, window + drafts, state, act)
    got = [(t.name, t.per_slot_shape, t.dtype) for t in layout.tensors()]
    assert got == want, f"{got} != {want}"
    assert layout.ring_names == tuple(n for n, _, _ in want[1:-1])
    total = sum(math.prod(s) * d.itemsize for _, s, d in want)
    assert layout.bytes_per_slot() == total


@entry("layout", covers=("mamba2_layout", "gdn_layout", "kda_layout", "CacheLayout"))
def build_layout(draw, device):
    v = Validity()
    fam = FAMILIES[draw(st.sampled_from(sorted(FAMILIES)))]
    state = draw_dtype(draw, v, "state_dtype")
    act = draw_dtype(draw, v, "act_dtype")
    dims = draw_head_dims(draw, fam, v, state)
    kwargs = {arg: dims[role] for role, arg in zip(ROLES, fam.shape_args)}
    window, ok = draw_int(draw, 1, MAX_WINDOW, likely=st.sampled_from([1, 4, 16, 256]), v=v)
    v.mark(ok, f"window={window!r}")
    drafts, ok = draw_int(draw, 1, MAX_DRAFTS, likely=st.sampled_from([1, 2, 16]), v=v)
    v.mark(ok, f"drafts={drafts!r}")
    kwargs.update(window=window, drafts=drafts, state_dtype=state, act_dtype=act)
    extra = draw(st.sampled_from(["missing", "unknown"])) if v.spend(draw) else None
    if extra == "missing":
        del kwargs[draw(st.sampled_from(fam.shape_args))]
        v.mark(False, "a shape argument missing")
    elif extra == "unknown":
        kwargs["num_groups"] = 2
        v.mark(False, "an unknown shape argument")
    how = draw(st.sampled_from(["family", "named", "object"]))
    if v.spend(draw):
        how = "bad-family"
    if how == "named":
        fn = {"mamba2": mamba2_layout, "gdn": gdn_layout, "kda": kda_layout}[fam.name]

        def run():
            return fn(**kwargs)
    else:
        family = {"family": fam.name, "object": fam}.get(how)
        if how == "bad-family":
            family = draw(st.sampled_from(["Mamba2", "KDA", None, 3, ["gdn"]]))
            v.mark(False, f"family {family!r}")

        def run():
            return family_layout(family, **kwargs)

    def check(layout):
        _check_layout(layout, fam, dims, window, drafts, state, act)

    names = {*fam.shape_args, "window", "drafts", "state_dtype", "act_dtype", "family",
             f"{fam.name} shape"}  # fmt: skip
    return Call(run, names, check=check, valid=v.valid, why=v.why)


SMALL = {
    "mamba2": dict(ngroups=2, num_heads=4, dstate=16, headdim=16),
    "gdn": dict(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16),
    "kda": dict(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16),
}


def draw_small_layout(draw, fam_name: str | None = None):
    fam_name = fam_name or draw(st.sampled_from(sorted(SMALL)))
    return family_layout(
        fam_name, **SMALL[fam_name], window=draw(st.sampled_from([1, 3, 4])),
        drafts=draw(st.sampled_from([1, 2])),
        state_dtype=draw(st.sampled_from(["f32", "bf16"])),
        act_dtype=draw(st.sampled_from(["f32", "bf16", "f16"])),
    )  # fmt: skip


def draw_device(draw, device: str, v: Validity, *, none_ok: bool | None = None) -> object:
    """A device argument: the run's device in its forms, or a bad one."""
    cuda = torch.cuda.is_available()
    forms = [device, torch.device(device)]
    if device == "cpu":
        forms.append("cpu:0")
    value = draw(st.sampled_from(forms))
    if v.spend(draw):
        value = draw(st.sampled_from(["cuda", "cuda:0", 0, "banana", "meta", None, 1.5,
                                      "cuda:banana", "cuda:99"]))  # fmt: skip
    if value is None:
        v.mark(none_ok, "device None")
    elif value in forms:
        pass
    elif value in ("cuda", "cuda:0", 0):
        v.mark(cuda, f"device {value!r}")
    else:
        v.mark(False, f"device {value!r}")
    return value


@entry("layout.methods", covers=("CacheLayout", "TensorLayout"))
def build_layout_methods(draw, device):
    v = Validity()
    layout = draw_small_layout(draw)
    method = draw(st.sampled_from(["allocate", "check_tensors", "check_tensors", "views"]))
    if method == "views":
        n = draw(st.integers(0, 5))

        def run():
            return [t.shape(n) for t in layout.tensors()], layout.ring_names

        def check(result):
            shapes, rings = result
            assert shapes == [(n, *t.per_slot_shape) for t in layout.tensors()]
            # (separate mode's own rings only with a read copy)
            held = [r for r in layout.family.rings if layout.read_dtype or not r.read_copy_only]
            assert rings == tuple(r.name for r in held)

        return Call(run, (), check=check, valid=True)
    if method == "allocate":
        num_slots, ok = draw_int(draw, 1, None, likely=st.integers(1, 6), v=v)
        if is_int(num_slots) and num_slots > 64:
            num_slots, ok = -num_slots, False  # (no multi-gigabyte pools)
        v.mark(ok, f"num_slots={num_slots!r}")
        dev = draw_device(draw, device, v, none_ok=None)

        def run():
            return layout.allocate(num_slots, dev)

        def check(tensors):
            assert list(tensors) == [t.name for t in layout.tensors()]
            for t in layout.tensors():
                got = tensors[t.name]
                assert got.shape == t.shape(num_slots) and got.dtype == t.dtype
                assert got.device.type == device and not got.any()

        return Call(run, {"num_slots", "device"}, check=check, valid=v.valid, why=v.why)
    num_slots = draw(st.integers(1, 5))
    base = layout.allocate(num_slots, device)
    tensors: dict = dict(base)
    optional = draw(st.sets(st.sampled_from([t.name for t in layout.tensors()])))
    for t in layout.tensors():
        if v.spend(draw):
            value, ok, label = slot_tensor_variant(
                draw, base[t.name], t.alignment, optional=t.name in optional,
                other_device="meta" if device == "cpu" else "cpu",
            )  # fmt: skip
            v.mark(ok, f"{t.name} {label}")
            if value is None and draw(st.booleans()):
                del tensors[t.name]
            else:
                tensors[t.name] = value
    fixed = draw(st.sampled_from([None, num_slots]))
    if v.spend(draw):
        fixed = draw(st.sampled_from([num_slots + 1, 0, float(num_slots), True]))
    if fixed is not None:
        v.mark(fixed == num_slots and is_int(fixed), f"num_slots={fixed!r}")
    dev = draw(st.sampled_from([torch.device(device), device]))
    as_mapping = not v.spend(draw)
    arg = tensors if as_mapping else list(tensors.values())
    if not as_mapping:
        v.mark(False, "tensors as a list")
    kinds = {t.name for t in layout.tensors()}

    def run():
        return layout.check_tensors(arg, device=dev, optional=optional, num_slots=fixed)

    def check(result):
        assert result == num_slots

    return Call(run, {*kinds, "tensors", "num_slots", "device"},
                watch=lambda: {k: t for k, t in tensors.items() if t is not None}, check=check,
                valid=v.valid, why=v.why)  # fmt: skip


@entry("spec", covers=("mamba2_spec", "gdn_spec", "kda_spec", "KernelSpec"))
def build_spec(draw, device):
    v = Validity()
    fam = FAMILIES[draw(st.sampled_from(sorted(FAMILIES)))]
    state = draw_dtype(draw, v, "state_dtype")
    act = draw_dtype(draw, v, "act_dtype")
    window, ok = draw_int(draw, 1, MAX_WINDOW, likely=st.sampled_from([1, 4, 16, 256]), v=v)
    v.mark(ok, f"window={window!r}")
    drafts, ok = draw_int(draw, 1, MAX_DRAFTS, likely=st.sampled_from([1, 2, 16]), v=v)
    v.mark(ok, f"drafts={drafts!r}")
    flags = None
    if draw(st.booleans()):
        pool = sorted(fam.flags) + (["bogus", "Z"] if v.spend(draw) else [])
        flags = draw(st.lists(st.sampled_from(pool), max_size=4))
        if draw(st.booleans()):
            flags = tuple(flags)
    chosen = fam.default_flags if flags is None else flags
    if set(chosen) - fam.flags:
        v.mark(False, f"flags {chosen}")
    sixteen = state in (torch.bfloat16, torch.float16, "bf16", "f16")
    if "sr" in chosen and not sixteen and state in DTYPE_FORMS:
        v.mark(False, "sr with an f32 state")
    if "device_seed" in chosen and "sr" not in chosen:
        v.mark(False, "device_seed without sr")
    replay_decode = isinstance(window, int) and window >= 2 and drafts == 1
    if (
        "flush_mask" in chosen
        and isinstance(window, int)
        and isinstance(drafts, int)
        and not replay_decode
    ):
        v.mark(False, "flush_mask without a ReplaySSM decode step (window >= 2, drafts = 1)")
    if "read_rn" in chosen:  # (these layouts have no read copy)
        v.mark(False, "read_rn without a read copy")
    how = draw(st.sampled_from(["make", "family", "named"]))
    if how == "make" and v.spend(draw):
        how = "make-bad-shape"
    dims = draw_head_dims(draw, fam, v, state, heads=how.startswith("make"))
    common = dict(window=window, drafts=drafts, act_dtype=act, state_dtype=state, flags=flags)
    per_key = None
    if how.startswith("make"):
        shape = HeadShape(*(dims[r] for r in ROLES))
        if how == "make-bad-shape":
            shape = draw(st.sampled_from([tuple(dims.values()), None, dict(dims)]))
            v.mark(False, f"shape {type(shape).__name__}")

        def run():
            return make_spec(fam.name, shape, **common)

        names = {*fam.shape_args, "shape"}
    else:
        per_key, ok = draw_int(draw, 1, MAX_HEADS, likely=st.sampled_from([1, 2, 4]), v=v)
        v.mark(ok, f"heads per key head {per_key!r}")
        by_arg = {arg: (per_key if role == "heads_per_key" else dims[role])
                  for _, role, arg in fam.spec_dims}  # fmt: skip
        if how == "family":

            def run():
                return family_spec(fam.name, **by_arg, **common)
        else:
            fn = {"mamba2": mamba2_spec, "gdn": gdn_spec, "kda": kda_spec}[fam.name]

            def run():
                return fn(**by_arg, **common)

        names = {arg for _, _, arg in fam.spec_dims} | set(
            fam.shape_args
        )  # head bounds name the heads

    def check(spec):
        per = per_key if per_key is not None else dims["value_heads"] // dims["key_heads"]
        roles = {"heads_per_key": per, **dims}
        assert spec.family == fam.name
        assert spec.dims == tuple((k, roles[r]) for k, r, _ in fam.spec_dims)
        assert (spec.window, spec.drafts, spec.capacity) == (window, drafts, window + drafts)
        assert (spec.act_dtype, spec.state_dtype) == (
            SHORT[DTYPE_FORMS[act]],
            SHORT[DTYPE_FORMS[state]],
        )
        assert spec.flags == tuple(sorted(set(chosen)))
        uri_dims = "_".join(f"{k}{val}" for k, val in spec.dims)
        assert spec.uri.startswith(f"{fam.name}_{uri_dims}_L{window}_T{drafts}_")
        assert spec.state_rows_cols == (dims["value_dim"], dims["key_dim"])

    names |= {"window", "drafts", "state_dtype", "act_dtype", "flags", "dims",
              f"{fam.name} spec"}  # fmt: skip
    return Call(run, names, check=check, valid=v.valid, why=v.why)
