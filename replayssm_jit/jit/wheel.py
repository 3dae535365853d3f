"""The `replayssm-jit-cache` wheel: prebuilt modules that `pip install` puts where the loader looks
(`replayssm_jit_cache/modules/<uri>/`), built by `python -m replayssm_jit aot wheel`.

The wheel's version is this replayssm_jit's with a PEP 440 local label naming the CUDA release and
the archs it was built for, `0.4.0+cu130.sm90a.sm100a` (CUDA 13.0; sm_90a and sm_100a, in arch
order), so builds for other targets have other file names. It requires
`replayssm-jit==<the public version>`, so pip installs matching pairs; the loader refuses a
`replayssm_jit_cache` of another public version (`env.cache_package`) and checks each module
against its manifest (source digest, archs, size, sha256) before loading it, as for any AOT
directory.

The modules are ELF libraries loaded through tvm_ffi's C ABI, not Python extensions, so the wheel
is tagged `py3-none-manylinux_X_Y_<machine>`: <machine> is the modules' ELF machine, and X_Y the
oldest baseline (`_BASELINES`, from manylinux_2_28 up) whose glibc and system libstdc++ provide
every GLIBC, GLIBCXX and CXXABI symbol version the modules need, read from their ELF version
needs. libcudart and libtvm_ffi come from the CUDA and apache-tvm-ffi wheels, not the system.

The wheel is made by setuptools through `pip wheel` from a generated project, without build
isolation, so building needs no network: setuptools >= 70.1 (which has `bdist_wheel` built in)
must be installed (`pip install "replayssm-jit[aot]"`).
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shutil
import struct
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
    """py3-none-<manylinux tag>: the modules are loaded through tvm_ffi's C ABI by any Python 3,
    on any glibc system at least as new as the tag, which replayssm_jit.jit.wheel computed."""

    def get_tag(self):
        return "py3", "none", PLATFORM_TAG


setup(distclass=BinaryDistribution, cmdclass={"bdist_wheel": AnyPython3Wheel})
'''


# Oldest first: (manylinux glibc, newest GLIBCXX, newest CXXABI) of a baseline system's libstdc++.
# 2.28 is the floor: PyTorch's and CUDA 13's oldest supported glibc (RHEL 8).
_BASELINES = [
    ((2, 28), (3, 4, 25), (1, 3, 11)),  # RHEL 8: GCC 8's libstdc++
    ((2, 31), (3, 4, 28), (1, 3, 12)),  # Ubuntu 20.04, Debian 11: GCC 10's
    ((2, 34), (3, 4, 29), (1, 3, 13)),  # RHEL 9: GCC 11's
    ((2, 35), (3, 4, 30), (1, 3, 13)),  # Ubuntu 22.04: GCC 12's
]
_MACHINES = {62: "x86_64", 183: "aarch64"}  # ELF e_machine
_SHT_GNU_VERNEED = 0x6FFFFFFE


def elf_needs(path: Path) -> tuple[str, set[str]]:
    """(machine, the symbol versions it needs, e.g. {'GLIBC_2.14', 'GLIBCXX_3.4.26'}) of the
    64-bit little-endian ELF library at `path`, read from its .gnu.version_r section."""
    data = path.read_bytes()
    if data[:6] != b"\x7fELF\x02\x01":
        raise ValueError(
            f"path: expected a 64-bit little-endian ELF file, got {path} starting {data[:6]!r}"
        )
    (machine,) = struct.unpack_from("<H", data, 18)
    if machine not in _MACHINES:
        raise ValueError(f"{path}: expected an ELF machine in {_MACHINES}, got {machine}")
    (section_table,) = struct.unpack_from("<Q", data, 0x28)
    entry_size, count = struct.unpack_from("<HH", data, 0x3A)
    # Each: name, type, flags, addr, offset, size, link, info, addralign, entsize.
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", data, section_table + i * entry_size)
        for i in range(count)
    ]
    needs = set()
    for _, kind, _, _, offset, _, link, files, _, _ in sections:
        if kind != _SHT_GNU_VERNEED:
            continue
        strings, entry = sections[link][4], offset
        for _ in range(files):  # one Verneed per library, each with its Vernaux list
            _, versions, _, aux, next_entry = struct.unpack_from("<HHIII", data, entry)
            at = entry + aux
            for _ in range(versions):
                _, _, _, name, next_aux = struct.unpack_from("<IHHII", data, at)
                start = strings + name
                needs.add(data[start : data.index(b"\0", start)].decode())
                at += next_aux
            entry += next_entry
    return _MACHINES[machine], needs


def _newest(needs: set[str], prefix: str) -> tuple[int, ...]:
    found = [tuple(map(int, n[len(prefix) :].split("."))) for n in needs if n.startswith(prefix)]
    return max(found, default=())


def manylinux_tag(machine: str, needs: set[str]) -> str:
    """The oldest manylinux tag of `_BASELINES` that provides all of `needs` on `machine`."""
    glibc, glibcxx = _newest(needs, "GLIBC_"), _newest(needs, "GLIBCXX_")
    cxxabi = _newest(needs, "CXXABI_")
    for base, newest_glibcxx, newest_cxxabi in _BASELINES:
        if glibc <= base and glibcxx <= newest_glibcxx and cxxabi <= newest_cxxabi:
            return f"manylinux_{base[0]}_{base[1]}_{machine}"
    raise ValueError(
        f"needs: expected symbol versions a baseline of {[b[0] for b in _BASELINES]} provides, "
        f"got GLIBC {glibc}, GLIBCXX {glibcxx}, CXXABI {cxxabi}; build with an older toolchain "
        "(a manylinux_2_28 image)"
    )


def platform_tag(libraries: list[Path]) -> str:
    """The manylinux tag that every module in `libraries` (one machine) satisfies."""
    machines, needs = set(), set()
    for library in libraries:
        machine, library_needs = elf_needs(library)
        machines.add(machine)
        needs |= library_needs
    if len(machines) != 1:
        raise ValueError(f"libraries: expected modules of one machine, got {sorted(machines)}")
    return manylinux_tag(machines.pop(), needs)


def cuda_version() -> str:
    """The CUDA release ("13.0") of the nvcc that builds the modules."""
    nvcc = Path(env.cuda_home()) / "bin" / "nvcc"
    command = [str(nvcc) if nvcc.exists() else "nvcc", "--version"]
    output = subprocess.run(command, capture_output=True, text=True, check=False).stdout
    release = re.search(r"release (\d+)\.(\d+)", output)
    if release is None:
        raise RuntimeError(
            f"{' '.join(command)}: expected 'release M.m' in its output, got {output!r}"
        )
    return f"{release[1]}.{release[2]}"


def _arch_key(arch: str) -> tuple[int, int, str]:
    major, _, minor = arch.partition(".")
    return int(major), int(minor.rstrip("af")), minor.lstrip("0123456789")


def local_version(cuda: str, archs: list[str]) -> str:
    """The PEP 440 local label of a wheel for CUDA `cuda` ("13.0") and `archs` (["9.0a"]):
    "cu130.sm90a", the archs deduplicated in ascending order."""
    major, _, minor = cuda.partition(".")
    if not (major.isdigit() and minor.isdigit()):
        raise ValueError(f"cuda: expected a CUDA release such as '13.0', got {cuda!r}")
    targets = ["sm" + arch.replace(".", "") for arch in sorted(set(archs), key=_arch_key)]
    return ".".join([f"cu{major}{minor}", *targets])


def _describe(archs: list[str], count: int) -> str:
    targets = " ".join("sm_" + arch.replace(".", "") for arch in archs)
    return f"{count} specialization{'s' * (count != 1)} for {targets}"


def _pyproject(version: str, archs: list[str], count: int) -> str:
    """The generated project: `version` has the local label, the pin on replayssm-jit has not."""
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
dependencies = [{json.dumps(f"replayssm-jit=={version.partition('+')[0]}")}]

[tool.setuptools]
packages = ["{env.CACHE_PACKAGE}"]

[tool.setuptools.package-data]
{env.CACHE_PACKAGE} = ["modules/*/*.so", "modules/*/{MANIFEST}"]
"""


def _package_init(version: str, cuda: str, archs: list[str], count: int) -> str:
    public = version.partition("+")[0]
    return f'''\
"""Prebuilt replayssm-jit modules ({_describe(archs, count)}, CUDA {cuda}), made by
`python -m replayssm_jit aot wheel`. replayssm_jit {public} loads them from modules/ (and
refuses them if its version differs), checking each against its manifest first."""

__version__ = {json.dumps(version)}
CUDA_VERSION = {json.dumps(cuda)}
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
        cuda = cuda_version()
        version = f"{__version__}+{local_version(cuda, archs)}"
        modules = build_aot(specs, package / "modules", jobs, archs)
        (package / "__init__.py").write_text(_package_init(version, cuda, archs, len(specs)))
        (project / "pyproject.toml").write_text(_pyproject(version, archs, len(specs)))
        tag = platform_tag(modules)
        (project / "setup.py").write_text(_SETUP_PY.replace("PLATFORM_TAG", repr(tag)))
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
