// Gated DeltaNet split verify step: the verify kernel's work in common/split.cuh's two launches,
// so that what a key head's value heads share (the k and q dots) is formed once per key head,
// and the committed records' part of every draft once per value row rather than per row tile.
//
// Records: one CTA per (key head, batch row). It reads the cursor (fused commit applied; it
// writes nothing of the slot), forms the raw dots k_i . k_j, k_i . q_j and the norms once, and
// for each value head the decays, the weights of every replayed record (verify_kernel.cuh's
// notation), and over the committed records it replays (none after an early flush):
//   pred_c[j][r] = sum_i w_kk[j][i] u_i[r],   osum_c[j][r] = sum_i w_kq[j][i] u_i[r],
// with the scalars of each draft (a_j = total_j |k_j|^-1, b_j = total_j |q_j|^-1 scale, beta_j),
// the drafts' weights among themselves [T][T], and an early flush's fold weights and decay.
// State: one CTA per (batch row, value head, row tile): the fold (written back), then per row,
// drafts in order, u_j = beta_j (v_j - a_j (S k_j) - pred_c[j] - sum_{a<j} w_kk[j][a] u_a) and
// o_j = b_j (S q_j) + osum_c[j] + sum_{a<=j} w_kq[j][a] u_a; then the records and the cursor.
#pragma once
#include "common/split.cuh"
#include "gdn/verify_kernel.cuh"

namespace replayssm::gdn {

// Per draft j: a_j, b_j, beta_j; then w_kk[j][a] and w_kq[j][a] among drafts; then the fold's decay.
template <int T>
struct VerifyScalars {
  static constexpr int kA = 0, kB = T, kBeta = 2 * T, kKk = 3 * T, kKq = 3 * T + T * T, kFold = 3 * T + 2 * T * T;
  static constexpr int kCount = kFold + 1;
};

// Hand-over of a split verify: per (batch row, value head) extra [2][T][V] (pred_c, then
// osum_c), VerifyScalars, the fold's weights [CAP]; per batch row the VerifyRow.
template <int V, int T, int CAP>
using VerifyWorkspace = SplitWorkspace<2 * T * V, VerifyScalars<T>::kCount, CAP>;

template <int K, int V, int VPH, int L, int T, typename act_t, typename state_t, bool L2NORM, bool GATES_IN_KERNEL>
struct VerifyRecords {
  static constexpr int kCap = L + T;
  using Params = VerifyParams<act_t, state_t>;
  using Workspace = VerifyWorkspace<V, T, kCap>;
  using Scalars = VerifyScalars<T>;
  static constexpr int kWarps = 8, kThreads = kWarps * 32;
  static constexpr int kRecords = kCap - 1 + T;  // committed (at most CAP - 1) then this step's drafts
  static constexpr int kLoadBatch = 4;           // u rows summed per batch of loads
  static constexpr int kGateIters = (VPH * T + kThreads - 1) / kThreads;

  struct Smem {
    float k[kRecords][K];  // raw k, committed then drafts
    float q[T][K];
    float kk[T][kRecords], kq[T][kRecords];  // raw dots
    float k2[kRecords], q2[T];
    float g[VPH][kRecords], log_after[VPH][kRecords];
    float beta[VPH][T];
    float wkk[VPH][T][kRecords], wkq[VPH][T][kRecords];  // weights over the replayed records
    float path_log[VPH][T];
    float committed_log[VPH];
    DraftTree<T> tree;
  };
  static constexpr size_t kSmemBytes = sizeof(Smem);

  static __device__ __forceinline__ float inv_norm(float sq) { return gdn::inv_norm(sq, L2NORM); }

  static __device__ __forceinline__ void run(const Params& vp, Smem& sm) {
    const auto& p = vp.base;
    const auto& d = vp.d;
    begin_after_prior_grid();  // the state kernel's CTAs may start their checkpoint reads now
    const auto index = GroupIndex<VPH>::of_block(vp);
    const int khead = index.group, row = index.row, vhead0 = index.head0, num_k_heads = index.num_groups;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int slot = p.slot_indices[row];
    if (!slot_usable(slot, p.pad_slot_id, p.num_slots)) return;  // the state kernel writes its outputs

    // The drafts' k, q, gates (one thread per (value head, draft)) and parents, in flight during
    // the cursor's round trip.
    RowStager<act_t, K, T, kThreads> k_draft, q_draft;
    k_draft.load(p.k + int64_t(row) * p.k_stride_b + int64_t(khead) * p.k_stride_h, d.k_stride_t, T);
    q_draft.load(p.q + int64_t(row) * p.q_stride_b + int64_t(khead) * p.q_stride_h, d.q_stride_t, T);
    float gate_g[kGateIters], gate_beta[kGateIters];
    #pragma unroll
    for (int it = 0; it < kGateIters; ++it) {
      const int e = it * kThreads + threadIdx.x;
      if (e < VPH * T) draft_gates<GATES_IN_KERNEL>(p, d, row, e % T, vhead0 + e / T, gate_g[it], gate_beta[it]);
    }
    const int parent_given = threadIdx.x < T ? DraftTree<T>::given_parent(d.parents, row, threadIdx.x) : 0;

    const VerifyRow v = read_verify_row<L, T>(slot_cursor(p.cursors, p.cursor_slot_stride, slot), d.num_drafts, d.num_accepted, row);
    const Workspace ws{p.workspace, p.batch, p.num_v_heads};
    if (khead == 0 && threadIdx.x == 0) store_verify_row(ws.info(row), v);
    if (!v.valid) return;  // a corrupted cursor: the state kernel faults the row
    const int m = v.committed, t = v.drafts, count = m + t;
    const int mc = v.flush ? 0 : m;  // committed records the drafts replay (none after the fold)

    // Committed k rows (their norms weigh a flush's fold too) and every value head's g.
    RowStager<act_t, K, kCap - 1, kThreads> k_held;
    k_held.load(p.rec_k + int64_t(slot) * p.rec_k_slot_stride + int64_t(khead) * kCap * K, K, m);
    const float* rec_g = p.rec_g + int64_t(slot) * p.rec_g_slot_stride + int64_t(vhead0) * kCap;
    for (int e = threadIdx.x; e < VPH * m; e += kThreads) sm.g[e / m][e % m] = rec_g[(e / m) * kCap + e % m];
    #pragma unroll
    for (int it = 0; it < kGateIters; ++it) {
      const int e = it * kThreads + threadIdx.x;
      if (e < VPH * T && e % T < t) {
        sm.g[e / T][m + e % T] = gate_g[it];
        sm.beta[e / T][e % T] = gate_beta[it];
      }
    }
    if (threadIdx.x < T) sm.tree.set_parent(threadIdx.x, parent_given);
    k_held.store(sm.k, 0, m);
    k_draft.store(sm.k, m, t);
    q_draft.store(sm.q, 0, t);
    __syncthreads();

    // Raw dots and norms; each value head's committed suffix sums and draft path sums.
    dots_with_drafts<K, T, kWarps>(sm.k, count, sm.k + m, t, &sm.kk[0][0], kRecords, sm.k2);
    dots_with_drafts<K, T, kWarps>(sm.k, count, sm.q, t, &sm.kq[0][0], kRecords, nullptr);
    dots_with_drafts<K, T, kWarps>(sm.q, t, sm.q, 0, nullptr, 0, sm.q2);
    if (threadIdx.x == 0) sm.tree.link();
    for (int h = warp; h < VPH; h += kWarps) {
      const float committed = suffix_log_sums(sm.g[h], sm.log_after[h], m);
      if (lane == 0) sm.committed_log[h] = committed;
      if (lane < t) sm.path_log[h][lane] = sm.tree.log_after(sm.g[h] + m, lane, -1);
    }
    __syncthreads();

    // Weights of the replayed records (i' < mc committed, then the drafts at m + i' - mc).
    const int replayed = mc + t;
    for (int e = threadIdx.x; e < VPH * t * replayed; e += kThreads) {
      const int h = e / (t * replayed), j = e / replayed % t, ir = e % replayed;
      const int i = ir < mc ? ir : m + ir - mc;
      const float dec = window_decay(sm.tree, sm.path_log[h], sm.g[h], sm.log_after[h], m, mc, j, i);
      const float rk_i = inv_norm(sm.k2[i]), rk_j = inv_norm(sm.k2[m + j]);
      const float rq_j = inv_norm(sm.q2[j]) * p.scale;
      sm.wkk[h][j][i] = i == m + j ? 0.f : window_weight(dec, sm.kk[j][i] * rk_i * rk_j);
      sm.wkq[h][j][i] = window_weight(dec, sm.kq[j][i] * rk_i * rq_j);
    }
    __syncthreads();
    // Every scalar of every value head (zeros for drafts past t, so the state kernel reads only
    // written words), and an early flush's fold weights a(i+1 .. m) |k_i|^-1.
    for (int e = threadIdx.x; e < VPH * Scalars::kCount; e += kThreads) {
      const int h = e / Scalars::kCount, w = e % Scalars::kCount;
      float value = 0.f;
      if (w == Scalars::kFold) {
        value = expf(sm.committed_log[h]);
      } else if (w >= Scalars::kKk) {
        const int pair = (w - Scalars::kKk) % (T * T), j = pair / T, a = pair % T;
        if (j < t && a <= j) value = (w < Scalars::kKq ? sm.wkk[h][j][m + a] : sm.wkq[h][j][m + a]);
      } else {
        const int j = w % T;
        if (j < t) {
          const float total = expf((v.flush ? 0.f : sm.committed_log[h]) + sm.path_log[h][j]);
          if (w < Scalars::kB) value = total * inv_norm(sm.k2[m + j]);
          else if (w < Scalars::kBeta) value = total * inv_norm(sm.q2[j]) * p.scale;
          else value = sm.beta[h][j];
        }
      }
      ws.scalars(row, vhead0 + h)[w] = value;
    }
    if (v.flush)
      for (int e = threadIdx.x; e < VPH * m; e += kThreads) {
        const int h = e / m, i = e % m;
        ws.coef(row, vhead0 + h)[i] = expf(sm.log_after[h][i]) * inv_norm(sm.k2[i]);
      }

    // The committed records' part of each (draft, value row): kVec consecutive rows of one value
    // head per thread, every draft at once, each u row loaded once (from L2).
    constexpr int kVec = elements_per_thread<V, VPH * V, kThreads>();
    const float* ring_u = p.rec_u + int64_t(slot) * p.rec_u_slot_stride + int64_t(vhead0) * kCap * V;
    for (int e = threadIdx.x * kVec; e < VPH * V; e += kThreads * kVec) {
      const int h = e / V, r = e % V;
      float pred[T][kVec], osum[T][kVec];
      #pragma unroll
      for (int j = 0; j < T; ++j)
        #pragma unroll
        for (int c = 0; c < kVec; ++c) pred[j][c] = osum[j][c] = 0.f;
      for (int i0 = 0; i0 < mc; i0 += kLoadBatch) {
        float u[kLoadBatch][kVec];
        #pragma unroll
        for (int b = 0; b < kLoadBatch; ++b)
          if (i0 + b < mc) load_floats<float, kVec>(ring_u + (int64_t(h) * kCap + i0 + b) * V + r, u[b]);
        #pragma unroll
        for (int b = 0; b < kLoadBatch; ++b) {
          if (i0 + b >= mc) break;
          #pragma unroll
          for (int j = 0; j < T; ++j) {
            if (j >= t) break;
            const float wk = sm.wkk[h][j][i0 + b], wq = sm.wkq[h][j][i0 + b];
            #pragma unroll
            for (int c = 0; c < kVec; ++c) {
              pred[j][c] = fmaf(wk, u[b][c], pred[j][c]);
              osum[j][c] = fmaf(wq, u[b][c], osum[j][c]);
            }
          }
        }
      }
      #pragma unroll
      for (int j = 0; j < T; ++j)
        if (j < t) {
          store_floats<kVec>(ws.extra(row, vhead0 + h) + j * V + r, pred[j]);
          store_floats<kVec>(ws.extra(row, vhead0 + h) + (T + j) * V + r, osum[j]);
        }
    }
  }
};

template <int K, int V, int VPH, int L, int T, int ROWS, int WARPS, typename act_t, typename state_t,
          bool GATES_IN_KERNEL, bool SR>
struct VerifyState {
  static constexpr int kCap = L + T;
  using Params = VerifyParams<act_t, state_t>;
  using Workspace = VerifyWorkspace<V, T, kCap>;
  using Scalars = VerifyScalars<T>;
  using Tile = RowTiling<state_t, K, ROWS, WARPS, false>;
  static constexpr int kThreads = Tile::kThreads;
  static constexpr int kSplits = V / ROWS;

  // Inputs as stored; FP32 where the records kernel or the fold wants them.
  struct Smem {
    alignas(16) act_t k[T][K];
    alignas(16) act_t q[T][K];
    alignas(16) act_t v[T][ROWS];
    alignas(16) float pred[T][ROWS];
    alignas(16) float osum[T][ROWS];
    alignas(16) float held_u[kCap - 1][ROWS];  // an early flush's committed u, then weighted
    alignas(16) act_t held_k[kCap - 1][K];
    float fold_w[kCap - 1];
    float scalars[Scalars::kCount];
    int last;
  };
  static constexpr size_t kSmemBytes = sizeof(Smem);

  static __device__ __forceinline__ void run(const Params& vp, Smem& sm) {
    const auto& p = vp.base;
    const auto& d = vp.d;
    allow_dependent_grid();  // the next kernel may be scheduled (it waits for this one)
    const auto tile = RowTileIndex<kSplits, VPH>::of_block(vp);
    const int split = tile.split, vhead = tile.head, row = tile.row, khead = tile.group;
    const int num_k_heads = tile.num_groups, row0 = split * ROWS;
    const int slot = p.slot_indices[row];
    const auto out_of = [&](int j) { return p.out + ((int64_t(row) * T + j) * p.num_v_heads + vhead) * V + row0; };
    if (skip_unusable_draft_row<T, ROWS, kThreads>(slot, p.pad_slot_id, p.num_slots, out_of)) return;

    // Checkpoint rows and the drafts' inputs first: none of them waits for the records kernel.
    TileCheckpoint<Tile, state_t, V> ck;  // (one copy, any format)
    ck.load(CheckpointView<state_t>{p.state, p.state_slot_stride, p.state_scale, p.state_scale_slot_stride, p.state_blocks,
                                    p.state_block_slot_stride}, slot, p.num_v_heads,
            vhead, row0);
    copy_rows_async<act_t, K, kThreads>(&sm.k[0][0], 0, K, p.k + int64_t(row) * p.k_stride_b +
                                        int64_t(khead) * p.k_stride_h, 0, d.k_stride_t, 1, T);
    copy_rows_async<act_t, K, kThreads>(&sm.q[0][0], 0, K, p.q + int64_t(row) * p.q_stride_b +
                                        int64_t(khead) * p.q_stride_h, 0, d.q_stride_t, 1, T);
    copy_rows_async<act_t, ROWS, kThreads>(&sm.v[0][0], 0, ROWS, p.v + int64_t(row) * p.v_stride_b +
                                           int64_t(vhead) * p.v_stride_h + row0, 0, d.v_stride_t, 1, T);

    wait_for_prior_grid();  // from here on the records kernel has finished
    const Workspace ws{p.workspace, p.batch, p.num_v_heads};
    const VerifyRow vr = load_verify_row(ws.info(row));
    if (!vr.valid) {  // a corrupted cursor: the row touches nothing
      pipe::wait_copies();
      fault_draft_row<T, ROWS, kThreads>(out_of);
      return;
    }
    const int m = vr.committed, t = vr.drafts;
    copy_rows_async<float, ROWS, kThreads>(&sm.pred[0][0], 0, ROWS, ws.extra(row, vhead) + row0, 0, V, 1, t);
    copy_rows_async<float, ROWS, kThreads>(&sm.osum[0][0], 0, ROWS, ws.extra(row, vhead) + T * V + row0, 0, V, 1, t);
    for (int w = threadIdx.x; w < Scalars::kCount; w += kThreads) sm.scalars[w] = ws.scalars(row, vhead)[w];
    if (vr.flush) {  // the committed records to fold, and their weights
      copy_rows_async<float, ROWS, kThreads>(&sm.held_u[0][0], 0, ROWS, p.rec_u + int64_t(slot) * p.rec_u_slot_stride +
                                             int64_t(vhead) * kCap * V + row0, 0, V, 1, m);
      copy_rows_async<act_t, K, kThreads>(&sm.held_k[0][0], 0, K, p.rec_k + int64_t(slot) * p.rec_k_slot_stride + int64_t(khead) *
                                          kCap * K, 0, K, 1, m);
      for (int i = threadIdx.x; i < m; i += kThreads) sm.fold_w[i] = ws.coef(row, vhead)[i];
    }
    pipe::wait_copies();
    __syncthreads();
    if (vr.flush) {
      for (int e = threadIdx.x; e < m * ROWS; e += kThreads) sm.held_u[e / ROWS][e % ROWS] *= sm.fold_w[e / ROWS];
      __syncthreads();
    }

    // Rows: the early flush's fold (written back), then the drafts in order, u in registers.
    float s[Tile::kPasses][Tile::kChunksPerLane][Tile::kVec];
    tile_values(ck, vr.flush ? sm.scalars[Scalars::kFold] : 1.f, s);
    if (vr.flush) {
      fold_records<Tile, ROWS>(s, sm.held_u, sm.held_k, m);
      store_flushed<Tile, SR, false, SR, V, K>(ck.at, ck.at, s, rounding_seed<SR>(p), slot, uint64_t(SR ? vr.epoch : 0),
                                                vhead, row0);
    }
    const int first = vr.flush ? 0 : m;
    float* u_ring = p.rec_u + int64_t(slot) * p.rec_u_slot_stride + int64_t(vhead) * kCap * V + row0;
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
      float k_reg[Tile::kChunksPerLane][Tile::kVec], q_reg[Tile::kChunksPerLane][Tile::kVec];
      Tile::slice(&sm.k[j][0], k_reg);
      Tile::slice(&sm.q[j][0], q_reg);
      const float* wkk = &sm.scalars[Scalars::kKk + j * T];
      const float* wkq = &sm.scalars[Scalars::kKq + j * T];
      #pragma unroll
      for (int i = 0; i < Tile::kPasses; ++i) {
        const int r = Tile::row(i);
        float sk, sq;
        Tile::dot2(s[i], k_reg, q_reg, sk, sq);
        float pred = sm.scalars[Scalars::kA + j] * group_sum<Tile::kLanesPerRow>(sk) + sm.pred[j][r];
        float o = sm.scalars[Scalars::kB + j] * group_sum<Tile::kLanesPerRow>(sq) + sm.osum[j][r];
        #pragma unroll
        for (int a = 0; a < j; ++a)  // (a non-ancestor has weight 0 and is skipped: its u may be NaN)
          if (wkk[a] != 0.f) pred = fmaf(wkk[a], du[a][i], pred);
        const float u = sm.scalars[Scalars::kBeta + j] * (to_float(sm.v[j][r]) - pred);
        du[j][i] = u;
        #pragma unroll
        for (int a = 0; a <= j; ++a)
          if (wkq[a] != 0.f) o = fmaf(wkq[a], du[a][i], o);
        if (Tile::row_leader()) {
          out[r] = from_float<act_t>(o);
          u_ring[int64_t(first + j) * V + r] = u;
        }
      }
    }
    append_shared_drafts<K, kCap, kThreads, GATES_IN_KERNEL, false>(vp, vr, row, slot, num_k_heads, kSplits, &sm.last);
  }
};

}  // namespace replayssm::gdn
