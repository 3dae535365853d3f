"""What a slot of a layer's cache holds: an engine allocates its own tensors from this.

Every tensor is [num_slots, *per_slot_shape]; each slot's block is contiguous and aligned (16
bytes, or one element for the scalar rings). Slots may lie further apart than a block (any slot
stride of at least the block's size, keeping the alignment): the kernels take each tensor's slot
stride, so an engine may carve every tensor of a layer out of one padded page per slot, as vLLM's
cache pages do (docs/integrations-vllm-pages.md), or allocate each packed (allocate() here). The cursor row is int32 [4]: records held since
the last flush, the flush epoch, a scratch word the kernels use to agree on who advances the
cursor, and the pending drafts of a speculative verify (docs/speculative.md); zero it (and the
checkpoint) when a slot starts a new sequence.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from functools import cached_property

import torch

from replayssm_jit.core.checks import (
    TensorTags,
    check_at_most,
    check_positive_int,
    check_slot_pool,
    check_tensor,
    resolve_device,
)
from replayssm_jit.core.cursor_words import CURSOR_WORDS
from replayssm_jit.core.dtypes import (
    BLOCK_SCALED_DTYPES,
    DTYPE_NAMES,
    NVFP4_BLOCK,
    ROW_SCALED_DTYPES,
    TORCH_DTYPES,
    dtype_name,
)
from replayssm_jit.families import get_family
from replayssm_jit.families.base import Family, HeadShape
from replayssm_jit.families.spec import make_spec

# Slot ids are int32 (slot_indices), and so is the kernels' slot count.
MAX_SLOTS = 2**31 - 1
# The layout each pool was allocated or reset with, by its cursors: rings of two layouts can
# have the same shapes (L=5, T=2 and L=4, T=3 both hold 7 rows), so shapes alone cannot tell.
POOL_LAYOUTS = TensorTags()


def check_pool_layout(layout: CacheLayout, cursors: object, name: str = "plan") -> None:
    """`layout` (a plan's) is the one `cursors`' pool was allocated or reset with, where known
    (layout.allocate and reset_slots record it); a host-side lookup, no device read."""
    if not isinstance(cursors, torch.Tensor):
        return
    known = POOL_LAYOUTS.get(cursors)
    if known is not None and known != layout:
        raise ValueError(
            f"{name}: expected a plan of the pool's layout (window={known.window}, "
            f"drafts={known.drafts}, {known.family.name}, state {known.state_dtype}: "
            f"layout.allocate or reset_slots recorded it), got window={layout.window}, "
            f"drafts={layout.drafts}, {layout.family.name}, state {layout.state_dtype}"
        )


def check_tensor_mapping(tensors: object) -> None:
    """A pool's tensors come as a mapping by name (the layout's tensor names)."""
    if not isinstance(tensors, Mapping):
        raise TypeError(
            f"tensors: expected a mapping of the layout's tensors by name, "
            f"got {type(tensors).__name__}"
        )


@dataclass(frozen=True)
class TensorLayout:
    """One per-slot tensor: its name (the functional ops' argument), shape per slot, dtype, the
    alignment in bytes each slot's block needs (16 where the kernels load 16-byte vectors; the
    slot stride in bytes and the first slot's address must keep it)."""

    name: str
    per_slot_shape: tuple[int, ...]
    dtype: torch.dtype
    alignment: int = 16

    def shape(self, num_slots: int) -> tuple[int, ...]:
        return (num_slots, *self.per_slot_shape)


@dataclass(frozen=True)
class CacheLayout:
    """The per-slot tensors of one layer of `family` for a replay window and draft count.

    Build it with `mamba2_layout(...)`, `gdn_layout(...)` or `kda_layout(...)`, which check every
    argument.
    """

    family: Family
    shape: HeadShape
    window: int
    drafts: int
    state_dtype: torch.dtype
    act_dtype: torch.dtype
    read_dtype: torch.dtype | None = None

    @property
    def checkpoint_names(self) -> tuple[str, ...]:
        """The checkpoint's tensors: state, with its scales where it is e4m3 (state_scale per
        row) or nvfp4 (state_scale per head, state_block_scale per 16 values), and separate
        mode's read copy (read_state, with read_scale / read_block_scale likewise)."""
        return tuple(t.name for t in self._checkpoint_tensors)

    @property
    def capacity(self) -> int:
        """Ring rows per slot: window + drafts."""
        return self.window + self.drafts

    def tensors(self) -> tuple[TensorLayout, ...]:
        """The checkpoint, each record ring (in the kernels' order) and the cursors."""
        return self._tensors

    @cached_property
    def _tensors(self) -> tuple[TensorLayout, ...]:  # (every step checks against it)
        s = self.shape
        rings = tuple(
            TensorLayout(
                r.name,
                r.per_slot_shape(s, self.capacity),
                r.torch_dtype(self.act_dtype),
                # Scalar rings are read one element at a time.
                alignment=16 if r.width else r.torch_dtype(self.act_dtype).itemsize,
            )
            for r in self.rings
        )
        return (
            *self._checkpoint_tensors,
            *rings,
            # Verify and commit read and write a cursor's four words in one 16-byte access.
            TensorLayout("cursors", (CURSOR_WORDS,), torch.int32, alignment=16),
        )

    @cached_property
    def _checkpoint_tensors(self) -> tuple[TensorLayout, ...]:
        s = self.shape
        rows = (s.value_heads, s.value_dim)
        out = []
        for codes, dtype in (("state", self.state_dtype), ("read_state", self.read_dtype)):
            if dtype is None:
                continue
            prefix = codes.removesuffix("_state")
            if DTYPE_NAMES[dtype] in BLOCK_SCALED_DTYPES:  # two e2m1 codes a byte
                out.append(TensorLayout(codes, (*rows, s.key_dim // 2), dtype))
                out.append(TensorLayout(f"{prefix}_scale", rows[:1], torch.float32, alignment=4))
                blocks = (*rows, s.key_dim // NVFP4_BLOCK)
                out.append(TensorLayout(f"{prefix}_block_scale", blocks, torch.float8_e4m3fn, 2))
                continue
            out.append(TensorLayout(codes, (*rows, s.key_dim), dtype))
            if DTYPE_NAMES[dtype] in ROW_SCALED_DTYPES:
                out.append(TensorLayout(f"{prefix}_scale", rows, torch.float32))
        return tuple(out)

    def check_tensors(
        self,
        tensors: Mapping[str, object],
        *,
        device: torch.device,
        optional: Collection[str] = (),
        num_slots: int | None = None,
    ) -> int:
        """Each slot tensor (those named in `optional` may be missing or None; no other name may
        be given) against this layout: a [num_slots, *per_slot_shape] tensor of its dtype on `device`, each slot's
        block contiguous and aligned, slots at least a block apart (packed, or padded as in an
        engine's cache pages), every one with the state's slot count (or `num_slots`, where given). Returns it."""
        check_tensor_mapping(tensors)
        names = [t.name for t in self.tensors()]
        unknown = sorted(str(name) for name in tensors if name not in names)
        if unknown:
            raise ValueError(f"tensors: expected names from {names}, got {unknown}")
        if num_slots is not None and (
            not isinstance(num_slots, int) or isinstance(num_slots, bool)
        ):
            raise TypeError(
                f"num_slots: expected None or an int, got {type(num_slots).__name__} {num_slots!r}"
            )
        if not isinstance(device, torch.device) or (device.type == "cuda") == (
            device.index is None
        ):
            device = resolve_device(device)  # (a name, "cuda" without its index, "cpu:0")
        fixed, num_slots = num_slots, None
        for t in self.tensors():
            value = tensors.get(t.name)
            if value is None and t.name in optional:
                continue
            check_tensor(t.name, value, shape=(fixed, *t.per_slot_shape), dtype=t.dtype,
                         device=device)  # fmt: skip
            check_slot_pool(t.name, value, str(list(t.per_slot_shape)), t.alignment)
            if num_slots is None:
                num_slots = value.shape[0]
            elif value.shape[0] != num_slots:
                raise ValueError(
                    f"{t.name}: expected {num_slots} slots (as state), got {value.shape[0]}"
                )
        return num_slots

    @cached_property
    def rings(self) -> tuple:
        """The family's record rings this layout holds (separate mode's only with a read copy)."""
        return tuple(r for r in self.family.rings if self.read_dtype or not r.read_copy_only)

    @cached_property
    def ring_names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.rings)

    def bytes_per_slot(self) -> int:
        return sum(math.prod(t.per_slot_shape) * t.dtype.itemsize for t in self.tensors())

    def allocate(self, num_slots: int, device: torch.device | str) -> dict[str, torch.Tensor]:
        """Zeroed tensors for `num_slots` slots, by name."""
        check_positive_int("num_slots", num_slots)
        check_at_most("num_slots", num_slots, MAX_SLOTS, "slot ids are int32")
        device = resolve_device(device)
        # (as bytes: torch has no fill for float4_e2m1fn_x2; zero bytes are zero codes)
        pool = {
            t.name: torch.zeros(
                (*t.shape(num_slots)[:-1], t.shape(num_slots)[-1] * t.dtype.itemsize),
                dtype=torch.uint8,
                device=device,
            ).view(t.dtype)
            for t in self.tensors()
        }
        POOL_LAYOUTS.set(pool["cursors"], self)
        return pool


# lp_format names (the vocabulary) and the checkpoint dtypes they store.
LP_FORMATS = {"fp16": "f16", "bf16": "bf16", "fp8_e4m3": "e4m3", "nvfp4": "nvfp4"}
CHECKPOINT_MODES = ("separate", "shared", "conventional")


@dataclass(frozen=True)
class CheckpointFormat:
    """A checkpoint format by its precisions (docs/precision.md):

    hp_dtype: the high-precision copy that carries the recurrence: float32, or float16 /
        bfloat16 (with stochastic rounding, a plan option); torch dtype or short name.
    lp_format: the low-precision copy: "fp16", "bf16", "fp8_e4m3", "nvfp4" or None.
    mode: "separate" (HP carries the recurrence, non-flush steps read LP; both required),
        "shared" (LP only: flushes read, fold and write LP; hp_dtype must be None) or
        "conventional" (one state of lp_format, else hp_dtype, updated every step: window 1
        and a wrapper of mode="conventional").

    `state_dtype` and `read_dtype` are what the layout stores (family_layout(...,
    checkpoint_format=...) takes this in their place).
    """

    hp_dtype: torch.dtype | str | None = torch.float32
    lp_format: str | None = None
    mode: str = "separate"

    def __post_init__(self) -> None:
        if not isinstance(self.mode, str) or self.mode not in CHECKPOINT_MODES:
            raise ValueError(f"mode: expected one of {CHECKPOINT_MODES}, got {self.mode!r}")
        if self.lp_format is not None and self.lp_format not in LP_FORMATS:
            raise ValueError(
                f"lp_format: expected None or one of {sorted(LP_FORMATS)}, got {self.lp_format!r}"
            )
        if self.mode == "shared":
            if self.hp_dtype is not None or self.lp_format is None:
                raise ValueError(
                    f"hp_dtype, lp_format: shared mode keeps only the LP copy: expected "
                    f"hp_dtype=None and an lp_format, got {self.hp_dtype!r} and {self.lp_format!r}"
                )
            return
        if self.hp_dtype is None:
            raise ValueError(f"hp_dtype: {self.mode} mode needs one, got None")
        hp = dtype_name(self.hp_dtype, "hp_dtype")
        if self.mode == "separate" and self.lp_format is None:
            raise ValueError(
                f"lp_format: separate mode needs a low-precision read copy, got None (hp_dtype={hp!r})"
            )

    @property
    def state_dtype(self) -> str:
        if self.mode == "separate":
            return dtype_name(self.hp_dtype, "hp_dtype")
        if self.lp_format is not None:
            return LP_FORMATS[self.lp_format]
        return dtype_name(self.hp_dtype, "hp_dtype")

    @property
    def read_dtype(self) -> str | None:
        return LP_FORMATS[self.lp_format] if self.mode == "separate" else None


def family_layout(
    family: str,
    *,
    window: int = 16,
    drafts: int = 1,
    state_dtype: torch.dtype | str = torch.float32,
    act_dtype: torch.dtype | str = torch.bfloat16,
    read_dtype: torch.dtype | str | None = None,
    checkpoint_format: CheckpointFormat | None = None,
    **shape_args: int,
) -> CacheLayout:
    """The checked layout of `family` for its head-shape arguments (Family.shape_args).
    checkpoint_format (a CheckpointFormat) replaces state_dtype and read_dtype (and, in
    conventional mode, sets window 1)."""
    if checkpoint_format is not None:
        if not isinstance(checkpoint_format, CheckpointFormat):
            raise TypeError(
                f"checkpoint_format: expected a CheckpointFormat, got "
                f"{type(checkpoint_format).__name__}"
            )
        if state_dtype is not torch.float32 or read_dtype is not None:
            raise ValueError(
                "checkpoint_format: expected it in place of state_dtype and read_dtype, got "
                f"state_dtype={state_dtype!r} and read_dtype={read_dtype!r} too"
            )
        state_dtype, read_dtype = checkpoint_format.state_dtype, checkpoint_format.read_dtype
        if checkpoint_format.mode == "conventional":
            window = 1
    fam = get_family(family)
    shape = fam.head_shape(**shape_args)
    # Everything a plan() of this layout needs must hold now, not at the first plan().
    spec = make_spec(fam.name, shape, window=window, drafts=drafts, act_dtype=act_dtype,
                     state_dtype=state_dtype, read_dtype=read_dtype)  # fmt: skip
    return CacheLayout(
        family=fam,
        shape=shape,
        window=window,
        drafts=drafts,
        state_dtype=TORCH_DTYPES[spec.state_dtype],
        act_dtype=TORCH_DTYPES[spec.act_dtype],
        read_dtype=TORCH_DTYPES[spec.read_dtype] if spec.read_dtype else None,
    )


def mamba2_layout(**kwargs) -> CacheLayout:
    """A Mamba-2 layer's slot tensors, from num_heads (H), headdim (P), dstate (N), ngroups (G),
    window=16, drafts=1, state_dtype=float32, act_dtype=bfloat16 and read_dtype=None (CAP =
    window + drafts):

    state [H, P, N] state_dtype (float32, bfloat16, float16 or float8_e4m3fn; [H, P, N / 2]
    float4_e2m1fn_x2 for nvfp4); state_scale [H, P] float32 where state_dtype is e4m3 (one
    decode scale per state row), [H] float32 where it is nvfp4 (one per head), with
    state_block_scale [H, P, N / 16] float8_e4m3fn (one per 16 values); read_state, read_scale
    and read_block_scale likewise for read_dtype in separate mode (read_dtype set: non-flush
    steps read that copy, flushes carry state and rewrite it; docs/precision.md); rec_x [H, CAP, P]
    act_dtype; rec_b [G, CAP, N] act_dtype; rec_dt [H, CAP] float32 (dt after bias and
    softplus); cursors [4] int32.
    """
    return family_layout("mamba2", **kwargs)


def gdn_layout(**kwargs) -> CacheLayout:
    """A Gated DeltaNet layer's slot tensors, from num_k_heads (H), num_v_heads (HV), head_k_dim
    (K), head_v_dim (V), window=16, drafts=1, state_dtype=float32, act_dtype=bfloat16 and
    read_dtype=None (CAP = window + drafts):

    state [HV, V, K] state_dtype (float32, bfloat16, float16 or float8_e4m3fn; [HV, V, K / 2]
    float4_e2m1fn_x2 for nvfp4); state_scale [HV, V] float32 where state_dtype is e4m3 (one
    decode scale per state row), [HV] float32 where it is nvfp4 (one per head), with
    state_block_scale [HV, V, K / 16] float8_e4m3fn (one per 16 values); read_state,
    read_scale and read_block_scale likewise for read_dtype in separate mode (non-flush steps
    read that copy, flushes carry state and rewrite it; docs/precision.md), which also adds
    rec_v [HV, CAP, V] act_dtype and rec_beta [HV, CAP] float32 (the flush recomputes each
    held u from the carried copy); rec_u [HV, CAP, V] float32; rec_k [H, CAP, K] act_dtype (raw
    k); rec_g [HV, CAP] float32 (log-decay); cursors [4] int32.
    """
    return family_layout("gdn", **kwargs)


def kda_layout(**kwargs) -> CacheLayout:
    """A Kimi Delta Attention layer's slot tensors, from gdn_layout's arguments (a read_dtype's
    separate mode runs on the torch path only; its CUDA modules are refused):

    state [HV, V, K] state_dtype, with state_scale [HV, V] float32 where it is e4m3, or
    state_scale [HV] float32 and state_block_scale [HV, V, K / 16] float8_e4m3fn where it is
    nvfp4 (state then [HV, V, K / 2] float4_e2m1fn_x2); rec_u [HV, CAP, V] float32; rec_k
    [H, CAP, K] act_dtype (raw k); rec_g [HV, CAP, K] float32 (a log-decay per key channel);
    cursors [4] int32; with a read_dtype, read_state (and its scales) and rec_v, rec_beta as
    gdn_layout's.
    """
    return family_layout("kda", **kwargs)
