// Conversions between storage types and FP32, and 16-byte vector I/O. Framework-agnostic.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cstdint>
#include <type_traits>

namespace replayssm {

// An FP8 e4m3 checkpoint code (OCP e4m3fn). Its to_float is the code's value before the row's
// FP32 scale (common/checkpoint.cuh applies it); it is never an activation type.
struct e4m3 {
  uint8_t code;
};

// Two NVFP4 checkpoint codes (e2m1, element 2i in the low nibble). They decode only with their
// block's e4m3 scale and the head's FP32 scale (common/checkpoint.cuh), never one at a time.
struct nvfp4x2 {
  uint8_t codes;
};

// Values per storage element, and per 16-byte chunk (the unit a lane loads and stores).
template <typename T> constexpr int kValuesPerElement = std::is_same_v<T, nvfp4x2> ? 2 : 1;
template <typename T> constexpr int kChunkValues = 16 / int(sizeof(T)) * kValuesPerElement<T>;

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <> __device__ __forceinline__ float to_float<e4m3>(e4m3 v) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(v.code, __NV_E4M3)));
}

// Round-to-nearest-even conversion from FP32.
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Load COUNT consecutive T (COUNT * sizeof(T) a multiple of 4 bytes and naturally aligned) as floats.
template <typename T, int COUNT>
__device__ __forceinline__ void load_as_float(const T* __restrict__ src, float (&dst)[COUNT]) {
  constexpr int BYTES = COUNT * int(sizeof(T));
  static_assert(BYTES % 4 == 0, "vector load must be a whole number of 32-bit words");
  if constexpr (BYTES % 16 == 0) {
    #pragma unroll
    for (int v = 0; v < BYTES / 16; ++v) {
      uint4 raw = reinterpret_cast<const uint4*>(src)[v];
      const T* e = reinterpret_cast<const T*>(&raw);
      #pragma unroll
      for (int i = 0; i < 16 / int(sizeof(T)); ++i) dst[v * (16 / sizeof(T)) + i] = to_float(e[i]);
    }
  } else if constexpr (BYTES % 8 == 0) {
    #pragma unroll
    for (int v = 0; v < BYTES / 8; ++v) {
      uint2 raw = reinterpret_cast<const uint2*>(src)[v];
      const T* e = reinterpret_cast<const T*>(&raw);
      #pragma unroll
      for (int i = 0; i < 8 / int(sizeof(T)); ++i) dst[v * (8 / sizeof(T)) + i] = to_float(e[i]);
    }
  } else {
    #pragma unroll
    for (int v = 0; v < BYTES / 4; ++v) {
      uint32_t raw = reinterpret_cast<const uint32_t*>(src)[v];
      const T* e = reinterpret_cast<const T*>(&raw);
      #pragma unroll
      for (int i = 0; i < 4 / int(sizeof(T)); ++i) dst[v * (4 / sizeof(T)) + i] = to_float(e[i]);
    }
  }
}

// COUNT consecutive T (naturally aligned to their total size) as floats: vector loads where the
// total is a whole number of 32-bit words, else one at a time.
template <typename T, int COUNT>
__device__ __forceinline__ void load_floats(const T* src, float (&dst)[COUNT]) {
  if constexpr ((COUNT * sizeof(T)) % 4 == 0) {
    load_as_float<T, COUNT>(src, dst);
  } else {
    #pragma unroll
    for (int i = 0; i < COUNT; ++i) dst[i] = to_float(src[i]);
  }
}

// COUNT floats to naturally aligned dst (16-byte stores when COUNT is 4).
template <int COUNT>
__device__ __forceinline__ void store_floats(float* dst, const float (&v)[COUNT]) {
  if constexpr (COUNT == 4) {
    *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
  } else if constexpr (COUNT == 2) {
    *reinterpret_cast<float2*>(dst) = make_float2(v[0], v[1]);
  } else {
    #pragma unroll
    for (int i = 0; i < COUNT; ++i) dst[i] = v[i];
  }
}

// 16 bytes of raw storage and its FP32 view.
template <typename T> struct Vec16 {
  static constexpr int kCount = 16 / sizeof(T);
  uint4 raw;
  __device__ __forceinline__ void load(const T* __restrict__ p) { raw = *reinterpret_cast<const uint4*>(p); }
  __device__ __forceinline__ void store(T* p) const { *reinterpret_cast<uint4*>(p) = raw; }
  __device__ __forceinline__ float get(int i) const { return to_float(reinterpret_cast<const T*>(&raw)[i]); }
  __device__ __forceinline__ void set(int i, T v) { reinterpret_cast<T*>(&raw)[i] = v; }
  // Every element as FP32 (e4m3 two at a time: one conversion per pair, exact through FP16).
  __device__ __forceinline__ void values(float (&out)[kCount]) const {
    if constexpr (std::is_same_v<T, e4m3>) {
      const unsigned short* pairs = reinterpret_cast<const unsigned short*>(&raw);
      #pragma unroll
      for (int i = 0; i < kCount / 2; ++i) {
        const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pairs[i], __NV_E4M3)));
        out[2 * i] = f.x, out[2 * i + 1] = f.y;
      }
    } else {
      #pragma unroll
      for (int i = 0; i < kCount; ++i) out[i] = get(i);
    }
  }
};

}  // namespace replayssm
