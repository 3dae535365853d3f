"""The `replayssm-jit-cache` wheel: prebuilt modules that `pip install` puts where the loader looks
(`replayssm_jit_cache/modules/<uri>/`), built by `python -m replayssm_jit.aot wheel`.

The wheel's version is this replayssm_jit's, and it requires `replayssm-jit==<that version>`, so
pip installs matching pairs; the loader also refuses a `replayssm_jit_cache` of another version
(`env.cache_package`) and checks each module against its manifest (source digest, size, sha256)
before loading it, as for any AOT directory. The modules are ELF libraries loaded through
tvm_ffi's C ABI, not Python extensions, so the wheel is tagged `py3-none-<platform>`.

The wheel is made by setuptools through `pip wheel` from a generated project, without build
isolation, so building needs no network: setuptools >= 70.1 (which has `bdist_wheel` built in)
must be installed (`pip install "replayssm-jit[aot]"`).
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from replayssm_jit.core.version import __version__
from replayssm_jit.families.spec import KernelSpec
from replayssm_jit.jit import env
from replayssm_jit.jit.aot import build_aot
from replayssm_jit.jit.build import MANIFEST

# setuptools.command.bdist_wheel first shipped in 70.1; older releases need the `wheel` package.
MIN_SETUPTOOLS = (70, 1)
_SETUPTOOLS_REQUIREMENT = "setuptools>=" + ".".join(map(str, MIN_SETUPTOOLS))

_SETUP_PY = '''\
from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel


class BinaryDistribution(Distribution):
    """Holds shared libraries: a platform wheel, installed to platlib."""

    def has_ext_modules(self):
        return True


class AnyPython3Wheel(bdist_wheel):
    """py3-none-<platform>: the modules are loaded through tvm_ffi's C ABI by any Python 3."""

    def get_tag(self):
        return "py3", "none", super().get_tag()[2]


setup(distclass=BinaryDistribution, cmdclass={"bdist_wheel": AnyPython3Wheel})
'''


def _describe(archs: list[str], count: int) -> str:
    targets = " ".join("sm_" + arch.replace(".", "") for arch in archs)
    return f"{count} specialization{'s' * (count != 1)} for {targets}"


def _pyproject(version: str, archs: list[str], count: int) -> str:
    # json.dumps quotes are valid TOML basic strings for these ASCII values.
    summary = f"Prebuilt replayssm-jit modules: {_describe(archs, count)}"
    return f"""\
[build-system]
requires = ["{_SETUPTOOLS_REQUIREMENT}"]
build-backend = "setuptools.build_meta"

[project]
name = "{env.CACHE_DISTRIBUTION}"
version = {json.dumps(version)}
description = {json.dumps(summary)}
requires-python = ">=3.10"
dependencies = [{json.dumps(f"replayssm-jit=={version}")}]

[tool.setuptools]
packages = ["{env.CACHE_PACKAGE}"]

[tool.setuptools.package-data]
{env.CACHE_PACKAGE} = ["modules/*/*.so", "modules/*/{MANIFEST}"]
"""


def _package_init(version: str, archs: list[str], count: int) -> str:
    return f'''\
"""Prebuilt replayssm-jit modules ({_describe(archs, count)}), made by
`python -m replayssm_jit.aot wheel`. replayssm_jit {version} loads them from modules/ (and
refuses them if its version differs), checking each against its manifest first."""

__version__ = {json.dumps(version)}
CUDA_ARCHS = {tuple(archs)!r}
'''


def check_setuptools() -> None:
    """Raise RuntimeError unless setuptools >= MIN_SETUPTOOLS is installed (read from its
    metadata: importing setuptools would patch distutils in this process)."""
    try:
        found = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        found = None
    release = tuple(int(part) for part in re.findall(r"\d+", found or "")[:2])
    if found is None or release < MIN_SETUPTOOLS:
        raise RuntimeError(
            f"building the {env.CACHE_DISTRIBUTION} wheel needs {_SETUPTOOLS_REQUIREMENT} in this "
            f"environment, found {found or 'none'}; run pip install '{_SETUPTOOLS_REQUIREMENT}' "
            "(or install replayssm-jit[aot])"
        )


def build_wheel(specs: list[KernelSpec], dist: Path, jobs: int, archs: list[str]) -> Path:
    """Build `specs` for `archs` (with `jobs` parallel compiles) and package them as the
    `replayssm-jit-cache` wheel in `dist`, replacing a wheel of the same name; returns its path."""
    if not specs or not all(isinstance(spec, KernelSpec) for spec in specs):
        raise ValueError(f"specs: expected a non-empty list of KernelSpec, got {specs!r}")
    if not isinstance(dist, Path):
        raise TypeError(f"dist: expected a pathlib.Path, got {type(dist).__name__} {dist!r}")
    if not archs or not all(isinstance(arch, str) for arch in archs):
        raise ValueError(f"archs: expected a non-empty list of str such as ['9.0a'], got {archs!r}")
    check_setuptools()
    dist.mkdir(parents=True, exist_ok=True)  # before compiling: an unusable DIST fails at once
    with tempfile.TemporaryDirectory(prefix="replayssm-wheel-") as scratch:
        project, wheels = Path(scratch) / "project", Path(scratch) / "wheels"
        package = project / env.CACHE_PACKAGE
        build_aot(specs, package / "modules", jobs, archs)
        (package / "__init__.py").write_text(_package_init(__version__, archs, len(specs)))
        (project / "pyproject.toml").write_text(_pyproject(__version__, archs, len(specs)))
        (project / "setup.py").write_text(_SETUP_PY)
        print(f"packaging {_describe(archs, len(specs))} with setuptools", file=sys.stderr)
        # No isolation and no index: the build uses this environment's setuptools, offline.
        command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                   "--no-index", "--wheel-dir", str(wheels), str(project)]  # fmt: skip
        run = subprocess.run(command, capture_output=True, text=True)
        built = sorted(wheels.glob("*.whl")) if run.returncode == 0 else []
        if len(built) != 1:
            raise RuntimeError(
                f"pip wheel of the generated {env.CACHE_DISTRIBUTION} project failed (exit "
                f"{run.returncode}, wheels made: {[w.name for w in built]}):\n"
                f"{run.stdout}{run.stderr}"
            )
        target = dist / built[0].name
        shutil.move(built[0], target)
    return target
