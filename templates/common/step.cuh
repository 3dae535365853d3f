// The ReplaySSM step protocol, written once for every kernel of every family: which cursor
// words a step reads, whether the row may run, whether it flushes, what a split step's records
// kernel hands its state kernel, and how the cursor advances; for a verify, the same for its
// drafts. A kernel sequences them as open_step, valid(), decide(), then arrive_after_cursor_reads and close_step (per item) or
// store_step / load_step / close_split_step (split). The torch twin is
// replayssm_jit/ops/torch_path/protocol.py; the contract (cursor words, flush decision, fused
// commit) is docs/speculative.md.
#pragma once
#include "common/opening.cuh"

namespace replayssm {

// Cursor words per slot: records held, flush epoch (keys SR noise), CTA arrivals, pending drafts.
constexpr int kCursorWords = 4;

// A slot's cursor as a step reads it, in one 8-byte load: records held and flush epoch. The epoch
// is read up front even where no rounding needs it, so advancing it later is a plain store rather
// than a dependent read at the end of the step.
struct SlotCursor {
  int held, epoch;
};
__device__ __forceinline__ SlotCursor read_slot_cursor(const int32_t* cursor) {
  const int2 words = *reinterpret_cast<const int2*>(cursor);
  return SlotCursor{words.x, words.y};
}

// Run by the last arrival of a slot's batch row: records held (none after a flush), the flush
// epoch read at the step's start advanced, the arrival count reset for the next launch, and a
// verify's pending drafts (word 3) dropped, as a step commits none of them.
__device__ __forceinline__ void advance_slot_cursor(int32_t* cursor, bool flushed, int records, int epoch) {
  cursor[0] = flushed ? 0 : records;
  if (flushed) cursor[1] = epoch + 1;
  *reinterpret_cast<int2*>(cursor + 2) = make_int2(0, 0);
}

// Whether a per-item step counts its CTAs' arrivals: all but a step that flushes every token
// (flush_every_step) with nothing held, which changes only the flush epoch, which no CTA of the
// launch reads unless SR keys its rounding (then the row's first CTA advances it alone).
template <bool SR>
__device__ __forceinline__ bool counts_arrivals(bool flush_every_step, int records) {
  return SR || !flush_every_step || records != 1;
}

// A per-item CTA's arrival, counted by thread 0 past a barrier that follows every thread's use of
// the slot's cursor (so no CTA can see a half-advanced one): early, so that the count's round
// trip overlaps the step's rows. Returns the arrival's order (thread 0 only; -1 where uncounted).
template <bool SR>
__device__ __forceinline__ int arrive_after_cursor_reads(int32_t* cursor, bool flush_every_step, int records) {
  if (threadIdx.x != 0 || !counts_arrivals<SR>(flush_every_step, records)) return -1;
  __threadfence();
  return atomicAdd(cursor + 2, 1);
}

// End of a per-item ReplaySSM step: the row's last arrival (arrive_after_cursor_reads) advances
// the cursor; an uncounted step (counts_arrivals) advances only the epoch, from the first CTA.
template <bool SR>
__device__ __forceinline__ void finish_step_cursor(int32_t* cursor, int ctas_per_row, bool first_cta,
                                                   bool flush_every_step, bool flushed, int records, int epoch,
                                                   int arrival) {
  if (threadIdx.x != 0) return;
  if (!counts_arrivals<SR>(flush_every_step, records)) {
    if (first_cta) {
      cursor[1] = epoch + 1;
      cursor[3] = 0;  // pending drafts dropped (advance_slot_cursor)
    }
  } else if (arrival == ctas_per_row - 1) {
    advance_slot_cursor(cursor, flushed, records, epoch);
  }
}

// A step leaves 0..L-1 records held, and a commit of drafts (CAP = L + T, T >= 2) up to CAP - 1
// (docs/speculative.md): any other count is a corrupted cursor, and the row must then touch
// neither its rings nor its checkpoint.
template <int L, int CAP>
__host__ __device__ __forceinline__ bool held_count_valid(int held) {
  constexpr int kMaxHeld = CAP > L + 1 ? CAP - 1 : L - 1;
  return unsigned(held) <= unsigned(kMaxHeld);
}

// A slot's cursor words in cursors [slots, kCursorWords], slots `slot_stride` words apart (kCursorWords
// when packed; more inside an engine's cache pages).
__device__ __forceinline__ int32_t* slot_cursor(int32_t* cursors, int64_t slot_stride, int slot) {
  return cursors + int64_t(slot) * slot_stride;
}

// Modules built with the "flush_mask" flag also flush a batch row whose byte in the engine's
// [batch] mask (Params::flush_mask; null: none given) is nonzero, as SGLang's prefix tracking
// needs the whole state at that token. The rule is flush_masked(); every kernel that decides a
// step adds it as `kFlushMask && flush_masked(p, row)`, which the compiler's front end drops
// whole without the flag, so those modules compile as before (even an inlined call that
// returns false reorders GDN's per-item SASS: scripts/compare_sass.py).
#ifndef REPLAYSSM_FLUSH_MASK
#define REPLAYSSM_FLUSH_MASK 0
#endif
constexpr bool kFlushMask = REPLAYSSM_FLUSH_MASK != 0;

// Whether batch row `row` flushes now whatever its record count: its flush_mask byte is nonzero.
template <class Params>
__host__ __device__ __forceinline__ bool flush_masked(const Params& p, int row) {
  return p.flush_mask != nullptr && p.flush_mask[row] != 0;
}

// One batch row's step, decided: records held before this token, the records replayed with it,
// the flush epoch read at the start, and whether they are folded into the checkpoint now.
struct StepDecision {
  int held, records, epoch;
  bool flush;
};

// A step's cursor as opened, before the decision (host and device: tests/protocol/
// test_step_protocol_agrees.py holds it against the torch path's). The decision is formed only past the validity
// check (decide()), where the compiler knows the held count's range. A conventional step (REPLAY
// false) holds nothing and always "flushes" (writes the state); a replay step flushes when its
// records reach L, or every step.
template <bool REPLAY, int L, int CAP>
struct OpenedStep {
  int held, epoch;
  // False for a cursor no launch leaves: the row then touches nothing of its slot (NaN outputs).
  __host__ __device__ __forceinline__ bool valid() const { return !REPLAY || held_count_valid<L, CAP>(held); }
  // every_step() (flush-every-step mode) is called only where the record count does not already
  // decide, as `||` would read a flag; literals for a conventional step, so that the kernel's
  // loops over records fold as constants.
  template <class EveryStep>
  __host__ __device__ __forceinline__ StepDecision decide(EveryStep every_step) const {
    if constexpr (REPLAY) {
      const int records = held + 1;
      return {held, records, epoch, records >= L || every_step()};
    } else {
      return {0, 1, 0, true};
    }
  }
  // What a split records kernel hands over for a row it found invalid (no flush).
  __host__ __device__ __forceinline__ StepDecision faulted() const { return {held, held + 1, epoch, false}; }
};

// Opens a step: reads the slot's cursor (REPLAY; none for a conventional step).
template <bool REPLAY, int L, int CAP>
__device__ __forceinline__ OpenedStep<REPLAY, L, CAP> open_step(const int32_t* cursor) {
  if constexpr (REPLAY) {
    const SlotCursor at_start = read_slot_cursor(cursor);
    return {at_start.held, at_start.epoch};
  } else {
    return {0, 0};
  }
}

// A split step's hand-over (common/split.cuh): the records kernel's decision in three int32 words
// (held, flush, epoch), read by every state CTA of the row, which re-checks the held count.
__device__ __forceinline__ void store_step(int32_t* words, const StepDecision& s) {
  words[0] = s.held;
  words[1] = s.flush;
  words[2] = s.epoch;
}
template <int L, int CAP>
struct HandedStep {
  int held;
  bool flush;
  int epoch;
  __host__ __device__ __forceinline__ bool valid() const { return held_count_valid<L, CAP>(held); }
  __host__ __device__ __forceinline__ StepDecision decide() const { return {held, held + 1, epoch, flush}; }
};
template <int L, int CAP>
__device__ __forceinline__ HandedStep<L, CAP> load_step(const int32_t* words) {
  return {words[0], words[1] != 0, words[2]};  // the words in order
}

// Closes a split step: one state CTA of the row, past the records kernel (no cursor readers left).
__device__ __forceinline__ void close_split_step(int32_t* cursor, const StepDecision& s) {
  advance_slot_cursor(cursor, s.flush, s.records, s.epoch);
}

// Closes a per-item step, its arrival counted (finish_step_cursor).
template <bool SR>
__device__ __forceinline__ void close_step(int32_t* cursor, const StepDecision& s, int ctas_per_row, bool first_cta,
                                           bool flush_every_step, int arrival) {
  finish_step_cursor<SR>(cursor, ctas_per_row, first_cta, flush_every_step, s.flush, s.records, s.epoch, arrival);
}

// A verify row as its launch starts: committed records after the fused commit, drafts this step,
// whether it flushes the committed records first, and the epoch that keys that flush's rounding.
struct VerifyRow {
  int committed, drafts, epoch;
  bool flush, valid;
};

// Reads a slot's cursor (words 0-3 in one load) and the row's optional per-row counts. Invalid
// device counts are clamped; an impossible cursor marks the row invalid (it then touches nothing).
template <int L, int T>
__device__ __forceinline__ VerifyRow read_verify_row(const int32_t* cursor, const int32_t* num_drafts,
                                                     const int32_t* num_accepted, int row) {
  constexpr int kCap = L + T;
  const int4 w = *reinterpret_cast<const int4*>(cursor);
  const int held = w.x, pending = w.w;
  VerifyRow v;
  v.valid = held >= 0 && pending >= 0 && pending <= T && held + pending <= kCap - 1;
  const int accepted = num_accepted != nullptr ? min(max(num_accepted[row], 0), pending) : 0;
  v.committed = held + accepted;
  v.drafts = num_drafts != nullptr ? min(max(num_drafts[row], 0), T) : T;
  v.flush = v.committed + v.drafts >= kCap;
  v.epoch = w.y;
  return v;
}

// A verify row as a split verify's records kernel read it, handed to its state kernel in four
// int32 words (the records kernel writes no cursor).
__device__ __forceinline__ void store_verify_row(int32_t* words, const VerifyRow& v) {
  words[0] = v.committed;
  words[1] = v.drafts;
  words[2] = v.epoch;
  words[3] = int(v.flush) | int(v.valid) << 1;
}
__device__ __forceinline__ VerifyRow load_verify_row(const int32_t* words) {
  VerifyRow v;
  v.committed = words[0];
  v.drafts = words[1];
  v.epoch = words[2];
  v.flush = (words[3] & 1) != 0;
  v.valid = (words[3] & 2) != 0;
  return v;
}

// Called by every CTA of a verify row after its last read of the slot's rings and cursor: true
// (in every thread of the CTA) for the row's last arrival, which may then overwrite the rows that
// CTAs share (all of them have read what they need) and advances the cursor with
// finish_verify_cursor. `flag` is a shared-memory word.
__device__ __forceinline__ bool last_arrival(int32_t* cursor, int ctas_per_row, int* flag) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    *flag = atomicAdd(cursor + 2, 1) == ctas_per_row - 1;
  }
  __syncthreads();
  return *flag != 0;
}

// A verify's cursor: committed records (none after the early flush), the epoch advanced by a
// flush, the arrival count reset, and the drafts pending until a commit.
__device__ __forceinline__ void finish_verify_cursor(int32_t* cursor, const VerifyRow& v) {
  if (threadIdx.x == 0) {
    *reinterpret_cast<int4*>(cursor) = make_int4(v.flush ? 0 : v.committed, v.epoch + (v.flush ? 1 : 0), 0, v.drafts);
  }
}

}  // namespace replayssm
