// Launch helpers shared by the bindings.
#pragma once
#include <cuda_runtime.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>

namespace replayssm {

inline cudaStream_t current_stream(const tvm::ffi::TensorView& t) {
  return static_cast<cudaStream_t>(TVMFFIEnvGetStream(t.device().device_type, t.device().device_id));
}

// The bits of the bindings' `flags` argument (kFlag*) are rendered into each module from
// replayssm_jit/core/launch_flags.py, their one definition.

// The split kernel's workspace (sized by the wrapper; checked again here): float32, contiguous,
// at least `needed` elements.
inline float* workspace_ptr(const tvm::ffi::TensorView& workspace, int64_t needed) {
  const DLDataType dtype = workspace.dtype();
  const bool f32 = dtype.code == kDLFloat && dtype.bits == 32 && dtype.lanes == 1;
  if (!f32 || workspace.numel() < needed || !workspace.IsContiguous())
    TVM_FFI_THROW(ValueError) << "workspace: expected a contiguous float32 tensor of at least " << needed
                              << " elements, got " << workspace.numel();
  return static_cast<float*>(workspace.data_ptr());
}

// An engine's stochastic-rounding seed on the device (int64, its first element), or null where none is given.
inline const int64_t* seed_tensor_ptr(const tvm::ffi::Optional<tvm::ffi::TensorView>& seed_tensor) {
  if (!seed_tensor.has_value()) return nullptr;
  const tvm::ffi::TensorView& t = seed_tensor.value();
  const DLDataType dtype = t.dtype();
  const bool i64 = dtype.code == kDLInt && dtype.bits == 64 && dtype.lanes == 1;
  if (!i64 || t.numel() < 1 || t.device().device_type != kDLCUDA)
    TVM_FFI_THROW(ValueError) << "seed_tensor: expected an int64 CUDA tensor of at least 1 element, got " << dtype
                              << " with " << t.numel() << " elements on device type " << int(t.device().device_type);
  return static_cast<const int64_t*>(t.data_ptr());
}

// An engine's flush mask ([batch] bool or uint8, contiguous, on the device; checked in Python first), or
// null where none is given. A module built without the "flush_mask" flag (`compiled` false) takes none: its
// kernels would never read it.
inline const uint8_t* flush_mask_ptr(const tvm::ffi::Optional<tvm::ffi::TensorView>& flush_mask, int64_t batch,
                                     bool compiled) {
  if (!flush_mask.has_value()) return nullptr;
  if (!compiled) TVM_FFI_THROW(ValueError) << "flush_mask: expected None (the module is built without the flush_mask flag), got a tensor";
  const tvm::ffi::TensorView& t = flush_mask.value();
  const DLDataType dtype = t.dtype();
  const bool byte = (dtype.code == kDLBool || dtype.code == kDLUInt) && dtype.bits == 8 && dtype.lanes == 1;
  if (!byte || t.ndim() != 1 || t.size(0) != batch || !t.IsContiguous() || t.device().device_type != kDLCUDA)
    TVM_FFI_THROW(ValueError) << "flush_mask: expected a contiguous [" << batch << "] bool or uint8 CUDA tensor, got "
                              << dtype << " with " << t.numel() << " elements on device type " << int(t.device().device_type);
  return static_cast<const uint8_t*>(t.data_ptr());
}

template <typename T> inline T* ptr(const tvm::ffi::TensorView& t) { return static_cast<T*>(t.data_ptr()); }
template <typename T> inline T* optional_ptr(const tvm::ffi::Optional<tvm::ffi::TensorView>& t) {
  return t.has_value() ? static_cast<T*>(t.value().data_ptr()) : nullptr;
}
// A slot pool's slot stride in elements (its block size when packed; an engine's page when padded, as
// vLLM's cache pages are; families/layout.py checks it), 0 for an absent optional one.
inline int64_t slot_stride(const tvm::ffi::TensorView& t) { return t.stride(0); }
inline int64_t slot_stride(const tvm::ffi::Optional<tvm::ffi::TensorView>& t) {
  return t.has_value() ? t.value().stride(0) : 0;
}

}  // namespace replayssm
