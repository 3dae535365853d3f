#!/usr/bin/env python3
"""Compile-time resources of AOT-built kernels, and the CTAs per SM they allow on sm_90.

    python scripts/resource_usage.py DIR_OR_MODULE... [--kind REGEX] [--args REGEX] [--sass]

Each argument is an AOT output folder (python -m replayssm_jit aot --out DIR), one module folder
in it, or a module's .so. For every kernel it prints, in one markdown table:

  family, kind (conventional, per-item, records, state, verify, verify-split records,
  verify-split state, snapshot, commit; others by function name) and the template's integer arguments by
  their names in templates/ (P, N, HPG or K, V, VPH, L, CAP, T, ROWS, WARPS, ...);
  registers, stack and local bytes per thread, static shared memory per CTA (as cuobjdump
  -res-usage reports it: on sm_90 it includes the 1 KiB the driver reserves per CTA); with
  --sass the spill instructions (LDL/STL) in its SASS and, for the smallest loop that holds
  shuffles and global stores (the split verify state kernel's draft loop), its instructions /
  divergent regions (BSSY), which the compiler does not schedule shuffles across;
  threads and dynamic shared memory per CTA, sizeof(Kern::Smem) and Kern::kThreads of the
  template itself (one small nvcc build per family, a few seconds);
  the resident CTAs per SM that registers, threads and shared memory each allow under the
  sm_90 limits of replayssm_jit/core/tiles.py (and 32 CTAs), the least of them, its warps
  per SM, and the limiting resource.

These are compile-time figures: no timing. cuobjdump is taken from --cuobjdump, $CUOBJDUMP, PATH
or $CUDA_HOME/bin; nvcc from $CUDA_HOME/bin or PATH.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from compare_sass import FUNCTION, INSTRUCTION, find_cuobjdump  # noqa: E402

from replayssm_jit.core.launch_flags import cpp_flag_constants  # noqa: E402
from replayssm_jit.core.tiles import (  # noqa: E402
    MAX_THREADS_PER_SM,
    REGISTERS_PER_SM,
    SHARED_BYTES_PER_SM,
)

TEMPLATES = ROOT / "templates"
NVCC = str(Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc")
MAX_CTAS_PER_SM = 32
REGISTER_UNIT = 256  # registers are allocated per warp, in units of 256 (8 per thread)
RES_USAGE = re.compile(
    r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", re.MULTILINE
)
PER_ITEM = re.compile(r"^void replayssm::per_item_kernel<replayssm::(\w+)::(\w+)<(.*)> ?>\(")
COMMIT = re.compile(r"^void replayssm::commit_kernel<(\d+), (\d+), (\d+)>\(")
TEMPLATE_STRUCT = re.compile(r"template\s*<([^<>{};]*)>\s*struct\s+(\w+)\s*[:{]")
KINDS = {"Records": "records", "State": "state", "Verify": "verify", "Snapshot": "snapshot",
         "VerifyRecords": "verify-split records", "VerifyState": "verify-split state"}  # fmt: skip
# Template flags worth a column (the inputs' flags are in the module URI).
VARIANT_FLAGS = {"REPLAY", "WIDE_ROWS", "FLUSH_EVERY_STEP", "CAPPED_REGISTERS", "SR"}


@dataclass
class Kernel:
    module: str
    mangled: str
    regs: int
    stack: int
    shared: int  # static, reserved 1 KiB included
    local: int
    family: str = ""
    kind: str = ""
    args: dict[str, str] = field(default_factory=dict)
    struct: str = ""  # the kernel struct's C++ type, for the size probe
    threads: int | None = None
    dynamic_shared: int | None = None
    spills: str = ""  # LDL/STL instructions (--sass)
    loops: str = ""  # instructions/BSSY of the output loop (--sass)


def parse_res_usage(text: str) -> list[tuple[str, int, int, int, int]]:
    """(mangled name, REG, STACK, SHARED, LOCAL) of every function in `cuobjdump -res-usage` text."""
    return [(m[1], int(m[2]), int(m[3]), int(m[4]), int(m[5])) for m in RES_USAGE.finditer(text)]


def split_args(text: str) -> list[str]:
    """Top-level template arguments of `text` (commas inside <> or () belong to an argument)."""
    args, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += 1 if c in "<(" else -1 if c in ">)" else 0
        if c == "," and depth == 0:
            args.append(text[start:i].strip())
            start = i + 1
    return [*args, text[start:].strip()]


def template_params(root: Path = TEMPLATES) -> dict[tuple[str, str], list[str]]:
    """(namespace, struct) -> template parameter names, read from the headers under `root`."""
    params = {}
    for header in root.rglob("*.cuh"):
        text = header.read_text()
        namespace = re.search(r"namespace replayssm::(\w+)", text)
        for m in TEMPLATE_STRUCT.finditer(text):
            names = [p.split()[-1].split("=")[0] for p in split_args(m[1]) if p]
            params.setdefault((namespace[1] if namespace else "", m[2]), names)
    return params


def describe(k: Kernel, demangled: str, params: dict) -> None:
    """Fill k's kind, args and struct from its demangled name."""
    if m := PER_ITEM.match(demangled):
        namespace, name, args = m[1], m[2], split_args(m[3])
        names = params.get((namespace, name), [])
        named = dict(zip(names, args))
        k.struct = f"replayssm::{namespace}::{name}<{m[3]}>"
        k.kind = KINDS.get(name, name)
        if name == "Kernel":
            k.kind = "per-item" if named.get("REPLAY") == "true" else "conventional"
        k.args = {n: v for n, v in named.items() if v.lstrip("-").isdigit()}
        k.args.update({n: "y" for n, v in named.items() if n in VARIANT_FLAGS and v == "true"})
        k.args.pop("REPLAY", None)
    elif m := COMMIT.match(demangled):
        k.kind, k.threads, k.dynamic_shared = "commit", int(m[3]), 0
        k.args = {"L": m[1], "T": m[2], "THREADS": m[3]}
    else:  # materialize::kernel and anything new: the function's name
        k.kind = demangled.split("<")[0].removeprefix("void replayssm::")


def demangle(names: list[str]) -> list[str]:
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                         check=True).stdout.splitlines()  # fmt: skip
    return out if len(out) == len(names) else names


def probe_sizes(family: str, structs: list[str]) -> dict[str, tuple[int, int]]:
    """struct -> (sizeof(Smem), kThreads), printed by one small program built from the family's
    headers (it instantiates no kernel, so nvcc takes a few seconds)."""
    import tvm_ffi.libinfo

    jinja = (TEMPLATES / family / "decode.cu.jinja").read_text()
    includes = re.findall(r'^#include "([^"]+)"', jinja, re.MULTILINE)
    lines = [
        "#define REPLAYSSM_DEVICE_SEED 0",
        '#include "common/launch.cuh"',
        cpp_flag_constants(),
    ]
    lines += [f'#include "{h}"' for h in includes if h != "common/launch.cuh"]
    lines += ["#include <cstdio>", "int main() {"]
    lines += [f'  printf("%zu %d\\n", sizeof({s}::Smem), int({s}::kThreads));' for s in structs]
    lines.append("}")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "probe.cu", Path(tmp) / "probe"
        src.write_text("\n".join(lines) + "\n")
        include = [f"-I{TEMPLATES}", *(f"-I{p}" for p in tvm_ffi.libinfo.include_paths())]
        build = subprocess.run(
            [NVCC if Path(NVCC).exists() else "nvcc", "-std=c++17", "--expt-relaxed-constexpr", "-w", "-arch=sm_90a", *include,
             str(src), "-o", str(exe)], capture_output=True, text=True, check=False,
        )  # fmt: skip
        if build.returncode != 0:
            sys.exit(f"resource_usage: the {family} size probe failed:\n{build.stderr[-3000:]}")
        out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()
    return {s: (int(out[2 * i]), int(out[2 * i + 1])) for i, s in enumerate(structs)}


def occupancy(k: Kernel) -> dict[str, int]:
    """Resident CTAs per SM that each resource allows for `k` (needs threads and dynamic shared)."""
    warps = -(-k.threads // 32)
    per_warp = -(-max(k.regs, 1) * 32 // REGISTER_UNIT) * REGISTER_UNIT
    return {
        "registers": REGISTERS_PER_SM // (per_warp * warps),
        "threads": MAX_THREADS_PER_SM // k.threads,
        "shared": SHARED_BYTES_PER_SM // (k.shared + k.dynamic_shared),
        "CTA slots": MAX_CTAS_PER_SM,
    }


def modules(paths: list[str]) -> list[Path]:
    """The .so files named by `paths` (files, module folders, or folders of module folders)."""
    found = []
    for p in map(Path, paths):
        if p.is_file():
            found.append(p)
        elif sos := sorted(p.glob("*.so")):
            found += sos
        else:
            found += sorted(p.glob("*/*.so"))
    return found


def sass_functions(cuobjdump: str, so: Path) -> dict[str, list[tuple[int, str]]]:
    """Kernel (mangled) -> its (address, instruction) pairs in `cuobjdump -sass`."""
    path = f"{Path(cuobjdump).resolve().parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "PATH": path}  # (cuobjdump -sass runs nvdisasm from beside it)
    text = subprocess.run([cuobjdump, "-sass", str(so)], capture_output=True, text=True,
                          check=True, env=env).stdout  # fmt: skip
    functions, current = {}, None
    for line in text.splitlines():
        if m := FUNCTION.match(line):
            current = functions.setdefault(m[1], [])
        elif current is not None and (m := INSTRUCTION.match(line)):
            current.append((int(m[1], 16), m[2]))
    return functions


def opcode(instruction: str) -> str:
    words = instruction.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def sass_summary(code: list[tuple[int, str]]) -> tuple[str, str]:
    """('LDL/STL' counts, 'instructions/BSSY' of the output loop): the innermost loop (a backward
    branch's body with no loop inside) that holds shuffles and global stores, such as the split
    verify state kernel's draft loop; a BSSY opens a divergent region, which the compiler does
    not schedule shuffles across."""
    ops = [opcode(i) for _, i in code]
    spills = f"{ops.count('LDL')}/{ops.count('STL')}"
    index = {address: n for n, (address, _) in enumerate(code)}
    loops = []  # (first, last) instruction of each backward branch's body
    for n, (address, instruction) in enumerate(code):
        target = re.search(r"BRA\s+0x([0-9a-f]+)", instruction)
        if target and int(target[1], 16) < address and int(target[1], 16) in index:
            loops.append((index[int(target[1], 16)], n))
    found = []
    for first, last in loops:
        body = ops[first : last + 1]
        inner = any(first <= a and b < last for a, b in loops)
        if not inner and "SHFL" in body and "STG" in body:
            found.append((len(body), body.count("BSSY")))
    return spills, " ".join(f"{n}/{b}" for n, b in found)


def collect(paths: list[str], cuobjdump: str, sass: bool) -> list[Kernel]:
    kernels, sos = [], modules(paths)
    several = len({so.parent.parent for so in sos}) > 1  # then name each module's AOT folder too
    for so in sos:
        run = subprocess.run([cuobjdump, "-res-usage", str(so)], capture_output=True, text=True,
                             check=True)  # fmt: skip
        name = f"{so.parent.parent.name}/{so.stem}" if several else so.stem
        found = [Kernel(name, *row) for row in parse_res_usage(run.stdout)]
        if sass and found:
            code = sass_functions(cuobjdump, so)
            for k in found:
                k.spills, k.loops = sass_summary(code.get(k.mangled, []))
        kernels += found
    return kernels


def attach_sizes(kernels: list[Kernel]) -> None:
    """Threads and dynamic shared memory per CTA of every kernel struct, one probe per family."""
    by_family: dict[str, set[str]] = {}
    for k in kernels:
        if k.struct:
            by_family.setdefault(k.struct.split("::")[1], set()).add(k.struct)
    sizes = {}
    for family, structs in by_family.items():
        sizes.update(probe_sizes(family, sorted(structs)))
    for k in kernels:
        if k.struct:
            k.dynamic_shared, k.threads = sizes[k.struct]


def args_text(k: Kernel) -> str:
    return " ".join(f"{n}={v}" for n, v in k.args.items()) + " "


def row(k: Kernel) -> str:
    cells = [k.module, k.family, k.kind, args_text(k).strip(), k.regs, k.stack, k.local, k.spills,
             k.loops, k.shared, k.dynamic_shared, k.threads]  # fmt: skip
    if k.threads is not None and k.dynamic_shared is not None:
        limits = occupancy(k)
        ctas = min(limits.values())
        cells += [", ".join(str(limits[n]) for n in ("registers", "threads", "shared")), ctas,
                  ctas * -(-k.threads // 32), "=".join(n for n, v in limits.items() if v == ctas)]  # fmt: skip
    else:
        cells += [""] * 4
    return "| " + " | ".join("" if c is None else str(c) for c in cells) + " |"


HEADER = (
    "| module | family | kind | args | regs | stack | local | LDL/STL | output loop | static smem "
    "| dyn smem | threads | CTAs/SM by regs, threads, smem | CTAs/SM | warps/SM | limiter |"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])  # fmt: skip
    parser.add_argument("paths", nargs="+", help="AOT folders, module folders or .so files")
    parser.add_argument("--kind", help="only kernels whose kind matches this regex (e.g. verify)")
    parser.add_argument("--args", help="only kernels whose args match this regex ('ROWS=64 ')")
    parser.add_argument("--sass", action="store_true", help="read the SASS too (slower)")
    parser.add_argument("--no-probe", action="store_true", help="no size probe (no occupancy)")
    parser.add_argument("--cuobjdump", help="cuobjdump to use")
    opts = parser.parse_args(argv)

    kernels = collect(opts.paths, find_cuobjdump(opts.cuobjdump), opts.sass)
    params = template_params()
    for k, name in zip(kernels, demangle([k.mangled for k in kernels])):
        k.family = k.module.split("/")[-1].split("_")[0]
        describe(k, name, params)
    kernels = [k for k in kernels if (not opts.kind or re.search(opts.kind, k.kind))
               and (not opts.args or re.search(opts.args, args_text(k)))]  # fmt: skip
    if not opts.no_probe:
        attach_sizes(kernels)
    print(HEADER)
    print("|" + "---|" * HEADER.count(" |"))
    for k in sorted(kernels, key=lambda k: (k.module, k.kind, args_text(k))):
        print(row(k))
    return 0


if __name__ == "__main__":
    sys.exit(main())
