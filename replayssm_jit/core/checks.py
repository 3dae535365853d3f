"""Argument validation with messages that name the argument, the expected and the actual value."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Mapping, Sequence

import torch


def check_tensor(
    name: str,
    t: object,
    *,
    shape: Sequence[int | None] | None = None,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
    inner_contiguous: bool = False,
) -> torch.Tensor:
    """Validate `t`; None in `shape` accepts any size. Returns `t`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if shape is not None and (
        t.dim() != len(shape) or any(e is not None and e != a for e, a in zip(shape, t.shape))
    ):
        want = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            want = allowed[0] if len(allowed) == 1 else f"one of {list(allowed)}"
            raise TypeError(f"{name}: expected dtype {want}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")
    if inner_contiguous and t.dim() and t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(
            f"{name}: expected a unit stride in the last dim, got strides {t.stride()}"
        )
    return t


def check_slot_pool(name: str, t: torch.Tensor, block: str, align: int = 16) -> None:
    """A per-slot pool [slots, ...]: every slot's block contiguous, slots `align`-byte aligned
    and at least a block apart: packed (a slot stride of exactly the block's size) or padded, as
    when an engine carves each tensor out of one page per slot (the kernels take the stride).

    block: how the error message spells one slot's block, e.g. "[H, P, N]".
    """
    dense = []
    stride = 1
    for size in reversed(t.shape[1:]):
        dense.insert(0, stride)
        stride *= size
    if list(t.stride()[1:]) != dense:
        raise ValueError(
            f"{name}: expected {align}-byte aligned slots with contiguous {block} blocks "
            f"(inner strides {dense}), got strides {t.stride()}"
        )
    if (t.stride(0) * t.element_size()) % align or t.data_ptr() % align:
        raise ValueError(
            f"{name}: expected {align}-byte aligned slots with contiguous {block} blocks (a slot "
            f"stride of a multiple of {align} bytes, at an address of one), got strides "
            f"{t.stride()} ({t.stride(0) * t.element_size()} bytes a slot) at address "
            f"{t.data_ptr()} ({t.data_ptr() % align} past a multiple of {align})"
        )
    # Overlapping slots (an expanded view's stride 0, say) would let a step on one slot write
    # another's.
    if t.shape[0] > 1 and t.stride(0) < stride:
        raise ValueError(
            f"{name}: expected slots {stride} or more elements apart (no two sharing memory), "
            f"got a slot stride of {t.stride(0)} (strides {t.stride()})"
        )


def check_aligned_rows(name: str, t: torch.Tensor | None) -> None:
    """Rows of the last dim start on 16-byte boundaries (kernels load them as 16-byte vectors)."""
    if t is None:
        return
    if t.data_ptr() % 16 or any(s % (16 // t.element_size()) for s in t.stride()[:-1]):
        raise ValueError(
            f"{name}: expected 16-byte aligned rows, got data_ptr % 16 = {t.data_ptr() % 16}, "
            f"strides {t.stride()}"
        )


def check_planned(name: str, t: object, planned: bool, plan_arg: str) -> None:
    """An optional argument is given exactly when plan() compiled it in.

    plan_arg: the plan() setting that decided it, as the message shows it, e.g. "has_D=True".
    """
    if (t is not None) != planned:
        raise ValueError(
            f"{name}: expected {'a tensor' if planned else 'None'} (plan() had {plan_arg}), "
            f"got {'a tensor' if t is not None else 'None'}"
        )


def check_slot_indices(
    slot_indices: torch.Tensor,
    batch: int,
    num_slots: int,
    pad_slot_id: int,
    device: torch.device,
    *,
    read_values: bool = True,
) -> None:
    """Shape, dtype, device and contiguity always; values (range, duplicates) only when
    `read_values` and outside CUDA-graph capture, since reading them from the device syncs."""
    check_tensor(
        "slot_indices",
        slot_indices,
        shape=(batch,),
        dtype=torch.int32,
        device=device,
        contiguous=True,
    )
    if not read_values or (slot_indices.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    values = slot_indices.tolist()
    real = [v for v in values if v != pad_slot_id]
    bad = [v for v in real if not 0 <= v < num_slots]
    if bad:
        raise ValueError(
            f"slot_indices: expected values in [0, {num_slots}) or pad_slot_id={pad_slot_id}, got {bad[0]}"
        )
    if len(set(real)) != len(real):
        dup = next(v for v in real if real.count(v) > 1)
        raise ValueError(f"slot_indices: expected distinct slots per batch, got slot {dup} twice")


def check_positive_int(name: str, value: object, *, upper: int | None = None) -> int:
    """A positive int (not a bool), at most `upper`; else a ValueError/TypeError naming it."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value <= 0 or (upper is not None and value > upper):
        bound = f"in [1, {upper}]" if upper is not None else "a positive int"
        raise ValueError(f"{name}: expected {bound}, got {value}")
    return value


def check_at_most(name: str, value: int, upper: int, reason: str) -> int:
    """`value` (an int, already checked) at most `upper`; `reason` says why, for the message."""
    if value > upper:
        raise ValueError(f"{name}: expected at most {upper} ({reason}), got {value}")
    return value


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")
    return value


def check_int(name: str, value: object) -> int:
    """An int (not a bool); else a TypeError naming it."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    return value


def resolve_device(device: object) -> torch.device:
    """A torch.device with its index (CUDA), or a ValueError where CUDA is asked for and absent."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: expected a torch device, got {device!r}") from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                "device: expected a usable device, got 'cuda' but CUDA is not available "
                "(use device='cpu' for the CPU path)"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device: expected a CUDA device index below {torch.cuda.device_count()}, "
                f"got {device}"
            )
    elif device.type == "cpu":
        device = torch.device("cpu")  # (as tensors report it: "cpu:0" would match none)
    else:
        raise ValueError(f"device: expected 'cuda' or 'cpu', got {device}")
    return device


def _byte_span(t: torch.Tensor) -> tuple[int, int, int]:
    """(device, first byte, one past the last byte) of a view (torch strides are >= 0)."""
    start = t.data_ptr()
    span = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.get_device(), start, start + (span + 1) * t.element_size()


def _slot_blocks(t: torch.Tensor) -> tuple[int, int] | None:
    """(slot stride, block) in bytes of a pool [slots, ...] whose slots are contiguous blocks at
    least a block apart, else None."""
    if t.dim() < 2 or t.shape[0] < 2:
        return None
    dense, block = [], 1
    for size in reversed(t.shape[1:]):
        dense.insert(0, block)
        block *= size
    if list(t.stride()[1:]) != dense or t.stride(0) < block:
        return None
    return t.stride(0) * t.element_size(), block * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two views share a byte. Byte extents decide, except for two slot pools of one
    slot stride (an engine's cache page holds each layer's tensors one after the other, so their
    extents interleave): those share a byte only where their blocks meet within a page."""
    (da, sa, ea), (db, sb, eb) = _byte_span(a), _byte_span(b)
    if da != db or not (sa < eb and sb < ea):
        return False
    pa, pb = _slot_blocks(a), _slot_blocks(b)
    if pa is None or pb is None or pa[0] != pb[0]:
        return True
    page = pa[0]
    shift = (sb - sa) % page  # b's blocks start `shift` bytes past a's, in every page
    return shift < pa[1] or shift + pb[1] > page


def check_disjoint(written: Mapping[str, torch.Tensor | None]) -> None:
    """The tensors a step writes (slot tensors, out, workspace) share no memory: one written
    through another's storage would corrupt slots no row names. Compared by byte extents
    ([first, last + 1) of each view; torch strides are >= 0), or, for two slot pools of one slot
    stride (views into one buffer of pages, as vLLM's cache pages are), by their blocks within
    a page; any other interleaving counts as overlapping."""
    present = [(name, t) for name, t in written.items() if t is not None and t.numel()]
    for (first, a), (second, b) in itertools.combinations(present, 2):
        if _overlap(a, b):
            first, second = sorted((first, second), key=lambda n: _byte_span(written[n])[1:])
            raise ValueError(
                f"{second}: expected memory disjoint from {first} (every tensor a step writes "
                f"needs its own), got overlapping storage"
            )


def check_no_alias(written: Mapping[str, torch.Tensor | None], read: Mapping[str, object]) -> None:
    """No tensor a call writes (out, workspace, slot tensors) shares memory with one it only
    reads (token inputs, parameters, index tensors): a launch would read values it has already
    overwritten. Inputs may overlap each other (B and C as views of one buffer, say)."""
    writes = [(name, t) for name, t in written.items() if isinstance(t, torch.Tensor) and t.numel()]
    for rname, r in read.items():
        if not isinstance(r, torch.Tensor) or not r.numel():
            continue
        for wname, w in writes:
            if _overlap(w, r):
                raise ValueError(
                    f"{wname}: expected memory disjoint from the input {rname} (a tensor the "
                    f"call writes may not alias one it reads), got overlapping storage"
                )


class TensorTags:
    """A value per tensor, kept only while that tensor object lives (a freed pool's address
    reused by a new one finds nothing). Host-side only: no device read."""

    def __init__(self) -> None:
        self._tags: dict[tuple, tuple[weakref.ref, object]] = {}

    @staticmethod
    def _key(t: torch.Tensor) -> tuple:
        return (str(t.device), t.data_ptr(), tuple(t.shape), t.stride())

    def set(self, t: torch.Tensor, value: object) -> None:
        key = self._key(t)

        def forget(ref: weakref.ref) -> None:  # a dead tensor's entry goes (not a newer one's)
            entry = self._tags.get(key)
            if entry is not None and entry[0] is ref:
                del self._tags[key]

        self._tags[key] = (weakref.ref(t, forget), value)

    def get(self, t: torch.Tensor, default: object = None) -> object:
        entry = self._tags.get(self._key(t))
        if entry is None:
            return default
        ref, value = entry
        if ref() is None:  # (that tensor died; its address now belongs to another)
            del self._tags[self._key(t)]
            return default
        return value

    def discard(self, t: torch.Tensor) -> None:
        self._tags.pop(self._key(t), None)
