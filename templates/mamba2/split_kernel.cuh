// Mamba-2 split ReplaySSM step (common/split.cuh).
//
// Records: one CTA per (group, batch row). It reads the slot's cursor and, for each head of the
// group, the held records. With j = held + 1 records (this token's last):
//   total = a(1:j), coef_i = a(i+1:j) dt_i,
//   non-flush: extra[r] = D x[r] + sum_i coef_i (B_i . q) x_i[r]; it appends this token's record;
//   flush:     extra[r] = D x[r], and coef goes to the state kernel, which folds the records.
// Nothing here writes the cursor: the state kernel's first CTA of the row advances it once every
// records CTA has finished (no arrival counting).
// State: the per-item row tiles (decode_kernel.cuh) with the records replaced by the workspace.
#pragma once
#include "common/split.cuh"
#include "mamba2/decode_kernel.cuh"

namespace replayssm::mamba2 {

template <int P, int N, int HPG, int L, int CAP, typename act_t, typename state_t, bool HAS_D, bool HAS_DT_BIAS,
          bool DT_SOFTPLUS>
struct Records {
  using Params = mamba2::Params<act_t, state_t>;
  using Workspace = SplitWorkspace<P, 1, CAP>;  // scalars: a(1:j)
  static constexpr int kWarps = 8, kThreads = kWarps * 32;
  static constexpr int kRing = CAP > 1 ? CAP - 1 : 1;  // ring rows held before this token, at most

  // Records as stored (copied asynchronously: no staging registers); this token's apart, so that
  // its copies can start before the cursor says which ring row it is. The held x rows join them
  // only where a full SM of records CTAs still fits; otherwise they are prefetched into L2 and
  // loaded from there where they are summed (a full SM of CTAs is worth the extra round trip).
  struct Scalars {
    float dt[HPG][CAP];         // ring dt (copied), then this token's at [held]
    float log_decay[HPG][CAP], coef[HPG][CAP];  // coef_i = a(i+1:j) dt_i
    float dot[CAP];             // B_i . q
    float A[HPG], D[HPG], dt_cur[HPG], total[HPG];
  };
  template <bool HELD_ROWS_IN_SHARED>
  struct Layout {
    alignas(16) act_t x[HELD_ROWS_IN_SHARED ? HPG : 1][HELD_ROWS_IN_SHARED ? kRing : 1][P];
    alignas(16) act_t x_cur[HPG][P];
    alignas(16) act_t b[kRing][N];
    alignas(16) act_t b_cur[N];
    alignas(16) act_t q[N];
    Scalars s;
  };
  static constexpr bool kRingRowsInShared = fills_sm_threads<sizeof(Layout<true>), kThreads>();
  using Smem = Layout<kRingRowsInShared>;
  static constexpr size_t kSmemBytes = sizeof(Smem);
  static constexpr int kMinBlocks = shared_memory_resident_ctas<kSmemBytes, kThreads>();
  // Held x rows read from L2 per batch of loads: their round trips overlap.
  static constexpr int kLoadBatch = 2;

  // The ring's first `count` rows; a flush (with_rows false) needs only their dt, for the decays.
  static __device__ __forceinline__ void copy_ring(const Params& p, Smem& sm, int slot, int head0, int group, int count,
                                                   bool with_rows) {
    const int num_groups = p.num_heads / HPG;
    if (with_rows) {
      const act_t* rec_x = p.rec_x + int64_t(slot) * p.rec_x_slot_stride + int64_t(head0) * CAP * P;
      stage_held_rows<kRingRowsInShared, act_t, P, HPG, kRing, CAP, kThreads>(&sm.x[0][0][0], rec_x, count);
      copy_columns_async<act_t, N, 1, kThreads>(&sm.b[0][0], 0, N,
                                                    p.rec_b + int64_t(slot) * p.rec_b_slot_stride + int64_t(group) * CAP * N, 0, N, count);
    }
    copy_columns_async<float, 1, HPG, kThreads>(&sm.s.dt[0][0], CAP, 1,
                                                    p.rec_dt + int64_t(slot) * p.rec_dt_slot_stride + int64_t(head0) * CAP, CAP, 1, count);
  }

  static __device__ __forceinline__ void run(const Params& p, Smem& sm) {
    begin_after_prior_grid();  // the state kernel's CTAs may start their checkpoint reads now
    const auto index = GroupIndex<HPG>::of_block(p);
    const int group = index.group, row = index.row, head0 = index.head0, num_groups = index.num_groups;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int slot = p.slot_indices[row];
    if (!slot_usable(slot, p.pad_slot_id, p.num_slots)) return;  // the state kernel writes its outputs

    // This token's inputs and per-head parameters, and (speculative) every ring row.
    copy_columns_async<act_t, P, HPG, kThreads>(&sm.x_cur[0][0], P, 0, p.x + int64_t(row) * p.x_stride_b +
                                        int64_t(head0) * p.x_stride_h, p.x_stride_h, 0, 1);
    copy_columns_async<act_t, N, 1, kThreads>(sm.b_cur, 0, 0, p.B + int64_t(row) * p.b_stride_b + int64_t(group) * p.b_stride_g, 0, 0, 1);
    copy_columns_async<act_t, N, 1, kThreads>(sm.q, 0, 0, p.C + int64_t(row) * p.c_stride_b + int64_t(group) * p.c_stride_g, 0, 0, 1);
    copy_columns_async<float, 1, 1, kThreads>(sm.s.A, 0, 1, p.A + head0, 0, 1, HPG);
    if constexpr (HAS_D) copy_columns_async<float, 1, 1, kThreads>(sm.s.D, 0, 1, p.D + head0, 0, 1, HPG);
    if (p.speculative) copy_ring(p, sm, slot, head0, group, kRing, true);

    const auto opened = open_step<true, L, CAP>(slot_cursor(p.cursors, p.cursor_slot_stride, slot));
    // This token's dt while the cursor load is in flight: read past the held-count check, its loads
    // waited for the cursor, a round trip more on every step (1 us at batch 8). sm.s.dt is not
    // used here, as the ring copies may still be filling it.
    if (threadIdx.x < HPG) sm.s.dt_cur[threadIdx.x] = token_dt<HAS_DT_BIAS, DT_SOFTPLUS>(p, row, head0 + threadIdx.x);
    if (!opened.valid()) {  // a corrupted cursor: the state kernel faults the row
      if (group == 0 && threadIdx.x == 0) store_step(Workspace{p.workspace, p.batch, p.num_heads}.info(row), opened.faulted());
      pipe::wait_copies();
      return;
    }
    const StepDecision d = opened.decide([&] { return kFlushMask && flush_masked(p, row); });
    const int held = d.held, records = d.records;
    const bool flush = d.flush;
    if (!p.speculative) copy_ring(p, sm, slot, head0, group, held, !flush);
    pipe::wait_copies();
    __syncthreads();

    // B_i . q (a warp per record; not needed by a flush) and each head's decays (a warp per head).
    for (int i = warp; i < (flush ? 0 : records); i += kWarps) {
      const act_t* b = i == held ? sm.b_cur : sm.b[i];
      float acc = 0.f;
      for (int k = lane; k < N; k += 32) acc = fmaf(to_float(b[k]), to_float(sm.q[k]), acc);
      acc = group_sum<32>(acc);
      if (lane == 0) sm.s.dot[i] = acc;
    }
    for (int h = warp; h < HPG; h += kWarps) {
      if (records <= 32) {  // one scan, in registers: lane l holds record records - 32 + l
        const int i = records - 32 + lane;
        const float dt_i = i < 0 ? 0.f : (i == held ? sm.s.dt_cur[h] : sm.s.dt[h][i]);
        float decay_i;
        const float total = suffix_decay_lane(i < 0 ? 0.f : dt_i * sm.s.A[h], decay_i);
        if (i >= 0) sm.s.coef[h][i] = decay_i * dt_i;
        if (lane == 0) sm.s.total[h] = total;
        continue;
      }
      if (lane == 0) sm.s.dt[h][held] = sm.s.dt_cur[h];
      __syncwarp();
      for (int i = lane; i < records; i += 32) sm.s.log_decay[h][i] = sm.s.dt[h][i] * sm.s.A[h];
      __syncwarp();
      const float total = suffix_decays(sm.s.log_decay[h], sm.s.coef[h], records);
      __syncwarp();
      for (int i = lane; i < records; i += 32) sm.s.coef[h][i] *= sm.s.dt[h][i];
      if (lane == 0) sm.s.total[h] = total;
    }
    __syncthreads();

    // Per-row sums, kVec consecutive rows of one head per thread: each record's weight
    // a(i+1:j) dt_i (B_i . q) is formed once per thread (the per-item kernel's product).
    const Workspace ws{p.workspace, p.batch, p.num_heads};
    constexpr int kVec = elements_per_thread<P, HPG * P, kThreads>();
    for (int e = threadIdx.x * kVec; e < HPG * P; e += kThreads * kVec) {
      const int h = e / P, r = e % P;
      float x_cur[kVec], extra[kVec];
      load_floats<act_t, kVec>(&sm.x_cur[h][r], x_cur);
      #pragma unroll
      for (int v = 0; v < kVec; ++v) extra[v] = HAS_D ? sm.s.D[h] * x_cur[v] : 0.f;
      if (!flush) {
        if constexpr (kRingRowsInShared) {
          for (int i = 0; i < held; ++i) {
            const float w = sm.s.coef[h][i] * sm.s.dot[i];
            float x[kVec];
            load_floats<act_t, kVec>(&sm.x[h][i][r], x);
            #pragma unroll
            for (int v = 0; v < kVec; ++v) extra[v] = fmaf(w, x[v], extra[v]);
          }
        } else {  // from L2, kLoadBatch records' loads in flight at once
          const act_t* held_x = p.rec_x + int64_t(slot) * p.rec_x_slot_stride + int64_t(head0 + h) * CAP * P + r;
          for (int i0 = 0; i0 < held; i0 += kLoadBatch) {
            float x[kLoadBatch][kVec];
            #pragma unroll
            for (int b = 0; b < kLoadBatch; ++b)
              if (i0 + b < held) load_floats<act_t, kVec>(held_x + (i0 + b) * P, x[b]);
            #pragma unroll
            for (int b = 0; b < kLoadBatch; ++b) {
              if (i0 + b >= held) break;
              const float w = sm.s.coef[h][i0 + b] * sm.s.dot[i0 + b];
              #pragma unroll
              for (int v = 0; v < kVec; ++v) extra[v] = fmaf(w, x[b][v], extra[v]);
            }
          }
        }
        const float w = sm.s.coef[h][held] * sm.s.dot[held];
        #pragma unroll
        for (int v = 0; v < kVec; ++v) extra[v] = fmaf(w, x_cur[v], extra[v]);
      }
      store_floats<kVec>(ws.extra(row, head0) + e, extra);  // a group's heads are adjacent rows of the workspace
    }
    if (threadIdx.x < HPG) *ws.scalars(row, head0 + threadIdx.x) = sm.s.total[threadIdx.x];
    if (flush) {
      for (int e = threadIdx.x; e < HPG * CAP; e += kThreads) {
        const int h = e / CAP, i = e % CAP;
        if (i < records) ws.coef(row, head0 + h)[i] = sm.s.coef[h][i];
      }
    } else {  // append this token's record at ring row `held` (copied as stored)
      store_rows<act_t, P, HPG, kThreads>(p.rec_x + int64_t(slot) * p.rec_x_slot_stride + (int64_t(head0) * CAP + held) * P, CAP * P,
                                          &sm.x_cur[0][0], P);
      if (threadIdx.x < HPG) p.rec_dt[int64_t(slot) * p.rec_dt_slot_stride + int64_t(head0 + threadIdx.x) * CAP + held] = sm.s.dt_cur[threadIdx.x];
      store_rows<act_t, N, 1, kThreads>(p.rec_b + int64_t(slot) * p.rec_b_slot_stride + (int64_t(group) * CAP + held) * N, 0, sm.b_cur, 0);
    }
    // the state kernel advances the cursor from this
    if (group == 0 && threadIdx.x == 0) store_step(ws.info(row), d);
  }
};

template <int P, int N, int HPG, int L, int CAP, int ROWS, int WARPS, typename act_t, typename state_t, bool HAS_D,
          bool HAS_Z, bool HAS_DT_BIAS, bool DT_SOFTPLUS, bool SR, typename read_t = void, bool READ_SR = SR>
struct State {
  using Base = Kernel<P, N, HPG, L, CAP, ROWS, WARPS, act_t, state_t, true, HAS_D, HAS_Z, HAS_DT_BIAS, DT_SOFTPLUS, SR,
                      false, read_t, READ_SR>;  // narrow rows: shorter shuffle reductions
  using Params = typename Base::Params;
  using Tile = typename Base::Tile;
  using Workspace = SplitWorkspace<P, 1, CAP>;  // scalars: a(1:j)
  static constexpr int kThreads = Base::kThreads, kSplits = Base::kSplits;

  // Inputs land as stored (asynchronous copies, no staging registers next to the checkpoint
  // rows); only a flush's x rows get an FP32 copy (scaled by their weights). Kept small: shared
  // memory comes out of the L1 that holds the checkpoint loads in flight.
  struct Smem {
    alignas(16) act_t x[CAP][ROWS];  // a flush's records
    alignas(16) act_t b[CAP][N];
    alignas(16) act_t q[N];
    alignas(16) act_t z[ROWS];
    alignas(16) float extra[ROWS];
    alignas(16) float weighted_x[CAP][ROWS];  // a(i+1:j) dt_i x_i
    float coef[CAP];
  };
  static constexpr size_t kSmemBytes = sizeof(Smem);

  static __device__ __forceinline__ void run(const Params& p, Smem& sm) {
    allow_dependent_grid();  // the next step's first kernel may be scheduled (it waits for this one)
    // Inline, not RowTileIndex: through the helper the compiler laid out this kernel's flush copies differently.
    const int split = blockIdx.x % kSplits, head = blockIdx.x / kSplits, row = blockIdx.y;
    const int group = head / HPG, num_groups = p.num_heads / HPG;
    const int row0 = split * ROWS;
    const int slot = p.slot_indices[row];
    act_t* out = p.out + (int64_t(row) * p.num_heads + head) * P + row0;
    if (skip_unusable_row<ROWS, kThreads>(slot, p.pad_slot_id, p.num_slots, out)) return;  // nothing else to do

    // Checkpoint rows and this token's C and z first: none of them waits for the records kernel.
    // The copy non-flush steps read (separate mode: the read copy; a flush loads the carried one below).
    typename Base::template Copy<typename Base::Read> read;
    read.load(Base::read_view(p), slot, p.num_heads, head, row0);
    const act_t* b_cur = p.B + int64_t(row) * p.b_stride_b + int64_t(group) * p.b_stride_g;
    copy_rows_async<act_t, N, kThreads>(sm.q, 0, 0, p.C + int64_t(row) * p.c_stride_b + int64_t(group) * p.c_stride_g,
                                        0, 0, 1, 1);
    if constexpr (HAS_Z)
      copy_rows_async<act_t, ROWS, kThreads>(sm.z, 0, 0, p.z + int64_t(row) * p.z_stride_b +
                                             int64_t(head) * p.z_stride_h + row0, 0, 0, 1, 1);

    wait_for_prior_grid();  // from here on the records kernel has finished: no cursor readers left
    const Workspace ws{p.workspace, p.batch, p.num_heads};
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
    if (head == 0 && split == 0 && threadIdx.x == 0)
      close_split_step(slot_cursor(p.cursors, p.cursor_slot_stride, slot), d);
    const float total = *ws.scalars(row, head);
    // ROWS divides P, so the extra rows are aligned to ROWS' vector width.
    copy_rows_async<float, ROWS, kThreads>(sm.extra, 0, 0, ws.extra(row, head) + row0, 0, 0, 1, 1);
    if (flush) {  // the records to fold (held ones from the rings, this token's from the inputs), and their weights
      copy_rows_async<act_t, ROWS, kThreads>(&sm.x[0][0], 0, ROWS, p.rec_x + int64_t(slot) * p.rec_x_slot_stride + int64_t(head) * CAP * P + row0,
                                             0, P, 1, held);
      copy_rows_async<act_t, ROWS, kThreads>(sm.x[held], 0, 0, p.x + int64_t(row) * p.x_stride_b +
                                             int64_t(head) * p.x_stride_h + row0, 0, 0, 1, 1);
      copy_rows_async<act_t, N, kThreads>(&sm.b[0][0], 0, N, p.rec_b + int64_t(slot) * p.rec_b_slot_stride + int64_t(group) * CAP * N,
                                          0, N, 1, held);
      copy_rows_async<act_t, N, kThreads>(sm.b[held], 0, 0, b_cur, 0, 0, 1, 1);
      copy_rows_async<float, 1, kThreads>(sm.coef, 0, 1, ws.coef(row, head), 0, 1, 1, records);
    }
    pipe::wait_copies();
    __syncthreads();
    if (flush) {  // x_i scaled by its weight a(i+1:j) dt_i, as the per-item kernel does
      for (int e = threadIdx.x; e < records * ROWS; e += kThreads)
        sm.weighted_x[e / ROWS][e % ROWS] = to_float(sm.x[e / ROWS][e % ROWS]) * sm.coef[e / ROWS];
      __syncthreads();
    }
    auto finish = [&](const auto& ck) {
      Base::finish_rows(p, ck, out, flush, records, total, slot, epoch, head, row0, sm.q, sm.z, sm.extra,
                        &sm.weighted_x[0][0], &sm.b[0][0]);
    };
    if (Base::kSeparate && flush) {  // (inline: through a helper such as rows_from the SASS of this flush moved)
      typename Base::template Copy<state_t> carried;
      carried.load(Base::state_view(p), slot, p.num_heads, head, row0);
      finish(carried);
    } else {
      finish(read);
    }
  }
};

}  // namespace replayssm::mamba2
