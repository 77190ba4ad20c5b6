// The dynamic table's remap as XLA FFI handlers: the native CPU twins of
// jaxembed/kernels/remap.py's `lookup` and `step`, bit for bit (the policy itself is stated,
// one id at a time, in jaxembed/dynamic/reference.py).
//
// Shapes (one table or shard): ids u32[M, 2] (low half, high half), keys u32[C, 2],
// last_seen / count i32[C], sketch i32[D, W] ([0, 0] without admission counting; W = K ·
// num_buckets, bucket b's counters [b·K, (b+1)·K) of each row), sketch_total i32[1];
// C = num_buckets · S, bucket b holding rows [b·S, (b+1)·S). A shard (remap.Shard) is given
// its state alone and its first bucket among the table's `num_buckets`: it hashes every id
// into the table's buckets and decides its own, numbering its rows from its first.
//
// A step, where XLA sorts every id twice. The buckets are split into P runs ("parts", four a
// thread) and the slots into P chunks; each of the phases below is P items that the threads of
// a `Team` claim one at a time (ForEach: a thread the machine preempts leaves its share to the
// others), and no item reads what another writes in the same phase:
// 1. each chunk's buckets (AVX-512: Murmur and FastMod 16 ids at a time) and its slots copied,
//    as (id, bucket) pairs, into one list per part that owns them;
// 2. each part, alone: its slots grouped into distinct ids (an open-addressing table keyed by
//    the 64-bit id, a few thousand places: in the L1/L2), the distinct ids radix-sorted by
//    bucket and laid out in that order (id, bucket, multiplicity: read in sequence), then one
//    pass over its buckets in ascending order: each bucket's keys, last_seen and count are
//    prefetched into the L2 32 buckets ahead and into the L1 8 ahead, its ids found (AVX-512:
//    8 keys a compare), its hits touched, and its candidates ranked (estimate descending, id)
//    and given its free slots, then its victims, ordered exactly as remap._pick orders them
//    but only as far as needed (the least one, the usual case, by masked AVX-512 minima over
//    the bucket's slots), while its lines are in the cache. With admission counting the
//    misses' sketch adds (atomic when threads share the sketch, each add a few ids after its
//    cells were prefetched) come first and a second pass decides, once every estimate is final;
// 3. each chunk's results, laid out in the order XLA gives them (a slot's row read back from
//    its part's rows, in slot order; the rows the parts assigned, in part order).
// A bucket's decision reads and writes only its own rows and a part only its own buckets, so
// neither the split nor the thread that runs a part changes anything: the results are the same
// bits for any thread count. The idea of prefetching the rows a few items ahead is FBGEMM's
// EmbeddingSpMDM (`prefetch=16`), applied here to the identity array and the metadata; the
// ascending bucket order is what lets it pay on a VM's 4 KiB pages (three of them a bucket:
// keys, last_seen, count).
//
// Measured on 2 shared cores (benchmarks/dynamic/throughput.py: 2^26 slots at load factor 0.9,
// batches of 65536 Zipf ids, ~32k of them distinct in ~31k buckets): the pass over the buckets
// is ~2/3 of a step's CPU time and bound by the memory system, 8 cache lines from 3 pages of
// the 1 GiB state a bucket. Prefetching each bucket into the L2 32 buckets ahead and into the
// L1 8 ahead takes it to ~75-80 ns a bucket a core on 4 KiB pages, from ~90 with the L1 alone
// (8, 16 or 32 ahead, or fewer of the lines, all alike: the L1's few outstanding misses were
// the likely limit); then the page walks are (about 55-60 ns a bucket where the state happens
// to be on transparent huge pages). Phases 1 and 3 and the grouping were serial before (on the
// calling thread: ~30% of a step's wall time); split over the threads in parts small enough
// for the L1/L2, they cost less CPU time too.
//
// Every shape and attribute is checked and a bad one returns an ffi::Error that names it.

#include <algorithm>
#include <atomic>
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
// Steps since last_seen at step t, (t - last) mod 2^32 (remap._age): the step counter may wrap.
inline uint32_t Age(int32_t t, int32_t last) {
  return static_cast<uint32_t>(t) - static_cast<uint32_t>(last);
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

// The table's geometry, checked: C rows in buckets of S; for one of a table's row shards
// (remap.Shard), its buckets are [first_bucket, first_bucket + num_buckets) of the table's
// total_buckets, and its rows and buckets are numbered from its first.
struct Table {
  int64_t C = 0, S = 0, num_buckets = 0, total_buckets = 0, first_bucket = 0;
  uint32_t bucket_seed = 0;
  FastMod bucket_mod;  // % total_buckets
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

// The shard's place (after CheckTable): `total_buckets` of the whole table (0: the state is
// the whole table) and its first bucket, an int32 scalar operand (traced in a shard_map).
ffi::Error CheckShard(const char* k, ffi::Buffer<ffi::S32> first_bucket, int64_t total_buckets,
                      Table* t) {
  if (first_bucket.element_count() != 1) {
    return Invalid(k, "first_bucket must be an int32 scalar, got shape " +
                          Dims(first_bucket.dimensions()));
  }
  const int64_t first = first_bucket.typed_data()[0];
  const int64_t total = total_buckets == 0 ? t->num_buckets : total_buckets;
  if (total < t->num_buckets || total > kInt32Max || first < 0 || first + t->num_buckets > total) {
    return Invalid(k, "first_bucket=" + std::to_string(first) + " and num_buckets=" +
                          std::to_string(total) + ": the shard's " +
                          std::to_string(t->num_buckets) + " buckets must lie in the table's");
  }
  t->total_buckets = total;
  t->first_bucket = first;
  t->bucket_mod = FastMod(static_cast<uint32_t>(total));
  return ffi::Error::Success();
}

// An id's bucket in the whole table.
inline int32_t BucketOf(const Table& t, uint32_t lo, uint32_t hi) {
  return static_cast<int32_t>(t.bucket_mod(Murmur(lo, hi, t.bucket_seed)));
}

// The shard's number of the table's bucket b, or -2 where another shard holds it (-1, the
// reserved id's, stays).
inline int32_t Local(const Table& t, int32_t b) {
  if (b < 0) return b;
  const int64_t local = b - t.first_bucket;
  return local >= 0 && local < t.num_buckets ? static_cast<int32_t>(local) : -2;
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
// BucketOf for the 16 ids at id[0, 32) (pairs), lanes as in BucketOf, -1 for the reserved
// id; returns how many were reserved. Murmur's 32-bit steps on 16 lanes, then FastMod's
// ((m·x mod 2^64)·d) >> 64 from 32x32 -> 64-bit products on 8 lanes at a time.
inline int BucketOf16(const Table& t, const uint32_t* id, int32_t* out) {
  const __m512i a = _mm512_loadu_si512(id), b = _mm512_loadu_si512(id + 16);
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i lo = _mm512_permutex2var_epi32(a, even, b);
  const __m512i hi = _mm512_permutex2var_epi32(a, _mm512_add_epi32(even, _mm512_set1_epi32(1)), b);
  __m512i h = _mm512_set1_epi32(static_cast<int>(t.bucket_seed));
  for (const __m512i& block : {lo, hi}) {
    __m512i k = _mm512_mullo_epi32(block, _mm512_set1_epi32(static_cast<int>(0xCC9E2D51u)));
    k = _mm512_mullo_epi32(_mm512_rol_epi32(k, 15), _mm512_set1_epi32(0x1B873593));
    h = _mm512_rol_epi32(_mm512_xor_si512(h, k), 13);
    h = _mm512_add_epi32(_mm512_mullo_epi32(h, _mm512_set1_epi32(5)),
                         _mm512_set1_epi32(static_cast<int>(0xE6546B64u)));
  }
  h = _mm512_xor_si512(h, _mm512_set1_epi32(8));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(0x85EBCA6Bu)));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(0xC2B2AE35u)));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
  const __m512i m_lo = _mm512_set1_epi64(static_cast<long long>(t.bucket_mod.m & 0xFFFFFFFFu));
  const __m512i m_hi = _mm512_set1_epi64(static_cast<long long>(t.bucket_mod.m >> 32));
  const __m512i d = _mm512_set1_epi64(t.bucket_mod.d);
  auto mod = [&](__m256i x32) {
    const __m512i x = _mm512_cvtepu32_epi64(x32);
    const __m512i l = _mm512_add_epi64(_mm512_mul_epu32(x, m_lo),
                                       _mm512_slli_epi64(_mm512_mul_epu32(x, m_hi), 32));
    const __m512i low = _mm512_srli_epi64(_mm512_mul_epu32(l, d), 32);
    const __m512i q = _mm512_add_epi64(_mm512_mul_epu32(_mm512_srli_epi64(l, 32), d), low);
    return _mm512_cvtepi64_epi32(_mm512_srli_epi64(q, 32));
  };
  __m512i bucket = _mm512_inserti64x4(_mm512_castsi256_si512(mod(_mm512_castsi512_si256(h))),
                                      mod(_mm512_extracti64x4_epi64(h, 1)), 1);
  const __m512i ones = _mm512_set1_epi32(-1);
  const __mmask16 empty = _mm512_cmpeq_epi32_mask(lo, ones) & _mm512_cmpeq_epi32_mask(hi, ones);
  bucket = _mm512_mask_mov_epi32(bucket, empty, ones);
  _mm512_storeu_si512(out, bucket);
  return __builtin_popcount(empty);
}
#endif

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

// The same into the L2 only (prefetcht2), for lines wanted a long while later: the far half of
// the walk's two-distance prefetch (StepPart::WalkBuckets).
inline void PrefetchLinesToL2(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) {
    __builtin_prefetch(c + b, 0, 1);
    asm volatile("" : : "r"(c + b));
  }
}

inline void PrefetchBucket(const Table& t, const uint32_t* keys, int64_t b) {
  PrefetchLines(keys + 2 * b * t.S, t.S * 2 * static_cast<int64_t>(sizeof(uint32_t)));
}

// ---- lookup -----------------------------------------------------------------------------------

ffi::Error RemapLookupImpl(ffi::Buffer<ffi::U32> ids, ffi::Buffer<ffi::U32> keys,
                           ffi::Buffer<ffi::S32> first_bucket,
                           ffi::Result<ffi::Buffer<ffi::S32>> rows,
                           ffi::Result<ffi::Buffer<ffi::PRED>> found, int64_t bucket_size,
                           int64_t num_buckets, int64_t seed, int64_t num_threads) {
  constexpr const char* k = "remap_lookup";
  Table t;
  if (auto e = CheckTable(k, ids, keys, bucket_size, seed, num_threads, &t); e.failure()) return e;
  if (auto e = CheckShard(k, first_bucket, num_buckets, &t); e.failure()) return e;
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
        const int32_t b = Local(t, BucketOf(t, id[2 * ahead], id[2 * ahead + 1]));
        if (b >= 0) PrefetchBucket(t, table, b);
      }
      int64_t row = -1;
      if (!IsEmpty(id + 2 * i)) {
        const int32_t b = Local(t, BucketOf(t, id[2 * i], id[2 * i + 1]));
        if (b >= 0) row = Probe(t, table, b, Key64(id + 2 * i));
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

#if defined(__AVX512F__)
// The least of bucket `base`'s victims (as TakeSlots orders them), 16 slots a compare, for
// S <= 64 a multiple of 16: the slots that may be taken as a mask, then the least count (lfu)
// and the greatest age among them as masked minima (of the count, signed, and of ~age,
// unsigned), then the first slot (least row) that has both; -1 where no slot may be taken.
// One victim is what almost every eviction needs.
inline int64_t LeastVictim(const Table& tb, const StepAttrs& at, int32_t t, int64_t base,
                           const uint32_t* keys, const int32_t* last, const int32_t* count) {
  const int64_t S = tb.S;
  const uint64_t all = S == 64 ? ~uint64_t{0} : (uint64_t{1} << S) - 1;
  uint64_t ok = ~SlotMask(keys + 2 * base, S, kEmptyId) & all;  // held rows
  const __m512i now = _mm512_set1_epi32(t), ttl = _mm512_set1_epi32(
                                                static_cast<int32_t>(at.ttl_steps));
  auto age = [&](int64_t s) { return _mm512_sub_epi32(now, _mm512_loadu_si512(last + base + s)); };
  for (int64_t s = 0; s < S; s += 16) {
    const __m512i a = age(s);
    __mmask16 m = _mm512_test_epi32_mask(a, a);  // age != 0: not read in this step
    if (at.policy == kTtl) m &= _mm512_cmpgt_epu32_mask(a, ttl);  // ages are unsigned
    ok &= ~(static_cast<uint64_t>(static_cast<__mmask16>(~m)) << s);
  }
  if (!ok) return -1;
  // The slots of `mask` where key(s) is least, signed or unsigned (ok before the first).
  auto least = [&](auto key, bool is_unsigned, uint64_t mask) {
    __m512i lo = _mm512_set1_epi32(is_unsigned ? -1 : kInt32Max);
    for (int64_t s = 0; s < S; s += 16) {
      const auto m = static_cast<__mmask16>(mask >> s);
      lo = is_unsigned ? _mm512_mask_min_epu32(lo, m, lo, key(s))
                       : _mm512_mask_min_epi32(lo, m, lo, key(s));
    }
    const __m512i m = _mm512_set1_epi32(
        is_unsigned ? static_cast<int32_t>(_mm512_reduce_min_epu32(lo))
                    : _mm512_reduce_min_epi32(lo));
    uint64_t at_min = 0;
    for (int64_t s = 0; s < S; s += 16) {
      at_min |= static_cast<uint64_t>(_mm512_cmpeq_epi32_mask(key(s), m)) << s;
    }
    return mask & at_min;
  };
  auto counts = [&](int64_t s) { return _mm512_loadu_si512(count + base + s); };
  auto older = [&](int64_t s) { return _mm512_xor_si512(age(s), _mm512_set1_epi32(-1)); };
  if (at.policy == kLfu) ok = least(counts, false, ok);
  return base + __builtin_ctzll(least(older, true, ok));
}
#endif

// The first `want` places of bucket b's order (remap._pick): its free slots ascending, then its
// victims by (count, age descending, row) under lfu, by (age descending, row) otherwise, the
// age (t - last_seen) mod 2^32; a slot read in this step (age 0) is no victim, nor under ttl
// one with age <= ttl_steps.
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
#if defined(__AVX512F__)
  if (want - n == 1 && tb.S % 16 == 0 && tb.S <= 64) {
    const int64_t r = LeastVictim(tb, at, t, base, keys, last, count);
    if (r >= 0) out[n++] = static_cast<int32_t>(r);
    return n;
  }
#endif
  int64_t nv = 0;
  for (int64_t r = base; r < base + tb.S; ++r) {
    const uint32_t age = Age(t, last[r]);
    if (!IsEmpty(keys + 2 * r) && age != 0 &&
        (at.policy != kTtl || age > static_cast<uint32_t>(at.ttl_steps))) {
      victims[nv++] = static_cast<int32_t>(r);
    }
  }
  const int64_t need = std::min(want - n, nv);
  if (need <= 0) return n;
  // The row makes every key distinct, so these orders are total.
  auto recent = [&](int32_t x, int32_t y) {  // the older (greater age) first
    const uint32_t ax = Age(t, last[x]), ay = Age(t, last[y]);
    return ax != ay ? ax > ay : x < y;
  };
  auto lfu = [&](int32_t x, int32_t y) {
    return count[x] != count[y] ? count[x] < count[y] : recent(x, y);
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

// Calls fn(i) for every i in [0, n) on the team's threads, each thread claiming the next i
// whenever it is free, so a thread the machine preempts leaves its share to the others. Each i
// writes only its own outputs: which thread runs it changes nothing.
template <class F>
void ForEach(Team& team, int n, const F& fn) {
  std::atomic<int> next{0};
  team.Run([&](int) {
    for (int i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) fn(i);
  });
}

// Parts of the buckets (and chunks of the slots) a thread: small parts keep a part's dedup
// table and arrays in the L1/L2, and let the threads even out what a preempted one leaves.
constexpr int64_t kPartsPerThread = 4;

// What a step's parts share: the table, the attributes and the state.
struct StepContext {
  Table tb;
  StepAttrs at;
  int32_t t;
  uint32_t* keys;  // [C, 2]
  int32_t *last, *count, *sketch;
  int64_t D = 0, W = 0;  // the sketch's rows and counters a row
  FastMod k_mod;         // % K, each bucket's counters a row (W = K · num_buckets)
  uint32_t sketch_seed[kMaxSketchDepth];
  bool counting, atomic_sketch;

  // Sketch row j's counter of `id` in bucket b: its column b·K + (h_j mod K) (keys.sketch_index;
  // the cell is j·W + column).
  uint32_t Column(uint64_t id, int64_t b, int64_t j) const {
    return static_cast<uint32_t>(b * k_mod.d + k_mod(Murmur(Lo(id), Hi(id), sketch_seed[j])));
  }
  // Asks for bucket b's keys, last_seen and count (all read by a victim search; the hits'
  // touch writes the last two) a few buckets before they are read.
  void Prefetch(int64_t b) const {
    PrefetchLines(keys + 2 * b * tb.S, tb.S * 8);
    PrefetchLines(last + b * tb.S, tb.S * 4, true);
    PrefetchLines(count + b * tb.S, tb.S * 4, true);
  }
};

// The split of the buckets over P parts: part p owns the buckets b with Owner(b) = p, a run
// [Lo(p), Lo(p + 1)) of about num_buckets / P of them (a multiply and a shift a slot, no
// division), so every id belongs to exactly one part, whichever slot it is in.
struct Split {
  int P = 1;
  uint64_t mul = 0;  // floor(P · 2^32 / num_buckets) <= 2^32 (P <= num_buckets)
  int64_t num_buckets = 1;
  Split(int parts, int64_t nb) : P(parts), num_buckets(nb) {
    mul = (static_cast<uint64_t>(parts) << 32) / static_cast<uint64_t>(nb);
  }
  int Owner(int64_t b) const { return static_cast<int>((static_cast<uint64_t>(b) * mul) >> 32); }
  int64_t Lo(int p) const {  // the least b with Owner(b) >= p
    if (p == 0) return 0;
    if (p >= P) return num_buckets;
    const uint64_t want = static_cast<uint64_t>(p) << 32;
    return std::min<int64_t>(num_buckets, static_cast<int64_t>((want + mul - 1) / mul));
  }
};

// A slot of the batch as its part reads it: the id and its bucket.
struct Slot {
  uint64_t id;
  int64_t bucket;
};

// The batch's slots as the parts read them: each slot's bucket (-1: the reserved id), and for
// each chunk q of the slots (P equal chunks) the slots of it that part p owns (owned[q·P + p]).
struct Batch {
  const uint32_t* id;
  int64_t M;
  std::unique_ptr<int32_t[]> bucket;
  std::unique_ptr<Slot[]> by_owner;  // each chunk's slots (not reserved) by part, in slot order
  std::vector<int64_t> owned;
  std::vector<int64_t> segment;  // [q·P + p]: where chunk q's slots of part p start in by_owner
  std::vector<int32_t> reserved;  // per chunk
};

// One part of a step: the buckets [lo, hi) and the batch's ids in them. It finds their distinct
// ids, sorts them by bucket and decides its buckets in ascending order; the rows it assigns (in
// order: bucket, then rank), its counts, and the row of each of its slots.
class StepPart {
 public:
  static constexpr int64_t kAhead = 8;      // buckets prefetched ahead of the one decided
  static constexpr int64_t kFar = 32;       // ... and into the L2 only, further ahead (the walk)
  static constexpr int64_t kPlaceAhead = 16;  // slots whose dedup place is asked for ahead
  static constexpr int64_t kAddLag = 8;     // ids whose sketch cells are asked for before adding

  StepPart(int p, const Split& split) : p_(p), lo_(split.Lo(p)), hi_(split.Lo(p + 1)) {}

  // The part's slots (in slot order: chunk by chunk) grouped into its distinct ids (an
  // open-addressing table, linear probing, keyed by the 64-bit id, at most half full: 4 bytes
  // a place, in the L2), then the distinct ids sorted by bucket (a stable radix sort of
  // (bucket, number) pairs) and laid out in that order: id, bucket and multiplicity, read in
  // sequence by the walk; and each slot's distinct id (its place in that order).
  void Gather(const StepContext& cx, const Batch& batch, int P) {
    n_own_ = 0;
    for (int q = 0; q < P; ++q) n_own_ += batch.owned[static_cast<size_t>(q) * P + p_];
    slot_ = Uninitialized<int32_t>(n_own_);
    auto first_id = Uninitialized<uint64_t>(n_own_);
    auto first_pair = Uninitialized<uint64_t>(n_own_);  // (bucket - lo) << 32 | multiplicity
    int log2 = 4;
    while ((int64_t{1} << log2) < 2 * n_own_) ++log2;
    const uint64_t places = uint64_t{1} << log2, place_mask = places - 1;
    auto place = Uninitialized<int32_t>(static_cast<int64_t>(places));
    std::fill(place.get(), place.get() + places, -1);
    auto home = [&](uint64_t key) { return (key * 0x9E3779B97F4A7C15ull) >> (64 - log2); };
    int64_t k = 0;
    int32_t n = 0;
    for (int q = 0; q < P; ++q) {
      const Slot* list = batch.by_owner.get() + batch.segment[static_cast<size_t>(q) * P + p_];
      const int64_t n_list = batch.owned[static_cast<size_t>(q) * P + p_];
      for (int64_t x = 0; x < n_list; ++x) {
        if (x + kPlaceAhead < n_list) __builtin_prefetch(&place[home(list[x + kPlaceAhead].id)]);
        const uint64_t key = list[x].id;
        uint64_t h = home(key);  // Fibonacci hashing
        int32_t v;
        while ((v = place[h]) >= 0 && first_id[v] != key) h = (h + 1) & place_mask;
        if (v < 0) {
          v = n++;
          place[h] = v;
          first_id[v] = key;
          first_pair[v] = static_cast<uint64_t>(list[x].bucket - lo_) << 32;
        }
        ++first_pair[v];  // the multiplicity, in the low half
        slot_[k++] = v;
      }
    }
    place.reset();
    U_ = n;
    // By bucket: the pairs become (bucket - lo) << 32 | number.
    auto pairs = Uninitialized<uint64_t>(2 * U_);
    for (int64_t v = 0; v < U_; ++v) {
      pairs[v] = (first_pair[v] >> 32) << 32 | static_cast<uint64_t>(v);
    }
    const uint64_t* sorted = SortByHighHalf(pairs.get(), pairs.get() + U_, U_,
                                            BitsFor(static_cast<uint64_t>(hi_ - lo_)));
    id_ = Uninitialized<uint64_t>(U_);
    bucket_ = Uninitialized<int32_t>(U_);
    mult_ = Uninitialized<int32_t>(U_);
    row_ = Uninitialized<int32_t>(U_);
    if (cx.counting) {
      est_ = Uninitialized<int32_t>(U_);
      column_ = Uninitialized<uint32_t>(U_ * cx.D);
    }
    auto at = Uninitialized<int32_t>(U_);  // each number's place in bucket order
    for (int64_t j = 0; j < U_; ++j) {
      const int32_t v = static_cast<int32_t>(sorted[j]);
      id_[j] = first_id[v];
      bucket_[j] = static_cast<int32_t>((sorted[j] >> 32) + lo_);
      mult_[j] = static_cast<int32_t>(first_pair[v]);
      at[v] = static_cast<int32_t>(j);
    }
    for (int64_t q = 0; q < n_own_; ++q) slot_[q] = at[slot_[q]];
    group_.clear();
    for (int64_t j = 0; j < U_; ++j) {
      if (j == 0 || bucket_[j] != bucket_[j - 1]) group_.push_back(j);
    }
    group_.push_back(U_);
    reset_ = Uninitialized<int32_t>(U_);
    displaced_ = Uninitialized<uint64_t>(U_);
    places_.resize(static_cast<size_t>(cx.tb.S));
    victims_.resize(static_cast<size_t>(cx.tb.S));
  }

  // One pass over the part's buckets, each prefetched into the L2 kFar buckets before and into
  // the L1 kAhead buckets before (measured here: ~15% less time in the pass than the L1 alone
  // at 8 ahead, which left the step waiting on the L1's few outstanding misses; 16 or 32
  // ahead into the L1 alone did not help): its distinct ids are found, its hits touched, then
  // (without counting) its candidates assigned while its lines are in the cache; with counting
  // its misses are added to the sketch (atomically when several parts run; each add kAddLag
  // ids after its cells were asked for) and the bucket is kept for DecideCounted. Compiled for
  // S = 32 (the default) apart, so that its loops unroll.
  void Walk(const StepContext& cx) {
    if (cx.tb.S == 32) {
      WalkBuckets<32>(cx);
    } else {
      WalkBuckets<0>(cx);
    }
  }

  template <int kS>
  void WalkBuckets(const StepContext& cx) {
    const int64_t S = kS ? kS : cx.tb.S;
    const int64_t G = static_cast<int64_t>(group_.size()) - 1;  // buckets
    auto far = [&](int64_t g) {  // bucket g's lines into the L2
      const int64_t b = bucket_[group_[g]];
      PrefetchLinesToL2(cx.keys + 2 * b * S, S * 8);
      PrefetchLinesToL2(cx.last + b * S, S * 4);
      PrefetchLinesToL2(cx.count + b * S, S * 4);
    };
    auto near = [&](int64_t g) {  // and from there into the L1 (last_seen, count for writing)
      const int64_t b = bucket_[group_[g]];
      PrefetchLines(cx.keys + 2 * b * S, S * 8);
      PrefetchLines(cx.last + b * S, S * 4, true);
      PrefetchLines(cx.count + b * S, S * 4, true);
    };
    for (int64_t g = 0; g < std::min(G, kFar); ++g) far(g);
    for (int64_t g = 0; g < std::min(G, kAhead); ++g) near(g);
    int64_t added_upto = 0;  // misses[0, added_upto) are in the sketch (counting)
    for (int64_t g = 0; g < G; ++g) {
      if (g + kFar < G) far(g + kFar);
      if (g + kAhead < G) near(g + kAhead);
      const int64_t a = group_[g], e = group_[g + 1], b = bucket_[a];
      const uint32_t* bucket_keys = cx.keys + 2 * b * S;
      bool miss = false;
      for (int64_t j = a; j < e; ++j) {
        const int64_t s = FindInBucket(bucket_keys, S, id_[j]);
        if (s < 0) {
          row_[j] = -1;
          miss = true;
          continue;
        }
        const int64_t r = b * S + s;
        cx.last[r] = cx.t;
        cx.count[r] = SaturatingAdd(cx.count[r], mult_[j]);
        row_[j] = static_cast<int32_t>(r);
        ++hits_;
      }
      if (!miss) continue;
      if (!cx.counting) {
        Decide(cx, b, a, e, mult_.get());
        continue;
      }
      for (int64_t j = a; j < e; ++j) {
        if (row_[j] >= 0) continue;
        uint32_t* col = column_.get() + j * cx.D;
        for (int64_t d = 0; d < cx.D; ++d) {
          col[d] = cx.Column(id_[j], b, d);
          __builtin_prefetch(cx.sketch + d * cx.W + col[d], 1, 3);
        }
        misses_.push_back(static_cast<int32_t>(j));
        added_ = WrapAdd(added_, mult_[j]);
      }
      for (; added_upto + kAddLag < static_cast<int64_t>(misses_.size()); ++added_upto) {
        AddToSketch(cx, misses_[added_upto]);
      }
      counted_.push_back(g);
    }
    for (; added_upto < static_cast<int64_t>(misses_.size()); ++added_upto) {
      AddToSketch(cx, misses_[added_upto]);
    }
  }

  // After every part's adds (counting only): each kept bucket's misses read their estimates,
  // then its candidates are assigned (the buckets and the misses' cells prefetched ahead).
  void DecideCounted(const StepContext& cx) {
    const int64_t K = static_cast<int64_t>(counted_.size());
    auto prefetch = [&](int64_t c) {
      const int64_t g = counted_[c];
      cx.Prefetch(bucket_[group_[g]]);
      for (int64_t j = group_[g]; j < group_[g + 1]; ++j) {
        if (row_[j] >= 0) continue;
        const uint32_t* col = column_.get() + j * cx.D;
        for (int64_t d = 0; d < cx.D; ++d) __builtin_prefetch(cx.sketch + d * cx.W + col[d]);
      }
    };
    for (int64_t c = 0; c < std::min(K, kAhead); ++c) prefetch(c);
    for (int64_t c = 0; c < K; ++c) {
      if (c + kAhead < K) prefetch(c + kAhead);
      const int64_t g = counted_[c], a = group_[g], e = group_[g + 1], b = bucket_[a];
      for (int64_t j = a; j < e; ++j) {
        if (row_[j] >= 0) continue;
        const uint32_t* col = column_.get() + j * cx.D;
        int32_t est = cx.sketch[col[0]];
        for (int64_t d = 1; d < cx.D; ++d) est = std::min(est, cx.sketch[d * cx.W + col[d]]);
        est_[j] = est;
      }
      Decide(cx, b, a, e, est_.get());
    }
  }

  // After the decisions: each of the part's slots' rows (-1: none), in slot order.
  void Finish() {
    for (int64_t q = 0; q < n_own_; ++q) slot_[q] = row_[slot_[q]];
  }

  int64_t placed() const { return placed_; }
  const int32_t* reset() const { return reset_.get(); }
  const uint64_t* displaced() const { return displaced_.get(); }
  const int32_t* slot_rows() const { return slot_.get(); }
  int32_t hits_ = 0, evicted_ = 0, refused_ = 0, pending_ = 0, added_ = 0;

 private:
  void AddToSketch(const StepContext& cx, int32_t j) {
    const uint32_t* col = column_.get() + static_cast<int64_t>(j) * cx.D;
    for (int64_t d = 0; d < cx.D; ++d) {
      int32_t* c = cx.sketch + d * cx.W + col[d];
      if (cx.atomic_sketch) {  // wrapping adds commute: the sums are the same in any order
        __atomic_fetch_add(c, mult_[j], __ATOMIC_RELAXED);
      } else {
        *c = WrapAdd(*c, mult_[j]);
      }
    }
  }

  // Bucket b's candidates among its misses ([a, e): estimate >= admit_after, the others
  // pending), ranked by (estimate descending, id); candidate r takes place r of the bucket's
  // order, or is refused.
  void Decide(const StepContext& cx, int64_t b, int64_t a, int64_t e, const int32_t* est) {
    cand_.clear();
    for (int64_t j = a; j < e; ++j) {
      if (row_[j] >= 0) continue;
      if (est[j] < cx.at.admit_after) {
        ++pending_;
        continue;
      }
      cand_.push_back(static_cast<int32_t>(j));
    }
    if (cand_.empty()) return;
    const int64_t K = static_cast<int64_t>(cand_.size());
    if (K > 1) {
      std::sort(cand_.begin(), cand_.end(), [&](int32_t x, int32_t y) {
        return est[x] != est[y] ? est[x] > est[y] : id_[x] < id_[y];
      });
    }
    const int64_t n = TakeSlots(cx.tb, cx.at, cx.t, b, std::min(K, cx.tb.S), cx.keys, cx.last,
                                cx.count, places_.data(), victims_.data());
    refused_ += static_cast<int32_t>(K - n);
    for (int64_t q = 0; q < n; ++q) {
      const int32_t j = cand_[q], r = places_[q];
      const uint64_t old = Key64(cx.keys + 2 * r);
      SetKey(cx.keys + 2 * r, id_[j]);
      cx.last[r] = cx.t;
      cx.count[r] = est[j];
      row_[j] = r;
      reset_[placed_] = r;
      displaced_[placed_++] = old;
      evicted_ += old != kEmptyId;
    }
  }

  int p_;
  int64_t lo_, hi_;            // the part's buckets
  int64_t n_own_ = 0, U_ = 0;  // its slots, its distinct ids
  std::unique_ptr<int32_t[]> slot_;  // each slot's distinct id (in bucket order), then its row
  std::unique_ptr<uint64_t[]> id_;   // the distinct ids in bucket order: id, bucket, multiplicity,
  std::unique_ptr<int32_t[]> bucket_, mult_, est_, row_;  // estimate (counting), row (-1: none)
  std::unique_ptr<uint32_t[]> column_;  // [U, D] their sketch columns (counting)
  int64_t placed_ = 0;
  std::unique_ptr<int32_t[]> reset_;
  std::unique_ptr<uint64_t[]> displaced_;
  std::vector<int32_t> cand_, places_, victims_, misses_;
  std::vector<int64_t> group_;    // each bucket's first distinct id, then U
  std::vector<int64_t> counted_;  // DecideCounted's buckets (their numbers in group_)
};

ffi::Error RemapStepImpl(ffi::Buffer<ffi::U32> ids, ffi::Buffer<ffi::S32> step_index,
                         ffi::Buffer<ffi::S32> first_bucket, ffi::Buffer<ffi::U32> keys_in, ffi::Buffer<ffi::S32> last_in,
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
                         int64_t num_buckets, int64_t admit_after, int64_t policy,
                         int64_t ttl_steps, int64_t sketch_window, int64_t halve, int64_t seed,
                         int64_t num_threads) {
  constexpr const char* k = "remap_step";
  Table tb;
  if (auto e = CheckTable(k, ids, keys_in, bucket_size, seed, num_threads, &tb); e.failure()) {
    return e;
  }
  if (auto e = CheckShard(k, first_bucket, num_buckets, &tb); e.failure()) return e;
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
                                      sd[1] > kInt32Max || sd[1] % tb.num_buckets != 0))) {
    return Invalid(k, "sketch has shape " + Dims(sd) + ": admit_after=" +
                          std::to_string(admit_after) + " needs a [depth, width] sketch, depth " +
                          "in [1, " + std::to_string(kMaxSketchDepth) + "], width a multiple " +
                          "of the " + std::to_string(tb.num_buckets) + " buckets");
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

  StepContext cx;
  cx.tb = tb;
  cx.at = StepAttrs{admit_after, policy, ttl_steps, sketch_window, static_cast<uint32_t>(seed)};
  cx.t = step_index.typed_data()[0];
  cx.keys = keys_out->typed_data();
  cx.last = last_out->typed_data();
  cx.count = count_out->typed_data();
  cx.sketch = sketch_out->typed_data();
  cx.counting = counting;
  if (counting) {
    cx.D = sd[0];
    cx.W = sd[1];
    cx.k_mod = FastMod(static_cast<uint32_t>(sd[1] / tb.num_buckets));
    for (int64_t j = 0; j < cx.D; ++j) {
      cx.sketch_seed[j] = StreamSeed(cx.at.seed, kStreamSketch + static_cast<uint32_t>(j));
    }
  }
  Team team(ThreadsFor(num_threads, M, 4096));
  const int T = team.size();
  cx.atomic_sketch = T > 1;
  // P parts of the buckets and P chunks of the slots, each claimed by the next free thread
  // (ForEach): a thread the machine preempts leaves its share to the others.
  const int P = static_cast<int>(std::min<int64_t>(kPartsPerThread * T, tb.num_buckets));
  const Split split(P, tb.num_buckets);

  // 1. Each slot's bucket, by chunk, and the chunk's slots by the part that owns them.
  Batch batch;
  batch.id = id;
  batch.M = M;
  batch.bucket = Uninitialized<int32_t>(M);
  batch.by_owner = Uninitialized<Slot>(M);
  batch.owned.assign(static_cast<size_t>(P) * P, 0);
  batch.segment.assign(static_cast<size_t>(P) * P, 0);
  batch.reserved.assign(static_cast<size_t>(P), 0);
  ForEach(team, P, [&](int q) {
    std::vector<int64_t> owned(static_cast<size_t>(P), 0);  // here, not in batch.owned: its
    int32_t reserved = 0;                                   // lines are shared by the chunks
    const int64_t a = PartStart(M, P, q), e = PartStart(M, P, q + 1);
    int64_t i = a;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    for (; i + 16 <= e; i += 16) reserved += BucketOf16(tb, id + 2 * i, &batch.bucket[i]);
#endif
    for (; i < e; ++i) {
      const bool empty = IsEmpty(id + 2 * i);
      reserved += empty;
      batch.bucket[i] = empty ? -1 : BucketOf(tb, id[2 * i], id[2 * i + 1]);
    }
    if (tb.total_buckets != tb.num_buckets) {  // a shard: its own buckets, -2 for the others
      for (i = a; i < e; ++i) batch.bucket[i] = Local(tb, batch.bucket[i]);
    }
    for (i = a; i < e; ++i) {
      const int32_t b = batch.bucket[i];
      if (b >= 0) ++owned[split.Owner(b)];
    }
    batch.reserved[q] = reserved;
    std::copy(owned.begin(), owned.end(), &batch.owned[static_cast<size_t>(q) * P]);
    int64_t* put = &batch.segment[static_cast<size_t>(q) * P];
    for (int64_t p = 0, at = a; p < P; at += owned[p++]) put[p] = at;
    std::vector<int64_t> next(put, put + P);
    for (i = a; i < e; ++i) {
      const int32_t b = batch.bucket[i];
      if (b >= 0) batch.by_owner[next[split.Owner(b)]++] = Slot{Key64(id + 2 * i), b};
    }
  });

  // 2. Each part's buckets: its distinct ids by bucket, then its decisions. A bucket's decision
  // reads and writes only its own rows and no two parts share a bucket: no locks, and no
  // decision depends on the split (with counting, every add is in before any estimate is read).
  std::vector<StepPart> parts;
  parts.reserve(static_cast<size_t>(P));
  for (int p = 0; p < P; ++p) parts.emplace_back(p, split);
  ForEach(team, P, [&](int p) {
    parts[p].Gather(cx, batch, P);
    parts[p].Walk(cx);
    if (!counting) parts[p].Finish();
  });
  if (counting) {
    ForEach(team, P, [&](int p) {
      parts[p].DecideCounted(cx);
      parts[p].Finish();
    });
  }

  // 3. The results, laid out as XLA's, by chunk: each slot's row (capacity where none), read
  // from its part's rows in slot order; the assigned rows by bucket (the parts' runs ascend),
  // then rank, padded with capacity, and the ids they held.
  std::vector<int64_t> offset(static_cast<size_t>(P) + 1, 0);
  std::vector<const int32_t*> part_rows(static_cast<size_t>(P));
  int32_t added = 0, reserved = 0;
  for (int p = 0; p < P; ++p) {
    const StepPart& part = parts[p];
    offset[p + 1] = offset[p] + part.placed();
    part_rows[p] = part.slot_rows();
    stats[0] += part.hits_;
    stats[2] += part.evicted_;
    stats[3] += part.refused_;
    stats[4] += part.pending_;
    added = WrapAdd(added, part.added_);
    reserved += batch.reserved[p];
  }
  const int64_t placed = offset[P];
  stats[1] = static_cast<int32_t>(placed);
  stats[5] = reserved;
  std::vector<int64_t> first(static_cast<size_t>(P) * P);  // [q·P + p]: part p's first slot in q
  for (int p = 0; p < P; ++p) {
    for (int64_t q = 0, n = 0; q < P; n += batch.owned[static_cast<size_t>(q++) * P + p]) {
      first[static_cast<size_t>(q) * P + p] = n;
    }
  }
  ForEach(team, P, [&](int q) {
    std::vector<int64_t> next(first.begin() + static_cast<int64_t>(q) * P,
                              first.begin() + static_cast<int64_t>(q + 1) * P);
    for (int64_t i = PartStart(M, P, q), e = PartStart(M, P, q + 1); i < e; ++i) {
      const int32_t b = batch.bucket[i];
      int32_t r = -1;
      if (b >= 0) {
        const int p = split.Owner(b);
        r = part_rows[p][next[p]++];
      }
      rows[i] = r >= 0 ? r : static_cast<int32_t>(C);
      found[i] = r >= 0;
    }
    const StepPart& part = parts[q];
    std::copy(part.reset(), part.reset() + part.placed(), reset + offset[q]);
    for (int64_t j = 0; j < part.placed(); ++j) {
      SetKey(evicted + 2 * (offset[q] + j), part.displaced()[j]);
    }
    const int64_t a = placed + PartStart(M - placed, P, q);
    const int64_t e = placed + PartStart(M - placed, P, q + 1);
    std::fill(reset + a, reset + e, static_cast<int32_t>(C));
    for (int64_t j = a; j < e; ++j) SetKey(evicted + 2 * j, kEmptyId);
  });

  // 4. Halving, once per sketch_window counts (a shard's waits on every shard's counts: the
  // caller halves).
  if (counting) {
    int32_t* total = total_out->typed_data();
    total[0] = WrapAdd(total[0], added);
    if (halve && total[0] >= sketch_window) {
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
                                  .Arg<ffi::Buffer<ffi::S32>>()   // first_bucket []
                                  .Ret<ffi::Buffer<ffi::S32>>()   // rows [M]
                                  .Ret<ffi::Buffer<ffi::PRED>>()  // found [M]
                                  .Attr<int64_t>("bucket_size")
                                  .Attr<int64_t>("num_buckets")
                                  .Attr<int64_t>("seed")
                                  .Attr<int64_t>("num_threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxembedRemapStep, jaxembed::Safe<jaxembed::RemapStepImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U32>>()   // ids [M, 2]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // step_index []
                                  .Arg<ffi::Buffer<ffi::S32>>()   // first_bucket []
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
                                  .Attr<int64_t>("num_buckets")
                                  .Attr<int64_t>("admit_after")
                                  .Attr<int64_t>("policy")
                                  .Attr<int64_t>("ttl_steps")
                                  .Attr<int64_t>("sketch_window")
                                  .Attr<int64_t>("halve")
                                  .Attr<int64_t>("seed")
                                  .Attr<int64_t>("num_threads"));
