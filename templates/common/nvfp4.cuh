// NVFP4 checkpoint decode with integer operations (sm_90 has no FP4 conversion): e2m1 codes, two
// per byte (element 2i in the low nibble), an e4m3 scale per 16 values and an FP32 scale per head,
// folded into one FP32 multiplier per block (docs/precision.md, NVFP4). Host and device, so that
// the rules are tested bit for bit against reference/precision.py's nvfp4_decode_bits on a CPU.
#pragma once
#include <cuda_fp16.h>
#include <cstdint>
#include <cstring>

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

}  // namespace replayssm::nvfp4
