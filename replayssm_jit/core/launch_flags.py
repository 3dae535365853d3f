"""The bits of the module bindings' `flags` word: defined here only; every rendered module gets
them as C++ constants (cpp_flag_constants), so Python and CUDA cannot disagree."""

from __future__ import annotations

FLAG_SPECULATIVE_RECORDS = 1
FLAG_SPLIT = 4
FLAG_FLUSH_EVERY_STEP = 8
FLAG_FEW_RECORDS_WARPS = 16
FLAG_CAPPED_STATE_REGISTERS = 32
FLAG_OVERLAP_PRIOR_KERNEL = 64

# (C++ name, bit, what it asks for) of each flag, in bit order.
LAUNCH_FLAGS = (
    ("kFlagSpeculativeRecords", FLAG_SPECULATIVE_RECORDS,
     "issue ring loads before the cursor is read"),
    ("kFlagSplit", FLAG_SPLIT, "ReplaySSM step as a records kernel, then a state kernel"),
    ("kFlagFlushEveryStep", FLAG_FLUSH_EVERY_STEP, "per-item ReplaySSM step that flushes every token"),
    ("kFlagFewRecordsWarps", FLAG_FEW_RECORDS_WARPS, "split step with records CTAs of 4 warps (GDN)"),
    ("kFlagCappedStateRegisters", FLAG_CAPPED_STATE_REGISTERS,
     "split step whose state kernel caps its registers (GDN)"),
    ("kFlagOverlapPriorKernel", FLAG_OVERLAP_PRIOR_KERNEL,
     "launch as a programmatic dependent of the previous kernel"),
)  # fmt: skip


def cpp_flag_constants() -> str:
    """The flags as the C++ constants a module's bindings test (namespace replayssm)."""
    lines = ["namespace replayssm {",
             "// Bits of the bindings' `flags` argument (rendered from replayssm_jit/core/launch_flags.py)."]  # fmt: skip
    lines += [f"constexpr int64_t {name} = {bit};  // {why}" for name, bit, why in LAUNCH_FLAGS]
    lines.append("}  // namespace replayssm")
    return "\n".join(lines)
