"""Each op's arguments, declared once: names, symbolic shapes, dtypes, optional/written, and the
order the module's bindings take them.

A family declares its token inputs (`Family.inputs`, the `Input`s below) and the plan scalars
its kernels read (`Family.bound_scalars`). Everything else is derived here from those and
from the family's rings:

- `check_token_inputs`: the shape/dtype/device/contiguity checks the ops run on the inputs;
- `binding_params` / `bind`: each binding's parameter list (rendered into the module templates
  as C++ by `cpp_params`) and the positional arguments built by name from it;
- `op_args`: each public op's arguments, from which ops/library.py writes the torch.library
  schemas and a test checks the Python signatures.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from replayssm_jit.core.checks import check_aligned_rows, check_planned, check_tensor

# A shape entry: "lead" (the per-token dims: (batch,) for a step, (batch, T) for drafts), a
# HeadShape field, or a product of them joined by "*".
Dim = str


@dataclass(frozen=True)
class Input:
    """One token input of a family's ops.

    shape: symbolic (see Dim); dtype: "act" (the layout's activation dtype) or "f32";
    strides: "contiguous", "inner" (a unit stride in the last dim) or "any"; aligned: 16-byte
    aligned rows (loaded as vectors). planned: (plan() option, spec flag, present when set):
    the input is given exactly when the flag is (not) in the spec, else it is required.
    binds: the binding parameter it fills (its own name by default; GDN's a and g both fill
    gate_a, one per gate mode).
    """

    name: str
    shape: tuple[Dim, ...]
    dtype: str
    strides: str = "any"
    aligned: bool = False
    planned: tuple[str, str, bool] | None = None
    binds: str | None = None

    @property
    def param(self) -> str:
        return self.binds or self.name

    def present(self, flags: frozenset[str] | set[str]) -> bool:
        """Whether a spec with `flags` takes this input."""
        if self.planned is None:
            return True
        _, flag, when = self.planned
        return (flag in flags) == when


@dataclass(frozen=True)
class Param:
    """One parameter of a module binding (or of an op): its name and C++ type.

    cpp: "TensorView", "Optional<TensorView>", "int64_t" or "double"; written: the op writes
    the tensor (for the torch.library schema).
    """

    name: str
    cpp: str = "TensorView"
    written: bool = False

    @property
    def optional(self) -> bool:
        return self.cpp.startswith("Optional")

    @property
    def tensor(self) -> bool:
        return self.cpp.endswith("TensorView>") or self.cpp == "TensorView"


def _t(name: str, written: bool = False) -> Param:
    return Param(name, "TensorView", written)


def _opt(name: str, written: bool = False) -> Param:
    return Param(name, "Optional<TensorView>", written)


def _int(name: str) -> Param:
    return Param(name, "int64_t")


# ---------------------------------------------------------------------------------------------
# Shared parts of the bindings, in the order every module takes them
# ---------------------------------------------------------------------------------------------

CHECKPOINT = (_t("state", True), _opt("state_scale", True), _opt("state_block_scale", True))
READ_COPY = (_opt("read_state", True), _opt("read_scale", True), _opt("read_block_scale", True))
CHECKPOINT_NAMES = tuple(p.name for p in (*CHECKPOINT, *READ_COPY))
CURSORS = _t("cursors", True)
STEP_TAIL = (
    _t("out", True),
    _t("slot_indices"),
    _int("pad_slot_id"),
    _int("seed"),
    _opt("seed_tensor"),
)
LAUNCH = (_int("rows"), _int("flags"))
# A [batch] bool/uint8 mask of rows a ReplaySSM decode step flushes now (the flush_mask flag).
FLUSH_MASK = _opt("flush_mask")
DRAFT_INDEX = (_opt("num_drafts"), _opt("parents"), _opt("num_accepted"))
# commit_step's rings by role, in every family's ring order (value heads, key heads, decays).
COMMIT_RING_PARAMS = ("value_ring", "key_ring", "decay_ring")
# Separate mode's rings (a read copy's layout only: GDN's v and beta), after the three.
COMMIT_READ_RING_PARAMS = ("read_value_ring", "read_scalar_ring")
BINDINGS = ("conventional_step", "replay_step", "verify_step", "snapshot_step", "commit_step",
            "materialize_step")  # fmt: skip


def ring_params(family) -> tuple[Param, ...]:
    """The family's rings as binding parameters (separate mode's own are optional)."""
    return tuple(_opt(r.name, True) if r.read_copy_only else _t(r.name, True) for r in family.rings)


def token_params(family) -> tuple[Param, ...]:
    """The family's token inputs as binding parameters (one per `Input.param`, in declaration
    order; optional where planned), then its plan scalars."""
    params: dict[str, Param] = {}
    for arg in family.inputs:
        if arg.param not in params:
            shared = [a for a in family.inputs if a.param == arg.param]
            # A parameter every gate mode fills is required; one some modes leave out is not.
            always = any(a.planned is None for a in shared) or len(shared) > 1
            params[arg.param] = _t(arg.param) if always else _opt(arg.param)
    return (*params.values(), *(Param(name, "double") for name in family.bound_scalars))


def binding_params(family, binding: str) -> tuple[Param, ...]:
    """The parameters of the module binding `binding` of `family`, in its positional order."""
    token = token_params(family)
    if binding == "conventional_step":
        return (*CHECKPOINT, *token, *STEP_TAIL, *LAUNCH)
    if binding == "replay_step":
        rings = ring_params(family)
        return (*CHECKPOINT, *READ_COPY, *rings, CURSORS, *token, *STEP_TAIL, *LAUNCH,
                _t("workspace", True), FLUSH_MASK)  # fmt: skip
    if binding == "verify_step":
        rings = ring_params(family)
        return (*CHECKPOINT, *READ_COPY, *rings, CURSORS, *token, *STEP_TAIL, *DRAFT_INDEX,
                *LAUNCH, _opt("workspace", True))  # fmt: skip
    if binding == "snapshot_step":
        return (CHECKPOINT[0], *token, *STEP_TAIL[:2], _t("snapshot_slots"), STEP_TAIL[2],
                DRAFT_INDEX[0], LAUNCH[0])  # fmt: skip
    if binding == "commit_step":
        return (CURSORS, *(_t(n, True) for n in COMMIT_RING_PARAMS), _t("num_accepted"),
                _opt("accepted_path"), _t("slot_indices"), _int("pad_slot_id"),
                *(_opt(n, True) for n in COMMIT_READ_RING_PARAMS))  # fmt: skip
    if binding == "materialize_step":
        # Reads only: the carried copy (never the read copy), every ring, the cursors.
        checkpoint = (_t("state"), _opt("state_scale"), _opt("state_block_scale"))
        rings = tuple(Param(p.name, p.cpp) for p in ring_params(family))
        return (*checkpoint, *rings, _t("cursors"), *(_t(n) for n in family.fold_inputs),
                _t("slot_ids"), _t("out", True))  # fmt: skip
    raise ValueError(f"binding: expected one of {list(BINDINGS)}, got {binding!r}")


def commit_ring_roles(ring_names: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """(commit argument, ring name) for each of a layout's rings, in ring order: the three every
    layout has, then a read copy's (a tree commit moves every ring's rows)."""
    roles = (*COMMIT_RING_PARAMS, *COMMIT_READ_RING_PARAMS)
    if not 3 <= len(ring_names) <= len(roles):
        raise ValueError(f"ring_names: expected 3 to {len(roles)} rings, got {list(ring_names)}")
    return tuple(zip(roles, ring_names))


def bind(family, binding: str, values: Mapping[str, object]) -> list[object]:
    """The positional arguments of `binding`, each taken from `values` by name (an optional
    parameter missing from `values` is None)."""
    args = []
    for p in binding_params(family, binding):
        if p.name not in values and not p.optional:
            raise KeyError(f"{binding}: expected a value for {p.name!r}, got none")
        args.append(values.get(p.name))
    return args


def cpp_params(family, binding: str, indent: int, width: int = 120) -> str:
    """`binding`'s C++ parameter list, wrapped at `width` columns with `indent` spaces before
    each continuation line (what the templates render between the parentheses)."""
    parts = [f"{p.cpp} {p.name}" for p in binding_params(family, binding)]
    lines, line = [], ""
    for i, part in enumerate(parts):
        piece = part + ("," if i < len(parts) - 1 else "")
        if line and indent + len(line) + 1 + len(piece) > width:
            lines.append(line)
            line = piece
        else:
            line = f"{line} {piece}" if line else piece
    lines.append(line)
    return ("\n" + " " * indent).join(lines)


# ---------------------------------------------------------------------------------------------
# Checks of the token inputs
# ---------------------------------------------------------------------------------------------


def _size(dim: Dim, shape) -> int:
    size = 1
    for factor in dim.split("*"):
        size *= getattr(shape, factor)
    return size


def expected_shape(arg: Input, shape, lead: Sequence[int]) -> tuple[int, ...]:
    """`arg`'s shape for a layer of HeadShape `shape` and per-token dims `lead`."""
    dims: list[int] = []
    for dim in arg.shape:
        dims.extend(lead if dim == "lead" else (_size(dim, shape),))
    return tuple(dims)


def _plan_arg(family, arg: Input, flags) -> str:
    """The plan() setting that decided whether `arg` is given, as the error shows it (with the
    inputs to pass where one setting decides several)."""
    option, flag, _ = arg.planned
    value = flag in flags
    group = [a for a in family.inputs if a.planned and a.planned[0] == option]
    if len(group) == 1:
        return f"{option}={value}"
    wanted = [a.name for a in group if a.present(flags)]
    return f"{option}={value}: pass {', '.join(wanted)}"


def check_token_inputs(
    family,
    given: Mapping[str, torch.Tensor | None],
    *,
    shape,
    act_dtype: torch.dtype,
    device: torch.device,
    flags,
    lead: Sequence[int],
) -> dict[str, torch.Tensor | None]:
    """Check `given` (each of family.inputs by name) against the declaration and the plan's
    flags: required inputs first, then that each planned one is given exactly when the plan
    compiled it, then their shapes, and 16-byte aligned rows last. Returns the binding
    parameters they fill, by name, in binding order (None where not given)."""
    flags = frozenset(flags)

    def check(arg: Input) -> None:
        check_tensor(
            arg.name, given[arg.name], shape=expected_shape(arg, shape, lead),
            dtype=act_dtype if arg.dtype == "act" else torch.float32, device=device,
            contiguous=arg.strides == "contiguous", inner_contiguous=arg.strides == "inner",
        )  # fmt: skip

    for arg in family.inputs:
        if arg.planned is None:
            check(arg)
    for arg in family.inputs:
        if arg.planned is not None:
            check_planned(arg.name, given[arg.name], arg.present(flags),
                          _plan_arg(family, arg, flags))  # fmt: skip
    for arg in family.inputs:
        if arg.planned is not None and arg.present(flags):
            check(arg)
    for arg in family.inputs:
        if arg.aligned:
            check_aligned_rows(arg.name, given[arg.name])
    bound: dict[str, torch.Tensor | None] = {}
    for arg in family.inputs:
        if arg.present(flags) or arg.param not in bound:
            bound[arg.param] = given[arg.name] if arg.present(flags) else None
    return bound


# ---------------------------------------------------------------------------------------------
# The public ops' arguments
# ---------------------------------------------------------------------------------------------

SEED = Param("seed", "int64_t")  # an int, or an int64 device tensor (library: seed_tensor)
OPS = ("decode", "verify", "snapshot_verify")


def _as_optional(p: Param) -> Param:
    return p if p.optional or not p.tensor else Param(p.name, "Optional<TensorView>", p.written)


def op_args(family, op: str) -> tuple[Param, ...]:
    """The arguments of the public op `<family>_<op>` after the plan (its keyword names), the
    required ones first: the slot tensors, the token inputs as the caller names them, then the
    op's own."""
    inputs = tuple(_t(a.name) if a.planned is None else _opt(a.name) for a in family.inputs)
    # out is required in the custom ops (they allocate nothing); the Python ops make it if None.
    token = (*inputs, _t("slot_indices"), _t("out", True))
    if op == "decode":
        copies = CHECKPOINT[1:] + READ_COPY
        rings = ring_params(family)
        # A conventional step leaves the rings and cursors out.
        slots = tuple(_as_optional(p) for p in (*rings, CURSORS))
        tail = (*copies, *slots, _opt("workspace", True), SEED, _opt("num_accepted"),
                FLUSH_MASK)  # fmt: skip
        return _required_first((CHECKPOINT[0], *token, *tail))
    if op == "verify":  # (the torch path's copies; the CUDA modules take one-copy f32/bf16/f16)
        copies = CHECKPOINT + READ_COPY
        slots = (*copies, *ring_params(family), CURSORS)
        return _required_first((*slots, *token, *DRAFT_INDEX, SEED, _opt("workspace", True)))
    if op == "snapshot_verify":
        return _required_first((CHECKPOINT[0], *token, _t("snapshot_slots"), DRAFT_INDEX[0]))
    raise ValueError(f"op: expected one of {list(OPS)}, got {op!r}")


def _required_first(params: Sequence[Param]) -> tuple[Param, ...]:
    return tuple(sorted(params, key=lambda p: p.optional or p is SEED))


# The family-free ops: commit_drafts (the pool by ring role) and commit_snapshots.
COMMIT_DRAFTS_ARGS = (
    CURSORS, *(_t(n, True) for n in COMMIT_RING_PARAMS), _t("num_accepted"), _t("slot_indices"),
    _opt("accepted_path"), _opt("parents"), *(_opt(n, True) for n in COMMIT_READ_RING_PARAMS),
)  # fmt: skip
COMMIT_SNAPSHOTS_ARGS = (
    _t("state", True),
    _t("snapshot_slots"),
    _t("num_accepted"),
    _t("slot_indices"),
)
