"""Drawn argument values: each comes with whether the entry must accept it (True), must
reject it (False) or may do either (None), by the documented rules, worked out here
independently of the package's own checks."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

HUGE_INTS = (2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, 10**30)
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _unusual(draw, v) -> bool:
    """Whether to draw from an argument's unusual values: as the call's Validity budget allows
    (support.fuzz.core.Validity.spend), else one time in three."""
    return v.spend(draw) if v is not None else draw(st.integers(0, 2)) == 0


def draw_int(draw, lo: int, hi: int | None, *, likely=None, v=None) -> tuple[object, bool]:
    """An int argument of valid range [lo, hi] (hi None: unbounded): mostly valid values (from
    `likely` if given) and the bounds; unusual ones: just past the bounds, huge and negative
    ints, bools, floats (integral ones too, NaN, inf), None, strings."""
    top = hi if hi is not None else lo + 1000
    if _unusual(draw, v):
        kind = draw(st.sampled_from(["past", "huge", "bool", "float", "other"]))
    else:
        kind = draw(st.sampled_from(["valid"] * 6 + ["edge"]))
    if kind == "valid":
        v = draw(likely if likely is not None else st.integers(lo, min(top, lo + 64)))
    elif kind == "edge":
        v = draw(st.sampled_from([lo, top]))
    elif kind == "past":
        v = draw(st.sampled_from([lo - 1, top + 1] if hi is not None else [lo - 1]))
    elif kind == "huge":
        v = draw(st.sampled_from([*HUGE_INTS, -(2**31) - 1, -(2**63), -(10**30)]))
    elif kind == "bool":
        v = draw(st.booleans())
    elif kind == "float":
        v = draw(st.sampled_from([float(lo), float(top), 1.5, math.nan, math.inf, -math.inf]))
    else:
        v = draw(st.sampled_from([None, "4", b"4", [4], (4,), 4j]))
    if not is_int(v):
        return v, False
    return v, lo <= v and (hi is None or v <= hi)


def draw_bool(draw, v=None) -> tuple[object, bool]:
    if _unusual(draw, v):
        value = draw(st.sampled_from([0, 1, None, "True", 1.0, torch.tensor(True)]))
    else:
        value = draw(st.booleans())
    return value, isinstance(value, bool)


def draw_choice(draw, choices: tuple[str, ...], v=None) -> tuple[object, bool]:
    """One of the string `choices`, or a near miss (case, spaces, another type)."""
    kind = draw(st.sampled_from(["miss", "type"])) if _unusual(draw, v) else "valid"
    if kind == "valid":
        return draw(st.sampled_from(choices)), True
    if kind == "miss":
        c = draw(st.sampled_from(choices))
        v = draw(st.sampled_from([c.upper(), f" {c}", c[:-1], c + "x", "", "auto!"]))
        return v, v in choices
    return draw(st.sampled_from([None, 0, 1, True, [choices[0]], (choices[0],)])), False


# --- tensor variants --------------------------------------------------------------------------
# req: what the argument needs: "any" (any strides), "inner" (unit stride in the last dim),
# "aligned" (inner plus 16-byte aligned rows: every outer stride and the start), "contiguous".


def _aligned_rows(t: torch.Tensor) -> bool:
    per = 16 // t.element_size()
    return t.data_ptr() % 16 == 0 and all(s % per == 0 for s in t.stride()[:-1])


def meets(t: torch.Tensor, req: str) -> bool:
    """Whether tensor `t` meets layout requirement `req` (as documented in ops/*.py)."""
    inner = t.dim() == 0 or t.stride(-1) == 1 or t.shape[-1] <= 1
    if req == "any":
        return True
    if req == "inner":
        return inner
    if req == "aligned":
        return inner and _aligned_rows(t)
    if req == "contiguous":
        return t.is_contiguous()
    raise ValueError(req)


def _in_buffer(base: torch.Tensor, pad: int, offset: int) -> torch.Tensor:
    """A copy of `base` as a view into a larger buffer: `pad` extra elements per last-dim row,
    starting `offset` elements in."""
    n = base.shape[-1] if base.dim() else 1
    rows = base.numel() // max(n, 1) if n else 0
    buf = torch.zeros(rows * (n + pad) + offset + pad, dtype=base.dtype, device=base.device)
    view = buf[offset : offset + rows * (n + pad)].view(*base.shape[:-1], n + pad)[..., :n]
    view.copy_(base)
    return view


OTHER_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int32,
                torch.int64, torch.bool)  # fmt: skip


def tensor_variant(draw, base: torch.Tensor, req: str, *, other_device: str) -> tuple:
    """(value, valid, label): `base` itself or a variant of it, the same values in another
    layout (padded rows, odd offsets, inner strides, expanded stride-0 rows, a transposed
    copy) or a wrong one (dtype, shape, device, None, a list, a float)."""
    kinds = ["same", "pad-aligned", "pad-1", "offset-1", "stride-2", "expanded", "transposed",
             "dtype", "shape-extra", "shape-size", "shape-drop", "device", "none", "list",
             "scalar"]  # fmt: skip
    kind = draw(st.sampled_from(kinds))
    if kind == "same":
        return base, True, kind
    if kind in ("pad-aligned", "pad-1", "offset-1"):
        pad = {"pad-aligned": 16 // base.element_size(), "pad-1": 1, "offset-1": 0}[kind]
        if base.dim() == 0:
            return base, True, "same"
        t = _in_buffer(base, pad, 1 if kind == "offset-1" else 0)
        return t, meets(t, req), kind
    if kind == "stride-2":
        if base.dim() == 0:
            return base, True, "same"
        wide = torch.zeros(*base.shape[:-1], 2 * base.shape[-1], dtype=base.dtype,
                           device=base.device)  # fmt: skip
        t = wide[..., ::2]
        t.copy_(base)
        return t, meets(t, req), kind
    if kind == "expanded":
        if base.dim() == 0 or base.shape[0] == 0:
            return base, True, "same"
        t = base[:1].expand_as(base)
        return t, meets(t, req), kind
    if kind == "transposed":
        if base.dim() < 2:
            return base, True, "same"
        t = base.transpose(-1, -2).contiguous().transpose(-1, -2)
        return t, meets(t, req), kind
    if kind == "dtype":
        dtype = draw(st.sampled_from([d for d in OTHER_DTYPES if d != base.dtype]))
        return base.to(dtype), False, f"dtype {dtype}"
    if kind == "shape-extra":
        return base.unsqueeze(0), False, kind
    if kind == "shape-size":
        if base.dim() == 0:
            return base.reshape(1), False, kind
        d = draw(st.integers(0, base.dim() - 1))
        shape = list(base.shape)
        shape[d] += draw(st.sampled_from([1, -1] if shape[d] > 0 else [1]))
        return torch.zeros(shape, dtype=base.dtype, device=base.device), False, f"{kind} {d}"
    if kind == "shape-drop":
        if base.dim() == 0:
            return base.reshape(1), False, kind
        return base.reshape(-1)[:1].reshape(()) if base.dim() == 1 else base[0], False, kind
    if kind == "device":
        return base.to(other_device), False, f"device {other_device}"
    if kind == "none":
        return None, False, kind
    if kind == "list":
        return base.tolist(), False, kind
    return 1.0, False, kind


def slot_tensor_variant(draw, base: torch.Tensor, alignment: int, *, optional: bool,
                        other_device: str) -> tuple:  # fmt: skip
    """(value, valid, label): a copy of the slot pool `base` [slots, ...] in another layout:
    a padded slot stride (aligned or not: every slot tensor may have padded slots, as in an
    engine's cache pages), an odd start, slots aliased by an expanded view, a
    non-contiguous block; or a wrong one: dtype, slot count, per-slot shape, device, None
    (valid where the tensor is `optional`)."""
    kind = draw(st.sampled_from(["same", "pad-aligned", "pad-1", "offset", "expanded", "permuted",
                                 "dtype", "slots", "block", "none", "device"]))  # fmt: skip
    n, elt = base.shape[0], base.element_size()
    block = base[0].numel() if n else 1
    if kind == "same":
        return base, True, kind
    if kind in ("pad-aligned", "pad-1", "offset"):
        pad = {"pad-aligned": max(1, alignment // elt), "pad-1": 1, "offset": 0}[kind]
        offset = 1 if kind == "offset" else 0
        buf = torch.zeros(n * (block + pad) + offset, dtype=base.dtype, device=base.device)
        t = torch.as_strided(buf, base.shape, (block + pad, *base.stride()[1:]), offset)
        t.copy_(base)
        ok = (t.stride(0) * elt) % alignment == 0 and t.data_ptr() % alignment == 0
        return t, ok, f"slot stride {t.stride(0)} at offset {offset}"
    if kind == "expanded":
        return base[:1].expand_as(base), n <= 1, "aliased slots (stride 0)"
    if kind == "permuted":
        if base.dim() < 3 or base.shape[-1] == 1 or base.shape[-2] == 1:
            return base, True, "same"
        return base.transpose(-1, -2).contiguous().transpose(-1, -2), False, "non-contiguous block"
    if kind == "dtype":
        dtype = draw(st.sampled_from([d for d in (torch.float32, torch.bfloat16, torch.float64,
                                                  torch.int32, torch.int64) if d != base.dtype]))  # fmt: skip
        return base.to(dtype), False, f"dtype {dtype}"
    if kind == "slots":
        delta = draw(st.sampled_from([1, -1] if n > 1 else [1]))
        return (torch.zeros(n + delta, *base.shape[1:], dtype=base.dtype, device=base.device),
                False, f"{n + delta} slots")  # fmt: skip
    if kind == "block":
        shape = list(base.shape)
        d = draw(st.integers(1, base.dim() - 1))
        shape[d] += 1
        return torch.zeros(shape, dtype=base.dtype, device=base.device), False, f"block {shape[1:]}"
    if kind == "none":
        return None, optional, "None"
    return base.to(other_device), False, f"device {other_device}"
