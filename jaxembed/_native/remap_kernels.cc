// The dynamic table's remap as XLA FFI handlers: the native CPU twins of
// jaxembed/kernels/remap.py's `lookup` and `step`, bit for bit (the policy itself is stated,
// one id at a time, in jaxembed/dynamic/reference.py).
//
// Shapes (one table or shard): ids u32[M, 2] (low half, high half), keys u32[C, 2],
// last_seen / count i32[C], sketch i32[D, W] ([0, 0] without admission counting),
// sketch_total i32[1]; C = num_buckets · S, bucket b holding rows [b·S, (b+1)·S).
//
// Where XLA sorts, these kernels hash: the batch's distinct ids come from an open-addressing
// table keyed by the 64-bit id (O(M)), and only the candidates (ids due for a row, few once
// the table is warm) are sorted: a stable radix sort by bucket (common.h's SortSlotsByKey),
// then each bucket's few by (estimate descending, id). Each bucket's free slots and victims
// are ordered exactly as remap._pick orders them, but only as far as its candidates need.
//
// Threads: the hash of every id, the probe of every distinct id's bucket (hits touched in
// place: distinct ids hold distinct rows), the assignment (split at bucket boundaries: buckets
// are disjoint) and the rows of the slots are split over a `Team`; the dedup and the sketch's
// adds run on the calling thread. Every output is laid out in the order XLA gives it, so none
// depends on the thread count. The idea of prefetching the bucket a few ids ahead is FBGEMM's
// EmbeddingSpMDM (`prefetch=16`), applied here to the identity array and the metadata.
//
// Every shape and attribute is checked and a bad one returns an ffi::Error that names it.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "ffi_checks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxembed {
namespace {

// ---- the hash: MurmurHash3_x86_32 of the id's 8 bytes (jaxembed/dynamic/keys.py) --------------

constexpr int32_t kInt32Max = std::numeric_limits<int32_t>::max();

inline uint32_t Rotl(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

inline uint32_t Fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

inline uint32_t Murmur(uint32_t lo, uint32_t hi, uint32_t seed) {
  uint32_t h = seed;
  for (uint32_t block : {lo, hi}) {
    uint32_t k = block * 0xCC9E2D51u;
    k = Rotl(k, 15) * 0x1B873593u;
    h = Rotl(h ^ k, 13) * 5u + 0xE6546B64u;
  }
  return Fmix32(h ^ 8u);
}

// keys.stream_seed: the seed of hash stream `stream` of a table seeded `seed`.
inline uint32_t StreamSeed(uint32_t seed, uint32_t stream) {
  return Fmix32(seed ^ Fmix32(stream * 0x9E3779B9u + 1u));
}
constexpr uint32_t kStreamBucket = 0, kStreamSketch = 2;

constexpr uint64_t kEmptyId = ~uint64_t{0};  // keys.EMPTY_ID: both halves 0xFFFFFFFF

// A key u32[2] (low, high) as its 64-bit id: one load on a little-endian machine.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "keys are read as little-endian u64");
inline uint64_t Key64(const uint32_t* key) {
  uint64_t v;
  std::memcpy(&v, key, sizeof(v));
  return v;
}
inline void SetKey(uint32_t* key, uint64_t v) { std::memcpy(key, &v, sizeof(v)); }
inline bool IsEmpty(const uint32_t* key) { return Key64(key) == kEmptyId; }
inline uint32_t Lo(uint64_t v) { return static_cast<uint32_t>(v); }
inline uint32_t Hi(uint64_t v) { return static_cast<uint32_t>(v >> 32); }

// int32 arithmetic as XLA's: wrapping.
inline int32_t WrapSub(int32_t a, int32_t b) {
  return static_cast<int32_t>(static_cast<uint32_t>(a) - static_cast<uint32_t>(b));
}
inline int32_t WrapAdd(int32_t a, int32_t b) {
  return static_cast<int32_t>(static_cast<uint32_t>(a) + static_cast<uint32_t>(b));
}
// remap._saturating_add: INT32_MAX when a > INT32_MAX - b.
inline int32_t SaturatingAdd(int32_t a, int32_t b) {
  return a > WrapSub(kInt32Max, b) ? kInt32Max : WrapAdd(a, b);
}

// ---- checks ---------------------------------------------------------------------------------

// The table's geometry, checked: C rows in buckets of S.
struct Table {
  int64_t C = 0, S = 0, num_buckets = 0;
  uint32_t bucket_seed = 0;
};

ffi::Error CheckTable(const char* k, ffi::Buffer<ffi::U32> ids, ffi::Buffer<ffi::U32> keys,
                      int64_t bucket_size, int64_t seed, int64_t num_threads, Table* t) {
  if (num_threads < 1 || num_threads > 1024) {
    return Invalid(k, "num_threads=" + std::to_string(num_threads) +
                          " must be in [1, 1024] (set JAXEMBED_NUM_THREADS)");
  }
  if (ids.dimensions().size() != 2 || ids.dimensions()[1] != 2) {
    return Invalid(k, "ids must be u32[M, 2] pairs (flatten them in Python), got shape " +
                          Dims(ids.dimensions()));
  }
  if (ids.dimensions()[0] > kInt32Max) {
    return Invalid(k, "M=" + std::to_string(ids.dimensions()[0]) + " ids exceed 2^31 - 1");
  }
  if (keys.dimensions().size() != 2 || keys.dimensions()[1] != 2) {
    return Invalid(k, "keys must be u32[C, 2], got shape " + Dims(keys.dimensions()));
  }
  t->C = keys.dimensions()[0];
  t->S = bucket_size;
  if (t->S < 1 || t->S > 1024 || t->C < 1 || t->C > kInt32Max || t->C % t->S != 0) {
    return Invalid(k, "capacity=" + std::to_string(t->C) + " and bucket_size=" +
                          std::to_string(t->S) + ": capacity must be a multiple of bucket_size " +
                          "in [1, 2^31 - 1], bucket_size in [1, 1024]");
  }
  if (seed < 0 || seed > 0xFFFFFFFFll) {
    return Invalid(k, "seed=" + std::to_string(seed) + " must be in [0, 2^32)");
  }
  t->num_buckets = t->C / t->S;
  t->bucket_seed = StreamSeed(static_cast<uint32_t>(seed), kStreamBucket);
  return ffi::Error::Success();
}

inline int32_t BucketOf(const Table& t, uint32_t lo, uint32_t hi) {
  return static_cast<int32_t>(Murmur(lo, hi, t.bucket_seed) % static_cast<uint32_t>(t.num_buckets));
}

// The row of `id` in bucket b, or -1. Up to 64 slots: a branch-free mask of the matches (the
// compiler vectorizes the compares), its lowest bit the slot; a live id is in a bucket once.
inline int64_t Probe(const Table& t, const uint32_t* keys, int64_t b, uint64_t id) {
  const uint32_t* k = keys + 2 * b * t.S;
  if (t.S <= 64) {
    uint64_t mask = 0;
    for (int64_t s = 0; s < t.S; ++s) mask |= uint64_t{Key64(k + 2 * s) == id} << s;
    return mask ? b * t.S + __builtin_ctzll(mask) : -1;
  }
  for (int64_t s = 0; s < t.S; ++s) {
    if (Key64(k + 2 * s) == id) return b * t.S + s;
  }
  return -1;
}

inline void PrefetchBucket(const Table& t, const uint32_t* keys, int64_t b) {
  PrefetchRow(keys + 2 * b * t.S, t.S * 2 * static_cast<int64_t>(sizeof(uint32_t)));
}

// ---- lookup -----------------------------------------------------------------------------------

ffi::Error RemapLookupImpl(ffi::Buffer<ffi::U32> ids, ffi::Buffer<ffi::U32> keys,
                           ffi::Result<ffi::Buffer<ffi::S32>> rows,
                           ffi::Result<ffi::Buffer<ffi::PRED>> found, int64_t bucket_size,
                           int64_t seed, int64_t num_threads) {
  constexpr const char* k = "remap_lookup";
  Table t;
  if (auto e = CheckTable(k, ids, keys, bucket_size, seed, num_threads, &t); e.failure()) return e;
  const int64_t M = ids.dimensions()[0];
  if (auto e = CheckShape(k, "rows", rows->dimensions(), {M}); e.failure()) return e;
  if (auto e = CheckShape(k, "found", found->dimensions(), {M}); e.failure()) return e;
  const uint32_t* id = ids.typed_data();
  const uint32_t* table = keys.typed_data();
  int32_t* r = rows->typed_data();
  bool* f = found->typed_data();
  Team team(ThreadsFor(num_threads, M, 4096));
  const int threads = team.size();
  team.Run([&](int p) {
    const int64_t a = PartStart(M, threads, p), e = PartStart(M, threads, p + 1);
    for (int64_t i = a; i < e; ++i) {
      const int64_t ahead = i + kPrefetchDistance;
      if (ahead < e && !IsEmpty(id + 2 * ahead)) {
        PrefetchBucket(t, table, BucketOf(t, id[2 * ahead], id[2 * ahead + 1]));
      }
      int64_t row = -1;
      if (!IsEmpty(id + 2 * i)) {
        row = Probe(t, table, BucketOf(t, id[2 * i], id[2 * i + 1]), Key64(id + 2 * i));
      }
      f[i] = row >= 0;
      r[i] = static_cast<int32_t>(row >= 0 ? row : t.C);
    }
  });
  return ffi::Error::Success();
}

// ---- step -------------------------------------------------------------------------------------

enum Policy : int64_t { kLru = 0, kLfu = 1, kTtl = 2 };  // config.POLICIES' order

struct StepAttrs {
  int64_t admit_after, policy, ttl_steps, sketch_window;
  uint32_t seed;
};

// Each state operand is aliased to its result (XLA copies it first unless it was donated);
// should XLA ever hand over two buffers, the result starts as a copy of the operand.
template <class B, class R>
void StartFrom(const B& in, R& out) {
  const size_t bytes = in.size_bytes();
  if (bytes && out->untyped_data() != in.untyped_data()) {
    std::memcpy(out->untyped_data(), in.untyped_data(), bytes);
  }
}

// The distinct ids of a batch, numbered in first-occurrence order.
struct Distinct {
  int64_t n = 0;
  std::unique_ptr<uint64_t[]> id;
  std::unique_ptr<int32_t[]> bucket, mult, row;
};
// A slot of the dedup's open-addressing hash (linear probing): an id and its number (-1: free).
struct HashSlot {
  uint64_t id;
  int32_t v;
};

// The first `want` places of bucket b's order (remap._pick): its free slots ascending,
// then its victims by (count, last_seen, row) under lfu, by (last_seen, row) otherwise; a slot
// read in this step (last_seen == t) is no victim, nor under ttl one with
// t - last_seen <= ttl_steps. Writes them to `out` and returns how many there are (<= want).
// Only as many victims as needed are ordered (a partial sort; usually one or two).
int64_t TakeSlots(const Table& tb, const StepAttrs& at, int32_t t, int64_t b, int64_t want,
                  const uint32_t* keys, const int32_t* last, const int32_t* count,
                  std::vector<int32_t>& out, std::vector<int32_t>& victims) {
  out.clear();
  victims.clear();
  for (int64_t s = 0; s < tb.S; ++s) {
    const int64_t r = b * tb.S + s;
    if (IsEmpty(keys + 2 * r)) {
      out.push_back(static_cast<int32_t>(r));
    } else if (last[r] != t && (at.policy != kTtl || WrapSub(t, last[r]) > at.ttl_steps)) {
      victims.push_back(static_cast<int32_t>(r));
    }
  }
  const int64_t need = std::min<int64_t>(want - static_cast<int64_t>(out.size()),
                                         static_cast<int64_t>(victims.size()));
  if (need > 0) {
    // In place, no scratch allocation; the row makes every key distinct.
    auto lfu = [&](int32_t x, int32_t y) {
      if (count[x] != count[y]) return count[x] < count[y];
      return last[x] != last[y] ? last[x] < last[y] : x < y;
    };
    auto recent = [&](int32_t x, int32_t y) {
      return last[x] != last[y] ? last[x] < last[y] : x < y;
    };
    if (need == 1 && at.policy == kLfu) {  // the usual case: one scan for the least
      std::iter_swap(victims.begin(), std::min_element(victims.begin(), victims.end(), lfu));
    } else if (need == 1) {
      std::iter_swap(victims.begin(), std::min_element(victims.begin(), victims.end(), recent));
    } else if (at.policy == kLfu) {
      std::partial_sort(victims.begin(), victims.begin() + need, victims.end(), lfu);
    } else {
      std::partial_sort(victims.begin(), victims.begin() + need, victims.end(), recent);
    }
    out.insert(out.end(), victims.begin(), victims.begin() + need);
  }
  if (static_cast<int64_t>(out.size()) > want) out.resize(static_cast<size_t>(want));
  return static_cast<int64_t>(out.size());
}

// A candidate for a row. Candidates are ordered by (bucket, estimate descending, id): the id
// as u64 orders as (hi, lo), XLA's order.
struct Candidate {
  uint64_t id;
  int32_t bucket, est;
  int32_t v;  // its distinct number
};
inline bool RanksBefore(const Candidate& a, const Candidate& b) {
  return a.est != b.est ? a.est > b.est : a.id < b.id;  // within one bucket
}

ffi::Error RemapStepImpl(ffi::Buffer<ffi::U32> ids, ffi::Buffer<ffi::S32> step_index,
                         ffi::Buffer<ffi::U32> keys_in, ffi::Buffer<ffi::S32> last_in,
                         ffi::Buffer<ffi::S32> count_in, ffi::Buffer<ffi::S32> sketch_in,
                         ffi::Buffer<ffi::S32> total_in,
                         ffi::Result<ffi::Buffer<ffi::U32>> keys_out,
                         ffi::Result<ffi::Buffer<ffi::S32>> last_out,
                         ffi::Result<ffi::Buffer<ffi::S32>> count_out,
                         ffi::Result<ffi::Buffer<ffi::S32>> sketch_out,
                         ffi::Result<ffi::Buffer<ffi::S32>> total_out,
                         ffi::Result<ffi::Buffer<ffi::S32>> rows_out,
                         ffi::Result<ffi::Buffer<ffi::PRED>> found_out,
                         ffi::Result<ffi::Buffer<ffi::S32>> stats_out,
                         ffi::Result<ffi::Buffer<ffi::S32>> reset_out,
                         ffi::Result<ffi::Buffer<ffi::U32>> evicted_out, int64_t bucket_size,
                         int64_t admit_after, int64_t policy, int64_t ttl_steps,
                         int64_t sketch_window, int64_t seed, int64_t num_threads) {
  constexpr const char* k = "remap_step";
  Table tb;
  if (auto e = CheckTable(k, ids, keys_in, bucket_size, seed, num_threads, &tb); e.failure()) {
    return e;
  }
  const int64_t M = ids.dimensions()[0], C = tb.C;
  if (admit_after < 1 || admit_after > kInt32Max || policy < kLru || policy > kTtl ||
      ttl_steps < 0 || ttl_steps > kInt32Max || sketch_window < 1 || sketch_window > kInt32Max) {
    return Invalid(k, "admit_after=" + std::to_string(admit_after) + ", policy=" +
                          std::to_string(policy) + ", ttl_steps=" + std::to_string(ttl_steps) +
                          ", sketch_window=" + std::to_string(sketch_window) +
                          " must be >= 1, in {0 lru, 1 lfu, 2 ttl}, >= 0 and >= 1 (int32)");
  }
  const bool counting = admit_after > 1;
  const auto sd = sketch_in.dimensions();
  if (sd.size() != 2 || (counting && (sd[0] < 1 || sd[1] < 1))) {
    return Invalid(k, "sketch has shape " + Dims(sd) + ": admit_after=" +
                          std::to_string(admit_after) + " needs a [depth, width] sketch");
  }
  const int64_t D = counting ? sd[0] : 0, W = counting ? sd[1] : 0;
  struct Want {
    const char* name;
    ffi::AnyBuffer::Dimensions got;
    std::vector<int64_t> want;
  };
  for (const Want& w : std::initializer_list<Want>{
           {"step_index", step_index.dimensions(), {}},
           {"last_seen", last_in.dimensions(), {C}},
           {"count", count_in.dimensions(), {C}},
           {"sketch_total", total_in.dimensions(), {1}},
           {"keys (result)", keys_out->dimensions(), {C, 2}},
           {"last_seen (result)", last_out->dimensions(), {C}},
           {"count (result)", count_out->dimensions(), {C}},
           {"sketch (result)", sketch_out->dimensions(), {sd[0], sd[1]}},
           {"sketch_total (result)", total_out->dimensions(), {1}},
           {"rows", rows_out->dimensions(), {M}},
           {"found", found_out->dimensions(), {M}},
           {"stats", stats_out->dimensions(), {6}},
           {"reset_rows", reset_out->dimensions(), {M}},
           {"evicted_keys", evicted_out->dimensions(), {M, 2}}}) {
    if (auto e = CheckShape(k, w.name, w.got, w.want); e.failure()) return e;
  }
  StartFrom(keys_in, keys_out);
  StartFrom(last_in, last_out);
  StartFrom(count_in, count_out);
  StartFrom(sketch_in, sketch_out);
  StartFrom(total_in, total_out);
  uint32_t* keys = keys_out->typed_data();
  int32_t* last = last_out->typed_data();
  int32_t* count = count_out->typed_data();
  int32_t* sketch = sketch_out->typed_data();
  int32_t* total = total_out->typed_data();
  int32_t* rows = rows_out->typed_data();
  bool* found = found_out->typed_data();
  int32_t* stats = stats_out->typed_data();
  int32_t* reset = reset_out->typed_data();
  uint32_t* evicted = evicted_out->typed_data();
  const StepAttrs at{admit_after, policy, ttl_steps, sketch_window, static_cast<uint32_t>(seed)};
  const int32_t t = step_index.typed_data()[0];
  const uint32_t* id = ids.typed_data();
  std::fill(stats, stats + 6, 0);
  for (int64_t j = 0; j < M; ++j) {
    reset[j] = static_cast<int32_t>(C);
    SetKey(evicted + 2 * j, kEmptyId);
  }
  if (M == 0) return ffi::Error::Success();
  Team team(ThreadsFor(num_threads, M, 4096));
  const int threads = team.size();

  // 1. Each slot's bucket (-1: the reserved id), in parallel; then the distinct ids.
  auto slot_bucket = Uninitialized<int32_t>(M);
  team.Run([&](int p) {
    for (int64_t i = PartStart(M, threads, p), e = PartStart(M, threads, p + 1); i < e; ++i) {
      slot_bucket[i] = IsEmpty(id + 2 * i) ? -1 : BucketOf(tb, id[2 * i], id[2 * i + 1]);
    }
  });
  Distinct u;
  u.id = Uninitialized<uint64_t>(M);
  u.bucket = Uninitialized<int32_t>(M);
  u.mult = Uninitialized<int32_t>(M);
  u.row = Uninitialized<int32_t>(M);
  auto slot_uid = Uninitialized<int32_t>(M);
  int log2 = 4;
  while ((int64_t{1} << log2) < 2 * M) ++log2;
  const uint64_t hash_size = uint64_t{1} << log2, hash_mask = hash_size - 1;
  std::vector<HashSlot> hash(hash_size, HashSlot{0, -1});
  int32_t reserved = 0;
  for (int64_t i = 0; i < M; ++i) {
    if (slot_bucket[i] < 0) {
      ++reserved;
      slot_uid[i] = -1;
      continue;
    }
    const uint64_t key = Key64(id + 2 * i);
    uint64_t h = (key * 0x9E3779B97F4A7C15ull) >> (64 - log2);  // Fibonacci hash
    while (hash[h].v >= 0 && hash[h].id != key) h = (h + 1) & hash_mask;
    int32_t v = hash[h].v;
    if (v < 0) {
      v = static_cast<int32_t>(u.n++);
      hash[h] = HashSlot{key, v};
      u.id[v] = key;
      u.bucket[v] = slot_bucket[i];
      u.mult[v] = 0;
    }
    ++u.mult[v];
    slot_uid[i] = v;
  }
  const int64_t U = u.n;

  // 2. Hits, touched in place (distinct ids hold distinct rows), in parallel: probe every
  // distinct id's bucket (prefetched ahead), then touch the rows found (prefetched ahead).
  std::vector<int32_t> hit_count(threads, 0);
  team.Run([&](int p) {
    const int64_t a = PartStart(U, threads, p), e = PartStart(U, threads, p + 1);
    for (int64_t v = a; v < e; ++v) {
      if (v + kPrefetchDistance < e) PrefetchBucket(tb, keys, u.bucket[v + kPrefetchDistance]);
      u.row[v] = static_cast<int32_t>(Probe(tb, keys, u.bucket[v], u.id[v]));
    }
    for (int64_t v = a; v < e; ++v) {
      const int64_t ahead = v + kPrefetchDistance;
      if (ahead < e && u.row[ahead] >= 0) {
        __builtin_prefetch(last + u.row[ahead], 1, 3);
        __builtin_prefetch(count + u.row[ahead], 1, 3);
      }
      const int32_t r = u.row[v];
      if (r >= 0) {
        last[r] = t;
        count[r] = SaturatingAdd(count[r], u.mult[v]);
        ++hit_count[p];
      }
    }
  });
  for (int32_t h : hit_count) stats[0] += h;

  // 3. Counting: every miss adds its multiplicity to its D counters, then reads the minimum.
  std::vector<uint32_t> sketch_seed(static_cast<size_t>(D));
  for (int64_t j = 0; j < D; ++j) sketch_seed[j] = StreamSeed(at.seed, kStreamSketch + j);
  auto counter = [&](int64_t v, int64_t j) {
    return j * W + static_cast<int64_t>(Murmur(Lo(u.id[v]), Hi(u.id[v]), sketch_seed[j]) %
                                        static_cast<uint32_t>(W));
  };
  int32_t added = 0;
  if (counting) {
    for (int64_t v = 0; v < U; ++v) {
      if (u.row[v] >= 0) continue;
      for (int64_t j = 0; j < D; ++j) {
        int32_t& c = sketch[counter(v, j)];
        c = WrapAdd(c, u.mult[v]);
      }
      added = WrapAdd(added, u.mult[v]);
    }
  }
  std::vector<Candidate> cand;
  int32_t pending = 0;
  for (int64_t v = 0; v < U; ++v) {
    if (u.row[v] >= 0) continue;
    int32_t e = u.mult[v];
    if (counting) {
      e = sketch[counter(v, 0)];
      for (int64_t j = 1; j < D; ++j) e = std::min(e, sketch[counter(v, j)]);
    }
    if (e >= admit_after) {
      cand.push_back({u.id[v], u.bucket[v], e, static_cast<int32_t>(v)});
    } else {
      ++pending;
    }
  }

  // 4. Candidates by (bucket, estimate descending, id); each bucket's r-th takes its r-th
  // place. Buckets are disjoint, so their runs are split over the team at run boundaries;
  // each candidate's row (-1: refused) and the id it displaced are then laid out in order.
  const int64_t K = static_cast<int64_t>(cand.size());
  {
    // A stable LSD radix sort by bucket (common.h), then each bucket's few by RanksBefore.
    SortedSlots by_bucket = SortSlotsByKey(
        K, BitsFor(static_cast<uint64_t>(tb.num_buckets)),
        [&](int64_t i) -> int64_t { return cand[i].bucket; }, team);
    std::vector<Candidate> sorted(cand.size());
    for (int64_t j = 0; j < K; ++j) sorted[j] = cand[by_bucket.slots[j]];
    for (int64_t a = 0, e = 0; a < K; a = e) {
      for (e = a + 1; e < K && sorted[e].bucket == sorted[a].bucket;) ++e;
      if (e - a > 1) std::sort(sorted.begin() + a, sorted.begin() + e, RanksBefore);
    }
    cand.swap(sorted);
  }
  auto taken = Uninitialized<int32_t>(K);
  auto displaced = Uninitialized<uint64_t>(K);  // the id the row held, or EMPTY_ID
  const int workers = std::min<int>(threads, static_cast<int>(std::max<int64_t>(1, K / 256)));
  team.Run([&](int p) {
    if (p >= workers) return;
    auto aligned = [&](int q) {  // the first candidate of a run at or after part q's start
      int64_t x = PartStart(K, workers, q);
      while (x > 0 && x < K && cand[x].bucket == cand[x - 1].bucket) ++x;
      return x;
    };
    std::vector<int32_t> places, victims;
    places.reserve(static_cast<size_t>(tb.S));
    victims.reserve(static_cast<size_t>(tb.S));
    constexpr int64_t kAhead = 8;
    for (int64_t a = aligned(p), end = aligned(p + 1); a < end;) {
      if (a + kAhead < end) {
        const int64_t nb = cand[a + kAhead].bucket;
        PrefetchBucket(tb, keys, nb);
        PrefetchRow(last + nb * tb.S, tb.S * 4);
        PrefetchRow(count + nb * tb.S, tb.S * 4);  // read by lfu, written by all
      }
      const int32_t b = cand[a].bucket;
      int64_t e = a;
      while (e < end && cand[e].bucket == b) ++e;
      const int64_t n = TakeSlots(tb, at, t, b, e - a, keys, last, count, places, victims);
      for (int64_t q = a; q < e; ++q) {
        if (q - a >= n) {
          taken[q] = -1;
          continue;
        }
        const int32_t r = places[q - a];
        displaced[q] = Key64(keys + 2 * r);
        SetKey(keys + 2 * r, cand[q].id);
        last[r] = t;
        count[r] = cand[q].est;
        u.row[cand[q].v] = r;
        taken[q] = r;
      }
      a = e;
    }
  });
  int64_t placed = 0;
  int32_t n_evicted = 0, refused = 0;
  for (int64_t q = 0; q < K; ++q) {
    if (taken[q] < 0) {
      ++refused;
      continue;
    }
    if (displaced[q] != kEmptyId) {
      ++n_evicted;
      SetKey(evicted + 2 * placed, displaced[q]);
    }
    reset[placed++] = taken[q];
  }

  // 5. Halving, once per sketch_window counts.
  if (counting) {
    total[0] = WrapAdd(total[0], added);
    if (total[0] >= sketch_window) {
      for (int64_t c = 0; c < D * W; ++c) sketch[c] >>= 1;
      total[0] >>= 1;
    }
  }

  // Each slot's row (capacity where none), in parallel.
  team.Run([&](int p) {
    for (int64_t i = PartStart(M, threads, p), e = PartStart(M, threads, p + 1); i < e; ++i) {
      const int32_t v = slot_uid[i];
      const int32_t r = v >= 0 ? u.row[v] : -1;
      found[i] = r >= 0;
      rows[i] = r >= 0 ? r : static_cast<int32_t>(C);
    }
  });
  stats[1] = static_cast<int32_t>(placed);
  stats[2] = n_evicted;
  stats[3] = refused;
  stats[4] = pending;
  stats[5] = reserved;
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxembed

// ---- the handlers (symbols looked up by build.py) ---------------------------------------------

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxembedRemapLookup, jaxembed::Safe<jaxembed::RemapLookupImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U32>>()   // ids [M, 2]
                                  .Arg<ffi::Buffer<ffi::U32>>()   // keys [C, 2]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // rows [M]
                                  .Ret<ffi::Buffer<ffi::PRED>>()  // found [M]
                                  .Attr<int64_t>("bucket_size")
                                  .Attr<int64_t>("seed")
                                  .Attr<int64_t>("num_threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxembedRemapStep, jaxembed::Safe<jaxembed::RemapStepImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U32>>()   // ids [M, 2]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // step_index []
                                  .Arg<ffi::Buffer<ffi::U32>>()   // keys [C, 2]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // last_seen [C]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // count [C]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // sketch [D, W]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // sketch_total [1]
                                  .Ret<ffi::Buffer<ffi::U32>>()   // keys (aliased)
                                  .Ret<ffi::Buffer<ffi::S32>>()   // last_seen (aliased)
                                  .Ret<ffi::Buffer<ffi::S32>>()   // count (aliased)
                                  .Ret<ffi::Buffer<ffi::S32>>()   // sketch (aliased)
                                  .Ret<ffi::Buffer<ffi::S32>>()   // sketch_total (aliased)
                                  .Ret<ffi::Buffer<ffi::S32>>()   // rows [M]
                                  .Ret<ffi::Buffer<ffi::PRED>>()  // found [M]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // stats [6]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // reset_rows [M]
                                  .Ret<ffi::Buffer<ffi::U32>>()   // evicted_keys [M, 2]
                                  .Attr<int64_t>("bucket_size")
                                  .Attr<int64_t>("admit_after")
                                  .Attr<int64_t>("policy")
                                  .Attr<int64_t>("ttl_steps")
                                  .Attr<int64_t>("sketch_window")
                                  .Attr<int64_t>("seed")
                                  .Attr<int64_t>("num_threads"));
