// The split ReplaySSM step: a records kernel, then a state kernel. Framework-agnostic.
//
// The records kernel reads the cursor, replays every head's records into a few per-head scalars
// and per-row sums, and appends this token's record. The state kernel then streams the checkpoint
// with no latency chain in front of its rows (non-flush: y = total (S_c q) + extra), so its CTAs
// keep as many bytes in flight as the conventional step's. It is launched as a programmatic
// dependent of the records kernel (sm_90): its checkpoint reads start while the records kernel is
// still running, and it waits for the records only where it reads them. Past that wait no records
// CTA is left to read a cursor, so the state kernel advances the cursors with plain stores.
#pragma once
#include <cuda_runtime.h>
#include "common/step.cuh"

namespace replayssm {

// What the records kernel hands the state kernel, in one float buffer: per (batch row, head)
// extra [EXTRA] (per-row record sums), scalars [SCALARS] and coef [CAP] (a flush's record
// weights), each kind in its own array; then per batch row info [4] int32: the records kernel's
// decision (store_step, or a split verify's store_verify_row; common/step.cuh). `extra` comes
// first so that its rows stay 16-byte aligned.
template <int EXTRA, int SCALARS, int CAP>
struct SplitWorkspace {
  float* base;
  int64_t batch, heads;

  static constexpr int64_t floats(int64_t batch, int64_t heads) {
    return batch * (heads * (EXTRA + SCALARS + CAP) + 4);
  }
  __host__ __device__ float* extra(int row, int head) const {
    return base + (int64_t(row) * heads + head) * EXTRA;
  }
  __host__ __device__ float* scalars(int row, int head) const {
    return base + batch * heads * EXTRA + (int64_t(row) * heads + head) * SCALARS;
  }
  __host__ __device__ float* coef(int row, int head) const {
    return base + batch * heads * (EXTRA + SCALARS) + (int64_t(row) * heads + head) * CAP;
  }
  __host__ __device__ int32_t* info(int row) const {
    return reinterpret_cast<int32_t*>(base + batch * heads * (EXTRA + SCALARS + CAP)) + int64_t(row) * 4;
  }
};

// sm_90 per-SM limits (mirrored in replayssm_jit/spec.py).
constexpr int kThreadsPerSm = 2048, kRegistersPerSm = 64 * 1024;
constexpr size_t kSharedBytesPerSm = 227 * 1024, kSharedBytesReservedPerCta = 1024;

// CTAs of THREADS threads and SMEM_BYTES of shared memory that fit on one SM by shared memory
// and threads: a records kernel's launch bounds ask for this many, so that registers are never
// the tighter limit.
template <size_t SMEM_BYTES, int THREADS>
constexpr int shared_memory_resident_ctas() {
  const int by_smem = int(kSharedBytesPerSm / (SMEM_BYTES + kSharedBytesReservedPerCta));
  const int by_threads = kThreadsPerSm / THREADS;
  return by_smem < by_threads ? by_smem : by_threads;
}

// Whether CTAs of THREADS threads and SMEM_BYTES still fill an SM's threads.
template <size_t SMEM_BYTES, int THREADS>
constexpr bool fills_sm_threads() {
  return shared_memory_resident_ctas<SMEM_BYTES, THREADS>() == kThreadsPerSm / THREADS;
}

// A records kernel's held rows: ring rows 0..count-1 (LEN elements each) of HEADS heads, each
// head's CAP-row ring contiguous at `src`. Copied into shared memory `dst` ([HEADS][RING][LEN])
// where IN_SHARED; otherwise one thread per head prefetches them into L2 for the later loads.
template <bool IN_SHARED, typename T, int LEN, int HEADS, int RING, int CAP, int THREADS>
__device__ __forceinline__ void stage_held_rows(T* dst, const T* src, int count) {
  if constexpr (IN_SHARED) {
    copy_columns_async<T, LEN, HEADS, THREADS>(dst, RING * LEN, LEN, src, CAP * LEN, LEN, count);
  } else if constexpr ((LEN * sizeof(T)) % 16 == 0) {
    if (threadIdx.x < HEADS) pipe::prefetch_l2(src + threadIdx.x * CAP * LEN, uint32_t(count) * LEN * sizeof(T));
  }
}

// Records kernel on (groups, batch) CTAs, then the state kernel on (heads x row splits, batch)
// CTAs as its programmatic dependent (where the device supports it). `overlap_prior`: the records
// kernel is a programmatic dependent of the stream's previous kernel too.
template <class Records, class State>
cudaError_t launch_split(const typename State::Params& p, int batch, int num_groups, int num_heads, bool overlap_prior,
                         cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  DeviceFacts facts;  // one device lookup for both kernels
  if (cudaError_t err = DeviceFacts::current(facts); err != cudaSuccess) return err;
  if (cudaError_t err = allow_shared_memory<Records>(facts.device); err != cudaSuccess) return err;
  if (cudaError_t err = allow_shared_memory<State>(facts.device); err != cudaSuccess) return err;
  if (cudaError_t err = launch_dependent<Records>(p, dim3(num_groups, batch), overlap_prior && facts.major >= 9, stream);
      err != cudaSuccess)
    return err;
  return launch_dependent<State>(p, dim3(num_heads * State::kSplits, batch), facts.major >= 9, stream);
}

}  // namespace replayssm
