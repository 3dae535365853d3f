// Persistent, warp-specialised driver for the streaming ReplaySSM step (sm_90).
//
// Work items are (batch row, head, row split), handed out round-robin over a grid sized to
// the SMs. A producer warp fills a ring of shared-memory stages with bulk copies (checkpoint
// rows, held records, this token's inputs) as far ahead as the ring allows; the consumer
// warps replay each item from shared memory. The checkpoint reads of later items so overlap
// the record arithmetic of earlier ones, which the one-CTA-per-item kernels cannot do.
//
// A family F provides Params, Stage, Meta (with slot, held, epoch), Scratch, kStages,
// kConsumerWarps, kWindow (L: an item flushes when held + 1 >= L), items_per_row(p) and
//   produce(params, item, slot, held, stage, meta, full): one producer warp, for a real slot
//     (the driver fills meta's slot, held and epoch); ends with every lane arriving on `full`
//     through pipe::arrive_after_words, and lane 0 with pipe::arrive_expect_bytes;
//   consume(params, item, stage, meta, scratch, empty): the consumer warps, for a real slot,
//     with one barrier (id 1) after writing scratch and none at the end (scratch alternates
//     between items); each warp arrives on `empty` once it no longer reads the stage or meta;
//   write_zeros(params, item): the consumer warps' output for a padded row.
// The driver handles padded rows and the cursor arrivals.
#pragma once
#include "common/dtype.cuh"
#include "common/pipeline.cuh"
#include "common/replay.cuh"

namespace replayssm {

// An item's arrival on its slot's cursor (word 2 counts arrivals; the last of a row advances
// words 0 and 1). The atomic's result is only looked at when the next item arrives (or the CTA
// ends), so its round trip overlaps that item's work instead of stalling the consumers. No
// fence: this launch never reads a cursor again once its whole row has arrived.
struct CursorArrival {
  int32_t* cursor = nullptr;
  int arrived = 0, count = 0, records = 0;
  bool flush = false;
  __device__ __forceinline__ void finish() {
    if (cursor != nullptr && arrived == count - 1) advance_slot_cursor(cursor, flush, records);
    cursor = nullptr;
  }
  __device__ __forceinline__ void start(int32_t* slot_cursor, int items_per_row, bool flushed, int new_records) {
    finish();
    cursor = slot_cursor;
    count = items_per_row;
    flush = flushed;
    records = new_records;
    arrived = atomicAdd(slot_cursor + 2, 1);
  }
};

// Each consumer warp's release of a stage it has finished reading.
__device__ __forceinline__ void release_stage(uint64_t* empty) {
  __syncwarp();
  if (threadIdx.x % 32 == 0) pipe::arrive(empty);
}

// Stages per CTA: as many as ~108 KiB holds (two CTAs per SM), at least 2, at most 8.
constexpr int stream_stages(size_t stage_bytes) {
  const size_t n = (108 * 1024) / stage_bytes;
  return n < 2 ? 2 : (n > 8 ? 8 : int(n));
}

template <class F>
struct StreamSmem {
  typename F::Stage stage[F::kStages];
  typename F::Meta meta[F::kStages];
  uint64_t full[F::kStages];
  uint64_t empty[F::kStages];
  typename F::Scratch scratch[2];  // alternate items: a fast warp may start the next item's
                                   // scratch while a slow one still reads this item's
};

template <class F>
__global__ void __launch_bounds__(F::kConsumerWarps * 32 + 32, 2)  // two CTAs per SM
    stream_kernel(const typename F::Params p, int num_items) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // bulk copies need sm_90; the Python side never picks this kernel below it
#else
  extern __shared__ __align__(128) unsigned char stream_smem[];
  auto& sm = *reinterpret_cast<StreamSmem<F>*>(stream_smem);
  const int warp = threadIdx.x / 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < F::kStages; ++s) {
      pipe::barrier_init(&sm.full[s], 32 + 1);  // every producer lane's words, plus lane 0's bytes
      pipe::barrier_init(&sm.empty[s], F::kConsumerWarps);
    }
    pipe::fence_barrier_init();
  }
  __syncthreads();

  pipe::Ring<F::kStages> ring;
  if (warp == F::kConsumerWarps) {
    // Slot ids and cursors of the next 32 items are read together (lane j: item j), so the
    // dependent loads cost one round trip per 32 items instead of two per item. Safe: a row's
    // cursor only advances after every item of the row has been consumed.
    const int lane = threadIdx.x % 32;
    for (int first = blockIdx.x; first < num_items; first += 32 * gridDim.x) {
      const int mine = first + lane * gridDim.x;
      int slot = p.pad_slot_id, held = -1, epoch = 0;
      if (mine < num_items) {
        slot = p.slot_indices[mine / F::items_per_row(p)];
        if (slot != p.pad_slot_id) {
          const int32_t* cursor = p.cursors + int64_t(slot) * kCursorWords;
          held = cursor[0];
          epoch = cursor[1];
        }
      }
      const int count = min(32, (num_items - first + int(gridDim.x) - 1) / int(gridDim.x));
      for (int j = 0; j < count; ++j, ring.next()) {
        const int item_slot = __shfl_sync(0xffffffffu, slot, j);
        const int item_held = __shfl_sync(0xffffffffu, held, j);
        const int item_epoch = __shfl_sync(0xffffffffu, epoch, j);
        auto& meta = sm.meta[ring.stage];
        uint64_t* full = &sm.full[ring.stage];
        pipe::wait(&sm.empty[ring.stage], ring.parity ^ 1u);  // the first use of a stage passes at once
        if (lane == 0) {
          meta.slot = item_slot;
          meta.held = item_slot == p.pad_slot_id ? -1 : item_held;
          meta.epoch = uint32_t(item_epoch);
        }
        if (item_slot == p.pad_slot_id) {  // nothing to copy: the consumers write zeros
          if (lane == 0) pipe::arrive(full);
          pipe::arrive_after_words(full);
        } else {
          F::produce(p, first + j * gridDim.x, item_slot, item_held, sm.stage[ring.stage], meta, full);
        }
      }
    }
  } else {
    CursorArrival arrival;
    int which = 0;
    for (int item = blockIdx.x; item < num_items; item += gridDim.x, ring.next(), which ^= 1) {
      uint64_t* empty = &sm.empty[ring.stage];
      pipe::wait(&sm.full[ring.stage], ring.parity);
      const int slot = sm.meta[ring.stage].slot, held = sm.meta[ring.stage].held;  // the stage may be refilled
      if (held < 0) {  // padded row: zero output, touch nothing else
        F::write_zeros(p, item);
        release_stage(empty);
        continue;
      }
      F::consume(p, item, sm.stage[ring.stage], sm.meta[ring.stage], sm.scratch[which], empty);
      if (threadIdx.x == 0)
        arrival.start(p.cursors + int64_t(slot) * kCursorWords, F::items_per_row(p), held + 1 >= F::kWindow,
                      held + 1);
    }
    arrival.finish();
  }
#endif
}

// Consumer view of a stage's [ROWS, COLS] state rows: each lane reads 16-byte chunks of one
// row, kLanesPerRow lanes a row; warps interleave by kRowsPerPass. Rows past ROWS (last pass)
// compute with zeros and must not be written.
template <typename state_t, int COLS, int ROWS, int WARPS>
struct StageRows {
  static constexpr int kVec = 16 / sizeof(state_t);
  static constexpr int kLanesPerRow = (COLS / kVec) < 32 ? (COLS / kVec) : 32;
  static constexpr int kChunks = COLS / (kVec * kLanesPerRow);
  static constexpr int kRowsPerPass = 32 / kLanesPerRow;
  static constexpr int kPasses = (ROWS + WARPS * kRowsPerPass - 1) / (WARPS * kRowsPerPass);
  static_assert(COLS % kVec == 0 && (kLanesPerRow & (kLanesPerRow - 1)) == 0, "state rows must tile 16-byte chunks");

  static __device__ __forceinline__ int row(int pass) {
    return (pass * WARPS + threadIdx.x / 32) * kRowsPerPass + (threadIdx.x % 32) / kLanesPerRow;
  }
  static __device__ __forceinline__ int col(int chunk) {
    return (chunk * kLanesPerRow + (threadIdx.x % 32) % kLanesPerRow) * kVec;
  }
  static __device__ __forceinline__ int lane_in_row() { return (threadIdx.x % 32) % kLanesPerRow; }
  static __device__ __forceinline__ bool row_leader() { return lane_in_row() == 0; }
  // Per-row work spread one row per lane: lane l owns the warp's row of pass l / kRowsPerPass
  // (ROWS or more: none), and owner_lane(pass) is the lane that owns this lane's row of `pass`.
  static_assert(kPasses * kRowsPerPass <= 32, "a warp's rows must fit one per lane");
  static __device__ __forceinline__ int own_row() {
    const int lane = threadIdx.x % 32, pass = lane / kRowsPerPass;
    return pass < kPasses ? (pass * WARPS + threadIdx.x / 32) * kRowsPerPass + lane % kRowsPerPass : ROWS;
  }
  static __device__ __forceinline__ int owner_lane(int pass) {
    return pass * kRowsPerPass + (threadIdx.x % 32) / kLanesPerRow;
  }
  // This lane's chunks of row r as floats (zeros past ROWS).
  static __device__ __forceinline__ void load(const state_t* rows, int r, float (&out)[kChunks][kVec]) {
    #pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      Vec16<state_t> v;
      if (r < ROWS) v.load(rows + r * COLS + col(c));
      #pragma unroll
      for (int e = 0; e < kVec; ++e) out[c][e] = r < ROWS ? v.get(e) : 0.f;
    }
  }
  // Every pass of this lane's rows, as floats.
  static __device__ __forceinline__ void load_all(const state_t* rows, float (&out)[kPasses][kChunks][kVec]) {
    #pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) load(rows, row(pass), out[pass]);
  }
  // This lane's chunks of a length-COLS vector of T in shared memory, as floats.
  template <typename T>
  static __device__ __forceinline__ void slice(const T* v, float (&out)[kChunks][kVec]) {
    #pragma unroll
    for (int c = 0; c < kChunks; ++c)
      #pragma unroll
      for (int e = 0; e < kVec; ++e) out[c][e] = to_float(v[col(c) + e]);
  }
};


template <class F>
cudaError_t launch_stream(const typename F::Params& p, int batch, int ctas_per_sm_cap, cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  auto kernel = stream_kernel<F>;
  constexpr int kThreads = F::kConsumerWarps * 32 + 32;
  constexpr size_t kSmem = sizeof(StreamSmem<F>);
  static int ctas = 0;  // per instantiation: CTAs that fit on the device's SMs
  if (ctas == 0) {
    int device = 0, sms = 0, per_sm = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err == cudaSuccess) err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem));
    if (err == cudaSuccess) err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, kSmem);
    if (err != cudaSuccess) return err;
    if (per_sm < 1) return cudaErrorInvalidConfiguration;
    ctas = sms * (per_sm < ctas_per_sm_cap ? per_sm : ctas_per_sm_cap);
  }
  const int num_items = batch * F::items_per_row(p);
  const int grid = num_items < ctas ? num_items : ctas;
  kernel<<<grid, kThreads, kSmem, stream>>>(p, num_items);
  return cudaGetLastError();
}

}  // namespace replayssm
