// Openings shared by the decode kernels (per-item, split records, split state) of every family.
// Params is a family's parameter struct with heads() (its state's heads), seed and seed_tensor.
#pragma once
#include "common/replay.cuh"

namespace replayssm {

// A programmatic dependent reads nothing its predecessor may still write; its own dependents may be
// scheduled at once (they wait for it in turn).
__device__ __forceinline__ void begin_after_prior_grid() {
  wait_for_prior_grid();
  allow_dependent_grid();
}

// A row-tile CTA on a (heads x SPLITS, batch) grid: row tile `split` of head `head`, in group `group`
// of HEADS_PER_GROUP heads (num_groups in all), for batch row `row`.
template <int SPLITS, int HEADS_PER_GROUP>
struct RowTileIndex {
  int split, head, row, group, num_groups;

  template <class Params>
  static __device__ __forceinline__ RowTileIndex of_block(const Params& p) {
    RowTileIndex t;
    t.split = blockIdx.x % SPLITS;
    t.head = blockIdx.x / SPLITS;
    t.row = blockIdx.y;
    t.group = t.head / HEADS_PER_GROUP;
    t.num_groups = p.heads() / HEADS_PER_GROUP;
    return t;
  }
};

// A records CTA on a (groups, batch) grid: group `group` (heads head0..head0 + HEADS_PER_GROUP - 1,
// num_groups groups in all) of batch row `row`.
template <int HEADS_PER_GROUP>
struct GroupIndex {
  int group, row, head0, num_groups;

  template <class Params>
  static __device__ __forceinline__ GroupIndex of_block(const Params& p) {
    GroupIndex g;
    g.group = blockIdx.x;
    g.row = blockIdx.y;
    g.head0 = g.group * HEADS_PER_GROUP;
    g.num_groups = p.heads() / HEADS_PER_GROUP;
    return g;
  }
};

// Fills this CTA's ROWS outputs of a batch row with `value`.
template <int ROWS, int THREADS, typename act_t>
__device__ __forceinline__ void fill_outputs(act_t* out, float value) {
  for (int r = threadIdx.x; r < ROWS; r += THREADS) out[r] = from_float<act_t>(value);
}

// A faulted row's outputs: a quiet NaN, so that the fault shows downstream rather than passing.
__device__ __forceinline__ float fault_output() { return __int_as_float(0x7fc00000); }

// Whether batch row slot id `slot` names a slot a step may touch: not the pad, in [0, num_slots).
__device__ __forceinline__ bool slot_usable(int slot, int pad_slot_id, int num_slots) {
  return slot != pad_slot_id && unsigned(slot) < unsigned(num_slots);
}

// A row this CTA must not run reads and writes nothing of the cache: a padded one (slot ==
// pad_slot_id) gets zeros in this CTA's ROWS outputs, one whose slot id is out of range (a graph
// replayed with stale ids) gets NaNs. True where the CTA is then done.
template <int ROWS, int THREADS, typename act_t>
__device__ __forceinline__ bool skip_unusable_row(int slot, int pad_slot_id, int num_slots, act_t* out) {
  if (slot_usable(slot, pad_slot_id, num_slots)) return false;
  fill_outputs<ROWS, THREADS>(out, slot == pad_slot_id ? 0.f : fault_output());
  return true;
}

// Issues every load of a CTA's rows row0.. of head `head` in slot `slot` of a [slots, heads,
// HEAD_ROWS, Tile::kCols] state (first, so that what follows overlaps them); returns where they start.
template <class Tile, int HEAD_ROWS, typename state_t>
__device__ __forceinline__ state_t* load_state_rows(state_t* state, int64_t slot_stride, int slot, int head, int row0,
                                                    typename Tile::Regs& regs) {
  state_t* rows = state + int64_t(slot) * slot_stride + (int64_t(head) * HEAD_ROWS + row0) * Tile::kCols;
  Tile::load(rows, regs);
  return rows;
}

// Modules built with the "device_seed" flag read the stochastic-rounding seed from a device tensor
// (a captured graph can then change it); the others keep it in the launch's parameters, which
// costs no registers.
#ifndef REPLAYSSM_DEVICE_SEED
#define REPLAYSSM_DEVICE_SEED 0
#endif

// The stochastic-rounding seed: on the device where the module reads it there and the engine gave
// one, else the launch's; non-SR kernels read neither.
template <bool SR, class Params>
__device__ __forceinline__ uint64_t rounding_seed(const Params& p) {
  if constexpr (SR) {
#if REPLAYSSM_DEVICE_SEED
    return p.seed_tensor != nullptr ? uint64_t(*p.seed_tensor) : p.seed;
#else
    return p.seed;
#endif
  } else {
    return 0;
  }
}

}  // namespace replayssm
