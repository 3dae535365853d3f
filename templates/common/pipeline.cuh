// Asynchronous global -> shared copies (cp.async, sm_80+) and L2 prefetches (sm_90). Framework-agnostic.
#pragma once
#include <cstdint>
#include <type_traits>

namespace replayssm::pipe {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Asynchronous copy of BYTES (4, 8 or 16; both addresses aligned to it) global -> shared,
// completed by wait_copies(). Before sm_80, a plain copy.
template <int BYTES>
__device__ __forceinline__ void copy_async(void* dst, const void* src) {
  static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async moves 4, 8 or 16 bytes");
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(smem_addr(dst)), "l"(src), "n"(BYTES) : "memory");
#else
  using Word = typename std::conditional<BYTES == 16, uint4, typename std::conditional<BYTES == 8, uint2, uint32_t>::type>::type;
  *static_cast<Word*>(dst) = *static_cast<const Word*>(src);
#endif
}

// Wait for every copy_async() this thread has issued (other threads' copies need a barrier too).
__device__ __forceinline__ void wait_copies() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n\tcp.async.wait_group 0;" ::: "memory");
#endif
}

// Starts moving `bytes` at src (both multiples of 16) from DRAM into L2, holding no registers or
// shared memory: a later plain load of those bytes is then an L2 hit. sm_90 bulk prefetch; a
// no-op elsewhere (the later loads stay correct, only slower).
__device__ __forceinline__ void prefetch_l2(const void* src, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (bytes > 0) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
#endif
}

}  // namespace replayssm::pipe
