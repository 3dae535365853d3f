// Gated DeltaNet decode step, conventional or ReplaySSM, for one token per batch row.
// Framework-agnostic: plain pointers and strides in, no allocation, no host sync.
//
// One CTA handles ROWS value rows of one (batch row, value head). Its lanes hold 16-byte chunks
// of those state rows (S is [V, K], K contiguous) in registers, loaded first.
//
// With j = n + 1 records (n held plus this token), decays dec_i = a(i+1:j), total = a(1:j):
//   alpha_j S_{j-1} k_j = total (S_c k_j) + sum_{i<n} dec_i (k_i . k_j) u_i
//   u_j = beta_j (v_j - alpha_j S_{j-1} k_j)
//   o_j = total (S_c q_j) + sum_{i<=n} dec_i (k_i . q_j) u_i
// so one read of S_c serves both S_c k_j and S_c q_j, and every value row is independent.
// Flush (n + 1 >= L): S_c <- total S_c + sum_{i<=n} dec_i u_i k_i^T, n <- 0. Otherwise append
// (g_j, u_j, k_j) and write no state. Conventional (REPLAY=false) is the flush with n = 0.
// k records are stored raw and L2-normalised again on replay, so they stay exact inputs.
#pragma once
#include "common/dtype.cuh"
#include "common/reduce.cuh"
#include "common/rounding.cuh"

namespace replayssm::gdn {

constexpr int kCursorWords = 4;  // records held, flush epoch, CTA arrivals, spare
constexpr float kNormEps = 1e-6f;

template <typename act_t, typename state_t>
struct Params {
  state_t* state;           // [slots, HV, V, K]
  int64_t state_slot_stride;
  float* rec_u;             // [slots, HV, CAP, V]
  act_t* rec_k;             // [slots, H, CAP, K] raw k
  float* rec_g;             // [slots, HV, CAP] log-decay
  int32_t* cursors;         // [slots, kCursorWords]
  const act_t* q;           // [batch, H, K]
  int64_t q_stride_b, q_stride_h;
  const act_t* k;           // [batch, H, K]
  int64_t k_stride_b, k_stride_h;
  const act_t* v;           // [batch, HV, V]
  int64_t v_stride_b, v_stride_h;
  const float* gate_a;      // g (log-decay) or a, [batch, HV]
  int64_t ga_stride_b, ga_stride_h;
  const float* gate_b;      // beta or b, [batch, HV]
  int64_t gb_stride_b, gb_stride_h;
  const float* A_log;       // [HV] (gates in kernel)
  const float* dt_bias;     // [HV] (gates in kernel)
  act_t* out;               // [batch, HV, V] contiguous
  const int32_t* slot_indices;
  int32_t pad_slot_id;
  int32_t num_v_heads;
  float scale;
  uint64_t seed;
};

// Three dots over K in one warp pass: a.b, a.c, a.a (per lane, before the warp sum).
template <typename T, int K>
__device__ __forceinline__ void lane_dots3(const T* __restrict__ a, const T* __restrict__ b,
                                           const T* __restrict__ c, int lane, float& ab, float& ac,
                                           float& aa) {
  ab = ac = aa = 0.f;
  if constexpr (K % 32 == 0 && ((K / 32) * sizeof(T)) % 4 == 0) {
    constexpr int kPer = K / 32;
    float av[kPer], bv[kPer], cv[kPer];
    load_as_float<T, kPer>(a + lane * kPer, av);
    load_as_float<T, kPer>(b + lane * kPer, bv);
    load_as_float<T, kPer>(c + lane * kPer, cv);
    #pragma unroll
    for (int e = 0; e < kPer; ++e) {
      ab = fmaf(av[e], bv[e], ab);
      ac = fmaf(av[e], cv[e], ac);
      aa = fmaf(av[e], av[e], aa);
    }
  } else {
    for (int e = lane; e < K; e += 32) {
      const float x = to_float(a[e]);
      ab = fmaf(x, to_float(b[e]), ab);
      ac = fmaf(x, to_float(c[e]), ac);
      aa = fmaf(x, x, aa);
    }
  }
}

template <int K, int V, int VPH, int L, int CAP, int ROWS, int WARPS, typename act_t, typename state_t,
          bool REPLAY, bool L2NORM, bool GATES_IN_KERNEL, bool SR>
struct Kernel {
  static constexpr int kThreads = WARPS * 32;
  static constexpr int kVec = 16 / sizeof(state_t);
  static constexpr int kLanesPerRow = (K / kVec) < 32 ? (K / kVec) : 32;
  static constexpr int kChunksPerLane = K / (kVec * kLanesPerRow);
  static constexpr int kRowsPerPass = 32 / kLanesPerRow;
  static constexpr int kRowsPerWarp = ROWS / WARPS;
  static constexpr int kPasses = kRowsPerWarp / kRowsPerPass;
  static constexpr int kSplits = V / ROWS;
  static constexpr int kRecords = REPLAY ? CAP : 1;
  static_assert(K % kVec == 0 && (kLanesPerRow & (kLanesPerRow - 1)) == 0, "head_k_dim must tile 16-byte chunks");
  static_assert(V % ROWS == 0 && ROWS % WARPS == 0 && kRowsPerWarp % kRowsPerPass == 0, "bad row tiling");

  struct Smem {
    float kk[kRecords];      // raw k_i . k_j
    float kq[kRecords];      // raw k_i . q_j
    float k2[kRecords];      // raw |k_i|^2
    float g[kRecords];       // log-decays
    float coef_k[kRecords];  // dec_i (k^_i . k^_j): weight of u_i in alpha_j S_{j-1} k^_j
    float coef_q[kRecords];  // dec_i (k^_i . q^_j): weight of u_i in o_j
    float fold[kRecords];    // dec_i / |k_i|: weight of u_i k_i(raw) in the fold
    float total_decay, beta, q2, q_norm, k_norm;
    float u[kRecords][ROWS]; // held u records (this CTA's rows)
    float k[kRecords][K];    // raw k of every record (flush only)
  };
  static constexpr size_t kSmemBytes = sizeof(Smem);

  static __device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

  static __device__ __forceinline__ void run(const Params<act_t, state_t>& p, Smem& sm) {
    const int split = blockIdx.x % kSplits;
    const int vhead = blockIdx.x / kSplits;
    const int khead = vhead / VPH;
    const int num_k_heads = p.num_v_heads / VPH;
    const int row = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row0 = split * ROWS;
    const int slot = p.slot_indices[row];
    act_t* out = p.out + (int64_t(row) * p.num_v_heads + vhead) * V + row0;

    if (slot == p.pad_slot_id) {
      for (int r = threadIdx.x; r < ROWS; r += kThreads) out[r] = from_float<act_t>(0.f);
      return;
    }

    // 1. Start the state reads first.
    const int lane_row = lane / kLanesPerRow, lane_col = lane % kLanesPerRow;
    state_t* head_state = p.state + int64_t(slot) * p.state_slot_stride + int64_t(vhead) * V * K;
    Vec16<state_t> s_raw[kPasses][kChunksPerLane];
    #pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int r = row0 + warp * kRowsPerWarp + i * kRowsPerPass + lane_row;
      #pragma unroll
      for (int c = 0; c < kChunksPerLane; ++c)
        s_raw[i][c].load(head_state + int64_t(r) * K + (c * kLanesPerRow + lane_col) * kVec);
    }

    int held = 0;
    if constexpr (REPLAY) held = p.cursors[int64_t(slot) * kCursorWords];
    const int records = held + 1;
    const bool flush = !REPLAY || records >= L;

    // 2. Gates of this token, and per-record dots (one warp per record).
    const act_t* q = p.q + int64_t(row) * p.q_stride_b + int64_t(khead) * p.q_stride_h;
    const act_t* k_cur = p.k + int64_t(row) * p.k_stride_b + int64_t(khead) * p.k_stride_h;
    const act_t* rec_k = p.rec_k + (int64_t(slot) * num_k_heads + khead) * CAP * K;
    const float* rec_u = p.rec_u + (int64_t(slot) * p.num_v_heads + vhead) * CAP * V + row0;
    if (threadIdx.x == 0) {
      float ga = p.gate_a[int64_t(row) * p.ga_stride_b + int64_t(vhead) * p.ga_stride_h];
      float gb = p.gate_b[int64_t(row) * p.gb_stride_b + int64_t(vhead) * p.gb_stride_h];
      if constexpr (GATES_IN_KERNEL) {
        ga = -expf(p.A_log[vhead]) * softplus(ga + p.dt_bias[vhead]);
        gb = 1.f / (1.f + expf(-gb));
      }
      sm.g[held] = ga;
      sm.beta = gb;
    }
    for (int i = warp; i < records; i += WARPS) {
      const act_t* k_i = i == held ? k_cur : rec_k + int64_t(i) * K;
      float kk, kq, k2;
      lane_dots3<act_t, K>(k_i, k_cur, q, lane, kk, kq, k2);
      kk = group_sum<32>(kk);
      kq = group_sum<32>(kq);
      k2 = group_sum<32>(k2);
      if (i == held) {
        float q2, unused_a, unused_b;
        lane_dots3<act_t, K>(q, q, q, lane, q2, unused_a, unused_b);
        q2 = group_sum<32>(q2);
        if (lane == 0) sm.q2 = q2;
      }
      if (lane == 0) {
        sm.kk[i] = kk;
        sm.kq[i] = kq;
        sm.k2[i] = k2;
        if (i != held) sm.g[i] = p.rec_g[(int64_t(slot) * p.num_v_heads + vhead) * CAP + i];
      }
    }
    for (int e = threadIdx.x; e < held * ROWS; e += kThreads) {
      const int i = e / ROWS, r = e % ROWS;
      sm.u[i][r] = rec_u[int64_t(i) * V + r];
    }
    if (flush) {
      for (int e = threadIdx.x; e < records * K; e += kThreads) {
        const int i = e / K, c = e % K;
        sm.k[i][c] = to_float(i == held ? k_cur[c] : rec_k[int64_t(i) * K + c]);
      }
    }
    __syncthreads();

    // 3. Norms, then decays from suffix sums of log-decays (FP32), then replay coefficients.
    if (warp == 0) {
      const float rk_j = L2NORM ? rsqrtf(sm.k2[held] + kNormEps) : 1.f;
      const float rq = (L2NORM ? rsqrtf(sm.q2 + kNormEps) : 1.f) * p.scale;
      float carry = 0.f;
      for (int top = records; top > 0; top -= 32) {
        const int i = top - 32 + lane;
        const float la = i >= 0 ? sm.g[i] : 0.f;
        float suffix = la;
        #pragma unroll
        for (int offset = 1; offset < 32; offset <<= 1) {
          const float other = __shfl_down_sync(0xffffffffu, suffix, offset);
          if (lane + offset < 32) suffix += other;
        }
        if (i >= 0) {
          const float dec = expf(carry + suffix - la);
          const float rk_i = L2NORM ? rsqrtf(sm.k2[i] + kNormEps) : 1.f;
          sm.coef_k[i] = dec * sm.kk[i] * rk_i * rk_j;
          sm.coef_q[i] = dec * sm.kq[i] * rk_i * rq;
          sm.fold[i] = dec * rk_i;
        }
        carry += __shfl_sync(0xffffffffu, suffix, 0);
      }
      if (lane == 0) {
        sm.total_decay = expf(carry);
        sm.q_norm = rq;
        sm.k_norm = rk_j;
      }
    }
    __syncthreads();

    // 4. Per value row: S_c.k and S_c.q from one read of the row, then u_j and o_j.
    float q_reg[kChunksPerLane][kVec], k_reg[kChunksPerLane][kVec];
    #pragma unroll
    for (int c = 0; c < kChunksPerLane; ++c) {
      load_as_float<act_t, kVec>(q + (c * kLanesPerRow + lane_col) * kVec, q_reg[c]);
      load_as_float<act_t, kVec>(k_cur + (c * kLanesPerRow + lane_col) * kVec, k_reg[c]);
    }
    const float total = sm.total_decay, beta = sm.beta, rq = sm.q_norm, rk_j = sm.k_norm;
    const act_t* v = p.v + int64_t(row) * p.v_stride_b + int64_t(vhead) * p.v_stride_h + row0;
    float* u_out = p.rec_u + ((int64_t(slot) * p.num_v_heads + vhead) * CAP + held) * V + row0;

    #pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int r_local = warp * kRowsPerWarp + i * kRowsPerPass + lane_row;
      float s[kChunksPerLane][kVec];
      float sk = 0.f, sq = 0.f;
      #pragma unroll
      for (int c = 0; c < kChunksPerLane; ++c)
        #pragma unroll
        for (int e = 0; e < kVec; ++e) {
          s[c][e] = s_raw[i][c].get(e);
          sk = fmaf(s[c][e], k_reg[c][e], sk);
          sq = fmaf(s[c][e], q_reg[c][e], sq);
        }
      sk = group_sum<kLanesPerRow>(sk) * rk_j;
      sq = group_sum<kLanesPerRow>(sq) * rq;
      float pred = total * sk;   // alpha_j S_{j-1} k^_j for this row
      float o = total * sq;
      for (int m = 0; m < held; ++m) {
        const float u_m = sm.u[m][r_local];
        pred = fmaf(sm.coef_k[m], u_m, pred);
        o = fmaf(sm.coef_q[m], u_m, o);
      }
      const float u_j = beta * (to_float(v[r_local]) - pred);
      o = fmaf(sm.coef_q[held], u_j, o);

      if (flush) {
        // Fold: S <- total S + sum_m (dec_m u_m / |k_m|) k_m(raw), exact FP32 FMAs.
        #pragma unroll
        for (int c = 0; c < kChunksPerLane; ++c)
          #pragma unroll
          for (int e = 0; e < kVec; ++e) s[c][e] *= total;
        for (int m = 0; m < records; ++m) {
          const float w = sm.fold[m] * (m == held ? u_j : sm.u[m][r_local]);
          #pragma unroll
          for (int c = 0; c < kChunksPerLane; ++c) {
            const float* k_m = &sm.k[m][(c * kLanesPerRow + lane_col) * kVec];
            #pragma unroll
            for (int e = 0; e < kVec; ++e) s[c][e] = fmaf(w, k_m[e], s[c][e]);
          }
        }
        float acc = 0.f;
        #pragma unroll
        for (int c = 0; c < kChunksPerLane; ++c)
          #pragma unroll
          for (int e = 0; e < kVec; ++e) acc = fmaf(s[c][e], q_reg[c][e], acc);
        o = group_sum<kLanesPerRow>(acc) * rq;
        const int r = row0 + r_local;
        #pragma unroll
        for (int c = 0; c < kChunksPerLane; ++c) {
          Vec16<state_t> st;
          const int col = (c * kLanesPerRow + lane_col) * kVec;
          #pragma unroll
          for (int e = 0; e < kVec; ++e) {
            if constexpr (SR) {
              const uint64_t element = (uint64_t(vhead) * V + r) * K + col + e;
              const uint64_t epoch = REPLAY ? uint64_t(p.cursors[int64_t(slot) * kCursorWords + 1]) : 0;
              st.set(e, round_stochastic<state_t>(s[c][e], rounding_bits(p.seed, (uint64_t(slot) << 32) | epoch, element)));
            } else {
              st.set(e, from_float<state_t>(s[c][e]));
            }
          }
          st.store(head_state + int64_t(r) * K + col);
        }
      }
      if (lane_col == 0) {
        out[r_local] = from_float<act_t>(o);
        if (REPLAY && !flush) u_out[r_local] = u_j;
      }
    }

    if constexpr (REPLAY) {
      if (!flush && split == 0) {  // append g_j and (once per key head) raw k_j at ring row `held`
        if (threadIdx.x == 0) p.rec_g[(int64_t(slot) * p.num_v_heads + vhead) * CAP + held] = sm.g[held];
        if (vhead % VPH == 0) {
          act_t* k_out = p.rec_k + ((int64_t(slot) * num_k_heads + khead) * CAP + held) * K;
          for (int c = threadIdx.x; c < K; c += kThreads) k_out[c] = k_cur[c];
        }
      }
      // The last CTA of this row to finish advances the slot's cursor: every CTA has read it.
      __syncthreads();
      if (threadIdx.x == 0) {
        __threadfence();
        int32_t* cur = p.cursors + int64_t(slot) * kCursorWords;
        if (atomicAdd(cur + 2, 1) == p.num_v_heads * kSplits - 1) {
          cur[0] = flush ? 0 : records;
          if (flush) cur[1] += 1;
          cur[2] = 0;
        }
      }
    }
  }
};

template <class Kern, typename act_t, typename state_t>
__global__ void __launch_bounds__(Kern::kThreads) decode_kernel(const Params<act_t, state_t> p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Kern::run(p, *reinterpret_cast<typename Kern::Smem*>(smem_raw));
}

template <class Kern, typename act_t, typename state_t>
cudaError_t launch(const Params<act_t, state_t>& p, int batch, cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  auto kernel = decode_kernel<Kern, act_t, state_t>;
  if (Kern::kSmemBytes > 48 * 1024) {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(Kern::kSmemBytes));
    if (err != cudaSuccess) return err;
  }
  dim3 grid(p.num_v_heads * Kern::kSplits, batch);
  kernel<<<grid, Kern::kThreads, Kern::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace replayssm::gdn
