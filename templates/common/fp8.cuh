// FP8 e4m3 (OCP e4m3fn) checkpoint codes with one FP32 decode scale per state row
// (docs/precision.md, FP8): decode, encode by round-to-nearest or stochastic rounding, and a
// row's scale and inverse. Host and device, so that the rules are tested bit for bit against
// reference/precision.py's e4m3_encode / fp8_encode on a CPU.
#pragma once
#include <cstdint>
#include <cmath>
#include <cstring>

namespace replayssm::fp8 {

constexpr float kMax = 448.f;  // the largest finite magnitude, code 0x7E
constexpr uint32_t kNaN = 0x7Fu;

__host__ __device__ __forceinline__ float float_from_bits(uint32_t bits) {
  float value;
  memcpy(&value, &bits, sizeof(value));
  return value;
}
__host__ __device__ __forceinline__ uint32_t bits_of(float value) {
  uint32_t bits;
  memcpy(&bits, &value, sizeof(bits));
  return bits;
}

// The value of code c: its exponent and mantissa placed at FP32's (c << 20) read as the value
// times 2^-120, normals and subnormals alike, so one exact multiply rebiases it.
__host__ __device__ __forceinline__ float code_value(uint32_t code) {
  if ((code & 0x7Fu) == kNaN) return float_from_bits(0x7FC00000u);
  return float_from_bits(((code & 0x80u) << 24) | ((code & 0x7Fu) << 20)) * 0x1p120f;
}

// The kernels' load: fp32(e4m3(code) * scale).
__host__ __device__ __forceinline__ float decode(uint32_t code, float scale) { return code_value(code) * scale; }

// IEEE division (the reference's x / scale); the device's default `/` is not correctly rounded.
__host__ __device__ __forceinline__ float divide(float x, float y) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(x, y);
#else
  return x / y;
#endif
}

// The code of an FP32 value already multiplied by its row's inverse scale, rounded to nearest
// (ties to the even code), saturating: |q| >= 448 and +-inf give +-448, NaN gives 0x7F, -0.0
// gives 0x80. q = (n + frac) * gap on the grid below |q| (gap a power of two, so both parts
// exact). The kernels round to nearest with the hardware conversion, which this mirrors.
__host__ __device__ __forceinline__ uint32_t encode_rn(float q) {
  const uint32_t raw = bits_of(q);
  if ((raw & 0x7FFFFFFFu) > 0x7F800000u) return kNaN;
  const uint32_t sign = (raw >> 24) & 0x80u;
  const float mag = fminf(float_from_bits(raw & 0x7FFFFFFFu), kMax);
  int e = int((bits_of(mag) >> 23) & 0xFFu) - 127;  // the binade [2^e, 2^(e+1)) of mag
  e = e < -6 ? -6 : e;                               // below 2^-6: the subnormal grid, gap 2^-9
  const float t = mag * float_from_bits(uint32_t(3 - e + 127) << 23);  // mag / gap, gap = 2^(e-3)
  const float n = floorf(t), frac = t - n;
  const bool up = frac > 0.5f || (frac == 0.5f && (int(n) & 1));
  // Codes step by one per gap: ((e + 7) << 3) is the code of 2^e (8 gaps above 0 at e = -6).
  return sign | uint32_t(((e + 7) << 3) + int(n) + (up ? 1 : 0) - 8);
}

// Stochastic rounding of q to an e4m3 value, returned as that (exact) FP32 value: `bits` (16
// random bits) are added at the top of the 20 mantissa bits e4m3 drops, which are then cleared,
// so q rounds away from zero with probability frac (to 2^-16). Below 2^-6 (subnormal e4m3, a
// fixed gap of 2^-9) the same is done to |q| + 2^-6, which then has that gap, and 2^-6 is taken
// off again. Saturates at 448; NaN stays NaN. Integer adds and masks: no per-value branch.
__host__ __device__ __forceinline__ float sr_value(float q, uint32_t bits) {
  const float mag = fminf(fabsf(q), kMax);
  const bool low = mag < 0x1p-6f;
  const float m = low ? mag + 0x1p-6f : mag;
  float v = fminf(float_from_bits((bits_of(m) + (bits << 4)) & 0x7FF00000u), kMax);
  v = low ? v - 0x1p-6f : v;
  const float signed_v = float_from_bits(bits_of(v) | (bits_of(q) & 0x80000000u));
  return q != q ? q : signed_v;
}

// The code of q: round to nearest, or (SR) sr_value's with 16 random bits.
template <bool SR>
__host__ __device__ __forceinline__ uint32_t encode(float q, uint32_t bits = 0) {
  return encode_rn(SR ? sr_value(q, bits) : q);
}

// A row's FP32 decode scale from its amax: amax / 448, at least 2^-126 so that its inverse is
// finite (0 for an all-zero row).
__host__ __device__ __forceinline__ float row_scale(float amax) {
  return amax == 0.f ? 0.f : fmaxf(divide(amax, kMax), 0x1p-126f);
}

// What a row's values are multiplied by before encoding: 1 / scale (1 where the scale is 0).
__host__ __device__ __forceinline__ float row_inverse(float scale) { return scale == 0.f ? 1.f : divide(1.f, scale); }

}  // namespace replayssm::fp8
