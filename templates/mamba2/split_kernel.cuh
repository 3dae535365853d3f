// Mamba-2 split ReplaySSM step (common/split.cuh).
//
// Records: one CTA per (group, batch row). It reads the slot's cursor and, for each head of the
// group, the held records. With j = held + 1 records (this token's last):
//   total = a(1:j), coef_i = a(i+1:j) dt_i,
//   non-flush: extra[r] = D x[r] + sum_i coef_i (B_i . q) x_i[r]; it appends this token's record;
//   flush:     extra[r] = D x[r], and coef goes to the state kernel, which folds the records.
// The group's CTAs advance the cursor (the last arrival of the row).
// State: the per-item row tiles (decode_kernel.cuh) with the records replaced by the workspace.
#pragma once
#include "common/split.cuh"
#include "mamba2/decode_kernel.cuh"

namespace replayssm::mamba2 {

template <int P, int N, int HPG, int L, int CAP, typename act_t, typename state_t, bool HAS_D, bool HAS_DT_BIAS,
          bool DT_SOFTPLUS>
struct Records {
  using Params = mamba2::Params<act_t, state_t>;
  using Workspace = SplitWorkspace<P, CAP>;
  static constexpr int kWarps = 8, kThreads = kWarps * 32;
  static constexpr int kRing = CAP > 1 ? CAP - 1 : 1;  // ring rows held before this token, at most

  struct Smem {
    alignas(16) act_t x[HPG][CAP][P];  // x_i of each head as stored: ring rows, then this token's
    float b[CAP][N];                   // B_i
    float q[1][N];                     // C of this token
    float dt[HPG][CAP], log_decay[HPG][CAP], coef[HPG][CAP];
    float dot[CAP];                    // B_i . q
    float total[HPG];
  };
  static constexpr size_t kSmemBytes = sizeof(Smem);

  // The group's x rows, copied raw (16-byte vectors where the rows allow): ring rows (h, i) at
  // ring + (h * CAP + i) * P, and this token's at x + h * head_stride.
  struct XRows {
    static constexpr int kBytes = row_vector_bytes<act_t, P>();
    static constexpr int kPerRow = P * int(sizeof(act_t)) / kBytes;
    static constexpr int kRingIters = (HPG * kRing * kPerRow + kThreads - 1) / kThreads;
    static constexpr int kCurIters = (HPG * kPerRow + kThreads - 1) / kThreads;
    using Raw = typename RawVec<kBytes>::type;
    Raw ring[kRingIters], cur[kCurIters];

    __device__ __forceinline__ void load_ring(const act_t* ring_rows, int count) {
      #pragma unroll
      for (int it = 0; it < kRingIters; ++it) {
        const int idx = it * kThreads + threadIdx.x, part = idx % kPerRow, h = idx / kPerRow / kRing,
                  i = idx / kPerRow % kRing;
        if (h < HPG && i < count) ring[it] = reinterpret_cast<const Raw*>(ring_rows + (int64_t(h) * CAP + i) * P)[part];
      }
    }
    __device__ __forceinline__ void load_current(const act_t* x, int64_t head_stride) {
      #pragma unroll
      for (int it = 0; it < kCurIters; ++it) {
        const int idx = it * kThreads + threadIdx.x, part = idx % kPerRow, h = idx / kPerRow;
        if (h < HPG) cur[it] = reinterpret_cast<const Raw*>(x + int64_t(h) * head_stride)[part];
      }
    }
    __device__ __forceinline__ void store(act_t (*dst)[CAP][P], int held) const {
      #pragma unroll
      for (int it = 0; it < kRingIters; ++it) {
        const int idx = it * kThreads + threadIdx.x, part = idx % kPerRow, h = idx / kPerRow / kRing,
                  i = idx / kPerRow % kRing;
        if (h < HPG && i < held) reinterpret_cast<Raw*>(dst[h][i])[part] = ring[it];
      }
      #pragma unroll
      for (int it = 0; it < kCurIters; ++it) {
        const int idx = it * kThreads + threadIdx.x, part = idx % kPerRow, h = idx / kPerRow;
        if (h < HPG) reinterpret_cast<Raw*>(dst[h][held])[part] = cur[it];
      }
    }
  };

  static __device__ __forceinline__ void run(const Params& p, Smem& sm) {
    allow_dependent_grid();  // the state kernel's CTAs may start their checkpoint reads now
    const int group = blockIdx.x, row = blockIdx.y, head0 = group * HPG, num_groups = p.num_heads / HPG;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int slot = p.slot_indices[row];
    if (slot == p.pad_slot_id) return;  // the state kernel writes the padded row's zeros

    const act_t* rec_x = p.rec_x + (int64_t(slot) * p.num_heads + head0) * CAP * P;
    const act_t* rec_b = p.rec_b + (int64_t(slot) * num_groups + group) * CAP * N;
    XRows x_rows;
    RecordStager<act_t, N, CAP, kThreads> b_stage;
    RowStager<act_t, N, 1, kThreads> q_stage;
    x_rows.load_current(p.x + int64_t(row) * p.x_stride_b + int64_t(head0) * p.x_stride_h, p.x_stride_h);
    if (p.speculative) x_rows.load_ring(rec_x, kRing);
    b_stage.load_early(rec_b, N, p.B + int64_t(row) * p.b_stride_b + int64_t(group) * p.b_stride_g, p.speculative);
    q_stage.load(p.C + int64_t(row) * p.c_stride_b + int64_t(group) * p.c_stride_g, 0, 1);

    int32_t* cursor = p.cursors + int64_t(slot) * kCursorWords;
    const int held = cursor[0], epoch = cursor[1];
    const int records = held + 1;
    const bool flush = records >= L;
    if (!p.speculative) x_rows.load_ring(rec_x, held);
    b_stage.load_late(rec_b, N, held, p.speculative);
    for (int e = threadIdx.x; e < HPG * records; e += kThreads) {
      const int h = e / records, i = e % records;
      float dt;
      if (i == held) {
        dt = p.dt[int64_t(row) * p.dt_stride_b + int64_t(head0 + h) * p.dt_stride_h];
        if constexpr (HAS_DT_BIAS) dt += p.dt_bias[head0 + h];
        if constexpr (DT_SOFTPLUS) dt = dt > 20.f ? dt : log1pf(expf(dt));
      } else {
        dt = p.rec_dt[(int64_t(slot) * p.num_heads + head0 + h) * CAP + i];
      }
      sm.dt[h][i] = dt;
      sm.log_decay[h][i] = dt * p.A[head0 + h];
    }
    x_rows.store(sm.x, held);
    b_stage.store(sm.b, held);
    q_stage.store(sm.q, 0, 1);
    __syncthreads();

    // B_i . q (a warp per record) and each head's decays (a warp per head).
    for (int i = warp; i < records; i += kWarps) {
      float acc = 0.f;
      for (int k = lane; k < N; k += 32) acc = fmaf(sm.b[i][k], sm.q[0][k], acc);
      acc = group_sum<32>(acc);
      if (lane == 0) sm.dot[i] = acc;
    }
    for (int h = warp; h < HPG; h += kWarps) {
      const float total = suffix_decays(sm.log_decay[h], sm.coef[h], records);
      __syncwarp();
      for (int i = lane; i < records; i += 32) sm.coef[h][i] *= sm.dt[h][i];
      if (lane == 0) sm.total[h] = total;
    }
    __syncthreads();

    const Workspace ws{p.workspace, p.batch, p.num_heads};
    for (int e = threadIdx.x; e < HPG * P; e += kThreads) {
      const int h = e / P, r = e % P;
      float extra = HAS_D ? p.D[head0 + h] * to_float(sm.x[h][held][r]) : 0.f;
      if (!flush)
        for (int i = 0; i < records; ++i) extra = fmaf(sm.coef[h][i] * sm.dot[i], to_float(sm.x[h][i][r]), extra);
      ws.extra(row, head0)[e] = extra;  // a group's heads are adjacent rows of the workspace
    }
    if (threadIdx.x < HPG) *ws.total(row, head0 + threadIdx.x) = sm.total[threadIdx.x];
    if (flush) {
      for (int e = threadIdx.x; e < HPG * records; e += kThreads)
        ws.coef(row, head0 + e / records)[e % records] = sm.coef[e / records][e % records];
    } else {  // append this token's record at ring row `held` (exact: copied as stored, B via float)
      for (int e = threadIdx.x; e < HPG * P; e += kThreads)
        p.rec_x[((int64_t(slot) * p.num_heads + head0 + e / P) * CAP + held) * P + e % P] = sm.x[e / P][held][e % P];
      if (threadIdx.x < HPG) p.rec_dt[(int64_t(slot) * p.num_heads + head0 + threadIdx.x) * CAP + held] = sm.dt[threadIdx.x][held];
      act_t* rb = p.rec_b + ((int64_t(slot) * num_groups + group) * CAP + held) * N;
      for (int k = threadIdx.x; k < N; k += kThreads) rb[k] = from_float<act_t>(sm.b[held][k]);
    }
    if (group == 0 && threadIdx.x == 0) {
      int32_t* info = ws.info(row);
      info[0] = held;
      info[1] = flush;
      info[2] = epoch;
    }
    advance_cursor(cursor, num_groups, flush, records);
  }
};

template <int P, int N, int HPG, int L, int CAP, int ROWS, int WARPS, typename act_t, typename state_t, bool HAS_D,
          bool HAS_Z, bool HAS_DT_BIAS, bool DT_SOFTPLUS, bool SR>
struct State {
  using Base = Kernel<P, N, HPG, L, CAP, ROWS, WARPS, act_t, state_t, true, HAS_D, HAS_Z, HAS_DT_BIAS, DT_SOFTPLUS, SR>;
  using Params = typename Base::Params;
  using Tile = typename Base::Tile;
  using Smem = typename Base::Smem;
  using Workspace = SplitWorkspace<P, CAP>;
  static constexpr int kThreads = Base::kThreads, kSplits = Base::kSplits;
  static constexpr size_t kSmemBytes = Base::kSmemBytes;
  // The workspace rows start at row0 of a P-float row: vectors that divide both.
  static constexpr int kExtraBytes = row_vector_bytes<float, P>() < row_vector_bytes<float, ROWS>()
                                         ? row_vector_bytes<float, P>()
                                         : row_vector_bytes<float, ROWS>();

  static __device__ __forceinline__ void run(const Params& p, Smem& sm) {
    const int split = blockIdx.x % kSplits, head = blockIdx.x / kSplits, row = blockIdx.y;
    const int group = head / HPG, num_groups = p.num_heads / HPG;
    const int row0 = split * ROWS;
    const int slot = p.slot_indices[row];
    act_t* out = p.out + (int64_t(row) * p.num_heads + head) * P + row0;
    if (slot == p.pad_slot_id) {  // padded row: zero output, touch nothing else
      for (int r = threadIdx.x; r < ROWS; r += kThreads) out[r] = from_float<act_t>(0.f);
      return;
    }

    // Checkpoint rows and this token's C and z first: none of them waits for the records kernel.
    state_t* rows = p.state + int64_t(slot) * p.state_slot_stride + (int64_t(head) * P + row0) * N;
    typename Tile::Regs s_raw;
    Tile::load(rows, s_raw);
    RowStager<act_t, N, 1, kThreads> q_stage;
    RowStager<act_t, ROWS, 1, kThreads> z_stage;
    q_stage.load(p.C + int64_t(row) * p.c_stride_b + int64_t(group) * p.c_stride_g, 0, 1);
    if constexpr (HAS_Z) z_stage.load(p.z + int64_t(row) * p.z_stride_b + int64_t(head) * p.z_stride_h + row0, 0, 1);

    wait_for_prior_grid();
    const Workspace ws{p.workspace, p.batch, p.num_heads};
    const int32_t* info = ws.info(row);
    const int held = info[0], records = held + 1;
    const bool flush = info[1] != 0;
    const uint64_t epoch = SR ? uint64_t(info[2]) : 0;
    const float total = *ws.total(row, head);
    RowStager<float, ROWS, 1, kThreads, kExtraBytes> extra_stage;
    extra_stage.load(ws.extra(row, head) + row0, 0, 1);
    if (flush) {  // the records to fold, and their weights
      const act_t* rec_x = p.rec_x + (int64_t(slot) * p.num_heads + head) * CAP * P + row0;
      const act_t* rec_b = p.rec_b + (int64_t(slot) * num_groups + group) * CAP * N;
      RecordStager<act_t, ROWS, CAP, kThreads> x_stage;
      RecordStager<act_t, N, CAP, kThreads> b_stage;
      x_stage.load_early(rec_x, P, p.x + int64_t(row) * p.x_stride_b + int64_t(head) * p.x_stride_h + row0, false);
      b_stage.load_early(rec_b, N, p.B + int64_t(row) * p.b_stride_b + int64_t(group) * p.b_stride_g, false);
      x_stage.load_late(rec_x, P, held, false);
      b_stage.load_late(rec_b, N, held, false);
      for (int i = threadIdx.x; i < records; i += kThreads) sm.dt[i] = ws.coef(row, head)[i];
      x_stage.store(sm.x, held);
      b_stage.store(sm.b, held);
    }
    q_stage.store(sm.q, 0, 1);
    if constexpr (HAS_Z) z_stage.store(sm.z, 0, 1);
    extra_stage.store(reinterpret_cast<float (*)[ROWS]>(sm.extra), 0, 1);
    __syncthreads();
    if (flush) {
      for (int r = threadIdx.x; r < ROWS; r += kThreads)
        for (int i = 0; i < records; ++i) sm.x[i][r] *= sm.dt[i];
      __syncthreads();
    }
    Base::finish_rows(p, sm, s_raw, rows, out, flush, records, total, slot, epoch, head, row0);
  }
};

}  // namespace replayssm::mamba2
