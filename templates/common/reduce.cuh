// Warp reductions over aligned groups of lanes.
#pragma once

namespace replayssm {

// Sum over each aligned group of WIDTH lanes (WIDTH a power of two <= 32); every lane gets it.
template <int WIDTH>
__device__ __forceinline__ float group_sum(float v) {
  #pragma unroll
  for (int offset = WIDTH / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Maximum over each aligned group of WIDTH lanes; every lane gets it.
template <int WIDTH>
__device__ __forceinline__ float group_max(float v) {
  #pragma unroll
  for (int offset = WIDTH / 2; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

}  // namespace replayssm
