"""The checkpoint copies of a pool on the torch path: load a slot's checkpoint as FP32, store FP32
values in a copy's format (round to nearest, or stochastically with the kernels' key), as
common/checkpoint.cuh does. The lifecycle and prefix ops use these on any device."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from replayssm_jit.core.codecs import (
    NVFP4,
    decode_nvfp4_heads,
    encode_e4m3_rows,
    encode_nvfp4_heads,
    raw_bits,
    round_stochastic,
    rounding_bits,
)

__all__ = [
    "Copy",
    "RoundingKey",
    "checkpoint_values",
    "load_state",
    "store_checkpoint",
    "store_flush",
    "store_state",
]

_F32 = torch.float32
# A read copy's rounding stream has the top bit set (read_copy_rounding_key in checkpoint.cuh).
_READ_COPY_STREAM = -(2**63)


@dataclass(frozen=True)
class Copy:
    """One checkpoint copy: its codes [slots, ...], with the FP32 scales (e4m3: per row; nvfp4:
    per head) and the e4m3 block scales (nvfp4: per 16 values) where its format has them."""

    codes: torch.Tensor
    scale: torch.Tensor | None = None
    block_scale: torch.Tensor | None = None

    @classmethod
    def named(cls, tensors: Mapping[str, torch.Tensor | None], prefix: str) -> Copy | None:
        """The copy a layout names "state" (prefix "state") or "read_state" (prefix "read"),
        None where the tensors lack it."""
        codes = tensors.get("state" if prefix == "state" else "read_state")
        if codes is None:
            return None
        return cls(codes, tensors.get(f"{prefix}_scale"), tensors.get(f"{prefix}_block_scale"))


@dataclass(frozen=True)
class RoundingKey:
    """What a stochastic store keys its bits by: the seed, each row's epoch (read at the step's
    start) and whether the copy is a read copy (its own stream)."""

    seed: int
    epochs: torch.Tensor
    read_copy: bool = False


def load_state(copy: Copy, slots) -> torch.Tensor:
    """copy[slots] as FP32: e4m3 codes times their row's scale (one FP32 product, as
    TileCheckpoint::values), nvfp4 codes times their block multiplier, other formats converted
    exactly."""
    state = copy.codes
    if state.dtype == NVFP4:
        return decode_nvfp4_heads(raw_bits(state)[slots], copy.block_scale[slots],
                                  copy.scale[slots])  # fmt: skip
    values = state[slots].to(_F32)
    if copy.scale is None:
        return values
    return values * copy.scale[slots].to(_F32).unsqueeze(-1)


def store_state(copy: Copy, slots: torch.Tensor, values: torch.Tensor,
                key: RoundingKey | None) -> None:  # fmt: skip
    """copy[slots] = FP32 `values` [rows, *per-slot shape] in the copy's format: round to nearest
    (key None), or stochastically with the bits store_values draws (stream slot << 32 | epoch,
    the top bit set for a read copy; counter the flat element). e4m3 stores codes and row scales,
    nvfp4 codes, block scales and head scales."""
    state = copy.codes
    bits = None
    if key is not None and state.dtype != _F32:
        per_slot = values.shape[1:]
        element = torch.arange(per_slot.numel(), dtype=torch.int64, device=values.device)
        # int32 epochs sign-extend, as the kernels' do
        stream = (slots.to(torch.int64) << 32) | key.epochs.to(torch.int64)
        if key.read_copy:
            stream = stream | _READ_COPY_STREAM
        bits = rounding_bits(key.seed, stream[:, None], element[None, :]).view(values.shape)
    if state.dtype == NVFP4:
        packed, blocks, head = encode_nvfp4_heads(values, bits)
        raw_bits(state)[slots] = packed
        copy.block_scale.view(torch.uint8)[slots] = blocks
        copy.scale[slots] = head
    elif state.dtype == torch.float8_e4m3fn:
        codes, scale = encode_e4m3_rows(values, bits)
        state[slots] = codes.view(torch.float8_e4m3fn)
        copy.scale[slots] = scale
    elif bits is None:
        state[slots] = values.to(state.dtype)
    else:
        state[slots] = round_stochastic(values, bits, state.dtype)


def store_flush(state: Copy, read: Copy | None, slots: torch.Tensor, values: torch.Tensor,
                key: RoundingKey | None, read_rn: bool) -> None:  # fmt: skip
    """A flush's stores: the carried copy with `key`, then separate mode's read copy from the same
    values (its own stream; to nearest where `read_rn`)."""
    store_state(state, slots, values, key)
    if read is not None:
        read_key = None if key is None or read_rn else RoundingKey(key.seed, key.epochs, True)
        store_state(read, slots, values, read_key)


def checkpoint_values(tensors: Mapping[str, torch.Tensor | None], slots) -> torch.Tensor:
    """The carried checkpoint of `slots` (an index) as FP32, from a layout's tensors by name."""
    return load_state(Copy.named(tensors, "state"), slots)


def store_checkpoint(tensors: Mapping[str, torch.Tensor | None], slots,
                     values: torch.Tensor) -> None:  # fmt: skip
    """Every checkpoint copy of `slots` (an index) from FP32 `values`, rounded to nearest: state
    (with its scales) and separate mode's read copy (with its scales)."""
    for prefix in ("state", "read"):
        copy = Copy.named(tensors, prefix)
        if copy is not None:
            store_state(copy, slots, values, None)
