// The dynamic table's remap as XLA FFI handlers: the native CPU twins of
// jaxembed/kernels/remap.py's `lookup` and `step`, bit for bit (the policy itself is stated,
// one id at a time, in jaxembed/dynamic/reference.py).
//
// Shapes (one table or shard): ids u32[M, 2] (low half, high half), keys u32[C, 2],
// last_seen / count i32[C], sketch i32[D, W] ([0, 0] without admission counting),
// sketch_total i32[1]; C = num_buckets · S, bucket b holding rows [b·S, (b+1)·S).
//
// A step, where XLA sorts every id twice:
// 1. the batch's distinct ids, on the calling thread, from an open-addressing table of their
//    numbers keyed by the 64-bit id (O(M), 4 bytes a place, at most half full: about the L2);
//    only a new id's bucket is hashed, its `% num_buckets` a multiply (FastMod);
// 2. the distinct ids sorted by bucket: a stable LSD radix sort of (bucket, number) pairs;
// 3. one pass over the buckets in ascending order, in runs of whole buckets, one a thread of a
//    `Team`: each bucket's keys, last_seen and count are prefetched 8 buckets ahead, its ids
//    found (AVX-512: 8 keys a compare), its hits touched, and its candidates ranked (estimate
//    descending, id) and given its free slots, then its victims, ordered exactly as
//    remap._pick orders them but only as far as needed, while its lines are in the cache.
//    With admission counting the misses' sketch adds (atomic) come first and a second pass
//    decides, once every estimate is final;
// 4. the results, laid out in the order XLA gives them.
// A bucket's decision reads and writes only its own rows, so the split over threads changes
// nothing: the results are the same bits for any thread count. The idea of prefetching the
// rows a few items ahead is FBGEMM's EmbeddingSpMDM (`prefetch=16`), applied here to the
// identity array and the metadata; the ascending bucket order is what lets it pay on a VM's
// 4 KiB pages (three of them a bucket: keys, last_seen, count).
//
// Measured on 2 shared cores (benchmarks/dynamic/throughput.py: 2^26 slots at load factor 0.9,
// batches of 65536 Zipf ids, ~32k of them distinct): the pass over the buckets is bound by
// memory latency, about 8 cache lines from 3 pages of the 1 GiB state a distinct id, some
// 250-300 ns a distinct id a core (1.4x less CPU time than the previous kernel, which
// probed in first-occurrence order and fetched a candidate's bucket again to assign it).
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

// x % d for 32-bit x and d >= 1 without a division (Lemire, Kaser and Kurz, "Faster remainder
// by direct computation", 2019): with m = ceil(2^64 / d), x % d = ((m·x mod 2^64)·d) >> 64.
struct FastMod {
  uint64_t m = 0;
  int64_t d = 1;
  FastMod() = default;
  explicit FastMod(uint32_t divisor) : m(~uint64_t{0} / divisor + 1), d(divisor) {}
  int64_t operator()(uint32_t x) const {
    return static_cast<int64_t>(
        (static_cast<unsigned __int128>(m * x) * static_cast<uint64_t>(d)) >> 64);
  }
};

constexpr int64_t kMaxSketchDepth = 16;  // config.DynamicTableConfig's limit

// ---- checks ---------------------------------------------------------------------------------

// The table's geometry, checked: C rows in buckets of S.
struct Table {
  int64_t C = 0, S = 0, num_buckets = 0;
  uint32_t bucket_seed = 0;
  FastMod bucket_mod;  // % num_buckets
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
  t->bucket_mod = FastMod(static_cast<uint32_t>(t->num_buckets));
  return ffi::Error::Success();
}

inline int32_t BucketOf(const Table& t, uint32_t lo, uint32_t hi) {
  return static_cast<int32_t>(t.bucket_mod(Murmur(lo, hi, t.bucket_seed)));
}

// The slots (bit s: slot s) of the S <= 64 keys at k that equal `v`: AVX-512 compares 8 keys
// at a time where the build has it; otherwise a branch-free loop the compiler vectorizes.
inline uint64_t SlotMask(const uint32_t* k, int64_t S, uint64_t v) {
  uint64_t mask = 0;
  int64_t s = 0;
#if defined(__AVX512F__)
  const __m512i want = _mm512_set1_epi64(static_cast<long long>(v));
  for (; s + 8 <= S; s += 8) {
    const __m512i held = _mm512_loadu_si512(k + 2 * s);
    mask |= static_cast<uint64_t>(_mm512_cmpeq_epi64_mask(held, want)) << s;
  }
#endif
  for (; s < S; ++s) mask |= uint64_t{Key64(k + 2 * s) == v} << s;
  return mask;
}

// The slot of `id` among a bucket's S keys at k, or -1 (a live id is in a bucket once).
inline int64_t FindInBucket(const uint32_t* k, int64_t S, uint64_t id) {
  if (S <= 64) {
    const uint64_t mask = SlotMask(k, S, id);
    return mask ? __builtin_ctzll(mask) : -1;
  }
  for (int64_t s = 0; s < S; ++s) {
    if (Key64(k + 2 * s) == id) return s;
  }
  return -1;
}

// The row of `id` in bucket b, or -1.
inline int64_t Probe(const Table& t, const uint32_t* keys, int64_t b, uint64_t id) {
  const int64_t s = FindInBucket(keys + 2 * b * t.S, t.S, id);
  return s < 0 ? -1 : b * t.S + s;
}

// Asks for the `bytes` at p, one cache line at a time (for writing: `write`). The empty asm
// keeps the loop: GCC 12 deleted a loop of nothing but __builtin_prefetch (common.h's
// PrefetchRow) inlined into a member function (StepContext::Prefetch below) as a loop
// without effects, and the step ran without prefetching.
inline void PrefetchLines(const void* p, int64_t bytes, bool write = false) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) {
    if (write) {
      __builtin_prefetch(c + b, 1, 3);
    } else {
      __builtin_prefetch(c + b, 0, 3);
    }
    asm volatile("" : : "r"(c + b));
  }
}

inline void PrefetchBucket(const Table& t, const uint32_t* keys, int64_t b) {
  PrefetchLines(keys + 2 * b * t.S, t.S * 2 * static_cast<int64_t>(sizeof(uint32_t)));
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

// Sorts keys[0, n) stably by their high half (< 2^bits): LSD radix, digits of at most
// kMaxDigitBits, a pass skipped where every key has one digit. `tmp` is scratch of n keys;
// returns whichever of the two holds the result.
uint64_t* SortByHighHalf(uint64_t* keys, uint64_t* tmp, int64_t n, int bits) {
  if (n < 2 || bits == 0) return keys;
  const int passes = (bits + kMaxDigitBits - 1) / kMaxDigitBits;
  const int digit_bits = (bits + passes - 1) / passes;
  const uint64_t mask = (uint64_t{1} << digit_bits) - 1;
  std::vector<int64_t> counts(static_cast<size_t>(mask + 1));
  for (int pass = 0; pass < passes; ++pass) {
    const int shift = 32 + pass * digit_bits;
    std::fill(counts.begin(), counts.end(), 0);
    for (int64_t j = 0; j < n; ++j) ++counts[(keys[j] >> shift) & mask];
    if (counts[(keys[0] >> shift) & mask] == n) continue;  // one digit: already in order
    int64_t total = 0;
    for (int64_t& c : counts) total += std::exchange(c, total);
    for (int64_t j = 0; j < n; ++j) tmp[counts[(keys[j] >> shift) & mask]++] = keys[j];
    std::swap(keys, tmp);
  }
  return keys;
}

// The first `want` places of bucket b's order (remap._pick): its free slots ascending, then its
// victims by (count, last_seen, row) under lfu, by (last_seen, row) otherwise; a slot read in
// this step (last_seen == t) is no victim, nor under ttl one with t - last_seen <= ttl_steps.
// Writes their rows to `out` and returns how many there are (<= want). The victims are
// gathered only when the free slots do not suffice, and only as many ordered as needed (one
// scan for the least, usually). `victims` is scratch of S rows.
int64_t TakeSlots(const Table& tb, const StepAttrs& at, int32_t t, int64_t b, int64_t want,
                  const uint32_t* keys, const int32_t* last, const int32_t* count, int32_t* out,
                  int32_t* victims) {
  const int64_t base = b * tb.S;
  int64_t n = 0;
  if (tb.S <= 64) {
    for (uint64_t free = SlotMask(keys + 2 * base, tb.S, kEmptyId); free && n < want;
         free &= free - 1) {
      out[n++] = static_cast<int32_t>(base + __builtin_ctzll(free));
    }
  } else {
    for (int64_t s = 0; s < tb.S && n < want; ++s) {
      if (IsEmpty(keys + 2 * (base + s))) out[n++] = static_cast<int32_t>(base + s);
    }
  }
  if (n == want) return n;
  int64_t nv = 0;
  for (int64_t r = base; r < base + tb.S; ++r) {
    if (!IsEmpty(keys + 2 * r) && last[r] != t &&
        (at.policy != kTtl || WrapSub(t, last[r]) > at.ttl_steps)) {
      victims[nv++] = static_cast<int32_t>(r);
    }
  }
  const int64_t need = std::min(want - n, nv);
  if (need <= 0) return n;
  // The row makes every key distinct, so these orders are total.
  auto lfu = [&](int32_t x, int32_t y) {
    if (count[x] != count[y]) return count[x] < count[y];
    return last[x] != last[y] ? last[x] < last[y] : x < y;
  };
  auto recent = [&](int32_t x, int32_t y) {
    return last[x] != last[y] ? last[x] < last[y] : x < y;
  };
  int32_t* end = victims + nv;
  if (need == 1 && at.policy == kLfu) {
    std::iter_swap(victims, std::min_element(victims, end, lfu));
  } else if (need == 1) {
    std::iter_swap(victims, std::min_element(victims, end, recent));
  } else if (at.policy == kLfu) {
    std::partial_sort(victims, victims + need, end, lfu);
  } else {
    std::partial_sort(victims, victims + need, end, recent);
  }
  for (int64_t q = 0; q < need; ++q) out[n++] = victims[q];
  return n;
}

// The batch's distinct ids, numbered in first-occurrence order: each one's bucket,
// multiplicity, estimate (its multiplicity without counting) and row after the step (-1: none).
struct Distinct {
  int64_t n = 0;
  std::unique_ptr<uint64_t[]> id;
  std::unique_ptr<int32_t[]> bucket, mult, est, row;
};

// What a step's parts share: the table, the attributes, the state and the distinct ids.
struct StepContext {
  Table tb;
  StepAttrs at;
  int32_t t;
  uint32_t* keys;  // [C, 2]
  int32_t *last, *count, *sketch;
  int64_t D = 0;
  FastMod w_mod;
  uint32_t sketch_seed[kMaxSketchDepth];
  bool counting, atomic_sketch;
  Distinct* u;
  const int32_t* est;  // [U] the distinct ids' estimates

  int64_t Counter(uint64_t id, int64_t j) const {
    return j * w_mod.d + w_mod(Murmur(Lo(id), Hi(id), sketch_seed[j]));
  }
  // Asks for bucket b's keys, last_seen and count (all read by a victim search; the hits'
  // touch writes the last two) a few buckets before they are read.
  void Prefetch(int64_t b) const {
    PrefetchLines(keys + 2 * b * tb.S, tb.S * 8);
    PrefetchLines(last + b * tb.S, tb.S * 4, true);
    PrefetchLines(count + b * tb.S, tb.S * 4, true);
  }
};

// One thread's share of a step: a run of the distinct ids sorted by bucket (whole buckets), the
// rows it assigned (in order: bucket, then rank) and its counts.
class StepPart {
 public:
  static constexpr int64_t kAhead = 8;  // buckets prefetched ahead of the one decided

  StepPart(const uint64_t* sorted, int64_t a, int64_t e) : sorted_(sorted), a_(a), e_(e) {}

  // Phase 1, one pass over the part's buckets, each prefetched kAhead buckets before: its
  // distinct ids are found, its hits touched, then (without counting) its candidates assigned
  // while its lines are in the cache; with counting its misses are added to the sketch
  // (atomically when several parts run) and it is kept for phase 2.
  void Walk(const StepContext& cx) {
    Distinct& u = *cx.u;
    reset_ = Uninitialized<int32_t>(e_ - a_);
    displaced_ = Uninitialized<uint64_t>(e_ - a_);
    places_.resize(static_cast<size_t>(cx.tb.S));
    victims_.resize(static_cast<size_t>(cx.tb.S));
    int64_t ahead = a_;  // the first id of the next bucket to prefetch
    auto prefetch_next = [&] {
      if (ahead >= e_) return;
      const uint64_t b = sorted_[ahead] >> 32;
      cx.Prefetch(static_cast<int64_t>(b));
      do {  // and the ids' own entries (the cache's other lines push them out)
        const int32_t v = static_cast<int32_t>(sorted_[ahead]);
        __builtin_prefetch(&u.id[v]);
        __builtin_prefetch(&cx.est[v]);
        __builtin_prefetch(&u.mult[v]);
        __builtin_prefetch(&u.row[v], 1);
      } while (++ahead < e_ && sorted_[ahead] >> 32 == b);
    };
    for (int64_t q = 0; q < kAhead; ++q) prefetch_next();
    for (int64_t a = a_, e; a < e_; a = e) {
      prefetch_next();
      const int64_t b = static_cast<int64_t>(sorted_[a] >> 32);
      for (e = a + 1; e < e_ && static_cast<int64_t>(sorted_[e] >> 32) == b;) ++e;
      const uint32_t* bucket_keys = cx.keys + 2 * b * cx.tb.S;
      bool miss = false;
      for (int64_t j = a; j < e; ++j) {
        const int32_t v = static_cast<int32_t>(sorted_[j]);
        const int64_t s = FindInBucket(bucket_keys, cx.tb.S, u.id[v]);
        if (s < 0) {
          u.row[v] = -1;
          miss = true;
          continue;
        }
        const int64_t r = b * cx.tb.S + s;
        cx.last[r] = cx.t;
        cx.count[r] = SaturatingAdd(cx.count[r], u.mult[v]);
        u.row[v] = static_cast<int32_t>(r);
        ++hits_;
      }
      if (!miss) continue;
      if (!cx.counting) {
        Decide(cx, b, a, e);
        continue;
      }
      for (int64_t j = a; j < e; ++j) {
        const int32_t v = static_cast<int32_t>(sorted_[j]);
        if (u.row[v] >= 0) continue;
        for (int64_t d = 0; d < cx.D; ++d) {
          int32_t* c = cx.sketch + cx.Counter(u.id[v], d);
          if (cx.atomic_sketch) {  // wrapping adds commute: the sums are the same in any order
            __atomic_fetch_add(c, u.mult[v], __ATOMIC_RELAXED);
          } else {
            *c = WrapAdd(*c, u.mult[v]);
          }
        }
        added_ = WrapAdd(added_, u.mult[v]);
      }
      counted_.push_back(a);
    }
  }

  // Phase 2 (counting only, after every part's adds): each kept bucket's misses read their
  // estimates, then its candidates are assigned (the buckets prefetched ahead again).
  void DecideCounted(const StepContext& cx) {
    Distinct& u = *cx.u;
    const int64_t G = static_cast<int64_t>(counted_.size());
    auto bucket = [&](int64_t g) { return static_cast<int64_t>(sorted_[counted_[g]] >> 32); };
    for (int64_t g = 0; g < std::min(G, kAhead); ++g) cx.Prefetch(bucket(g));
    for (int64_t g = 0; g < G; ++g) {
      if (g + kAhead < G) cx.Prefetch(bucket(g + kAhead));
      const int64_t b = bucket(g), a = counted_[g];
      int64_t e = a + 1;
      while (e < e_ && static_cast<int64_t>(sorted_[e] >> 32) == b) ++e;
      for (int64_t j = a; j < e; ++j) {
        const int32_t v = static_cast<int32_t>(sorted_[j]);
        if (u.row[v] >= 0) continue;
        int32_t est = cx.sketch[cx.Counter(u.id[v], 0)];
        for (int64_t d = 1; d < cx.D; ++d) est = std::min(est, cx.sketch[cx.Counter(u.id[v], d)]);
        u.est[v] = est;
      }
      Decide(cx, b, a, e);
    }
  }

  int64_t placed() const { return placed_; }
  const int32_t* reset() const { return reset_.get(); }
  const uint64_t* displaced() const { return displaced_.get(); }
  int32_t hits_ = 0, evicted_ = 0, refused_ = 0, pending_ = 0, added_ = 0;

 private:
  // Bucket b's candidates among its misses (sorted_[a, e): estimate >= admit_after, the others
  // pending), ranked by (estimate descending, id); candidate r takes place r of the bucket's
  // order, or is refused.
  void Decide(const StepContext& cx, int64_t b, int64_t a, int64_t e) {
    Distinct& u = *cx.u;
    cand_.clear();
    for (int64_t j = a; j < e; ++j) {
      const int32_t v = static_cast<int32_t>(sorted_[j]);
      if (u.row[v] >= 0) continue;
      if (cx.est[v] < cx.at.admit_after) {
        ++pending_;
        continue;
      }
      cand_.push_back(v);
    }
    if (cand_.empty()) return;
    const int64_t K = static_cast<int64_t>(cand_.size());
    if (K > 1) {
      std::sort(cand_.begin(), cand_.end(), [&](int32_t x, int32_t y) {
        return cx.est[x] != cx.est[y] ? cx.est[x] > cx.est[y] : u.id[x] < u.id[y];
      });
    }
    const int64_t n = TakeSlots(cx.tb, cx.at, cx.t, b, std::min(K, cx.tb.S), cx.keys, cx.last,
                                cx.count, places_.data(), victims_.data());
    refused_ += static_cast<int32_t>(K - n);
    for (int64_t q = 0; q < n; ++q) {
      const int32_t v = cand_[q], r = places_[q];
      const uint64_t old = Key64(cx.keys + 2 * r);
      SetKey(cx.keys + 2 * r, u.id[v]);
      cx.last[r] = cx.t;
      cx.count[r] = cx.est[v];
      u.row[v] = r;
      reset_[placed_] = r;
      displaced_[placed_++] = old;
      evicted_ += old != kEmptyId;
    }
  }

  const uint64_t* sorted_;  // (bucket << 32 | distinct number), by bucket
  int64_t a_, e_;           // the part's run of sorted_
  int64_t placed_ = 0;
  std::unique_ptr<int32_t[]> reset_;
  std::unique_ptr<uint64_t[]> displaced_;
  std::vector<int32_t> cand_, places_, victims_;
  std::vector<int64_t> counted_;  // phase 2's buckets: the first index of each in sorted_
};

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
  if (sd.size() != 2 || (counting && (sd[0] < 1 || sd[0] > kMaxSketchDepth || sd[1] < 1 ||
                                      sd[1] > kInt32Max))) {
    return Invalid(k, "sketch has shape " + Dims(sd) + ": admit_after=" +
                          std::to_string(admit_after) + " needs a [depth, width] sketch, depth " +
                          "in [1, " + std::to_string(kMaxSketchDepth) + "]");
  }
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
  int32_t* stats = stats_out->typed_data();
  std::fill(stats, stats + 6, 0);
  int32_t* rows = rows_out->typed_data();
  bool* found = found_out->typed_data();
  int32_t* reset = reset_out->typed_data();
  uint32_t* evicted = evicted_out->typed_data();
  if (M == 0) return ffi::Error::Success();  // XLA's step returns the state unchanged
  const uint32_t* id = ids.typed_data();

  // 1. The distinct ids, on the calling thread: an open-addressing table (linear probing) of
  // distinct numbers keyed by the id, at most half full, 4 bytes a place (2M places: 512 KiB
  // for M = 65536, about the L2), each place asked for 16 slots ahead (1.5x faster here).
  // Only a new id's bucket is hashed.
  Distinct u;
  u.id = Uninitialized<uint64_t>(M);
  u.bucket = Uninitialized<int32_t>(M);
  u.mult = Uninitialized<int32_t>(M);
  u.row = Uninitialized<int32_t>(M);
  if (counting) u.est = Uninitialized<int32_t>(M);
  auto slot_uid = Uninitialized<int32_t>(M);
  int log2 = 4;
  while ((int64_t{1} << log2) < 2 * M) ++log2;
  const uint64_t places = uint64_t{1} << log2, place_mask = places - 1;
  auto place = Uninitialized<int32_t>(static_cast<int64_t>(places));
  std::fill(place.get(), place.get() + places, -1);
  auto home = [&](uint64_t key) { return (key * 0x9E3779B97F4A7C15ull) >> (64 - log2); };
  constexpr int64_t kPlaceAhead = 16;  // the place of the id 16 slots on is asked for
  int32_t reserved = 0;
  for (int64_t i = 0; i < M; ++i) {
    if (i + kPlaceAhead < M) {
      __builtin_prefetch(&place[home(Key64(id + 2 * (i + kPlaceAhead)))]);
    }
    if (IsEmpty(id + 2 * i)) {
      ++reserved;
      slot_uid[i] = -1;
      continue;
    }
    const uint64_t key = Key64(id + 2 * i);
    uint64_t h = home(key);  // Fibonacci hashing
    int32_t v;
    while ((v = place[h]) >= 0 && u.id[v] != key) h = (h + 1) & place_mask;
    if (v < 0) {
      v = static_cast<int32_t>(u.n++);
      place[h] = v;
      u.id[v] = key;
      u.bucket[v] = BucketOf(tb, id[2 * i], id[2 * i + 1]);
      u.mult[v] = 0;
    }
    ++u.mult[v];
    slot_uid[i] = v;
  }
  place.reset();
  const int64_t U = u.n;

  // 2. The distinct ids by bucket (a stable radix sort of (bucket, number) pairs).
  auto pairs = Uninitialized<uint64_t>(2 * U);
  for (int64_t v = 0; v < U; ++v) {
    pairs[v] = static_cast<uint64_t>(u.bucket[v]) << 32 | static_cast<uint64_t>(v);
  }
  const int bucket_bits = BitsFor(static_cast<uint64_t>(tb.num_buckets));
  const uint64_t* sorted = SortByHighHalf(pairs.get(), pairs.get() + U, U, bucket_bits);

  // 3. The buckets' decisions: the sorted ids split into one run a thread at bucket boundaries
  // (rows are never shared: no locks, and each bucket's decision is its own, so none depends on
  // the split).
  StepContext cx;
  cx.tb = tb;
  cx.at = StepAttrs{admit_after, policy, ttl_steps, sketch_window, static_cast<uint32_t>(seed)};
  cx.t = step_index.typed_data()[0];
  cx.keys = keys_out->typed_data();
  cx.last = last_out->typed_data();
  cx.count = count_out->typed_data();
  cx.sketch = sketch_out->typed_data();
  cx.counting = counting;
  cx.u = &u;
  cx.est = counting ? u.est.get() : u.mult.get();  // without counting, the multiplicity
  if (counting) {
    cx.D = sd[0];
    cx.w_mod = FastMod(static_cast<uint32_t>(sd[1]));
    for (int64_t j = 0; j < cx.D; ++j) {
      cx.sketch_seed[j] = StreamSeed(cx.at.seed, kStreamSketch + static_cast<uint32_t>(j));
    }
  }
  Team team(ThreadsFor(num_threads, U, 2048));
  const int T = team.size();
  cx.atomic_sketch = T > 1;
  auto aligned = [&](int q) {  // the first id of a bucket at or after part q's start
    int64_t x = PartStart(U, T, q);
    while (x > 0 && x < U && sorted[x] >> 32 == sorted[x - 1] >> 32) ++x;
    return x;
  };
  std::vector<StepPart> parts;
  for (int p = 0; p < T; ++p) parts.emplace_back(sorted, aligned(p), aligned(p + 1));
  team.Run([&](int p) { parts[p].Walk(cx); });
  if (counting) team.Run([&](int p) { parts[p].DecideCounted(cx); });

  // 4. The results, laid out as XLA's: each slot's row (capacity where none); the assigned rows
  // by bucket (the parts' runs ascend), then rank, padded with capacity, and the ids they held.
  for (int64_t i = 0; i < M; ++i) {
    const int32_t v = slot_uid[i];
    const int32_t r = v >= 0 ? u.row[v] : -1;
    rows[i] = r >= 0 ? r : static_cast<int32_t>(C);
    found[i] = r >= 0;
  }
  int64_t placed = 0;
  int32_t added = 0;
  for (const StepPart& part : parts) {
    std::copy(part.reset(), part.reset() + part.placed(), reset + placed);
    for (int64_t q = 0; q < part.placed(); ++q) {
      SetKey(evicted + 2 * (placed + q), part.displaced()[q]);
    }
    placed += part.placed();
    stats[0] += part.hits_;
    stats[2] += part.evicted_;
    stats[3] += part.refused_;
    stats[4] += part.pending_;
    added = WrapAdd(added, part.added_);
  }
  stats[1] = static_cast<int32_t>(placed);
  stats[5] = reserved;
  std::fill(reset + placed, reset + M, static_cast<int32_t>(C));
  for (int64_t q = placed; q < M; ++q) SetKey(evicted + 2 * q, kEmptyId);

  // 5. Halving, once per sketch_window counts.
  if (counting) {
    int32_t* total = total_out->typed_data();
    total[0] = WrapAdd(total[0], added);
    if (total[0] >= sketch_window) {
      const int64_t n = sd[0] * sd[1];
      int32_t* sketch = cx.sketch;
      team.Run([&](int p) {
        const int64_t a = PartStart(n, T, p), e = PartStart(n, T, p + 1);
        for (int64_t c = a; c < e; ++c) sketch[c] >>= 1;
      });
      total[0] >>= 1;
    }
  }
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
