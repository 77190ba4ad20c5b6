// Shared pieces of jaxembed's native CPU kernels: a per-call thread team, bfloat16
// conversion, row prefetching and a stable parallel radix sort of slots by row.
//
// No global state: every kernel call builds its own `Team` (its threads live for the call),
// so concurrent calls from several simulated devices never share anything.

#ifndef JAXEMBED_KERNELS_NATIVE_COMMON_H_
#define JAXEMBED_KERNELS_NATIVE_COMMON_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <immintrin.h>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace jaxembed {

// ---- threads ---------------------------------------------------------------------------------

// A fork-join team of `size` threads for one kernel call: `Run(fn)` calls fn(t) for
// t = 0..size-1 (t = 0 on the calling thread) and returns when all are done.
//
// Between phases a worker spins for a short while (kSpinRounds pauses, ~0.1-0.3 ms) before it
// sleeps on a condition variable, and so does the caller waiting for the workers: waking a
// sleeping thread (an idle vCPU of a VM) cost more than a whole radix pass here. The spin is
// bounded, so an idle team never holds a core that XLA's own threads need for long.
class Team {
 public:
  explicit Team(int size) {
    // If the system refuses a thread, the team is smaller (the work is split by size()).
    for (int t = 1; t < std::max(1, size); ++t) {
      try {
        workers_.emplace_back([this, t] { Loop(t); });
      } catch (const std::system_error&) {
        break;
      }
    }
    size_ = 1 + static_cast<int>(workers_.size());
  }
  ~Team() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_.store(true, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }
  Team(const Team&) = delete;
  Team& operator=(const Team&) = delete;

  int size() const { return size_; }

  template <class F>
  void Run(const F& fn) {
    if (size_ == 1) {
      fn(0);
      return;
    }
    ctx_ = &fn;
    call_ = [](const void* ctx, int t) { (*static_cast<const F*>(ctx))(t); };
    pending_.store(size_ - 1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(mu_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    fn(0);
    for (int i = 0; i < kSpinRounds; ++i) {
      if (pending_.load(std::memory_order_acquire) == 0) return;
      Pause();
    }
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return pending_.load(std::memory_order_acquire) == 0; });
  }

 private:
  static constexpr int kSpinRounds = 4000;

  static void Pause() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#else
    std::this_thread::yield();
#endif
  }

  void Loop(int t) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t g = generation_.load(std::memory_order_acquire);
      for (int i = 0; g == seen && i < kSpinRounds; ++i) {
        Pause();
        g = generation_.load(std::memory_order_acquire);
      }
      if (g == seen) {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
        g = generation_.load(std::memory_order_acquire);
      }
      seen = g;
      if (stop_.load(std::memory_order_relaxed)) return;
      call_(ctx_, t);
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> lock(mu_);
        done_.notify_one();
      }
    }
  }

  int size_ = 1;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  const void* ctx_ = nullptr;
  void (*call_)(const void*, int) = nullptr;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
};

// Threads worth starting for `work` items: at most `requested`, at least `grain` items each.
// The default grain, 2^18 slots a thread, is measured on the 2-core machine: a second thread
// lost at every size up to 172k slots (1 thread 0.7-4.0 ms a step, 2 threads 0.9-5.0 ms, the
// grid's cells of 26k-172k ids: it waits for a core and hands off memory-bound work) and tied
// at 827k; the old grain of 16k slots made 2 threads the default from 32k slots on.
inline int ThreadsFor(int64_t requested, int64_t work, int64_t grain = int64_t{1} << 18) {
  int64_t useful = (work + grain - 1) / grain;
  return static_cast<int>(std::max<int64_t>(1, std::min(requested, useful)));
}

// The start of part `p` of `parts` equal parts of [0, n).
inline int64_t PartStart(int64_t n, int parts, int p) { return n * p / parts; }

// ---- element types ---------------------------------------------------------------------------

using bf16_t = uint16_t;

inline float ToF32(float x) { return x; }
inline float ToF32(bf16_t x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// float32 -> bfloat16 rounding to nearest even, as XLA's convert (NaN stays a quiet NaN).
inline void FromF32(float x, float* out) { *out = x; }
inline void FromF32(float x, bf16_t* out) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    *out = static_cast<bf16_t>((u >> 16) | 0x40u);
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  *out = static_cast<bf16_t>(u >> 16);
}

// ---- weighted sums of rows, 64 columns at a time in registers ----------------------------------

#if defined(__AVX512F__)
inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 Load16(const bf16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif
#if defined(__AVX2__)
inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Load8(const bf16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

// dst[0:H] = Σ_k s_k · row_k[0:H] over k in [a, b), in order of k, from 0; `get(k, &row, &s, c)`
// gives item k's row (T[H]) and factor, or returns false to skip it, while the sum reads the
// row's columns from c on (up to 64 of them: a row wider than 64 is walked once per 64 columns,
// so a prefetch in `get` fetches those columns, not the whole row again). Each sum is
// ((0 + r0·s0) + r1·s1) + ..., multiplies and adds rounded apart, as XLA's `rows * scale`
// then segment_sum. The accumulators of 64 columns stay in registers for the whole run (the
// output is stored once), so the random row reads of consecutive items overlap in the
// out-of-order core (2-3x faster here than accumulating in memory).
template <class T, class Get>
inline void WeightedSum(float* __restrict dst, int64_t H, int64_t a, int64_t b, const Get& get) {
  int64_t c = 0;
#if defined(__AVX512F__)
  for (; c + 64 <= H; c += 64) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t k = a; k < b; ++k) {
      const T* row;
      float s;
      if (!get(k, &row, &s, c)) continue;
      row += c;
      const __m512 sv = _mm512_set1_ps(s);
      a0 = _mm512_add_ps(a0, _mm512_mul_ps(Load16(row), sv));
      a1 = _mm512_add_ps(a1, _mm512_mul_ps(Load16(row + 16), sv));
      a2 = _mm512_add_ps(a2, _mm512_mul_ps(Load16(row + 32), sv));
      a3 = _mm512_add_ps(a3, _mm512_mul_ps(Load16(row + 48), sv));
    }
    _mm512_storeu_ps(dst + c, a0);
    _mm512_storeu_ps(dst + c + 16, a1);
    _mm512_storeu_ps(dst + c + 32, a2);
    _mm512_storeu_ps(dst + c + 48, a3);
  }
  for (; c + 16 <= H; c += 16) {
    __m512 a0 = _mm512_setzero_ps();
    for (int64_t k = a; k < b; ++k) {
      const T* row;
      float s;
      if (!get(k, &row, &s, c)) continue;
      a0 = _mm512_add_ps(a0, _mm512_mul_ps(Load16(row + c), _mm512_set1_ps(s)));
    }
    _mm512_storeu_ps(dst + c, a0);
  }
#elif defined(__AVX2__)
  // AVX2 (no AVX-512): 64 columns in 8 registers of 8, then 8 at a time. Multiplies and adds
  // stay apart (no FMA: the build passes -ffp-contract=off), so the sums are XLA's bits.
  for (; c + 64 <= H; c += 64) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
           a7 = a0;
    for (int64_t k = a; k < b; ++k) {
      const T* row;
      float s;
      if (!get(k, &row, &s, c)) continue;
      row += c;
      const __m256 sv = _mm256_set1_ps(s);
      a0 = _mm256_add_ps(a0, _mm256_mul_ps(Load8(row), sv));
      a1 = _mm256_add_ps(a1, _mm256_mul_ps(Load8(row + 8), sv));
      a2 = _mm256_add_ps(a2, _mm256_mul_ps(Load8(row + 16), sv));
      a3 = _mm256_add_ps(a3, _mm256_mul_ps(Load8(row + 24), sv));
      a4 = _mm256_add_ps(a4, _mm256_mul_ps(Load8(row + 32), sv));
      a5 = _mm256_add_ps(a5, _mm256_mul_ps(Load8(row + 40), sv));
      a6 = _mm256_add_ps(a6, _mm256_mul_ps(Load8(row + 48), sv));
      a7 = _mm256_add_ps(a7, _mm256_mul_ps(Load8(row + 56), sv));
    }
    _mm256_storeu_ps(dst + c, a0);
    _mm256_storeu_ps(dst + c + 8, a1);
    _mm256_storeu_ps(dst + c + 16, a2);
    _mm256_storeu_ps(dst + c + 24, a3);
    _mm256_storeu_ps(dst + c + 32, a4);
    _mm256_storeu_ps(dst + c + 40, a5);
    _mm256_storeu_ps(dst + c + 48, a6);
    _mm256_storeu_ps(dst + c + 56, a7);
  }
  for (; c + 16 <= H; c += 16) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    for (int64_t k = a; k < b; ++k) {
      const T* row;
      float s;
      if (!get(k, &row, &s, c)) continue;
      const __m256 sv = _mm256_set1_ps(s);
      a0 = _mm256_add_ps(a0, _mm256_mul_ps(Load8(row + c), sv));
      a1 = _mm256_add_ps(a1, _mm256_mul_ps(Load8(row + c + 8), sv));
    }
    _mm256_storeu_ps(dst + c, a0);
    _mm256_storeu_ps(dst + c + 8, a1);
  }
  for (; c + 8 <= H; c += 8) {
    __m256 a0 = _mm256_setzero_ps();
    for (int64_t k = a; k < b; ++k) {
      const T* row;
      float s;
      if (!get(k, &row, &s, c)) continue;
      a0 = _mm256_add_ps(a0, _mm256_mul_ps(Load8(row + c), _mm256_set1_ps(s)));
    }
    _mm256_storeu_ps(dst + c, a0);
  }
#endif
  for (; c < H; c += 64) {  // without AVX2 or AVX-512, or the last columns: a local block
    float acc[64] = {};
    const int64_t n = std::min<int64_t>(64, H - c);
    for (int64_t k = a; k < b; ++k) {
      const T* row;
      float s;
      if (!get(k, &row, &s, c)) continue;
      for (int64_t h = 0; h < n; ++h) acc[h] = acc[h] + ToF32(row[c + h]) * s;
    }
    std::memcpy(dst + c, acc, n * sizeof(float));
  }
}

// Prefetch a row of `bytes` bytes into the cache, one line at a time.
//
// The idea is FBGEMM's EmbeddingSpMDM (`prefetch=16`): while pooling slot i, ask for the row of
// slot i + 16, so the random reads of a big table overlap with the arithmetic. Measured on the
// 2-core dev machine with register accumulators (`WeightedSum`), it gains at most ~5% on
// workload a's pool_sum (the out-of-order core already overlaps the reads); the update's
// prefetch of the next distinct rows (sparse, ascending: the hardware does not follow them)
// gains ~10-15%.
inline void PrefetchRow(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
}
inline void PrefetchRowForWrite(void* row, int64_t bytes) {
  char* p = static_cast<char*>(row);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 1, 3);
}
constexpr int64_t kPrefetchDistance = 16;

// An uninitialized heap array (std::vector would zero it: a wasted pass over the memory).
template <class T>
std::unique_ptr<T[]> Uninitialized(int64_t n) {
  return std::unique_ptr<T[]>(new T[static_cast<size_t>(std::max<int64_t>(n, 1))]);
}

// ---- grouping slots by row: a stable LSD radix sort --------------------------------------------

// The slots sorted by key (ties in slot order): `slots[j]` and its key `keys[j]` for j < n.
// The keys travel with the slots: a caller that re-read `key_of(slot)` in sorted order paid
// random reads per slot (two for a row: the slot's valid and local) at every use.
struct SortedSlots {
  std::unique_ptr<int32_t[]> slots;
  std::unique_ptr<int32_t[]> keys;
  int64_t n = 0;
};

constexpr int kMaxDigitBits = 11;  // measured here: 11 beats 7, 8 and 12

// Sorts the candidates i in [0, m) whose `key_of(i)` is >= 0 (keys < 2^bits <= 2^31) by key,
// stably.
//
// Not a comparison sort: LSD radix with digits of at most 11 bits (2 passes for 2M rows). The
// first pass reads the candidates in place and skips the ones with a negative key, so the
// compaction of the live slots costs no pass of its own. A sort of more than one pass moves
// (key << 32 | slot) pairs, so that every later pass reads its digit in order (reading
// `key_of(slot)` there was two random reads per slot and pass). Each pass is parallel: every
// thread counts its contiguous chunk, the counts are laid out digit-major / thread-minor, and
// every thread scatters its chunk in order, which keeps the sort stable (FBGEMM's CPU backward
// groups a batch's indices by row with a parallel radix sort too).
template <class KeyOf>
SortedSlots SortSlotsByKey(int64_t m, int bits, const KeyOf& key_of, Team& team) {
  const int threads = team.size();
  const int passes = bits <= 0 ? 1 : (bits + kMaxDigitBits - 1) / kMaxDigitBits;
  const int digit_bits = bits <= 0 ? 0 : (bits + passes - 1) / passes;
  const int64_t buckets = int64_t{1} << digit_bits;
  const uint64_t mask = static_cast<uint64_t>(buckets - 1);
  std::vector<int64_t> counts(static_cast<size_t>(threads * buckets));

  auto exclusive_scan = [&]() {
    int64_t total = 0;
    for (int64_t d = 0; d < buckets; ++d) {
      for (int t = 0; t < threads; ++t) {
        int64_t c = counts[t * buckets + d];
        counts[t * buckets + d] = total;
        total += c;
      }
    }
    return total;
  };

  // Pass 0: candidates -> by the lowest digit.
  team.Run([&](int t) {
    int64_t* c = &counts[t * buckets];
    std::fill(c, c + buckets, 0);
    for (int64_t i = PartStart(m, threads, t), e = PartStart(m, threads, t + 1); i < e; ++i) {
      int64_t k = key_of(i);
      if (k >= 0) ++c[static_cast<uint64_t>(k) & mask];
    }
  });
  SortedSlots out;
  out.n = exclusive_scan();
  const int64_t n = out.n;
  out.slots = Uninitialized<int32_t>(n);
  out.keys = Uninitialized<int32_t>(n);
  int32_t* slots = out.slots.get();
  int32_t* keys = out.keys.get();
  if (passes == 1) {
    team.Run([&](int t) {
      int64_t* c = &counts[t * buckets];
      for (int64_t i = PartStart(m, threads, t), e = PartStart(m, threads, t + 1); i < e; ++i) {
        const int64_t k = key_of(i);
        if (k < 0) continue;
        const int64_t at = c[static_cast<uint64_t>(k) & mask]++;
        slots[at] = static_cast<int32_t>(i);
        keys[at] = static_cast<int32_t>(k);
      }
    });
    return out;
  }
  auto pairs_a = Uninitialized<uint64_t>(n);
  // The last pass writes the slots and keys apart: a second pair buffer only for 3 passes.
  auto pairs_b = Uninitialized<uint64_t>(passes > 2 ? n : 0);
  team.Run([&](int t) {
    int64_t* c = &counts[t * buckets];
    uint64_t* a = pairs_a.get();
    for (int64_t i = PartStart(m, threads, t), e = PartStart(m, threads, t + 1); i < e; ++i) {
      const int64_t k = key_of(i);
      if (k >= 0) a[c[static_cast<uint64_t>(k) & mask]++] = static_cast<uint64_t>(k) << 32 | i;
    }
  });
  for (int pass = 1; pass < passes; ++pass) {
    const int shift = 32 + pass * digit_bits;
    const bool last = pass == passes - 1;
    const uint64_t* a = pairs_a.get();
    team.Run([&](int t) {
      int64_t* c = &counts[t * buckets];
      std::fill(c, c + buckets, 0);
      for (int64_t j = PartStart(n, threads, t), e = PartStart(n, threads, t + 1); j < e; ++j)
        ++c[(a[j] >> shift) & mask];
    });
    exclusive_scan();
    team.Run([&](int t) {
      int64_t* c = &counts[t * buckets];
      uint64_t* b = pairs_b.get();
      for (int64_t j = PartStart(n, threads, t), e = PartStart(n, threads, t + 1); j < e; ++j) {
        const int64_t at = c[(a[j] >> shift) & mask]++;
        if (last) {  // the last pass writes the slots and their keys apart
          slots[at] = static_cast<int32_t>(a[j] & 0xffffffffu);
          keys[at] = static_cast<int32_t>(a[j] >> 32);
        } else {
          b[at] = a[j];
        }
      }
    });
    std::swap(pairs_a, pairs_b);
  }
  return out;
}

// The start of thread t's share of the sorted slots, moved forward to a run boundary so that
// every key (row) belongs to exactly one thread.
inline int64_t RunAlignedStart(const SortedSlots& s, int threads, int t) {
  int64_t p = PartStart(s.n, threads, t);
  while (p > 0 && p < s.n && s.keys[p] == s.keys[p - 1]) ++p;
  return p;
}

// Bits needed for keys in [0, span).
inline int BitsFor(uint64_t span) {
  int bits = 0;
  while (bits < 64 && (uint64_t{1} << bits) < span) ++bits;
  return bits;
}

}  // namespace jaxembed

#endif  // JAXEMBED_KERNELS_NATIVE_COMMON_H_
