"""LaunchConfig: the launch choices a plan() may fix, each "auto" by default.

`REPLAYSSM_LAUNCH` (for experiments, e.g. "kernel=split,rows_per_cta=16") supplies values for
the fields a caller left "auto"; production code passes a LaunchConfig instead. The variable is
read once per process (launch/environment.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import lru_cache

from replayssm_jit.launch.environment import LAUNCH_ENV, launch_environment

AUTO = "auto"
REPLAY_KERNELS = ("split", "per-item", "flush-every-step")
VERIFY_KERNELS = ("split", "per-item")

_BOOL_FIELDS = ("capped_state_registers", "overlap_prior_kernel", "speculative_records")


def _is_auto(value: object) -> bool:
    return isinstance(value, str) and value == AUTO


@dataclass(frozen=True)
class LaunchConfig:
    """How plan() launches a step; every field "auto" lets the launch policy choose.

    kernel: the ReplaySSM kernel, one of "split" (a records kernel, then a state kernel),
        "per-item" or "flush-every-step" (per-item, flushing every token).
    rows_per_cta: the state rows one CTA holds, one of the spec's compiled tiles.
    records_warps: warps of the split step's records CTAs (a value the family compiles).
    capped_state_registers: the split state kernel's 96-register variant (where compiled).
    overlap_prior_kernel: launch the step's first kernel as a programmatic dependent of the
        stream's previous kernel (sm_90).
    speculative_records: issue every ring row's loads before the cursor is read.
    verify_kernel: the verify kernel of a plan with drafts, "split" or "per-item" (else as
        `kernel` asks, else the policy's).
    verify_rows_per_cta: the verify kernel's row tile (else `rows_per_cta`, else the policy's).
    """

    kernel: str = AUTO
    rows_per_cta: int | str = AUTO
    records_warps: int | str = AUTO
    capped_state_registers: bool | str = AUTO
    overlap_prior_kernel: bool | str = AUTO
    speculative_records: bool | str = AUTO
    verify_kernel: str = AUTO
    verify_rows_per_cta: int | str = AUTO

    def __post_init__(self) -> None:
        # (each value's type first: `value != AUTO` of an array or a tensor is no bool)
        if not isinstance(self.kernel, str) or self.kernel not in (AUTO, *REPLAY_KERNELS):
            raise ValueError(
                f"config.kernel: expected 'auto' or one of {REPLAY_KERNELS}, got {self.kernel!r}"
            )
        if not isinstance(self.verify_kernel, str) or self.verify_kernel not in (
            AUTO,
            *VERIFY_KERNELS,
        ):
            raise ValueError(
                f"config.verify_kernel: expected 'auto' or one of {VERIFY_KERNELS}, "
                f"got {self.verify_kernel!r}"
            )
        for name in ("rows_per_cta", "records_warps", "verify_rows_per_cta"):
            value = getattr(self, name)
            if not _is_auto(value) and (
                not isinstance(value, int) or isinstance(value, bool) or value <= 0
            ):
                raise ValueError(f"config.{name}: expected 'auto' or a positive int, got {value!r}")
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if not _is_auto(value) and not isinstance(value, bool):
                raise ValueError(f"config.{name}: expected 'auto' or a bool, got {value!r}")

    def with_defaults(self, other: LaunchConfig) -> LaunchConfig:
        """This config with its "auto" fields taken from `other`."""
        return replace(
            self,
            **{
                f.name: getattr(other, f.name)
                for f in fields(self)
                if getattr(self, f.name) == AUTO
            },
        )


def parse_launch(text: str, source: str = LAUNCH_ENV) -> LaunchConfig:
    """A LaunchConfig from "field=value,..." (bools as 0/1/true/false); errors name `source`."""
    if not isinstance(text, str):
        raise TypeError(f"{source}: expected a str of field=value pairs, got {type(text).__name__}")
    values: dict[str, object] = {}
    names = {f.name for f in fields(LaunchConfig)}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or key not in names:
            raise ValueError(
                f"{source}: expected field=value pairs with fields {sorted(names)}, got {item!r}"
            )
        if key in values:
            raise ValueError(f"{source}: expected each field once, got {key} twice")
        if key in _BOOL_FIELDS:
            lowered = raw.lower()
            if lowered not in ("0", "1", "true", "false", AUTO):
                raise ValueError(f"{source}: {key} expected 0, 1, true, false or auto, got {raw!r}")
            values[key] = AUTO if lowered == AUTO else lowered in ("1", "true")
        elif key in ("kernel", "verify_kernel"):
            values[key] = raw
        else:
            # (ASCII digits only: str.isdigit() takes '²', which int() rejects)
            values[key] = int(raw) if raw.isascii() and raw.isdigit() else raw
    try:
        return LaunchConfig(**values)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


@lru_cache(maxsize=4)
def _environment_config(text: str) -> LaunchConfig:
    # Parsed once per text; a bad text raises at every plan (exceptions are not cached).
    return parse_launch(text)


def resolve_config(config: LaunchConfig | None) -> LaunchConfig:
    """`config` (checked) with REPLAYSSM_LAUNCH (as read once, launch/environment.py) filling
    its "auto" fields."""
    if config is None:
        config = LaunchConfig()
    elif not isinstance(config, LaunchConfig):
        raise TypeError(f"config: expected a LaunchConfig or None, got {type(config).__name__}")
    raw = launch_environment().launch
    return config.with_defaults(_environment_config(raw)) if raw.strip() else config
