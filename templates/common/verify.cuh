// Building blocks of the speculative kernels of every family: the verify step (T drafts, output
// only), the commit of accepted drafts and the conventional snapshot baseline. The contract
// (cursor words, fused commit, early flush, trees) is docs/speculative.md.
#pragma once
#include <type_traits>

#include "common/checkpoint.cuh"
#include "common/step.cuh"

namespace replayssm {

// The draft tree of one row in shared memory: parent[j] in [-1, j) (a parent out of range is
// taken as -1, attached to the committed records), ancestors[j] the bit set of j's root path
// (j included), and path_log[j] the sum of the log-decays along it.
template <int T>
struct DraftTree {
  int parent[T];
  uint32_t ancestors[T];
  float path_log[T];

  // Draft j's parent as given (a chain where none are), read early into a register.
  static __device__ __forceinline__ int given_parent(const int32_t* parents, int row, int j) {
    return parents != nullptr ? parents[int64_t(row) * T + j] : j - 1;
  }
  __device__ __forceinline__ void set_parent(int j, int given) { parent[j] = given < -1 || given >= j ? -1 : given; }
  // One thread, once every parent is set: the ancestor sets.
  __device__ __forceinline__ void link() {
    #pragma unroll
    for (int j = 0; j < T; ++j) ancestors[j] = (1u << j) | (parent[j] >= 0 ? ancestors[parent[j]] : 0u);
  }
  // Sum of `draft_log[node]` over draft j's root path after node i (i an ancestor of j, or -1
  // for the whole path), summed from j upwards.
  __device__ __forceinline__ float log_after(const float* draft_log, int j, int i) const {
    float sum = 0.f;
    for (int node = j; node != i && node >= 0; node = parent[node]) sum += draft_log[node];
    return sum;
  }
  __device__ __forceinline__ bool on_path(int j, int i) const { return (ancestors[j] >> i) & 1u; }
};

// log_after[i] = sum of log_decay[i+1 .. count-1], and returns the sum of all (every lane): one
// warp, chunks of 32 records from the top, as suffix_decays sums them.
__device__ __forceinline__ float suffix_log_sums(const float* log_decay, float* log_after, int count) {
  const int lane = threadIdx.x % 32;
  float carry = 0.f;
  for (int top = count; top > 0; top -= 32) {
    const int i = top - 32 + lane;
    const float la = i >= 0 ? log_decay[i] : 0.f;
    const float suffix = warp_suffix_sum(la);
    if (i >= 0) log_after[i] = carry + suffix - la;
    carry += __shfl_sync(0xffffffffu, suffix, 0);
  }
  return carry;
}

// The log-decays of a verify row's windows, with its dots (after a barrier since the records and
// parents were staged): the committed records' suffix sums and their total (one warp, the second
// where there are two), the tree's ancestor sets and each draft's path sum.
template <int T, int THREADS>
__device__ __forceinline__ void window_logs(DraftTree<T>& tree, const float* log_decay, float* log_after, int m, int t,
                                            float* committed_total) {
  if (threadIdx.x / 32 == (THREADS > 32 ? 1 : 0)) {
    const float sum = suffix_log_sums(log_decay, log_after, m);
    if (threadIdx.x % 32 == 0) *committed_total = sum;
  }
  if (threadIdx.x == 0) tree.link();
  if (threadIdx.x < t) tree.path_log[threadIdx.x] = tree.log_after(log_decay + m, threadIdx.x, -1);
}

// a(i+1 .. j) over draft j's window, for record i of a row holding m committed records (at
// [0, m), mc of them replayed) and its drafts (at [m, m + t)): 0 where i is off the window.
// `path_log` is the drafts' path sums of these log-decays (the tree's own where omitted; a split
// verify keeps one array per head).
template <int T>
__device__ __forceinline__ float window_decay(const DraftTree<T>& tree, const float* path_log, const float* log_decay,
                                              const float* log_after, int m, int mc, int j, int i) {
  if (i < mc) return expf(log_after[i] + path_log[j]);
  if (i >= m && tree.on_path(j, i - m)) return expf(tree.log_after(log_decay + m, j, i - m));
  return 0.f;
}
template <int T>
__device__ __forceinline__ float window_decay(const DraftTree<T>& tree, const float* log_decay, const float* log_after,
                                              int m, int mc, int j, int i) {
  return window_decay(tree, tree.path_log, log_decay, log_after, m, mc, j, i);
}

// A record's weight in a draft: exactly zero off the draft's window (decay 0), even where the
// dot it scales is NaN or inf (another draft's poisoned inputs must not reach this one).
__device__ __forceinline__ float window_weight(float decay, float value) { return decay == 0.f ? 0.f : decay * value; }

// Without an early flush no CTA of a verify row reads ring rows from its first draft row on (the
// committed rows come before), so per item the CTAs that hold a row the heads share write it
// before they arrive, sparing the last arrival a round trip through the inputs: true (in every
// CTA of the row) where write_own(first) did so. An early flush's rows overwrite committed ones
// that every CTA reads: the last arrival writes them. (The split kernels keep NoOwnRows.)
template <class WriteOwn>
__device__ __forceinline__ bool wrote_own_rows(const VerifyRow& v, const WriteOwn& write_own) {
  return !v.flush && write_own(v.committed);
}
struct NoOwnRows {
  __device__ __forceinline__ bool operator()(int) const { return false; }
};

// The per-item verify's committed records: two ring row stagers (A, B) and one scalar ring.
// Where `early` (small batches) every ring row loads before the cursor read, a round trip saved
// for the bytes; else only the m rows held, after it. SCALAR false: no scalar ring read early.
template <typename a_t, int A_LEN, typename b_t, int B_LEN, int HELD, int THREADS, bool SCALAR = true>
struct HeldRecords {
  RowStager<a_t, A_LEN, HELD, THREADS> a;
  RowStager<b_t, B_LEN, HELD, THREADS> b;
  const a_t* a_src;
  int64_t a_stride;
  const b_t* b_src;
  int64_t b_stride;
  const float* scalars;
  bool early;
  float scalar_early;  // this thread's row of the scalar ring, where early

  __device__ __forceinline__ HeldRecords(bool early_, const a_t* a_src_, int64_t a_stride_, const b_t* b_src_,
                                         int64_t b_stride_, const float* scalars_)
      : a_src(a_src_), a_stride(a_stride_), b_src(b_src_), b_stride(b_stride_), scalars(scalars_), early(early_) {
    if (early) {
      a.load(a_src, a_stride, HELD);
      b.load(b_src, b_stride, HELD);
    }
    scalar_early = SCALAR && early && threadIdx.x < HELD ? scalars[threadIdx.x] : 0.f;
  }
  // After the cursor read: the m rows held, where they were not loaded early.
  __device__ __forceinline__ void load_held(int m) {
    if (!early) {
      a.load(a_src, a_stride, m);
      b.load(b_src, b_stride, m);
    }
  }
  // Scalar ring row i < m.
  __device__ __forceinline__ float scalar(int i) const { return early && i == threadIdx.x ? scalar_early : scalars[i]; }
  __device__ __forceinline__ void store(float (*a_dst)[A_LEN], float (*b_dst)[B_LEN], int m) const {
    a.store(a_dst, 0, m);
    b.store(b_dst, 0, m);
  }
};

// A verify or snapshot row this CTA must not run: its T drafts' outputs zero (a pad row) or NaN
// (a slot id out of range), nothing else touched. True where the CTA is then done.
template <int T, int ROWS, int THREADS, class OutOf>
__device__ __forceinline__ bool skip_unusable_draft_row(int slot, int pad_slot_id, int num_slots, const OutOf& out_of) {
  if (slot_usable(slot, pad_slot_id, num_slots)) return false;
  for (int j = 0; j < T; ++j) fill_outputs<ROWS, THREADS>(out_of(j), slot == pad_slot_id ? 0.f : fault_output());
  return true;
}

// A faulted verify row (its cursor is one no launch leaves): NaN in every draft's outputs.
template <int T, int ROWS, int THREADS, class OutOf>
__device__ __forceinline__ void fault_draft_row(const OutOf& out_of) {
  for (int j = 0; j < T; ++j) fill_outputs<ROWS, THREADS>(out_of(j), fault_output());
}

// An early flush's fold of `count` records into the CTA's tile s (FP32, laid out as Tile):
// s += sum_k w[k][r] v[k], per-row weights w [count][ROWS] and row vectors v [count][COLS] in
// shared memory (FP32 or as stored), exact FP32 FMAs.
template <class Tile, int ROWS, typename V>
__device__ __forceinline__ void fold_records(float (&s)[Tile::kPasses][Tile::kChunksPerLane][Tile::kVec],
                                             const float (*w)[ROWS], const V (*v)[Tile::kCols], int count) {
  for (int k = 0; k < count; ++k) {
    float wk[Tile::kPasses];
    Tile::row_values(&w[k][0], wk);
    #pragma unroll
    for (int c = 0; c < Tile::kChunksPerLane; ++c) {
      float v_c[Tile::kVec];
      Tile::chunk(&v[k][0], c, v_c);
      #pragma unroll
      for (int i = 0; i < Tile::kPasses; ++i)
        #pragma unroll
        for (int e = 0; e < Tile::kVec; ++e) s[i][c][e] = fmaf(wk[i], v_c[e], s[i][c][e]);
    }
  }
}

// An early flush's store of the CTA's new state s (laid out as Tile) into the copy it read, `at`
// (any format: row or block scales reduced and written), and, where SEPARATE, into the read copy
// `read_at` too, with the keys a step's flush rounds by (slot, epoch; the element's index).
// Called by every thread of the CTA (an NVFP4 copy reduces its head scale over the CTA).
template <class Tile, bool SR, bool SEPARATE, bool READ_SR, int HEAD_ROWS, int COLS, typename T, typename R>
__device__ __forceinline__ void store_flushed(const CopyRows<T, HEAD_ROWS, COLS>& at, const CopyRows<R, HEAD_ROWS, COLS>& read_at,
                                              const float (&s)[Tile::kPasses][Tile::kChunksPerLane][Tile::kVec],
                                              uint64_t seed, int slot, uint64_t epoch, int head, int row0) {
  const uint64_t sr_key = checkpoint_rounding_key<SR>(seed, slot, epoch);
  const uint64_t read_key = SEPARATE ? read_copy_rounding_key<READ_SR>(seed, slot, epoch) : 0;
  const float head_scale = prepare_store<Tile>(at, s);
  float read_head_scale = 0.f;
  if constexpr (SEPARATE) read_head_scale = prepare_store<Tile>(read_at, s);
  #pragma unroll
  for (int i = 0; i < Tile::kPasses; ++i) {
    const int r = Tile::row(i);
    const uint64_t element = (uint64_t(head) * HEAD_ROWS + row0 + r) * COLS;
    store_row<Tile, T, SR>(at, r, s[i], sr_key, element, head_scale);
    if constexpr (SEPARATE) store_row<Tile, R, READ_SR>(read_at, r, s[i], read_key, element, read_head_scale);
  }
}

// The CTA's tile s (FP32, laid out as Tile) times a per-column scale col[COLS] in shared memory
// (KDA's fold: a decay per key channel).
template <class Tile>
__device__ __forceinline__ void scale_columns(float (&s)[Tile::kPasses][Tile::kChunksPerLane][Tile::kVec],
                                              const float* col) {
  #pragma unroll
  for (int c = 0; c < Tile::kChunksPerLane; ++c) {
    float col_c[Tile::kVec];
    Tile::chunk(col, c, col_c);
    #pragma unroll
    for (int i = 0; i < Tile::kPasses; ++i)
      #pragma unroll
      for (int e = 0; e < Tile::kVec; ++e) s[i][c][e] *= col_c[e];
  }
}

// Writes the CTA's tile (rows row0.. of head `head`, HEAD_ROWS rows a head) back, stochastically
// rounded where SR with the standard steps' key (slot and epoch; the element's index in the slot).
template <class Tile, bool SR, int HEAD_ROWS, typename state_t>
__device__ __forceinline__ void store_tile(state_t* rows,
                                           const float (&s)[Tile::kPasses][Tile::kChunksPerLane][Tile::kVec],
                                           uint64_t seed, int slot, uint64_t epoch, int head, int row0) {
  const uint64_t sr_key = checkpoint_rounding_key<SR>(seed, slot, epoch);
  #pragma unroll
  for (int i = 0; i < Tile::kPasses; ++i)
    #pragma unroll
    for (int c = 0; c < Tile::kChunksPerLane; ++c)
      store_values<state_t, SR, Tile::kVec>(rows + int64_t(Tile::row(i)) * Tile::kCols + Tile::col(c), s[i][c], sr_key,
                               (uint64_t(head) * HEAD_ROWS + row0 + Tile::row(i)) * Tile::kCols + Tile::col(c));
}

// Dot products of rows of `rows` ([count][LEN], shared memory) with each of t draft rows
// (`drafts`, [t][LEN]): out[j * stride + i] = rows[i] . drafts[j], and (where `norms`)
// norms[i] = rows[i] . rows[i]. A warp per row and lanes over columns, with the drafts' columns
// held in registers, so that shared memory is read about once per row rather than once per pair.
template <int LEN, int T, int WARPS>
__device__ __forceinline__ void dots_with_drafts(const float (*rows)[LEN], int count, const float (*drafts)[LEN], int t,
                                                 float* out, int stride, float* norms) {
  constexpr int kPer = (LEN + 31) / 32;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float d[T][kPer];
  #pragma unroll
  for (int j = 0; j < T; ++j)
    #pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int c = lane + 32 * k;
      d[j][k] = j < t && c < LEN ? drafts[j][c] : 0.f;
    }
  for (int i = warp; i < count; i += WARPS) {
    float a[kPer];
    #pragma unroll
    for (int k = 0; k < kPer; ++k) a[k] = lane + 32 * k < LEN ? rows[i][lane + 32 * k] : 0.f;
    if (norms != nullptr) {
      float n = 0.f;
      #pragma unroll
      for (int k = 0; k < kPer; ++k) n = fmaf(a[k], a[k], n);
      n = group_sum<32>(n);
      if (lane == 0) norms[i] = n;
    }
    #pragma unroll
    for (int j = 0; j < T; ++j) {
      if (j < t) {
        float acc = 0.f;
        #pragma unroll
        for (int k = 0; k < kPer; ++k) acc = fmaf(a[k], d[j][k], acc);
        acc = group_sum<32>(acc);
        if (lane == 0) out[j * stride + i] = acc;
      }
    }
  }
}

// Global-to-global copy of `rows` rows of LEN elements of T (row i from src(i) to dst(i)), in
// the widest vectors that divide a row, a few loads in flight per thread before their stores.
template <typename T, int LEN, int THREADS, class Src, class Dst>
__device__ __forceinline__ void copy_rows(int rows, Src src, Dst dst) {
  constexpr int kBytes = row_vector_bytes<T, LEN>();
  constexpr int kPerRow = LEN * int(sizeof(T)) / kBytes;
  constexpr int kBatch = 4;
  using Raw = typename RawVec<kBytes>::type;
  const int total = rows * kPerRow;
  for (int base = threadIdx.x; base < total; base += THREADS * kBatch) {
    Raw v[kBatch];
    #pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int idx = base + u * THREADS;
      if (idx < total) v[u] = reinterpret_cast<const Raw*>(src(idx / kPerRow))[idx % kPerRow];
    }
    #pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int idx = base + u * THREADS;
      if (idx < total) reinterpret_cast<Raw*>(dst(idx / kPerRow))[idx % kPerRow] = v[u];
    }
  }
}

// Rows of one ring of a slot pool, [slots, heads, CAP, row_bytes] (any element type), slots
// slot_bytes apart (heads * CAP * row_bytes when packed).
struct RingRows {
  unsigned char* base;
  int64_t heads, row_bytes, slot_bytes;
};

// Every ring a commit moves: the three each layout has, then a read copy's (base nullptr: none).
struct CommitRings {
  static constexpr int kMax = 5;
  RingRows ring[kMax];
};

// Commit of accepted drafts, one CTA per batch row: a = clamp(num_accepted, 0, pending). For a
// tree (path given) every ring's row n + path[i] moves to n + i, for i = 0..a-1 in order: a root
// path increases, so no row is overwritten before it is read. Then n += a and nothing is pending.
template <int L, int T, int THREADS>
__global__ void __launch_bounds__(THREADS) commit_kernel(int32_t* cursors, int64_t cursor_slot_stride, CommitRings rings,
                                                          const int32_t* num_accepted, const int32_t* path,
                                                          const int32_t* slot_indices, int32_t pad_slot_id,
                                                          int32_t num_slots) {
  constexpr int kCap = L + T;
  const int row = blockIdx.x;
  const int slot = slot_indices[row];
  if (!slot_usable(slot, pad_slot_id, num_slots)) return;
  int32_t* cursor = slot_cursor(cursors, cursor_slot_stride, slot);
  const int4 w = *reinterpret_cast<const int4*>(cursor);
  const int held = w.x, pending = w.w;
  if (held < 0 || pending < 0 || pending > T || held + pending > kCap - 1) return;  // a corrupted cursor
  const int accepted = min(max(num_accepted[row], 0), pending);
  if (path != nullptr) {
    // Row `from` of one ring to row `to`, for every head of the slot, a 4-byte word per thread.
    const auto move_row = [&](const RingRows& ring, int from, int to) {
      if (ring.base == nullptr) return;
      unsigned char* slot_rows = ring.base + int64_t(slot) * ring.slot_bytes;
      const int64_t words = ring.row_bytes / 4;  // every ring row is a whole number of 4-byte words
      for (int64_t e = threadIdx.x; e < ring.heads * words; e += THREADS) {
        const int64_t h = e / words, c = e % words;
        uint32_t* head_rows = reinterpret_cast<uint32_t*>(slot_rows + h * kCap * ring.row_bytes);
        head_rows[(held + to) * words + c] = head_rows[(held + from) * words + c];
      }
    };
    for (int i = 0; i < accepted; ++i) {
      const int from = min(max(path[int64_t(row) * T + i], 0), pending - 1);
      if (from != i) {
        #pragma unroll
        for (int k = 0; k < CommitRings::kMax; ++k) move_row(rings.ring[k], from, i);
      }
      __syncthreads();
    }
  }
  if (threadIdx.x == 0) *reinterpret_cast<int4*>(cursor) = make_int4(held + accepted, w.y, 0, 0);
}

}  // namespace replayssm
