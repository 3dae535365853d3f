"""Launch entries: LaunchConfig(...), the REPLAYSSM_LAUNCH parser (parse_launch) and
resolve_config (a config with the variable filling its "auto" fields)."""

from __future__ import annotations

from dataclasses import fields

from hypothesis import strategies as st

from replayssm_jit import LaunchConfig
from replayssm_jit.launch.config import (
    AUTO,
    LAUNCH_ENV,
    REPLAY_KERNELS,
    VERIFY_KERNELS,
    parse_launch,
    resolve_config,
)

from .core import Call, EnvPatch, Validity, entry
from .values import draw_bool, draw_choice, draw_int

INT_FIELDS = ("rows_per_cta", "records_warps", "verify_rows_per_cta")
KERNEL_FIELDS = {"kernel": REPLAY_KERNELS, "verify_kernel": VERIFY_KERNELS}
BOOL_FIELDS = ("capped_state_registers", "overlap_prior_kernel", "speculative_records")
FIELDS = tuple(f.name for f in fields(LaunchConfig))
NAMES = {f"config.{f}" for f in FIELDS}


def draw_config_fields(draw, v: Validity) -> dict[str, object]:
    """Some LaunchConfig fields, each "auto", a good value or a bad one."""
    chosen = draw(st.sets(st.sampled_from(FIELDS)))
    values: dict[str, object] = {}
    for name in sorted(chosen):
        if draw(st.integers(0, 3)) == 0:
            values[name] = AUTO
            continue
        if name in KERNEL_FIELDS:
            value, ok = draw_choice(draw, (AUTO, *KERNEL_FIELDS[name]), v=v)
        elif name in INT_FIELDS:
            value, ok = draw_int(draw, 1, None, likely=st.sampled_from([1, 4, 8, 16, 32]), v=v)
        else:
            value, ok = draw_bool(draw, v=v)
        values[name] = value
        v.mark(ok, f"config.{name}={value!r}")
    return values


def _check_config(config, values: dict[str, object]) -> None:
    assert isinstance(config, LaunchConfig)
    for name in FIELDS:
        assert getattr(config, name) == values.get(name, AUTO), name


@entry("launch.config", covers=("LaunchConfig",))
def build_launch_config(draw, device):
    v = Validity()
    values = draw_config_fields(draw, v)
    return Call(lambda: LaunchConfig(**values), NAMES, check=lambda c: _check_config(c, values),
                valid=v.valid, why=v.why)  # fmt: skip


def draw_launch_text(draw, v: Validity) -> tuple[str, dict[str, object]]:
    """A REPLAYSSM_LAUNCH text and the fields it should parse to (marks what it breaks)."""
    items, values = [], {}
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["field", "field", "empty"]))
        if v.spend(draw):
            kind = draw(st.sampled_from(["unknown", "no-equals", "dup", "value"]))
        if kind == "empty":
            items.append(draw(st.sampled_from(["", " "])))
            continue
        if kind == "no-equals":
            items.append(draw(st.sampled_from(FIELDS)))
            v.mark(False, f"{items[-1]!r} without '='")
            continue
        if kind == "dup" and values:
            key = draw(st.sampled_from(sorted(values)))
        elif kind == "unknown":
            key = "kernels"
            v.mark(False, "an unknown field")
        else:
            key = draw(st.sampled_from(FIELDS))
        if key in values:
            v.mark(False, f"{key} twice")
        odd = kind == "value"
        if key in KERNEL_FIELDS:
            kernels = KERNEL_FIELDS[key]
            raw = draw(st.sampled_from(["fast", "", "Split"] if odd else [AUTO, *kernels]))
            ok, parsed = raw in (AUTO, *kernels), raw
        elif key in INT_FIELDS:
            good = ["4", "16", "08", AUTO, "99999999999999999999"]
            raw = draw(st.sampled_from(["0", "-4", "+4", "4.0", "²", ""] if odd else good))
            digits = raw.isascii() and raw.isdigit()
            parsed = int(raw) if digits else raw
            ok = raw == AUTO or (digits and int(raw) > 0)
        else:
            good = ["0", "1", "true", "FALSE", "True", AUTO]
            raw = draw(st.sampled_from(["yes", "2", ""] if odd else good))
            low = raw.lower()
            ok = low in ("0", "1", "true", "false", AUTO)
            parsed = AUTO if low == AUTO else low in ("1", "true")
        values[key] = parsed
        v.mark(ok, f"{key}={raw!r}")
        pad = draw(st.sampled_from(["", " "]))
        items.append(f"{pad}{key}{pad}={pad}{raw}")
    return ",".join(items), values


@entry("launch.parse", covers=("LaunchConfig",))
def build_parse_launch(draw, device):
    v = Validity()
    text, values = draw_launch_text(draw, v)
    source = draw(st.sampled_from([LAUNCH_ENV, "--launch"]))
    arg: object = text
    if v.spend(draw):
        arg = draw(st.sampled_from([None, 4, b"kernel=split", ["kernel=split"]]))
        v.mark(False, f"text {arg!r}")

    def check(config):
        _check_config(config, values)

    return Call(lambda: parse_launch(arg, source), {source}, check=check, valid=v.valid,
                why=v.why)  # fmt: skip


@entry("launch.resolve", covers=("LaunchConfig",))
def build_resolve_config(draw, device):
    v = Validity()
    how = draw(st.sampled_from(["none", "config", "config", "bad"]))
    given: dict[str, object] = {}
    if how == "config":
        inner = Validity()
        given = draw_config_fields(draw, inner)
        if inner.valid is not True:
            given = {}
        config = LaunchConfig(**given)
    elif how == "none":
        config = None
    else:
        config = draw(st.sampled_from(["kernel=split", {"kernel": "split"}, 0]))
        v.mark(False, f"config {config!r}")
    env = None
    if draw(st.booleans()):
        env, parsed = draw_launch_text(draw, v)
    else:
        parsed = {}

    def run():
        with EnvPatch({LAUNCH_ENV: env}):
            return resolve_config(config)

    def check(result):
        want = {n: given.get(n, AUTO) for n in FIELDS}
        for n in FIELDS:
            if want[n] == AUTO and env is not None and env.strip():
                want[n] = parsed.get(n, AUTO)
        _check_config(result, want)

    names = {"config", LAUNCH_ENV}
    return Call(run, names, check=check, valid=v.valid, why=v.why)
