"""Typed kernel specializations and their readable URIs (data only).

A spec names everything a template is specialized on. Two specs with equal URIs are the same
compiled module; the URI is also the module's file name.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from replayssm_jit.core.checks import check_positive_int
from replayssm_jit.core.dtypes import (
    BLOCK_SCALED_DTYPES,
    CHECKPOINT_ONLY_DTYPES,
    CHUNK_VALUES,
    CPP_TYPES,
    DTYPE_BITS,
    MAX_DRAFTS,
    MAX_VERIFY_DRAFTS,
    MAX_WINDOW,
    dtype_name,
)
from replayssm_jit.core.launch_flags import cpp_flag_constants
from replayssm_jit.core.tiles import rows_tilings
from replayssm_jit.families import FAMILIES, get_family
from replayssm_jit.families.base import Family, HeadShape


@dataclass(frozen=True)
class KernelSpec:
    """One specialization: family, head dims, window, drafts, dtypes and flags.

    dims: ordered (URI key, value) pairs, e.g. (("p", 64), ("n", 128), ("hpg", 16)). The short
        keys are part of every module URI (and so of AOT names); read them by role instead:
        value_dim (Mamba-2 headdim "p", GDN/KDA "v"), key_dim ("n", "k") and heads_per_key
        ("hpg", "vph"; Family.spec_dims maps each key to its role and argument name).
    window: replay window L (1 = conventional only). drafts: draft tokens T the ring also
    holds (capacity L + T). state_dtype: the checkpoint the recurrence is carried in (f32, bf16,
    f16, e4m3 with a scale per row, or nvfp4 with e4m3 scales per 16 values and an FP32 scale
    per head). read_dtype: separate mode's read copy (nvfp4, e4m3, bf16 or f16), which
    non-flush steps read instead, or None (shared mode). flags: sorted compile-time
    features, e.g. ("d", "dt_softplus"). Construct through `make_spec` (or mamba2_spec /
    gdn_spec), which checks everything.
    """

    family: str
    dims: tuple[tuple[str, int], ...]
    window: int
    drafts: int
    act_dtype: str
    state_dtype: str
    flags: tuple[str, ...] = field(default=())
    read_dtype: str | None = None

    def __post_init__(self) -> None:
        fam = get_family(self.family)
        keys = tuple(key for key, _, _ in fam.spec_dims)
        if tuple(k for k, _ in self.dims) != keys:
            raise ValueError(f"dims: expected keys {keys} for {self.family}, got {self.dims!r}")
        for name, value in self.dims:
            check_positive_int(fam.dim_arg(name), value)
        check_positive_int("window", self.window, upper=MAX_WINDOW)
        check_positive_int("drafts", self.drafts, upper=MAX_DRAFTS)
        object.__setattr__(self, "act_dtype", dtype_name(self.act_dtype, "act_dtype"))
        state = dtype_name(self.state_dtype, "state_dtype", checkpoint=True)
        object.__setattr__(self, "state_dtype", state)
        read = check_read_dtype(fam, self.read_dtype, state, self.window, self.drafts)
        object.__setattr__(self, "read_dtype", read)
        flags = check_flags(fam, self.flags, state, read, window=self.window, drafts=self.drafts)
        object.__setattr__(self, "flags", flags)

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
            *([f"read-{self.read_dtype}"] if self.read_dtype else []),
            *self.flags,
        ]
        return "_".join(parts)

    @property
    def capacity(self) -> int:
        """Record ring rows per slot: L + T."""
        return self.window + self.drafts

    @property
    def has_verify(self) -> bool:
        """Whether the module compiles the speculative kernels (verify, commit, snapshot)."""
        return 2 <= self.drafts <= MAX_VERIFY_DRAFTS

    def dim(self, name: str) -> int:
        """The dim under URI key `name` (prefer value_dim, key_dim, heads_per_key)."""
        return dict(self.dims)[name]

    def _dim_of_role(self, role: str) -> int:
        return self.dim(get_family(self.family).role_key(role))

    @property
    def value_dim(self) -> int:
        """Rows of one head's state: Mamba-2's headdim P, GDN/KDA's head_v_dim V."""
        return self._dim_of_role("value_dim")

    @property
    def key_dim(self) -> int:
        """Columns of one head's state: Mamba-2's dstate N, GDN/KDA's head_k_dim K."""
        return self._dim_of_role("key_dim")

    @property
    def heads_per_key(self) -> int:
        """Value heads per key head: Mamba-2's heads per group, GDN/KDA's per key head."""
        return self._dim_of_role("heads_per_key")

    @property
    def state_rows_cols(self) -> tuple[int, int]:
        """(rows, cols) of one head's state: (value_dim, key_dim)."""
        return self.value_dim, self.key_dim

    def template_context(self) -> dict:
        fam = get_family(self.family)
        return {
            "spec": self,
            "uri": self.uri,
            "dims": dict(self.dims),
            "window": self.window,
            "drafts": self.drafts,
            "capacity": self.capacity,
            "verify": self.has_verify,
            "act_t": CPP_TYPES[self.act_dtype],
            "state_t": CPP_TYPES[self.state_dtype],
            "read_t": CPP_TYPES[self.read_dtype] if self.read_dtype else "void",
            "flags": set(self.flags),
            "tilings": spec_tilings(self),
            "launch_flags": cpp_flag_constants(),
            **fam.template_context(),
        }


def check_read_dtype(
    fam: Family, read_dtype: object, state_dtype: str, window: int, drafts: int
) -> str | None:
    """`read_dtype` as a short name (or None), checked against the rest of the spec. Every
    format takes drafts on the torch path; check_cuda_spec refuses the CUDA modules that would
    pair drafts with an e4m3/nvfp4 state or a read copy (not built yet)."""
    read = None if read_dtype is None else dtype_name(read_dtype, "read_dtype", checkpoint=True)
    nvfp4 = BLOCK_SCALED_DTYPES & {state_dtype, read}
    if nvfp4 and not fam.nvfp4:
        built = sorted(f.name for f in FAMILIES.values() if f.nvfp4)
        arg = "state_dtype" if state_dtype in nvfp4 else "read_dtype"
        raise ValueError(f"{arg}: NVFP4 checkpoints are built for {built}, not {fam.name}")
    if read is not None:
        if read == state_dtype or read == "f32":
            raise ValueError(
                f"read_dtype: expected a format narrower than state_dtype={state_dtype!r} "
                f"(nvfp4, e4m3, bf16 or f16), got {read!r}"
            )
        if DTYPE_BITS[read] >= DTYPE_BITS[state_dtype] or state_dtype in CHECKPOINT_ONLY_DTYPES:
            raise ValueError(
                f"read_dtype: a read copy needs a wider carried state; got "
                f"state_dtype={state_dtype!r} and read_dtype={read!r}"
            )
        if window < 2:
            raise ValueError(
                f"read_dtype: a read copy serves ReplaySSM's non-flush steps (window >= 2); "
                f"got window={window}"
            )
    return read


def check_cuda_spec(spec: KernelSpec) -> KernelSpec:
    """`spec`, refused where the CUDA templates cannot build it: a read copy in a family without
    separate mode's kernels (Family.read_copy); drafts (the speculative kernels) with an e4m3 or
    NVFP4 checkpoint, or with a read copy, in a family whose verify
    kernels do not read them (Family.verify_scaled_checkpoint, verify_read_copy). The torch path
    (a plan on device="cpu", or torch_path on any tensors) takes those."""
    fam = get_family(spec.family)
    if spec.read_dtype is not None and not fam.read_copy:
        built = sorted(f.name for f in FAMILIES.values() if f.read_copy)
        raise ValueError(
            f"read_dtype: expected None for a CUDA {spec.family} module (separate mode's CUDA "
            f"kernels are built for {built}; the torch path, a plan on device='cpu', runs "
            f"{spec.family}'s), got {spec.read_dtype!r}"
        )
    scaled = spec.state_dtype in CHECKPOINT_ONLY_DTYPES and not fam.verify_scaled_checkpoint
    separate = spec.read_dtype is not None and not fam.verify_read_copy
    if spec.has_verify and (scaled or separate):
        taken = "f32/bf16/f16 and e4m3/nvfp4" if fam.verify_scaled_checkpoint else "f32/bf16/f16"
        raise ValueError(
            f"drafts: expected 1 for a CUDA {spec.family} module with state_dtype="
            f"{spec.state_dtype!r} and read_dtype={spec.read_dtype!r} (the torch path, a plan "
            f"on device='cpu', verifies drafts on these checkpoints; this family's CUDA kernels "
            f"do not yet: they take {taken} checkpoints without a read copy), got {spec.drafts}"
        )
    return spec


def check_flags(
    fam: Family,
    flags: object,
    state_dtype: str,
    read_dtype: str | None = None,
    *,
    window: int,
    drafts: int,
) -> tuple[str, ...]:
    """`flags` as the sorted names of features `fam` compiles, with their dependencies met (a
    spec's window and drafts among them)."""
    if isinstance(flags, str) or not isinstance(flags, Iterable):
        raise TypeError(
            f"flags: expected a sequence of flag names, got {type(flags).__name__} {flags!r}"
        )
    flags = tuple(flags)
    if not all(isinstance(f, str) for f in flags):
        raise TypeError(f"flags: expected a sequence of flag names, got {flags!r}")
    unknown = set(flags) - fam.flags
    if unknown:
        raise ValueError(
            f"flags: expected a subset of {sorted(fam.flags)}, got unknown {sorted(unknown)}"
        )
    if "sr" in flags and state_dtype == "f32" and read_dtype is None:
        raise ValueError(
            "flags: 'sr' (stochastic rounding) needs a bf16/f16/e4m3/nvfp4 state_dtype or a read "
            "copy, got an f32 state and none"
        )
    if "read_rn" in flags and ("sr" not in flags or read_dtype is None):
        raise ValueError(
            "flags: 'read_rn' (a read copy rounded to nearest under stochastic rounding) needs "
            f"'sr' and a read copy, got flags {sorted(set(flags))} and read_dtype={read_dtype!r}"
        )
    if "device_seed" in flags and "sr" not in flags:
        raise ValueError("flags: 'device_seed' (the seed read on the device) needs 'sr'")
    if "flush_mask" in flags and (window < 2 or drafts != 1):
        # A conventional step writes every state anyway; a verify reads no mask, so a spec
        # with drafts must not suggest that one is honoured.
        raise ValueError(
            "flags: 'flush_mask' (forced flushes of a ReplaySSM decode step) needs window >= 2 "
            f"and drafts = 1, got window={window} and drafts={drafts}"
        )
    return tuple(sorted(set(flags)))


def spec_tilings(spec: KernelSpec) -> list[tuple[int, int]]:
    """The (rows_per_cta, warps) tiles compiled into `spec`'s module, largest first."""
    rows, cols = spec.state_rows_cols
    return checkpoint_tilings(rows, cols, (spec.state_dtype, spec.read_dtype))


def checkpoint_tilings(rows: int, cols: int, dtypes) -> list[tuple[int, int]]:
    """The row tiles that serve every copy of a [rows, cols] head in `dtypes` (None: no such
    copy): separate mode's kernel tiles both copies with one (rows, warps); an NVFP4 copy
    needs whole heads per CTA (its head scale is reduced over the head at a flush)."""
    present = [d for d in dtypes if d is not None]
    whole = bool(BLOCK_SCALED_DTYPES & set(present))
    tilings = rows_tilings(rows, cols, CHUNK_VALUES[present[0]], whole_heads=whole)
    for other in present[1:]:
        also = set(rows_tilings(rows, cols, CHUNK_VALUES[other], whole_heads=whole))
        tilings = [t for t in tilings if t in also]
    if tilings or len(present) == 1:
        return tilings
    # The copies' preferred warp counts differ: per rows_per_cta the first that tiles both.
    every = [rows_tilings(rows, cols, CHUNK_VALUES[d], whole_heads=whole, every_warps=True)
             for d in present]  # fmt: skip
    common = [t for t in every[0] if all(t in other for other in every[1:])]
    return [t for i, t in enumerate(common) if t[0] not in {r for r, _ in common[:i]}]


def make_spec(
    family: str,
    shape: HeadShape,
    *,
    window: int = 16,
    drafts: int = 1,
    act_dtype: object = "bf16",
    state_dtype: object = "f32",
    flags: Iterable[str] | None = None,
    read_dtype: object = None,
) -> KernelSpec:
    """The checked specialization of `family` for `shape` (value_heads may be any multiple of
    the key heads' ratio: only the ratio enters the spec).

    Key rows must fill whole 16-byte lane chunks (a multiple of max(values per chunk, 8), at
    most 32 lanes x 8 chunks) and value rows must have a row tiling (NVFP4: whole heads).
    """
    fam = get_family(family)
    state = dtype_name(state_dtype, "state_dtype", checkpoint=True)
    # (window and drafts first: the read-copy and flag rules compare them)
    check_positive_int("window", window, upper=MAX_WINDOW)
    check_positive_int("drafts", drafts, upper=MAX_DRAFTS)
    read = check_read_dtype(fam, read_dtype, state, window, drafts)
    flags = check_flags(fam, fam.default_flags if flags is None else flags, state, read,
                        window=window, drafts=drafts)  # fmt: skip
    spec = KernelSpec(
        family=fam.name,
        dims=fam.dims_of(shape),
        window=window,
        drafts=drafts,
        act_dtype=dtype_name(act_dtype, "act_dtype"),
        state_dtype=state,
        flags=tuple(flags),
        read_dtype=read,
    )
    rows, cols = spec.state_rows_cols
    row_arg, col_arg = fam.dim_arg(fam.role_key("value_dim")), fam.dim_arg(fam.role_key("key_dim"))
    vec = max(CHUNK_VALUES[d] for d in (state, read or state))
    if cols % vec or cols % 8 or cols > 32 * vec * 8:
        raise ValueError(
            f"{col_arg}: expected a multiple of {max(vec, 8)} up to {32 * vec * 8}, got {cols}"
        )
    if not spec_tilings(spec):
        copies = state if read is None else f"{state} carried and {read} read copies in one tile"
        raise ValueError(
            f"{row_arg}: no row tiling fits {row_arg}={rows} with {col_arg}={cols} ({copies})"
        )
    return spec


def family_spec(family: str, *, window: int = 16, drafts: int = 1, act_dtype: object = "bf16",
                state_dtype: object = "f32", flags: Iterable[str] | None = None,
                read_dtype: object = None, **dims: int) -> KernelSpec:  # fmt: skip
    """The spec of `family` from its dims by their user-facing names (Family.spec_dims), e.g.
    family_spec("mamba2", headdim=64, dstate=128, heads_per_group=16)."""
    fam = get_family(family)
    args = {arg: role for _, role, arg in fam.spec_dims}
    missing, unknown = [a for a in args if a not in dims], sorted(set(dims) - set(args))
    if missing or unknown:
        raise TypeError(
            f"{fam.name} spec: expected dims {list(args)}, got missing {missing} and unknown {unknown}"
        )
    by_role = {role: check_positive_int(arg, dims[arg]) for arg, role in args.items()}
    shape = HeadShape(1, by_role["heads_per_key"], by_role["key_dim"], by_role["value_dim"])
    return make_spec(
        fam.name, shape, window=window, drafts=drafts, act_dtype=act_dtype,
        state_dtype=state_dtype, flags=flags, read_dtype=read_dtype,
    )  # fmt: skip


def mamba2_spec(*, headdim: int, dstate: int, heads_per_group: int, **kwargs) -> KernelSpec:
    """The Mamba-2 specialization (tied head dim: A and dt per head); kwargs as family_spec."""
    return family_spec(
        "mamba2", headdim=headdim, dstate=dstate, heads_per_group=heads_per_group, **kwargs
    )


def gdn_spec(
    *, head_k_dim: int, head_v_dim: int, value_heads_per_key_head: int, **kwargs
) -> KernelSpec:
    """The Gated DeltaNet specialization (state [V, K] per value head); kwargs as family_spec.

    flags: "qk_l2norm" (q and k L2-normalised in the kernel), "gates_in_kernel" (raw a, b plus
    A_log, dt_bias; otherwise g, beta), "sr" (stochastic rounding of a bf16/f16 checkpoint).
    """
    return family_spec(
        "gdn", head_k_dim=head_k_dim, head_v_dim=head_v_dim,
        value_heads_per_key_head=value_heads_per_key_head, **kwargs,
    )  # fmt: skip


def kda_spec(
    *, head_k_dim: int, head_v_dim: int, value_heads_per_key_head: int, **kwargs
) -> KernelSpec:
    """The Kimi Delta Attention specialization: gdn_spec's arguments and flags, with a decay per
    key channel (g [K] per value head and token)."""
    return family_spec(
        "kda", head_k_dim=head_k_dim, head_v_dim=head_v_dim,
        value_heads_per_key_head=value_heads_per_key_head, **kwargs,
    )  # fmt: skip
