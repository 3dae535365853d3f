// NVFP4 checkpoints (docs/precision.md, NVFP4): e2m1 codes, two per byte (element 2i in the low
// nibble), an e4m3 scale per 16 values and an FP32 scale per head. Decode with integer operations
// (sm_90 has no FP4 conversion), the two scales folded into one FP32 multiplier per block; encode
// by comparisons on the value times the block's inverse multiplier. Host and device, so that the
// rules are tested bit for bit against reference/precision.py's nvfp4_decode_bits / nvfp4_encode
// on a CPU.
#pragma once
#include <cuda_fp16.h>
#include <cstdint>
#include <cstring>
#include "common/fp8.cuh"

namespace replayssm::nvfp4 {

constexpr int kBlock = 16;  // values per e4m3 block scale

__host__ __device__ __forceinline__ float float_from_bits(uint32_t bits) {
  float value;
  memcpy(&value, &bits, sizeof(value));
  return value;
}

// The block's multiplier S = fp32(e4m3(code) * head), times 2^14 for decode_word. e4m3 code c's
// exponent and mantissa placed at FP32's (c << 20) read as the value times 2^-120, normals and
// subnormals alike: one exact multiply rebiases it (by 2^134, with decode_word's 2^14). Exact
// while S < 2^114. 0x7F / 0xFF are e4m3fn's NaN codes.
__host__ __device__ __forceinline__ float block_multiplier(uint32_t code, float head) {
  const uint32_t bits = ((code & 0x80u) << 24) | ((code & 0x7fu) << 20);
  const float block = (code & 0x7fu) == 0x7fu ? float_from_bits(0x7fc00000u) : float_from_bits(bits) * 0x1p120f;
  return block * head * 0x1p14f;
}

// An e2m1 nibble s ee m placed as FP16 bits s << 15 | ee << 10 | m << 9 reads as its value times
// 2^-14 (exponent bias 15 against 1; the subnormal 0.5 lands on FP16's subnormal 2^-15), so two
// shifts and a mask place two nibbles (j and j + 4 of a word) in the lanes of an FP16 pair.
__host__ __device__ __forceinline__ float half_bits_to_float(uint32_t bits) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}

// The eight values of one 32-bit word (value i in nibble i, one block's), times `multiplier`
// from block_multiplier: fp32(e2m1 * S), bit for bit.
__host__ __device__ __forceinline__ void decode_word(uint32_t word, float multiplier, float (&out)[8]) {
  #pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t x = word >> (4 * j);  // nibble j at bits 0-3, nibble j + 4 at bits 16-19
    const uint32_t lanes = ((x << 9) & 0x0e000e00u) | ((x << 12) & 0x80008000u);
    out[j] = half_bits_to_float(lanes & 0xffffu) * multiplier;
    out[j + 4] = half_bits_to_float(lanes >> 16) * multiplier;
  }
}

constexpr float kMaxValue = 6.f;             // e2m1's largest magnitude, code 7
constexpr float kMinHeadScale = 0x1p-117f;   // times e4m3's least subnormal 2^-9: FP32's least normal

// The head's FP32 scale from its amax: amax / (6 * 448), at least kMinHeadScale (0 for a zero head).
__host__ __device__ __forceinline__ float head_scale(float amax) {
  return amax == 0.f ? 0.f : fmaxf(fp8::divide(amax, kMaxValue * fp8::kMax), kMinHeadScale);
}

// A block's e4m3 scale code from its amax: e4m3_rn(fp32(fp32(amax / 6) / head)), saturating.
__host__ __device__ __forceinline__ uint32_t block_code(float block_amax, float head) {
  const float per_block = fp8::divide(block_amax, kMaxValue);
  return fp8::encode_rn(head == 0.f ? per_block : fp8::divide(per_block, head));
}

// The block's S = fp32(e4m3(code) * head) and what its values are multiplied by before encoding:
// fp32(1 / S), 0 where S is 0 (the block stores codes 0).
__host__ __device__ __forceinline__ float block_inverse(uint32_t code, float head) {
  const float s = fp8::code_value(code) * head;
  return s == 0.f ? 0.f : fp8::divide(1.f, s);
}

// The e2m1 code of q (a value times its block's inverse), round to nearest with ties to the even
// code, saturating at 6; -0.0 keeps its sign. Thresholds are the midpoints of 0, 0.5, 1, 1.5, 2,
// 3, 4, 6 (>= where the upper code is even).
__host__ __device__ __forceinline__ uint32_t encode_rn(float q) {
  const float a = fabsf(q);
  const uint32_t code = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.f);
  return code | ((fp8::bits_of(q) >> 28) & 8u);
}

// Stochastic rounding of q between its two neighbours on the e2m1 grid: up (away from zero) iff
// bits * 2^-16 < (|q| - lower) / gap, exact in FP32 (the gap is a power of two); saturating at 6.
__host__ __device__ __forceinline__ uint32_t encode_sr(float q, uint32_t bits) {
  const float a = fminf(fabsf(q), kMaxValue);
  const uint32_t lower = (a >= 0.5f) + (a >= 1.f) + (a >= 1.5f) + (a >= 2.f) + (a >= 3.f) + (a >= 4.f) + (a >= 6.f);
  const float lower_value = lower < 4 ? 0.5f * float(lower) : float(2u << ((lower - 4) / 2)) * (lower & 1 ? 1.5f : 1.f);
  const float gap_inverse = lower < 4 ? 2.f : lower < 6 ? 1.f : 0.5f;
  const bool up = lower < 7 && float(bits) < (a - lower_value) * gap_inverse * 65536.f;
  return (lower + (up ? 1u : 0u)) | ((fp8::bits_of(q) >> 28) & 8u);
}

// The code of value v in a block with inverse multiplier `inverse` (block_inverse): RN, or SR with
// 16 random bits; +0 where the block's S is 0.
template <bool SR>
__host__ __device__ __forceinline__ uint32_t encode(float v, float inverse, uint32_t bits = 0) {
  const float q = inverse == 0.f ? 0.f : v * inverse;
  return SR ? encode_sr(q, bits) : encode_rn(q);
}

}  // namespace replayssm::nvfp4
