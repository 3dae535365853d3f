"""Cache entries: SlotCache(...), the family caches, SlotCache.from_tensors; a cache's
allocate / free / reset / records_held / fork; the lifecycle ops reset_slots / copy_slots on
engine-owned tensors; materialize_slots (prefix states)."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from replayssm_jit import (
    SlotCache,
    copy_slots,
    materialize_slots,
    materialize_states,
    plan_decode,
    reset_slots,
)
from replayssm_jit.ops import torch_path

from .core import Call, Validity, entry, tensors_identical
from .families import ADAPTERS
from .layouts import SMALL, draw_device, draw_small_layout
from .values import INT32_MAX, INT32_MIN, draw_bool, draw_int, is_int, slot_tensor_variant

BAD_COUNTS = (0, -1, 2**31, 2**63, True, 2.0, None, "3")


def draw_num_slots(draw, v: Validity) -> object:
    if not v.spend(draw):
        return draw(st.integers(1, 6))
    n = draw(st.sampled_from(BAD_COUNTS))
    v.mark(False, f"num_slots={n!r}")
    return n


def random_fill(tensors: dict, gen: torch.Generator, window: int) -> None:
    """Random bits where an engine's tensors would hold data: checkpoints and rings, cursors
    with held counts a step leaves (0..window-1) and any epoch and spare word."""
    for name, t in tensors.items():
        if name == "cursors":
            n = t.shape[0]
            t[:, 0] = torch.randint(0, window, (n,), generator=gen).to(torch.int32)
            t[:, 1] = torch.randint(-(2**31), 2**31, (n,), generator=gen).to(torch.int32)
            t[:, 3] = torch.randint(-(2**31), 2**31, (n,), generator=gen).to(torch.int32)
        else:
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))


@entry("cache.init", covers=("SlotCache", "Mamba2DecodeCache", "GDNDecodeCache", "KDADecodeCache"))
def build_cache_init(draw, device):
    v = Validity()
    layout = draw_small_layout(draw)
    how = draw(st.sampled_from(["slotcache", "family", "from_tensors"]))
    pad, ok = draw_int(
        draw, INT32_MIN, INT32_MAX, likely=st.sampled_from([-1, 0, 1, 5, INT32_MIN]), v=v
    )
    v.mark(ok, f"pad_slot_id={pad!r}")
    names = {"layout", "num_slots", "device", "pad_slot_id", "tensors", "window", "state",
             *(t.name for t in layout.tensors()), *SMALL[layout.family.name]}  # fmt: skip
    given: dict = {}
    if how == "from_tensors":
        n = draw(st.integers(1, 5))
        given = layout.allocate(n, device)
        random_fill(given, torch.Generator().manual_seed(draw(st.integers(0, 99))), layout.window)
        kind = draw(st.sampled_from(["variant", "missing", "extra"])) if v.spend(draw) else "keep"
        if kind == "variant":
            t = draw(st.sampled_from(layout.tensors()))
            value, ok, label = slot_tensor_variant(
                draw, given[t.name], t.alignment, optional=False,
                other_device="meta" if device == "cpu" else "cpu",
            )  # fmt: skip
            given[t.name] = value
            v.mark(ok, f"{t.name} {label}")
        elif kind == "missing":
            del given[draw(st.sampled_from(sorted(given)))]
            v.mark(False, "a tensor missing")
        elif kind == "extra":
            given["rec_z"] = torch.zeros(n, 4, device=device)
            v.mark(False, "an unknown tensor")
        num_slots = n

        def run():
            return SlotCache.from_tensors(layout, pad_slot_id=pad, **given)

        dev = device
    else:
        num_slots = draw_num_slots(draw, v)
        dev = draw_device(draw, device, v, none_ok=True)
        if how == "slotcache":

            def run():
                return SlotCache(layout, num_slots, device=dev, pad_slot_id=pad)
        else:
            cls = ADAPTERS[layout.family.name].cache_cls
            args = dict(SMALL[layout.family.name], window=layout.window, drafts=layout.drafts,
                        state_dtype=layout.state_dtype, act_dtype=layout.act_dtype)  # fmt: skip
            if v.spend(draw):
                args["window"] = draw(st.sampled_from([0, 257, True, 2.5]))
                v.mark(False, f"window={args['window']!r}")

            def run():
                return cls(num_slots, device=dev, pad_slot_id=pad, **args)

    if is_int(num_slots) and is_int(pad) and pad >= num_slots:
        v.mark(False, f"pad_slot_id={pad} of {num_slots} slots")

    def check(cache):
        assert cache.layout == layout and cache.num_slots == num_slots
        assert cache.pad_slot_id == pad
        want = torch.device(device) if dev is None or device == "cpu" else cache.device
        assert cache.device.type == want.type
        assert cache._free == [s for s in range(num_slots) if s != pad]
        for t in layout.tensors():
            got = cache.tensors[t.name]
            assert got.shape == t.shape(num_slots) and got.dtype == t.dtype
            if given:
                assert got is given[t.name], f"{t.name} was copied"
            else:
                assert not got.any(), f"{t.name} not zeroed"

    watch = lambda: {k: t for k, t in given.items() if isinstance(t, torch.Tensor)}  # noqa: E731
    return Call(run, names, watch=watch, check=check, valid=v.valid, why=v.why)


def draw_ids(draw, n: int, pad: int, device: str, v: Validity, what: str, *,
             distinct: bool, may_be_free: set[int] | None = None) -> tuple[object, list | None]:  # fmt: skip
    """Slot ids in a drawn form (list, tuple, range, int tensors of several dtypes, or a bad
    form) and values (real slots, the pad, out of range, repeats); returns (ids, values or None
    where the form is bad) and marks them."""
    count = draw(st.integers(0, 4))
    odd = v.spend(draw)
    pool = [*range(n), pad, -1, n, n + 3, INT32_MAX] if odd else [*range(n)]
    values = [draw(st.sampled_from(pool)) for _ in range(count)]
    if distinct and not odd:
        values = list(dict.fromkeys(values))
    form = draw(st.sampled_from(["list", "tuple", "i32", "i64", "i16", "u8", "range"]))
    if v.spend(draw):
        form = draw(st.sampled_from(["f32", "bool", "2d", "str", "int", "bad-item", form]))
    ids: object
    if form == "range":
        values = list(range(min(count, n)))
        ids = range(min(count, n))
    elif form in ("list", "tuple"):
        ids = values if form == "list" else tuple(values)
    elif form in ("i32", "i64", "i16", "u8"):
        dtype = {"i32": torch.int32, "i64": torch.int64, "i16": torch.int16, "u8": torch.uint8}[
            form
        ]
        if form in ("i16", "u8"):
            values = [x for x in values if 0 <= x < 2**7]
        ids = torch.tensor(values, dtype=dtype, device=device)
    else:
        bad = {"f32": torch.tensor([0.0], device=device), "bool": torch.tensor([True]),
               "2d": torch.zeros(1, 1, dtype=torch.int32), "str": "01", "int": 0,
               "bad-item": draw(st.sampled_from([[True], [1.0], [None], [0, "1"]]))}  # fmt: skip
        v.mark(False, f"{what} as {form}")
        return bad[form], None
    for x in values:
        if not 0 <= x < n or x == pad:
            v.mark(False, f"{what} id {x}")
        elif may_be_free is not None and x in may_be_free:
            v.mark(False, f"{what} id {x} free")
    if distinct and len(set(values)) != len(values):
        v.mark(False, f"{what} repeats")
    return ids, values


@entry("cache.slots", covers=("SlotCache",))
def build_cache_slots(draw, device):
    v = Validity()
    layout = draw_small_layout(draw)
    n, pad = draw(st.integers(2, 6)), draw(st.sampled_from([-1, 0]))
    cache = SlotCache(layout, n, device=device, pad_slot_id=pad)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 99)))
    random_fill(cache.tensors, gen, layout.window)
    cache.allocate(draw(st.integers(0, len(cache._free))))
    free = set(cache._free)
    before = {k: t.clone() for k, t in cache.tensors.items()}
    free_before = list(cache._free)
    method = draw(st.sampled_from(["allocate", "free", "reset", "reset", "records_held", "fork"]))
    names = {"slots", "count", "src", "dst", "initial_state"}
    watch = lambda: {**cache.tensors, "_free": cache._free}  # noqa: E731

    def unchanged_except(slots: list[int]) -> None:
        for k, t in cache.tensors.items():
            keep = [s for s in range(n) if s not in slots]
            assert tensors_identical(t[keep].cpu(), before[k][keep].cpu()), k

    if method == "allocate":
        count, ok = draw_int(draw, 0, len(free), likely=st.integers(0, len(free)), v=v)
        v.mark(ok, f"count={count!r}")

        def check(ids):
            assert ids.dtype == torch.int32 and ids.device.type == device
            got = ids.tolist()
            assert got == free_before[:count] and cache._free == free_before[count:]
            unchanged_except(got)
            for s in got:
                assert not cache.state[s].any() and not cache.cursors[s].any()

        return Call(lambda: cache.allocate(count), names, watch=watch, check=check,
                    valid=v.valid, why=v.why)  # fmt: skip
    if method == "fork":
        src, src_v = draw_ids(draw, n, pad, device, v, "src", distinct=False, may_be_free=free)
        dst, dst_v = draw_ids(draw, n, pad, device, v, "dst", distinct=True, may_be_free=free)
        if src_v is not None and dst_v is not None:
            if len(src_v) != len(dst_v):
                v.mark(False, "src and dst of different lengths")
            if set(src_v) & set(dst_v):
                v.mark(False, "dst in src")

        def check(result):
            for s, d in zip(src_v, dst_v):
                for k, t in cache.tensors.items():
                    assert tensors_identical(t[d].cpu(), before[k][s].cpu()), k
            unchanged_except(dst_v)
            assert cache._free == free_before

        return Call(lambda: cache.fork(src, dst), names, watch=watch, check=check, valid=v.valid,
                    why=v.why)  # fmt: skip
    distinct = method in ("free", "reset")
    ids, values = draw_ids(draw, n, pad, device, v, "slots", distinct=distinct,
                           may_be_free=free if method == "free" else None)  # fmt: skip
    if method == "free":

        def check(result):
            assert cache._free == free_before + values
            unchanged_except([])

        return Call(lambda: cache.free(ids), names, watch=watch, check=check, valid=v.valid,
                    why=v.why)  # fmt: skip
    if method == "records_held":

        def check(held):
            assert held.dtype == torch.int32 and held.device.type == device
            assert held.tolist() == [int(before["cursors"][s, 0]) for s in values]
            unchanged_except([])

        return Call(lambda: cache.records_held(ids), names, watch=watch, check=check,
                    valid=v.valid, why=v.why)  # fmt: skip
    initial = draw_initial_state(draw, cache.state, values, device, v)

    def check(result):
        unchanged_except(values)
        assert cache._free == free_before
        for i, s in enumerate(values):
            want = torch.zeros_like(cache.state[s]) if initial is None else initial[i]
            assert tensors_identical(cache.state[s].cpu(), want.to(cache.state.dtype).cpu())
            assert not cache.cursors[s].any()
            for ring in layout.ring_names:
                assert tensors_identical(cache.tensors[ring][s].cpu(), before[ring][s].cpu())

    return Call(lambda: cache.reset(ids, initial), names, watch=watch, check=check,
                valid=v.valid, why=v.why)  # fmt: skip


def draw_initial_state(
    draw, state: torch.Tensor, values, device: str, v: Validity, *, checked: bool = True
):
    """None, or an initial state for `values` slots: good (any floating dtype, CPU or the
    cache's device) or bad (NaN, shape, integer dtype, not a tensor). checked: whether the call
    reads values (check_slot_values); unchecked, a NaN is the caller's and none is drawn."""
    if values is None or draw(st.booleans()):
        return None
    k = len(values)
    kind = draw(st.sampled_from(["good", "good", "nan" if checked else "good", "f64"]))
    if v.spend(draw):
        kind = draw(st.sampled_from(["shape", "int", "list"]))
    base = torch.randn(k, *state.shape[1:])
    if kind == "good":
        return base.to(device)
    if kind == "nan":  # refused: a non-finite state decodes to NaN rows in e4m3 / nvfp4
        v.mark(k == 0, "initial_state nan")  # (no rows: nothing to refuse)
        base[..., 0] = float("nan")
        return base
    if kind == "f64":
        return base.double()
    v.mark(False, f"initial_state {kind}")
    if kind == "shape":
        return torch.randn(k + 1, *state.shape[1:])
    if kind == "int":
        return base.to(torch.int32)
    return base.tolist()


@entry("lifecycle", covers=("reset_slots", "copy_slots"))
def build_lifecycle(draw, device):
    v = Validity()
    layout = draw_small_layout(draw)
    n = draw(st.integers(2, 6))
    tensors = layout.allocate(n, device)
    random_fill(tensors, torch.Generator().manual_seed(draw(st.integers(0, 99))), layout.window)
    before = {k: t.clone() for k, t in tensors.items()}
    op = draw(st.sampled_from(["reset_slots", "copy_slots"]))
    pad_arg = draw(st.sampled_from([True, "0"] if v.spend(draw) else [None, None, -1, 0]))
    if pad_arg is not None and not is_int(pad_arg):
        v.mark(False, f"pad_slot_id={pad_arg!r}")
    pad = pad_arg if is_int(pad_arg) else None
    check_values, ok = draw_bool(draw, v=v)
    v.mark(ok, f"check_slot_values={check_values!r}")
    given = dict(tensors)
    kind = "keep"
    if v.spend(draw):
        kind = draw(st.sampled_from(["variant", "missing-ring", "missing", "extra", "list"]))
    if kind == "variant":
        t = draw(st.sampled_from(layout.tensors()))
        value, ok, label = slot_tensor_variant(
            draw, tensors[t.name], t.alignment, optional=op == "reset_slots" and t.name.startswith("rec"),
            other_device="meta" if device == "cpu" else "cpu",
        )  # fmt: skip
        given[t.name] = value
        v.mark(ok, f"{t.name} {label}")
    elif kind == "missing-ring":
        del given[draw(st.sampled_from(layout.ring_names))]
        v.mark(op == "reset_slots", "a ring missing")
    elif kind == "missing":
        del given[draw(st.sampled_from(["state", "cursors"]))]
        v.mark(False, "state or cursors missing")
    elif kind == "extra":
        given["rec_z"] = torch.zeros(n, device=device)
        v.mark(False, "an unknown tensor")
    tensors_arg: object = given if kind != "list" else list(given.values())
    if kind == "list":
        v.mark(False, "tensors as a list")
    fake_pad = -1 if pad is None else pad
    unchecked = check_values is False  # ids then must be a tensor on the device, used as given
    names = {"layout", "tensors", "slots", "src", "dst", "initial_state", "pad_slot_id",
             "check_slot_values", *(t.name for t in layout.tensors())}  # fmt: skip

    real = [s for s in range(n) if s != fake_pad]

    def written():
        return {k: t for k, t in given.items() if isinstance(t, torch.Tensor)}

    def unchecked_ids(what, values):
        """Ids for check_slot_values=False: the caller's to get right, so drawn right; only
        their form varies (a tensor on the device, or a list: a TypeError)."""
        if v.spend(draw):
            v.mark(False, f"{what} as a list without the value check")
            return values
        dtype = draw(st.sampled_from([torch.int64, torch.int32]))
        return torch.tensor(values, dtype=dtype, device=device)

    if op == "reset_slots":
        if unchecked:
            values = draw(st.permutations(real))[: draw(st.integers(0, len(real)))]
            ids = unchecked_ids("slots", values)
        else:
            ids, values = draw_ids(draw, n, fake_pad, device, v, "slots", distinct=True)
        state = given.get("state", tensors["state"])  # (what the op was given: a variant is a copy)
        if not isinstance(state, torch.Tensor):  # (a None state variant: the pool's shape)
            state = tensors["state"]
        initial = draw_initial_state(draw, state, values, device, v,
                                     checked=check_values is not False)  # fmt: skip

        def run():
            return reset_slots(layout, tensors_arg, ids, initial, pad_slot_id=pad_arg,
                               check_slot_values=check_values)  # fmt: skip

        def check(result):
            for k, t in written().items():
                keep = [s for s in range(n) if s not in values]
                assert tensors_identical(t[keep].cpu(), before[k][keep].cpu()), k
            for i, s in enumerate(values):
                want = torch.zeros_like(state[s]) if initial is None else initial[i]
                assert tensors_identical(state[s].cpu(), want.to(state.dtype).cpu())
                assert not given.get("cursors", tensors["cursors"])[s].any()

    else:
        if unchecked:
            order = draw(st.permutations(real))
            m = draw(st.integers(0, len(real) // 2))
            dst_v = order[:m]
            src_v = [draw(st.sampled_from(order[m:])) for _ in range(m)]
            src, dst = unchecked_ids("src", src_v), unchecked_ids("dst", dst_v)
        else:
            src, src_v = draw_ids(draw, n, fake_pad, device, v, "src", distinct=False)
            dst, dst_v = draw_ids(draw, n, fake_pad, device, v, "dst", distinct=True)
            if src_v is not None and dst_v is not None:
                if len(src_v) != len(dst_v):
                    v.mark(False, "src and dst of different lengths")
                if set(src_v) & set(dst_v):
                    v.mark(False, "dst in src")

        def run():
            return copy_slots(layout, tensors_arg, src, dst, pad_slot_id=pad_arg,
                              check_slot_values=check_values)  # fmt: skip

        def check(result):
            for s, d in zip(src_v, dst_v):
                for k, t in written().items():
                    assert tensors_identical(t[d].cpu(), before[k][s].cpu()), k
            for k, t in written().items():
                keep = [s for s in range(n) if s not in dst_v]
                assert tensors_identical(t[keep].cpu(), before[k][keep].cpu()), k

    watch = lambda: {k: t for k, t in given.items() if isinstance(t, torch.Tensor)}  # noqa: E731
    return Call(run, names, watch=watch, check=check, valid=v.valid, why=v.why)


@entry("prefix.materialize", covers=("materialize_slots",), devices=("cpu",))
def build_materialize(draw, device):
    """materialize_slots on a randomly filled pool: ids in every form, Mamba-2's A given, missing,
    of a wrong dtype or extra, corrupted cursors. A success must equal the fold in float64 of
    each named slot's held records and write nothing. (No kernel: CPU only; the CUDA tensors
    take the same PyTorch ops, run in tests/protocol/test_prefix_states.py.)"""
    v = Validity()
    layout = draw_small_layout(draw)
    n = draw(st.integers(1, 5))
    tensors = layout.allocate(n, device)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 99)))
    random_fill(tensors, gen, layout.window)
    if v.spend(draw):
        tensors["cursors"][draw(st.integers(0, n - 1)), 0] = draw(
            st.sampled_from([-1, layout.capacity, INT32_MAX])
        )
    plan = plan_decode(layout, 1, device=device)
    ids, values = draw_ids(draw, n, -1, device, v, "slots", distinct=False)
    for s in values or []:
        held = int(tensors["cursors"][s, 0]) if 0 <= s < n else 0
        if not 0 <= held < layout.capacity:
            v.mark(False, f"slot {s}'s cursor holds {held}")
    params: dict = {}
    heads = layout.shape.value_heads
    if layout.family.name == "mamba2":
        kind = draw(st.sampled_from(["f64", "short", "none"])) if v.spend(draw) else "good"
        if kind != "none":
            size = heads - 1 if kind == "short" else heads
            params["A"] = -torch.rand(
                size, generator=gen, dtype=torch.float64 if kind == "f64" else torch.float32
            )
        v.mark(kind == "good", f"A {kind}")
    elif v.spend(draw):
        params["A"] = -torch.rand(heads)
        v.mark(False, "A given to a delta-rule family")
    if v.spend(draw):
        params["D"] = torch.zeros(heads)
        v.mark(False, "an unknown parameter")
    before = {k: t.clone() for k, t in tensors.items()}

    def run():
        return materialize_slots(plan, tensors, ids, **params)

    def check(result):
        for k, t in tensors.items():
            assert tensors_identical(t, before[k]), k
        assert result.dtype == torch.float32 and result.shape == (
            len(values),
            *tensors["state"].shape[1:],
        )
        shape = layout.shape
        for row, s in enumerate(values):
            held = int(tensors["cursors"][s, 0])
            state = tensors["state"][s : s + 1].double()
            rings = [tensors[r][s : s + 1, :, :held].double() for r in layout.ring_names]
            if held and layout.family.name == "mamba2":
                want = torch_path.mamba2_fold(
                    state, *rings, params["A"].double(), heads // shape.key_heads
                )
            elif held:
                want = torch_path.delta_fold(
                    state, *rings, "qk_l2norm" in plan.spec.flags, heads // shape.key_heads
                )
            else:
                want = state
            err = (result[row].double() - want[0]).norm() / want.norm().clamp_min(1e-300)
            assert err < 1e-5 or not torch.isfinite(want).all(), (s, float(err))

    names = {
        "plan",
        "tensors",
        "slots",
        "A",
        "D",
        "cursors",
        *layout.ring_names,
        "state",
        "mamba2",
        "gdn",
    }
    return Call(run, names, watch=lambda: tensors, check=check, valid=v.valid, why=v.why)


@entry("prefix.materialize_states", covers=("materialize_states",), devices=("cpu",))
def build_materialize_states(draw, device):
    """materialize_states over a [layers, batch] table of one layout's pools: pads, repeats, ids
    past the pool, corrupted cursors, a table of a wrong dtype or shape, an out of a wrong shape,
    Mamba-2's A missing or given to a delta-rule family. A success gives each named row the bits
    materialize_slots gives (NaN where it gives NaN), leaves pad rows and the pools as they were.
    (CPU only: the CUDA tensors take the same PyTorch ops.)"""
    v = Validity()
    layout = draw_small_layout(draw)
    n, layers, batch = draw(st.integers(1, 4)), draw(st.integers(1, 2)), draw(st.integers(0, 4))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 99)))
    pools = [layout.allocate(n, device) for _ in range(layers)]
    for pool in pools:
        random_fill(pool, gen, layout.window)
    if v.spend(draw):
        pools[-1]["cursors"][draw(st.integers(0, n - 1)), 0] = draw(
            st.sampled_from([-1, layout.capacity, INT32_MAX])
        )
    plan = plan_decode(layout, 1, device=device)
    choices = [*range(n), -1, -7, n, INT32_MAX] if v.spend(draw) else [*range(n), -1]
    values = [[draw(st.sampled_from(choices)) for _ in range(batch)] for _ in range(layers)]
    for layer, row in enumerate(values):
        for s in row:
            if s >= n:
                v.mark(False, f"slot {s} past the pool")
            elif s >= 0 and not 0 <= int(pools[layer]["cursors"][s, 0]) < layout.capacity:
                v.mark(False, f"slot {s}'s cursor in layer {layer}")
    table = torch.tensor(values, dtype=torch.int32).view(layers, batch)
    if v.spend(draw):
        table = table.long() if draw(st.booleans()) else table[:, None]
        v.mark(False, "a slot table of a wrong dtype or shape")
    per_slot = (batch + (1 if v.spend(draw) else 0), *tensors_state_shape(pools[0]))
    v.mark(per_slot[0] == batch, "out of a wrong batch")
    out = torch.randn((layers, *per_slot), generator=gen)
    heads = layout.shape.value_heads
    params = [{"A": -torch.rand(heads, generator=gen)} if layout.family.name == "mamba2" else {}
              for _ in range(layers)]  # fmt: skip
    if v.spend(draw):
        params[-1] = {} if params[-1] else {"A": -torch.rand(heads)}
        v.mark(False, "A missing or given to a delta-rule family")
    before = {f"{i}.{k}": t.clone() for i, pool in enumerate(pools) for k, t in pool.items()}
    out_before = out.clone()

    def watch():
        return {
            "out": out,
            **{f"{i}.{k}": t for i, pool in enumerate(pools) for k, t in pool.items()},
        }

    def run():
        return materialize_states(plan, pools, table, out, params)

    def check(result):
        assert result is None
        for i, pool in enumerate(pools):
            for k, t in pool.items():
                assert tensors_identical(t, before[f"{i}.{k}"]), k
        for layer, row in enumerate(values):
            for b, s in enumerate(row):
                got = out[layer, b]
                if s < 0:
                    assert tensors_identical(got, out_before[layer, b]), (layer, b)
                    continue
                want = materialize_slots(plan, pools[layer], [s], **params[layer])[0]
                assert torch.equal(torch.isnan(got), torch.isnan(want)), (layer, b, s)
                assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0)), (layer, b, s)

    names = {"plans", "pools", "slot_table", "out", "out[0]", "params[0]", "params[1]"}
    names |= {f"slot_table[{layer}, {b}]" for layer in range(layers) for b in range(batch)}
    return Call(run, names, watch=watch, check=check, valid=v.valid, why=v.why)


def tensors_state_shape(pool: dict) -> tuple[int, ...]:
    """The FP32 state's per-slot shape of a pool (an nvfp4 state holds two codes a byte)."""
    shape = list(pool["state"].shape[1:])
    if pool["state"].dtype == torch.float4_e2m1fn_x2:
        shape[-1] *= 2
    return tuple(shape)
