// Mamba-2 split verify step: the verify kernel's work in common/split.cuh's two launches, so that
// what every head of a group shares is formed once per group rather than once per row tile.
//
// Records: one CTA per (group, batch row). It reads the cursor (with the fused commit applied;
// it writes nothing of the slot), forms the dots B_i . C_j once for the group, and for each head
// the decays and, over the records draft j replays (the committed ones unless the row flushes
// first, then j's root path W_j):
//   extra[j][r] = D x_j[r] + sum_i a(i+1 .. j) dt_i (B_i . C_j) x_i[r],   total[j] = a(j's window),
// and for an early flush the fold's weights a(i+1 .. m) dt_i and total decay a(1 .. m).
// State: one CTA per (batch row, head, row tile): the early flush's fold (written back), then
//   y_j = total[j] (S_c C_j) + extra[j],
// then the drafts' records and the cursor, as the per-item kernel (verify_kernel.cuh).
#pragma once
#include "common/split.cuh"
#include "mamba2/verify_kernel.cuh"

namespace replayssm::mamba2 {

// Hand-over of a split verify: per (batch row, head) extra [T][P], scalars total[T] then the
// fold's decay, the fold's weights [CAP]; per batch row the VerifyRow (store_verify_row).
template <int P, int T, int CAP>
using VerifyWorkspace = SplitWorkspace<T * P, T + 1, CAP>;

template <int P, int N, int HPG, int L, int T, typename act_t, typename state_t, bool HAS_D, bool HAS_DT_BIAS,
          bool DT_SOFTPLUS>
struct VerifyRecords {
  static constexpr int kCap = L + T;
  using Params = VerifyParams<act_t, state_t>;
  using Workspace = VerifyWorkspace<P, T, kCap>;
  static constexpr int kWarps = 8, kThreads = kWarps * 32;
  static constexpr int kRecords = kCap - 1 + T;  // committed (at most CAP - 1) then this step's drafts
  // x rows summed per batch of loads: their round trips overlap.
  static constexpr int kLoadBatch = 4;
  static_assert(HPG * T <= kThreads, "one thread per (head, draft)");

  struct Smem {
    float b[kRecords][N];  // committed B rows (read only where they are replayed), then the drafts'
    float q[T][N];         // C of each draft
    float dot[T][kRecords];
    float dt[HPG][kRecords], log_decay[HPG][kRecords], log_after[HPG][kRecords];
    float coef[HPG][T][kRecords];  // weight of record i in draft j's output, over the replayed records
    float path_log[HPG][T];
    float committed_log[HPG];
    DraftTree<T> tree;
  };
  static constexpr size_t kSmemBytes = sizeof(Smem);

  static __device__ __forceinline__ void run(const Params& vp, Smem& sm) {
    const auto& p = vp.base;
    const auto& d = vp.d;
    begin_after_prior_grid();  // the state kernel's CTAs may start their checkpoint reads now
    const auto index = GroupIndex<HPG>::of_block(vp);
    const int group = index.group, row = index.row, head0 = index.head0, num_groups = index.num_groups;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int slot = p.slot_indices[row];
    if (!slot_usable(slot, p.pad_slot_id, p.num_slots)) return;  // the state kernel writes its outputs

    // The drafts' B, C, dt (one thread per (head, draft)) and parents: in flight during the cursor's round trip.
    RowStager<act_t, N, T, kThreads> b_draft, c_draft;
    b_draft.load(p.B + int64_t(row) * p.b_stride_b + int64_t(group) * p.b_stride_g, d.b_stride_t, T);
    c_draft.load(p.C + int64_t(row) * p.c_stride_b + int64_t(group) * p.c_stride_g, d.c_stride_t, T);
    const int draft_h = threadIdx.x / T, draft_j = threadIdx.x % T;
    const bool draft_lane = threadIdx.x < HPG * T;
    const float dt_draft =
        draft_lane ? draft_dt<HAS_DT_BIAS, DT_SOFTPLUS>(p, d, row, draft_j, head0 + draft_h) : 0.f;
    const int parent_given = threadIdx.x < T ? DraftTree<T>::given_parent(d.parents, row, threadIdx.x) : 0;

    const VerifyRow v = read_verify_row<L, T>(slot_cursor(p.cursors, p.cursor_slot_stride, slot), d.num_drafts, d.num_accepted, row);
    const Workspace ws{p.workspace, p.batch, p.num_heads};
    if (group == 0 && threadIdx.x == 0) store_verify_row(ws.info(row), v);
    if (!v.valid) return;  // a corrupted cursor: the state kernel faults the row
    const int m = v.committed, t = v.drafts, count = m + t;
    const int mc = v.flush ? 0 : m;  // committed records the drafts replay (none after the fold)
    // The replayed x rows head for L2 now: the sums at the end load them (measured waiting on
    // DRAM there, in batches of kLoadBatch) after the dots and weights.
    const act_t* ring_x = p.rec_x + int64_t(slot) * p.rec_x_slot_stride + int64_t(head0) * kCap * P;
    stage_held_rows<false, act_t, P, HPG, kCap - 1, kCap, kThreads>(nullptr, ring_x, mc);

    // Committed B rows (only where replayed) and every head's committed dt, drafts after them.
    RowStager<act_t, N, kCap - 1, kThreads> b_held;
    b_held.load(p.rec_b + int64_t(slot) * p.rec_b_slot_stride + int64_t(group) * kCap * N, N, mc);
    const float* rec_dt = p.rec_dt + int64_t(slot) * p.rec_dt_slot_stride + int64_t(head0) * kCap;
    for (int e = threadIdx.x; e < HPG * m; e += kThreads) sm.dt[e / m][e % m] = rec_dt[(e / m) * kCap + e % m];
    if (draft_lane && draft_j < t) sm.dt[draft_h][m + draft_j] = dt_draft;
    if (threadIdx.x < T) sm.tree.set_parent(threadIdx.x, parent_given);
    b_held.store(sm.b, 0, mc);
    b_draft.store(sm.b, m, t);
    c_draft.store(sm.q, 0, t);
    __syncthreads();

    // Dots of the replayed records; each head's log-decays, committed suffix sums and path sums.
    dots_with_drafts<N, T, kWarps>(sm.b, mc, sm.q, t, &sm.dot[0][0], kRecords, nullptr);
    dots_with_drafts<N, T, kWarps>(sm.b + m, t, sm.q, t, &sm.dot[0][m], kRecords, nullptr);
    if (threadIdx.x == 0) sm.tree.link();
    for (int h = warp; h < HPG; h += kWarps) {
      const float A = p.A[head0 + h];
      for (int i = lane; i < count; i += 32) sm.log_decay[h][i] = sm.dt[h][i] * A;
      __syncwarp();
      const float committed = suffix_log_sums(sm.log_decay[h], sm.log_after[h], m);
      if (lane == 0) sm.committed_log[h] = committed;
      if (lane < t) sm.path_log[h][lane] = sm.tree.log_after(sm.log_decay[h] + m, lane, -1);
    }
    __syncthreads();

    // Weights of the replayed records (i' < mc committed, then the drafts at m + i' - mc); the
    // scalars; an early flush's fold weights.
    const int replayed = mc + t;
    for (int e = threadIdx.x; e < HPG * t * replayed; e += kThreads) {
      const int h = e / (t * replayed), j = e / replayed % t, ir = e % replayed;
      const int i = ir < mc ? ir : m + ir - mc;
      const float w = window_decay(sm.tree, sm.path_log[h], sm.log_decay[h], sm.log_after[h], m, mc, j, i);
      sm.coef[h][j][i] = window_weight(w, sm.dt[h][i] * sm.dot[j][i]);
    }
    if (draft_lane && draft_j < t) {
      const float committed = v.flush ? 0.f : sm.committed_log[draft_h];
      ws.scalars(row, head0 + draft_h)[draft_j] = expf(committed + sm.path_log[draft_h][draft_j]);
    }
    if (v.flush) {
      if (threadIdx.x < HPG) ws.scalars(row, head0 + threadIdx.x)[T] = expf(sm.committed_log[threadIdx.x]);
      for (int e = threadIdx.x; e < HPG * m; e += kThreads) {
        const int h = e / m, i = e % m;
        ws.coef(row, head0 + h)[i] = expf(sm.log_after[h][i]) * sm.dt[h][i];
      }
    }
    __syncthreads();

    // Per-row sums, kVec consecutive rows of one head per thread, every draft at once: each x row
    // (committed ones from the ring, drafts from the inputs) is loaded once.
    constexpr int kVec = elements_per_thread<P, HPG * P, kThreads>();
    const act_t* draft_x = p.x + int64_t(row) * p.x_stride_b + int64_t(head0) * p.x_stride_h;
    for (int e = threadIdx.x * kVec; e < HPG * P; e += kThreads * kVec) {
      const int h = e / P, r = e % P;
      const float D = HAS_D ? p.D[head0 + h] : 0.f;
      float acc[T][kVec];
      #pragma unroll
      for (int j = 0; j < T; ++j)
        #pragma unroll
        for (int k = 0; k < kVec; ++k) acc[j][k] = 0.f;
      for (int i0 = 0; i0 < replayed; i0 += kLoadBatch) {
        float x[kLoadBatch][kVec];
        #pragma unroll
        for (int b = 0; b < kLoadBatch; ++b) {
          const int ir = i0 + b;
          if (ir >= replayed) break;
          const act_t* src = ir < mc ? ring_x + (int64_t(h) * kCap + ir) * P + r
                                     : draft_x + int64_t(ir - mc) * d.x_stride_t + int64_t(h) * p.x_stride_h + r;
          load_floats<act_t, kVec>(src, x[b]);
        }
        #pragma unroll
        for (int b = 0; b < kLoadBatch; ++b) {
          const int ir = i0 + b;
          if (ir >= replayed) break;
          const int i = ir < mc ? ir : m + ir - mc;
          #pragma unroll
          for (int j = 0; j < T; ++j) {
            if (j >= t) break;
            float w = sm.coef[h][j][i];
            if (HAS_D && i == m + j) w += D;  // the skip term D x_j
            if (w == 0.f) continue;  // off j's window: that x may be another draft's NaN
            #pragma unroll
            for (int k = 0; k < kVec; ++k) acc[j][k] = fmaf(w, x[b][k], acc[j][k]);
          }
        }
      }
      #pragma unroll
      for (int j = 0; j < T; ++j)
        if (j < t) store_floats<kVec>(ws.extra(row, head0 + h) + j * P + r, acc[j]);
    }
  }
};

template <int P, int N, int HPG, int L, int T, int ROWS, int WARPS, typename act_t, typename state_t, bool HAS_Z,
          bool HAS_DT_BIAS, bool DT_SOFTPLUS, bool SR, typename read_t = void, bool READ_SR = SR>
struct VerifyState {
  static constexpr int kCap = L + T;
  using Params = VerifyParams<act_t, state_t>;
  using Workspace = VerifyWorkspace<P, T, kCap>;
  using Tile = RowTiling<state_t, N, ROWS, WARPS, false>;
  using Copies = VerifyCopies<P, N, ROWS, WARPS, state_t, read_t>;
  static constexpr int kThreads = Tile::kThreads;
  static constexpr int kSplits = P / ROWS;

  // Inputs as stored; FP32 only where the fold wants them weighted.
  struct Smem {
    alignas(16) act_t q[T][N];
    alignas(16) act_t z[T][ROWS];
    alignas(16) act_t x[T][ROWS];            // the drafts' x rows, for the ring
    alignas(16) float extra[T][ROWS];
    alignas(16) act_t held_x[kCap - 1][ROWS];  // an early flush's committed records
    alignas(16) act_t held_b[kCap - 1][N];
    alignas(16) float weighted_x[kCap - 1][ROWS];  // a(i+1 .. m) dt_i x_i
    float fold_w[kCap - 1];
    float total[T + 1];
    int last;
  };
  static constexpr size_t kSmemBytes = sizeof(Smem);

  static __device__ __forceinline__ void run(const Params& vp, Smem& sm) {
    const auto& p = vp.base;
    const auto& d = vp.d;
    allow_dependent_grid();  // the next kernel may be scheduled (it waits for this one)
    const auto tile = RowTileIndex<kSplits, HPG>::of_block(vp);
    const int split = tile.split, head = tile.head, row = tile.row, group = tile.group, num_groups = tile.num_groups;
    const int row0 = split * ROWS;
    const int slot = p.slot_indices[row];
    const auto out_of = [&](int j) { return p.out + ((int64_t(row) * T + j) * p.num_heads + head) * P + row0; };
    if (skip_unusable_draft_row<T, ROWS, kThreads>(slot, p.pad_slot_id, p.num_slots, out_of)) return;

    // Checkpoint rows and the drafts' inputs first: none of them waits for the records kernel.
    typename Copies::template Copy<typename Copies::Read> read;
    read.load(Copies::read_view(p), slot, p.num_heads, head, row0);
    copy_rows_async<act_t, N, kThreads>(&sm.q[0][0], 0, N, p.C + int64_t(row) * p.c_stride_b +
                                        int64_t(group) * p.c_stride_g, 0, d.c_stride_t, 1, T);
    copy_rows_async<act_t, ROWS, kThreads>(&sm.x[0][0], 0, ROWS, p.x + int64_t(row) * p.x_stride_b +
                                           int64_t(head) * p.x_stride_h + row0, 0, d.x_stride_t, 1, T);
    if constexpr (HAS_Z)
      copy_rows_async<act_t, ROWS, kThreads>(&sm.z[0][0], 0, ROWS, p.z + int64_t(row) * p.z_stride_b +
                                             int64_t(head) * p.z_stride_h + row0, 0, d.z_stride_t, 1, T);

    wait_for_prior_grid();  // from here on the records kernel has finished
    const Workspace ws{p.workspace, p.batch, p.num_heads};
    const VerifyRow v = load_verify_row(ws.info(row));
    if (!v.valid) {  // a corrupted cursor: the row touches nothing
      pipe::wait_copies();
      fault_draft_row<T, ROWS, kThreads>(out_of);
      return;
    }
    const int m = v.committed, t = v.drafts;
    copy_rows_async<float, ROWS, kThreads>(&sm.extra[0][0], 0, ROWS, ws.extra(row, head) + row0, 0, P, 1, t);
    // (only what the records kernel wrote: drafts j < t, the fold's decay where it flushes)
    if (threadIdx.x < t || (threadIdx.x == T && v.flush)) sm.total[threadIdx.x] = ws.scalars(row, head)[threadIdx.x];
    if (v.flush) {  // the committed records to fold, and their weights
      copy_rows_async<act_t, ROWS, kThreads>(&sm.held_x[0][0], 0, ROWS, p.rec_x + int64_t(slot) * p.rec_x_slot_stride + int64_t(head) *
                                             kCap * P + row0, 0, P, 1, m);
      copy_rows_async<act_t, N, kThreads>(&sm.held_b[0][0], 0, N, p.rec_b + int64_t(slot) * p.rec_b_slot_stride + int64_t(group) *
                                          kCap * N, 0, N, 1, m);
      for (int i = threadIdx.x; i < m; i += kThreads) sm.fold_w[i] = ws.coef(row, head)[i];
    }
    pipe::wait_copies();
    __syncthreads();
    if (v.flush) {
      for (int e = threadIdx.x; e < m * ROWS; e += kThreads)
        sm.weighted_x[e / ROWS][e % ROWS] = to_float(sm.held_x[e / ROWS][e % ROWS]) * sm.fold_w[e / ROWS];
      __syncthreads();
    }

    // Rows: the early flush's fold (written back), then every draft's output from the state.
    Copies::rows_from(p, read, v.flush, slot, head, row0, [&](const auto& ck) {
      using RT = typename std::decay_t<decltype(ck)>::Tiling;
      float s[RT::kPasses][RT::kChunksPerLane][RT::kVec];
      tile_values(ck, v.flush ? sm.total[T] : 1.f, s);
      if (v.flush) {
        fold_records<RT, ROWS>(s, sm.weighted_x, sm.held_b, m);
        Copies::template store<SR, READ_SR>(p, ck, s, slot, uint64_t(SR ? v.epoch : 0), head, row0);
      }
      // Per draft: every pass's dot and row sum first, then the row leaders' stores. With a store
      // under row_leader() between two passes, ptxas branched around it (a divergent region it
      // does not move shuffles across) and ran each pass's FMA chain and shuffles one after the
      // other in every compiled (T, tile) but super120b's T = 4 (docs/tuning-verify.md, "The T = 8 step
      // at batch 256"; not yet timed on a GPU). Same FMAs in the same order as before.
      act_t* out = out_of(0);
      const int64_t draft_stride = int64_t(p.num_heads) * P;
      #pragma unroll 1
      for (int j = 0; j < T; ++j, out += draft_stride) {
        if (j >= t) {  // no such draft: a zero output
          RT::fill_rows(out, 0.f);
          continue;
        }
        float q_reg[RT::kChunksPerLane][RT::kVec];
        RT::slice(&sm.q[j][0], q_reg);
        float y[RT::kPasses];
        #pragma unroll
        for (int i = 0; i < RT::kPasses; ++i) y[i] = RT::dot(s[i], q_reg);
        #pragma unroll
        for (int i = 0; i < RT::kPasses; ++i)
          y[i] = group_sum<RT::kLanesPerRow>(y[i]) * sm.total[j] + sm.extra[j][RT::row(i)];
        if (RT::row_leader()) {
          #pragma unroll
          for (int i = 0; i < RT::kPasses; ++i) {
            const int r = RT::row(i);
            if constexpr (HAS_Z) {
              const float z = to_float(sm.z[j][r]);
              y[i] *= z / (1.f + expf(-z));
            }
            out[r] = from_float<act_t>(y[i]);
          }
        }
      }
    });
    append_drafts<P, N, kCap, ROWS, kThreads, HAS_DT_BIAS, DT_SOFTPLUS>(
        vp, v, row, slot, head, row0, num_groups, kSplits, &sm.last, [&](int j, int r) { return sm.x[j][r]; });
  }
};

}  // namespace replayssm::mamba2
