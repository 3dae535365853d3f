// A checkpoint copy in storage and in a CTA's registers, for every format: FP32, FP16, BF16, FP8
// e4m3 with one FP32 decode scale per state row, and NVFP4 (e2m1 codes, an e4m3 scale per 16
// values along a row, an FP32 scale per head; docs/precision.md). The decode kernels of every
// family load, decode and store their checkpoint rows only through this file.
#pragma once
#include <type_traits>
#include "common/fp8.cuh"
#include "common/nvfp4.cuh"
#include "common/replay.cuh"

namespace replayssm {

// Whether a format keeps an FP32 decode scale per state row beside its codes.
template <typename T> constexpr bool kRowScaled = std::is_same_v<T, e4m3>;
// Whether it keeps e4m3 scales per block of 16 values and an FP32 scale per head (NVFP4).
template <typename T> constexpr bool kBlockScaled = std::is_same_v<T, nvfp4x2>;
constexpr int kBlockValues = nvfp4::kBlock;

// Where one copy lives: codes [slots, heads, HEAD_ROWS, cols] (slots `slot_stride` elements
// apart); row-scaled formats: scales [slots, heads, HEAD_ROWS]; block-scaled ones: scales
// [slots, heads] (per head) and blocks [slots, heads, HEAD_ROWS, cols / 16] (e4m3 codes); each with
// its own slot stride (its block size when packed), the rest contiguous.
template <typename T>
struct CheckpointView {
  T* codes;
  int64_t slot_stride;
  float* scales;
  int64_t scale_slot_stride;
  uint8_t* blocks;
  int64_t block_slot_stride;
};

// The two copies in any family's kernel Params: the carried checkpoint (state_* fields) and the
// copy a non-flush step reads, the read copy (read_* fields) where read_t is not void, else the
// carried one.
template <typename state_t, class Params>
__device__ __forceinline__ CheckpointView<state_t> carried_view(const Params& p) {
  return {p.state, p.state_slot_stride, p.state_scale, p.state_scale_slot_stride, p.state_blocks, p.state_block_slot_stride};
}
template <typename state_t, typename read_t, class Params>
__device__ __forceinline__ CheckpointView<std::conditional_t<std::is_void_v<read_t>, state_t, read_t>> read_copy_view(
    const Params& p) {
  if constexpr (std::is_void_v<read_t>) {
    return carried_view<state_t>(p);
  } else {
    return {static_cast<read_t*>(p.read_state), p.read_slot_stride, p.read_scale, p.read_scale_slot_stride, p.read_blocks,
            p.read_block_slot_stride};
  }
}

// A CTA's rows row0.. of one head's copy: where they live, for loads and stores.
template <typename T, int HEAD_ROWS, int COLS>
struct CopyRows {
  T* codes;         // row0's first element
  float* scales;    // row0's scale (row-scaled), the head's scale (block-scaled), else null
  uint8_t* blocks;  // row0's first block code (block-scaled), else null

  __device__ __forceinline__ static CopyRows of(const CheckpointView<T>& v, int slot, int heads, int head, int row0) {
    (void)heads;  // (the slot strides place each slot's heads)
    CopyRows at{v.codes + int64_t(slot) * v.slot_stride + (int64_t(head) * HEAD_ROWS + row0) * COLS / kValuesPerElement<T>,
                nullptr, nullptr};
    if constexpr (kRowScaled<T>) at.scales = v.scales + int64_t(slot) * v.scale_slot_stride + int64_t(head) * HEAD_ROWS + row0;
    if constexpr (kBlockScaled<T>) {
      at.scales = v.scales + int64_t(slot) * v.scale_slot_stride + head;
      at.blocks = v.blocks + int64_t(slot) * v.block_slot_stride + (int64_t(head) * HEAD_ROWS + row0) * (COLS / kBlockValues);
    }
    return at;
  }
  __device__ __forceinline__ T* row_codes(int r) const { return codes + int64_t(r) * COLS / kValuesPerElement<T>; }
  __device__ __forceinline__ uint8_t* row_blocks(int r) const { return blocks + int64_t(r) * (COLS / kBlockValues); }
};

// A CTA's rows row0.. of one head's copy, loaded into registers (every load issued at once), with
// where they live for the store.
template <class Tile, typename T, int HEAD_ROWS>
struct TileCheckpoint {
  using Tiling = Tile;  // (for code generic over the copy it reads)
  using Format = T;
  static constexpr bool kScaled = kRowScaled<T>;
  static constexpr bool kBlocks = kBlockScaled<T>;
  static_assert(!kBlocks || Tile::kVec == 2 * kBlockValues, "an NVFP4 chunk holds two blocks");
  typename Tile::Regs raw;
  float scale[kScaled ? Tile::kPasses : 1];
  uint16_t block[kBlocks ? Tile::kPasses : 1][kBlocks ? Tile::kChunksPerLane : 1];  // a chunk's two block codes
  float head_scale;
  CopyRows<T, HEAD_ROWS, Tile::kCols> at;

  __device__ __forceinline__ void load(const CheckpointView<T>& v, int slot, int heads, int head, int row0) {
    at = CopyRows<T, HEAD_ROWS, Tile::kCols>::of(v, slot, heads, head, row0);
    Tile::load(at.codes, raw);
    if constexpr (kScaled) {
      #pragma unroll
      for (int i = 0; i < Tile::kPasses; ++i) scale[i] = at.scales[Tile::row(i)];
    }
    if constexpr (kBlocks) {
      head_scale = *at.scales;
      #pragma unroll
      for (int i = 0; i < Tile::kPasses; ++i)
        #pragma unroll
        for (int c = 0; c < Tile::kChunksPerLane; ++c)
          block[i][c] = *reinterpret_cast<const uint16_t*>(at.row_blocks(Tile::row(i)) + Tile::col(c) / kBlockValues);
    }
  }

  // Pass i's values (decoded: code times its scales) times `mult`, one multiply per element.
  __device__ __forceinline__ void values(int i, float mult, float (&out)[Tile::kChunksPerLane][Tile::kVec]) const {
    if constexpr (kBlocks) {
      #pragma unroll
      for (int c = 0; c < Tile::kChunksPerLane; ++c) {
        const uint32_t* words = reinterpret_cast<const uint32_t*>(&raw[i][c].raw);
        #pragma unroll
        for (int b = 0; b < 2; ++b) {
          const float m = nvfp4::block_multiplier((block[i][c] >> (8 * b)) & 0xffu, head_scale) * mult;
          #pragma unroll
          for (int w = 0; w < 2; ++w) {
            float v[8];
            nvfp4::decode_word(words[2 * b + w], m, v);
            #pragma unroll
            for (int e = 0; e < 8; ++e) out[c][16 * b + 8 * w + e] = v[e];
          }
        }
      }
    } else {
      const float m = kScaled ? scale[i] * mult : mult;
      #pragma unroll
      for (int c = 0; c < Tile::kChunksPerLane; ++c) {
        raw[i][c].values(out[c]);
        #pragma unroll
        for (int e = 0; e < Tile::kVec; ++e) out[c][e] *= m;
      }
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

// What a flush's store of a copy of format T needs from the whole CTA before any row: the head
// scale of a block-scaled copy (the CTA holds the whole head), from the amax of the new state s;
// its first thread stores it. Called by every thread of the CTA where T is block-scaled; 0 else.
template <class Tile, typename T, int HEAD_ROWS, int COLS>
__device__ __forceinline__ float prepare_store(const CopyRows<T, HEAD_ROWS, COLS>& at,
                                               const float (&s)[Tile::kPasses][Tile::kChunksPerLane][Tile::kVec]) {
  if constexpr (kBlockScaled<T>) {
    static_assert(Tile::kRowsPerWarp * (Tile::kThreads / 32) == HEAD_ROWS, "an NVFP4 head must lie in one CTA");
    __shared__ float warp_amax[32];
    float amax = 0.f;
    #pragma unroll
    for (int i = 0; i < Tile::kPasses; ++i)
      #pragma unroll
      for (int c = 0; c < Tile::kChunksPerLane; ++c)
        #pragma unroll
        for (int e = 0; e < Tile::kVec; ++e) amax = fmaxf(amax, fabsf(s[i][c][e]));
    amax = group_max<32>(amax);
    if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
    __syncthreads();
    amax = 0.f;
    #pragma unroll
    for (int w = 0; w < Tile::kThreads / 32; ++w) amax = fmaxf(amax, warp_amax[w]);
    const float head = nvfp4::head_scale(amax);
    if (threadIdx.x == 0) *at.scales = head;
    return head;
  } else {
    return 0.f;
  }
}

// Stores this lane's chunks of a row into a block-scaled (NVFP4) copy: a block's 16 values lie in
// one chunk or in the chunks of 16 / VEC neighbouring lanes, whose amax they reduce; the block's
// first lane stores its scale code.
template <class Tile, bool SR>
__device__ __forceinline__ void store_blocks(nvfp4x2* row, uint8_t* blocks, const float (&s)[Tile::kChunksPerLane][Tile::kVec],
                                             float head, uint64_t key, uint64_t element) {
  constexpr int kVec = Tile::kVec;
  constexpr int kLanesPerBlock = kVec < kBlockValues ? kBlockValues / kVec : 1;
  constexpr int kBlocksPerChunk = kVec < kBlockValues ? 1 : kVec / kBlockValues;
  constexpr int kGroup = kVec < kBlockValues ? kVec : kBlockValues;  // a block's values in this lane
  static_assert(Tile::kLanesPerRow % kLanesPerBlock == 0, "a block's lanes must share its row");
  #pragma unroll
  for (int c = 0; c < Tile::kChunksPerLane; ++c) {
    const int col = Tile::col(c);
    uint32_t words[kVec / 8 > 0 ? kVec / 8 : 1] = {};
    uint32_t packed = 0;  // fewer than 8 values: their nibbles
    #pragma unroll
    for (int b = 0; b < kBlocksPerChunk; ++b) {
      float amax = 0.f;
      #pragma unroll
      for (int e = 0; e < kGroup; ++e) amax = fmaxf(amax, fabsf(s[c][b * kGroup + e]));
      amax = group_max<kLanesPerBlock>(amax);
      const uint32_t code = nvfp4::block_code(amax, head);
      const float inverse = nvfp4::block_inverse(code, head);
      if (kBlocksPerChunk > 1 || (threadIdx.x % 32) % kLanesPerBlock == 0)
        blocks[(col + b * kGroup) / kBlockValues] = static_cast<uint8_t>(code);
      #pragma unroll
      for (int e = 0; e < kGroup; e += 2) {
        const int v = b * kGroup + e;
        uint32_t bits = 0;
        if constexpr (SR) bits = pair_bits(key, static_cast<uint32_t>((element + col + v) >> 1));
        const uint32_t pair = nvfp4::encode<SR>(s[c][v], inverse, bits & 0xffffu) |
                              nvfp4::encode<SR>(s[c][v + 1], inverse, bits >> 16) << 4;
        if constexpr (kVec >= 8) words[v / 8] |= pair << (4 * (v % 8));
        else packed |= pair << (4 * v);
      }
    }
    nvfp4x2* dst = row + col / 2;
    if constexpr (kVec == 32) *reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);
    else if constexpr (kVec == 16) *reinterpret_cast<uint2*>(dst) = make_uint2(words[0], words[1]);
    else if constexpr (kVec == 8) *reinterpret_cast<uint32_t*>(dst) = words[0];
    else *reinterpret_cast<uint16_t*>(dst) = static_cast<uint16_t>(packed);
  }
}

// Stores this lane's chunks of pass i's row r (s, laid out as Tile) into a copy of format T at
// `at`: row-scaled formats reduce the row's amax over the lanes that share it first and store its
// scale; block-scaled ones take the head scale from prepare_store. `element`: the row's first
// element in the slot (SR).
template <class Tile, typename T, bool SR, int HEAD_ROWS, int COLS>
__device__ __forceinline__ void store_row(const CopyRows<T, HEAD_ROWS, COLS>& at, int r,
                                          const float (&s)[Tile::kChunksPerLane][Tile::kVec], uint64_t key,
                                          uint64_t element, float head = 0.f) {
  if constexpr (kBlockScaled<T>) {
    store_blocks<Tile, SR>(at.row_codes(r), at.row_blocks(r), s, head, key, element);
  } else {
    float inverse = 1.f;
    if constexpr (kRowScaled<T>) {
      float amax = 0.f;
      #pragma unroll
      for (int c = 0; c < Tile::kChunksPerLane; ++c)
        #pragma unroll
        for (int e = 0; e < Tile::kVec; ++e) amax = fmaxf(amax, fabsf(s[c][e]));
      const float scale = fp8::row_scale(group_max<Tile::kLanesPerRow>(amax));
      inverse = fp8::row_inverse(scale);
      if (Tile::row_leader()) at.scales[r] = scale;
    }
    T* row = at.row_codes(r);
    #pragma unroll
    for (int c = 0; c < Tile::kChunksPerLane; ++c)
      store_values<T, SR, Tile::kVec>(row + Tile::col(c), s[c], key, element + Tile::col(c), inverse);
  }
}

// The rounding key of a slot's read copy (separate mode): a stream apart from the carried copy's,
// so that two roundings of one value draw independent bits.
template <bool SR>
__device__ __forceinline__ uint64_t read_copy_rounding_key(uint64_t seed, int slot, uint64_t epoch) {
  return SR ? rounding_key(seed, (uint64_t(1) << 63) | (uint64_t(slot) << 32) | epoch) : 0;
}

}  // namespace replayssm
