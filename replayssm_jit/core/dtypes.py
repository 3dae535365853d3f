"""Dtype names and tables, and the limits of a specialization: facts of the formats and the
launch grid, not of any family."""

from __future__ import annotations

import torch

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "f32",
    torch.bfloat16: "bf16",
    torch.float16: "f16",
    torch.float8_e4m3fn: "e4m3",
    torch.float4_e2m1fn_x2: "nvfp4",
}
TORCH_DTYPES: dict[str, torch.dtype] = {v: k for k, v in DTYPE_NAMES.items()}
# Bits per value (NVFP4: a byte holds two e2m1 codes, element 2i in the low nibble).
DTYPE_BITS: dict[str, int] = {"f32": 32, "bf16": 16, "f16": 16, "e4m3": 8, "nvfp4": 4}
# Bytes per element of the formats activations and records may have.
DTYPE_BYTES: dict[str, int] = {"f32": 4, "bf16": 2, "f16": 2, "e4m3": 1}
# Values in a 16-byte chunk, the unit a lane loads and stores (RowTiling::kVec).
CHUNK_VALUES: dict[str, int] = {name: 128 // bits for name, bits in DTYPE_BITS.items()}
CPP_TYPES: dict[str, str] = {
    "f32": "float", "bf16": "__nv_bfloat16", "f16": "__half", "e4m3": "replayssm::e4m3",
    "nvfp4": "replayssm::nvfp4x2",
}  # fmt: skip
# Checkpoint formats with an FP32 decode scale per state row beside their codes.
ROW_SCALED_DTYPES = frozenset({"e4m3"})
# NVFP4: e4m3 scales per 16 values along a row and one FP32 scale per head beside the codes.
BLOCK_SCALED_DTYPES = frozenset({"nvfp4"})
NVFP4_BLOCK = 16
# Dtypes only a checkpoint may have (activations and records are f32, bf16 or f16).
CHECKPOINT_ONLY_DTYPES = frozenset({"e4m3", "nvfp4"})

# Limits of a spec's ring: the replay window L and the draft tokens T it also holds.
MAX_WINDOW = 256
MAX_DRAFTS = 16
# Drafts a verify kernel takes (a row's draft tree is a 32-bit ancestor mask; its u live in registers).
MAX_VERIFY_DRAFTS = 8
# A launch's grid carries heads x row splits (at most 8) in its x dimension, at most 2^31 - 1.
MAX_HEADS = (2**31 - 1) // 8


def dtype_name(dtype: object, arg: str, *, checkpoint: bool = False) -> str:
    """The short name ("f32", "bf16", "f16"; for a checkpoint also "e4m3") of a torch dtype or
    short name, else a TypeError."""
    names = sorted(TORCH_DTYPES if checkpoint else set(TORCH_DTYPES) - CHECKPOINT_ONLY_DTYPES)
    name = dtype if isinstance(dtype, str) else DTYPE_NAMES.get(dtype)
    if isinstance(dtype, str | torch.dtype) and name in names:
        return name
    torch_names = "/".join(str(TORCH_DTYPES[n]).removeprefix("torch.") for n in names)
    raise TypeError(f"{arg}: expected one of {names} or torch.{{{torch_names}}}, got {dtype!r}")
