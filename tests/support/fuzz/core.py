"""The fuzzing harness: a registry of public entries and the one property every call must keep.

An entry draws one call of a public function or method (its arguments, the objects the call
may touch, and what it knows about the arguments' validity) on a device. `check_call` runs it:

* it succeeds, and then the entry's `check` compares the result with the reference (the
  float64 oracles of replayssm_jit.reference, by relative error, or the documented rule);
* or it raises ValueError / TypeError whose message names the argument first
  (``name: expected ..., got ...``) and leaves everything the call could touch bit-identical.

Nothing else may escape: another exception type fails the test. Where the generator knows an
argument is bad (`Call.valid` False) the call must fail; where it knows every argument is good
(True) it must succeed. New ops join by registering an entry (`@entry("name", covers=...)`).
"""

from __future__ import annotations

import copy
import os
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st

from replayssm_jit.launch.environment import reload_launch_environment

DEVICES = ("cpu", "cuda")
# FUZZ_TRACE=1: print every fuzzed call's outcome (run pytest with -s).
TRACE = os.environ.get("FUZZ_TRACE") == "1"


@dataclass
class Call:
    """One drawn call.

    run: makes the call. names: what a clear error may name first (argument names, or e.g.
    "config.kernel"). watch: returns everything the call could change (tensors, free lists,
    plans), snapshotted before and compared after a failed call. check: the success check,
    given the result. valid: True (every argument good: must succeed), False (must fail), None
    (the generator cannot tell). why: the bad parts, for messages. clear: checks a raised
    error (default: `assert_clear` with `names`); errors: the exception types allowed.
    """

    run: Callable[[], object]
    names: Collection[str]
    watch: Callable[[], Mapping[str, object]] = dict
    check: Callable[[object], None] | None = None
    valid: bool | None = None
    why: str = ""
    clear: Callable[[BaseException], None] | None = None
    errors: tuple[type[BaseException], ...] = (ValueError, TypeError)


@dataclass(frozen=True)
class Entry:
    """A public entry: `build(draw, device)` draws one Call on `device`. covers: the public
    names (replayssm_jit.__all__, or "python -m replayssm_jit ...") its calls reach. weight:
    its share of the profile's max_examples."""

    name: str
    build: Callable[..., Call]
    devices: tuple[str, ...] = DEVICES
    covers: tuple[str, ...] = ()
    weight: float = 1.0


ENTRIES: dict[str, Entry] = {}
# (entry, "ok" | "error") -> calls made this session; tests/conftest.py prints them.
COUNTS: Counter = Counter()


def entry(name: str, *, covers: tuple[str, ...], devices: tuple[str, ...] = DEVICES,
          weight: float = 1.0):  # fmt: skip
    """Register `build(draw, device) -> Call` as the entry `name`."""

    def register(build):
        if name in ENTRIES:
            raise ValueError(f"entry {name!r} is registered twice")
        ENTRIES[name] = Entry(name, build, devices, tuple(covers), weight)
        return build

    return register


class Validity:
    """Collects what a generator knows about the arguments it drew (see Call.valid)."""

    def __init__(self) -> None:
        self.bad: list[str] = []
        self.unsure: list[str] = []
        self.budget: int | None = None

    def spend(self, draw) -> bool:
        """Whether to draw the next argument from its unusual values (bad ones, mostly): a call
        gets a drawn budget of zero to two, so that most arguments of a call are good and the
        call gets past the first check."""
        if self.budget is None:
            self.budget = draw(st.sampled_from([0, 1, 1, 2]))
        if self.budget and draw(st.integers(0, 2)) == 0:
            self.budget -= 1
            return True
        return False

    def mark(self, valid: bool | None, what: str) -> None:
        if valid is False:
            self.bad.append(what)
        elif valid is None:
            self.unsure.append(what)

    @property
    def valid(self) -> bool | None:
        if self.bad:
            return False
        return None if self.unsure else True

    @property
    def why(self) -> str:
        return "; ".join([*(f"bad {w}" for w in self.bad), *(f"unsure {w}" for w in self.unsure)])


# --- snapshots: bit-identical, NaN-aware ------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (NaN payloads, signed zeros and all)."""
    t = t.detach().contiguous().reshape(-1)
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    return t.view(torch.uint8)


def snapshot(values: Mapping[str, object]) -> dict[str, object]:
    """Copies of `values`: tensors cloned, containers deep-copied, other objects by identity."""
    snap = {}
    for name, v in values.items():
        if isinstance(v, torch.Tensor):
            data = v if v.device.type == "meta" else v.detach().clone()
            snap[name] = ("tensor", v, data, v.shape, v.stride(), v.dtype, v.device)
        elif isinstance(v, (list, dict, set, tuple, int, float, str, bool, type(None))):
            snap[name] = ("value", copy.deepcopy(v))
        else:
            snap[name] = ("object", v)
    return snap


def tensors_identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (torch.equal, and the bytes, so NaN equals NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.device.type == "meta" or b.device.type == "meta":
        return a.device == b.device  # (no data to compare)
    a, b = a.detach().cpu(), b.detach().cpu()
    if torch.equal(a, b):
        return True
    return torch.equal(_bits(a), _bits(b))


def assert_unchanged(before: dict[str, object], now: Mapping[str, object], what: str) -> None:
    assert set(before) == set(now), f"{what}: watched names changed"
    for name, snap in before.items():
        value = now[name]
        if snap[0] == "tensor":
            _, obj, data, shape, stride, dtype, device = snap
            assert value is obj, f"{what}: {name} was replaced"
            assert (value.shape, value.stride(), value.dtype, value.device) == (
                shape, stride, dtype, device,
            ), f"{what}: {name}'s metadata changed"  # fmt: skip
            assert tensors_identical(value, data), f"{what}: {name} changed"
        elif snap[0] == "value":
            assert value == snap[1], f"{what}: {name} changed from {snap[1]!r} to {value!r}"
        else:
            assert value is snap[1], f"{what}: {name} was replaced"


# --- what a clear error is ------------------------------------------------------------------

# Messages that name the argument and its actual value but word the expectation otherwise,
# from files this suite does not own (replayssm_jit/families/spec.py): accepted as they are.
_OTHER_WORDINGS = ("no row tiling fits",)


def assert_clear(exc: BaseException, names: Collection[str]) -> None:
    """`exc` names an argument of `names` first and says what was expected and what came."""
    msg = str(exc)
    head, sep, _ = msg.partition(":")
    assert sep and head in names, (
        f"{type(exc).__name__} does not name one of {sorted(names)}: {msg!r}"
    )
    worded = ("expected" in msg and "got" in msg) or "needs" in msg
    assert worded or any(w in msg for w in _OTHER_WORDINGS), f"no expected/actual value: {msg!r}"


def check_call(entry: Entry, call: Call) -> None:
    """The property: success that passes the entry's check, or a clear error that changed
    nothing; the generator's validity knowledge must hold either way."""
    before = snapshot(call.watch())
    try:
        result = call.run()
    except call.errors as exc:
        COUNTS[entry.name, "error"] += 1
        if TRACE:
            print(
                f"[fuzz] {entry.name}: {type(exc).__name__}: {exc} (valid={call.valid}; {call.why})"
            )
        assert call.valid is not True, f"{entry.name}: a valid call raised {exc!r} ({call.why})"
        (call.clear or (lambda e: assert_clear(e, call.names)))(exc)
        assert_unchanged(before, call.watch(), f"{entry.name} after {type(exc).__name__}({exc})")
        return
    COUNTS[entry.name, "ok"] += 1
    if TRACE:
        print(f"[fuzz] {entry.name}: ok (valid={call.valid}; {call.why})")
    assert call.valid is not False, f"{entry.name}: accepted a bad call ({call.why})"
    if call.check is not None:
        call.check(result)


def cuda_usable() -> bool:
    return torch.cuda.is_available()


@dataclass
class EnvPatch:
    """Environment variables set for the span of a `with` block (and restored after); the
    launch variables are read again on entry and exit (launch/environment.py reads them once)."""

    values: dict[str, str | None] = field(default_factory=dict)

    def __enter__(self):
        self._old = {k: os.environ.get(k) for k in self.values}
        for k, v in self.values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        reload_launch_environment()
        return self

    def __exit__(self, *exc):
        for k, v in self._old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        reload_launch_environment()
