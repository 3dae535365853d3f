"""Row-tile geometry of the kernels (mirrors RowTiling in templates/common/replay.cuh) and the
sm_90 limits the launch policy plans against. Data and arithmetic only: no device access."""

from __future__ import annotations

# Largest dynamic shared memory of one CTA on sm_90.
MAX_CTA_SHARED_BYTES = 227 * 1024
# sm_90 per-SM limits (kThreadsPerSm, kRegistersPerSm and shared_memory_resident_ctas in
# templates/common/split.cuh).
MAX_THREADS_PER_SM = 2048
REGISTERS_PER_SM = 64 * 1024
SHARED_BYTES_PER_SM = 227 * 1024
SHARED_BYTES_RESERVED_PER_CTA = 1024
# Threads of the split step's 8-warp records CTA: one per head for its scalars.
SPLIT_RECORDS_THREADS = 256
SPLIT_RECORDS_FULL_SM_CTAS = MAX_THREADS_PER_SM // SPLIT_RECORDS_THREADS
# Enough CTAs to cover every SM twice before a head's rows are split further.
TARGET_CTAS_PER_SM = 2
# FP32 values per lane of a whole-head (NVFP4) tile: more would spill at a flush.
WHOLE_HEAD_LANE_VALUES = 64


def lanes_per_row(rows_per_warp: int, cols: int, chunk_values: int) -> int:
    """Lanes sharing a state row in a tile with `rows_per_warp` rows per warp: the fewest of 8
    and 16 (at most one per 16-byte chunk) that split a warp's rows into whole passes, else one
    per chunk up to 32 (as RowTiling does for narrow rows)."""
    vecs = cols // chunk_values
    for lanes in (8, 16):
        if lanes <= vecs and rows_per_warp % (32 // lanes) == 0:
            return lanes
    return min(32, vecs)


def rows_tilings(
    rows: int,
    cols: int,
    chunk_values: int,
    *,
    warp_options: tuple[int, ...] = (4, 8, 2, 1),
    max_chunks: int = 16,
    whole_heads: bool = False,
    every_warps: bool = False,
) -> list[tuple[int, int]]:
    """(rows_per_cta, warps) pairs for a [rows, cols] state per head, largest first: the first
    of `warp_options` that tiles each rows_per_cta, or (`every_warps`) each that does.

    A lane holds 16-byte chunks (`chunk_values` values each) of a state row, so a warp covers
    32 / lanes_per_row rows per pass; splitting the rows across CTAs buys parallelism at small
    batch, unless `whole_heads` (a CTA must hold its head's rows: NVFP4's head scale).
    `max_chunks` bounds the state registers per lane (chunks x 16 bytes); a whole head's tile
    prefers warp counts that give a lane at most WHOLE_HEAD_LANE_VALUES values (a flush holds
    them in FP32).
    """
    vec = chunk_values
    tilings = []
    for split in (1,) if whole_heads else (1, 2, 4, 8):
        if rows % split:
            continue
        per_cta = rows // split
        options = warp_options
        if whole_heads:
            options = sorted(
                options, key=lambda w: lane_values(per_cta, w, cols) > WHOLE_HEAD_LANE_VALUES
            )
        for warps in options:
            per_warp = per_cta // warps if per_cta % warps == 0 else 0
            if not per_warp:
                continue
            rows_per_pass = 32 // lanes_per_row(per_warp, cols, chunk_values)
            chunks = per_warp * cols // (32 * vec)
            if per_warp % rows_per_pass == 0 and chunks <= max_chunks:
                tilings.append((per_cta, warps))
                if not every_warps:
                    break
    return tilings


def lane_values(rows_per_cta: int, warps: int, cols: int) -> int:
    """State values each lane holds for a (rows_per_cta, warps) tile of a [*, cols] state."""
    return rows_per_cta * cols // (warps * 32)
