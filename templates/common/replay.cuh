// Building blocks shared by the ReplaySSM decode kernels (Mamba-2, GDN).
#pragma once
#include <type_traits>
#include "common/dtype.cuh"
#include "common/fp8.cuh"
#include "common/pipeline.cuh"
#include "common/reduce.cuh"
#include "common/rounding.cuh"

namespace replayssm {

// Lanes that share a state row: one per 16-byte chunk up to 32 (WIDE), else the fewest of 8 and
// 16 that split a warp's rows into whole passes (falling back to WIDE). Narrow rows mean shorter
// shuffle reductions and fewer passes, while each load instruction still covers whole 128-byte
// lines of a row; wide rows keep fewer values (of q, B, k) per lane. Mirrored by launch.tiles.lanes_per_row.
template <int COLS_VECS, int ROWS_PER_WARP, bool WIDE>
constexpr int lanes_per_row() {
  if (!WIDE)
    for (int lanes = 8; lanes < 32; lanes *= 2)
      if (lanes <= COLS_VECS && ROWS_PER_WARP % (32 / lanes) == 0) return lanes;
  return COLS_VECS < 32 ? COLS_VECS : 32;
}

// A CTA's ROWS rows of a per-head [*, COLS] state, held in registers: kLanesPerRow lanes share a
// row, each holding kChunksPerLane 16-byte chunks; a warp covers kRowsPerPass rows per pass and
// kPasses passes. A lane's rows are consecutive (pass-major), so per-row vectors in shared memory
// can be read a few rows at a time.
template <typename state_t, int COLS, int ROWS, int WARPS, bool WIDE>
struct RowTiling {
  static constexpr int kThreads = WARPS * 32;
  static constexpr int kCols = COLS;
  static constexpr int kVec = kChunkValues<state_t>;  // values per 16-byte chunk
  static constexpr int kPack = kValuesPerElement<state_t>;
  static constexpr int kRowsPerWarp = ROWS / WARPS;
  static constexpr int kLanesPerRow = lanes_per_row<COLS / kVec, kRowsPerWarp, WIDE>();
  static constexpr int kChunksPerLane = COLS / (kVec * kLanesPerRow);
  static constexpr int kRowsPerPass = 32 / kLanesPerRow;
  static constexpr int kPasses = kRowsPerWarp / kRowsPerPass;
  static_assert(COLS % kVec == 0 && (kLanesPerRow & (kLanesPerRow - 1)) == 0, "state rows must tile 16-byte chunks");
  static_assert(ROWS % WARPS == 0 && kRowsPerWarp % kRowsPerPass == 0, "bad row tiling");

  using Regs = Vec16<state_t>[kPasses][kChunksPerLane];

  static __device__ __forceinline__ int row(int pass) {  // CTA-local row of this lane in a pass
    return (threadIdx.x / 32) * kRowsPerWarp + ((threadIdx.x % 32) / kLanesPerRow) * kPasses + pass;
  }
  static __device__ __forceinline__ int col(int chunk) {
    return (chunk * kLanesPerRow + (threadIdx.x % 32) % kLanesPerRow) * kVec;
  }
  static __device__ __forceinline__ bool row_leader() { return (threadIdx.x % 32) % kLanesPerRow == 0; }

  // Issue every 16-byte load of the CTA's rows at once (rows start at `rows`).
  static __device__ __forceinline__ void load(const state_t* rows, Regs& regs) {
    #pragma unroll
    for (int i = 0; i < kPasses; ++i)
      #pragma unroll
      for (int c = 0; c < kChunksPerLane; ++c) regs[i][c].load(rows + (int64_t(row(i)) * COLS + col(c)) / kPack);
  }

  // This lane's slice of a length-COLS vector held in shared memory (FP32 or as stored).
  template <typename T>
  static __device__ __forceinline__ void slice(const T* v, float (&out)[kChunksPerLane][kVec]) {
    #pragma unroll
    for (int c = 0; c < kChunksPerLane; ++c) chunk(v, c, out[c]);
  }
  // Chunk c of that slice.
  template <typename T>
  static __device__ __forceinline__ void chunk(const T* v, int c, float (&out)[kVec]) {
    #pragma unroll
    for (int e = 0; e < kVec; ++e) out[e] = to_float(v[col(c) + e]);
  }

  // `value` into this lane's rows of a length-ROWS output (its row leader writes).
  template <typename T>
  static __device__ __forceinline__ void fill_rows(T* out, float value) {
    #pragma unroll
    for (int i = 0; i < kPasses; ++i)
      if (row_leader()) out[row(i)] = from_float<T>(value);
  }

  // This lane's part of a state row's dot product with a sliced vector: FP32 FMAs in chunk order,
  // to be summed over the row's lanes (group_sum<kLanesPerRow>).
  static __device__ __forceinline__ float dot(const float (&s)[kChunksPerLane][kVec],
                                              const float (&v)[kChunksPerLane][kVec]) {
    float acc = 0.f;
    #pragma unroll
    for (int c = 0; c < kChunksPerLane; ++c)
      #pragma unroll
      for (int e = 0; e < kVec; ++e) acc = fmaf(s[c][e], v[c][e], acc);
    return acc;
  }
  // Two such dots from one pass over the row.
  static __device__ __forceinline__ void dot2(const float (&s)[kChunksPerLane][kVec], const float (&a)[kChunksPerLane][kVec],
                                              const float (&b)[kChunksPerLane][kVec], float& sa, float& sb) {
    sa = 0.f, sb = 0.f;
    #pragma unroll
    for (int c = 0; c < kChunksPerLane; ++c)
      #pragma unroll
      for (int e = 0; e < kVec; ++e) {
        sa = fmaf(s[c][e], a[c][e], sa);
        sb = fmaf(s[c][e], b[c][e], sb);
      }
  }

  // This lane's rows' entries of a length-ROWS vector in shared memory (16-byte aligned when
  // FP32): its rows are consecutive, so FP32 ones load four at a time.
  template <typename T>
  static __device__ __forceinline__ void row_values(const T* v, float (&out)[kPasses]) {
    if constexpr (sizeof(T) == 4 && kPasses % 4 == 0) {
      #pragma unroll
      for (int i = 0; i < kPasses; i += 4) {
        const float4 f = *reinterpret_cast<const float4*>(v + row(i));
        out[i] = f.x, out[i + 1] = f.y, out[i + 2] = f.z, out[i + 3] = f.w;
      }
    } else {
      #pragma unroll
      for (int i = 0; i < kPasses; ++i) out[i] = to_float(v[row(i)]);
    }
  }
};

// Largest vector width (bytes, <= 16) that divides a row of LEN elements of T.
template <typename T, int LEN>
constexpr int row_vector_bytes() {
  constexpr int bytes = LEN * int(sizeof(T));
  return bytes % 16 == 0 ? 16 : bytes % 8 == 0 ? 8 : bytes % 4 == 0 ? 4 : int(sizeof(T));
}

template <int BYTES> struct RawVec;
template <> struct RawVec<16> { using type = uint4; };
template <> struct RawVec<8> { using type = uint2; };
template <> struct RawVec<4> { using type = uint32_t; };
template <> struct RawVec<2> { using type = unsigned short; };

// Stages up to MAX_ROWS rows of LEN elements of T from global into float shared memory: load()
// issues every load (one memory round trip for the lot), store() converts and writes them.
// Splitting the two lets a kernel issue ring loads before it knows how many rows it needs.
// BYTES: vector width, which the rows' start addresses must be aligned to.
template <typename T, int LEN, int MAX_ROWS, int THREADS, int BYTES = row_vector_bytes<T, LEN>()>
struct RowStager {
  static constexpr int kBytes = BYTES;
  static constexpr int kElems = kBytes / int(sizeof(T));
  static constexpr int kPerRow = LEN / kElems;
  static constexpr int kIters = (MAX_ROWS * kPerRow + THREADS - 1) / THREADS;
  using Raw = typename RawVec<kBytes>::type;
  Raw raw[kIters];

  // Rows 0..count-1 from src + i * stride.
  __device__ __forceinline__ void load(const T* src, int64_t stride, int count) {
    #pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int idx = it * THREADS + threadIdx.x, i = idx / kPerRow, part = idx % kPerRow;
      if (i < count) raw[it] = reinterpret_cast<const Raw*>(src + int64_t(i) * stride)[part];
    }
  }
  // Rows 0..count-1 into dst[first + i].
  __device__ __forceinline__ void store(float (*dst)[LEN], int first, int count) const {
    #pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int idx = it * THREADS + threadIdx.x, i = idx / kPerRow, part = idx % kPerRow;
      if (i < count) {
        const T* e = reinterpret_cast<const T*>(&raw[it]);
        #pragma unroll
        for (int k = 0; k < kElems; ++k) dst[first + i][part * kElems + k] = to_float(e[k]);
      }
    }
  }
};

// Asynchronous copy of `heads` x `count` rows of LEN elements of T into shared memory: row
// (h, i) from src + h * src_head + i * src_row to dst + h * dst_head + i * dst_row (element
// strides; every row aligned to the widest vector that divides it). Complete with
// pipe::wait_copies() and a barrier.
template <typename T, int LEN, int THREADS>
__device__ __forceinline__ void copy_rows_async(T* dst, int64_t dst_head, int64_t dst_row, const T* src, int64_t src_head,
                                                int64_t src_row, int heads, int count) {
  constexpr int kBytes = row_vector_bytes<T, LEN>();
  constexpr int kPerRow = LEN * int(sizeof(T)) / kBytes;
  for (int idx = threadIdx.x; idx < heads * count * kPerRow; idx += THREADS) {
    const int part = idx % kPerRow, i = idx / kPerRow % count, h = idx / kPerRow / count;
    const char* from = reinterpret_cast<const char*>(src + h * src_head + i * src_row) + part * kBytes;
    char* to = reinterpret_cast<char*>(dst + h * dst_head + i * dst_row) + part * kBytes;
    if constexpr (kBytes >= 4) {
      pipe::copy_async<kBytes>(to, from);
    } else {
      *reinterpret_cast<T*>(to) = *reinterpret_cast<const T*>(from);
    }
  }
}

// Asynchronous copy of rows 0..count-1 of HEADS heads (as copy_rows_async), each thread on fixed
// 16-byte columns: THREADS / (HEADS x chunks per row) thread groups take every group-th row, so a
// row costs a copy and two adds rather than an index split (a records CTA's main cost otherwise).
template <typename T, int LEN, int HEADS, int THREADS>
__device__ __forceinline__ void copy_columns_async(T* dst, int64_t dst_head, int64_t dst_row, const T* src,
                                                   int64_t src_head, int64_t src_row, int count) {
  constexpr int kBytes = row_vector_bytes<T, LEN>();
  constexpr int kPerRow = LEN * int(sizeof(T)) / kBytes;
  constexpr int kColumns = HEADS * kPerRow;
  constexpr int kGroups = kColumns < THREADS ? THREADS / kColumns : 1;
  for (int t = threadIdx.x; t < kColumns * kGroups; t += THREADS) {
    const int column = t % kColumns, group = t / kColumns;
    const int h = column / kPerRow, part = column % kPerRow;
    const char* from = reinterpret_cast<const char*>(src + h * src_head + group * src_row) + part * kBytes;
    char* to = reinterpret_cast<char*>(dst + h * dst_head + group * dst_row) + part * kBytes;
    for (int i = group; i < count; i += kGroups) {
      if constexpr (kBytes >= 4) {
        pipe::copy_async<kBytes>(to, from);
      } else {
        *reinterpret_cast<T*>(to) = *reinterpret_cast<const T*>(from);
      }
      from += kGroups * src_row * int64_t(sizeof(T));
      to += kGroups * dst_row * int64_t(sizeof(T));
    }
  }
}

// Stores HEADS rows of LEN elements of T from shared memory (src + h * src_head) to global
// memory (dst + h * dst_head), in the widest vectors that divide a row.
template <typename T, int LEN, int HEADS, int THREADS>
__device__ __forceinline__ void store_rows(T* dst, int64_t dst_head, const T* src, int64_t src_head) {
  constexpr int kBytes = row_vector_bytes<T, LEN>();
  constexpr int kPerRow = LEN * int(sizeof(T)) / kBytes;
  using Raw = typename RawVec<kBytes>::type;
  for (int idx = threadIdx.x; idx < HEADS * kPerRow; idx += THREADS) {
    const int h = idx / kPerRow, part = idx % kPerRow;
    reinterpret_cast<Raw*>(dst + h * dst_head)[part] = reinterpret_cast<const Raw*>(src + h * src_head)[part];
  }
}

// Largest power-of-two count of consecutive elements (<= 4) a thread takes of rows of LEN, so
// that COUNT elements spread over at most about THREADS threads.
template <int LEN, int COUNT, int THREADS>
constexpr int elements_per_thread() {
  int vec = 1;
  while (vec < 4 && LEN % (2 * vec) == 0 && COUNT / vec > THREADS) vec *= 2;
  return vec;
}

// A token's records: the held ones from a ring (rows 0..held-1) and this token's from the inputs
// (row `held`). With `speculative`, the ring loads are issued before the cursor is read (all
// CAP-1 rows: more bytes, one dependent round trip less; worth it when latency dominates).
template <typename T, int LEN, int CAP, int THREADS>
struct RecordStager {
  RowStager<T, LEN, (CAP > 1 ? CAP - 1 : 1), THREADS> ring;
  RowStager<T, LEN, 1, THREADS> current;
  __device__ __forceinline__ void load_early(const T* ring_rows, int64_t stride, const T* cur, bool speculative) {
    current.load(cur, 0, 1);
    if (CAP > 1 && speculative) ring.load(ring_rows, stride, CAP - 1);
  }
  __device__ __forceinline__ void load_late(const T* ring_rows, int64_t stride, int held, bool speculative) {
    if (CAP > 1 && !speculative) ring.load(ring_rows, stride, held);
  }
  __device__ __forceinline__ void store(float (*dst)[LEN], int held) const {
    if (CAP > 1) ring.store(dst, 0, held);
    current.store(dst, held, 1);
  }
};

// Runs prepare(n), which stages a token's records (the held ones at [0, n), this token's at [n])
// and whatever the kernel forms from them, for n = held; where n != held, prepare must end with a
// barrier, as its shared memory is staged again. Where `zero_first` (flush_every_step, whose
// steady state holds none), first for n = 0 without waiting for the cursor read, then again only
// if records are held after all, so the cursor's round trip overlaps that work. Mamba-2 prepares
// its dots, decays and row sums inside; GDN only stages there (faster for each).
template <class Prepare>
__device__ __forceinline__ void prepare_token_records(Prepare&& prepare, bool zero_first, int held) {
  #pragma unroll 1
  for (int n = zero_first ? 0 : held;; n = held) {
    prepare(n);
    if (n == held) break;
  }
}

__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// Inclusive suffix sum over a warp's lanes: lane l gets the sum of la over lanes l..31.
__device__ __forceinline__ float warp_suffix_sum(float la) {
  const int lane = threadIdx.x % 32;
  float suffix = la;
  #pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const float other = __shfl_down_sync(0xffffffffu, suffix, offset);
    if (lane + offset < 32) suffix += other;
  }
  return suffix;
}

// decay[i] = exp(sum_{m>i} log_decay[m]) for i < count, and returns exp(sum of all), in FP32.
// One warp; log_decay and decay live in shared memory. Chunks of 32 records, top down.
__device__ __forceinline__ float suffix_decays(const float* log_decay, float* decay, int count) {
  const int lane = threadIdx.x % 32;
  float carry = 0.f;
  for (int top = count; top > 0; top -= 32) {
    const int i = top - 32 + lane;
    const float la = i >= 0 ? log_decay[i] : 0.f;
    const float suffix = warp_suffix_sum(la);  // within the chunk
    if (i >= 0) decay[i] = expf(carry + suffix - la);
    carry += __shfl_sync(0xffffffffu, suffix, 0);
  }
  return expf(carry);
}

// suffix_decays for count <= 32, with this lane's log-decay in a register: lane l holds record
// i = count - 32 + l (la = 0 for i < 0). Sets decay_i to record i's decay and returns exp(sum of
// all): the same arithmetic, in the same order, without the shared-memory round trips.
__device__ __forceinline__ float suffix_decay_lane(float la, float& decay_i) {
  const float suffix = warp_suffix_sum(la);
  decay_i = expf(0.f + suffix - la);  // suffix_decays' first chunk, carry 0
  return expf(0.f + __shfl_sync(0xffffffffu, suffix, 0));
}

// The stochastic-rounding key of a slot's checkpoint at a flush epoch (0 without SR): formed
// once per CTA, before the stores.
template <bool SR>
__device__ __forceinline__ uint64_t checkpoint_rounding_key(uint64_t seed, int slot, uint64_t epoch) {
  return SR ? rounding_key(seed, (uint64_t(slot) << 32) | epoch) : 0;
}

// VEC values as T at dst (VEC * sizeof(T) bytes, naturally aligned), rounded to nearest or, where
// SR, stochastically (key: the copy's rounding key; element: the first value's index in the slot,
// even). e4m3 encodes value * inverse (the row's inverse scale), saturating.
template <typename T, bool SR, int VEC>
__device__ __forceinline__ void store_values(T* dst, const float (&v)[VEC], uint64_t key, uint64_t element,
                                             float inverse = 1.f) {
  constexpr int kBytes = VEC * int(sizeof(T));
  typename RawVec<kBytes>::type raw;
  T* out = reinterpret_cast<T*>(&raw);
  if constexpr (std::is_same_v<T, e4m3>) {
    static_assert(VEC % 2 == 0, "e4m3 codes are formed in pairs");
    #pragma unroll
    for (int e = 0; e < VEC; e += 2) {
      float a = v[e] * inverse, b = v[e + 1] * inverse;
      if constexpr (SR) {  // to exact e4m3 values, which the conversion below keeps
        const uint32_t bits = pair_bits(key, static_cast<uint32_t>((element + e) >> 1));
        a = fp8::sr_value(a, bits & 0xffffu);
        b = fp8::sr_value(b, bits >> 16);
      }
      reinterpret_cast<__nv_fp8x2_storage_t*>(out)[e / 2] =
          __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
    }
  } else if constexpr (SR && !std::is_same_v<T, float>) {
    static_assert(VEC % 2 == 0, "stochastic rounding draws bits for pairs of elements");
    #pragma unroll
    for (int e = 0; e < VEC; e += 2) {
      const uint32_t bits = pair_bits(key, static_cast<uint32_t>((element + e) >> 1));
      out[e] = round_stochastic<T>(v[e], bits & 0xffffu);
      out[e + 1] = round_stochastic<T>(v[e + 1], bits >> 16);
    }
  } else {
    #pragma unroll
    for (int e = 0; e < VEC; ++e) out[e] = from_float<T>(v[e]);
  }
  *reinterpret_cast<typename RawVec<kBytes>::type*>(dst) = raw;
}

// CTAs per SM a kernel struct asks the register allocator to allow (Kern::kMinBlocks; 0, no
// request, otherwise: an explicit 1 changes the allocation).
template <class Kern, class = void>
struct MinBlocks {
  static constexpr int value = 0;
};
template <class Kern>
struct MinBlocks<Kern, std::void_t<decltype(Kern::kMinBlocks)>> {
  static constexpr int value = Kern::kMinBlocks;
};

// One CTA per item (the launcher sets the grid) for a kernel struct Kern with Params, Smem,
// kThreads and run(params, smem).
template <class Kern>
__global__ void __launch_bounds__(Kern::kThreads, MinBlocks<Kern>::value) per_item_kernel(const typename Kern::Params p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Kern::run(p, *reinterpret_cast<typename Kern::Smem*>(smem_raw));
}

// Per-device facts the launchers need, looked up once per device (devices 0-63; others every call).
struct DeviceFacts {
  int device = 0, major = 0;
  static cudaError_t current(DeviceFacts& facts) {
    static int majors[64] = {};
    if (cudaError_t err = cudaGetDevice(&facts.device); err != cudaSuccess) return err;
    int* cached = facts.device < 64 ? &majors[facts.device] : nullptr;
    if (cached != nullptr && *cached != 0) {
      facts.major = *cached;
      return cudaSuccess;
    }
    cudaError_t err = cudaDeviceGetAttribute(&facts.major, cudaDevAttrComputeCapabilityMajor, facts.device);
    if (err == cudaSuccess && cached != nullptr) *cached = facts.major;
    return err;
  }
};

// Lets per_item_kernel<Kern> use more than 48 KiB of dynamic shared memory on `device` (a
// function attribute is per device; set once per instantiation and device, devices 0-63).
template <class Kern>
cudaError_t allow_shared_memory(int device) {
  if (Kern::kSmemBytes <= 48 * 1024) return cudaSuccess;
  static uint64_t raised = 0;  // bit d: set on device d
  const uint64_t bit = device < 64 ? uint64_t(1) << device : 0;
  if (bit == 0 || !(raised & bit)) {
    cudaError_t err = cudaFuncSetAttribute(per_item_kernel<Kern>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           int(Kern::kSmemBytes));
    if (err != cudaSuccess) return err;
    raised |= bit;
  }
  return cudaSuccess;
}

// Programmatic dependent launch (sm_90; no-ops elsewhere and when launched without the attribute).
__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_dependent_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Launches per_item_kernel<Kern> on `grid`, as a programmatic dependent of the stream's previous
// kernel where `programmatic` (sm_90+): its CTAs may then be scheduled while that kernel's last
// ones still run, and each waits (wait_for_prior_grid) before reading what it wrote.
template <class Kern>
cudaError_t launch_dependent(const typename Kern::Params& p, dim3 grid, bool programmatic, cudaStream_t stream) {
  cudaLaunchAttribute overlap[1];
  overlap[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  overlap[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(Kern::kThreads);
  config.dynamicSmemBytes = Kern::kSmemBytes;
  config.stream = stream;
  config.attrs = overlap;
  config.numAttrs = programmatic ? 1 : 0;
  return cudaLaunchKernelEx(&config, per_item_kernel<Kern>, p);
}

// `overlap_prior`: launched as a programmatic dependent of the stream's previous kernel (sm_90+).
template <class Kern>
cudaError_t launch_per_item(const typename Kern::Params& p, int batch, int num_heads, bool overlap_prior,
                            cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  DeviceFacts facts;
  if (cudaError_t err = DeviceFacts::current(facts); err != cudaSuccess) return err;
  if (cudaError_t err = allow_shared_memory<Kern>(facts.device); err != cudaSuccess) return err;
  return launch_dependent<Kern>(p, dim3(num_heads * Kern::kSplits, batch), overlap_prior && facts.major >= 9, stream);
}

}  // namespace replayssm
