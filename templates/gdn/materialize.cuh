// The delta rule's records for materialize_step (common/materialize.cuh), GDN's and KDA's: record
// i of value head hv is (u_i, raw k_i of its key head, log-decay g_i per head or per key channel),
// folded as S <- S Diag(exp(g_i)) + u_i k^_i^T with k^ = rk k (rk = rsqrt(|k|^2 + eps) with
// L2NORM). Separate mode (SEPARATE) recomputes u_i = beta_i (v_i - S k^_i) from the carried copy.
#pragma once
#include "common/materialize.cuh"

namespace replayssm {
namespace gdn {

template <typename act_t, int K, int V, int VPH, int CAP, bool L2NORM, bool PER_CHANNEL, bool SEPARATE>
struct MaterializeRecords {
  static constexpr bool kCorrect = SEPARATE;
  static constexpr float kEps = 1e-6f;  // as the decode kernels' kNormEps
  struct Args {
    const float* rec_u;  // [slots, HV, CAP, V]
    int64_t u_slot;
    const act_t* rec_k;  // [slots, H, CAP, K]
    int64_t k_slot;
    const float* rec_g;  // [slots, HV, CAP] or, per channel, [slots, HV, CAP, K]
    int64_t g_slot;
    const act_t* rec_v;  // [slots, HV, CAP, V] (separate mode)
    int64_t v_slot;
    const float* rec_beta;  // [slots, HV, CAP] (separate mode)
    int64_t beta_slot;
  };

  __device__ __forceinline__ static void stage(const Args& a, int slot, int head, int i, materialize::Staged<V, K>& st) {
    const act_t* k = a.rec_k + int64_t(slot) * a.k_slot + (int64_t(head / VPH) * CAP + i) * K;
    float rk = 1.f;
    if constexpr (L2NORM) {  // every warp sums the whole key: no barrier before the scale
      float kk = 0.f;
      for (int t = threadIdx.x % 32; t < K; t += 32) kk = fmaf(to_float(k[t]), to_float(k[t]), kk);
      rk = rsqrtf(group_sum<32>(kk) + kEps);
    }
    const float* g = a.rec_g + int64_t(slot) * a.g_slot + (int64_t(head) * CAP + i) * (PER_CHANNEL ? K : 1);
    for (int t = threadIdx.x; t < K; t += blockDim.x) {
      st.col[t] = rk * to_float(k[t]);
      st.decay[t] = expf(PER_CHANNEL ? g[t] : g[0]);
    }
    if constexpr (SEPARATE) {
      const act_t* v = a.rec_v + int64_t(slot) * a.v_slot + (int64_t(head) * CAP + i) * V;
      for (int t = threadIdx.x; t < V; t += blockDim.x) st.row[t] = to_float(v[t]);
      if (threadIdx.x == 0) st.beta = a.rec_beta[int64_t(slot) * a.beta_slot + int64_t(head) * CAP + i];
    } else {
      const float* u = a.rec_u + int64_t(slot) * a.u_slot + (int64_t(head) * CAP + i) * V;
      for (int t = threadIdx.x; t < V; t += blockDim.x) st.row[t] = u[t];
    }
  }
};

}  // namespace gdn
}  // namespace replayssm
