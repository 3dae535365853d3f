// Mamba-2 ReplaySSM step on the persistent streaming driver (common/stream.cuh), sm_90.
// Same math, records and cursor protocol as decode_kernel.cuh; an item is ROWS headdim rows of
// one (batch row, head), staged whole in shared memory by bulk copies.
#pragma once
#include "common/replay.cuh"
#include "common/stream.cuh"
#include "mamba2/decode_kernel.cuh"

namespace replayssm::mamba2 {

template <int P, int N, int HPG, int L, int CAP, int ROWS, int CWARPS, typename act_t, typename state_t, bool HAS_D,
          bool HAS_Z, bool HAS_DT_BIAS, bool DT_SOFTPLUS, bool SR>
struct Stream {
  using Params = mamba2::Params<act_t, state_t>;
  using Rows = StageRows<state_t, N, ROWS, CWARPS>;
  static constexpr int kConsumerWarps = CWARPS;
  static constexpr int kConsumers = CWARPS * 32;
  static constexpr int kSplits = P / ROWS;
  static constexpr int kSA = sizeof(act_t), kSS = sizeof(state_t);
  static_assert(P % ROWS == 0, "headdim must split into row tiles");
  static_assert((ROWS * N * kSS) % 16 == 0 && (ROWS * kSA) % 16 == 0 && (N * kSA) % 16 == 0,
                "bulk copies move whole 16-byte units");

  struct alignas(128) Stage {
    state_t s[ROWS * N];  // checkpoint rows
    act_t x[CAP][ROWS];   // held x records, this token's x at row `held`
    act_t b[CAP][N];      // held B records, this token's B at row `held`
    act_t c[N];           // this token's C
    act_t z[HAS_Z ? ROWS : 16 / kSA];
    float dt[CAP];        // held dt records, this token's raw dt at row `held`
  };
  struct Meta {
    int slot, held;  // held < 0: padded row
    uint32_t epoch;
    float A, D, dt_bias;
  };
  struct Scratch {
    float dt[CAP], log_decay[CAP], decay[CAP], dot[CAP];
    float total;
  };
  static constexpr int kStages = stream_stages(sizeof(Stage));

  static constexpr int kWindow = L;
  static __device__ __forceinline__ void write_zeros(const Params& p, int item) {
    const Item it(item, p.num_heads);
    act_t* out = p.out + (int64_t(it.row) * p.num_heads + it.head) * P + it.split * ROWS;
    for (int r = threadIdx.x; r < ROWS; r += kConsumers) out[r] = from_float<act_t>(0.f);
  }
  static __host__ __device__ __forceinline__ int items_per_row(const Params& p) { return p.num_heads * kSplits; }

  struct Item {
    int split, head, row, group;
    __device__ __forceinline__ Item(int item, int num_heads)
        : split(item % kSplits), head((item / kSplits) % num_heads), row(item / kSplits / num_heads),
          group(head / HPG) {}
  };

  static __device__ __forceinline__ void produce(const Params& p, int item, int slot, int held, Stage& st, Meta& meta,
                                                 uint64_t* full) {
    const Item it(item, p.num_heads);
    const int lane = threadIdx.x % 32, row0 = it.split * ROWS, num_groups = p.num_heads / HPG;
    if (lane == 0) {
      const uint32_t bytes = ROWS * N * kSS + (held + 1) * (ROWS + N) * kSA + N * kSA + (HAS_Z ? ROWS * kSA : 0);
      pipe::arrive_expect_bytes(full, bytes);
    }
    __syncwarp();
    const int64_t head_rec = int64_t(slot) * p.num_heads + it.head;
    if (lane == 0)
      pipe::bulk_copy(st.s, p.state + int64_t(slot) * p.state_slot_stride + (int64_t(it.head) * P + row0) * N,
                      ROWS * N * kSS, full);
    const act_t* rec_x = p.rec_x + head_rec * CAP * P + row0;
    if constexpr (ROWS == P) {
      if (lane == 1 && held > 0) pipe::bulk_copy(st.x, rec_x, held * P * kSA, full);
    } else {
      for (int i = lane; i < held; i += 32) pipe::bulk_copy(st.x[i], rec_x + i * P, ROWS * kSA, full);
    }
    if (lane == 2 && held > 0)
      pipe::bulk_copy(st.b, p.rec_b + (int64_t(slot) * num_groups + it.group) * CAP * N, held * N * kSA, full);
    if (lane == 3) pipe::bulk_copy(st.c, p.C + int64_t(it.row) * p.c_stride_b + int64_t(it.group) * p.c_stride_g,
                                   N * kSA, full);
    if (lane == 4)
      pipe::bulk_copy(st.x[held], p.x + int64_t(it.row) * p.x_stride_b + int64_t(it.head) * p.x_stride_h + row0,
                      ROWS * kSA, full);
    if (lane == 5) pipe::bulk_copy(st.b[held], p.B + int64_t(it.row) * p.b_stride_b + int64_t(it.group) * p.b_stride_g,
                                   N * kSA, full);
    if constexpr (HAS_Z)
      if (lane == 6)
        pipe::bulk_copy(st.z, p.z + int64_t(it.row) * p.z_stride_b + int64_t(it.head) * p.z_stride_h + row0,
                        ROWS * kSA, full);
    for (int i = lane; i < held; i += 32) pipe::copy_word(&st.dt[i], p.rec_dt + head_rec * CAP + i);
    if (lane == 31)
      pipe::copy_word(&st.dt[held], p.dt + int64_t(it.row) * p.dt_stride_b + int64_t(it.head) * p.dt_stride_h);
    if (lane == 30) pipe::copy_word(&meta.A, p.A + it.head);
    if (HAS_D && lane == 29) pipe::copy_word(&meta.D, p.D + it.head);
    if (HAS_DT_BIAS && lane == 28) pipe::copy_word(&meta.dt_bias, p.dt_bias + it.head);
    pipe::arrive_after_words(full);
  }

  static __device__ __forceinline__ void consume(const Params& p, int item, const Stage& st, const Meta& meta,
                                                 Scratch& sc, uint64_t* empty) {
    const Item it(item, p.num_heads);
    const int t = threadIdx.x, warp = t / 32, lane = t % 32, row0 = it.split * ROWS;
    const int held = meta.held, slot = meta.slot;
    act_t* out = p.out + (int64_t(it.row) * p.num_heads + it.head) * P + row0;
    const int records = held + 1;
    const bool flush = records >= L;

    // Checkpoint rows into registers first (every pass at once, for ILP).
    float s[Rows::kPasses][Rows::kChunks][Rows::kVec];
    Rows::load_all(st.s, s);

    // dt (this token's after bias and softplus), log-decays, suffix decays; B_i . C per record.
    if (warp == 0) {
      for (int i = lane; i < records; i += 32) {
        float dt = st.dt[i];
        if (i == held) {
          if constexpr (HAS_DT_BIAS) dt += meta.dt_bias;
          if constexpr (DT_SOFTPLUS) dt = dt > 20.f ? dt : log1pf(expf(dt));
        }
        sc.dt[i] = dt;
        sc.log_decay[i] = dt * meta.A;
      }
      __syncwarp();
      const float total = suffix_decays(sc.log_decay, sc.decay, records);
      if (lane == 0) sc.total = total;
    }
    for (int i = warp; i < records; i += CWARPS) {
      float acc = 0.f;
      for (int k = lane; k < N; k += 32) acc = fmaf(to_float(st.b[i][k]), to_float(st.c[k]), acc);
      acc = group_sum<32>(acc);
      if (lane == 0) sc.dot[i] = acc;
    }
    pipe::sync_threads(1, kConsumers);

    const float total = sc.total, D = HAS_D ? meta.D : 0.f;
    float q[Rows::kChunks][Rows::kVec];
    Rows::slice(st.c, q);
    // Lane l owns row own_row(l) of this warp for the record sums: consecutive lanes read
    // consecutive x entries of one record (no bank conflicts).
    const int mine = Rows::own_row();
    float extra = 0.f;  // non-flush: sum_i a(i+1:j) dt_i (B_i . C) x_i[mine]; both: + D x_j[mine]
    if (mine < ROWS) {
      if (!flush) {
        #pragma unroll 4
        for (int i = 0; i < records; ++i)
          extra = fmaf(sc.decay[i] * sc.dt[i] * sc.dot[i], to_float(st.x[i][mine]), extra);
      }
      extra = fmaf(D, to_float(st.x[held][mine]), extra);
    }
    const float z_mine = HAS_Z && mine < ROWS ? to_float(st.z[mine]) : 0.f;
    const uint32_t epoch = meta.epoch;
    if (!flush) {  // append this token's record at ring row `held` (exact copies, from the stage)
      const int64_t head_rec = int64_t(slot) * p.num_heads + it.head;
      act_t* rx = p.rec_x + (head_rec * CAP + held) * P + row0;
      for (int r = t; r < ROWS; r += kConsumers) rx[r] = st.x[held][r];
      if (it.split == 0) {
        if (t == 0) p.rec_dt[head_rec * CAP + held] = sc.dt[held];
        if (it.head % HPG == 0) {
          act_t* rb = p.rec_b + ((int64_t(slot) * (p.num_heads / HPG) + it.group) * CAP + held) * N;
          for (int k = t; k < N; k += kConsumers) rb[k] = st.b[held][k];
        }
      }
      release_stage(empty);  // the rest runs from registers (a flush still reads B, x)
    }
    float acc[Rows::kPasses];
    if (flush) {  // S <- a(1:j) S + sum_i (a(i+1:j) dt_i x_i[r]) B_i: exact FP32 FMAs
      #pragma unroll
      for (int pass = 0; pass < Rows::kPasses; ++pass)
        #pragma unroll
        for (int c = 0; c < Rows::kChunks; ++c)
          #pragma unroll
          for (int e = 0; e < Rows::kVec; ++e) s[pass][c][e] *= total;
      for (int i = 0; i < records; ++i) {
        const float coef = sc.decay[i] * sc.dt[i];
        float b[Rows::kChunks][Rows::kVec];
        Rows::slice(st.b[i], b);
        #pragma unroll
        for (int pass = 0; pass < Rows::kPasses; ++pass) {
          const int r = Rows::row(pass);
          const float w = r < ROWS ? coef * to_float(st.x[i][r]) : 0.f;
          #pragma unroll
          for (int c = 0; c < Rows::kChunks; ++c)
            #pragma unroll
            for (int e = 0; e < Rows::kVec; ++e) s[pass][c][e] = fmaf(w, b[c][e], s[pass][c][e]);
        }
      }
    }
    #pragma unroll
    for (int pass = 0; pass < Rows::kPasses; ++pass) {
      float a = 0.f;
      #pragma unroll
      for (int c = 0; c < Rows::kChunks; ++c)
        #pragma unroll
        for (int e = 0; e < Rows::kVec; ++e) a = fmaf(s[pass][c][e], q[c][e], a);
      acc[pass] = flush ? a : a * total;
    }
    #pragma unroll
    for (int pass = 0; pass < Rows::kPasses; ++pass) {
      const int r = Rows::row(pass);
      const int owner = Rows::owner_lane(pass);
      float y = group_sum<Rows::kLanesPerRow>(acc[pass]) + __shfl_sync(0xffffffffu, extra, owner);
      const float zr = __shfl_sync(0xffffffffu, z_mine, owner);
      if (flush && r < ROWS) {
        state_t* dst = p.state + int64_t(slot) * p.state_slot_stride + (int64_t(it.head) * P + row0 + r) * N;
        #pragma unroll
        for (int c = 0; c < Rows::kChunks; ++c)
          store_chunk<state_t, SR>(dst + Rows::col(c), s[pass][c], p.seed, (uint64_t(slot) << 32) | epoch,
                                   (uint64_t(it.head) * P + row0 + r) * N + Rows::col(c));
      }
      if (r < ROWS && Rows::row_leader()) {
        if constexpr (HAS_Z) y *= zr / (1.f + expf(-zr));
        out[r] = from_float<act_t>(y);
      }
    }

    if (flush) release_stage(empty);

  }
};

}  // namespace replayssm::mamba2
