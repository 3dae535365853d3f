// Mamba-2's records for materialize_step (common/materialize.cuh): record i of head h is
// (x_i, B_i of the head's group, dt_i), folded as S <- exp(dt_i A_h) S + dt_i x_i B_i^T.
#pragma once
#include "common/materialize.cuh"

namespace replayssm {
namespace mamba2 {

template <typename act_t, int P, int N, int HPG, int CAP>
struct MaterializeRecords {
  static constexpr bool kCorrect = false;
  struct Args {
    const act_t* rec_x;  // [slots, H, CAP, P]
    int64_t x_slot;
    const act_t* rec_b;  // [slots, G, CAP, N]
    int64_t b_slot;
    const float* rec_dt;  // [slots, H, CAP]
    int64_t dt_slot;
    const float* A;  // [H]
  };

  __device__ __forceinline__ static void stage(const Args& a, int slot, int head, int i, materialize::Staged<P, N>& st) {
    const float dt = a.rec_dt[int64_t(slot) * a.dt_slot + int64_t(head) * CAP + i];
    const float decay = expf(dt * a.A[head]);
    const act_t* x = a.rec_x + int64_t(slot) * a.x_slot + (int64_t(head) * CAP + i) * P;
    const act_t* B = a.rec_b + int64_t(slot) * a.b_slot + (int64_t(head / HPG) * CAP + i) * N;
    for (int t = threadIdx.x; t < P; t += blockDim.x) st.row[t] = dt * to_float(x[t]);
    for (int t = threadIdx.x; t < N; t += blockDim.x) {
      st.col[t] = to_float(B[t]);
      st.decay[t] = decay;
    }
  }
};

}  // namespace mamba2
}  // namespace replayssm
