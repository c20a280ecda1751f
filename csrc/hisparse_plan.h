// SPDX-License-Identifier: Apache-2.0
// Hybrid HiSparse fused resolution plan: the decisions of plan_resolution
// (vllm/v1/hisparse/resolver.py) for one step and one top-K selection, one thread
// block per request with HOST pages, everything in shared memory.
//
// The algorithm is written once, here, for two builds:
// - CUDA (hisparse_plan.cu): HS_FOR spreads a loop over the block's threads,
//   HS_SYNC is __syncthreads(), HS_SINGLE is thread 0;
// - host (tests/support/plan_host.cpp, compiled by the tests with the C++ compiler):
//   the same phases run one after another on one CPU thread, with kPlanThreads
//   virtual threads where a phase is split by thread, so the CPU test suite holds the
//   algorithm to the torch reference on every run.
// Every phase writes only what its own index owns; phases are separated by barriers
// that every thread reaches (no barrier sits inside a data-dependent branch), and every
// decision is read from the inputs or from a completed earlier phase.
//
// Per request m (hot state row m):
// 1. its tokens (token_requests[t] == m), in order;
// 2. one key per entry: position << 32 | local entry index for positions on HOST pages,
//    a sentinel otherwise; bitonic sort, so equal positions are adjacent and ascending;
// 3. the hot buffer's held positions, sorted; each distinct key is looked up by binary
//    search: a hit selects its slot (distinct keys, distinct slots);
// 4. eligible slots in LRU order: one sort of (selected, stamp + 1, slot);
// 5. misses ranked by an exclusive scan in ascending position order: the r-th takes the
//    r-th eligible slot, beyond them staging slot H + (r - eligible), beyond the leased
//    staging an overflow error; the hot state is updated for hits and hot misses;
// 6. each entry takes the slot of the first entry of its run (a fill-forward scan).
// Each distinct miss is loaded through its first entry (the lowest entry index), so the
// load arrays are per entry, masked by `load`.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define HS_HD __device__ __forceinline__
#define HS_FOR(i, n) for (int64_t i = threadIdx.x; i < (n); i += blockDim.x)
#define HS_FOR_THREADS(t) for (int t = threadIdx.x; t < kPlanThreads; t += blockDim.x)
#define HS_SYNC() __syncthreads()
#define HS_SINGLE if (threadIdx.x == 0)
#define HS_ATOMIC_ADD(p, v) \
  atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v))
#define HS_ATOMIC_OR(p, v) atomicOr(p, v)
#else
#define HS_HD inline
#define HS_FOR(i, n) for (int64_t i = 0; i < (n); ++i)
#define HS_FOR_THREADS(t) for (int t = 0; t < kPlanThreads; ++t)
#define HS_SYNC() ((void)0)
#define HS_SINGLE if (true)
#define HS_ATOMIC_ADD(p, v) (*(p) += (v))
#define HS_ATOMIC_OR(p, v) (*(p) |= (v))
#endif

#include "hisparse_errors.h"

namespace hisparse {

constexpr int kPlanThreads = 512;
// Above these, plan_resolution's torch operations serve (a prefill chunk, a huge buffer).
constexpr int64_t kPlanMaxEntries = 8192;  // a request's tokens x top-K in one step
constexpr int64_t kPlanMaxHotRows = 8192;
constexpr int64_t kKeySentinel = (static_cast<int64_t>(0x7FFFFFFF) << 32) | 0xFFFFFFFFll;
constexpr int64_t kEntryBits = 14;  // a request's entries in one step < 2**14
constexpr int64_t kEntryMask = (static_cast<int64_t>(1) << kEntryBits) - 1;
constexpr int64_t kCodeAndEntryMask = (static_cast<int64_t>(1) << 32) - 1;
constexpr int64_t kSlotBits = 14;  // hot slots < 2**14 in an LRU key
constexpr int64_t kSlotMask = (static_cast<int64_t>(1) << kSlotBits) - 1;
constexpr int64_t kStampBits = 48;  // stamps + 1 < 2**48
constexpr int64_t kSelectedBit = static_cast<int64_t>(1) << (kSlotBits + kStampBits);

struct PlanArgs {
  const int32_t* positions;        // [T, K]
  const int64_t* token_requests;   // [T]: hot state row, -1 for a request without HOST pages
  const int64_t* host_page_table;  // [R, P]
  const int64_t* table_rows;       // [M]
  int64_t* hot_positions;          // [M, H], updated
  int64_t* hot_stamps;             // [M, H], updated
  const int64_t* staging_slots;    // [M]
  int64_t num_tokens, topk, num_requests, hot_rows, table_height, num_pages, block_size, step;
  int64_t max_entries;  // >= any request's tokens x topk; a power of two
  int64_t hot_pad;      // >= hot_rows; a power of two
  // Outputs, zeroed by the caller, [T, K] flattened:
  bool* on_host;
  int64_t* entry_request;
  int64_t* entry_slot;
  bool* load;
  int64_t* load_request;
  int64_t* load_slot;
  int64_t* load_host_row;
  int64_t* counts;                    // [3]: rows loaded, hit, staged (added to)
  unsigned long long* error;          // the step's error word (OR-ed into)
  unsigned long long* request_error;  // [M]: each request's own error word (OR-ed into)
};

// Shared scratch of one block: keys [max_entries], held [hot_pad], partial
// [kPlanThreads + 1], scalars [4] (int64); lanes [max_entries], tokens
// [max_entries / topk + 1] (int32).
struct PlanScratch {
  int64_t* keys;
  int64_t* held;
  int64_t* partial;
  int64_t* scalars;  // token count, table row, eligible slots
  int32_t* lanes;
  int32_t* tokens;
};

constexpr int64_t plan_scratch_bytes(int64_t max_entries, int64_t hot_pad, int64_t topk) {
  return 8 * (max_entries + hot_pad + kPlanThreads + 1 + 4) +
         4 * (max_entries + max_entries / topk + 1);
}

HS_HD void bitonic_sort(int64_t* a, int64_t n) {
  for (int64_t k = 2; k <= n; k <<= 1) {
    for (int64_t j = k >> 1; j > 0; j >>= 1) {
      HS_FOR(i, n) {
        const int64_t partner = i ^ j;
        if (partner > i) {
          const bool ascending = (i & k) == 0;
          const int64_t x = a[i], y = a[partner];
          if ((x > y) == ascending) {
            a[i] = y;
            a[partner] = x;
          }
        }
      }
      HS_SYNC();
    }
  }
}

// In place: a[0..kPlanThreads) becomes its inclusive scan under `op` (associative), in
// parallel: a work-efficient (Brent-Kung) scan, log2(kPlanThreads) up-sweep steps and one
// fewer down-sweep steps. In each step every index writes one element and reads another
// that no index writes in that step, and a barrier ends each step, so the block's threads
// (or the host build's virtual threads, one after another) never race.
template <typename Op>
HS_HD void scan_partials(int64_t* a, Op op) {
  static_assert((kPlanThreads & (kPlanThreads - 1)) == 0, "the scan needs a power of two");
  for (int64_t d = 1; d < kPlanThreads; d <<= 1) {
    HS_FOR_THREADS(t) {
      const int64_t i = (t + 1) * 2 * d - 1;  // = 2d - 1 (mod 2d); reads d - 1 (mod 2d)
      if (i < kPlanThreads) a[i] = op(a[i - d], a[i]);
    }
    HS_SYNC();
  }
  for (int64_t d = kPlanThreads / 4; d >= 1; d >>= 1) {
    HS_FOR_THREADS(t) {
      const int64_t i = (t + 1) * 2 * d - 1;  // writes i + d = d - 1 (mod 2d)
      if (i + d < kPlanThreads) a[i + d] = op(a[i], a[i + d]);
    }
    HS_SYNC();
  }
}

struct ScanSum {
  HS_HD int64_t operator()(int64_t left, int64_t right) const { return left + right; }
};

// The last value that is not -1: a run's slot carried forward.
struct ScanCarry {
  HS_HD int64_t operator()(int64_t left, int64_t right) const { return right != -1 ? right : left; }
};

// Exclusive prefix sum of values[0..n) into out (out may alias values), split into
// kPlanThreads contiguous chunks; returns the total (valid after the call, in scratch).
HS_HD void exclusive_scan(const int32_t* values, int32_t* out, int64_t n, int64_t* partial) {
  const int64_t chunk = (n + kPlanThreads - 1) / kPlanThreads;
  HS_FOR_THREADS(t) {
    int64_t sum = 0;
    for (int64_t i = t * chunk; i < n && i < (t + 1) * chunk; ++i) sum += values[i];
    partial[t + 1] = sum;
    if (t == 0) partial[0] = 0;
  }
  HS_SYNC();
  scan_partials(partial + 1, ScanSum());
  HS_FOR_THREADS(t) {
    int64_t running = partial[t];
    for (int64_t i = t * chunk; i < n && i < (t + 1) * chunk; ++i) {
      const int32_t v = values[i];
      out[i] = static_cast<int32_t>(running);
      running += v;
    }
  }
  HS_SYNC();
}

// In place: every -1 takes the last value before it that is not -1 (runs start with one).
HS_HD void fill_forward(int32_t* values, int64_t n, int64_t* partial) {
  const int64_t chunk = (n + kPlanThreads - 1) / kPlanThreads;
  HS_FOR_THREADS(t) {
    int64_t last = -1;
    for (int64_t i = t * chunk; i < n && i < (t + 1) * chunk; ++i) {
      if (values[i] != -1) last = values[i];
    }
    partial[t + 1] = last;
    if (t == 0) partial[0] = -1;
  }
  HS_SYNC();
  scan_partials(partial + 1, ScanCarry());
  HS_FOR_THREADS(t) {
    int64_t carried = partial[t];
    for (int64_t i = t * chunk; i < n && i < (t + 1) * chunk; ++i) {
      if (values[i] == -1) {
        values[i] = static_cast<int32_t>(carried);
      } else {
        carried = values[i];
      }
    }
  }
  HS_SYNC();
}

// Entry keys: position << 32 | (code + 2) << kEntryBits | local entry index, where the
// code (set in phase 3) is the hit slot, -1 for a miss, -2 for a run's later entries.
HS_HD int64_t key_position(int64_t key) { return key >> 32; }
HS_HD int64_t key_entry(int64_t key) { return key & kEntryMask; }
HS_HD int64_t key_code(int64_t key) { return ((key >> kEntryBits) & 0x7FFF) - 2; }

// The plan of request row m. All threads of the block call it, and reach every barrier.
HS_HD void plan_request(const PlanArgs& a, int64_t m, const PlanScratch& s) {
  const int64_t H = a.hot_rows, K = a.topk;
  const int64_t max_tokens = a.max_entries / K;
  // 1. Tokens of request m, in order (each virtual thread counts a chunk of the batch,
  // a scan places the chunks), and its row of the host page table.
  const int64_t chunk = (a.num_tokens + kPlanThreads - 1) / kPlanThreads;
  HS_FOR_THREADS(t) {
    int64_t count = 0;
    bool stray =
        false;  // a token's request outside [-1, M): no request plans it, so it reads as resident
    for (int64_t i = t * chunk; i < a.num_tokens && i < (t + 1) * chunk; ++i) {
      const int64_t r = a.token_requests[i];
      count += r == m;
      stray |= r < -1 || r >= a.num_requests;
    }
    if (stray && m == 0) HS_ATOMIC_OR(a.error, kErrorRequestOutOfBounds);
    s.partial[t + 1] = count;
    if (t == 0) s.partial[0] = 0;
  }
  HS_SYNC();
  scan_partials(s.partial + 1, ScanSum());
  HS_SINGLE {
    int64_t count = s.partial[kPlanThreads];
    int64_t row = a.table_rows[m];
    if (count > max_tokens || row < 0 || row >= a.table_height) {
      HS_ATOMIC_OR(a.error, kErrorRequestOutOfBounds);
      count = count > max_tokens ? max_tokens : count;
      row = row < 0 ? 0 : (row >= a.table_height ? a.table_height - 1 : row);
    }
    s.scalars[0] = count;
    s.scalars[1] = row;
    s.scalars[2] = 0;  // eligible slots, counted in phase 4
  }
  HS_SYNC();
  HS_FOR_THREADS(t) {
    int64_t at = s.partial[t];
    for (int64_t i = t * chunk; i < a.num_tokens && i < (t + 1) * chunk; ++i) {
      if (a.token_requests[i] == m) {
        if (at < max_tokens) s.tokens[at] = static_cast<int32_t>(i);
        ++at;
      }
    }
  }
  HS_SYNC();
  const int64_t entries = s.scalars[0] * K;
  const int64_t* table = a.host_page_table + s.scalars[1] * a.num_pages;

  // 2. One key per entry on a HOST page; the per-entry outputs that need no slot.
  HS_FOR(e, a.max_entries) {
    int64_t key = kKeySentinel;
    if (e < entries) {
      const int64_t flat = static_cast<int64_t>(s.tokens[e / K]) * K + e % K;
      const int64_t p = a.positions[flat];
      const int64_t page = p >= 0 ? p / a.block_size : a.num_pages;
      if (page < a.num_pages && table[page] >= 0) {
        key = (p << 32) | e;
        a.on_host[flat] = true;
        a.entry_request[flat] = m;
      }
    }
    s.keys[e] = key;
  }
  HS_FOR(slot, a.hot_pad) {
    const int64_t p = slot < H ? a.hot_positions[m * H + slot] : -1;
    s.held[slot] = p >= 0 ? ((p << 32) | slot) : kKeySentinel;
  }
  HS_SYNC();
  bitonic_sort(s.keys, a.max_entries);
  bitonic_sort(s.held, a.hot_pad);

  // 3. The first entry of each run of one position looks it up among the held
  // positions: its code is the hit slot, or -1 for a miss (-2 for the run's other
  // entries). The code then joins the key, and lanes[i] flags the misses for the scan.
  HS_FOR(i, a.max_entries) {
    const int64_t key = s.keys[i];
    int64_t code = -2;
    if (key != kKeySentinel && (i == 0 || key_position(s.keys[i - 1]) != key_position(key))) {
      const int64_t p = key_position(key);
      int64_t lo = 0, hi = a.hot_pad;  // the first held key whose position is >= p
      while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (key_position(s.held[mid]) < p) {
          lo = mid + 1;
        } else {
          hi = mid;
        }
      }
      const bool found =
          lo < a.hot_pad && s.held[lo] != kKeySentinel && key_position(s.held[lo]) == p;
      code = found ? key_entry(s.held[lo]) : -1;
    }
    s.lanes[i] = static_cast<int32_t>(code);
  }
  HS_SYNC();
  HS_FOR(i, a.max_entries) {
    const int64_t key = s.keys[i];
    const int64_t code = s.lanes[i];
    if (key != kKeySentinel)
      s.keys[i] = (key & ~kCodeAndEntryMask) | ((code + 2) << kEntryBits) | key_entry(key);
    s.lanes[i] = code == -1 ? 1 : 0;
  }
  HS_SYNC();

  // 4. Eligible slots in LRU order: keys (selected, stamp + 1, slot), sorted ascending.
  HS_FOR(slot, a.hot_pad) {
    s.held[slot] =
        slot < H ? (((a.hot_stamps[m * H + slot] + 1) << kSlotBits) | slot) : kKeySentinel;
  }
  HS_SYNC();
  HS_FOR(i, a.max_entries) {
    const int64_t code = key_code(s.keys[i]);
    if (s.keys[i] != kKeySentinel && code >= 0) s.held[code] |= kSelectedBit;  // distinct slots
  }
  HS_SYNC();
  HS_FOR(slot, H) {
    if (!(s.held[slot] & kSelectedBit)) HS_ATOMIC_ADD(&s.scalars[2], 1);
  }
  HS_SYNC();
  bitonic_sort(s.held, a.hot_pad);

  // 5. Miss ranks in ascending position order.
  exclusive_scan(s.lanes, s.lanes, a.max_entries, s.partial);
  const int64_t eligible = s.scalars[2];
  const int64_t staging = a.staging_slots[m];

  // 6. Slots of the first entries; hot state, loads and counters.
  int64_t loaded = 0, hits = 0, staged = 0;
  HS_FOR(i, a.max_entries) {
    const int64_t key = s.keys[i];
    const int64_t code = key_code(key);
    int32_t slot = -1;
    if (key != kKeySentinel && code >= 0) {
      slot = static_cast<int32_t>(code);
      a.hot_stamps[m * H + slot] = a.step;
      ++hits;
    } else if (key != kKeySentinel && code == -1) {
      const int64_t p = key_position(key);
      const int64_t rank = s.lanes[i];
      bool copy = true;
      if (rank < eligible) {
        slot = static_cast<int32_t>(s.held[rank] & kSlotMask);
        a.hot_positions[m * H + slot] = p;
        a.hot_stamps[m * H + slot] = a.step;
      } else if (rank - eligible < staging) {
        slot = static_cast<int32_t>(H + rank - eligible);
        ++staged;
      } else {
        HS_ATOMIC_OR(a.error, kErrorStagingOverflow);
        HS_ATOMIC_OR(a.request_error + m, kErrorStagingOverflow);
        slot = 0;
        copy = false;
      }
      if (copy) {
        const int64_t e = key_entry(key);
        const int64_t flat = static_cast<int64_t>(s.tokens[e / K]) * K + e % K;
        a.load[flat] = true;
        a.load_request[flat] = m;
        a.load_slot[flat] = slot;
        a.load_host_row[flat] = table[p / a.block_size] * a.block_size + p % a.block_size;
        ++loaded;
      }
    }
    s.lanes[i] = slot;
  }
  if (loaded) HS_ATOMIC_ADD(&a.counts[0], loaded);
  if (hits) HS_ATOMIC_ADD(&a.counts[1], hits);
  if (staged) HS_ATOMIC_ADD(&a.counts[2], staged);
  HS_SYNC();

  // 7. Every entry of a run takes its first entry's slot.
  fill_forward(s.lanes, a.max_entries, s.partial);
  HS_FOR(i, a.max_entries) {
    const int64_t key = s.keys[i];
    if (key != kKeySentinel) {
      const int64_t e = key_entry(key);
      a.entry_slot[static_cast<int64_t>(s.tokens[e / K]) * K + e % K] = s.lanes[i];
    }
  }
}

}  // namespace hisparse
