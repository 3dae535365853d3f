// A checkpoint copy in storage and in a CTA's registers, for every format: FP32, FP16, BF16, and
// FP8 e4m3 with one FP32 decode scale per state row (docs/precision.md). The decode kernels of
// every family load, decode and store their checkpoint rows only through this file.
#pragma once
#include <type_traits>
#include "common/fp8.cuh"
#include "common/replay.cuh"

namespace replayssm {

// Whether a format keeps an FP32 decode scale per state row beside its codes.
template <typename T> constexpr bool kRowScaled = std::is_same_v<T, e4m3>;

// Where one copy lives: codes [slots, heads, HEAD_ROWS, cols] (slots `slot_stride` elements
// apart) and, for row-scaled formats, scales [slots, heads, HEAD_ROWS], packed.
template <typename T>
struct CheckpointView {
  T* codes;
  int64_t slot_stride;
  float* scales;
};

// A CTA's rows row0.. of one head's copy, loaded into registers (every load issued at once), with
// where they live for the store.
template <class Tile, typename T, int HEAD_ROWS>
struct TileCheckpoint {
  static constexpr bool kScaled = kRowScaled<T>;
  typename Tile::Regs raw;
  float scale[kScaled ? Tile::kPasses : 1];
  T* rows;
  float* scales;

  __device__ __forceinline__ void load(const CheckpointView<T>& v, int slot, int heads, int head, int row0) {
    rows = v.codes + int64_t(slot) * v.slot_stride + (int64_t(head) * HEAD_ROWS + row0) * Tile::kCols;
    Tile::load(rows, raw);
    if constexpr (kScaled) {
      scales = v.scales + (int64_t(slot) * heads + head) * HEAD_ROWS + row0;
      #pragma unroll
      for (int i = 0; i < Tile::kPasses; ++i) scale[i] = scales[Tile::row(i)];
    } else {
      scales = nullptr;
    }
  }

  // Pass i's values (decoded: code times row scale) times `mult`, one multiply per element.
  __device__ __forceinline__ void values(int i, float mult, float (&out)[Tile::kChunksPerLane][Tile::kVec]) const {
    const float m = kScaled ? scale[i] * mult : mult;
    #pragma unroll
    for (int c = 0; c < Tile::kChunksPerLane; ++c) {
      raw[i][c].values(out[c]);
      #pragma unroll
      for (int e = 0; e < Tile::kVec; ++e) out[c][e] *= m;
    }
  }
};

// The FP32 view of one pass of a TileCheckpoint, for every pass: s[i][c][e].
template <class Tile, typename T, int HEAD_ROWS>
__device__ __forceinline__ void tile_values(const TileCheckpoint<Tile, T, HEAD_ROWS>& ck, float mult,
                                            float (&s)[Tile::kPasses][Tile::kChunksPerLane][Tile::kVec]) {
  #pragma unroll
  for (int i = 0; i < Tile::kPasses; ++i) ck.values(i, mult, s[i]);
}

// Stores this lane's chunks of pass i's row (s, laid out as Tile) into a copy of format T: `row`
// is the row's first code, `row_scale` its scale (row-scaled formats: the row's amax is reduced
// over the lanes that share it first), `element` the row's first element in the slot.
template <class Tile, typename T, bool SR>
__device__ __forceinline__ void store_row(T* row, float* row_scale, const float (&s)[Tile::kChunksPerLane][Tile::kVec],
                                          uint64_t key, uint64_t element) {
  float inverse = 1.f;
  if constexpr (kRowScaled<T>) {
    float amax = 0.f;
    #pragma unroll
    for (int c = 0; c < Tile::kChunksPerLane; ++c)
      #pragma unroll
      for (int e = 0; e < Tile::kVec; ++e) amax = fmaxf(amax, fabsf(s[c][e]));
    const float scale = fp8::row_scale(group_max<Tile::kLanesPerRow>(amax));
    inverse = fp8::row_inverse(scale);
    if (Tile::row_leader()) *row_scale = scale;
  }
  #pragma unroll
  for (int c = 0; c < Tile::kChunksPerLane; ++c)
    store_values<T, SR, Tile::kVec>(row + Tile::col(c), s[c], key, element + Tile::col(c), inverse);
}

// The rounding key of a slot's read copy (separate mode): a stream apart from the carried copy's,
// so that two roundings of one value draw independent bits.
template <bool SR>
__device__ __forceinline__ uint64_t read_copy_rounding_key(uint64_t seed, int slot, uint64_t epoch) {
  return SR ? rounding_key(seed, (uint64_t(1) << 63) | (uint64_t(slot) << 32) | epoch) : 0;
}

}  // namespace replayssm
