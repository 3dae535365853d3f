"""The `replayssm-jit-cache` wheel (`python -m replayssm_jit aot wheel`): built from the `ci`
preset with nvcc for sm_90a and sm_100a, installed by pip into a fresh venv, and its module loaded
from that venv with JIT disabled for sm_90a alone; and, on the CPU alone, its name (CUDA and arch
label, manylinux tag from the modules' ELF version needs) and the loader's refusal of a cache
package of another version.

The nvcc wheel test compiles the `ci` preset's one module for two archs (about 80 s of CPU on this
project's 2-core CI machine) and packages it (about 10 s); the CPU packaging test takes about 10 s.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from replayssm_jit import __version__
from replayssm_jit.jit import build, env, wheel
from replayssm_jit.jit.presets import preset_specs

# Runs in the fresh venv: load the `ci` module and report which file of it the process mapped.
_LOAD_AND_REPORT = """
import json
import replayssm_jit_cache
from replayssm_jit.jit.presets import preset_specs
from replayssm_jit.jit.build import load_module

(spec,) = preset_specs(["ci"])
module = load_module(spec)
with open("/proc/self/maps") as maps:
    fields = [line.split(maxsplit=5) for line in maps]
mapped = sorted({f[5].strip() for f in fields if len(f) == 6 and f[5].strip().endswith(".so")})
print(json.dumps({
    "package": replayssm_jit_cache.__file__,
    "mapped": [path for path in mapped if path.endswith(f"/{spec.uri}.so")],
    "exports_replay_step": callable(module.replay_step),
}))
"""


def _run(command: list, env_vars: dict, what: str) -> subprocess.CompletedProcess:
    run = subprocess.run(
        [str(part) for part in command], env=env_vars, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, f"{what} failed ({run.returncode}):\n{run.stdout}\n{run.stderr}"
    return run


def _fresh_venv(root: Path) -> Path:
    """A new venv (no pip of its own) that sees this interpreter's site-packages after its own,
    so torch, pip and this replayssm_jit need no reinstall; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    own_site = _run([python, "-c", "import sysconfig; print(sysconfig.get_path('platlib'))"],
                    os.environ.copy(), "asking the venv for its site-packages").stdout.strip()  # fmt: skip
    # addsitedir (not a bare path line) so that our site-packages' own .pth files, such as the
    # editable install's, are processed too.
    outer = [p for p in site.getsitepackages() if Path(p).is_dir()]
    Path(own_site, "_outer_site_packages.pth").write_text(
        f"import site; list(map(site.addsitedir, {outer!r}))\n"
    )
    return python


@pytest.mark.nvcc
def test_ci_wheel_installs_into_a_fresh_venv_and_loads_with_jit_disabled(tmp_path):
    specs = preset_specs(["ci"])
    assert len(specs) == 1, "the ci preset grew: build one of its specs here (--spec) to stay fast"
    spec = specs[0]
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAYSSM_")}

    # Build for two archs; the loader below asks for one of them.
    dist = tmp_path / "dist"
    build_env = {**base_env, "REPLAYSSM_CACHE_DIR": str(tmp_path / "build-cache"),
                 "REPLAYSSM_CUDA_ARCH_LIST": "10.0a 9.0a"}  # fmt: skip
    built = _run([sys.executable, "-m", "replayssm_jit", "aot", "wheel", "--preset", "ci",
                  "--out", dist], build_env, "building the wheel")  # fmt: skip
    (whl,) = dist.iterdir()
    assert built.stdout.strip() == str(whl)
    version = f"{__version__}+cu{wheel.cuda_version().replace('.', '')}.sm90a.sm100a"
    assert re.fullmatch(
        rf"replayssm_jit_cache-{re.escape(version)}-py3-none-manylinux_2_\d+_{platform.machine()}\.whl",
        whl.name,
    ), whl.name
    assert "AOT: 100%" in built.stderr, "the build shows a progress bar"

    # Install with pip, offline, checking its pin on this replayssm_jit: not --no-deps.
    python = _fresh_venv(tmp_path / "venv")
    installed = _run([python, "-m", "pip", "install", "--no-index", whl], base_env,
                     "pip install of the wheel")  # fmt: skip
    assert f"Successfully installed replayssm-jit-cache-{version}" in installed.stdout

    # Load with JIT disabled, an empty JIT cache and no AOT directory: only the wheel can serve.
    jit_cache = tmp_path / "empty-jit-cache"
    jit_cache.mkdir()
    load_env = {**base_env, "REPLAYSSM_DISABLE_JIT": "1", "REPLAYSSM_CACHE_DIR": str(jit_cache),
                "REPLAYSSM_AOT_DIR": "", "REPLAYSSM_CUDA_ARCH_LIST": "9.0a"}  # fmt: skip
    loaded = _run([python, "-c", _LOAD_AND_REPORT], load_env, "loading from the wheel")
    report = json.loads(loaded.stdout.strip().splitlines()[-1])
    venv_site = Path(report["package"]).resolve().parent.parent
    assert venv_site.is_relative_to((tmp_path / "venv").resolve()), report
    module_in_wheel = venv_site / "replayssm_jit_cache" / "modules" / spec.uri / f"{spec.uri}.so"
    assert [Path(p).resolve() for p in report["mapped"]] == [module_in_wheel], report
    assert report["exports_replay_step"]
    assert not any(jit_cache.iterdir()), "the JIT cache must not be used"
    assert whl.name.endswith(f"-{wheel.platform_tag([module_in_wheel])}.whl")


@pytest.fixture
def cache_package_of_version(tmp_path, monkeypatch):
    """Install (on sys.path) a `replayssm_jit_cache` package of the version given, with no
    modules; returns a function making it."""

    def make(version: str | None) -> Path:
        package = tmp_path / "site" / env.CACHE_PACKAGE
        (package / "modules").mkdir(parents=True)
        assigned = "" if version is None else f"__version__ = {version!r}\n"
        (package / "__init__.py").write_text(assigned)
        monkeypatch.syspath_prepend(str(tmp_path / "site"))
        return package

    monkeypatch.delitem(sys.modules, env.CACHE_PACKAGE, raising=False)
    yield make
    sys.modules.pop(env.CACHE_PACKAGE, None)


@pytest.mark.parametrize("label", ["", "+cu130.sm90a", "+cu129.sm90a.sm100a"])
def test_cache_package_of_this_version_is_searched(jit_cache, cache_package_of_version, label):
    """The wheel's version is ours plus a local label naming its CUDA and archs."""
    package = cache_package_of_version(__version__ + label)
    assert env.cache_package() == ([package / "modules"], None)
    assert env.aot_dirs() == [package / "modules"]


@pytest.mark.parametrize("version", ["0.0.1", "0.0.1+cu130.sm90a", f"{__version__}.post1", None])
def test_cache_package_of_another_version_is_refused(
    jit_cache, cache_package_of_version, monkeypatch, caplog, version
):
    """A wheel built from other templates is not searched, and the refusal is logged and named
    in the error raised with JIT disabled."""
    package = cache_package_of_version(version)
    dirs, problem = env.cache_package()
    assert dirs == [] and env.aot_dirs() == []
    found = "records no __version__" if version is None else f"is version {version!r}"
    assert f"{found}, expected {__version__!r} (with any local label)" in problem
    assert str(package) in problem and f"replayssm-jit-cache=={__version__}" in problem

    monkeypatch.setenv("REPLAYSSM_DISABLE_JIT", "1")
    build._WARNED_PACKAGES.clear()
    (spec,) = preset_specs(["ci"])
    with caplog.at_level(logging.WARNING, logger="replayssm_jit"):
        for _ in range(2):
            with pytest.raises(build.JITDisabledError) as error:
                build.load_module(spec)
            assert f"Refused: {problem}." in str(error.value)
    assert [r.getMessage() for r in caplog.records] == [f"skipping AOT modules: {problem}"]


def test_wheel_command_lists_and_rejects_bad_arguments(capsys, monkeypatch, tmp_path):
    """The wheel command's options are the folder build's; usage errors come before any build."""
    from replayssm_jit.cli.aot import main as aot_main

    monkeypatch.delenv("REPLAYSSM_CUDA_ARCH_LIST", raising=False)
    assert aot_main(["wheel", "--preset", "ci", "--list"]) == 0
    assert capsys.readouterr().out.split() == [preset_specs(["ci"])[0].uri]
    monkeypatch.setattr("importlib.metadata.version", lambda name: "65.5.0")
    for bad, message in (
        (["--preset", "ci"], "the following arguments are required: --out"),
        (["--jobs", "0", "--list"], "--jobs: expected >= 1"),
        (["--out", str(tmp_path)], "needs setuptools>=70.1 in this environment, found 65.5.0"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            aot_main(["wheel", *bad])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "usage: python -m replayssm_jit aot wheel" in err and message in err, err
    assert not any(tmp_path.iterdir()), "nothing is built"


def test_build_wheel_rejects_bad_arguments_before_compiling(tmp_path):
    from replayssm_jit.jit.wheel import build_wheel

    specs = preset_specs(["ci"])
    for args, error, message in (
        (([], tmp_path, 1, ["9.0a"]), ValueError, "specs: expected a non-empty list of KernelSpec"),
        ((specs, str(tmp_path), 1, ["9.0a"]), TypeError, "dist: expected a pathlib.Path, got str"),
        ((specs, tmp_path, 1, []), ValueError, "archs: expected a non-empty list of str"),
    ):
        with pytest.raises(error, match=message):
            build_wheel(*args)
    assert not any(tmp_path.iterdir())


def test_elf_needs_are_what_readelf_reads(tiny_so, tmp_path):
    """The symbol versions the tag is computed from are the library's version needs."""
    if shutil.which("readelf") is None:
        pytest.skip("needs readelf (binutils) to compare against")
    so = tmp_path / "tiny.so"
    so.write_bytes(tiny_so)
    machine, needs = wheel.elf_needs(so)
    listing = subprocess.run(["readelf", "-V", "--wide", str(so)], capture_output=True, text=True)
    section = listing.stdout.partition("Version needs section")[2]
    assert machine == platform.machine()
    assert needs == set(re.findall(r"Name: (\S+)\s+Flags", section)) and "GLIBC_2.2.5" in needs
    (tmp_path / "text.so").write_text("not a library")
    with pytest.raises(ValueError, match="path: expected a 64-bit little-endian ELF file"):
        wheel.elf_needs(tmp_path / "text.so")


@pytest.mark.parametrize(
    "needs, tag",
    [
        ({"GLIBC_2.2.5", "GLIBC_2.14", "GCC_3.0"}, "manylinux_2_28_x86_64"),
        ({"GLIBC_2.28", "GLIBCXX_3.4.25", "CXXABI_1.3.11"}, "manylinux_2_28_x86_64"),
        # what nvcc 13 with Debian 12's GCC 12 gives the modules: GCC 9's ostringstream()
        ({"GLIBC_2.14", "GLIBCXX_3.4.26", "CXXABI_1.3.9"}, "manylinux_2_31_x86_64"),
        ({"GLIBC_2.29"}, "manylinux_2_31_x86_64"),
        ({"GLIBC_2.34", "GLIBCXX_3.4.21"}, "manylinux_2_34_x86_64"),
        ({"GLIBC_2.17", "CXXABI_1.3.13", "GLIBCXX_3.4.29"}, "manylinux_2_34_x86_64"),
        ({"GLIBC_2.35"}, "manylinux_2_35_x86_64"),
    ],
)
def test_manylinux_tag_is_the_oldest_baseline_with_every_needed_version(needs, tag):
    assert wheel.manylinux_tag("x86_64", needs) == tag


def test_manylinux_tag_refuses_needs_past_every_baseline():
    with pytest.raises(ValueError, match=r"got GLIBC \(2, 14\), GLIBCXX \(3, 4, 32\)"):
        wheel.manylinux_tag("x86_64", {"GLIBC_2.14", "GLIBCXX_3.4.32"})


def test_local_version_names_cuda_and_the_archs_in_order():
    assert wheel.local_version("13.0", ["10.0a", "9.0a", "9.0a"]) == "cu130.sm90a.sm100a"
    assert wheel.local_version("12.9", ["8.0", "12.0f"]) == "cu129.sm80.sm120f"
    with pytest.raises(ValueError, match="cuda: expected a CUDA release such as '13.0', got 'x'"):
        wheel.local_version("x", ["9.0a"])


def test_wheel_is_named_by_cuda_archs_and_manylinux_tag(tiny_so, tmp_path, monkeypatch):
    """Packaging alone (a stand-in for the nvcc build writes the tiny module): the file name
    carries the CUDA and arch label and the modules' manylinux tag, the metadata pins the public
    version of replayssm-jit, and the package records its version, CUDA and archs."""
    (spec,) = preset_specs(["ci"])

    def fake_build_aot(specs, out, jobs, archs):
        folder = out / spec.uri
        folder.mkdir(parents=True)
        (folder / f"{spec.uri}.so").write_bytes(tiny_so)
        (folder / build.MANIFEST).write_text(json.dumps({"uri": spec.uri, "archs": archs}))
        return [folder / f"{spec.uri}.so"]

    monkeypatch.setattr(wheel, "build_aot", fake_build_aot)
    monkeypatch.setattr(wheel, "cuda_version", lambda: "13.0")
    (tmp_path / "tiny.so").write_bytes(tiny_so)
    tag = wheel.platform_tag([tmp_path / "tiny.so"])
    assert tag.startswith("manylinux_2_") and tag.endswith(platform.machine())

    whl = wheel.build_wheel([spec], tmp_path / "dist", 1, ["10.0a", "9.0a"])
    version = f"{__version__}+cu130.sm90a.sm100a"
    assert whl.name == f"replayssm_jit_cache-{version}-py3-none-{tag}.whl"
    with zipfile.ZipFile(whl) as archive:
        info = f"replayssm_jit_cache-{version}.dist-info"
        metadata = archive.read(f"{info}/METADATA").decode()
        tags = archive.read(f"{info}/WHEEL").decode()
        init = archive.read(f"{env.CACHE_PACKAGE}/__init__.py").decode()
    assert f"Version: {version}\n" in metadata
    assert f"Requires-Dist: replayssm-jit=={__version__}\n" in metadata
    assert f"Tag: py3-none-{tag}\n" in tags and "Root-Is-Purelib: false" in tags
    assert f"__version__ = {version!r}".replace("'", '"') in init
    assert 'CUDA_VERSION = "13.0"' in init and "CUDA_ARCHS = ('10.0a', '9.0a')" in init
