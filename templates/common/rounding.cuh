// Deterministic stochastic rounding of FP32 to FP16/BF16 in software (Hopper has no SR convert).
// Randomness comes from counter-based hashes keyed by (seed, slot, element, epoch): the same key
// always gives the same bits, with no RNG state to carry. A row's 64-bit key is mixed once
// (rounding_key, the same for every chunk a thread stores); each pair of elements then costs one
// 32-bit hash (pair_bits), 16 random bits per element.
#pragma once
#include "common/dtype.cuh"

namespace replayssm {

// SplitMix64 finaliser: a bijective 64-bit mixer.
__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The key of one (seed, stream) pair, stream = slot << 32 | epoch.
__device__ __forceinline__ uint64_t rounding_key(uint64_t seed, uint64_t stream) {
  return mix64(seed ^ mix64(stream * 0x9e3779b97f4a7c15ull));
}

// 32 random bits for elements 2 pair and 2 pair + 1 (low and high half): a bijective 32-bit
// mixer (two multiplies) of the key's low word and the pair's index, xored with its high word.
__device__ __forceinline__ uint32_t pair_bits(uint64_t key, uint32_t pair) {
  uint32_t x = static_cast<uint32_t>(key) ^ (pair * 0x9e3779b9u);
  x ^= x >> 16;
  x *= 0x21f0aaadu;
  x ^= x >> 15;
  x *= 0x735a2d97u;
  x ^= x >> 15;
  return x ^ static_cast<uint32_t>(key >> 32);
}

// FP32 to T with 16 random bits (in [0, 2^16)).
template <typename T> __device__ __forceinline__ T round_stochastic(float v, uint32_t bits);

template <> __device__ __forceinline__ float round_stochastic<float>(float v, uint32_t) { return v; }

// BF16 keeps the top 16 bits of FP32: add 16 random bits below them, then truncate. Branch-free
// (a select for NaN, which truncation could turn into inf; inf itself never carries).
template <> __device__ __forceinline__ __nv_bfloat16 round_stochastic<__nv_bfloat16>(float v, uint32_t bits) {
  const __nv_bfloat16 rounded = __ushort_as_bfloat16(static_cast<unsigned short>((__float_as_uint(v) + bits) >> 16));
  return isnan(v) ? __float2bfloat16_rn(v) : rounded;
}

// FP16: the neighbour away from zero with probability equal to the distance from the one toward
// zero. From 2^-14 up (FP16 normals, and every finite value above FP16's range, which truncates
// to 65504) an FP16 ulp is 13 FP32 mantissa bits: add 13 random bits to them and truncate, which
// is exact. Below, FP16 subnormals (rare: a branch): compare 16 random bits with the exact
// fraction.
template <> __device__ __forceinline__ __half round_stochastic<__half>(float v, uint32_t bits) {
  const uint32_t magnitude = __float_as_uint(v) & 0x7fffffffu;
  if (magnitude < 0x38800000u) {
    const __half toward_zero = __float2half_rz(v);
    const __half away = __ushort_as_half(static_cast<unsigned short>(__half_as_ushort(toward_zero) + 1));
    const float frac = fabsf(v - __half2float(toward_zero)) * 16777216.0f;  // a subnormal FP16 ulp is 2^-24
    return bits * (1.0f / 65536.0f) < frac ? away : toward_zero;  // frac 0: exact values stay
  }
  const __half rounded = __float2half_rz(__uint_as_float(__float_as_uint(v) + (bits & 0x1fffu)));
  return magnitude >= 0x7f800000u ? __float2half_rn(v) : rounded;  // inf / nan to nearest
}

}  // namespace replayssm
