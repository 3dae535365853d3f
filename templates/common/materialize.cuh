// Prefix states for engines (materialize_step): each named slot's exact FP32 state, its carried
// checkpoint decoded with the decode kernels' TileCheckpoint and its held records folded in flush
// order, written to a caller-owned [batch, heads, ROWS, COLS] float32 output. One CTA per (head,
// batch row); a family supplies Records, which stages record i of a head in shared memory as
//   S[r][c] <- S[r][c] * decay[c] + row[r] * col[c]
// (with kCorrect, row[r] <- beta * (row[r] - sum_c S[r][c] col[c]) first: separate mode's u,
// recomputed from the carried copy as its flush does). Sequential in the records, so it agrees
// with the torch path's closed form to FP32 rounding, not bit for bit.
#pragma once
#include <cmath>
#include "common/checkpoint.cuh"
#include "common/reduce.cuh"

namespace replayssm {
namespace materialize {

// One record of a head as Records::stage leaves it for the fold.
template <int ROWS, int COLS>
struct Staged {
  float row[ROWS];
  float col[COLS];
  float decay[COLS];
  float beta;
};

// Which slots a launch reads and where their states go.
struct Rows {
  const int32_t* slot_ids;  // [batch]; negative: a pad, its output rows untouched
  const int32_t* cursors;   // [slots, 4] (word 0: records held)
  int64_t cursor_stride;
  float* out;  // [batch, heads, ROWS, COLS]
  int num_slots, heads, cap;
};

// Warps per CTA: the most (up to 8) whose rows tile a head in whole passes of the wide tiling.
template <typename state_t, int ROWS, int COLS>
constexpr int warps() {
  constexpr int vecs = COLS / kChunkValues<state_t>;
  constexpr int rows_per_pass = 32 / (vecs < 32 ? vecs : 32);
  for (int w = 8; w > 1; w /= 2)
    if (ROWS % w == 0 && (ROWS / w) % rows_per_pass == 0) return w;
  return 1;
}

template <class Records, class Tile, typename state_t, int ROWS>
__global__ void __launch_bounds__(Tile::kThreads) kernel(CheckpointView<state_t> view, Rows where,
                                                         typename Records::Args args) {
  constexpr int kCols = Tile::kCols;
  __shared__ __align__(16) Staged<ROWS, kCols> st;
  const int head = blockIdx.x, b = blockIdx.y;
  const int slot = where.slot_ids[b];
  if (slot < 0) return;
  float* out = where.out + (int64_t(b) * where.heads + head) * ROWS * kCols;
  const int held = slot < where.num_slots ? where.cursors[int64_t(slot) * where.cursor_stride] : -1;
  if (held < 0 || held >= where.cap) {  // a stray id or corrupted cursor: NaN, as the torch path writes
    for (int e = threadIdx.x; e < ROWS * kCols; e += Tile::kThreads) out[e] = __int_as_float(0x7fc00000);
    return;
  }
  TileCheckpoint<Tile, state_t, ROWS> ck;
  ck.load(view, slot, where.heads, head, 0);
  float s[Tile::kPasses][Tile::kChunksPerLane][Tile::kVec];
  tile_values(ck, 1.f, s);
  for (int i = 0; i < held; ++i) {
    __syncthreads();  // everyone is done with record i - 1's stage
    Records::stage(args, slot, head, i, st);
    __syncthreads();
    float col[Tile::kChunksPerLane][Tile::kVec], decay[Tile::kChunksPerLane][Tile::kVec];
    Tile::slice(st.col, col);
    Tile::slice(st.decay, decay);
    #pragma unroll
    for (int p = 0; p < Tile::kPasses; ++p) {
      #pragma unroll
      for (int c = 0; c < Tile::kChunksPerLane; ++c)
        #pragma unroll
        for (int e = 0; e < Tile::kVec; ++e) s[p][c][e] *= decay[c][e];
      float row = st.row[Tile::row(p)];
      if constexpr (Records::kCorrect) row = st.beta * (row - group_sum<Tile::kLanesPerRow>(Tile::dot(s[p], col)));
      #pragma unroll
      for (int c = 0; c < Tile::kChunksPerLane; ++c)
        #pragma unroll
        for (int e = 0; e < Tile::kVec; ++e) s[p][c][e] = fmaf(row, col[c][e], s[p][c][e]);
    }
  }
  #pragma unroll
  for (int p = 0; p < Tile::kPasses; ++p)
    #pragma unroll
    for (int c = 0; c < Tile::kChunksPerLane; ++c) {
      float4* dst = reinterpret_cast<float4*>(out + int64_t(Tile::row(p)) * kCols + Tile::col(c));
      #pragma unroll
      for (int e = 0; e < Tile::kVec; e += 4) dst[e / 4] = make_float4(s[p][c][e], s[p][c][e + 1], s[p][c][e + 2], s[p][c][e + 3]);
    }
}

// Launches the kernel on (heads, batch) for a head state of ROWS x COLS.
template <class Records, typename state_t, int ROWS, int COLS>
cudaError_t launch(const CheckpointView<state_t>& view, const Rows& where, const typename Records::Args& args, int batch,
                   cudaStream_t stream) {
  using Tile = RowTiling<state_t, COLS, ROWS, warps<state_t, ROWS, COLS>(), /*WIDE=*/true>;
  static_assert(Tile::kVec % 4 == 0, "rows are stored as float4");
  if (batch == 0 || where.heads == 0) return cudaSuccess;
  kernel<Records, Tile, state_t, ROWS><<<dim3(where.heads, batch), Tile::kThreads, 0, stream>>>(view, where, args);
  return cudaGetLastError();
}

}  // namespace materialize
}  // namespace replayssm
