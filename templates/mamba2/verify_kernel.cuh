// Mamba-2 speculative kernels: the verify step (T drafts per batch row, output only) and the
// conventional snapshot baseline. Contract: docs/speculative.md.
//
// One CTA handles ROWS headdim rows of one (batch row, head), its state rows in registers. With
// m committed records (none after an early flush) and draft j's root path W_j:
//   y_j = a(W_j) (S_c C_j) + sum_{i in committed + W_j} a(i+1 .. j along W_j) dt_i (B_i . C_j) x_i + D x_j
// The drafts' records go to ring rows n.. (n = 0 after an early flush); the rows heads and row
// tiles share (dt, B) are written by the row's last CTA, once every CTA has read the old ones.
#pragma once
#include "common/verify.cuh"
#include "mamba2/decode_kernel.cuh"

namespace replayssm::mamba2 {

// Inputs of a verify or snapshot launch beside Params (whose token pointers hold the drafts'
// [batch, T, ...] tensors, with their draft strides here).
struct DraftParams {
  int64_t x_stride_t, z_stride_t, dt_stride_t, b_stride_t, c_stride_t;
  const int32_t* num_drafts;     // [batch] or null (every row verifies T)
  const int32_t* parents;        // [batch, T] or null (chains)
  const int32_t* num_accepted;   // [batch] or null: the previous verify's accepted counts (fused commit)
  const int32_t* snapshot_slots; // [batch, T]: the snapshot baseline's slots
};

template <typename act_t, typename state_t>
struct VerifyParams {
  Params<act_t, state_t> base;
  DraftParams d;
  __host__ __device__ int heads() const { return base.num_heads; }
};

// dt of draft j at `head`, with the flags' bias and softplus.
template <bool HAS_DT_BIAS, bool DT_SOFTPLUS, typename P>
__device__ __forceinline__ float draft_dt(const P& p, const DraftParams& d, int row, int j, int head) {
  float dt = p.dt[int64_t(row) * p.dt_stride_b + int64_t(j) * d.dt_stride_t + int64_t(head) * p.dt_stride_h];
  if constexpr (HAS_DT_BIAS) dt += p.dt_bias[head];
  if constexpr (DT_SOFTPLUS) dt = softplus(dt);
  return dt;
}

// The end of a verify row's CTA (rows row0.. of `head`, SPLITS row tiles a head), once it has
// read the rings: its tile of the drafts' x rows (x_of(j, r)) goes to ring rows first.. (0 after
// an early flush, else after the committed ones); every head's dt and every group's B rows go
// there by write_own (wrote_own_rows) or else from the inputs by the row's last CTA, which then
// writes the cursor.
template <int P, int N, int CAP, int ROWS, int THREADS, bool HAS_DT_BIAS, bool DT_SOFTPLUS, typename act_t,
          typename state_t, class XOf, class WriteOwn = NoOwnRows>
__device__ __forceinline__ void append_drafts(const VerifyParams<act_t, state_t>& vp, const VerifyRow& v, int row,
                                              int slot, int head, int row0, int num_groups, int splits, int* flag,
                                              XOf x_of, const WriteOwn& write_own = {}) {
  const auto& p = vp.base;
  const auto& d = vp.d;
  const int t = v.drafts, first = v.flush ? 0 : v.committed;
  act_t* x_ring = p.rec_x + int64_t(slot) * p.rec_x_slot_stride + int64_t(head) * CAP * P + row0;
  for (int e = threadIdx.x; e < t * ROWS; e += THREADS) {
    const int j = e / ROWS, r = e % ROWS;
    x_ring[int64_t(first + j) * P + r] = x_of(j, r);
  }
  int32_t* cursor = slot_cursor(p.cursors, p.cursor_slot_stride, slot);
  const bool written = wrote_own_rows(v, write_own);
  if (!last_arrival(cursor, p.num_heads * splits, flag)) return;
  if (written) {
    finish_verify_cursor(cursor, v);
    return;
  }
  for (int e = threadIdx.x; e < t * p.num_heads; e += THREADS) {
    const int j = e / p.num_heads, h = e % p.num_heads;
    p.rec_dt[int64_t(slot) * p.rec_dt_slot_stride + int64_t(h) * CAP + first + j] = draft_dt<HAS_DT_BIAS, DT_SOFTPLUS>(p, d, row, j, h);
  }
  copy_rows<act_t, N, THREADS>(
      t * num_groups,
      [&](int i) { return p.B + int64_t(row) * p.b_stride_b + int64_t(i / num_groups) * d.b_stride_t +
                          int64_t(i % num_groups) * p.b_stride_g; },
      [&](int i) { return p.rec_b + int64_t(slot) * p.rec_b_slot_stride + (int64_t(i % num_groups) * CAP + first + i / num_groups) * N; });
  finish_verify_cursor(cursor, v);
}

// The checkpoint copies a verify CTA reads (any format; in separate mode, read_t not void, the
// read copy, and at an early flush the carried copy, both written back as a step's flush does).
template <int P, int N, int ROWS, int WARPS, typename state_t, typename read_t>
struct VerifyCopies {
  static constexpr bool kSeparate = !std::is_void_v<read_t>;
  using Read = std::conditional_t<kSeparate, read_t, state_t>;
  template <class T> using Copy = TileCheckpoint<RowTiling<T, N, ROWS, WARPS, false>, T, P>;

  template <class Params>
  static __device__ __forceinline__ CheckpointView<state_t> state_view(const Params& p) {
    return carried_view<state_t>(p);
  }
  template <class Params>
  static __device__ __forceinline__ CheckpointView<Read> read_view(const Params& p) {
    return read_copy_view<state_t, read_t>(p);
  }
  // Calls finish(ck) with the copy the rows come from: the read one loaded first (`read`), or at a
  // separate-mode flush the carried copy, loaded now.
  template <class Params, class Finish>
  static __device__ __forceinline__ void rows_from(const Params& p, const Copy<Read>& read, bool flush, int slot,
                                                   int head, int row0, const Finish& finish) {
    if (kSeparate && flush) {
      Copy<state_t> carried;
      carried.load(state_view(p), slot, p.num_heads, head, row0);
      finish(carried);
    } else {
      finish(read);
    }
  }
  // An early flush's store of the new state s (laid out as the tile of the copy `ck` read) into
  // that copy and, in separate mode, the read copy.
  template <bool SR, bool READ_SR, class Params, class CK>
  static __device__ __forceinline__ void store(const Params& p, const CK& ck,
                                               const float (&s)[CK::Tiling::kPasses][CK::Tiling::kChunksPerLane][CK::Tiling::kVec],
                                               int slot, uint64_t epoch, int head, int row0) {
    const auto read_at = CopyRows<Read, P, N>::of(read_view(p), slot, p.num_heads, head, row0);
    store_flushed<typename CK::Tiling, SR, kSeparate, READ_SR, P, N>(ck.at, read_at, s, rounding_seed<SR>(p), slot,
                                                                      epoch, head, row0);
  }
};

template <int P, int N, int HPG, int L, int T, int ROWS, int WARPS, typename act_t, typename state_t, bool HAS_D,
          bool HAS_Z, bool HAS_DT_BIAS, bool DT_SOFTPLUS, bool SR, typename read_t = void, bool READ_SR = SR>
struct Verify {
  static constexpr int kCap = L + T;
  using Params = VerifyParams<act_t, state_t>;
  using Tile = RowTiling<state_t, N, ROWS, WARPS, false>;
  using Copies = VerifyCopies<P, N, ROWS, WARPS, state_t, read_t>;
  static constexpr int kThreads = Tile::kThreads;
  static constexpr int kSplits = P / ROWS;
  static constexpr int kRecords = kCap - 1 + T;  // committed (at most CAP - 1) then this step's drafts
  static_assert(T >= 2 && T <= 8, "verify drafts: 2..8");
  // 64 state values a lane: ask for 4 CTAs of 4 warps per SM (128 registers); unbounded, the
  // allocator takes 168, 3 CTAs, and batch 8 at super120b runs 2.6 waves instead of 2. (FP32
  // inputs at T = 8 would spill at 128.)
  static constexpr int kLaneValues = Tile::kPasses * Tile::kChunksPerLane * Tile::kVec;
  static constexpr int kMinBlocks = kThreads == 128 && kLaneValues >= 64 && (sizeof(act_t) == 2 || T <= 4) ? 4 : 0;

  struct Smem {
    alignas(16) float x[kRecords][ROWS];  // committed then draft x rows; a flush scales committed ones in place
    float b[kRecords][N];
    float q[T][N];                        // C of each draft
    float z[T][ROWS];
    alignas(16) float extra[T][ROWS];     // D x_j + record sums of draft j
    float dot[T][kRecords];               // B_i . C_j
    float coef[T][kRecords];              // weight of x_i in y_j
    float dt[kRecords], log_decay[kRecords], log_after[kRecords];
    float total[T];
    DraftTree<T> tree;
    float fold_total;
    int last;
  };
  static constexpr size_t kSmemBytes = sizeof(Smem);

  static __device__ __forceinline__ void run(const Params& vp, Smem& sm) {
    const auto& p = vp.base;
    const auto& d = vp.d;
    begin_after_prior_grid();
    const auto tile = RowTileIndex<kSplits, HPG>::of_block(vp);
    const int split = tile.split, head = tile.head, row = tile.row, group = tile.group, num_groups = tile.num_groups;
    const int row0 = split * ROWS;
    const int slot = p.slot_indices[row];
    // out [batch, T, H, P]: draft j's rows of this CTA.
    const auto out_of = [&](int j) { return p.out + ((int64_t(row) * T + j) * p.num_heads + head) * P + row0; };
    if (skip_unusable_draft_row<T, ROWS, kThreads>(slot, p.pad_slot_id, p.num_slots, out_of)) return;
    typename Copies::template Copy<typename Copies::Read> read;
    read.load(Copies::read_view(p), slot, p.num_heads, head, row0);

    // This step's drafts (all T rows exist whatever t is) and per-head values: their loads are in
    // flight during the cursor's round trip.
    RowStager<act_t, ROWS, T, kThreads> x_draft, z_draft;
    RowStager<act_t, N, T, kThreads> b_draft, c_draft;
    x_draft.load(p.x + int64_t(row) * p.x_stride_b + int64_t(head) * p.x_stride_h + row0, d.x_stride_t, T);
    b_draft.load(p.B + int64_t(row) * p.b_stride_b + int64_t(group) * p.b_stride_g, d.b_stride_t, T);
    c_draft.load(p.C + int64_t(row) * p.c_stride_b + int64_t(group) * p.c_stride_g, d.c_stride_t, T);
    if constexpr (HAS_Z)
      z_draft.load(p.z + int64_t(row) * p.z_stride_b + int64_t(head) * p.z_stride_h + row0, d.z_stride_t, T);
    const bool draft_lane = threadIdx.x < T;
    const float dt_raw = draft_lane ? p.dt[int64_t(row) * p.dt_stride_b + int64_t(threadIdx.x) * d.dt_stride_t +
                                           int64_t(head) * p.dt_stride_h]
                                    : 0.f;
    const int parent_given = draft_lane ? DraftTree<T>::given_parent(d.parents, row, threadIdx.x) : 0;
    const float A = p.A[head], D = HAS_D ? p.D[head] : 0.f, dt_bias = HAS_DT_BIAS ? p.dt_bias[head] : 0.f;

    // Committed records (x, B rows and dt): early where p.speculative.
    HeldRecords<act_t, ROWS, act_t, N, kCap - 1, kThreads> held(
        p.speculative, p.rec_x + int64_t(slot) * p.rec_x_slot_stride + int64_t(head) * kCap * P + row0, P,
        p.rec_b + int64_t(slot) * p.rec_b_slot_stride + int64_t(group) * kCap * N, N,
        p.rec_dt + int64_t(slot) * p.rec_dt_slot_stride + int64_t(head) * kCap);

    int32_t* cursor = slot_cursor(p.cursors, p.cursor_slot_stride, slot);
    const VerifyRow v = read_verify_row<L, T>(cursor, d.num_drafts, d.num_accepted, row);
    if (!v.valid) {  // a corrupted cursor: the row touches nothing
      fault_draft_row<T, ROWS, kThreads>(out_of);
      return;
    }
    const int m = v.committed, t = v.drafts, count = m + t;
    const int mc = v.flush ? 0 : m;  // committed records the drafts replay (none after the fold)

    // Records: committed ones at [0, m), drafts at [m, m + t).
    held.load_held(m);
    for (int i = threadIdx.x; i < m; i += kThreads) {
      const float dt = held.scalar(i);
      sm.dt[i] = dt;
      sm.log_decay[i] = dt * A;
    }
    if (draft_lane && threadIdx.x < t) {
      float dt = dt_raw + dt_bias;
      if constexpr (DT_SOFTPLUS) dt = softplus(dt);
      sm.dt[m + threadIdx.x] = dt;
      sm.log_decay[m + threadIdx.x] = dt * A;
    }
    if (draft_lane) sm.tree.set_parent(threadIdx.x, parent_given);
    held.store(sm.x, sm.b, m);
    x_draft.store(sm.x, m, t);
    b_draft.store(sm.b, m, t);
    c_draft.store(sm.q, 0, t);
    if constexpr (HAS_Z) z_draft.store(sm.z, 0, t);
    __syncthreads();

    // Dots B_i . C_j, the committed records' suffix log-decays, each draft's path log-decay.
    dots_with_drafts<N, T, WARPS>(sm.b, count, sm.q, t, &sm.dot[0][0], kRecords, nullptr);
    window_logs<T, kThreads>(sm.tree, sm.log_decay, sm.log_after, m, t, &sm.fold_total);
    __syncthreads();

    // Weights: coef[j][i] = a(i+1..j) dt_i (B_i . C_j) over committed records and j's path.
    const float committed_log = v.flush ? 0.f : sm.fold_total;
    for (int pair = threadIdx.x; pair < t * count; pair += kThreads) {
      const int j = pair / count, i = pair % count;
      const float w = window_decay(sm.tree, sm.log_decay, sm.log_after, m, mc, j, i);
      sm.coef[j][i] = window_weight(w, sm.dt[i] * sm.dot[j][i]);
    }
    if (threadIdx.x < t) sm.total[threadIdx.x] = expf(committed_log + sm.tree.path_log[threadIdx.x]);
    __syncthreads();
    // Record sums of each (draft, row), over the committed records it replays and its path; a
    // flush's fold weights of the committed x rows (which the sums then skip) in place.
    for (int e = threadIdx.x; e < t * ROWS; e += kThreads) {
      const int j = e / ROWS, r = e % ROWS;
      float acc = HAS_D ? D * sm.x[m + j][r] : 0.f;
      for (int i = 0; i < mc; ++i) acc = fmaf(sm.coef[j][i], sm.x[i][r], acc);
      // (a draft off j's path has weight 0 and is skipped: its x may be NaN)
      for (int i = m; i < count; ++i)
        if (sm.coef[j][i] != 0.f) acc = fmaf(sm.coef[j][i], sm.x[i][r], acc);
      sm.extra[j][r] = acc;
    }
    if (v.flush)
      for (int e = threadIdx.x; e < m * ROWS; e += kThreads) {
        const int i = e / ROWS, r = e % ROWS;
        sm.x[i][r] *= expf(sm.log_after[i]) * sm.dt[i];
      }
    __syncthreads();

    // Rows: the early flush's fold (written back), then every draft's output from the state.
    Copies::rows_from(p, read, v.flush, slot, head, row0, [&](const auto& ck) {
      using RT = typename std::decay_t<decltype(ck)>::Tiling;
      float s[RT::kPasses][RT::kChunksPerLane][RT::kVec];
      tile_values(ck, v.flush ? expf(sm.fold_total) : 1.f, s);
      if (v.flush) {
        fold_records<RT, ROWS>(s, sm.x, sm.b, m);
        Copies::template store<SR, READ_SR>(p, ck, s, slot, uint64_t(SR ? v.epoch : 0), head, row0);
      }
      #pragma unroll
      for (int j = 0; j < T; ++j) {
        act_t* out = out_of(j);
        if (j >= t) {  // no such draft: a zero output
          RT::fill_rows(out, 0.f);
          continue;
        }
        float q_reg[RT::kChunksPerLane][RT::kVec];
        RT::slice(&sm.q[j][0], q_reg);
        #pragma unroll
        for (int i = 0; i < RT::kPasses; ++i) {
          const int r = RT::row(i);
          const float acc = RT::dot(s[i], q_reg);
          float y = group_sum<RT::kLanesPerRow>(acc) * sm.total[j] + sm.extra[j][r];
          if (RT::row_leader()) {
            if constexpr (HAS_Z) y *= sm.z[j][r] / (1.f + expf(-sm.z[j][r]));
            out[r] = from_float<act_t>(y);
          }
        }
      }
    });

    // Shared rows from this CTA's shared memory: its head's dt (first row tile), its group's B
    // rows (the group's first head).
    const auto write_own = [&](int first) {
      if (split != 0) return true;
      float* dt_ring = p.rec_dt + int64_t(slot) * p.rec_dt_slot_stride + int64_t(head) * kCap + first;
      for (int j = threadIdx.x; j < t; j += kThreads) dt_ring[j] = sm.dt[m + j];
      if (head % HPG == 0) {
        act_t* b_ring = p.rec_b + int64_t(slot) * p.rec_b_slot_stride + (int64_t(group) * kCap + first) * N;
        for (int j = 0; j < t; ++j)
          for (int c = threadIdx.x; c < N; c += kThreads) b_ring[j * N + c] = from_float<act_t>(sm.b[m + j][c]);
      }
      return true;
    };
    append_drafts<P, N, kCap, ROWS, kThreads, HAS_DT_BIAS, DT_SOFTPLUS>(
        vp, v, row, slot, head, row0, num_groups, kSplits, &sm.last,
        [&](int j, int r) { return from_float<act_t>(sm.x[m + j][r]); }, write_own);
  }
};

// The conventional spec baseline: per row, read the state once, take the t drafts as a chain of
// conventional steps, and write the state after draft j into slot snapshot_slots[row, j].
template <int P, int N, int HPG, int T, int ROWS, int WARPS, typename act_t, typename state_t, bool HAS_D, bool HAS_Z,
          bool HAS_DT_BIAS, bool DT_SOFTPLUS>
struct Snapshot {
  using Params = VerifyParams<act_t, state_t>;
  using Tile = RowTiling<state_t, N, ROWS, WARPS, true>;
  static constexpr int kThreads = Tile::kThreads;
  static constexpr int kSplits = P / ROWS;

  struct Smem {
    alignas(16) float x[T][ROWS];
    float b[T][N], q[T][N];
    float z[T][ROWS];
    float dt[T];
  };
  static constexpr size_t kSmemBytes = sizeof(Smem);

  static __device__ __forceinline__ void run(const Params& vp, Smem& sm) {
    const auto& p = vp.base;
    const auto& d = vp.d;
    begin_after_prior_grid();
    const auto tile = RowTileIndex<kSplits, HPG>::of_block(vp);
    const int split = tile.split, head = tile.head, row = tile.row, group = tile.group;
    const int row0 = split * ROWS;
    const int slot = p.slot_indices[row];
    const auto out_of = [&](int j) { return p.out + ((int64_t(row) * T + j) * p.num_heads + head) * P + row0; };
    if (skip_unusable_draft_row<T, ROWS, kThreads>(slot, p.pad_slot_id, p.num_slots, out_of)) return;
    typename Tile::Regs s_raw;
    load_state_rows<Tile, P>(p.state, p.state_slot_stride, slot, head, row0, s_raw);
    RowStager<act_t, ROWS, T, kThreads> x_draft, z_draft;
    RowStager<act_t, N, T, kThreads> b_draft, c_draft;
    x_draft.load(p.x + int64_t(row) * p.x_stride_b + int64_t(head) * p.x_stride_h + row0, d.x_stride_t, T);
    b_draft.load(p.B + int64_t(row) * p.b_stride_b + int64_t(group) * p.b_stride_g, d.b_stride_t, T);
    c_draft.load(p.C + int64_t(row) * p.c_stride_b + int64_t(group) * p.c_stride_g, d.c_stride_t, T);
    if constexpr (HAS_Z)
      z_draft.load(p.z + int64_t(row) * p.z_stride_b + int64_t(head) * p.z_stride_h + row0, d.z_stride_t, T);
    const int t = d.num_drafts != nullptr ? min(max(d.num_drafts[row], 0), T) : T;
    x_draft.store(sm.x, 0, t);
    b_draft.store(sm.b, 0, t);
    c_draft.store(sm.q, 0, t);
    if constexpr (HAS_Z) z_draft.store(sm.z, 0, t);
    if (threadIdx.x < t) sm.dt[threadIdx.x] = draft_dt<HAS_DT_BIAS, DT_SOFTPLUS>(p, d, row, threadIdx.x, head);
    __syncthreads();

    float s[Tile::kPasses][Tile::kChunksPerLane][Tile::kVec];
    #pragma unroll
    for (int i = 0; i < Tile::kPasses; ++i)
      #pragma unroll
      for (int c = 0; c < Tile::kChunksPerLane; ++c)
        #pragma unroll
        for (int e = 0; e < Tile::kVec; ++e) s[i][c][e] = s_raw[i][c].get(e);
    const float A = p.A[head], D = HAS_D ? p.D[head] : 0.f;
    #pragma unroll 1
    for (int j = 0; j < T; ++j) {
      act_t* out = out_of(j);
      if (j >= t) {  // no such draft: a zero output
        Tile::fill_rows(out, 0.f);
        continue;
      }
      const float alpha = expf(sm.dt[j] * A);
      const int snap = d.snapshot_slots[int64_t(row) * T + j];
      const bool write = unsigned(snap) < unsigned(p.num_slots);  // an out-of-range snapshot slot is skipped
      state_t* snap_rows = p.state + int64_t(snap) * p.state_slot_stride + (int64_t(head) * P + row0) * N;
      float b_reg[Tile::kChunksPerLane][Tile::kVec], q_reg[Tile::kChunksPerLane][Tile::kVec];
      Tile::slice(&sm.b[j][0], b_reg);
      Tile::slice(&sm.q[j][0], q_reg);
      #pragma unroll
      for (int i = 0; i < Tile::kPasses; ++i) {
        const int r = Tile::row(i);
        const float w = sm.dt[j] * sm.x[j][r];
        float acc = 0.f;
        #pragma unroll
        for (int c = 0; c < Tile::kChunksPerLane; ++c) {
          #pragma unroll
          for (int e = 0; e < Tile::kVec; ++e) {
            s[i][c][e] = fmaf(w, b_reg[c][e], alpha * s[i][c][e]);
            acc = fmaf(s[i][c][e], q_reg[c][e], acc);
          }
          if (write) store_values<state_t, false, Tile::kVec>(snap_rows + int64_t(r) * N + Tile::col(c), s[i][c], 0, 0);
        }
        float y = group_sum<Tile::kLanesPerRow>(acc) + D * sm.x[j][r];
        if (Tile::row_leader()) {
          if constexpr (HAS_Z) y *= sm.z[j][r] / (1.f + expf(-sm.z[j][r]));
          out[r] = from_float<act_t>(y);
        }
      }
    }
  }
};

}  // namespace replayssm::mamba2
