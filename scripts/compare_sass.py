#!/usr/bin/env python3
"""Compare the SASS of two AOT builds, module by module and kernel by kernel.

    python scripts/compare_sass.py BASE_DIR NEW_DIR [--only REGEX] [--allow REGEX] [--diff LINES]

Each directory holds one folder per module URI with <uri>.so (python -m replayssm_jit aot --out DIR).
Modules present in both are disassembled with `cuobjdump -sass` and each kernel function (matched by
its mangled name) is compared after normalisation:

  renamed: registers (R, P, UR, UP, B) renamed in order of first appearance within the function,
           constant-bank offsets (c[0x0][0x...]) masked, branch targets and labels masked;
  masked:  as renamed, with every register number masked (so operand order among registers and
           register allocation no longer show).

A kernel is "same" when its renamed sequences agree, "same-masked" when only its masked ones do,
and "differs" otherwise; for a differing kernel the opcode multiset difference is printed as a
looser second check. The exit status is 1 when any compared module has a differing kernel (or a
kernel only one side has), unless the module's URI matches --allow; 2 on usage errors.

cuobjdump is taken from --cuobjdump, $CUOBJDUMP, PATH, or $CUDA_HOME/bin (it needs nvdisasm beside
it or on PATH).
"""

from __future__ import annotations

import argparse
import collections
import difflib
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")
REGISTER = re.compile(r"\b(UR|UP|R|P|B)(\d+)\b")
CONST_BANK = re.compile(r"\bc\[(0x[0-9a-f]+)\]\[0x[0-9a-f]+\]")
LABEL = re.compile(r"`\(\.L_x_\d+\)|\.L_x_\d+")
# Opcodes whose hex operand is a code address.
BRANCH_OPCODES = {"BRA", "BRX", "JMP", "JMX", "CALL", "BSSY", "SSY", "PBK", "PCNT", "BREAK", "RET"}
HEX_TARGET = re.compile(r"\b0x[0-9a-f]+\b")


def opcode_of(text: str) -> str:
    """The opcode with its modifiers (the guard predicate, if any, left out)."""
    parts = text.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0] if parts else ""


def mask_common(text: str) -> str:
    """Constant-bank offsets, labels and branch targets masked; whitespace collapsed."""
    text = CONST_BANK.sub(lambda m: f"c[{m.group(1)}][OFF]", text)
    text = LABEL.sub("LABEL", text)
    if opcode_of(text).split(".")[0] in BRANCH_OPCODES:
        text = HEX_TARGET.sub("ADDR", text)
    return " ".join(text.replace(",", " , ").split())


def masked(instructions: list[str]) -> list[str]:
    return [REGISTER.sub(lambda m: m.group(1), mask_common(i)) for i in instructions]


def renamed(instructions: list[str]) -> list[str]:
    """Registers renamed per class in order of first appearance (so allocation does not show)."""
    names: dict[tuple[str, str], int] = {}
    counts: collections.Counter[str] = collections.Counter()

    def rename(m: re.Match) -> str:
        key = (m.group(1), m.group(2))
        if key not in names:
            names[key] = counts[m.group(1)]
            counts[m.group(1)] += 1
        return f"{m.group(1)}{names[key]}"

    return [REGISTER.sub(rename, mask_common(i)) for i in instructions]


def find_cuobjdump(explicit: str | None) -> str:
    for candidate in (explicit, os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump")):
        if candidate:
            return candidate
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    path = Path(cuda_home) / "bin" / "cuobjdump"
    if path.exists():
        return str(path)
    sys.exit("compare_sass: cuobjdump not found (give --cuobjdump, $CUOBJDUMP, or put it on PATH)")


def disassemble(cuobjdump: str, so_path: Path) -> dict[str, list[str]]:
    """Kernel name -> its instructions as cuobjdump prints them (addresses and encodings dropped)."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(cuobjdump).resolve().parent}{os.pathsep}{env.get('PATH', '')}"
    run = subprocess.run(
        [cuobjdump, "-sass", str(so_path)], capture_output=True, text=True, env=env, check=False
    )
    if run.returncode != 0 or "fatal" in run.stderr:
        raise RuntimeError(
            f"cuobjdump -sass {so_path} failed: {run.stderr.strip() or run.stdout[-500:]}"
        )
    functions: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in run.stdout.splitlines():
        if m := FUNCTION.match(line):
            if m.group(1) in functions:
                raise RuntimeError(f"{so_path}: kernel {m.group(1)} appears twice (several archs?)")
            current = functions.setdefault(m.group(1), [])
        elif current is not None and (m := INSTRUCTION.match(line)):
            current.append(m.group(2))
    return functions


@dataclass
class KernelResult:
    name: str
    status: str  # same, same-masked, differs, only-base, only-new
    base_count: int = 0
    new_count: int = 0
    opcode_delta: dict[str, int] = field(default_factory=dict)
    diff: list[str] = field(default_factory=list)


@dataclass
class ModuleResult:
    uri: str
    kernels: list[KernelResult]
    allowed: bool = False

    @property
    def differs(self) -> bool:
        return any(k.status not in ("same", "same-masked") for k in self.kernels)


def compare_kernel(
    name: str, base: list[str] | None, new: list[str] | None, diff_lines: int
) -> KernelResult:
    if base is None or new is None:
        return KernelResult(
            name, "only-new" if base is None else "only-base", len(base or []), len(new or [])
        )
    result = KernelResult(name, "same", len(base), len(new))
    if renamed(base) == renamed(new):
        return result
    base_masked, new_masked = masked(base), masked(new)
    if base_masked == new_masked:
        result.status = "same-masked"
        return result
    result.status = "differs"
    delta = collections.Counter(opcode_of(i) for i in new)
    delta.subtract(collections.Counter(opcode_of(i) for i in base))
    result.opcode_delta = {op: n for op, n in sorted(delta.items()) if n}
    if diff_lines:
        lines = difflib.unified_diff(base_masked, new_masked, "base", "new", n=2, lineterm="")
        result.diff = list(lines)[:diff_lines]
    return result


def compare_module(
    cuobjdump: str, uri: str, base_dir: Path, new_dir: Path, diff_lines: int
) -> ModuleResult:
    base = disassemble(cuobjdump, base_dir / uri / f"{uri}.so")
    new = disassemble(cuobjdump, new_dir / uri / f"{uri}.so")
    names = sorted(set(base) | set(new))
    return ModuleResult(
        uri, [compare_kernel(n, base.get(n), new.get(n), diff_lines) for n in names]
    )


def modules_in(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if (p / f"{p.name}.so").is_file()}


def short_name(mangled: str) -> str:
    """A readable form of a kernel's mangled name (via c++filt where available): the kernel
    struct's template, without the namespace and the parameter list."""
    filt = shutil.which("c++filt")
    if not filt:
        return mangled
    out = subprocess.run(
        [filt, mangled], capture_output=True, text=True, check=False
    ).stdout.strip()
    if not out:
        return mangled
    out = out.replace("replayssm::", "")
    head, _, _ = out.rpartition("(")  # drop the kernel's parameter list
    return head.removeprefix("void ") or out


def report(
    results: list[ModuleResult], only_base: list[str], only_new: list[str], verbose: bool
) -> None:
    for module in results:
        counts = collections.Counter(k.status for k in module.kernels)
        if module.differs:
            state = "DIFFERS (allowed)" if module.allowed else "DIFFERS"
        else:
            state = "identical"
        detail = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        print(f"{state:18} {module.uri}  [{len(module.kernels)} kernels: {detail}]")
        for k in module.kernels:
            if k.status in ("same", "same-masked") and not verbose:
                continue
            print(
                f"    {k.status:12} {k.base_count:6} -> {k.new_count:6} instructions  {short_name(k.name)}"
            )
            if k.opcode_delta:
                delta = " ".join(f"{op}:{n:+d}" for op, n in k.opcode_delta.items())
                print(f"        opcode multiset (new - base): {delta}")
            elif k.status == "differs":
                print("        opcode multiset (new - base): equal (order differs)")
            for line in k.diff:
                print(f"        | {line}")
    kernels = [k for m in results for k in m.kernels]
    kernel_counts = collections.Counter(k.status for k in kernels)
    differing = [m for m in results if m.differs]
    allowed = [m for m in differing if m.allowed]
    print()
    print("summary:")
    print(f"  modules compared: {len(results)}; identical: {len(results) - len(differing)}; "
          f"differing: {len(differing)} ({len(allowed)} allowed by --allow)")  # fmt: skip
    print(f"  kernels compared: {len(kernels)}; " + "; ".join(
        f"{s}: {kernel_counts.get(s, 0)}" for s in ("same", "same-masked", "differs", "only-base", "only-new")
    ))  # fmt: skip
    if only_base or only_new:
        print(f"  modules only in base: {len(only_base)}; only in new: {len(only_new)}")
        for uri in only_base:
            print(f"    only in base: {uri}")
        for uri in only_new:
            print(f"    only in new: {uri}")
    for m in differing:
        print(f"  {'allowed' if m.allowed else 'DIFFERS'}: {m.uri}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path, help="baseline AOT directory")
    parser.add_argument("new", type=Path, help="AOT directory to check against it")
    parser.add_argument("--only", help="compare only modules whose URI matches this regex")
    parser.add_argument(
        "--allow", help="modules whose URI matches this regex may differ (reported, exit 0)"
    )
    parser.add_argument("--diff", type=int, default=0, metavar="LINES",
                        help="print up to LINES lines of masked unified diff per differing kernel")  # fmt: skip
    parser.add_argument(
        "--jobs", type=int, default=2, help="cuobjdump processes at once (default 2)"
    )
    parser.add_argument("--cuobjdump", help="path of cuobjdump")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="list every kernel, not only differing ones"
    )
    args = parser.parse_args(argv)
    for d in (args.base, args.new):
        if not d.is_dir():
            parser.error(f"not a directory: {d}")
    cuobjdump = find_cuobjdump(args.cuobjdump)
    base_uris, new_uris = modules_in(args.base), modules_in(args.new)
    if args.only:
        pattern = re.compile(args.only)
        base_uris = {u for u in base_uris if pattern.search(u)}
        new_uris = {u for u in new_uris if pattern.search(u)}
    common = sorted(base_uris & new_uris)
    if not common:
        print("compare_sass: no module is in both directories", file=sys.stderr)
        return 1
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = list(
            pool.map(
                lambda uri: compare_module(cuobjdump, uri, args.base, args.new, args.diff), common
            )
        )
    if args.allow:
        allow = re.compile(args.allow)
        for m in results:
            m.allowed = bool(allow.search(m.uri))
    report(results, sorted(base_uris - new_uris), sorted(new_uris - base_uris), args.verbose)
    return 1 if any(m.differs and not m.allowed for m in results) else 0


if __name__ == "__main__":
    sys.exit(main())
