"""Fuzzing every public entry (hypothesis, issue 21 section 1).

Each fuzzed call either succeeds and matches the reference (the float64 oracles of
replayssm_jit.reference, by relative error, and the documented cursor, ring and pad rules), or
raises a ValueError/TypeError whose message names the argument with the expected and the actual
value, and changes nothing (every tensor of the cache, bit for bit, NaN-aware). NaN/Inf inputs
stay inside their own batch row. The command lines (`python -m replayssm_jit demo|aot`, called
in-process with the work stubbed out) end a bad argument list as argparse does: SystemExit(2)
with the usage and an "error:" line on stderr, which is a clear error for a command line.

The entries and the property are in tests/fuzz/ (a new op joins by registering an entry); the
profiles in tests/conftest.py: "ci" by default, "long" with HYPOTHESIS_PROFILE=long. The session
summary prints how many calls each entry made. FUZZ_TRACE=1 (with -s) prints every call.
"""

from __future__ import annotations

import fuzz
import pytest
import torch
from fuzz.core import check_call
from hypothesis import given, settings
from hypothesis import strategies as st

import replayssm_jit
from replayssm_jit.families.base import HeadShape
from replayssm_jit.spec import KernelSpec, make_spec

CPU = sorted(name for name, e in fuzz.ENTRIES.items() if "cpu" in e.devices)
CUDA = sorted(name for name, e in fuzz.ENTRIES.items() if "cuda" in e.devices)


def _fuzz(name: str, device: str) -> None:
    e = fuzz.ENTRIES[name]
    examples = max(1, round(settings().max_examples * e.weight))

    @settings(max_examples=examples)
    @given(data=st.data())
    def prop(data):
        check_call(e, e.build(data.draw, device))

    prop()


@pytest.mark.parametrize("name", CPU)
def test_entry_on_cpu(name, no_launch_env):
    _fuzz(name, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("name", CUDA)
def test_entry_on_cuda(name, no_launch_env):
    """The same entries on CUDA tensors: the kernels (JIT-built with nvcc, or the AOT
    `sanitizer` preset's modules, whose shapes, windows, dtypes and flags the decode and plan
    entries keep to on CUDA)."""
    assert torch.cuda.is_available()
    _fuzz(name, "cuda")


def test_every_public_entry_is_fuzzed():
    """Each name of replayssm_jit.__all__ (and each command) is reached by some entry."""
    covered = {c for e in fuzz.ENTRIES.values() for c in e.covers}
    commands = {"python -m replayssm_jit", "python -m replayssm_jit demo",
                "python -m replayssm_jit aot"}  # fmt: skip
    missing = sorted(set(replayssm_jit.__all__) - covered) + sorted(commands - covered)
    assert not missing, f"public entries no fuzz entry covers: {missing}"
    assert all(e.devices for e in fuzz.ENTRIES.values())


# Found by the fuzzing: flags given as a str were taken as its characters ("dz" was ("d", "z")),
# a non-iterable's TypeError named nothing, and a KernelSpec built directly took any flags.
@pytest.mark.parametrize("flags", ["dz", 5])
def test_make_spec_names_flags_of_a_wrong_type(flags):
    with pytest.raises((TypeError, ValueError), match="^flags: "):
        make_spec("mamba2", HeadShape(2, 4, 16, 16), flags=flags)


def test_kernel_spec_rejects_unknown_flags():
    with pytest.raises(ValueError, match="^flags: "):
        KernelSpec("mamba2", (("p", 16), ("n", 16), ("hpg", 2)), 4, 1, "bf16", "f32", ("bogus",))
