// Gated DeltaNet speculative kernels: the verify step (T drafts per batch row, output only) and the
// conventional snapshot baseline. Contract: docs/speculative.md.
//
// One CTA handles ROWS value rows of one (batch row, value head), its state rows in registers.
// With m committed records (none after an early flush) and draft j's root path W_j, decays
// dec_ij = a(i+1 .. j along W_j) and total_j = a(committed + W_j):
//   pred_j = total_j (S_c k^_j) + sum_{i in committed + W_j, i != j} dec_ij (k^_i . k^_j) u_i
//   u_j    = beta_j (v_j - pred_j)
//   o_j    = total_j (S_c q^_j) + sum_{i in committed + W_j} dec_ij (k^_i . q^_j) u_i
// The drafts' u depend on their ancestors' only: solved in order of j, per row, in registers
// (the unit-triangular T x T system), without forming a state. Records as in mamba2/verify_kernel.cuh.
#pragma once
#include "common/verify.cuh"
#include "gdn/decode_kernel.cuh"

namespace replayssm::gdn {

struct DraftParams {
  int64_t q_stride_t, k_stride_t, v_stride_t, ga_stride_t, gb_stride_t;
  const int32_t* num_drafts;
  const int32_t* parents;
  const int32_t* num_accepted;
  const int32_t* snapshot_slots;
};

template <typename act_t, typename state_t>
struct VerifyParams {
  Params<act_t, state_t> base;
  DraftParams d;
  __host__ __device__ int heads() const { return base.num_v_heads; }
};

// g and beta of draft j at `vhead` (token_gates, with the draft dim).
template <bool GATES_IN_KERNEL, typename P>
__device__ __forceinline__ void draft_gates(const P& p, const DraftParams& d, int row, int j, int vhead, float& g,
                                            float& beta) {
  g = p.gate_a[int64_t(row) * p.ga_stride_b + int64_t(j) * d.ga_stride_t + int64_t(vhead) * p.ga_stride_h];
  beta = p.gate_b[int64_t(row) * p.gb_stride_b + int64_t(j) * d.gb_stride_t + int64_t(vhead) * p.gb_stride_h];
  if constexpr (GATES_IN_KERNEL) {
    g = -expf(p.A_log[vhead]) * softplus(g + p.dt_bias[vhead]);
    beta = 1.f / (1.f + expf(-beta));
  }
}

// Called by every CTA of a verify row once it has read the rings (and written its u rows): the
// row's last CTA writes the rows value heads and row tiles share (every head's g, every key
// head's k) at ring rows first.. (0 after an early flush, else after the committed ones), then
// the cursor.
template <int K, int CAP, int THREADS, bool GATES_IN_KERNEL, typename act_t, typename state_t>
__device__ __forceinline__ void append_shared_drafts(const VerifyParams<act_t, state_t>& vp, const VerifyRow& vr,
                                                     int row, int slot, int num_k_heads, int splits, int* flag) {
  const auto& p = vp.base;
  const auto& d = vp.d;
  int32_t* cursor = slot_cursor(p.cursors, slot);
  if (!last_arrival(cursor, p.num_v_heads * splits, flag)) return;
  const int t = vr.drafts, first = vr.flush ? 0 : vr.committed;
  for (int e = threadIdx.x; e < t * p.num_v_heads; e += THREADS) {
    const int j = e / p.num_v_heads, h = e % p.num_v_heads;
    float g, beta;
    draft_gates<GATES_IN_KERNEL>(p, d, row, j, h, g, beta);
    p.rec_g[(int64_t(slot) * p.num_v_heads + h) * CAP + first + j] = g;
  }
  copy_rows<act_t, K, THREADS>(
      t * num_k_heads,
      [&](int i) { return p.k + int64_t(row) * p.k_stride_b + int64_t(i / num_k_heads) * d.k_stride_t +
                          int64_t(i % num_k_heads) * p.k_stride_h; },
      [&](int i) { return p.rec_k + ((int64_t(slot) * num_k_heads + i % num_k_heads) * CAP + first + i / num_k_heads) * K; });
  finish_verify_cursor(cursor, vr);
}

template <int K, int V, int VPH, int L, int T, int ROWS, int WARPS, typename act_t, typename state_t, bool L2NORM,
          bool GATES_IN_KERNEL, bool SR>
struct Verify {
  static constexpr int kCap = L + T;
  using Params = VerifyParams<act_t, state_t>;
  using Tile = RowTiling<state_t, K, ROWS, WARPS, false>;
  static constexpr int kThreads = Tile::kThreads;
  static constexpr int kSplits = V / ROWS;
  static constexpr int kRecords = kCap - 1 + T;
  static_assert(T >= 2 && T <= 8, "verify drafts: 2..8");

  struct Smem {
    alignas(16) float u[kCap][ROWS];  // committed u (this CTA's rows); a flush scales them in place
    float k[kRecords][K];             // raw k, committed then drafts
    float q[T][K];
    float v[T][ROWS];
    alignas(16) float pred[T][ROWS];  // committed records' part of pred_j and o_j
    alignas(16) float osum[T][ROWS];
    float kk[T][kRecords], kq[T][kRecords];  // k_i . k_j and k_i . q_j, raw; then the weights
    float k2[kRecords], q2[T];
    float g[kRecords], log_after[kRecords], beta[T], total[T];
    DraftTree<T> tree;
    float fold_total;
    int last;
  };
  static constexpr size_t kSmemBytes = sizeof(Smem);

  static __device__ __forceinline__ float inv_norm(float sq) { return L2NORM ? rsqrtf(sq + kNormEps) : 1.f; }

  static __device__ __forceinline__ void run(const Params& vp, Smem& sm) {
    const auto& p = vp.base;
    const auto& d = vp.d;
    begin_after_prior_grid();
    const auto tile = RowTileIndex<kSplits, VPH>::of_block(vp);
    const int split = tile.split, vhead = tile.head, row = tile.row, khead = tile.group, num_k_heads = tile.num_groups;
    const int row0 = split * ROWS;
    const int slot = p.slot_indices[row];
    const auto out_of = [&](int j) { return p.out + ((int64_t(row) * T + j) * p.num_v_heads + vhead) * V + row0; };
    if (skip_unusable_draft_row<T, ROWS, kThreads>(slot, p.pad_slot_id, p.num_slots, out_of)) return;
    typename Tile::Regs s_raw;
    state_t* rows = load_state_rows<Tile, V>(p.state, p.state_slot_stride, slot, vhead, row0, s_raw);

    // This step's drafts (all T rows) and raw gates, in flight during the cursor's round trip.
    RowStager<act_t, K, T, kThreads> k_draft, q_draft;
    RowStager<act_t, ROWS, T, kThreads> v_draft;
    k_draft.load(p.k + int64_t(row) * p.k_stride_b + int64_t(khead) * p.k_stride_h, d.k_stride_t, T);
    q_draft.load(p.q + int64_t(row) * p.q_stride_b + int64_t(khead) * p.q_stride_h, d.q_stride_t, T);
    v_draft.load(p.v + int64_t(row) * p.v_stride_b + int64_t(vhead) * p.v_stride_h + row0, d.v_stride_t, T);
    const bool draft_lane = threadIdx.x < T;
    float gate_a = 0.f, gate_b = 0.f;
    if (draft_lane) {
      gate_a = p.gate_a[int64_t(row) * p.ga_stride_b + int64_t(threadIdx.x) * d.ga_stride_t +
                        int64_t(vhead) * p.ga_stride_h];
      gate_b = p.gate_b[int64_t(row) * p.gb_stride_b + int64_t(threadIdx.x) * d.gb_stride_t +
                        int64_t(vhead) * p.gb_stride_h];
    }
    const int parent_given = draft_lane ? DraftTree<T>::given_parent(d.parents, row, threadIdx.x) : 0;
    const float A_log = GATES_IN_KERNEL ? p.A_log[vhead] : 0.f, dt_bias = GATES_IN_KERNEL ? p.dt_bias[vhead] : 0.f;

    int32_t* cursor = slot_cursor(p.cursors, slot);
    const VerifyRow vr = read_verify_row<L, T>(cursor, d.num_drafts, d.num_accepted, row);
    if (!vr.valid) {  // a corrupted cursor: the row touches nothing
      fault_draft_row<T, ROWS, kThreads>(out_of);
      return;
    }
    const int m = vr.committed, t = vr.drafts, count = m + t;
    const int mc = vr.flush ? 0 : m;

    // Records: committed ones from the rings at [0, m) (one more round trip), drafts at [m, m + t).
    const act_t* rec_k = p.rec_k + (int64_t(slot) * num_k_heads + khead) * kCap * K;
    const float* rec_u = p.rec_u + (int64_t(slot) * p.num_v_heads + vhead) * kCap * V + row0;
    const float* rec_g = p.rec_g + (int64_t(slot) * p.num_v_heads + vhead) * kCap;
    RowStager<act_t, K, kCap - 1, kThreads> k_held;
    RowStager<float, ROWS, kCap - 1, kThreads> u_held;
    k_held.load(rec_k, K, m);
    u_held.load(rec_u, V, m);
    for (int i = threadIdx.x; i < m; i += kThreads) sm.g[i] = rec_g[i];
    if (draft_lane && threadIdx.x < t) {
      float g = gate_a, beta = gate_b;
      if constexpr (GATES_IN_KERNEL) {
        g = -expf(A_log) * softplus(g + dt_bias);
        beta = 1.f / (1.f + expf(-beta));
      }
      sm.g[m + threadIdx.x] = g;
      sm.beta[threadIdx.x] = beta;
    }
    if (draft_lane) sm.tree.set_parent(threadIdx.x, parent_given);
    k_held.store(sm.k, 0, m);
    u_held.store(sm.u, 0, m);
    k_draft.store(sm.k, m, t);
    q_draft.store(sm.q, 0, t);
    v_draft.store(sm.v, 0, t);
    __syncthreads();

    // Dots (raw) of every record's k with each draft's k (and |k_i|^2) and q, log-decays.
    dots_with_drafts<K, T, WARPS>(sm.k, count, sm.k + m, t, &sm.kk[0][0], kRecords, sm.k2);
    dots_with_drafts<K, T, WARPS>(sm.k, count, sm.q, t, &sm.kq[0][0], kRecords, nullptr);
    dots_with_drafts<K, T, WARPS>(sm.q, t, sm.q, 0, nullptr, 0, sm.q2);
    window_logs<T, kThreads>(sm.tree, sm.g, sm.log_after, m, t, &sm.fold_total);
    __syncthreads();

    // Weights of u_i in pred_j (kk) and in o_j (kq), in place; zero off committed + W_j.
    const float committed_log = vr.flush ? 0.f : sm.fold_total;
    for (int pair = threadIdx.x; pair < t * count; pair += kThreads) {
      const int j = pair / count, i = pair % count;
      const float dec = window_decay(sm.tree, sm.g, sm.log_after, m, mc, j, i);
      const float rk_i = inv_norm(sm.k2[i]), rk_j = inv_norm(sm.k2[m + j]);
      const float rq_j = inv_norm(sm.q2[j]) * p.scale;
      sm.kk[j][i] = i == m + j ? 0.f : dec * sm.kk[j][i] * rk_i * rk_j;
      sm.kq[j][i] = dec * sm.kq[j][i] * rk_i * rq_j;
    }
    if (threadIdx.x < t) sm.total[threadIdx.x] = expf(committed_log + sm.tree.path_log[threadIdx.x]);
    __syncthreads();
    // The committed records' part of each (draft, row); a flush's fold weights in place instead.
    for (int e = threadIdx.x; e < t * ROWS; e += kThreads) {
      const int j = e / ROWS, r = e % ROWS;
      float pr = 0.f, os = 0.f;
      for (int i = 0; i < mc; ++i) {
        pr = fmaf(sm.kk[j][i], sm.u[i][r], pr);
        os = fmaf(sm.kq[j][i], sm.u[i][r], os);
      }
      sm.pred[j][r] = pr;
      sm.osum[j][r] = os;
    }
    if (vr.flush)
      for (int e = threadIdx.x; e < m * ROWS; e += kThreads) {
        const int i = e / ROWS, r = e % ROWS;
        sm.u[i][r] *= expf(sm.log_after[i]) * inv_norm(sm.k2[i]);
      }
    __syncthreads();

    // Rows: the early flush's fold (written back), then the drafts in order, u in registers.
    float s[Tile::kPasses][Tile::kChunksPerLane][Tile::kVec];
    fold_tile<Tile, ROWS>(s_raw, s, vr.flush ? expf(sm.fold_total) : 1.f, vr.flush, sm.u, sm.k, m);
    if (vr.flush)
      store_tile<Tile, SR, V>(rows, s, rounding_seed<SR>(p), slot, uint64_t(SR ? vr.epoch : 0), vhead, row0);
    const int first = vr.flush ? 0 : m;
    float* u_ring = p.rec_u + (int64_t(slot) * p.num_v_heads + vhead) * kCap * V + row0;
    float du[T][Tile::kPasses];  // the drafts' u of this lane's rows
    #pragma unroll
    for (int j = 0; j < T; ++j) {
      act_t* out = out_of(j);
      if (j >= t) {  // no such draft: a zero output and no u
        #pragma unroll
        for (int i = 0; i < Tile::kPasses; ++i) du[j][i] = 0.f;
        Tile::fill_rows(out, 0.f);
        continue;
      }
      const float rk_j = inv_norm(sm.k2[m + j]), rq_j = inv_norm(sm.q2[j]) * p.scale;
      float k_reg[Tile::kChunksPerLane][Tile::kVec], q_reg[Tile::kChunksPerLane][Tile::kVec];
      Tile::slice(&sm.k[m + j][0], k_reg);
      Tile::slice(&sm.q[j][0], q_reg);
      #pragma unroll
      for (int i = 0; i < Tile::kPasses; ++i) {
        const int r = Tile::row(i);
        float sk, sq;
        Tile::dot2(s[i], k_reg, q_reg, sk, sq);
        float pred = sm.total[j] * group_sum<Tile::kLanesPerRow>(sk) * rk_j + sm.pred[j][r];
        float o = sm.total[j] * group_sum<Tile::kLanesPerRow>(sq) * rq_j + sm.osum[j][r];
        #pragma unroll
        for (int a = 0; a < j; ++a) pred = fmaf(sm.kk[j][m + a], du[a][i], pred);
        const float u = sm.beta[j] * (sm.v[j][r] - pred);
        du[j][i] = u;
        #pragma unroll
        for (int a = 0; a <= j; ++a) o = fmaf(sm.kq[j][m + a], du[a][i], o);
        if (Tile::row_leader()) {
          out[r] = from_float<act_t>(o);
          u_ring[int64_t(first + j) * V + r] = u;
        }
      }
    }

    append_shared_drafts<K, kCap, kThreads, GATES_IN_KERNEL>(vp, vr, row, slot, num_k_heads, kSplits, &sm.last);
  }
};

// The conventional spec baseline (mamba2::Snapshot): the t drafts as a chain of conventional
// steps from one read of the state, the state after draft j written into snapshot_slots[row, j].
template <int K, int V, int VPH, int T, int ROWS, int WARPS, typename act_t, typename state_t, bool L2NORM,
          bool GATES_IN_KERNEL>
struct Snapshot {
  using Params = VerifyParams<act_t, state_t>;
  using Tile = RowTiling<state_t, K, ROWS, WARPS, true>;
  static constexpr int kThreads = Tile::kThreads;
  static constexpr int kSplits = V / ROWS;

  struct Smem {
    float k[T][K], q[T][K];
    float v[T][ROWS];
    float g[T], beta[T], rk[T], rq[T];
  };
  static constexpr size_t kSmemBytes = sizeof(Smem);

  static __device__ __forceinline__ void run(const Params& vp, Smem& sm) {
    const auto& p = vp.base;
    const auto& d = vp.d;
    begin_after_prior_grid();
    const auto tile = RowTileIndex<kSplits, VPH>::of_block(vp);
    const int split = tile.split, vhead = tile.head, row = tile.row, khead = tile.group;
    const int row0 = split * ROWS;
    const int slot = p.slot_indices[row];
    const auto out_of = [&](int j) { return p.out + ((int64_t(row) * T + j) * p.num_v_heads + vhead) * V + row0; };
    if (skip_unusable_draft_row<T, ROWS, kThreads>(slot, p.pad_slot_id, p.num_slots, out_of)) return;
    typename Tile::Regs s_raw;
    load_state_rows<Tile, V>(p.state, p.state_slot_stride, slot, vhead, row0, s_raw);
    RowStager<act_t, K, T, kThreads> k_draft, q_draft;
    RowStager<act_t, ROWS, T, kThreads> v_draft;
    k_draft.load(p.k + int64_t(row) * p.k_stride_b + int64_t(khead) * p.k_stride_h, d.k_stride_t, T);
    q_draft.load(p.q + int64_t(row) * p.q_stride_b + int64_t(khead) * p.q_stride_h, d.q_stride_t, T);
    v_draft.load(p.v + int64_t(row) * p.v_stride_b + int64_t(vhead) * p.v_stride_h + row0, d.v_stride_t, T);
    const int t = d.num_drafts != nullptr ? min(max(d.num_drafts[row], 0), T) : T;
    k_draft.store(sm.k, 0, t);
    q_draft.store(sm.q, 0, t);
    v_draft.store(sm.v, 0, t);
    if (threadIdx.x < t) draft_gates<GATES_IN_KERNEL>(p, d, row, threadIdx.x, vhead, sm.g[threadIdx.x], sm.beta[threadIdx.x]);
    __syncthreads();
    for (int i = threadIdx.x; i < 2 * t; i += kThreads) {
      const float* a = i < t ? sm.k[i] : sm.q[i - t];
      float acc = 0.f;
      for (int c = 0; c < K; ++c) acc = fmaf(a[c], a[c], acc);
      const float inv = L2NORM ? rsqrtf(acc + kNormEps) : 1.f;
      if (i < t) sm.rk[i] = inv; else sm.rq[i - t] = inv * p.scale;
    }
    __syncthreads();

    float s[Tile::kPasses][Tile::kChunksPerLane][Tile::kVec];
    #pragma unroll
    for (int i = 0; i < Tile::kPasses; ++i)
      #pragma unroll
      for (int c = 0; c < Tile::kChunksPerLane; ++c)
        #pragma unroll
        for (int e = 0; e < Tile::kVec; ++e) s[i][c][e] = s_raw[i][c].get(e);
    #pragma unroll 1
    for (int j = 0; j < T; ++j) {
      act_t* out = out_of(j);
      if (j >= t) {  // no such draft: a zero output
        Tile::fill_rows(out, 0.f);
        continue;
      }
      const float alpha = expf(sm.g[j]), rk = sm.rk[j], rq = sm.rq[j];
      const int snap = d.snapshot_slots[int64_t(row) * T + j];
      const bool write = unsigned(snap) < unsigned(p.num_slots);
      state_t* snap_rows = p.state + int64_t(snap) * p.state_slot_stride + (int64_t(vhead) * V + row0) * K;
      float k_reg[Tile::kChunksPerLane][Tile::kVec], q_reg[Tile::kChunksPerLane][Tile::kVec];
      Tile::slice(&sm.k[j][0], k_reg);
      Tile::slice(&sm.q[j][0], q_reg);
      #pragma unroll
      for (int i = 0; i < Tile::kPasses; ++i) {
        const int r = Tile::row(i);
        const float sk = Tile::dot(s[i], k_reg);
        const float u = sm.beta[j] * (sm.v[j][r] - alpha * group_sum<Tile::kLanesPerRow>(sk) * rk);
        const float w = u * rk;
        float acc = 0.f;
        #pragma unroll
        for (int c = 0; c < Tile::kChunksPerLane; ++c) {
          #pragma unroll
          for (int e = 0; e < Tile::kVec; ++e) {
            s[i][c][e] = fmaf(w, k_reg[c][e], alpha * s[i][c][e]);
            acc = fmaf(s[i][c][e], q_reg[c][e], acc);
          }
          if (write) store_chunk<state_t, false>(snap_rows + int64_t(r) * K + Tile::col(c), s[i][c], 0, 0);
        }
        const float o = group_sum<Tile::kLanesPerRow>(acc) * rq;
        if (Tile::row_leader()) out[r] = from_float<act_t>(o);
      }
    }
  }
};

}  // namespace replayssm::gdn
