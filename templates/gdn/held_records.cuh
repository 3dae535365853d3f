// Gated DeltaNet separate mode's flush: the held u_i again, from the carried copy.
//
// A non-flush step of separate mode forms u_j from the low-precision read copy; the flush must
// fold the u_j a one-copy run would have formed from the carried copy instead. So it recomputes
//   u_i = beta_i (v_i - (total_i S_c k^_i + sum_{m<i} w[i][m] u_m)),  w[i][m] = a(m+1:i) (k^_m . k^_i)
// row by row in record order, with record i's own step arithmetic (its suffix decays, raw dots and
// norms, in the same order), so that the carried copy is bit for bit a one-copy run's.
//
// The weights w, totals and norms depend on the records only, not on the state rows: the per-item
// kernel forms them in each CTA (form_held_weights); the split kernel's records kernel forms them
// once per (batch row, value head), the Gram once per key head (write_held_weights), and its state
// CTAs load them from the workspace. Both use held_dot and held_weight, so both get the same floats.
#pragma once
#include "common/replay.cuh"

namespace replayssm::gdn {

// The L2 norm's epsilon, 1/sqrt(|k|^2 + eps), in every GDN kernel (here: the first header they include).
constexpr float kNormEps = 1e-6f;

// The held records a separate-mode flush recomputes, in shared memory (empty without a read copy).
template <bool SEPARATE, int RECORDS, int ROWS>
struct RecomputeSmem {
  alignas(16) float v[RECORDS][ROWS];
  float predicted[RECORDS][ROWS];  // S_c k^_i, this CTA's rows
  alignas(16) float weight[RECORDS][RECORDS];  // [i][m], m < i: w[i][m] as record i's step formed it
  float kk[RECORDS][RECORDS];      // [i][m]: k_m . k_i, raw (the per-item kernel's staging for weight)
  alignas(16) float total[RECORDS];
  alignas(16) float rk[RECORDS];
  float beta[RECORDS];
};
template <int RECORDS, int ROWS>
struct RecomputeSmem<false, RECORDS, ROWS> {};

// Raw a . b over K channels, one warp: lane-strided FMAs, then the warp sum (every step's order).
template <int K, typename A, typename B>
__device__ __forceinline__ float held_dot(const A* a, const B* b) {
  float acc = 0.f;
  for (int c = threadIdx.x % 32; c < K; c += 32) acc = fmaf(to_float(a[c]), to_float(b[c]), acc);
  return group_sum<32>(acc);
}

// Record m's weight in record i's prediction, in the one order every kernel multiplies it.
__device__ __forceinline__ float held_weight(float decay, float kk, float rk_m, float rk_i) {
  return decay * kk * rk_m * rk_i;
}

// 1/|x| from |x|^2 where the kernel L2-normalises keys and queries, else 1: every GDN kernel's norm.
__device__ __forceinline__ float inv_norm(float sq, bool l2norm) {
  return l2norm ? rsqrtf(sq + kNormEps) : 1.f;
}

// The held (v, beta) records of one value head (its ring rows: v [CAP][V], beta [CAP]), this CTA's rows.
template <int V, int ROWS, int THREADS, typename act_t, int RECORDS>
__device__ __forceinline__ void load_held_values(const act_t* values, const float* betas, RecomputeSmem<true, RECORDS, ROWS>& h,
                                                 int row0, int held) {
  for (int e = threadIdx.x; e < held * ROWS; e += THREADS) h.v[e / ROWS][e % ROWS] = to_float(values[(e / ROWS) * V + row0 + e % ROWS]);
  for (int i = threadIdx.x; i < held; i += THREADS) h.beta[i] = betas[i];
}

// The per-item kernel's weights, totals and norms, formed in this CTA from the held raw k rows
// and log-decays g (in shared memory). Ends with a barrier.
template <int K, int WARPS, bool L2NORM, typename REC, int RECORDS, int ROWS>
__device__ __forceinline__ void form_held_weights(const REC* k, const float* g, RecomputeSmem<true, RECORDS, ROWS>& h,
                                                  int held) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int i = warp; i < held; i += WARPS) {  // a warp per record: each record's scan is its own
    const float total = suffix_decays(g, h.weight[i], i + 1);  // the decays, made weights below
    if (lane == 0) h.total[i] = total;
  }
  for (int pair = warp; pair < held * held; pair += WARPS) {  // (i, m), m <= i; |k_i|^2 where m == i
    const int i = pair / held, m = pair % held;
    if (m > i) continue;
    const float kk = held_dot<K>(k + m * K, k + i * K);
    if (lane == 0) {
      if (m == i) {
        h.rk[i] = inv_norm(kk, L2NORM);
      } else {
        h.kk[i][m] = kk;
      }
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < held * held; e += WARPS * 32) {
    const int i = e / held, m = e % held;
    if (m < i) h.weight[i][m] = held_weight(h.weight[i][m], h.kk[i][m], h.rk[m], h.rk[i]);
  }
  __syncthreads();
}

// The split records kernel's share, one warp per (value head h, held record i): record i's
// decays (scratch: the warp's CAP floats), w[i][m] for m < i from the key head's raw Gram
// (gram[i][m], m < i) and norms rk (1/|k_i|, as inv_norm forms them) into weights
// [held][CAP], total_i into totals and rk_i into norms. WARPS warps; no barrier inside.
template <int CAP, int VPH, int WARPS, class Out>
__device__ __forceinline__ void write_held_weights(const float (&g)[VPH][CAP], const float (&gram)[CAP][CAP],
                                                   const float* rk, float (&scratch)[WARPS][CAP], const Out& out,
                                                   int held) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int w = warp; w < VPH * held; w += WARPS) {
    const int h = w / held, i = w % held;
    const float total = suffix_decays(g[h], scratch[warp], i + 1);
    __syncwarp();
    float* weights = out.weights(h) + i * CAP;
    for (int m = lane; m < i; m += 32) weights[m] = held_weight(scratch[warp][m], gram[i][m], rk[m], rk[i]);
    if (lane == 0) {
      out.totals(h)[i] = total;
      out.norms(h)[i] = rk[i];
    }
    __syncwarp();  // before the next record's decays overwrite scratch
  }
}

// u_i for the held records into u [held][ROWS], from the carried copy `ck` and h's weights,
// totals, norms, v and beta (all in shared memory before the call). k: the held raw k rows.
// Tile: the state tile's lane layout. Ends with a barrier.
template <class Tile, int K, int ROWS, typename REC, class CK, int RECORDS>
__device__ __forceinline__ void solve_held_u(const CK& ck, const REC* k, float* u, RecomputeSmem<true, RECORDS, ROWS>& h,
                                             int held) {
  #pragma unroll
  for (int pass = 0; pass < Tile::kPasses; ++pass) {  // S_c k^_i for this lane's rows
    float s[Tile::kChunksPerLane][Tile::kVec];
    ck.values(pass, 1.f, s);
    // kBatch records' lane reductions at once: their shuffle chains overlap.
    constexpr int kBatch = 8;
    for (int i0 = 0; i0 < held; i0 += kBatch) {
      float sk[kBatch];
      #pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        sk[b] = 0.f;
        if (i0 + b < held) {
          float k_reg[Tile::kChunksPerLane][Tile::kVec];
          Tile::slice(k + (i0 + b) * K, k_reg);
          sk[b] = Tile::dot(s, k_reg);
        }
      }
      #pragma unroll
      for (int b = 0; b < kBatch; ++b) sk[b] = group_sum<Tile::kLanesPerRow>(sk[b]);
      #pragma unroll
      for (int b = 0; b < kBatch; ++b)
        if (i0 + b < held && Tile::row_leader()) h.predicted[i0 + b][Tile::row(pass)] = sk[b] * h.rk[i0 + b];
    }
  }
  __syncthreads();
  for (int r = threadIdx.x; r < ROWS; r += Tile::kThreads) {
    for (int i = 0; i < held; ++i) {
      float pred = 0.f;
      for (int m = 0; m < i; ++m) pred = fmaf(h.weight[i][m], u[m * ROWS + r], pred);
      u[i * ROWS + r] = h.beta[i] * (h.v[i][r] - (h.total[i] * h.predicted[i][r] + pred));
    }
  }
  __syncthreads();
}

}  // namespace replayssm::gdn
