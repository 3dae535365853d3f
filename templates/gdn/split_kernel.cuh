// Gated DeltaNet split ReplaySSM step (common/split.cuh).
//
// Records: one CTA per (key head, batch row), for the key head's VPH value heads. It reads the
// cursor and the held records (g, u, raw k), and with j = held + 1 records computes, per value
// head, the scalars of the replay (a(1:j), beta_j, 1/|k_j|, scale/|q_j|, the weight of u_j in
// o_j) and per value row
//   pred[r] = sum_{i<j-1} dec_i (k^_i . k^_j) u_i[r],   osum[r] = sum_{i<j-1} dec_i (k^_i . q^_j) u_i[r];
// a flush also gets coef_i = dec_i / |k_i|. It appends g_j and k_j (u_j needs the checkpoint).
// State: the per-item row tiles (decode_kernel.cuh) with those sums from the workspace; it
// appends u_j and advances the cursor once every records CTA has finished.
// PER_CHANNEL (KDA): the records kernel also turns each value head's per-channel log-decays into
// decays, and hands the state kernel total * q_j, total * k_j, total and (a flush) the decayed
// held k rows dec_i * k_i, so that the state kernel's rows are the per-item kernel's.
#pragma once
#include "common/split.cuh"
#include "gdn/decode_kernel.cuh"

namespace replayssm::gdn {

// Per (batch row, value head): extra = [pred | osum] (2 V), per channel then [total * q_j |
// total * k_j | total] (3 K) and a flush's decayed held k rows ((CAP - 1) K); scalars =
// RowScalars, coef [CAP]. Separate mode adds a flush's pred weights [CAP] and the held records'
// recomputation weights [CAP][CAP], totals [CAP] and norms [CAP] (held_records.cuh) to extra.
template <int K, int V, int CAP, bool PER_CHANNEL, bool SEPARATE>
struct WorkspaceLayout {
  static constexpr int kChannels = 2 * V;                // offset of total * q_j in extra
  static constexpr int kDecayedRows = kChannels + 3 * K;  // offset of the decayed held k rows
  // (each part rounded to 4 floats: the state kernel copies them as 16-byte chunks)
  static constexpr int round4(int n) { return (n + 3) / 4 * 4; }
  // Separate mode (scalar decay): a flush's weights of the held u_i in this token's pred, after
  // the two row sums (which a separate-mode flush does not use: its u_i come from the carried copy).
  static constexpr int kPredWeights = 2 * V;
  static constexpr int kHeldWeights = kPredWeights + round4(CAP);
  static constexpr int kHeldTotals = kHeldWeights + round4(CAP * CAP);
  static constexpr int kHeldNorms = kHeldTotals + round4(CAP);
  static constexpr int kExtra =
      PER_CHANNEL ? kDecayedRows + (CAP > 1 ? CAP - 1 : 1) * K : (SEPARATE ? kHeldNorms + round4(CAP) : kPredWeights);
  static_assert(kExtra % 4 == 0, "each (row, head)'s extra must start 16-byte aligned");
};
template <int K, int V, int CAP, bool PER_CHANNEL = false, bool SEPARATE = false>
using Workspace = SplitWorkspace<WorkspaceLayout<K, V, CAP, PER_CHANNEL, SEPARATE>::kExtra, 5, CAP>;

// Separate mode's records kernel: the held raw k Gram of its key head and a CAP-float scratch per
// warp (write_held_weights); nothing (an empty base) without a read copy.
template <bool SEPARATE, int CAP, int WARPS>
struct HeldGramSmem {
  float gram[CAP][CAP];
  float scratch[WARPS][CAP];
};
template <int CAP, int WARPS>
struct HeldGramSmem<false, CAP, WARPS> {};

// The state kernel's per-channel vectors, named as decode_kernel.cuh's DecaySmem for finish_rows.
template <int K>
struct ChannelDecays {
  alignas(16) float q_decayed[K];
  alignas(16) float k_decayed[K];
  alignas(16) float total[K];
};

// WARPS: 8, or 4 where the grid covers the chip many times over (ops/tiling.py): a warp's fixed
// work (index math, copies' set-up, barriers) then counts for less against the per-row work.
// SEPARATE (separate mode, scalar decay): a non-flush step appends beta_j too; a flush leaves the
// row sums (from the read copy's u) and writes each held u_i's weight in this token's pred, and
// the held u_i's recomputation weights, once per value head (the Gram once per key head).
template <int K, int V, int VPH, int L, int CAP, typename act_t, typename state_t, bool L2NORM, bool GATES_IN_KERNEL,
          int WARPS = 8, bool PER_CHANNEL = false, bool SEPARATE = false>
struct Records {
  static_assert(!(SEPARATE && PER_CHANNEL), "separate mode is built for a scalar decay");
  using Params = gdn::Params<act_t, state_t>;
  using Workspace = gdn::Workspace<K, V, CAP, PER_CHANNEL, SEPARATE>;
  using Offsets = WorkspaceLayout<K, V, CAP, PER_CHANNEL, SEPARATE>;
  static constexpr int kChannelHeads = PER_CHANNEL ? VPH : 1, kChannelRows = PER_CHANNEL ? CAP : 1,
                       kChannels = PER_CHANNEL ? K : 1;
  static constexpr int kWarps = WARPS, kThreads = kWarps * 32;
  static constexpr int kRing = CAP > 1 ? CAP - 1 : 1;  // ring rows held before this token, at most

  // The held u rows are staged in shared memory only where a full SM of records CTAs still fits,
  // as for Mamba-2 (mamba2/split_kernel.cuh); otherwise they are prefetched into L2 and loaded
  // from there where they are summed.
  struct Scalars {
    float g[VPH][CAP], decay[VPH][CAP];  // log-decays (ring, then this token's at [held]); dec_i
    float kk[CAP], kq[CAP], rk[CAP];     // k_i . k_j, k_i . q_j (raw), 1/|k_i| (1 without L2 norm)
    float w_pred[VPH][CAP], w_osum[VPH][CAP];  // held record i's weights in pred and osum
    float q2, g_cur[VPH], total[VPH], beta[VPH];
  };
  template <bool HELD_ROWS_IN_SHARED>
  struct Layout : HeldGramSmem<SEPARATE, CAP, kWarps> {
    alignas(16) float u[HELD_ROWS_IN_SHARED ? VPH : 1][HELD_ROWS_IN_SHARED ? kRing : 1][V];
    alignas(16) act_t k[kRing][K];       // raw k ring rows
    alignas(16) act_t k_cur[K];
    alignas(16) act_t q[K];
    Scalars s;
    // Per channel: each value head's log-decays (ring rows, then this token's at [held]), turned
    // into the decays dec_i in place.
    alignas(16) float channel_g[kChannelHeads][kChannelRows][kChannels];
    alignas(16) float channel_g_cur[kChannelHeads][kChannels];
  };
  static constexpr bool kRingRowsInShared = fills_sm_threads<sizeof(Layout<true>), kThreads>();
  using Smem = Layout<kRingRowsInShared>;
  static constexpr size_t kSmemBytes = sizeof(Smem);
  static constexpr int kMinBlocks = shared_memory_resident_ctas<kSmemBytes, kThreads>();
  // Held u rows read from L2 per batch of loads: their round trips overlap.
  static constexpr int kLoadBatch = 2;

  static __device__ __forceinline__ void copy_ring(const Params& p, Smem& sm, int slot, int khead, int count) {
    const int vhead0 = khead * VPH, num_k_heads = p.num_v_heads / VPH;
    const float* rec_u = p.rec_u + int64_t(slot) * p.rec_u_slot_stride + int64_t(vhead0) * CAP * V;
    stage_held_rows<kRingRowsInShared, float, V, VPH, kRing, CAP, kThreads>(&sm.u[0][0][0], rec_u, count);
    copy_columns_async<act_t, K, 1, kThreads>(&sm.k[0][0], 0, K, p.rec_k + int64_t(slot) * p.rec_k_slot_stride + int64_t(khead) * CAP * K,
                                                  0, K, count);
    if constexpr (PER_CHANNEL) {
      copy_columns_async<float, K, VPH, kThreads>(&sm.channel_g[0][0][0], CAP * K, K,
                                                  p.rec_g + int64_t(slot) * p.rec_g_slot_stride + int64_t(vhead0) * CAP * K, CAP * K,
                                                  K, count);
    } else {
      copy_columns_async<float, 1, VPH, kThreads>(&sm.s.g[0][0], CAP, 1,
                                                  p.rec_g + int64_t(slot) * p.rec_g_slot_stride + int64_t(vhead0) * CAP, CAP, 1, count);
    }
  }

  static __device__ __forceinline__ void run(const Params& p, Smem& sm) {
    begin_after_prior_grid();  // the state kernel's CTAs may start their checkpoint reads now
    const auto index = GroupIndex<VPH>::of_block(p);
    const int khead = index.group, row = index.row, vhead0 = index.head0, num_k_heads = index.num_groups;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int slot = p.slot_indices[row];
    if (!slot_usable(slot, p.pad_slot_id, p.num_slots)) return;  // the state kernel writes its outputs

    copy_columns_async<act_t, K, 1, kThreads>(sm.k_cur, 0, 0, p.k + int64_t(row) * p.k_stride_b + int64_t(khead) * p.k_stride_h, 0, 0, 1);
    copy_columns_async<act_t, K, 1, kThreads>(sm.q, 0, 0, p.q + int64_t(row) * p.q_stride_b + int64_t(khead) * p.q_stride_h, 0, 0, 1);
    if (p.speculative) copy_ring(p, sm, slot, khead, kRing);

    const auto opened = open_step<true, L, CAP>(slot_cursor(p.cursors, p.cursor_slot_stride, slot));
    // This token's gates while the cursor load is in flight: read past the held-count check, their
    // loads waited for the cursor, a round trip more on every step. Not into sm.s.g, which the ring
    // copies may still be filling.
    if constexpr (PER_CHANNEL) {
      for (int e = threadIdx.x; e < VPH * K; e += kThreads)
        sm.channel_g_cur[e / K][e % K] = token_channel_log_decay<GATES_IN_KERNEL, K>(p, row, vhead0 + e / K, e % K);
      if (threadIdx.x < VPH) sm.s.beta[threadIdx.x] = token_beta<GATES_IN_KERNEL>(p, row, vhead0 + threadIdx.x);
    } else if (threadIdx.x < VPH) {
      float g, beta;
      token_gates<GATES_IN_KERNEL>(p, row, vhead0 + threadIdx.x, g, beta);
      sm.s.g_cur[threadIdx.x] = g;
      sm.s.beta[threadIdx.x] = beta;
    }
    if (!opened.valid()) {  // a corrupted cursor: the state kernel faults the row
      if (khead == 0 && threadIdx.x == 0) store_step(Workspace{p.workspace, p.batch, p.num_v_heads}.info(row), opened.faulted());
      pipe::wait_copies();
      return;
    }
    const StepDecision d = opened.decide([&] { return kFlushMask && flush_masked(p, row); });
    const int held = d.held, records = d.records;
    const bool flush = d.flush;
    if (!p.speculative) copy_ring(p, sm, slot, khead, held);
    pipe::wait_copies();
    __syncthreads();

    // Dots of each k_i with k_j and q_j, 1/|k_i| and |q|^2 (a warp per record); decays (a warp
    // per value head). The per-item kernel's arithmetic, in its order.
    for (int i = warp; i <= records; i += kWarps) {
      const act_t* a = i < held ? sm.k[i] : (i == held ? sm.k_cur : sm.q);
      float kk = 0.f, kq = 0.f, aa = 0.f;
      for (int c = lane; c < K; c += 32) {
        const float ac = to_float(a[c]);
        kk = fmaf(ac, to_float(sm.k_cur[c]), kk);
        kq = fmaf(ac, to_float(sm.q[c]), kq);
        aa = fmaf(ac, ac, aa);
      }
      kk = group_sum<32>(kk);
      kq = group_sum<32>(kq);
      aa = group_sum<32>(aa);
      if (lane == 0) {
        if (i < records) {
          sm.s.kk[i] = kk;
          sm.s.kq[i] = kq;
          sm.s.rk[i] = inv_norm(aa, L2NORM);
        } else {
          sm.s.q2 = aa;
        }
      }
    }
    const Workspace ws{p.workspace, p.batch, p.num_v_heads};
    if constexpr (PER_CHANNEL) {
      channel_decays(sm, ws, row, vhead0, held, flush);
    } else {
      for (int h = warp; h < VPH; h += kWarps) scalar_decays(sm, h, held);
    }
    __syncthreads();

    // Each held record's two weights, once per (value head, record): the per-item kernel's
    // products, in its order. (Formed per thread, they made the sums below issue-bound.)
    const float rk_j = sm.s.rk[held];
    const float rq = inv_norm(sm.s.q2, L2NORM) * p.scale;
    if constexpr (PER_CHANNEL) {
      channel_weights(sm, ws, row, vhead0, held, flush, rk_j, rq);
    } else {
      for (int e = threadIdx.x; e < VPH * held; e += kThreads) {
        const int h = e / held, i = e % held;
        const float rk_i = sm.s.rk[i];
        sm.s.w_pred[h][i] = sm.s.decay[h][i] * sm.s.kk[i] * rk_i * rk_j;
        sm.s.w_osum[h][i] = sm.s.decay[h][i] * sm.s.kq[i] * rk_i * rq;
      }
    }
    __syncthreads();
    if (SEPARATE && flush) {
      for (int e = threadIdx.x; e < VPH * held; e += kThreads)
        ws.extra(row, vhead0 + e / held)[Offsets::kPredWeights + e % held] = sm.s.w_pred[e / held][e % held];
      if constexpr (SEPARATE) held_weights(sm, ws, row, vhead0, held);
    } else {
      row_sums(p, sm, ws, row, slot, vhead0, held);
    }

    if (threadIdx.x < VPH) {
      float* sc = ws.scalars(row, vhead0 + threadIdx.x);
      sc[0] = PER_CHANNEL ? 1.f : sm.s.total[threadIdx.x];  // per channel: inside the decayed q and k
      sc[1] = sm.s.beta[threadIdx.x];
      sc[2] = rk_j;
      sc[3] = rq;
      sc[4] = sm.s.kq[held] * rk_j * rq;  // dec_j = 1
    }
    if (flush) {  // weights of the held u_i in the fold: dec_i / |k_i| (per channel: 1 / |k_i|)
      for (int e = threadIdx.x; e < VPH * CAP; e += kThreads) {
        const int h = e / CAP, i = e % CAP;
        if (i < held) ws.coef(row, vhead0 + h)[i] = PER_CHANNEL ? sm.s.rk[i] : sm.s.decay[h][i] * sm.s.rk[i];
      }
    } else {  // append g_j and raw k_j at ring row `held` (u_j: the state kernel)
      if constexpr (PER_CHANNEL) {
        for (int e = threadIdx.x; e < VPH * K; e += kThreads)
          p.rec_g[int64_t(slot) * p.rec_g_slot_stride + (int64_t(vhead0 + e / K) * CAP + held) * K + e % K] = sm.channel_g_cur[e / K][e % K];
      } else if (threadIdx.x < VPH) {
        const int64_t at = int64_t(vhead0 + threadIdx.x) * CAP + held;  // within the slot
        p.rec_g[int64_t(slot) * p.rec_g_slot_stride + at] = sm.s.g_cur[threadIdx.x];
        if constexpr (SEPARATE) p.rec_beta[int64_t(slot) * p.rec_beta_slot_stride + at] = sm.s.beta[threadIdx.x];
      }
      store_rows<act_t, K, 1, kThreads>(p.rec_k + int64_t(slot) * p.rec_k_slot_stride + (int64_t(khead) * CAP + held) * K, 0, sm.k_cur, 0);
    }
    // the state kernel advances the cursor from this
    if (khead == 0 && threadIdx.x == 0) store_step(ws.info(row), d);
  }

  // Separate mode's flush: the held raw k Gram (a warp per pair), then each value head's held
  // recomputation weights, totals and norms into the workspace (held_records.cuh).
  static __device__ __forceinline__ void held_weights(Smem& sm, const Workspace& ws, int row, int vhead0, int held) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int pair = warp; pair < held * held; pair += kWarps) {
      const int i = pair / held, m = pair % held;
      if (m >= i) continue;
      const float kk = held_dot<K>(sm.k[m], sm.k[i]);
      if (lane == 0) sm.gram[i][m] = kk;
    }
    __syncthreads();
    // (1/|k_i|: sm.s.rk, the dots loop's, inv_norm of the same |k_i|^2 FMAs)
    struct Out {  // value head vhead0 + h's extra: EXTRA floats after vhead0's
      float* extra0;
      __device__ float* weights(int h) const { return extra0 + h * Offsets::kExtra + Offsets::kHeldWeights; }
      __device__ float* totals(int h) const { return extra0 + h * Offsets::kExtra + Offsets::kHeldTotals; }
      __device__ float* norms(int h) const { return extra0 + h * Offsets::kExtra + Offsets::kHeldNorms; }
    };
    write_held_weights<CAP, VPH, kWarps>(sm.s.g, sm.gram, sm.s.rk, sm.scratch, Out{ws.extra(row, vhead0)}, held);
  }

  // Value head h's decays dec_i and total (a warp).
  static __device__ __forceinline__ void scalar_decays(Smem& sm, int h, int held) {
    const int lane = threadIdx.x % 32, records = held + 1;
    if (records <= 32) {  // one scan, in registers: lane l holds record records - 32 + l
      const int i = records - 32 + lane;
      float decay_i;
      const float total = suffix_decay_lane(i < 0 ? 0.f : (i == held ? sm.s.g_cur[h] : sm.s.g[h][i]), decay_i);
      if (i >= 0) sm.s.decay[h][i] = decay_i;
      if (lane == 0) sm.s.total[h] = total;
      return;
    }
    if (lane == 0) sm.s.g[h][held] = sm.s.g_cur[h];
    __syncwarp();
    const float total = suffix_decays(sm.s.g[h], sm.s.decay[h], records);
    if (lane == 0) sm.s.total[h] = total;
  }

  // Per channel, a thread per (value head, channel): the decays dec_i in place and total
  // (channel_suffix_decays, as the per-item kernel forms them); total * q_j, total * k_j and (a
  // flush's column scale) total go to the workspace.
  static __device__ __forceinline__ void channel_decays(Smem& sm, const Workspace& ws, int row, int vhead0, int held,
                                                        bool flush) {
    for (int e = threadIdx.x; e < VPH * K; e += kThreads) {
      const int h = e / K, c = e % K;
      const float total = channel_suffix_decays<K>(&sm.channel_g[h][0][c], held, sm.channel_g_cur[h][c]);
      float* channels = ws.extra(row, vhead0 + h) + Offsets::kChannels;
      channels[c] = total * to_float(sm.q[c]);
      channels[K + c] = total * to_float(sm.k_cur[c]);
      if (flush) channels[2 * K + c] = total;
    }
  }

  // Per channel, a warp per (value head, held record): (dec_i * k_i) . k_j and . q_j into the
  // weights; a flush also writes the decayed row dec_i * k_i for the state kernel's fold.
  static __device__ __forceinline__ void channel_weights(Smem& sm, const Workspace& ws, int row, int vhead0, int held,
                                                         bool flush, float rk_j, float rq) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int w = warp; w < VPH * held; w += kWarps) {
      const int h = w / held, i = w % held;
      float* decayed_row = ws.extra(row, vhead0 + h) + Offsets::kDecayedRows + i * K;
      float kk = 0.f, kq = 0.f;
      for (int c = lane; c < K; c += 32) {
        const float decayed = to_float(sm.k[i][c]) * sm.channel_g[h][i][c];
        kk = fmaf(decayed, to_float(sm.k_cur[c]), kk);
        kq = fmaf(decayed, to_float(sm.q[c]), kq);
        if (flush) decayed_row[c] = decayed;
      }
      kk = group_sum<32>(kk);
      kq = group_sum<32>(kq);
      if (lane == 0) {
        const float rk_i = sm.s.rk[i];
        sm.s.w_pred[h][i] = kk * rk_i * rk_j;
        sm.s.w_osum[h][i] = kq * rk_i * rq;
      }
    }
  }

  // Per-row sums, kVec consecutive rows of one value head per thread.
  static __device__ __forceinline__ void row_sums(const Params& p, Smem& sm, const Workspace& ws, int row, int slot,
                                                  int vhead0, int held) {
    constexpr int kVec = elements_per_thread<V, VPH * V, kThreads>();
    for (int e = threadIdx.x * kVec; e < VPH * V; e += kThreads * kVec) {
      const int h = e / V, r = e % V;
      float pred[kVec], osum[kVec];
      #pragma unroll
      for (int v = 0; v < kVec; ++v) pred[v] = osum[v] = 0.f;
      auto add_record = [&](int i, const float (&u)[kVec]) {  // u_i into both sums
        const float w_pred = sm.s.w_pred[h][i], w_osum = sm.s.w_osum[h][i];
        #pragma unroll
        for (int v = 0; v < kVec; ++v) {
          pred[v] = fmaf(w_pred, u[v], pred[v]);
          osum[v] = fmaf(w_osum, u[v], osum[v]);
        }
      };
      if constexpr (kRingRowsInShared) {
        for (int i = 0; i < held; ++i) {
          float u[kVec];
          load_floats<float, kVec>(&sm.u[h][i][r], u);
          add_record(i, u);
        }
      } else {  // from L2, kLoadBatch records' loads in flight at once
        const float* held_u = p.rec_u + int64_t(slot) * p.rec_u_slot_stride + int64_t(vhead0 + h) * CAP * V + r;
        for (int i0 = 0; i0 < held; i0 += kLoadBatch) {
          float u[kLoadBatch][kVec];
          #pragma unroll
          for (int b = 0; b < kLoadBatch; ++b)
            if (i0 + b < held) load_floats<float, kVec>(held_u + (i0 + b) * V, u[b]);
          #pragma unroll
          for (int b = 0; b < kLoadBatch; ++b) {
            if (i0 + b >= held) break;
            add_record(i0 + b, u[b]);
          }
        }
      }
      float* extra = ws.extra(row, vhead0 + h);
      store_floats<kVec>(extra + r, pred);
      store_floats<kVec>(extra + V + r, osum);
    }
  }
};

// CAPPED_REGISTERS: launch bounds that leave a thread at most kCappedRegisters, so that one more CTA
// shares an SM: faster where the grid covers the chip many times, slower at small batch
// (ops/tiling.py). Only the 64-row, 4-warp tile has a capped form (capped_registers_tile): smaller
// tiles got more registers under the bound, larger ones would spill.
template <int K, int ROWS, int WARPS>
constexpr bool capped_registers_tile() {
  return WARPS == 4 && ROWS * K / (WARPS * 32) == 64;
}

// Separate mode (read_t not void): non-flush rows read the read copy and append v_j; a flush
// loads the carried copy, recomputes the held u_i from it with the records kernel's weights
// (held_records.cuh's solve_held_u), forms this token's pred from them and folds as a one-copy
// flush does.
template <int K, int V, int VPH, int L, int CAP, int ROWS, int WARPS, typename act_t, typename state_t, bool L2NORM,
          bool GATES_IN_KERNEL, bool SR, bool CAPPED_REGISTERS = false, bool PER_CHANNEL = false,
          typename read_t = void, bool READ_SR = SR>
struct State {
  using Base = Kernel<K, V, VPH, L, CAP, ROWS, WARPS, act_t, state_t, true, L2NORM, GATES_IN_KERNEL, SR, PER_CHANNEL,
                      read_t, READ_SR>;
  static constexpr bool kSeparate = Base::kSeparate;
  using Params = typename Base::Params;
  using Tile = typename Base::Tile;
  using Workspace = gdn::Workspace<K, V, CAP, PER_CHANNEL, kSeparate>;
  using Offsets = WorkspaceLayout<K, V, CAP, PER_CHANNEL, kSeparate>;
  static constexpr int kThreads = Base::kThreads, kSplits = Base::kSplits;
  static constexpr int kCappedRegisters = 96;
  // An NVFP4 copy's stochastic flush store would otherwise take the non-flush rows to one
  // 8-warp CTA per SM: two CTAs (128 registers) keep them memory-bound.
  static constexpr bool kTwoBlockScaledCtas =
      (kBlockScaled<state_t> || kBlockScaled<typename Base::Read>) && kThreads == 256;
  static constexpr int kMinBlocks =
      CAPPED_REGISTERS ? kRegistersPerSm / (kThreads * kCappedRegisters) : (kTwoBlockScaledCtas ? 2 : 0);

  // FP32 checkpoints only: with BF16 ones the registers it frees are chosen by batch instead
  // (CAPPED_REGISTERS). Per channel the fold's held rows are FP32 (decayed) anyway.
  static constexpr bool kConvertK =
      PER_CHANNEL || (!std::is_same_v<act_t, float> && std::is_same_v<state_t, float>);
  static constexpr int kRawKRows = PER_CHANNEL ? 1 : CAP;  // per channel: this token's k only

  // Inputs land as stored (asynchronous copies, no staging registers next to the checkpoint
  // rows); a flush scales its u rows in place. Kept small: shared memory comes out of the L1
  // that holds the checkpoint loads in flight.
  struct Smem {
    alignas(16) float u[CAP][ROWS];  // a flush's held u rows
    alignas(16) act_t k[kRawKRows][K];  // raw k: a flush's ring rows, this token's at [held] ([0] per channel)
    alignas(16) act_t q[K];
    alignas(16) act_t v[ROWS];
    alignas(16) float pred[ROWS];
    alignas(16) float osum[ROWS];
    float coef[CAP], scalars[5];
    ChannelDecays<PER_CHANNEL ? K : 4> channels;  // per channel: total * q_j, total * k_j, total
    // A flush's k, q and v as FP32, converted once per CTA: its fold would otherwise convert a
    // bf16 k value per FMA (narrow rows: each lane reads most of every k row).
    alignas(16) float k_f32[kConvertK ? CAP : 1][K];
    alignas(16) float q_f32[kConvertK ? K : 1];
    alignas(16) float v_f32[kConvertK ? ROWS : 1];
    RecomputeSmem<kSeparate, CAP, ROWS> held;  // separate mode's flush (weights from the records kernel)
  };
  static constexpr size_t kSmemBytes = sizeof(Smem);

  static __device__ __forceinline__ void run(const Params& p, Smem& sm) {
    allow_dependent_grid();  // the next step's first kernel may be scheduled (it waits for this one)
    const auto tile = RowTileIndex<kSplits, VPH>::of_block(p);
    const int split = tile.split, vhead = tile.head, row = tile.row, khead = tile.group, num_k_heads = tile.num_groups;
    const int row0 = split * ROWS;
    const int slot = p.slot_indices[row];
    act_t* out = p.out + (int64_t(row) * p.num_v_heads + vhead) * V + row0;
    if (skip_unusable_row<ROWS, kThreads>(slot, p.pad_slot_id, p.num_slots, out)) return;  // nothing else to do

    // Checkpoint rows and this token's q, k and v first: none of them waits for the records kernel.
    // The copy non-flush steps read (separate mode: the read copy; a flush loads the carried one below).
    typename Base::template Copy<typename Base::Read> read;
    read.load(Base::read_view(p), slot, p.num_v_heads, vhead, row0);
    const act_t* k_cur = p.k + int64_t(row) * p.k_stride_b + int64_t(khead) * p.k_stride_h;
    copy_rows_async<act_t, K, kThreads>(sm.q, 0, 0, p.q + int64_t(row) * p.q_stride_b + int64_t(khead) * p.q_stride_h, 0,
                                        0, 1, 1);
    copy_rows_async<act_t, ROWS, kThreads>(sm.v, 0, 0, p.v + int64_t(row) * p.v_stride_b +
                                           int64_t(vhead) * p.v_stride_h + row0, 0, 0, 1, 1);

    wait_for_prior_grid();  // from here on the records kernel has finished: no cursor readers left
    const Workspace ws{p.workspace, p.batch, p.num_v_heads};
    const auto handed = load_step<L, CAP>(ws.info(row));
    if (!handed.valid()) {  // a corrupted cursor: the row touches nothing
      pipe::wait_copies();
      fill_outputs<ROWS, kThreads>(out, fault_output());
      return;
    }
    const StepDecision d = handed.decide();
    const int held = d.held, records = d.records;
    const bool flush = d.flush;
    const uint64_t epoch = SR ? uint64_t(d.epoch) : 0;
    if (vhead == 0 && split == 0 && threadIdx.x == 0)
      close_split_step(slot_cursor(p.cursors, p.cursor_slot_stride, slot), d);
    // V divides into ROWS-row tiles, so the sums' rows are aligned to ROWS' vector width.
    const float* extra = ws.extra(row, vhead);
    copy_rows_async<float, ROWS, kThreads>(sm.pred, 0, 0, extra + row0, 0, 0, 1, 1);
    copy_rows_async<float, ROWS, kThreads>(sm.osum, 0, 0, extra + V + row0, 0, 0, 1, 1);
    copy_rows_async<float, 1, kThreads>(sm.scalars, 0, 1, ws.scalars(row, vhead), 0, 1, 1, 5);
    const int k_j_row = PER_CHANNEL ? 0 : held;
    copy_rows_async<act_t, K, kThreads>(sm.k[k_j_row], 0, 0, k_cur, 0, 0, 1, 1);
    if constexpr (PER_CHANNEL) {
      const float* channels = extra + Offsets::kChannels;
      copy_rows_async<float, K, kThreads>(sm.channels.q_decayed, 0, 0, channels, 0, 0, 1, 1);
      copy_rows_async<float, K, kThreads>(sm.channels.k_decayed, 0, 0, channels + K, 0, 0, 1, 1);
      if (flush) {  // the fold's column scale and its decayed held k rows
        copy_rows_async<float, K, kThreads>(sm.channels.total, 0, 0, channels + 2 * K, 0, 0, 1, 1);
        copy_rows_async<float, K, kThreads>(&sm.k_f32[0][0], 0, K, extra + Offsets::kDecayedRows, 0, K, 1, held);
      }
    }
    if (flush) {  // the held records to fold, and their weights
      if constexpr (!PER_CHANNEL)
        copy_rows_async<act_t, K, kThreads>(&sm.k[0][0], 0, K, p.rec_k + int64_t(slot) * p.rec_k_slot_stride + int64_t(khead) * CAP * K,
                                            0, K, 1, held);
      if constexpr (kSeparate) {  // the held u_i come from the carried copy: their recomputation weights instead
        copy_rows_async<float, CAP, kThreads>(&sm.held.weight[0][0], 0, CAP, extra + Offsets::kHeldWeights, 0, CAP, 1, held);
        copy_rows_async<float, 1, kThreads>(sm.held.total, 0, 1, extra + Offsets::kHeldTotals, 0, 1, 1, held);
        copy_rows_async<float, 1, kThreads>(sm.held.rk, 0, 1, extra + Offsets::kHeldNorms, 0, 1, 1, held);
      } else {
        copy_rows_async<float, ROWS, kThreads>(&sm.u[0][0], 0, ROWS,
                                               p.rec_u + int64_t(slot) * p.rec_u_slot_stride + int64_t(vhead) * CAP * V + row0, 0, V,
                                               1, held);
      }
      copy_rows_async<float, 1, kThreads>(sm.coef, 0, 1, ws.coef(row, vhead), 0, 1, 1, held);
    }
    pipe::wait_copies();
    __syncthreads();
    typename Base::template Copy<state_t> carried;
    if constexpr (kSeparate) {
      if (flush) {  // the held u_i from the carried copy, then this token's pred from them
        carried.load(Base::state_view(p), slot, p.num_v_heads, vhead, row0);
        load_held_values<V, ROWS, kThreads>(Base::held_values(p, slot, vhead), Base::held_betas(p, slot, vhead), sm.held,
                                            row0, held);
        if constexpr (kConvertK) {  // the held k rows as FP32 first: the recomputation reads each many times
          for (int e = threadIdx.x; e < held * K; e += kThreads) (&sm.k_f32[0][0])[e] = to_float((&sm.k[0][0])[e]);
          __syncthreads();
          solve_held_u<Tile, K, ROWS>(carried, &sm.k_f32[0][0], &sm.u[0][0], sm.held, held);
        } else {
          solve_held_u<Tile, K, ROWS>(carried, &sm.k[0][0], &sm.u[0][0], sm.held, held);
        }
        const float* weights = extra + Offsets::kPredWeights;
        for (int r = threadIdx.x; r < ROWS; r += kThreads) {
          float pred = 0.f;
          for (int i = 0; i < held; ++i) pred = fmaf(weights[i], sm.u[i][r], pred);
          sm.pred[r] = pred;
        }
        __syncthreads();  // before the u rows are scaled below, by other threads
      }
    }
    if (flush) {  // u_i scaled by dec_i / |k_i|, as the per-item kernel does
      for (int e = threadIdx.x; e < held * ROWS; e += kThreads) sm.u[e / ROWS][e % ROWS] *= sm.coef[e / ROWS];
      if constexpr (kConvertK) {
        const int first_raw = PER_CHANNEL ? held : 0;  // per channel only k_j is raw (the held rows came as FP32)
        for (int e = first_raw * K + threadIdx.x; e < records * K; e += kThreads)
          (&sm.k_f32[0][0])[e] = to_float((&sm.k[0][0])[e - first_raw * K]);
        for (int c = threadIdx.x; c < K; c += kThreads) sm.q_f32[c] = to_float(sm.q[c]);
        for (int r = threadIdx.x; r < ROWS; r += kThreads) sm.v_f32[r] = to_float(sm.v[r]);
      }
      __syncthreads();
    }
    // Per channel the decays are inside q and k: total is the constant 1, as in the per-item kernel,
    // so that both kernels contract the same products into the same FMAs.
    const typename Base::RowScalars sc{PER_CHANNEL ? 1.f : sm.scalars[0], sm.scalars[1], sm.scalars[2], sm.scalars[3],
                                       sm.scalars[4]};
    const auto finish = [&](const auto& ck, bool fold, const auto* q, const auto* v, const auto* k) {
      Base::finish_rows(p, ck, out, fold, held, sc, slot, epoch, vhead, row0, q, v, sm.pred, sm.osum,
                        &sm.u[0][0], k, &sm.channels);
    };
    const auto finish_from = [&](const auto& ck) {
      if (kConvertK && flush) {
        finish(ck, true, sm.q_f32, sm.v_f32, &sm.k_f32[0][0]);
      } else {
        finish(ck, flush, sm.q, sm.v, &sm.k[0][0]);
      }
    };
    if (kSeparate && flush) {
      finish_from(carried);
    } else {
      finish_from(read);
    }
    if constexpr (kSeparate) {  // separate mode's v_j at ring row `held`, this CTA's rows
      if (!flush) {
        act_t* v_out = p.rec_v + int64_t(slot) * p.rec_v_slot_stride + (int64_t(vhead) * CAP + held) * V + row0;
        for (int r = threadIdx.x; r < ROWS; r += kThreads) v_out[r] = sm.v[r];
      }
    }
  }
};

}  // namespace replayssm::gdn
