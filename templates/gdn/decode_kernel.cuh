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
//
// Separate mode (read_t not void, scalar decay): non-flush steps read the read copy and also
// append (v_j, beta_j); a flush reads the carried copy, first recomputes each held u_i from it
// with record i's own step arithmetic (its decays, dots and sums in the same order, so the
// carried copy is bit for bit that of a one-copy run), then folds and stores both copies.
//
// PER_CHANNEL (Kimi Delta Attention): g is a log-decay per key channel, dec_i and total are
// vectors over K, and S_{j-1} Diag(alpha_j) k_j = S_c (total * k_j) + sum_{i<n} ((dec_i * k_i) . k_j) u_i,
// o_j = S_c (total * q_j) + sum_{i<=n} ((dec_i * k_i) . q_j) u_i; the flush folds
// S_c Diag(total) + sum_i u_i (dec_i * k_i)^T. Decays are exps of suffix sums of log-decays per
// channel, never ratios of cumulative decays (those overflow over long windows).
#pragma once
#include "common/checkpoint.cuh"
#include "common/step.cuh"
#include "gdn/held_records.cuh"

namespace replayssm::gdn {

template <typename act_t, typename state_t>
struct Params {
  state_t* state;           // [slots, HV, V, K]
  int64_t state_slot_stride;
  float* state_scale;       // e4m3: [slots, HV, V] FP32 row scales; nvfp4: [slots, HV] head scales; else null
  uint8_t* state_blocks;    // nvfp4: [slots, HV, V, K / 16] e4m3 block scales, else null
  void* read_state;         // separate mode's read copy [slots, HV, V, K] (read_t), else null
  int64_t read_slot_stride;
  float* read_scale;        // its scales, as state_scale's
  uint8_t* read_blocks;     // its block scales, as state_blocks'
  act_t* rec_v;             // separate mode: [slots, HV, CAP, V] raw v
  float* rec_beta;          // separate mode: [slots, HV, CAP] beta
  float* rec_u;             // [slots, HV, CAP, V]
  act_t* rec_k;             // [slots, H, CAP, K] raw k
  float* rec_g;             // [slots, HV, CAP] log-decay ([slots, HV, CAP, K] per channel)
  int32_t* cursors;         // [slots, kCursorWords]
  // Every slot pool's slot stride in its elements (its block when packed, the page in vLLM's cache
  // pages); each slot's block is contiguous.
  int64_t state_scale_slot_stride, state_block_slot_stride, read_scale_slot_stride, read_block_slot_stride;
  int64_t rec_v_slot_stride, rec_beta_slot_stride, rec_u_slot_stride, rec_k_slot_stride, rec_g_slot_stride;
  int64_t cursor_slot_stride;
  const act_t* q;           // [batch, H, K]
  int64_t q_stride_b, q_stride_h;
  const act_t* k;           // [batch, H, K]
  int64_t k_stride_b, k_stride_h;
  const act_t* v;           // [batch, HV, V]
  int64_t v_stride_b, v_stride_h;
  const float* gate_a;      // g (log-decay) or a, [batch, HV] ([batch, HV, K] per channel, unit stride in K)
  int64_t ga_stride_b, ga_stride_h;
  const float* gate_b;      // beta or b, [batch, HV]
  int64_t gb_stride_b, gb_stride_h;
  const float* A_log;       // [HV] (gates in kernel)
  const float* dt_bias;     // [HV] (gates in kernel; [HV, K] per channel)
  act_t* out;               // [batch, HV, V] contiguous
  const int32_t* slot_indices;
  int32_t pad_slot_id;
  int32_t num_slots;         // the state's slots: ids outside [0, num_slots) are faults
  int32_t num_v_heads;
  int32_t batch;
  float scale;
  uint64_t seed;
  bool speculative;         // issue ring loads before the cursor is read (small batches)
  bool flush_every_step;    // per-item ReplaySSM: flush every token (nothing stays held)
  float lower_bound;        // per channel, gates in kernel: < 0 the safe gate, 0 fla's (fills the bools' padding)
  float* workspace;         // split kernel only: its Records::Workspace for `batch` rows
  const int64_t* seed_tensor;  // [1] on the device, or null: replaces seed where SR
  const uint8_t* flush_mask;   // [batch], or null: a nonzero row flushes now (read where REPLAYSSM_FLUSH_MASK)

  __host__ __device__ int heads() const { return num_v_heads; }  // the state's heads (common/opening.cuh)
};

// This token's log-decay g and beta for `vhead`: given, or (GATES_IN_KERNEL) formed from a, b
// as g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) (per-item and split kernels).
template <bool GATES_IN_KERNEL, typename Params>
__device__ __forceinline__ void token_gates(const Params& p, int row, int vhead, float& g, float& beta) {
  g = p.gate_a[int64_t(row) * p.ga_stride_b + int64_t(vhead) * p.ga_stride_h];
  beta = p.gate_b[int64_t(row) * p.gb_stride_b + int64_t(vhead) * p.gb_stride_h];
  if constexpr (GATES_IN_KERNEL) {
    g = -expf(p.A_log[vhead]) * softplus(g + p.dt_bias[vhead]);
    beta = 1.f / (1.f + expf(-beta));
  }
}

// A log-decay of key channel c for `vhead` (per-channel decay) from its given input: itself, or
// (GATES_IN_KERNEL) formed from a as g = -exp(A_log) softplus(a + dt_bias) (fla's gate), or where
// p.lower_bound < 0 the safe gate g = lower_bound sigmoid(exp(A_log) (a + dt_bias)). This token's:
// token_channel_log_decay.
__device__ __forceinline__ float formed_channel_log_decay(float a, float dt_bias, float A_log, float lower_bound) {
  const float x = a + dt_bias, rate = expf(A_log);
  return lower_bound < 0.f ? lower_bound / (1.f + expf(-rate * x)) : -rate * softplus(x);
}
template <bool GATES_IN_KERNEL, int K, typename Params>
__device__ __forceinline__ float channel_log_decay(const Params& p, float given, int vhead, int c) {
  if constexpr (GATES_IN_KERNEL) {
    return formed_channel_log_decay(given, p.dt_bias[int64_t(vhead) * K + c], p.A_log[vhead], p.lower_bound);
  }
  return given;
}
template <bool GATES_IN_KERNEL, int K, typename Params>
__device__ __forceinline__ float token_channel_log_decay(const Params& p, int row, int vhead, int c) {
  return channel_log_decay<GATES_IN_KERNEL, K>(
      p, p.gate_a[int64_t(row) * p.ga_stride_b + int64_t(vhead) * p.ga_stride_h + c], vhead, c);
}

// This token's beta for `vhead`: given, or (GATES_IN_KERNEL) sigmoid(b).
template <bool GATES_IN_KERNEL, typename Params>
__device__ __forceinline__ float token_beta(const Params& p, int row, int vhead) {
  const float beta = p.gate_b[int64_t(row) * p.gb_stride_b + int64_t(vhead) * p.gb_stride_h];
  return GATES_IN_KERNEL ? 1.f / (1.f + expf(-beta)) : beta;
}

// Channel c's decays over records 0..held, the per-item and split kernels' one order: the held
// records' log-decays at column[i * STRIDE] (i < held) and this token's `g_held` in, dec_i =
// exp(sum_{m>i} g_m) at column[i * STRIDE] (i <= held) out; returns total = exp(sum of all).
// Decays are exps of suffix sums, never ratios of cumulative decays (those overflow).
template <int STRIDE>
__device__ __forceinline__ float channel_suffix_decays(float* column, int held, float g_held) {
  float suffix = 0.f;
  for (int i = held; i >= 0; --i) {
    const float g = i == held ? g_held : column[i * STRIDE];
    column[i * STRIDE] = expf(suffix);
    suffix += g;
  }
  return expf(suffix);
}

// The records' log-decays and decays in shared memory: one of each per record for a scalar decay;
// per channel, one [RECORDS][K] array staged with the log-decays and turned into the decays in
// place, plus total = a(1:j) and the query and this token's key scaled by it.
template <bool PER_CHANNEL, int RECORDS, int K>
struct DecaySmem {
  float g[RECORDS], decay[RECORDS];
};
template <int RECORDS, int K>
struct DecaySmem<true, RECORDS, K> {
  alignas(16) float decay[RECORDS][K];
  alignas(16) float total[K];
  alignas(16) float q_decayed[K];
  alignas(16) float k_decayed[K];
};

template <int K, int V, int VPH, int L, int CAP, int ROWS, int WARPS, typename act_t, typename state_t,
          bool REPLAY, bool L2NORM, bool GATES_IN_KERNEL, bool SR, bool PER_CHANNEL = false,
          typename read_t = void, bool READ_SR = SR>
struct Kernel {
  using Params = gdn::Params<act_t, state_t>;
  static constexpr bool kSeparate = !std::is_void_v<read_t>;
  static_assert(!(kSeparate && PER_CHANNEL), "separate mode is built for a scalar decay");
  using Read = std::conditional_t<kSeparate, read_t, state_t>;
  // Conventional: wide rows (fewest values per lane, for the bandwidth-bound step).
  using Tile = RowTiling<state_t, K, ROWS, WARPS, !REPLAY>;
  template <class T> using Copy = TileCheckpoint<RowTiling<T, K, ROWS, WARPS, !REPLAY>, T, V>;
  static constexpr int kThreads = Tile::kThreads;
  static constexpr int kSplits = V / ROWS;
  static constexpr int kRecords = REPLAY ? CAP : 1;
  static_assert(V % ROWS == 0, "head_v_dim must split into row tiles");

  struct Smem {
    alignas(16) float u[kRecords][ROWS];  // held u records (this CTA's rows); a flush scales them in place
    float k[kRecords][K];      // raw k of every record (this token's last)
    float q[1][K];
    float v[1][ROWS];
    DecaySmem<PER_CHANNEL, kRecords, K> dec;
    float kk[kRecords], kq[kRecords], k2[kRecords];
    alignas(16) float pred[ROWS];  // sum_{i<n} dec_i (k^_i . k^_j) u_i
    alignas(16) float osum[ROWS];  // sum_{i<n} dec_i (k^_i . q^_j) u_i
    float total_decay, beta, q2, coef_q_cur;
    RecomputeSmem<kSeparate && REPLAY, kRecords, ROWS> held;
  };
  static constexpr size_t kSmemBytes = sizeof(Smem);

  // Per-row scalars of a replay: a(1:j), beta_j, 1/|k_j|, scale/|q_j| and the weight of u_j in o_j.
  struct RowScalars {
    float total, beta, rk_j, rq, coef_q_cur;
  };

  // Rows: S_c.k and S_c.q from one read, u_j = beta (v - (total S_c k^ + pred)), then o, or the
  // fold S <- total S + sum_i u[i][r] k_i (u already scaled by dec_i / |k_i|, [held][ROWS]; k
  // [records][K], this token's last) + u_j k^_j and o = S.q^; writes o and (non-flush) appends
  // u_j. All in shared memory; q, k and v FP32 or as stored. Shared with the split kernel.
  // PER_CHANNEL: sc.total is 1, the S_c dots read `decays`' q_decayed and k_decayed, the fold
  // scales S by its total per column, and the held k rows (m < held) are already decayed.
  template <class RT, typename T, typename IN, typename REC, typename DECAYS = DecaySmem<PER_CHANNEL, kRecords, K>>
  static __device__ __forceinline__ void finish_rows(const Params& p, const TileCheckpoint<RT, T, V>& ck,
                                                     act_t* out, bool flush, int held, const RowScalars& sc, int slot,
                                                     uint64_t epoch, int vhead, int row0, const IN* q,
                                                     const IN* v, const float* pred, const float* osum, const float* u,
                                                     const REC* k,
                                                     const DECAYS* decays = nullptr) {
    const REC* k_j = k + held * K;
    const float total = sc.total, beta = sc.beta, rk_j = sc.rk_j, rq = sc.rq, coef_q_cur = sc.coef_q_cur;
    const int records = held + 1;
    float s[RT::kPasses][RT::kChunksPerLane][RT::kVec];
    float u_j[RT::kPasses], o[RT::kPasses];
    {
      float q_reg[RT::kChunksPerLane][RT::kVec], k_reg[RT::kChunksPerLane][RT::kVec];
      if constexpr (PER_CHANNEL) {
        RT::slice(decays->q_decayed, q_reg);
        RT::slice(decays->k_decayed, k_reg);
      } else {
        RT::slice(q, q_reg);
        RT::slice(k_j, k_reg);
      }
      // The rows' record sums, read a few rows at a time where a lane has few rows.
      constexpr bool kFewRows = RT::kPasses <= 4;
      float pred_r[kFewRows ? RT::kPasses : 1], osum_r[kFewRows ? RT::kPasses : 1];
      if constexpr (kFewRows) {
        RT::row_values(pred, pred_r);
        RT::row_values(osum, osum_r);
      }
      const auto row_sum = [&](const float* in_regs, const float* in_shared, int i, int r) {
        if constexpr (kFewRows) {
          return in_regs[i];
        } else {
          return in_shared[r];
        }
      };
      #pragma unroll
      for (int i = 0; i < RT::kPasses; ++i) {
        const int r = RT::row(i);
        float sk = 0.f, sq = 0.f;
        ck.values(i, 1.f, s[i]);
        #pragma unroll
        for (int c = 0; c < RT::kChunksPerLane; ++c)
          #pragma unroll
          for (int e = 0; e < RT::kVec; ++e) {
            sk = fmaf(s[i][c][e], k_reg[c][e], sk);
            sq = fmaf(s[i][c][e], q_reg[c][e], sq);
          }
        sk = group_sum<RT::kLanesPerRow>(sk) * rk_j;
        sq = group_sum<RT::kLanesPerRow>(sq) * rq;
        u_j[i] = beta * (to_float(v[r]) - (total * sk + row_sum(pred_r, pred, i, r)));
        o[i] = total * sq + row_sum(osum_r, osum, i, r) + coef_q_cur * u_j[i];
      }
    }
    if (flush) {  // S <- a(1:j) S + sum_i dec_i u_i k^_i^T: exact FP32 FMAs
      if constexpr (PER_CHANNEL) {
        #pragma unroll
        for (int c = 0; c < RT::kChunksPerLane; ++c) {
          float total_c[RT::kVec];
          RT::chunk(decays->total, c, total_c);
          #pragma unroll
          for (int i = 0; i < RT::kPasses; ++i)
            #pragma unroll
            for (int e = 0; e < RT::kVec; ++e) s[i][c][e] *= total_c[e];
        }
      } else {
        #pragma unroll
        for (int i = 0; i < RT::kPasses; ++i)
          #pragma unroll
          for (int c = 0; c < RT::kChunksPerLane; ++c)
            #pragma unroll
            for (int e = 0; e < RT::kVec; ++e) s[i][c][e] *= total;
      }
      for (int m = 0; m < records; ++m) {
        // A record's weights for this lane's rows: held in registers only when the lane has few rows.
        constexpr bool kHoldWeights = RT::kPasses <= 4;
        float w[kHoldWeights ? RT::kPasses : 1];
        if constexpr (kHoldWeights) {
          if (m == held) {
            #pragma unroll
            for (int i = 0; i < RT::kPasses; ++i) w[i] = rk_j * u_j[i];
          } else {
            RT::row_values(u + m * ROWS, w);
          }
        }
        #pragma unroll
        for (int c = 0; c < RT::kChunksPerLane; ++c) {  // one chunk of k_m live at a time
          float k_c[RT::kVec];
          RT::chunk(k + m * K, c, k_c);
          #pragma unroll
          for (int i = 0; i < RT::kPasses; ++i) {
            const float w_i = kHoldWeights ? w[kHoldWeights ? i : 0]
                                           : (m == held ? rk_j * u_j[i] : u[m * ROWS + RT::row(i)]);
            #pragma unroll
            for (int e = 0; e < RT::kVec; ++e) s[i][c][e] = fmaf(w_i, k_c[e], s[i][c][e]);
          }
        }
      }
      float q_reg[RT::kChunksPerLane][RT::kVec];
      RT::slice(q, q_reg);
      const uint64_t seed = rounding_seed<SR>(p);  // SR: read on the flush path only
      const uint64_t sr_key = checkpoint_rounding_key<SR>(seed, slot, epoch);
      const uint64_t read_key = kSeparate ? read_copy_rounding_key<READ_SR>(seed, slot, epoch) : 0;
      const auto read_at = CopyRows<Read, V, K>::of(read_view(p), slot, p.num_v_heads, vhead, row0);
      const float head_scale = prepare_store<RT>(ck.at, s);  // NVFP4 copies' (whole-CTA reductions)
      float read_head_scale = 0.f;
      if constexpr (kSeparate) read_head_scale = prepare_store<RT>(read_at, s);
      #pragma unroll
      for (int i = 0; i < RT::kPasses; ++i) {
        const int r = RT::row(i);
        const float acc = RT::dot(s[i], q_reg);
        const uint64_t element = (uint64_t(vhead) * V + row0 + r) * K;
        store_row<RT, T, SR>(ck.at, r, s[i], sr_key, element, head_scale);
        if constexpr (kSeparate) store_row<RT, Read, READ_SR>(read_at, r, s[i], read_key, element, read_head_scale);
        o[i] = group_sum<RT::kLanesPerRow>(acc) * rq;
      }
    }
    float* u_out = p.rec_u + int64_t(slot) * p.rec_u_slot_stride + (int64_t(vhead) * CAP + held) * V + row0;
    #pragma unroll
    for (int i = 0; i < RT::kPasses; ++i) {
      if (RT::row_leader()) {
        out[RT::row(i)] = from_float<act_t>(o[i]);
        if (REPLAY && !flush) u_out[RT::row(i)] = u_j[i];
      }
    }
  }

  static __device__ __forceinline__ CheckpointView<state_t> state_view(const Params& p) { return carried_view<state_t>(p); }
  static __device__ __forceinline__ CheckpointView<Read> read_view(const Params& p) {
    return read_copy_view<state_t, read_t>(p);
  }

  // Separate mode's flush: each held u_i (into u[i][ROWS]) again from the carried copy `ck`
  // (held_records.cuh), its weights formed here from the held raw k rows (FP32 or as stored, in
  // shared memory) and log-decays g. Shared with the verify kernel's early flush.
  template <typename REC>
  static __device__ __forceinline__ void recompute_held_u(const Params& p, const Copy<state_t>& ck, const REC* k,
                                                          const float* g, float* u,
                                                          RecomputeSmem<true, kRecords, ROWS>& h, int slot, int vhead,
                                                          int row0, int held) {
    load_held_values<V, ROWS, kThreads>(held_values(p, slot, vhead), held_betas(p, slot, vhead), h, row0, held);
    form_held_weights<K, WARPS, L2NORM>(k, g, h, held);
    solve_held_u<Tile, K, ROWS>(ck, k, u, h, held);
  }
  // Separate mode's ring rows of value head `vhead`: v [CAP][V] and beta [CAP].
  static __device__ __forceinline__ const act_t* held_values(const Params& p, int slot, int vhead) {
    return p.rec_v + int64_t(slot) * p.rec_v_slot_stride + int64_t(vhead) * CAP * V;
  }
  static __device__ __forceinline__ const float* held_betas(const Params& p, int slot, int vhead) {
    return p.rec_beta + int64_t(slot) * p.rec_beta_slot_stride + int64_t(vhead) * CAP;
  }

  // A held record's decay in the replay sums: dec_i for a scalar decay; 1 per channel, where the
  // decays are inside the dots (and the fold's decayed k rows).
  static __device__ __forceinline__ float record_decay(const Smem& sm, int i) {
    if constexpr (PER_CHANNEL) {
      return 1.f;
    } else {
      return sm.dec.decay[i];
    }
  }

  // Step 3 per channel, on the staged k, q and log-decays [0, held]: |k_i|^2 and |q|^2 (a warp per
  // record) while each thread turns its channels' log-decays into dec_i = exp(sum_{m>i} g_m) and
  // total = exp(sum of all) (appending this token's g where `append`), then scales q and k_j by
  // total; after a barrier, (dec_i * k_i) . k_j and (dec_i * k_i) . q (a warp per record), each
  // held k_i row decayed in place for the fold where `flush`.
  static __device__ __forceinline__ void channel_decays_and_dots(const Params& p, Smem& sm, int slot, int vhead,
                                                                 int held, bool append, bool flush) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, records = held + 1;
    for (int i = warp; i <= records; i += WARPS) {
      const float* a = i < records ? sm.k[i] : sm.q[0];
      float aa = 0.f;
      for (int c = lane; c < K; c += 32) aa = fmaf(a[c], a[c], aa);
      aa = group_sum<32>(aa);
      if (lane == 0) (i < records ? sm.k2[i] : sm.q2) = aa;
    }
    const int64_t g_row = int64_t(slot) * p.rec_g_slot_stride + (int64_t(vhead) * CAP + held) * K;
    for (int c = threadIdx.x; c < K; c += kThreads) {
      const float g_held = sm.dec.decay[held][c];
      if (append) p.rec_g[g_row + c] = g_held;
      const float total = channel_suffix_decays<K>(&sm.dec.decay[0][c], held, g_held);
      sm.dec.total[c] = total;
      sm.dec.q_decayed[c] = total * sm.q[0][c];
      sm.dec.k_decayed[c] = total * sm.k[held][c];
    }
    __syncthreads();
    for (int i = warp; i < records; i += WARPS) {
      float kk = 0.f, kq = 0.f;
      for (int c = lane; c < K; c += 32) {
        const float decayed = sm.k[i][c] * sm.dec.decay[i][c];
        kk = fmaf(decayed, sm.k[held][c], kk);
        kq = fmaf(decayed, sm.q[0][c], kq);
        if (flush && i < held) sm.k[i][c] = decayed;
      }
      kk = group_sum<32>(kk);
      kq = group_sum<32>(kq);
      if (lane == 0) {
        sm.kk[i] = kk;
        sm.kq[i] = kq;
      }
    }
  }

  static __device__ __forceinline__ void run(const Params& p, Smem& sm) {
    begin_after_prior_grid();  // where launched as a programmatic dependent (kFlagOverlapPriorKernel)
    const auto tile = RowTileIndex<kSplits, VPH>::of_block(p);
    const int split = tile.split, vhead = tile.head, row = tile.row, khead = tile.group, num_k_heads = tile.num_groups;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row0 = split * ROWS;
    const int slot = p.slot_indices[row];
    act_t* out = p.out + (int64_t(row) * p.num_v_heads + vhead) * V + row0;
    if (skip_unusable_row<ROWS, kThreads>(slot, p.pad_slot_id, p.num_slots, out)) return;  // nothing else to do

    // 1. State reads first (the read copy's, in separate mode).
    Copy<Read> read;
    read.load(read_view(p), slot, p.num_v_heads, vhead, row0);

    // 2. Records (held ones from the rings, RecordStager) and this token's q, k, v.
    const act_t* q = p.q + int64_t(row) * p.q_stride_b + int64_t(khead) * p.q_stride_h;
    const act_t* k_cur = p.k + int64_t(row) * p.k_stride_b + int64_t(khead) * p.k_stride_h;
    const act_t* v = p.v + int64_t(row) * p.v_stride_b + int64_t(vhead) * p.v_stride_h + row0;
    const act_t* rec_k = p.rec_k + int64_t(slot) * p.rec_k_slot_stride + int64_t(khead) * CAP * K;
    const float* rec_u = p.rec_u + int64_t(slot) * p.rec_u_slot_stride + int64_t(vhead) * CAP * V + row0;
    const float* rec_g = p.rec_g + int64_t(slot) * p.rec_g_slot_stride + int64_t(vhead) * CAP * (PER_CHANNEL ? K : 1);
    RecordStager<act_t, K, kRecords, kThreads> k_stage;
    RowStager<float, ROWS, (kRecords > 1 ? kRecords - 1 : 1), kThreads> u_stage;
    RowStager<act_t, K, 1, kThreads> q_stage;
    RowStager<act_t, ROWS, 1, kThreads> v_stage;
    k_stage.load_early(rec_k, K, k_cur, p.speculative);
    if (REPLAY && p.speculative) u_stage.load(rec_u, V, kRecords - 1);
    q_stage.load(q, 0, 1);
    v_stage.load(v, 0, 1);

    int32_t* cursor = REPLAY ? slot_cursor(p.cursors, p.cursor_slot_stride, slot) : nullptr;
    // step.cuh's lower-level pieces, in this order: through open_step/decide the compiler
    // schedules this kernel's address arithmetic differently (SASS compared; see issue 40).
    const SlotCursor at_start = REPLAY ? read_slot_cursor(cursor) : SlotCursor{0, 0};
    const int held = at_start.held;
    if (REPLAY && !held_count_valid<L, CAP>(held)) {  // a corrupted cursor: the row touches nothing
      fill_outputs<ROWS, kThreads>(out, fault_output());
      return;
    }
    const int records = held + 1;
    const bool flush = !REPLAY || records >= L || p.flush_every_step || (kFlushMask && flush_masked(p, row));
    const uint64_t epoch = (REPLAY && SR) ? uint64_t(at_start.epoch) : 0;
    // The held records from the rings at [0, n), this token's k and gates at [n] (and q, v).
    auto stage_records = [&](int n) {
      k_stage.load_late(rec_k, K, n, p.speculative);
      if (REPLAY && !p.speculative) u_stage.load(rec_u, V, n);
      k_stage.store(sm.k, n);
      if (REPLAY) u_stage.store(sm.u, 0, n);
      q_stage.store(sm.q, 0, 1);
      v_stage.store(sm.v, 0, 1);
      if constexpr (PER_CHANNEL) {
        for (int idx = threadIdx.x; idx < (n + 1) * K; idx += kThreads) {
          const int i = idx / K, c = idx % K;
          sm.dec.decay[i][c] = i == n ? token_channel_log_decay<GATES_IN_KERNEL, K>(p, row, vhead, c) : rec_g[idx];
        }
        if (threadIdx.x == 0) sm.beta = token_beta<GATES_IN_KERNEL>(p, row, vhead);
      } else {
        for (int i = threadIdx.x; i <= n; i += kThreads) {
          if (i == n) {
            float g, beta;
            token_gates<GATES_IN_KERNEL>(p, row, vhead, g, beta);
            sm.dec.g[i] = g;
            sm.beta = beta;
          } else {
            sm.dec.g[i] = rec_g[i];
          }
        }
      }
    };
    // A second staging (held records after all) reuses row [0]: a barrier first.
    const auto stage = [&](int n) {
      stage_records(n);
      if (n != held) __syncthreads();
    };
    prepare_token_records(stage, REPLAY && p.flush_every_step, held);
    __syncthreads();
    const int arrival = REPLAY ? arrive_after_cursor_reads<SR>(cursor, p.flush_every_step, records) : -1;

    // 3. Dots of each k_i with k_j and q_j, |k_i|^2 and |q|^2 (a warp per record); decays.
    if constexpr (PER_CHANNEL) {
      channel_decays_and_dots(p, sm, slot, vhead, held, REPLAY && !flush && split == 0, flush);
    } else {
      for (int i = warp; i <= records; i += WARPS) {
        const float* a = i < records ? sm.k[i] : sm.q[0];
        float kk = 0.f, kq = 0.f, aa = 0.f;
        for (int c = lane; c < K; c += 32) {
          kk = fmaf(a[c], sm.k[held][c], kk);
          kq = fmaf(a[c], sm.q[0][c], kq);
          aa = fmaf(a[c], a[c], aa);
        }
        kk = group_sum<32>(kk);
        kq = group_sum<32>(kq);
        aa = group_sum<32>(aa);
        if (lane == 0) {
          if (i < records) {
            sm.kk[i] = kk;
            sm.kq[i] = kq;
            sm.k2[i] = aa;
          } else {
            sm.q2 = aa;
          }
        }
      }
      if (warp == 0) {
        const float total = suffix_decays(sm.dec.g, sm.dec.decay, records);
        if (lane == 0) sm.total_decay = total;
      }
    }
    __syncthreads();

    // 4. Normalised coefficients, then per-row record sums (once per row, not per lane).
    const float rk_j = L2NORM ? rsqrtf(sm.k2[held] + kNormEps) : 1.f;
    const float rq = (L2NORM ? rsqrtf(sm.q2 + kNormEps) : 1.f) * p.scale;
    const auto row_sums = [&] {
      for (int r = threadIdx.x; r < ROWS; r += kThreads) {
        float pred = 0.f, osum = 0.f;
        for (int i = 0; i < held; ++i) {
          const float rk_i = L2NORM ? rsqrtf(sm.k2[i] + kNormEps) : 1.f;
          const float u = sm.u[i][r];
          const float dec = record_decay(sm, i);
          pred = fmaf(dec * sm.kk[i] * rk_i * rk_j, u, pred);
          osum = fmaf(dec * sm.kq[i] * rk_i * rq, u, osum);
          if (flush) sm.u[i][r] = dec * rk_i * u;  // fold weight of raw k_i
        }
        sm.pred[r] = pred;
        sm.osum[r] = osum;
      }
      __syncthreads();
    };

    // 5. Rows (a separate-mode flush from the carried copy, loaded now, its held u's recomputed).
    const auto finish = [&](const auto& ck) {
      finish_rows(p, ck, out, flush, held,
                  RowScalars{PER_CHANNEL ? 1.f : sm.total_decay, sm.beta, rk_j, rq, sm.kq[held] * rk_j * rq},  // dec_j = 1
                  slot, epoch, vhead, row0, sm.q[0], sm.v[0], sm.pred, sm.osum, &sm.u[0][0], &sm.k[0][0],
                  &sm.dec);
    };
    if (kSeparate && flush) {
      Copy<state_t> carried;
      carried.load(state_view(p), slot, p.num_v_heads, vhead, row0);
      if constexpr (kSeparate && REPLAY)
        recompute_held_u(p, carried, &sm.k[0][0], sm.dec.g, &sm.u[0][0], sm.held, slot, vhead, row0, held);
      row_sums();
      finish(carried);
    } else {
      row_sums();
      finish(read);
    }

    if constexpr (REPLAY) {
      if constexpr (kSeparate) {  // separate mode: v_j (this CTA's rows) and beta_j too
        if (!flush) {
          const int64_t at = int64_t(vhead) * CAP + held;  // within the slot
          act_t* values = p.rec_v + int64_t(slot) * p.rec_v_slot_stride;
          for (int r = threadIdx.x; r < ROWS; r += kThreads) values[at * V + row0 + r] = from_float<act_t>(sm.v[0][r]);
          if (split == 0 && threadIdx.x == 0) p.rec_beta[int64_t(slot) * p.rec_beta_slot_stride + at] = sm.beta;
        }
      }
      if (!flush && split == 0) {  // append g_j and (once per key head) raw k_j at ring row `held`
        if constexpr (!PER_CHANNEL)  // (per channel: appended in channel_decays_and_dots)
          if (threadIdx.x == 0) p.rec_g[int64_t(slot) * p.rec_g_slot_stride + int64_t(vhead) * CAP + held] = sm.dec.g[held];
        if (vhead % VPH == 0) {
          act_t* k_out = p.rec_k + int64_t(slot) * p.rec_k_slot_stride + (int64_t(khead) * CAP + held) * K;
          for (int c = threadIdx.x; c < K; c += kThreads) k_out[c] = from_float<act_t>(sm.k[held][c]);
        }
      }
      finish_step_cursor<SR>(cursor, p.num_v_heads * kSplits, vhead == 0 && split == 0, p.flush_every_step, flush, records,
                             at_start.epoch, arrival);
    }
  }
};

}  // namespace replayssm::gdn
