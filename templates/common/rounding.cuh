// Deterministic stochastic rounding of FP32 to FP16/BF16 in software (Hopper has no SR convert).
// Randomness comes from a counter-based hash keyed by (seed, slot, element, epoch): the same
// key always gives the same bits, with no RNG state to carry.
#pragma once
#include "common/dtype.cuh"

namespace replayssm {

// SplitMix64 finaliser: a bijective 64-bit mixer, good enough for rounding noise.
__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

__device__ __forceinline__ uint32_t rounding_bits(uint64_t seed, uint64_t stream, uint64_t counter) {
  return static_cast<uint32_t>(mix64(seed ^ mix64(stream * 0x9e3779b97f4a7c15ull + counter)) >> 32);
}

template <typename T> __device__ __forceinline__ T round_stochastic(float v, uint32_t bits);

template <> __device__ __forceinline__ float round_stochastic<float>(float v, uint32_t) { return v; }

// BF16 keeps the top 16 bits of FP32: add 16 random bits below them, then truncate.
template <> __device__ __forceinline__ __nv_bfloat16 round_stochastic<__nv_bfloat16>(float v, uint32_t bits) {
  uint32_t u = __float_as_uint(v);
  if ((u & 0x7f800000u) == 0x7f800000u) return __float2bfloat16_rn(v);  // inf / nan
  u += bits >> 16;
  return __ushort_as_bfloat16(static_cast<unsigned short>(u >> 16));
}

// FP16: pick the upper neighbour with probability equal to the distance from the lower one.
template <> __device__ __forceinline__ __half round_stochastic<__half>(float v, uint32_t bits) {
  __half toward_zero = __float2half_rz(v);
  float low = __half2float(toward_zero);
  if (low == v || !isfinite(v) || __hisinf(toward_zero)) return __float2half_rn(v);
  unsigned short next_bits = __half_as_ushort(toward_zero) + 1;  // one ulp away from zero
  __half away = __ushort_as_half(next_bits);
  if (__hisinf(away)) return toward_zero;
  float high = __half2float(away);
  float frac = (v - low) / (high - low);  // in (0, 1)
  float r = (bits >> 8) * (1.0f / 16777216.0f);
  return r < frac ? away : toward_zero;
}

}  // namespace replayssm
