// Gated DeltaNet ReplaySSM step on the persistent streaming driver (common/stream.cuh), sm_90.
// Same math, records and cursor protocol as decode_kernel.cuh; an item is ROWS value rows of one
// (batch row, value head), staged whole in shared memory by bulk copies.
#pragma once
#include "common/replay.cuh"
#include "common/stream.cuh"
#include "gdn/decode_kernel.cuh"

namespace replayssm::gdn {

template <int K, int V, int VPH, int L, int CAP, int ROWS, int CWARPS, typename act_t, typename state_t, bool L2NORM,
          bool GATES_IN_KERNEL, bool SR>
struct Stream {
  using Params = gdn::Params<act_t, state_t>;
  using Rows = StageRows<state_t, K, ROWS, CWARPS>;
  static constexpr int kConsumerWarps = CWARPS;
  static constexpr int kConsumers = CWARPS * 32;
  static constexpr int kSplits = V / ROWS;
  static constexpr int kSA = sizeof(act_t), kSS = sizeof(state_t);
  static_assert(V % ROWS == 0, "head_v_dim must split into row tiles");
  static_assert((ROWS * K * kSS) % 16 == 0 && (ROWS * kSA) % 16 == 0 && (K * kSA) % 16 == 0 && ROWS % 4 == 0,
                "bulk copies move whole 16-byte units");

  struct alignas(128) Stage {
    state_t s[ROWS * K];  // checkpoint rows
    float u[CAP][ROWS];   // held u records (this item's rows)
    act_t k[CAP][K];      // held raw k records, this token's k at row `held`
    act_t q[K];
    act_t v[ROWS];
    float g[CAP];         // held log-decays, this token's gate input at row `held`
  };
  struct Meta {
    int slot, held;  // held < 0: padded row
    uint32_t epoch;
    float gate_b, A_log, dt_bias;
  };
  struct Scratch {
    float g[CAP], decay[CAP], kk[CAP], kq[CAP], k2[CAP];
    float pred[CAP], osum[CAP], fold[CAP];  // per-record coefficients of u_i
    float total, beta, q2;
  };
  static constexpr int kStages = stream_stages(sizeof(Stage));

  static constexpr int kWindow = L;
  static __device__ __forceinline__ void write_zeros(const Params& p, int item) {
    const Item it(item, p.num_v_heads);
    act_t* out = p.out + (int64_t(it.row) * p.num_v_heads + it.vhead) * V + it.split * ROWS;
    for (int r = threadIdx.x; r < ROWS; r += kConsumers) out[r] = from_float<act_t>(0.f);
  }
  static __host__ __device__ __forceinline__ int items_per_row(const Params& p) { return p.num_v_heads * kSplits; }
  static __device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

  struct Item {
    int split, vhead, row, khead;
    __device__ __forceinline__ Item(int item, int num_v_heads)
        : split(item % kSplits), vhead((item / kSplits) % num_v_heads), row(item / kSplits / num_v_heads),
          khead(vhead / VPH) {}
  };

  static __device__ __forceinline__ void produce(const Params& p, int item, int slot, int held, Stage& st, Meta& meta,
                                                 uint64_t* full) {
    const Item it(item, p.num_v_heads);
    const int lane = threadIdx.x % 32, row0 = it.split * ROWS, num_k_heads = p.num_v_heads / VPH;
    if (lane == 0) {
      const uint32_t bytes = ROWS * K * kSS + (held + 1) * K * kSA + held * ROWS * 4 + K * kSA + ROWS * kSA;
      pipe::arrive_expect_bytes(full, bytes);
    }
    __syncwarp();
    const int64_t vhead_rec = int64_t(slot) * p.num_v_heads + it.vhead;
    if (lane == 0)
      pipe::bulk_copy(st.s, p.state + int64_t(slot) * p.state_slot_stride + (int64_t(it.vhead) * V + row0) * K,
                      ROWS * K * kSS, full);
    const float* rec_u = p.rec_u + vhead_rec * CAP * V + row0;
    if constexpr (ROWS == V) {
      if (lane == 1 && held > 0) pipe::bulk_copy(st.u, rec_u, held * V * 4, full);
    } else {
      for (int i = lane; i < held; i += 32) pipe::bulk_copy(st.u[i], rec_u + i * V, ROWS * 4, full);
    }
    if (lane == 2 && held > 0)
      pipe::bulk_copy(st.k, p.rec_k + (int64_t(slot) * num_k_heads + it.khead) * CAP * K, held * K * kSA, full);
    if (lane == 3) pipe::bulk_copy(st.q, p.q + int64_t(it.row) * p.q_stride_b + int64_t(it.khead) * p.q_stride_h,
                                   K * kSA, full);
    if (lane == 4) pipe::bulk_copy(st.k[held], p.k + int64_t(it.row) * p.k_stride_b + int64_t(it.khead) * p.k_stride_h,
                                   K * kSA, full);
    if (lane == 5)
      pipe::bulk_copy(st.v, p.v + int64_t(it.row) * p.v_stride_b + int64_t(it.vhead) * p.v_stride_h + row0,
                      ROWS * kSA, full);
    for (int i = lane; i < held; i += 32) pipe::copy_word(&st.g[i], p.rec_g + vhead_rec * CAP + i);
    if (lane == 31)
      pipe::copy_word(&st.g[held], p.gate_a + int64_t(it.row) * p.ga_stride_b + int64_t(it.vhead) * p.ga_stride_h);
    if (lane == 30)
      pipe::copy_word(&meta.gate_b, p.gate_b + int64_t(it.row) * p.gb_stride_b + int64_t(it.vhead) * p.gb_stride_h);
    if constexpr (GATES_IN_KERNEL) {
      if (lane == 29) pipe::copy_word(&meta.A_log, p.A_log + it.vhead);
      if (lane == 28) pipe::copy_word(&meta.dt_bias, p.dt_bias + it.vhead);
    }
    pipe::arrive_after_words(full);
  }

  static __device__ __forceinline__ void consume(const Params& p, int item, const Stage& st, const Meta& meta,
                                                 Scratch& sc, uint64_t* empty) {
    const Item it(item, p.num_v_heads);
    const int t = threadIdx.x, warp = t / 32, lane = t % 32, row0 = it.split * ROWS;
    const int held = meta.held, slot = meta.slot;
    act_t* out = p.out + (int64_t(it.row) * p.num_v_heads + it.vhead) * V + row0;
    const int records = held + 1;
    const bool flush = records >= L;

    // Checkpoint rows into registers first (every pass at once, for ILP).
    float s[Rows::kPasses][Rows::kChunks][Rows::kVec];
    Rows::load_all(st.s, s);

    // Gates and suffix decays (warp 0); k_i . k_j, k_i . q, |k_i|^2 and |q|^2 (a warp per record).
    if (warp == 0) {
      for (int i = lane; i < records; i += 32) {
        float g = st.g[i];
        if (i == held && GATES_IN_KERNEL) g = -expf(meta.A_log) * softplus(g + meta.dt_bias);
        sc.g[i] = g;
      }
      __syncwarp();
      const float total = suffix_decays(sc.g, sc.decay, records);
      if (lane == 0) {
        sc.total = total;
        sc.beta = GATES_IN_KERNEL ? 1.f / (1.f + expf(-meta.gate_b)) : meta.gate_b;
      }
    }
    for (int i = warp; i <= records; i += CWARPS) {
      const act_t* a = i < records ? st.k[i] : st.q;
      float kk = 0.f, kq = 0.f, aa = 0.f;
      for (int c = lane; c < K; c += 32) {
        const float ac = to_float(a[c]);
        kk = fmaf(ac, to_float(st.k[held][c]), kk);
        kq = fmaf(ac, to_float(st.q[c]), kq);
        aa = fmaf(ac, ac, aa);
      }
      kk = group_sum<32>(kk);
      kq = group_sum<32>(kq);
      aa = group_sum<32>(aa);
      if (lane == 0) {
        if (i < records) {
          sc.kk[i] = kk;
          sc.kq[i] = kq;
          sc.k2[i] = aa;
        } else {
          sc.q2 = aa;
        }
      }
    }
    pipe::sync_threads(1, kConsumers);
    const float rk_j = L2NORM ? rsqrtf(sc.k2[held] + kNormEps) : 1.f;
    const float rq = (L2NORM ? rsqrtf(sc.q2 + kNormEps) : 1.f) * p.scale;
    for (int i = t; i < held; i += kConsumers) {  // coefficients of the held u_i
      const float rk_i = L2NORM ? rsqrtf(sc.k2[i] + kNormEps) : 1.f;
      sc.pred[i] = sc.decay[i] * sc.kk[i] * rk_i * rk_j;
      sc.osum[i] = sc.decay[i] * sc.kq[i] * rk_i * rq;
      sc.fold[i] = sc.decay[i] * rk_i;
    }
    pipe::sync_threads(1, kConsumers);

    const float total = sc.total, beta = sc.beta;
    const float coef_q_cur = sc.kq[held] * rk_j * rq;  // dec_j = 1
    float q[Rows::kChunks][Rows::kVec], kj[Rows::kChunks][Rows::kVec];
    Rows::slice(st.q, q);
    Rows::slice(st.k[held], kj);
    // Lane l owns one row of this warp for the record sums (no bank conflicts on u records).
    const int mine = Rows::own_row();
    float pred = 0.f, osum = 0.f, v_mine = 0.f;
    if (mine < ROWS) {
      #pragma unroll 4
      for (int i = 0; i < held; ++i) {
        const float u = st.u[i][mine];
        pred = fmaf(sc.pred[i], u, pred);
        osum = fmaf(sc.osum[i], u, osum);
      }
      v_mine = to_float(st.v[mine]);
    }
    const uint32_t epoch = meta.epoch;
    if (!flush) {
      if (it.split == 0) {  // append g_j and (once per key head) raw k_j at ring row `held`
        if (t == 0) p.rec_g[(int64_t(slot) * p.num_v_heads + it.vhead) * CAP + held] = sc.g[held];
        if (it.vhead % VPH == 0) {
          act_t* k_out = p.rec_k + ((int64_t(slot) * (p.num_v_heads / VPH) + it.khead) * CAP + held) * K;
          for (int c = t; c < K; c += kConsumers) k_out[c] = st.k[held][c];
        }
      }
      release_stage(empty);  // the rest runs from registers (a flush still reads k, u)
    }
    // alpha S_{j-1} k^_j = total S_c k^_j + pred, u_j = beta (v - that), o_j = total S_c q^ + osum + (k^_j . q^) u_j
    float u_j[Rows::kPasses], o[Rows::kPasses];
    #pragma unroll
    for (int pass = 0; pass < Rows::kPasses; ++pass) {
      float sk = 0.f, sq = 0.f;
      #pragma unroll
      for (int c = 0; c < Rows::kChunks; ++c)
        #pragma unroll
        for (int e = 0; e < Rows::kVec; ++e) {
          sk = fmaf(s[pass][c][e], kj[c][e], sk);
          sq = fmaf(s[pass][c][e], q[c][e], sq);
        }
      const int owner = Rows::owner_lane(pass);
      sk = group_sum<Rows::kLanesPerRow>(sk) * (total * rk_j) + __shfl_sync(0xffffffffu, pred, owner);
      sq = group_sum<Rows::kLanesPerRow>(sq) * (total * rq) + __shfl_sync(0xffffffffu, osum, owner);
      u_j[pass] = beta * (__shfl_sync(0xffffffffu, v_mine, owner) - sk);
      o[pass] = sq + coef_q_cur * u_j[pass];
    }
    if (flush) {  // S <- a(1:j) S + sum_i dec_i u_i k^_i^T: exact FP32 FMAs; o = S . q^
      #pragma unroll
      for (int pass = 0; pass < Rows::kPasses; ++pass)
        #pragma unroll
        for (int c = 0; c < Rows::kChunks; ++c)
          #pragma unroll
          for (int e = 0; e < Rows::kVec; ++e) s[pass][c][e] *= total;
      for (int m = 0; m < held; ++m) {
        const float fold = sc.fold[m];
        float km[Rows::kChunks][Rows::kVec];
        Rows::slice(st.k[m], km);
        #pragma unroll
        for (int pass = 0; pass < Rows::kPasses; ++pass) {
          const int r = Rows::row(pass);
          const float w = r < ROWS ? fold * st.u[m][r] : 0.f;
          #pragma unroll
          for (int c = 0; c < Rows::kChunks; ++c)
            #pragma unroll
            for (int e = 0; e < Rows::kVec; ++e) s[pass][c][e] = fmaf(w, km[c][e], s[pass][c][e]);
        }
      }
      #pragma unroll
      for (int pass = 0; pass < Rows::kPasses; ++pass) {
        const float w = rk_j * u_j[pass];
        float acc = 0.f;
        #pragma unroll
        for (int c = 0; c < Rows::kChunks; ++c)
          #pragma unroll
          for (int e = 0; e < Rows::kVec; ++e) {
            s[pass][c][e] = fmaf(w, kj[c][e], s[pass][c][e]);
            acc = fmaf(s[pass][c][e], q[c][e], acc);
          }
        o[pass] = acc;
      }
    }
    if (flush) release_stage(empty);
    float* u_out = p.rec_u + ((int64_t(slot) * p.num_v_heads + it.vhead) * CAP + held) * V + row0;
    #pragma unroll
    for (int pass = 0; pass < Rows::kPasses; ++pass) {
      const int r = Rows::row(pass);
      if (flush) {
        o[pass] = group_sum<Rows::kLanesPerRow>(o[pass]) * rq;
        if (r < ROWS) {
          state_t* dst = p.state + int64_t(slot) * p.state_slot_stride + (int64_t(it.vhead) * V + row0 + r) * K;
          #pragma unroll
          for (int c = 0; c < Rows::kChunks; ++c)
            store_chunk<state_t, SR>(dst + Rows::col(c), s[pass][c], p.seed, (uint64_t(slot) << 32) | epoch,
                                     (uint64_t(it.vhead) * V + row0 + r) * K + Rows::col(c));
        }
      }
      if (r < ROWS && Rows::row_leader()) {
        out[r] = from_float<act_t>(o[pass]);
        if (!flush) u_out[r] = u_j[pass];
      }
    }

  }
};

}  // namespace replayssm::gdn
