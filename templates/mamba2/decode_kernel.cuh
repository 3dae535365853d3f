// Mamba-2 decode step, conventional or ReplaySSM, for one token per batch row.
// Framework-agnostic: plain pointers and strides in, no allocation, no host sync.
//
// One CTA handles ROWS headdim rows of one (batch row, head). Its lanes hold whole 16-byte
// chunks of those state rows in registers, loaded before anything else so that the DRAM
// reads overlap the record replay.
//
// ReplaySSM (REPLAY=true): slot s holds a checkpoint S_c and n records (dt, x, B) in rings of
// CAP rows. With j = n + 1 records (the held ones plus this token):
//   y = a(1:j) (S_c q) + sum_i a(i+1:j) dt_i (B_i . q) x_i + D x
// A row flushes when n + 1 >= L: S_c <- a(1:j) S_c + sum_i a(i+1:j) dt_i x_i B_i^T, n <- 0.
// Otherwise it appends this token's record and writes no state. The decision is per slot,
// on the device, so one launch mixes flush and non-flush rows.
// Conventional (REPLAY=false) is the flush path with no held records.
#pragma once
#include "common/checkpoint.cuh"
#include "common/step.cuh"

namespace replayssm::mamba2 {

template <typename act_t, typename state_t>
struct Params {
  state_t* state;           // [slots, H, P, N]; slot stride below, rest contiguous
  int64_t state_slot_stride;
  float* state_scale;       // e4m3: [slots, H, P] FP32 row scales; nvfp4: [slots, H] head scales; else null
  uint8_t* state_blocks;    // nvfp4: [slots, H, P, N / 16] e4m3 block scales, else null
  void* read_state;         // separate mode: the read copy [slots, H, P, N] (read_t), else null
  int64_t read_slot_stride;
  float* read_scale;        // as state_scale, for the read copy
  uint8_t* read_blocks;     // as state_blocks, for the read copy
  act_t* rec_x;             // [slots, H, CAP, P]
  act_t* rec_b;             // [slots, G, CAP, N]
  float* rec_dt;            // [slots, H, CAP]  (dt after bias and softplus)
  int32_t* cursors;         // [slots, kCursorWords]
  // Every slot pool's slot stride in its elements (its block when packed, the page in vLLM's cache
  // pages); each slot's block is contiguous.
  int64_t state_scale_slot_stride, state_block_slot_stride, read_scale_slot_stride, read_block_slot_stride;
  int64_t rec_x_slot_stride, rec_b_slot_stride, rec_dt_slot_stride, cursor_slot_stride;
  const act_t* x;           // [batch, H, P]
  int64_t x_stride_b, x_stride_h;
  const act_t* z;           // [batch, H, P] or null
  int64_t z_stride_b, z_stride_h;
  const float* dt;          // [batch, H]
  int64_t dt_stride_b, dt_stride_h;
  const float* A;           // [H]
  const float* D;           // [H] or null
  const float* dt_bias;     // [H] or null
  const act_t* B;           // [batch, G, N]
  int64_t b_stride_b, b_stride_g;
  const act_t* C;           // [batch, G, N]
  int64_t c_stride_b, c_stride_g;
  act_t* out;               // [batch, H, P] contiguous
  const int32_t* slot_indices;  // [batch]
  int32_t pad_slot_id;
  int32_t num_slots;         // the state's slots: ids outside [0, num_slots) are faults
  int32_t num_heads;
  int32_t batch;
  uint64_t seed;
  bool speculative;         // issue ring loads before the cursor is read (small batches)
  bool flush_every_step;    // per-item ReplaySSM: flush every token (nothing stays held)
  float* workspace;         // split kernel only: its Records::Workspace for `batch` rows
  const int64_t* seed_tensor;  // [1] on the device, or null: replaces seed where SR
  const uint8_t* flush_mask;   // [batch], or null: a nonzero row flushes now (read where REPLAYSSM_FLUSH_MASK)

  __host__ __device__ int heads() const { return num_heads; }  // the state's heads (common/opening.cuh)
};

// This token's dt for `head`, with the bias and softplus the flags ask for (per-item and split kernels).
template <bool HAS_DT_BIAS, bool DT_SOFTPLUS, typename Params>
__device__ __forceinline__ float token_dt(const Params& p, int row, int head) {
  float dt = p.dt[int64_t(row) * p.dt_stride_b + int64_t(head) * p.dt_stride_h];
  if constexpr (HAS_DT_BIAS) dt += p.dt_bias[head];
  if constexpr (DT_SOFTPLUS) dt = softplus(dt);
  return dt;
}

template <int P, int N, int HPG, int L, int CAP, int ROWS, int WARPS, typename act_t, typename state_t,
          bool REPLAY, bool HAS_D, bool HAS_Z, bool HAS_DT_BIAS, bool DT_SOFTPLUS, bool SR, bool WIDE_ROWS,
          typename read_t = void, bool READ_SR = SR>
struct Kernel {
  using Params = mamba2::Params<act_t, state_t>;
  // Separate mode (read_t not void): non-flush steps read the read copy; a flush reads the state
  // (the carried copy), folds, writes it, and writes the read copy from the new state.
  static constexpr bool kSeparate = !std::is_void_v<read_t>;
  using Read = std::conditional_t<kSeparate, read_t, state_t>;
  // Wide rows (fewest values per lane) for the bandwidth-bound conventional and flush-every-step steps;
  // narrow ones for the per-item ReplaySSM kernel and the split state kernel, which agree bit for bit.
  using Tile = RowTiling<state_t, N, ROWS, WARPS, WIDE_ROWS>;
  using ReadTile = RowTiling<Read, N, ROWS, WARPS, WIDE_ROWS>;
  template <class T> using Copy = TileCheckpoint<RowTiling<T, N, ROWS, WARPS, WIDE_ROWS>, T, P>;
  static constexpr int kThreads = Tile::kThreads;
  static constexpr int kSplits = P / ROWS;
  static constexpr int kRecords = REPLAY ? CAP : 1;
  static_assert(P % ROWS == 0, "headdim must split into row tiles");

  struct Smem {
    alignas(16) float x[kRecords][ROWS];  // x_i rows; a flush scales them in place to a(i+1:j) dt_i x_i
    float b[kRecords][N];     // B_i
    float q[1][N];            // C of this token
    float z[1][ROWS];
    float dt[kRecords], log_decay[kRecords], decay[kRecords], dot[kRecords];
    alignas(16) float extra[ROWS];  // D x, plus (non-flush) sum_i a(i+1:j) dt_i (B_i . q) x_i
    float total_decay;
  };
  static constexpr size_t kSmemBytes = sizeof(Smem);

  static __device__ __forceinline__ CheckpointView<state_t> state_view(const Params& p) { return carried_view<state_t>(p); }
  static __device__ __forceinline__ CheckpointView<Read> read_view(const Params& p) {
    return read_copy_view<state_t, read_t>(p);
  }

  // Rows: y = total (S_c . q) + extra, or the fold S <- total S + sum_k x[k][r] B_k (x already
  // scaled by a(k+1:j) dt_k, [records][ROWS]; B [records][N]) and then y = S . q + extra; gated by
  // silu(z). All in shared memory; q (C), z and B FP32 or as stored. `ck` is the copy the step
  // reads (its tile RT); a flush stores the new state into it and, in separate mode, into the read
  // copy too. Shared with the split kernel.
  template <class RT, typename T, typename IN, typename REC>
  static __device__ __forceinline__ void finish_rows(const Params& p, const TileCheckpoint<RT, T, P>& ck, act_t* out,
                                                     bool flush, int records, float total, int slot, uint64_t epoch,
                                                     int head, int row0, const IN* q, const IN* z,
                                                     const float* extra, const float* x, const REC* b) {
    // SR: the seed is read and the keys mixed on the flush path only, and first, where fewer values
    // are live (mixed after the fold, the 64-row state kernel took 127 registers instead of 96).
    uint64_t sr_key = 0, read_key = 0;
    if constexpr (SR || READ_SR) {
      if (flush) {
        const uint64_t seed = rounding_seed<true>(p);
        sr_key = checkpoint_rounding_key<SR>(seed, slot, epoch);
        if constexpr (kSeparate) read_key = read_copy_rounding_key<READ_SR>(seed, slot, epoch);
      }
    }
    float s[RT::kPasses][RT::kChunksPerLane][RT::kVec];
    tile_values(ck, flush ? total : 1.f, s);
    if (flush) {  // S <- a(1:j) S + sum_k (a(k+1:j) dt_k x_k[r]) B_k: exact FP32 FMAs
      for (int k = 0; k < records; ++k) {
        float w[RT::kPasses];
        RT::row_values(x + k * ROWS, w);
        #pragma unroll
        for (int c = 0; c < RT::kChunksPerLane; ++c) {  // one chunk of B_k live at a time
          float b_c[RT::kVec];
          RT::chunk(b + k * N, c, b_c);
          #pragma unroll
          for (int i = 0; i < RT::kPasses; ++i)
            #pragma unroll
            for (int e = 0; e < RT::kVec; ++e) s[i][c][e] = fmaf(w[i], b_c[e], s[i][c][e]);
        }
      }
    }
    float q_reg[RT::kChunksPerLane][RT::kVec];
    RT::slice(q, q_reg);
    const auto read_at = CopyRows<Read, P, N>::of(read_view(p), slot, p.num_heads, head, row0);
    float head_scale = 0.f, read_head_scale = 0.f;  // NVFP4 copies' (whole-CTA reductions)
    if (flush) {
      head_scale = prepare_store<RT>(ck.at, s);
      if constexpr (kSeparate) read_head_scale = prepare_store<RT>(read_at, s);
    }
    #pragma unroll
    for (int i = 0; i < RT::kPasses; ++i) {
      const int r = RT::row(i);
      const float acc = RT::dot(s[i], q_reg);
      float y = group_sum<RT::kLanesPerRow>(acc) * (flush ? 1.f : total) + extra[r];
      if (flush) {
        const uint64_t element = (uint64_t(head) * P + row0 + r) * N;
        store_row<RT, T, SR>(ck.at, r, s[i], sr_key, element, head_scale);
        if constexpr (kSeparate) store_row<RT, Read, READ_SR>(read_at, r, s[i], read_key, element, read_head_scale);
      }
      if (RT::row_leader()) {
        if constexpr (HAS_Z) y *= to_float(z[r]) / (1.f + expf(-to_float(z[r])));
        out[r] = from_float<act_t>(y);
      }
    }
  }

  static __device__ __forceinline__ void run(const Params& p, Smem& sm) {
    begin_after_prior_grid();  // where launched as a programmatic dependent (kFlagOverlapPriorKernel)
    const auto tile = RowTileIndex<kSplits, HPG>::of_block(p);
    const int split = tile.split, head = tile.head, row = tile.row, group = tile.group, num_groups = tile.num_groups;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row0 = split * ROWS;
    const int slot = p.slot_indices[row];
    act_t* out = p.out + (int64_t(row) * p.num_heads + head) * P + row0;
    if (skip_unusable_row<ROWS, kThreads>(slot, p.pad_slot_id, p.num_slots, out)) return;  // nothing else to do

    // 1. State reads first (the read copy's, in separate mode): everything below overlaps them.
    Copy<Read> read;
    read.load(read_view(p), slot, p.num_heads, head, row0);

    // 2. Records: this token's from the inputs, the held ones from the rings (RecordStager).
    const act_t* x_cur = p.x + int64_t(row) * p.x_stride_b + int64_t(head) * p.x_stride_h + row0;
    const act_t* b_cur = p.B + int64_t(row) * p.b_stride_b + int64_t(group) * p.b_stride_g;
    const act_t* q = p.C + int64_t(row) * p.c_stride_b + int64_t(group) * p.c_stride_g;
    const act_t* rec_x = p.rec_x + int64_t(slot) * p.rec_x_slot_stride + int64_t(head) * CAP * P + row0;
    const act_t* rec_b = p.rec_b + int64_t(slot) * p.rec_b_slot_stride + int64_t(group) * CAP * N;
    const float* rec_dt = p.rec_dt + int64_t(slot) * p.rec_dt_slot_stride + int64_t(head) * CAP;
    RecordStager<act_t, ROWS, kRecords, kThreads> x_stage;
    RecordStager<act_t, N, kRecords, kThreads> b_stage;
    RowStager<act_t, N, 1, kThreads> q_stage;
    RowStager<act_t, ROWS, 1, kThreads> z_stage;
    x_stage.load_early(rec_x, P, x_cur, p.speculative);
    b_stage.load_early(rec_b, N, b_cur, p.speculative);
    q_stage.load(q, 0, 1);
    if constexpr (HAS_Z) z_stage.load(p.z + int64_t(row) * p.z_stride_b + int64_t(head) * p.z_stride_h + row0, 0, 1);

    int32_t* cursor = REPLAY ? slot_cursor(p.cursors, p.cursor_slot_stride, slot) : nullptr;
    const auto opened = open_step<REPLAY, L, CAP>(cursor);
    // A replay step's dt for this token beside the cursor load: read where it is staged, past the
    // held count, it waited a round trip for the cursor. (Not the conventional step's: it has no
    // cursor, and the early load cost it registers.)
    const float dt_token = REPLAY ? token_dt<HAS_DT_BIAS, DT_SOFTPLUS>(p, row, head) : 0.f;
    if (!opened.valid()) {  // a corrupted cursor: the row touches nothing
      fill_outputs<ROWS, kThreads>(out, fault_output());
      return;
    }
    const StepDecision d = opened.decide([&] { return p.flush_every_step || (kFlushMask && flush_masked(p, row)); });
    const int held = d.held, records = d.records;
    const bool flush = d.flush;
    const uint64_t epoch = (REPLAY && SR) ? uint64_t(d.epoch) : 0;
    // The held records from the rings at [0, n), this token's at [n], with their dt and log-decays
    // (and q, z).
    auto stage_records = [&](int n) {
      x_stage.load_late(rec_x, P, n, p.speculative);
      b_stage.load_late(rec_b, N, n, p.speculative);
      x_stage.store(sm.x, n);
      b_stage.store(sm.b, n);
      q_stage.store(sm.q, 0, 1);
      if constexpr (HAS_Z) z_stage.store(sm.z, 0, 1);
      for (int i = threadIdx.x; i <= n; i += kThreads) {
        const float dt = i != n ? rec_dt[i] : REPLAY ? dt_token : token_dt<HAS_DT_BIAS, DT_SOFTPLUS>(p, row, head);
        sm.dt[i] = dt;
        sm.log_decay[i] = dt * p.A[head];
      }
    };
    const float D = HAS_D ? p.D[head] : 0.f;
    // Steps 2-4 for n held records (this token's at [n]): staged, then their dots and decays,
    // then the per-row sums. Ends with a barrier.
    auto prepare = [&](int n) {
      stage_records(n);
      __syncthreads();
      const int count = n + 1;

      // 3. B_i . q (a warp per record) and the decays a(i+1:j) from suffix sums of log-decays.
      for (int i = warp; i < count; i += WARPS) {
        float acc = 0.f;
        for (int k = lane; k < N; k += 32) acc = fmaf(sm.b[i][k], sm.q[0][k], acc);
        acc = group_sum<32>(acc);
        if (lane == 0) sm.dot[i] = acc;
      }
      if (warp == 0) {
        const float total = suffix_decays(sm.log_decay, sm.decay, count);
        if (lane == 0) sm.total_decay = total;
      }
      __syncthreads();

      // 4. Per-row record sums, computed once per row rather than by every lane of the row.
      for (int r = threadIdx.x; r < ROWS; r += kThreads) {
        float extra = HAS_D ? D * sm.x[n][r] : 0.f;
        if (flush) {
          for (int i = 0; i < count; ++i) sm.x[i][r] *= sm.decay[i] * sm.dt[i];
        } else {
          for (int i = 0; i < count; ++i) extra = fmaf(sm.decay[i] * sm.dt[i] * sm.dot[i], sm.x[i][r], extra);
        }
        sm.extra[r] = extra;
      }
      __syncthreads();
    };
    prepare_token_records(prepare, REPLAY && p.flush_every_step, held);
    // (past prepare's barriers, which follow every thread's use of the cursor)
    const int arrival = REPLAY ? arrive_after_cursor_reads<SR>(cursor, p.flush_every_step, records) : -1;

    // 5. Rows (a separate-mode flush from the carried copy, loaded now).
    auto finish = [&](const auto& ck) {
      finish_rows(p, ck, out, flush, records, sm.total_decay, slot, epoch, head, row0, sm.q[0], sm.z[0],
                  sm.extra, &sm.x[0][0], &sm.b[0][0]);
    };
    if (kSeparate && flush) {  // (inline: through a helper such as rows_from the SASS of this flush moved)
      Copy<state_t> carried;
      carried.load(state_view(p), slot, p.num_heads, head, row0);
      finish(carried);
    } else {
      finish(read);
    }

    if constexpr (REPLAY) {
      if (!flush) {  // append this token's record at ring row `held` (exact: act -> float -> act)
        act_t* rx = p.rec_x + int64_t(slot) * p.rec_x_slot_stride + (int64_t(head) * CAP + held) * P + row0;
        for (int r = threadIdx.x; r < ROWS; r += kThreads) rx[r] = from_float<act_t>(sm.x[held][r]);
        if (split == 0) {
          if (threadIdx.x == 0) p.rec_dt[int64_t(slot) * p.rec_dt_slot_stride + int64_t(head) * CAP + held] = sm.dt[held];
          act_t* rb = p.rec_b + int64_t(slot) * p.rec_b_slot_stride + (int64_t(group) * CAP + held) * N;
          if (head % HPG == 0)
            for (int k = threadIdx.x; k < N; k += kThreads) rb[k] = from_float<act_t>(sm.b[held][k]);
        }
      }
      close_step<SR>(cursor, d, p.num_heads * kSplits, head == 0 && split == 0, p.flush_every_step, arrival);
    }
  }
};

}  // namespace replayssm::mamba2
