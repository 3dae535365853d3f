"""Each op's arguments are declared once (families/schema.py): the rendered bindings, the public
Python signatures and the torch.library schemas all agree with it, and so do the flag bits of
Python and CUDA."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
import torch

from replayssm_jit import commit_drafts, gdn_layout, kda_layout, mamba2_layout, plan_decode
from replayssm_jit.core import launch_flags
from replayssm_jit.families import FAMILIES, get_family
from replayssm_jit.families.schema import (
    BINDINGS,
    COMMIT_DRAFTS_ARGS,
    OPS,
    SEED,
    bind,
    binding_params,
    expected_shape,
    op_args,
)
from replayssm_jit.jit import build
from replayssm_jit.jit.presets import PRESETS, preset_specs
from replayssm_jit.launch import policy
from replayssm_jit.ops import library
from replayssm_jit.ops.registry import family_ops

# The public op of each family and op name (ops/registry.py).
FUNCTIONS = {f"{f.name}_{op}": getattr(family_ops(f), op) for f in FAMILIES.values() for op in OPS}


def _specs():
    """One spec per family with drafts (every binding) and one with a read copy, from the CI
    and h200 presets."""
    specs = preset_specs(["ci", "h200"], PRESETS)
    picked = {}
    for spec in specs:
        picked.setdefault((spec.family, spec.has_verify, spec.read_dtype is not None), spec)
    return list(picked.values())


def _rendered_params(text: str, binding: str) -> list[tuple[str, str]] | None:
    """(C++ type, name) of each parameter of `binding` in the rendered source."""
    found = re.search(rf"^(?:void|Params|int64_t) {binding}\((.*?)\) \{{", text, re.S | re.M)
    if found is None:
        return None
    parts = [" ".join(p.split()) for p in found.group(1).split(",")]
    return [tuple(p.rsplit(" ", 1)) for p in parts]


@pytest.mark.parametrize("spec", _specs(), ids=lambda s: s.uri)
def test_every_binding_renders_the_schemas_parameters(spec):
    fam = get_family(spec.family)
    text = build.render(spec)
    for binding in BINDINGS:
        got = _rendered_params(text, binding)
        if got is None:  # (the draft bindings exist only in modules with drafts)
            assert (
                binding in ("verify_step", "snapshot_step", "commit_step") and not spec.has_verify
            )
            continue
        assert got == [(p.cpp, p.name) for p in binding_params(fam, binding)], binding


def test_the_flag_bits_are_defined_once_and_rendered_into_every_module():
    header = (build.template_root() / "common" / "launch.cuh").read_text()
    assert not re.search(r"constexpr\s+\w+\s+kFlag", header)  # (only the rendered ones)
    python = {n: getattr(launch_flags, n) for n in dir(launch_flags) if n.startswith("FLAG_")}
    assert sorted(python.values()) == [bit for _, bit, _ in launch_flags.LAUNCH_FLAGS]
    assert all(getattr(policy, n) == bit for n, bit in python.items())
    for spec in _specs():
        rendered = dict(re.findall(r"constexpr int64_t (kFlag\w+) = (\d+);", build.render(spec)))
        assert rendered == {name: str(bit) for name, bit, _ in launch_flags.LAUNCH_FLAGS}
        for name in re.findall(r"\bkFlag\w+", build.render(spec)):
            assert name in rendered, name  # every flag a module tests is a defined one


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("op", OPS)
def test_the_public_ops_take_the_schemas_arguments(family, op):
    """The Python signature (kept for readers and type checkers) names what the schema declares;
    out is optional there, as the Python op allocates it."""
    fn = FUNCTIONS[f"{family}_{op}"]
    params = list(inspect.signature(fn).parameters.values())[1:]
    declared = op_args(get_family(family), op)
    assert {p.name for p in params} == {p.name for p in declared}
    for p in params:
        spec = next(d for d in declared if d.name == p.name)
        required = not (spec.optional or spec is SEED or spec.name == "out")
        assert (p.default is inspect.Parameter.empty) == required, p.name
        assert p.kind is inspect.Parameter.KEYWORD_ONLY, p.name


def test_the_custom_ops_bind_by_name_only():
    """Every custom op's arguments after the plan are keyword-only, with the schema's names."""
    for name, packet in library.OPS.items():
        schema = packet.default._schema
        assert [a.kwarg_only for a in schema.arguments] == [False] + [True] * (
            len(schema.arguments) - 1
        ), name
        if name == "commit_drafts":
            assert {a.name for a in schema.arguments[1:]} == {p.name for p in COMMIT_DRAFTS_ARGS}


def test_bind_takes_each_argument_by_name_and_names_a_missing_one():
    fam = get_family("gdn")
    values = {p.name: p.name for p in binding_params(fam, "replay_step")}
    assert bind(fam, "replay_step", values) == [p.name for p in binding_params(fam, "replay_step")]
    # Optional parameters left out bind as None; a required one left out is an error.
    values.pop("rec_v")
    assert None in bind(fam, "replay_step", values)
    values.pop("cursors")
    with pytest.raises(KeyError, match="replay_step: expected a value for 'cursors'"):
        bind(fam, "replay_step", values)


class Recorder:
    """A stand-in module: each binding checks its positional arguments against the schema's
    parameter types (what tvm-ffi would convert) and records the call."""

    def __init__(self, family):
        self.family, self.calls = family, []

    def __getattr__(self, binding):
        params = binding_params(self.family, binding)

        def call(*args):
            assert len(args) == len(params), binding
            for p, value in zip(params, args):
                want = {"int64_t": int, "double": float}.get(p.cpp, torch.Tensor)
                assert isinstance(value, want) or (p.optional and value is None), (binding, p)
            self.calls.append(binding)

        return call


def _as_cuda_path(plan):
    """`plan` as the CUDA backend would hold it, its module a Recorder (the ops' CUDA branch
    run on CPU tensors)."""
    return dataclasses.replace(plan, backend="cuda", module=Recorder(plan.family))


SHAPES = {
    "mamba2": (mamba2_layout, dict(num_heads=4, headdim=16, dstate=16, ngroups=2)),
    "gdn": (gdn_layout, dict(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16)),
    "kda": (kda_layout, dict(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16)),
}


def _token_inputs(fam, plan, lead, gen):
    """Random token inputs of the shapes the schema declares, those the plan takes."""
    shape, flags = plan.layout.shape, plan.spec.flags
    given = {}
    for arg in fam.inputs:
        if arg.present(flags):
            dtype = plan.layout.act_dtype if arg.dtype == "act" else torch.float32
            size = expected_shape(arg, shape, lead)
            given[arg.name] = (0.1 * torch.randn(size, generator=gen)).to(dtype)
    return given


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_the_cuda_path_passes_each_binding_its_parameters(family, monkeypatch):
    """decode (replay and conventional), verify, commit and the snapshot verify, run through
    the ops' CUDA branch with a Recorder for the module: every binding gets its schema's
    parameters, in number and type."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # (no GPU here)
    fam, gen = get_family(family), torch.Generator().manual_seed(0)
    make_layout, dims = SHAPES[family]
    layout = make_layout(**dims, window=4, drafts=2, act_dtype=torch.float32)
    slots, batch = 5, 3
    pool = {t.name: torch.zeros(t.shape(slots), dtype=t.dtype) for t in layout.tensors()}
    ids = torch.tensor([3, 0, 1], dtype=torch.int32)
    for mode in ("replay", "conventional"):
        plan = _as_cuda_path(plan_decode(layout, batch, device="cpu", mode=mode))
        given = {**pool} if mode == "replay" else {"state": pool["state"]}
        FUNCTIONS[f"{family}_decode"](plan, **given, **_token_inputs(fam, plan, (batch,), gen),
                                      slot_indices=ids)  # fmt: skip
        assert plan.module.calls == [f"{mode}_step"]
    plan = _as_cuda_path(plan_decode(layout, batch, device="cpu"))
    FUNCTIONS[f"{family}_verify"](plan, **pool, **_token_inputs(fam, plan, (batch, 2), gen),
                                  slot_indices=ids)  # fmt: skip
    commit_drafts(plan, **pool, num_accepted=torch.zeros(3, dtype=torch.int32),
                  slot_indices=ids)  # fmt: skip
    snapshot = torch.tensor([[2, 4]] * 3, dtype=torch.int32)  # (slots no row holds)
    FUNCTIONS[f"{family}_snapshot_verify"](
        plan, state=pool["state"], **_token_inputs(fam, plan, (batch, 2), gen), slot_indices=ids,
        snapshot_slots=snapshot, num_drafts=torch.tensor([1, 0, 0], dtype=torch.int32),
    )  # fmt: skip
    assert plan.module.calls == ["verify_step", "commit_step", "snapshot_step"]
