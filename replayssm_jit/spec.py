"""Typed kernel specializations and their readable URIs.

A spec names everything a template is specialized on. Two specs with equal URIs
are the same compiled module; the URI is also the module's file name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Short names used in URIs and templates, and the torch dtypes they map to.
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "f32",
    torch.bfloat16: "bf16",
    torch.float16: "f16",
}
TORCH_DTYPES: dict[str, torch.dtype] = {v: k for k, v in DTYPE_NAMES.items()}
CPP_TYPES: dict[str, str] = {"f32": "float", "bf16": "__nv_bfloat16", "f16": "__half"}

FAMILY_TEMPLATES: dict[str, str] = {
    "mamba2": "mamba2/decode.cu.jinja",
    "gdn": "gdn/decode.cu.jinja",
}


def dtype_name(dtype: torch.dtype | str, arg: str) -> str:
    """Map a torch dtype (or its short name) to the short name, or raise a TypeError naming `arg`."""
    if isinstance(dtype, str) and dtype in TORCH_DTYPES:
        return dtype
    if isinstance(dtype, torch.dtype) and dtype in DTYPE_NAMES:
        return DTYPE_NAMES[dtype]
    raise TypeError(
        f"{arg}: expected one of {sorted(TORCH_DTYPES)} (or torch dtypes), got {dtype!r}"
    )


@dataclass(frozen=True)
class KernelSpec:
    """One specialization: family, head dims, window, drafts, dtypes and flags.

    dims:  ordered (name, value) pairs, e.g. (("p", 64), ("n", 128), ("hpg", 16)).
    window: replay window L (1 = conventional only).
    drafts: draft tokens T the record ring must also hold (ring capacity L + T).
    flags: sorted feature flags, e.g. ("d", "dt_bias", "dt_softplus").
    """

    family: str
    dims: tuple[tuple[str, int], ...]
    window: int
    drafts: int
    act_dtype: str
    state_dtype: str
    flags: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.family not in FAMILY_TEMPLATES:
            raise ValueError(
                f"family: expected one of {sorted(FAMILY_TEMPLATES)}, got {self.family!r}"
            )
        for name, value in self.dims:
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"dims[{name!r}]: expected a positive int, got {value!r}")
        if not (isinstance(self.window, int) and 1 <= self.window <= 256):
            raise ValueError(f"window: expected an int in [1, 256], got {self.window!r}")
        if not (isinstance(self.drafts, int) and 1 <= self.drafts <= 16):
            raise ValueError(f"drafts: expected an int in [1, 16], got {self.drafts!r}")
        for arg in ("act_dtype", "state_dtype"):
            dtype_name(getattr(self, arg), arg)
        if tuple(sorted(set(self.flags))) != self.flags:
            object.__setattr__(self, "flags", tuple(sorted(set(self.flags))))

    @property
    def uri(self) -> str:
        dims = "_".join(f"{k}{v}" for k, v in self.dims)
        parts = [
            self.family,
            dims,
            f"L{self.window}",
            f"T{self.drafts}",
            f"act-{self.act_dtype}",
            f"state-{self.state_dtype}",
            *self.flags,
        ]
        return "_".join(parts)

    @property
    def capacity(self) -> int:
        """Record ring rows per slot: L + T."""
        return self.window + self.drafts

    def dim(self, name: str) -> int:
        return dict(self.dims)[name]

    def template_context(self) -> dict:
        return {
            "spec": self,
            "uri": self.uri,
            "dims": dict(self.dims),
            "window": self.window,
            "drafts": self.drafts,
            "capacity": self.capacity,
            "act_t": CPP_TYPES[self.act_dtype],
            "state_t": CPP_TYPES[self.state_dtype],
            "flags": set(self.flags),
            **_FAMILY_CONTEXT[self.family](self),
        }


DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2}
MAMBA2_FLAGS = frozenset({"d", "z", "dt_bias", "dt_softplus", "sr"})
GDN_FLAGS = frozenset({"qk_l2norm", "gates_in_kernel", "sr"})

# Per family: the dims of one head's state [rows, cols] (cols contiguous), as named in `dims`.
STATE_DIMS: dict[str, tuple[str, str]] = {"mamba2": ("p", "n"), "gdn": ("v", "k")}


def lanes_per_row(rows_per_warp: int, cols: int, state_bytes: int) -> int:
    """Lanes that share a state row in a tile with `rows_per_warp` rows per warp: the fewest of
    8 and 16 (at most one per 16-byte chunk) that split a warp's rows into whole passes, else
    one per chunk up to 32. Mirrors lanes_per_row() in templates/common/replay.cuh."""
    vecs = cols // (16 // state_bytes)
    for lanes in (8, 16):
        if lanes <= vecs and rows_per_warp % (32 // lanes) == 0:
            return lanes
    return min(32, vecs)


def rows_tilings(
    rows: int,
    cols: int,
    state_bytes: int,
    *,
    warp_options: tuple[int, ...] = (4, 8, 2, 1),
    max_chunks: int = 16,
) -> list[tuple[int, int]]:
    """(rows_per_cta, warps) pairs for a [rows, cols] state per head, largest first.

    A lane holds 16-byte chunks of a state row (lanes_per_row lanes share a row), so a warp
    covers 32 / lanes_per_row rows per pass; splitting the rows across CTAs buys parallelism at
    small batch. `max_chunks` bounds the state registers per lane (chunks x 16 bytes).
    """
    vec = 16 // state_bytes
    tilings = []
    for split in (1, 2, 4, 8):
        if rows % split:
            continue
        per_cta = rows // split
        for warps in warp_options:
            per_warp = per_cta // warps if per_cta % warps == 0 else 0
            if not per_warp:
                continue
            rows_per_pass = 32 // lanes_per_row(per_warp, cols, state_bytes)
            chunks = per_warp * cols // (32 * vec)
            if per_warp % rows_per_pass == 0 and chunks <= max_chunks:
                tilings.append((per_cta, warps))
                break
    return tilings


def state_tilings(rows: int, cols: int, state_dtype: str) -> list[tuple[int, int]]:
    """(rows_per_cta, warps) pairs compiled for a [rows, cols] state per head, largest first."""
    return rows_tilings(rows, cols, DTYPE_BYTES[state_dtype])


def mamba2_tilings(headdim: int, dstate: int, state_dtype: str) -> list[tuple[int, int]]:
    """(rows_per_cta, warps) pairs compiled into a Mamba-2 module ([P, N] per head), largest first."""
    return state_tilings(headdim, dstate, state_dtype)


def gdn_tilings(head_v_dim: int, head_k_dim: int, state_dtype: str) -> list[tuple[int, int]]:
    """(rows_per_cta, warps) pairs compiled into a GDN module ([V, K] per head), largest first."""
    return state_tilings(head_v_dim, head_k_dim, state_dtype)


def spec_tilings(spec: KernelSpec) -> list[tuple[int, int]]:
    """The row tilings compiled into `spec`'s module (its template loops over these)."""
    rows, cols = STATE_DIMS[spec.family]
    return state_tilings(spec.dim(rows), spec.dim(cols), spec.state_dtype)


def _state_spec(
    family: str,
    dims: tuple[tuple[str, int], ...],
    arg_names: tuple[str, ...],
    *,
    allowed_flags: frozenset[str],
    flags: tuple[str, ...] | frozenset[str],
    window: int,
    drafts: int,
    act_dtype: torch.dtype | str,
    state_dtype: torch.dtype | str,
) -> KernelSpec:
    """Validate and build a spec whose per-head state is [rows, cols] = STATE_DIMS[family].

    arg_names: the user-facing argument name of each entry of `dims`, used in error messages.
    cols must fill whole 16-byte lane chunks (a multiple of max(16 / state bytes, 8), at most
    32 lanes x 8 chunks) and rows must have a row tiling.
    """
    names = dict(zip((d for d, _ in dims), arg_names))
    for (_, value), arg in zip(dims, arg_names):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{arg}: expected a positive int, got {value!r}")
    unknown = set(flags) - allowed_flags
    if unknown:
        raise ValueError(
            f"flags: expected a subset of {sorted(allowed_flags)}, got unknown {sorted(unknown)}"
        )
    state = dtype_name(state_dtype, "state_dtype")
    if "sr" in flags and state == "f32":
        raise ValueError("flags: 'sr' (stochastic rounding) needs a bf16/f16 state_dtype, got f32")
    row_dim, col_dim = STATE_DIMS[family]
    rows, cols = dict(dims)[row_dim], dict(dims)[col_dim]
    vec = 16 // DTYPE_BYTES[state]
    if cols % vec or cols % 8 or cols > 32 * vec * 8:
        raise ValueError(
            f"{names[col_dim]}: expected a multiple of {max(vec, 8)} up to {32 * vec * 8}, got {cols}"
        )
    spec = KernelSpec(
        family=family,
        dims=dims,
        window=window,
        drafts=drafts,
        act_dtype=dtype_name(act_dtype, "act_dtype"),
        state_dtype=state,
        flags=tuple(sorted(set(flags))),
    )
    if not state_tilings(rows, cols, state):
        raise ValueError(
            f"{names[row_dim]}: no row tiling fits {names[row_dim]}={rows} "
            f"with {names[col_dim]}={cols} ({state})"
        )
    return spec


def mamba2_spec(
    *,
    headdim: int,
    dstate: int,
    heads_per_group: int,
    window: int = 16,
    drafts: int = 1,
    act_dtype: torch.dtype | str = torch.bfloat16,
    state_dtype: torch.dtype | str = torch.float32,
    flags: tuple[str, ...] | frozenset[str] = ("d", "dt_bias", "dt_softplus"),
) -> KernelSpec:
    """The Mamba-2 specialization for these shapes (tied head dim: A and dt per head)."""
    return _state_spec(
        "mamba2",
        (("p", headdim), ("n", dstate), ("hpg", heads_per_group)),
        ("headdim", "dstate", "heads_per_group"),
        allowed_flags=MAMBA2_FLAGS,
        flags=flags,
        window=window,
        drafts=drafts,
        act_dtype=act_dtype,
        state_dtype=state_dtype,
    )


def gdn_spec(
    *,
    head_k_dim: int,
    head_v_dim: int,
    value_heads_per_key_head: int,
    window: int = 16,
    drafts: int = 1,
    act_dtype: torch.dtype | str = torch.bfloat16,
    state_dtype: torch.dtype | str = torch.float32,
    flags: tuple[str, ...] | frozenset[str] = ("qk_l2norm", "gates_in_kernel"),
) -> KernelSpec:
    """The Gated DeltaNet specialization for these shapes (state [V, K] per value head).

    flags: "qk_l2norm" (the kernel L2-normalises q and k), "gates_in_kernel" (the kernel takes
    raw a, b plus A_log, dt_bias and forms g, beta; otherwise it takes g, beta), "sr"
    (stochastic rounding of a bf16/f16 checkpoint).
    """
    return _state_spec(
        "gdn",
        (("k", head_k_dim), ("v", head_v_dim), ("vph", value_heads_per_key_head)),
        ("head_k_dim", "head_v_dim", "value_heads_per_key_head"),
        allowed_flags=GDN_FLAGS,
        flags=flags,
        window=window,
        drafts=drafts,
        act_dtype=act_dtype,
        state_dtype=state_dtype,
    )


# Largest dynamic shared memory of one CTA on sm_90.
MAX_CTA_SHARED_BYTES = 227 * 1024
# Threads of the split kernel's records CTA (Records::kThreads): one per head for its scalars.
SPLIT_RECORDS_THREADS = 256
# sm_90 per-SM limits (shared_memory_resident_ctas in templates/common/split.cuh)
MAX_THREADS_PER_SM = 2048
SHARED_BYTES_PER_SM = 227 * 1024
SHARED_BYTES_RESERVED_PER_CTA = 1024


def split_records_heads(spec: KernelSpec) -> int:
    """Heads one records CTA serves: a Mamba-2 group's heads, a GDN key head's value heads."""
    return spec.dim("hpg") if spec.family == "mamba2" else spec.dim("vph")


def split_workspace_floats(spec: KernelSpec, batch: int, num_heads: int) -> int:
    """float32 elements the split kernel's records kernel hands to its state kernel
    (SplitWorkspace in templates/common/split.cuh): per (batch row, head) the per-row sums
    (Mamba-2: P; GDN: pred and osum, 2 V), the replay scalars (1; 5) and a flush's record
    weights (CAP); per batch row 4 info words. num_heads: heads of the state pool."""
    extra, scalars = (spec.dim("p"), 1) if spec.family == "mamba2" else (2 * spec.dim("v"), 5)
    return batch * (num_heads * (extra + scalars + spec.capacity) + 4)


def split_records_shared_bytes(spec: KernelSpec) -> int:
    """Upper bound on the shared memory of the split kernel's records kernel (Records::Smem in
    templates/*/split_kernel.cuh) for every head one CTA serves (a Mamba-2 group's heads, a GDN
    key head's value heads): the held B or k rows, this token's x, the scalars, and the held x
    (Mamba-2) or u (GDN) rows where a full SM of 8-warp records CTAs still fits with them (else
    those are read through L2). GDN's 4-warp CTAs (ops/tiling.py) hold their rows in shared
    memory less often, so this bounds them too."""
    act, cap = DTYPE_BYTES[spec.act_dtype], spec.capacity
    ring = max(cap - 1, 1)
    if spec.family == "mamba2":
        heads, p, n = spec.dim("hpg"), spec.dim("p"), spec.dim("n")
        base = heads * p * act + (ring + 2) * n * act + 4 * (3 * heads * cap + cap + 4 * heads)
        held_rows, placeholder = heads * ring * p * act, p * act
    else:
        heads, k, v = spec.dim("vph"), spec.dim("k"), spec.dim("v")
        base = (ring + 2) * k * act + 4 * (4 * heads * cap + 3 * cap + 1 + 3 * heads)
        held_rows, placeholder = heads * ring * v * 4, v * 4
    base += 6 * 16  # 16-byte alignment of the record arrays
    full_sm = MAX_THREADS_PER_SM // SPLIT_RECORDS_THREADS
    fits = SHARED_BYTES_PER_SM // (base + held_rows + SHARED_BYTES_RESERVED_PER_CTA) >= full_sm
    return base + (held_rows if fits else placeholder)  # (one row left in place of the array)


def _tiling_context(spec: KernelSpec) -> dict:
    return {"tilings": spec_tilings(spec)}


_FAMILY_CONTEXT = {"mamba2": _tiling_context, "gdn": _tiling_context}
