"""JIT core on the CPU: specs, URIs, rendering, compile-only builds, AOT, disable-JIT, the
module's split workspace size."""

import json
import subprocess
import sys

import pytest
import torch
from support.aot_presets import every_preset

from replayssm_jit import mamba2_layout, plan_decode
from replayssm_jit.core.dtypes import CHUNK_VALUES
from replayssm_jit.core.tiles import rows_tilings
from replayssm_jit.families import MAMBA2, HeadShape, get_family
from replayssm_jit.families.spec import (
    KernelSpec,
    family_spec,
    kda_spec,
    make_spec,
    mamba2_spec,
    spec_tilings,
)
from replayssm_jit.jit import build, env
from replayssm_jit.jit.presets import preset_specs
from replayssm_jit.launch.policy import can_split

PRESETS = every_preset()


def test_uri_is_readable_and_unique():
    a = mamba2_spec(headdim=64, dstate=128, heads_per_group=16, window=16)
    b = mamba2_spec(headdim=64, dstate=128, heads_per_group=16, window=8)
    assert a.uri == "mamba2_p64_n128_hpg16_L16_T1_act-bf16_state-f32_d_dt_bias_dt_softplus"
    assert a.uri != b.uri
    assert a == mamba2_spec(headdim=64, dstate=128, heads_per_group=16, window=16)
    assert a.capacity == 17


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(window=0), ValueError, "window"),
        (dict(state_dtype=torch.float64), TypeError, "state_dtype"),
        (dict(flags=("bogus",)), ValueError, "flags"),
        (dict(flags=("sr",)), ValueError, "sr"),
        (dict(dstate=12), ValueError, "dstate"),
        (dict(headdim=3, state_dtype=torch.bfloat16), ValueError, "headdim"),
    ],
)
def test_spec_rejects_bad_arguments(kwargs, error, match):
    base = dict(headdim=64, dstate=128, heads_per_group=16)
    with pytest.raises(error, match=match):
        mamba2_spec(**{**base, **kwargs})


def test_unknown_family():
    with pytest.raises(ValueError, match="family"):
        KernelSpec("mamba3", (("p", 1),), 1, 1, "f32", "f32")
    with pytest.raises(ValueError, match=r"^family: expected one of \['gdn', 'kda', 'mamba2'\]"):
        get_family("mamba3")
    assert get_family("mamba2") is MAMBA2 and get_family(MAMBA2) is MAMBA2


def test_make_spec_takes_a_head_shape_and_keeps_the_uris():
    """make_spec (from a layer's HeadShape: only the heads' ratio enters the spec) gives the same
    spec and URI as the per-family helpers; the 16-byte and tiling checks live there."""
    shape = HeadShape(key_heads=8, value_heads=128, key_dim=128, value_dim=64)
    spec = make_spec("mamba2", shape, window=16)
    assert spec == mamba2_spec(headdim=64, dstate=128, heads_per_group=16, window=16)
    assert spec == family_spec("mamba2", headdim=64, dstate=128, heads_per_group=16)
    assert spec.uri == "mamba2_p64_n128_hpg16_L16_T1_act-bf16_state-f32_d_dt_bias_dt_softplus"
    assert spec.state_rows_cols == (64, 128)
    assert make_spec("mamba2", HeadShape(1, 16, 128, 64)) == spec
    with pytest.raises(ValueError, match=r"^dstate: expected a multiple of 8 up to 1024, got 12$"):
        make_spec("mamba2", HeadShape(8, 128, 12, 64))
    with pytest.raises(ValueError, match=r"^headdim: no row tiling fits headdim=3"):
        make_spec("mamba2", HeadShape(8, 128, 128, 3), state_dtype="bf16")
    with pytest.raises(TypeError, match=r"missing \['heads_per_group'\] and unknown \['ngroups'\]"):
        family_spec("mamba2", headdim=64, dstate=128, ngroups=8)


def test_tilings_cover_model_shapes():
    assert rows_tilings(64, 128, CHUNK_VALUES["f32"])[0] == (64, 4)
    assert rows_tilings(80, 128, CHUNK_VALUES["f32"])[0] == (80, 8)
    assert spec_tilings(mamba2_spec(headdim=80, dstate=128, heads_per_group=12))[0] == (80, 8)
    for rows, warps in rows_tilings(80, 128, CHUNK_VALUES["bf16"]):
        assert 80 % rows == 0 and rows % warps == 0


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_spec_renders(preset):
    """Mamba-2 specs here; the GDN ones in test_gdn_cpu.py."""
    for spec in preset_specs([preset], PRESETS):
        if spec.family != "mamba2":
            continue
        text = build.render(spec)
        assert spec.uri in text
        assert "TVM_FFI_DLL_EXPORT_TYPED_FUNC(replay_step" in text
        assert f"constexpr int kL = {spec.window}" in text
        for rows, _ in spec_tilings(spec):
            assert f"case {rows}:" in text
        assert "{{" not in text and "{%" not in text


def test_write_if_different(tmp_path):
    path = tmp_path / "a.cu"
    assert build.write_if_different(path, "x")
    mtime = path.stat().st_mtime_ns
    assert not build.write_if_different(path, "x")
    assert path.stat().st_mtime_ns == mtime
    assert build.write_if_different(path, "y") and path.read_text() == "y"


def test_arch_list(monkeypatch):
    monkeypatch.setenv("REPLAYSSM_CUDA_ARCH_LIST", "8.0 9.0a")
    assert env.cuda_arch_list() == ["8.0", "9.0a"]
    assert env.gencode_flags(["9.0a"]) == ["-gencode=arch=compute_90a,code=sm_90a"]
    monkeypatch.setenv("REPLAYSSM_CUDA_ARCH_LIST", "hopper")
    with pytest.raises(ValueError, match="REPLAYSSM_CUDA_ARCH_LIST"):
        env.cuda_arch_list()
    monkeypatch.delenv("REPLAYSSM_CUDA_ARCH_LIST")
    if not torch.cuda.is_available():
        assert env.cuda_arch_list() == ["9.0a"]


def test_disable_jit_names_the_missing_spec(jit_cache, monkeypatch):
    monkeypatch.setenv("REPLAYSSM_DISABLE_JIT", "1")
    spec = mamba2_spec(headdim=64, dstate=128, heads_per_group=16, window=4)
    with pytest.raises(build.JITDisabledError, match=spec.uri):
        build.load_module(spec)
    assert not (jit_cache / "build" / spec.uri).exists(), "nothing may be compiled"


@pytest.mark.nvcc
def test_aot_round_trip_compiles_and_loads(jit_cache, aot_split_modules, monkeypatch):
    """nvcc builds a real sm_90a specialization; with JIT disabled the loader finds and loads it."""
    aot, modules = aot_split_modules
    spec, so_path = modules["mamba2"]
    assert spec == preset_specs(["ci"])[0]
    assert so_path == aot / spec.uri / f"{spec.uri}.so" and so_path.stat().st_size > 100_000
    manifest = json.loads((aot / spec.uri / "manifest.json").read_text())
    assert manifest["uri"] == spec.uri and manifest["archs"] == ["9.0a"]
    assert b"sm_90a" in so_path.read_bytes() or b"sm_90" in so_path.read_bytes()

    monkeypatch.setenv("REPLAYSSM_AOT_DIR", str(aot))
    monkeypatch.setenv("REPLAYSSM_DISABLE_JIT", "1")
    assert build.find_prebuilt(spec) == so_path
    module = build.load_module(spec)  # loading needs only the CUDA runtime library, not a GPU
    assert callable(module.replay_step) and callable(module.conventional_step)
    assert build.load_module(spec) is module  # memoized
    assert not (jit_cache / "build").exists(), "the JIT cache must not be used"


@pytest.mark.nvcc
def test_kda_module_compiles_and_loads(jit_cache, tmp_path, monkeypatch):
    """A KDA spec (GDN's templates with a decay per key channel) compiles for sm_90a and loads
    with its conventional and ReplaySSM steps, and its split step's workspace holds per (row,
    value head) the row sums, the per-channel vectors and a flush's decayed k rows."""
    from replayssm_jit.jit.aot import build_aot

    spec = kda_spec(head_k_dim=32, head_v_dim=32, value_heads_per_key_head=2, window=4)
    assert spec.template_context()["decay_per_channel"]
    monkeypatch.setenv("REPLAYSSM_CACHE_DIR", str(tmp_path / "aot-build-cache"))
    build_aot([spec], tmp_path / "aot", jobs=1, archs=["9.0a"])
    monkeypatch.setenv("REPLAYSSM_AOT_DIR", str(tmp_path / "aot"))
    monkeypatch.setenv("REPLAYSSM_DISABLE_JIT", "1")
    module = build.load_module(spec)
    assert callable(module.conventional_step) and callable(module.replay_step)
    K = V = 32
    cap = spec.capacity
    extra = 2 * V + 3 * K + (cap - 1) * K  # pred, osum | total q, total k, total | decayed k rows
    assert module.split_workspace_floats(8, 4) == 8 * (4 * (extra + 5 + cap) + 4)
    with pytest.raises(AttributeError):
        module.verify_step  # noqa: B018


def _templates_export(name: str) -> bool:
    """Whether a module template exports `name` (the modules' bindings are exported there)."""
    return any(
        f"TVM_FFI_DLL_EXPORT_TYPED_FUNC({name}," in path.read_text()
        for path in build.template_root().rglob("*.jinja")
    )


@pytest.mark.nvcc
@pytest.mark.xfail(
    not _templates_export("split_workspace_floats"),
    reason="the modules' split_workspace_floats export is not in the templates yet",
    raises=AttributeError,
    strict=False,
)
@pytest.mark.parametrize("family", ["mamba2", "gdn"])
def test_split_workspace_floats_from_the_module(jit_cache, aot_split_modules, monkeypatch, family):
    """plan() sizes the split step's workspace from the module: per batch row, the records
    kernel's extra sums [heads, EXTRA], SCALARS per head, the coefficients [heads, CAP] and an
    info block of 4 (Mamba-2: EXTRA = P, 1 scalar; GDN: pred and osum, EXTRA = 2 V, 5 scalars)."""
    aot, modules = aot_split_modules
    spec, _ = modules[family]
    assert can_split(spec)
    monkeypatch.setenv("REPLAYSSM_AOT_DIR", str(aot))
    monkeypatch.setenv("REPLAYSSM_DISABLE_JIT", "1")
    module = build.load_module(spec)
    rows, _ = spec.state_rows_cols  # P (Mamba-2) or V (GDN)
    extra, scalars = (rows, 1) if family == "mamba2" else (2 * rows, 5)
    for batch, heads in ((1, 16), (3, 128), (256, 32)):  # multiples of heads per key head
        want = batch * (heads * (extra + scalars + spec.capacity) + 4)
        assert module.split_workspace_floats(batch, heads) == want, (spec.uri, batch, heads)


def test_cpu_plan_loads_nothing(jit_cache, monkeypatch):
    """plan() on a CPU device picks the PyTorch path: no module is built or loaded (even with JIT
    disabled and no AOT build), and the step needs no workspace."""
    monkeypatch.setenv("REPLAYSSM_DISABLE_JIT", "1")
    layout = mamba2_layout(num_heads=128, headdim=64, dstate=128, ngroups=8, window=16)
    for mode in ("replay", "conventional"):
        plan = plan_decode(layout, 256, device="cpu", mode=mode)
        assert plan.backend == "cpu" and plan.module is None and plan.workspace_floats == 0
        assert plan.spec.window == (16 if mode == "replay" else 1)
    assert not build._LOADED and not jit_cache.exists()


@pytest.mark.nvcc
def test_stale_aot_module_is_not_used(jit_cache, tmp_path, monkeypatch):
    spec = preset_specs(["ci"])[0]
    folder = tmp_path / "aot" / spec.uri
    folder.mkdir(parents=True)
    (folder / f"{spec.uri}.so").write_bytes(b"not a module")
    (folder / "manifest.json").write_text(json.dumps({"uri": spec.uri, "digest": "old"}))
    monkeypatch.setenv("REPLAYSSM_AOT_DIR", str(tmp_path / "aot"))
    assert build.find_prebuilt(spec) is None


def test_aot_cli_takes_a_list_of_specs(capsys):
    from replayssm_jit.cli.aot import main as aot_main

    spec = "mamba2:headdim=64,dstate=128,heads_per_group=16,window=8,state_dtype=bf16,flags=d+dt_softplus"
    assert (
        aot_main(
            [
                "--spec",
                spec,
                "--spec",
                "gdn:head_k_dim=64,head_v_dim=64,value_heads_per_key_head=2",
                "--list",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.split() == [
        "mamba2_p64_n128_hpg16_L8_T1_act-bf16_state-bf16_d_dt_softplus",
        "gdn_k64_v64_vph2_L16_T1_act-bf16_state-f32_gates_in_kernel_qk_l2norm",
    ]
    for bad, message in (
        (["--spec", "mamba3:headdim=1"], "--spec: expected FAMILY:key=value"),
        (["--spec", "mamba2:headdim"], "--spec: expected key=value"),
        (["--spec", "mamba2:headdim=64,dstate=12,heads_per_group=2"], "dstate"),
        (["--preset", "bogus"], "invalid choice: 'bogus'"),
        (["--jobs", "0"], "--jobs: expected >= 1"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            aot_main([*bad, "--list"])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "usage:" in err and message in err and "Traceback" not in err


@pytest.mark.parametrize(
    "command, prog",
    [
        (["replayssm_jit", "aot"], "python -m replayssm_jit aot"),
        (["replayssm_jit", "aot", "wheel"], "python -m replayssm_jit aot wheel"),
    ],
)
def test_aot_entry_point_rejects_a_bogus_preset(command, prog):
    """`python -m replayssm_jit aot --preset bogus` (and `aot wheel`): an argparse error (exit 2, usage and the message on stderr),
    not a traceback."""
    run = subprocess.run(
        [sys.executable, "-m", *command, "--preset", "bogus", "--list"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2, run
    assert f"usage: {prog}" in run.stderr
    assert "--preset: invalid choice: 'bogus'" in run.stderr
    assert "Traceback" not in run.stderr and not run.stdout


@pytest.mark.nvcc
@pytest.mark.parametrize("family", ["mamba2", "gdn"])
def test_verify_modules_compile_and_export_the_speculative_steps(family, jit_cache, tmp_path,
                                                                 monkeypatch):  # fmt: skip
    """A spec with drafts (T = 2) compiles its verify, snapshot and commit kernels for sm_90a
    and loads with every binding; with T = 1 it has none of them."""
    from replayssm_jit.families.spec import family_spec
    from replayssm_jit.jit.aot import build_aot

    dims = {
        "mamba2": dict(headdim=16, dstate=32, heads_per_group=2),
        "gdn": dict(head_k_dim=32, head_v_dim=32, value_heads_per_key_head=2),
    }[family]
    spec = family_spec(family, window=4, drafts=2, **dims)
    assert spec.has_verify and not family_spec(family, window=4, drafts=1, **dims).has_verify
    monkeypatch.setenv("REPLAYSSM_CACHE_DIR", str(tmp_path / "aot-build-cache"))
    build_aot([spec], tmp_path / "aot", jobs=1, archs=["9.0a"])
    monkeypatch.setenv("REPLAYSSM_AOT_DIR", str(tmp_path / "aot"))
    monkeypatch.setenv("REPLAYSSM_DISABLE_JIT", "1")
    module = build.load_module(spec)
    for name in ("verify_step", "snapshot_step", "commit_step", "replay_step"):
        assert callable(getattr(module, name)), name
