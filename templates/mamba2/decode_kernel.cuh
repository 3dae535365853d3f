// Mamba-2 decode step, conventional or ReplaySSM, for one token per batch row.
// Framework-agnostic: plain pointers and strides in, no allocation, no host sync.
//
// One CTA handles ROWS headdim rows of one (batch row, head). Its lanes hold whole 16-byte
// chunks of those state rows in registers, loaded before anything else so that the DRAM
// reads overlap the record replay.
//
// ReplaySSM (REPLAY=true): slot s holds a checkpoint S_c and n records (dt, x, B) in rings of
// CAP rows. With j = n + 1 records (the held ones plus this token):
//   y = a(1:j) (S_c q) + sum_i a(i+1:j) dt_i (B_i . q) x_i + D x
// A row flushes when n + 1 >= L: S_c <- a(1:j) S_c + sum_i a(i+1:j) dt_i x_i B_i^T, n <- 0.
// Otherwise it appends this token's record and writes no state. The decision is per slot,
// on the device, so one launch mixes flush and non-flush rows.
// Conventional (REPLAY=false) is the flush path with no held records.
#pragma once
#include "common/dtype.cuh"
#include "common/reduce.cuh"
#include "common/rounding.cuh"

namespace replayssm::mamba2 {

// Cursor words per slot: records held, flush epoch (keys SR noise), CTA arrivals, spare.
constexpr int kCursorWords = 4;

// This lane's share of a . b over N elements (strided by 32 lanes; vectorised when possible).
template <typename T, int N>
__device__ __forceinline__ float lane_dot(const T* __restrict__ a, const T* __restrict__ b, int lane) {
  float acc = 0.f;
  if constexpr (N % 32 == 0 && ((N / 32) * sizeof(T)) % 4 == 0) {
    constexpr int kPer = N / 32;
    float av[kPer], bv[kPer];
    load_as_float<T, kPer>(a + lane * kPer, av);
    load_as_float<T, kPer>(b + lane * kPer, bv);
    #pragma unroll
    for (int k = 0; k < kPer; ++k) acc = fmaf(av[k], bv[k], acc);
  } else {
    for (int k = lane; k < N; k += 32) acc = fmaf(to_float(a[k]), to_float(b[k]), acc);
  }
  return acc;
}

template <typename act_t, typename state_t>
struct Params {
  state_t* state;           // [slots, H, P, N]; slot stride below, rest contiguous
  int64_t state_slot_stride;
  act_t* rec_x;             // [slots, H, CAP, P]
  act_t* rec_b;             // [slots, G, CAP, N]
  float* rec_dt;            // [slots, H, CAP]  (dt after bias and softplus)
  int32_t* cursors;         // [slots, kCursorWords]
  const act_t* x;           // [batch, H, P]
  int64_t x_stride_b, x_stride_h;
  const act_t* z;           // [batch, H, P] or null
  int64_t z_stride_b, z_stride_h;
  const float* dt;          // [batch, H]
  int64_t dt_stride_b, dt_stride_h;
  const float* A;           // [H]
  const float* D;           // [H] or null
  const float* dt_bias;     // [H] or null
  const act_t* B;           // [batch, G, N]
  int64_t b_stride_b, b_stride_g;
  const act_t* C;           // [batch, G, N]
  int64_t c_stride_b, c_stride_g;
  act_t* out;               // [batch, H, P] contiguous
  const int32_t* slot_indices;  // [batch]
  int32_t pad_slot_id;
  int32_t num_heads;
  uint64_t seed;
};

template <int P, int N, int HPG, int L, int CAP, int ROWS, int WARPS, typename act_t, typename state_t,
          bool REPLAY, bool HAS_D, bool HAS_Z, bool HAS_DT_BIAS, bool DT_SOFTPLUS, bool SR>
struct Kernel {
  static constexpr int kThreads = WARPS * 32;
  static constexpr int kVec = 16 / sizeof(state_t);             // state elements per 16 bytes
  static constexpr int kLanesPerRow = (N / kVec) < 32 ? (N / kVec) : 32;
  static constexpr int kChunksPerLane = N / (kVec * kLanesPerRow);
  static constexpr int kRowsPerPass = 32 / kLanesPerRow;
  static constexpr int kRowsPerWarp = ROWS / WARPS;
  static constexpr int kPasses = kRowsPerWarp / kRowsPerPass;
  static constexpr int kSplits = P / ROWS;
  static constexpr int kRecords = REPLAY ? CAP : 1;
  static_assert(N % kVec == 0 && (kLanesPerRow & (kLanesPerRow - 1)) == 0, "dstate must tile 16-byte chunks");
  static_assert(P % ROWS == 0 && ROWS % WARPS == 0 && kRowsPerWarp % kRowsPerPass == 0, "bad row tiling");
  static_assert(N % 32 == 0 || N * sizeof(act_t) % 16 == 0, "dstate too small");

  // Shared memory: per-record scalars, the CTA's x rows of every record, and (flush) every B.
  struct Smem {
    float coef[kRecords];     // a(i+1:j) dt_i (B_i . q): weight of x_i in y
    float weight[kRecords];   // a(i+1:j) dt_i: weight of x_i B_i^T in the fold
    float dot[kRecords];
    float dt[kRecords];
    float total_decay;
    int records;
    float x[kRecords][ROWS];
    float b[kRecords][N];
  };
  static constexpr size_t kSmemBytes = sizeof(Smem);

  static __device__ __forceinline__ void run(const Params<act_t, state_t>& p, Smem& sm) {
    const int split = blockIdx.x % kSplits;
    const int head = blockIdx.x / kSplits;
    const int row = blockIdx.y;
    const int group = head / HPG;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row0 = split * ROWS;
    const int slot = p.slot_indices[row];
    act_t* out = p.out + (int64_t(row) * p.num_heads + head) * P + row0;

    if (slot == p.pad_slot_id) {  // padded row: zero output, touch nothing else
      for (int r = threadIdx.x; r < ROWS; r += kThreads) out[r] = from_float<act_t>(0.f);
      return;
    }

    // 1. Start the state reads first; everything below overlaps them.
    const int lane_row = lane / kLanesPerRow, lane_col = lane % kLanesPerRow;
    state_t* head_state = p.state + int64_t(slot) * p.state_slot_stride + int64_t(head) * P * N;
    Vec16<state_t> s_raw[kPasses][kChunksPerLane];
    #pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int r = row0 + warp * kRowsPerWarp + i * kRowsPerPass + lane_row;
      #pragma unroll
      for (int c = 0; c < kChunksPerLane; ++c)
        s_raw[i][c].load(head_state + int64_t(r) * N + (c * kLanesPerRow + lane_col) * kVec);
    }

    int held = 0;
    if constexpr (REPLAY) held = p.cursors[int64_t(slot) * kCursorWords];
    const int records = held + 1;
    const bool flush = !REPLAY || records >= L;

    // 2. Per-record scalars: dt_i, and the dot B_i . q (one warp per record).
    const act_t* q = p.C + int64_t(row) * p.c_stride_b + int64_t(group) * p.c_stride_g;
    const act_t* b_cur = p.B + int64_t(row) * p.b_stride_b + int64_t(group) * p.b_stride_g;
    const act_t* rec_b = p.rec_b + (int64_t(slot) * (p.num_heads / HPG) + group) * CAP * N;
    if (threadIdx.x == 0) {
      float dt = p.dt[int64_t(row) * p.dt_stride_b + int64_t(head) * p.dt_stride_h];
      if constexpr (HAS_DT_BIAS) dt += p.dt_bias[head];
      if constexpr (DT_SOFTPLUS) dt = dt > 20.f ? dt : log1pf(expf(dt));
      sm.dt[held] = dt;
      sm.records = records;
    }
    for (int i = warp; i < records; i += WARPS) {
      const act_t* b_i = i == held ? b_cur : rec_b + int64_t(i) * N;
      const float acc = group_sum<32>(lane_dot<act_t, N>(b_i, q, lane));
      if (lane == 0) {
        sm.dot[i] = acc;
        if (i != held) sm.dt[i] = p.rec_dt[(int64_t(slot) * p.num_heads + head) * CAP + i];
      }
    }
    // x rows of every record (this CTA's ROWS), and for a flush every B.
    const act_t* x_cur = p.x + int64_t(row) * p.x_stride_b + int64_t(head) * p.x_stride_h + row0;
    const act_t* rec_x = p.rec_x + (int64_t(slot) * p.num_heads + head) * CAP * P + row0;
    for (int e = threadIdx.x; e < records * ROWS; e += kThreads) {
      const int i = e / ROWS, r = e % ROWS;
      sm.x[i][r] = to_float(i == held ? x_cur[r] : rec_x[int64_t(i) * P + r]);
    }
    if (flush) {
      for (int e = threadIdx.x; e < records * N; e += kThreads) {
        const int i = e / N, k = e % N;
        sm.b[i][k] = to_float(i == held ? b_cur[k] : rec_b[int64_t(i) * N + k]);
      }
    }
    __syncthreads();

    // 3. Decays from suffix sums of log-decays, in FP32: a(i+1:j) = exp(sum_{m>i} dt_m A).
    if (warp == 0) {
      const float A = p.A[head];
      float carry = 0.f;  // sum of log-decays of the records above this 32-record chunk
      for (int top = records; top > 0; top -= 32) {
        const int i = top - 32 + lane;
        const float la = i >= 0 ? sm.dt[i] * A : 0.f;
        float suffix = la;  // inclusive suffix sum within the chunk
        #pragma unroll
        for (int offset = 1; offset < 32; offset <<= 1) {
          const float other = __shfl_down_sync(0xffffffffu, suffix, offset);
          if (lane + offset < 32) suffix += other;
        }
        if (i >= 0) {
          const float decay = expf(carry + suffix - la);
          sm.weight[i] = decay * sm.dt[i];
          sm.coef[i] = sm.weight[i] * sm.dot[i];
        }
        carry += __shfl_sync(0xffffffffu, suffix, 0);
      }
      if (lane == 0) sm.total_decay = expf(carry);
    }
    __syncthreads();

    // 4. This lane's slice of q (C), then each row: y = a(1:j) S.q + sum coef_i x_i (+ D x).
    float q_reg[kChunksPerLane][kVec];
    #pragma unroll
    for (int c = 0; c < kChunksPerLane; ++c)
      load_as_float<act_t, kVec>(q + (c * kLanesPerRow + lane_col) * kVec, q_reg[c]);
    const float total = sm.total_decay;
    const float D = HAS_D ? p.D[head] : 0.f;

    #pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int r_local = warp * kRowsPerWarp + i * kRowsPerPass + lane_row;
      float s[kChunksPerLane][kVec];
      #pragma unroll
      for (int c = 0; c < kChunksPerLane; ++c)
        #pragma unroll
        for (int v = 0; v < kVec; ++v) s[c][v] = s_raw[i][c].get(v);

      float y;
      if (flush) {
        // Fold: S <- a(1:j) S + sum_i (a(i+1:j) dt_i x_i[r]) B_i, exact FP32 FMAs.
        #pragma unroll
        for (int c = 0; c < kChunksPerLane; ++c)
          #pragma unroll
          for (int v = 0; v < kVec; ++v) s[c][v] *= total;
        for (int k = 0; k < records; ++k) {
          const float w = sm.weight[k] * sm.x[k][r_local];
          #pragma unroll
          for (int c = 0; c < kChunksPerLane; ++c) {
            const float* b_k = &sm.b[k][(c * kLanesPerRow + lane_col) * kVec];
            #pragma unroll
            for (int v = 0; v < kVec; ++v) s[c][v] = fmaf(w, b_k[v], s[c][v]);
          }
        }
        float acc = 0.f;
        #pragma unroll
        for (int c = 0; c < kChunksPerLane; ++c)
          #pragma unroll
          for (int v = 0; v < kVec; ++v) acc = fmaf(s[c][v], q_reg[c][v], acc);
        y = group_sum<kLanesPerRow>(acc);
        // Write the new checkpoint (stochastically rounded when SR is on).
        const int r = row0 + r_local;
        #pragma unroll
        for (int c = 0; c < kChunksPerLane; ++c) {
          Vec16<state_t> o;
          const int col = (c * kLanesPerRow + lane_col) * kVec;
          #pragma unroll
          for (int v = 0; v < kVec; ++v) {
            if constexpr (SR) {
              const uint64_t element = (uint64_t(head) * P + r) * N + col + v;
              const uint64_t epoch = REPLAY ? uint64_t(p.cursors[int64_t(slot) * kCursorWords + 1]) : 0;
              o.set(v, round_stochastic<state_t>(s[c][v], rounding_bits(p.seed, (uint64_t(slot) << 32) | epoch, element)));
            } else {
              o.set(v, from_float<state_t>(s[c][v]));
            }
          }
          o.store(head_state + int64_t(r) * N + col);
        }
      } else {
        float acc = 0.f;
        #pragma unroll
        for (int c = 0; c < kChunksPerLane; ++c)
          #pragma unroll
          for (int v = 0; v < kVec; ++v) acc = fmaf(s[c][v], q_reg[c][v], acc);
        y = total * group_sum<kLanesPerRow>(acc);
        for (int k = 0; k < records; ++k) y = fmaf(sm.coef[k], sm.x[k][r_local], y);
      }
      if (lane_col == 0) {
        const float x_r = sm.x[held][r_local];
        if constexpr (HAS_D) y = fmaf(D, x_r, y);
        if constexpr (HAS_Z) {
          const float zv = to_float(p.z[int64_t(row) * p.z_stride_b + int64_t(head) * p.z_stride_h + row0 + r_local]);
          y *= zv / (1.f + expf(-zv));
        }
        out[r_local] = from_float<act_t>(y);
      }
    }

    if constexpr (REPLAY) {
      if (!flush) {  // append this token's record at ring row `held`
        act_t* rx = p.rec_x + ((int64_t(slot) * p.num_heads + head) * CAP + held) * P + row0;
        for (int r = threadIdx.x; r < ROWS; r += kThreads) rx[r] = x_cur[r];
        if (split == 0) {
          if (threadIdx.x == 0) p.rec_dt[(int64_t(slot) * p.num_heads + head) * CAP + held] = sm.dt[held];
          if (head % HPG == 0)
            for (int k = threadIdx.x; k < N; k += kThreads) rec_b_write(p, slot, group, held, k, b_cur[k]);
        }
      }
      // The last CTA of this row to finish advances the slot's cursor: every CTA has read it.
      __syncthreads();
      if (threadIdx.x == 0) {
        __threadfence();
        int32_t* cur = p.cursors + int64_t(slot) * kCursorWords;
        const int ctas = p.num_heads * kSplits;
        if (atomicAdd(cur + 2, 1) == ctas - 1) {
          cur[0] = flush ? 0 : records;
          if (flush) cur[1] += 1;
          cur[2] = 0;
        }
      }
    }
  }

  static __device__ __forceinline__ void rec_b_write(const Params<act_t, state_t>& p, int slot, int group,
                                                     int pos, int k, act_t v) {
    p.rec_b[((int64_t(slot) * (p.num_heads / HPG) + group) * CAP + pos) * N + k] = v;
  }
};

template <class K, typename act_t, typename state_t>
__global__ void __launch_bounds__(K::kThreads) decode_kernel(const Params<act_t, state_t> p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  K::run(p, *reinterpret_cast<typename K::Smem*>(smem_raw));
}

template <class K, typename act_t, typename state_t>
cudaError_t launch(const Params<act_t, state_t>& p, int batch, cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  auto kernel = decode_kernel<K, act_t, state_t>;
  if (K::kSmemBytes > 48 * 1024) {
    static bool raised = false;  // once per instantiation
    if (!raised) {
      cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             int(K::kSmemBytes));
      if (err != cudaSuccess) return err;
      raised = true;
    }
  }
  dim3 grid(p.num_heads * K::kSplits, batch);
  kernel<<<grid, K::kThreads, K::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace replayssm::mamba2
