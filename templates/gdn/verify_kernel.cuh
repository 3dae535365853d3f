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
//
// PER_CHANNEL (KDA): dec_ij and total_j are vectors over the key channels, exps of sums of
// log-decays along the window (never ratios), inside the dots: ((dec_ij * k^_i) . k^_j) and
// S_c (total_j * k^_j); an early flush folds S_c Diag(a(committed)) + sum_i u_i (dec_i * k^_i)^T.
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

// Drafts' per-channel log-decays (channel_log_decay) of `heads` value heads from head0, each
// passed to put(j, h, c, g), formed in batches with their loads in flight together: a CTA forms
// t x K of them, the appending CTA t x HV x K, and one dependent load chain each would make
// that latency-bound.
template <int K, int THREADS, bool GATES_IN_KERNEL, typename act_t, typename state_t, class Put>
__device__ __forceinline__ void form_draft_channel_decays(const VerifyParams<act_t, state_t>& vp, int row, int total,
                                                          int heads, int head0, const Put& put) {
  const auto& p = vp.base;
  const auto& d = vp.d;
  constexpr int kBatch = 8;
  for (int base = threadIdx.x; base < total; base += THREADS * kBatch) {
    float a[kBatch], bias[kBatch], A_log[kBatch];
    #pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int e = base + u * THREADS, j = e / (heads * K), h = head0 + e / K % heads, c = e % K;
      if (e < total) {
        a[u] = p.gate_a[int64_t(row) * p.ga_stride_b + int64_t(j) * d.ga_stride_t + int64_t(h) * p.ga_stride_h + c];
        bias[u] = GATES_IN_KERNEL ? p.dt_bias[int64_t(h) * K + c] : 0.f;
        A_log[u] = GATES_IN_KERNEL ? p.A_log[h] : 0.f;
      }
    }
    #pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int e = base + u * THREADS, j = e / (heads * K), h = head0 + e / K % heads, c = e % K;
      if (e < total) put(j, h, c, GATES_IN_KERNEL ? formed_channel_log_decay(a[u], bias[u], A_log[u], p.lower_bound) : a[u]);
    }
  }
}

// Called by every CTA of a verify row once it has read the rings (and written its u rows): the
// rows value heads and row tiles share (every head's g, and beta in separate mode; every key
// head's k) go to ring rows first.. (0 after an early flush, else after the committed ones) by
// write_own (wrote_own_rows) or else from the inputs by the row's last CTA, which then writes
// the cursor. PER_CHANNEL: a g row holds K log-decays.
template <int K, int CAP, int THREADS, bool GATES_IN_KERNEL, bool PER_CHANNEL, typename act_t, typename state_t,
          class WriteOwn = NoOwnRows>
__device__ __forceinline__ void append_shared_drafts(const VerifyParams<act_t, state_t>& vp, const VerifyRow& vr,
                                                     int row, int slot, int num_k_heads, int splits, int* flag,
                                                     const WriteOwn& write_own = {}) {
  const auto& p = vp.base;
  const auto& d = vp.d;
  int32_t* cursor = slot_cursor(p.cursors, p.cursor_slot_stride, slot);
  const bool written = wrote_own_rows(vr, write_own);
  if (!last_arrival(cursor, p.num_v_heads * splits, flag)) return;
  if (written) {
    finish_verify_cursor(cursor, vr);
    return;
  }
  const int t = vr.drafts, first = vr.flush ? 0 : vr.committed;
  if constexpr (PER_CHANNEL) {
    if (vr.flush)
      form_draft_channel_decays<K, THREADS, GATES_IN_KERNEL>(
          vp, row, t * p.num_v_heads * K, p.num_v_heads, 0, [&](int j, int h, int c, float g) {
            p.rec_g[int64_t(slot) * p.rec_g_slot_stride + (int64_t(h) * CAP + first + j) * K + c] = g;
          });
  } else {
    for (int e = threadIdx.x; e < t * p.num_v_heads; e += THREADS) {
      const int j = e / p.num_v_heads, h = e % p.num_v_heads;
      float g, beta;
      draft_gates<GATES_IN_KERNEL>(p, d, row, j, h, g, beta);
      p.rec_g[int64_t(slot) * p.rec_g_slot_stride + int64_t(h) * CAP + first + j] = g;
      // Separate mode's beta ring (every CTA of the row has read the committed ones by now).
      if (p.rec_beta != nullptr) p.rec_beta[int64_t(slot) * p.rec_beta_slot_stride + int64_t(h) * CAP + first + j] = beta;
    }
  }
  copy_rows<act_t, K, THREADS>(
      t * num_k_heads,
      [&](int i) { return p.k + int64_t(row) * p.k_stride_b + int64_t(i / num_k_heads) * d.k_stride_t +
                          int64_t(i % num_k_heads) * p.k_stride_h; },
      [&](int i) { return p.rec_k + int64_t(slot) * p.rec_k_slot_stride + (int64_t(i % num_k_heads) * CAP + first + i / num_k_heads) * K; });
  finish_verify_cursor(cursor, vr);
}

// A verify row's per-channel decays (PER_CHANNEL): the log-decays staged per record (committed,
// then drafts); then, each the exp of one sum of log-decays (never a ratio of exps), a committed
// record's decay to the committed records' end (in place), the committed records' total, each
// draft's own decay and its root path's, and total_j * q_j, total_j * k_j. A pair's decay is a
// product of these (each at most 1), so a window costs an exp per record and channel, not per pair.
template <bool PER_CHANNEL, int RECORDS, int T, int K>
struct VerifyChannels {};
template <int RECORDS, int T, int K>
struct VerifyChannels<true, RECORDS, T, K> {
  alignas(16) float g[RECORDS][K];
  alignas(16) float step[T][K];    // exp(g) of each draft
  alignas(16) float path[T][K];    // exp(sum of g along draft j's root path)
  alignas(16) float committed[K];  // exp(sum of the committed records' g): an early flush's column scale
  alignas(16) float q_decayed[T][K];
  alignas(16) float k_decayed[T][K];
};

// Separate mode (read_t not void; GDN, per item): a verify that does not flush reads the read
// copy; an early flush loads the carried copy, recomputes each committed u from it (the decode
// kernel's recompute_held_u, over the rings' v and beta) before folding, and writes both copies;
// the drafts' v and beta go to the rings beside their u.
template <int K, int V, int VPH, int L, int T, int ROWS, int WARPS, typename act_t, typename state_t, bool L2NORM,
          bool GATES_IN_KERNEL, bool SR, bool PER_CHANNEL = false, typename read_t = void, bool READ_SR = SR>
struct Verify {
  static constexpr int kCap = L + T;
  static constexpr bool kSeparate = !std::is_void_v<read_t>;
  static_assert(!(kSeparate && PER_CHANNEL), "KDA has no read copy");
  using Params = VerifyParams<act_t, state_t>;
  using Tile = RowTiling<state_t, K, ROWS, WARPS, false>;
  using Read = std::conditional_t<kSeparate, read_t, state_t>;
  template <class C> using Copy = TileCheckpoint<RowTiling<C, K, ROWS, WARPS, false>, C, V>;
  // The decode kernel whose separate-mode flush this one's repeats (the same tile and capacity).
  using Step = Kernel<K, V, VPH, L, kCap, ROWS, WARPS, act_t, state_t, true, L2NORM, GATES_IN_KERNEL, SR, false,
                      read_t, READ_SR>;
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
    VerifyChannels<PER_CHANNEL, kRecords, T, K> ch;
    RecomputeSmem<kSeparate, kCap, ROWS> held;  // separate mode's early flush
  };
  static constexpr size_t kSmemBytes = sizeof(Smem);

  static __device__ __forceinline__ float inv_norm(float sq) { return gdn::inv_norm(sq, L2NORM); }

  // Per channel, once the records, log-decays and parents are staged: |k_i|^2 and |q_j|^2, the
  // decays of VerifyChannels (a thread per channel), the tree's ancestor sets; after a barrier,
  // total_j * q_j and total_j * k_j and the dots ((dec_ij * k_i) . k_j) and ((dec_ij * k_i) . q_j)
  // of every pair on a window (a warp per pair; zero off it), raw as dots_with_drafts leaves them.
  static __device__ __forceinline__ void channel_logs_and_dots(Smem& sm, int m, int mc, int t, bool flush) {
    const int count = m + t;
    dots_with_drafts<K, T, WARPS>(sm.k, count, sm.q, 0, nullptr, 0, sm.k2);
    dots_with_drafts<K, T, WARPS>(sm.q, t, sm.q, 0, nullptr, 0, sm.q2);
    if (threadIdx.x == 0) sm.tree.link();
    for (int c = threadIdx.x; c < K; c += kThreads) {
      float suffix = 0.f;
      for (int i = m - 1; i >= 0; --i) {
        const float g = sm.ch.g[i][c];
        sm.ch.g[i][c] = expf(suffix);
        suffix += g;
      }
      sm.ch.committed[c] = expf(suffix);
      for (int j = 0; j < t; ++j) {
        float path = 0.f;
        for (int node = j; node >= 0; node = sm.tree.parent[node]) path += sm.ch.g[m + node][c];
        sm.ch.path[j][c] = expf(path);
        sm.ch.step[j][c] = expf(sm.ch.g[m + j][c]);
      }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < t * K; e += kThreads) {
      const int j = e / K, c = e % K;
      // After an early flush the window starts at the drafts.
      const float total = flush ? sm.ch.path[j][c] : sm.ch.committed[c] * sm.ch.path[j][c];
      sm.ch.q_decayed[j][c] = total * sm.q[j][c];
      sm.ch.k_decayed[j][c] = total * sm.k[m + j][c];
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int pair = warp; pair < t * count; pair += WARPS) {
      const int j = pair / count, i = pair % count;
      const bool committed = i < mc, on_path = i >= m && sm.tree.on_path(j, i - m);
      float kk = 0.f, kq = 0.f;
      if (committed || on_path) {
        for (int c = lane; c < K; c += 32) {
          float dec = 1.f;
          if (committed) {
            dec = sm.ch.g[i][c] * sm.ch.path[j][c];
          } else {
            for (int node = j; node != i - m; node = sm.tree.parent[node]) dec *= sm.ch.step[node][c];
          }
          const float decayed = sm.k[i][c] * dec;
          kk = fmaf(decayed, sm.k[m + j][c], kk);
          kq = fmaf(decayed, sm.q[j][c], kq);
        }
        kk = group_sum<32>(kk);
        kq = group_sum<32>(kq);
      }
      if (lane == 0) {
        sm.kk[j][i] = kk;
        sm.kq[j][i] = kq;
      }
    }
  }

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
    // The copy a non-flush verify reads (any format; the read copy in separate mode), first.
    Copy<Read> read;
    read.load(Step::read_view(p), slot, p.num_v_heads, vhead, row0);

    // This step's drafts (all T rows) and raw gates, in flight during the cursor's round trip.
    RowStager<act_t, K, T, kThreads> k_draft, q_draft;
    RowStager<act_t, ROWS, T, kThreads> v_draft;
    k_draft.load(p.k + int64_t(row) * p.k_stride_b + int64_t(khead) * p.k_stride_h, d.k_stride_t, T);
    q_draft.load(p.q + int64_t(row) * p.q_stride_b + int64_t(khead) * p.q_stride_h, d.q_stride_t, T);
    v_draft.load(p.v + int64_t(row) * p.v_stride_b + int64_t(vhead) * p.v_stride_h + row0, d.v_stride_t, T);
    const bool draft_lane = threadIdx.x < T;
    float gate_a = 0.f, gate_b = 0.f;
    if (draft_lane) {
      if constexpr (!PER_CHANNEL)  // (per channel: formed with the committed records' g)
        gate_a = p.gate_a[int64_t(row) * p.ga_stride_b + int64_t(threadIdx.x) * d.ga_stride_t +
                          int64_t(vhead) * p.ga_stride_h];
      gate_b = p.gate_b[int64_t(row) * p.gb_stride_b + int64_t(threadIdx.x) * d.gb_stride_t +
                        int64_t(vhead) * p.gb_stride_h];
    }
    const int parent_given = draft_lane ? DraftTree<T>::given_parent(d.parents, row, threadIdx.x) : 0;
    const float A_log = GATES_IN_KERNEL && !PER_CHANNEL ? p.A_log[vhead] : 0.f;
    const float dt_bias = GATES_IN_KERNEL && !PER_CHANNEL ? p.dt_bias[vhead] : 0.f;

    // Committed records (k, u rows and g): early where p.speculative (per channel, the g rows
    // always after the cursor read).
    const float* rec_g = p.rec_g + int64_t(slot) * p.rec_g_slot_stride + int64_t(vhead) * kCap * (PER_CHANNEL ? K : 1);
    HeldRecords<act_t, K, float, ROWS, kCap - 1, kThreads, !PER_CHANNEL> held(
        p.speculative, p.rec_k + int64_t(slot) * p.rec_k_slot_stride + int64_t(khead) * kCap * K, K,
        p.rec_u + int64_t(slot) * p.rec_u_slot_stride + int64_t(vhead) * kCap * V + row0, V, rec_g);

    int32_t* cursor = slot_cursor(p.cursors, p.cursor_slot_stride, slot);
    const VerifyRow vr = read_verify_row<L, T>(cursor, d.num_drafts, d.num_accepted, row);
    if (!vr.valid) {  // a corrupted cursor: the row touches nothing
      fault_draft_row<T, ROWS, kThreads>(out_of);
      return;
    }
    const int m = vr.committed, t = vr.drafts, count = m + t;
    const int mc = vr.flush ? 0 : m;

    // Records: committed ones at [0, m), drafts at [m, m + t).
    held.load_held(m);
    if constexpr (PER_CHANNEL) {
      for (int e = threadIdx.x; e < m * K / 4; e += kThreads)
        reinterpret_cast<float4*>(&sm.ch.g[0][0])[e] = reinterpret_cast<const float4*>(rec_g)[e];
      form_draft_channel_decays<K, kThreads, GATES_IN_KERNEL>(
          vp, row, t * K, 1, vhead, [&](int j, int, int c, float g) { sm.ch.g[m + j][c] = g; });
    } else {
      for (int i = threadIdx.x; i < m; i += kThreads) sm.g[i] = held.scalar(i);
    }
    if (draft_lane && threadIdx.x < t) {
      float g = gate_a, beta = gate_b;
      if constexpr (GATES_IN_KERNEL) {
        if constexpr (!PER_CHANNEL) g = -expf(A_log) * softplus(g + dt_bias);
        beta = 1.f / (1.f + expf(-beta));
      }
      if constexpr (!PER_CHANNEL) sm.g[m + threadIdx.x] = g;
      sm.beta[threadIdx.x] = beta;
    }
    if (draft_lane) sm.tree.set_parent(threadIdx.x, parent_given);
    held.store(sm.k, sm.u, m);
    k_draft.store(sm.k, m, t);
    q_draft.store(sm.q, 0, t);
    v_draft.store(sm.v, 0, t);
    __syncthreads();

    // Dots (raw) of every record's k with each draft's k (and |k_i|^2) and q, log-decays (per
    // channel: the decays inside the dots).
    if constexpr (PER_CHANNEL) {
      channel_logs_and_dots(sm, m, mc, t, vr.flush);
    } else {
      dots_with_drafts<K, T, WARPS>(sm.k, count, sm.k + m, t, &sm.kk[0][0], kRecords, sm.k2);
      dots_with_drafts<K, T, WARPS>(sm.k, count, sm.q, t, &sm.kq[0][0], kRecords, nullptr);
      dots_with_drafts<K, T, WARPS>(sm.q, t, sm.q, 0, nullptr, 0, sm.q2);
      window_logs<T, kThreads>(sm.tree, sm.g, sm.log_after, m, t, &sm.fold_total);
    }
    __syncthreads();

    // Weights of u_i in pred_j (kk) and in o_j (kq), in place; zero off committed + W_j.
    const float committed_log = vr.flush || PER_CHANNEL ? 0.f : sm.fold_total;
    for (int pair = threadIdx.x; pair < t * count; pair += kThreads) {
      const int j = pair / count, i = pair % count;
      // (per channel the decays are inside the dots; 0 off the window still masks a NaN norm)
      const float dec = PER_CHANNEL ? float(i < mc || (i >= m && sm.tree.on_path(j, i - m)))
                                    : window_decay(sm.tree, sm.g, sm.log_after, m, mc, j, i);
      const float rk_i = inv_norm(sm.k2[i]), rk_j = inv_norm(sm.k2[m + j]);
      const float rq_j = inv_norm(sm.q2[j]) * p.scale;
      sm.kk[j][i] = i == m + j ? 0.f : window_weight(dec, sm.kk[j][i] * rk_i * rk_j);
      sm.kq[j][i] = window_weight(dec, sm.kq[j][i] * rk_i * rq_j);
    }
    if (threadIdx.x < t) sm.total[threadIdx.x] = PER_CHANNEL ? 1.f : expf(committed_log + sm.tree.path_log[threadIdx.x]);
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
    // The fold's weights of the committed u (recomputed from the carried copy first in separate
    // mode: they were formed from the read copy), in place.
    const auto fold_weights = [&] {
      if (vr.flush) {
        for (int e = threadIdx.x; e < m * ROWS; e += kThreads) {
          const int i = e / ROWS, r = e % ROWS;
          sm.u[i][r] *= (PER_CHANNEL ? 1.f : expf(sm.log_after[i])) * inv_norm(sm.k2[i]);
        }
        if constexpr (PER_CHANNEL) {  // the fold's decayed k rows and column scale, in place
          for (int e = threadIdx.x; e < m * K; e += kThreads) sm.k[e / K][e % K] *= sm.ch.g[e / K][e % K];
        }
      }
      __syncthreads();
    };
    const int first = vr.flush ? 0 : m;
    float* u_ring = p.rec_u + int64_t(slot) * p.rec_u_slot_stride + int64_t(vhead) * kCap * V + row0;

    // Rows: the early flush's fold (written back), then the drafts in order, u in registers.
    const auto finish = [&](const auto& ck) {
      using RT = typename std::decay_t<decltype(ck)>::Tiling;
      float s[RT::kPasses][RT::kChunksPerLane][RT::kVec];
      tile_values(ck, (!PER_CHANNEL && vr.flush) ? expf(sm.fold_total) : 1.f, s);
      if (vr.flush) {
        if constexpr (PER_CHANNEL) scale_columns<RT>(s, static_cast<const float*>(sm.ch.committed));
        fold_records<RT, ROWS>(s, sm.u, sm.k, m);
        const auto read_at = CopyRows<Read, V, K>::of(Step::read_view(p), slot, p.num_v_heads, vhead, row0);
        store_flushed<RT, SR, kSeparate, READ_SR, V, K>(ck.at, read_at, s, rounding_seed<SR>(p), slot,
                                                        uint64_t(SR ? vr.epoch : 0), vhead, row0);
      }
      float du[T][RT::kPasses];  // the drafts' u of this lane's rows
      #pragma unroll
      for (int j = 0; j < T; ++j) {
        act_t* out = out_of(j);
        if (j >= t) {  // no such draft: a zero output and no u
          #pragma unroll
          for (int i = 0; i < RT::kPasses; ++i) du[j][i] = 0.f;
          RT::fill_rows(out, 0.f);
          continue;
        }
        const float rk_j = inv_norm(sm.k2[m + j]), rq_j = inv_norm(sm.q2[j]) * p.scale;
        float k_reg[RT::kChunksPerLane][RT::kVec], q_reg[RT::kChunksPerLane][RT::kVec];
        if constexpr (PER_CHANNEL) {
          RT::slice(&sm.ch.k_decayed[j][0], k_reg);
          RT::slice(&sm.ch.q_decayed[j][0], q_reg);
        } else {
          RT::slice(&sm.k[m + j][0], k_reg);
          RT::slice(&sm.q[j][0], q_reg);
        }
        #pragma unroll
        for (int i = 0; i < RT::kPasses; ++i) {
          const int r = RT::row(i);
          float sk, sq;
          RT::dot2(s[i], k_reg, q_reg, sk, sq);
          float pred = sm.total[j] * group_sum<RT::kLanesPerRow>(sk) * rk_j + sm.pred[j][r];
          float o = sm.total[j] * group_sum<RT::kLanesPerRow>(sq) * rq_j + sm.osum[j][r];
          #pragma unroll
          for (int a = 0; a < j; ++a)  // (a non-ancestor has weight 0 and is skipped: its u may be NaN)
            if (sm.kk[j][m + a] != 0.f) pred = fmaf(sm.kk[j][m + a], du[a][i], pred);
          const float u = sm.beta[j] * (sm.v[j][r] - pred);
          du[j][i] = u;
          #pragma unroll
          for (int a = 0; a <= j; ++a)
            if (sm.kq[j][m + a] != 0.f) o = fmaf(sm.kq[j][m + a], du[a][i], o);
          if (RT::row_leader()) {
            out[r] = from_float<act_t>(o);
            u_ring[int64_t(first + j) * V + r] = u;
          }
        }
      }
    };
    if constexpr (kSeparate) {
      if (vr.flush) {
        Copy<state_t> carried;
        carried.load(Step::state_view(p), slot, p.num_v_heads, vhead, row0);
        Step::recompute_held_u(p, carried, &sm.k[0][0], sm.g, &sm.u[0][0], sm.held, slot, vhead, row0, m);
        fold_weights();
        finish(carried);
      } else {
        fold_weights();
        finish(read);
      }
      // The drafts' v rows of this CTA at ring rows first.. (its own recompute read rows 0..m
      // before the barrier that ended it); their beta goes with the rows the heads share.
      act_t* v_ring = p.rec_v + int64_t(slot) * p.rec_v_slot_stride + (int64_t(vhead) * kCap + first) * V + row0;
      for (int e = threadIdx.x; e < t * ROWS; e += kThreads)
        v_ring[int64_t(e / ROWS) * V + e % ROWS] = from_float<act_t>(sm.v[e / ROWS][e % ROWS]);
    } else {
      fold_weights();
      finish(read);
    }

    // Shared rows from this CTA's shared memory: its value head's g (and beta), first row tile;
    // its key head's k rows, the key head's first value head.
    const auto write_own = [&](int first) {
      if (split != 0) return true;
      const int64_t g_width = PER_CHANNEL ? K : 1;
      float* g_ring = p.rec_g + int64_t(slot) * p.rec_g_slot_stride + (int64_t(vhead) * kCap + first) * g_width;
      if constexpr (PER_CHANNEL) {
        for (int j = 0; j < t; ++j)
          for (int c = threadIdx.x; c < K; c += kThreads) g_ring[j * K + c] = sm.ch.g[m + j][c];
      } else {
        for (int j = threadIdx.x; j < t; j += kThreads) g_ring[j] = sm.g[m + j];
      }
      if (p.rec_beta != nullptr)
        for (int j = threadIdx.x; j < t; j += kThreads)
          p.rec_beta[int64_t(slot) * p.rec_beta_slot_stride + int64_t(vhead) * kCap + first + j] = sm.beta[j];
      if (vhead % VPH == 0) {
        act_t* k_ring = p.rec_k + int64_t(slot) * p.rec_k_slot_stride + (int64_t(khead) * kCap + first) * K;
        for (int j = 0; j < t; ++j)
          for (int c = threadIdx.x; c < K; c += kThreads) k_ring[j * K + c] = from_float<act_t>(sm.k[m + j][c]);
      }
      return true;
    };
    append_shared_drafts<K, kCap, kThreads, GATES_IN_KERNEL, PER_CHANNEL>(vp, vr, row, slot, num_k_heads, kSplits,
                                                                        &sm.last, write_own);
  }
};

// The conventional spec baseline (mamba2::Snapshot): the t drafts as a chain of conventional
// steps from one read of the state, the state after draft j written into snapshot_slots[row, j].
// PER_CHANNEL: the decay alpha_j is a vector over the key channels (the state's columns).
template <int K, int V, int VPH, int T, int ROWS, int WARPS, typename act_t, typename state_t, bool L2NORM,
          bool GATES_IN_KERNEL, bool PER_CHANNEL = false>
struct Snapshot {
  using Params = VerifyParams<act_t, state_t>;
  using Tile = RowTiling<state_t, K, ROWS, WARPS, true>;
  static constexpr int kThreads = Tile::kThreads;
  static constexpr int kSplits = V / ROWS;

  struct Smem {
    float k[T][K], q[T][K];
    float v[T][ROWS];
    float g[T], beta[T], rk[T], rq[T];
    alignas(16) float alpha[PER_CHANNEL ? T : 1][PER_CHANNEL ? K : 4];  // per channel: exp(g_j)
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
    if constexpr (PER_CHANNEL) {
      form_draft_channel_decays<K, kThreads, GATES_IN_KERNEL>(
          vp, row, t * K, 1, vhead, [&](int j, int, int c, float g) { sm.alpha[j][c] = expf(g); });
      if (threadIdx.x < t) {
        const float b = p.gate_b[int64_t(row) * p.gb_stride_b + int64_t(threadIdx.x) * d.gb_stride_t +
                                 int64_t(vhead) * p.gb_stride_h];
        sm.beta[threadIdx.x] = GATES_IN_KERNEL ? 1.f / (1.f + expf(-b)) : b;
      }
    } else {
      if (threadIdx.x < t) draft_gates<GATES_IN_KERNEL>(p, d, row, threadIdx.x, vhead, sm.g[threadIdx.x], sm.beta[threadIdx.x]);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 2 * t; i += kThreads) {
      const float* a = i < t ? sm.k[i] : sm.q[i - t];
      float acc = 0.f;
      for (int c = 0; c < K; ++c) acc = fmaf(a[c], a[c], acc);
      const float inv = inv_norm(acc, L2NORM);
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
      const float alpha = PER_CHANNEL ? 1.f : expf(sm.g[j]), rk = sm.rk[j], rq = sm.rq[j];  // (per channel: alpha_reg)
      const int snap = d.snapshot_slots[int64_t(row) * T + j];
      const bool write = unsigned(snap) < unsigned(p.num_slots);
      state_t* snap_rows = p.state + int64_t(snap) * p.state_slot_stride + (int64_t(vhead) * V + row0) * K;
      float k_reg[Tile::kChunksPerLane][Tile::kVec], q_reg[Tile::kChunksPerLane][Tile::kVec];
      Tile::slice(&sm.k[j][0], k_reg);
      Tile::slice(&sm.q[j][0], q_reg);
      float alpha_reg[PER_CHANNEL ? Tile::kChunksPerLane : 1][Tile::kVec];
      if constexpr (PER_CHANNEL) Tile::slice(&sm.alpha[j][0], alpha_reg);
      #pragma unroll
      for (int i = 0; i < Tile::kPasses; ++i) {
        const int r = Tile::row(i);
        if constexpr (PER_CHANNEL) {  // S Diag(alpha_j) first; alpha is then 1
          #pragma unroll
          for (int c = 0; c < Tile::kChunksPerLane; ++c)
            #pragma unroll
            for (int e = 0; e < Tile::kVec; ++e) s[i][c][e] *= alpha_reg[c][e];
        }
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
          if (write) store_values<state_t, false, Tile::kVec>(snap_rows + int64_t(r) * K + Tile::col(c), s[i][c], 0, 0);
        }
        const float o = group_sum<Tile::kLanesPerRow>(acc) * rq;
        if (Tile::row_leader()) out[r] = from_float<act_t>(o);
      }
    }
  }
};

}  // namespace replayssm::gdn
