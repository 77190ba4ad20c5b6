// jaxembed's native CPU kernels: the shard-local gather / pool / scatter / dedup + update of
// jaxembed/kernels/local.py and jaxembed/kernels/sparse.py, and the routed exchange's bucketing
// by owner (local.bucket_ids), as XLA FFI handlers.
//
// Each handler is one C++ function behind one XLA_FFI_DEFINE_HANDLER_SYMBOL, typed with
// ffi::Buffer, the thread count an attribute; bad shapes or attributes return an ffi::Error that
// names the value and the limit (never an abort). Every index is bounds-checked: a slot's row
// is read only when 0 <= row < R, a bag only when 0 <= segment < S.
//
// Shapes (per shard): table f[R, H] (f32 or bf16), slots M (local i32[M], valid bool[M],
// segments i32[M], scale f32[M]), bags S (out_grad f[S, H]).
//
// Determinism: every output element is written by one thread, adding in slot order, so results
// do not depend on the thread count (pool_sum, the scatters and the summed gradients of the
// update add in the same order as XLA's segment_sum / scatter-add).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "common.h"
#include "ffi_checks.h"
#include "formulas.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxembed {

// Attributes of the row-sparse updates (all of them, as one struct; see build.py / __init__.py).
struct UpdateAttrs {
  std::string_view formula;
  int64_t num_threads;
  float weight_decay;
  int64_t has_weight_decay;
  int64_t decoupled;
  float eps;
  float b1;
  float one_minus_b1;
  float b2;
  float one_minus_b2;
  float hidden;
  float q;
  float l1;
  float two_l2;
  float beta;
  int64_t power_mode;
};

}  // namespace jaxembed

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    jaxembed::UpdateAttrs, ::xla::ffi::StructMember<std::string_view>("formula"),
    ::xla::ffi::StructMember<int64_t>("num_threads"),
    ::xla::ffi::StructMember<float>("weight_decay"),
    ::xla::ffi::StructMember<int64_t>("has_weight_decay"),
    ::xla::ffi::StructMember<int64_t>("decoupled"), ::xla::ffi::StructMember<float>("eps"),
    ::xla::ffi::StructMember<float>("b1"), ::xla::ffi::StructMember<float>("one_minus_b1"),
    ::xla::ffi::StructMember<float>("b2"), ::xla::ffi::StructMember<float>("one_minus_b2"),
    ::xla::ffi::StructMember<float>("hidden"), ::xla::ffi::StructMember<float>("q"),
    ::xla::ffi::StructMember<float>("l1"), ::xla::ffi::StructMember<float>("two_l2"),
    ::xla::ffi::StructMember<float>("beta"), ::xla::ffi::StructMember<int64_t>("power_mode"));

namespace jaxembed {
namespace {

// ---- checks ---------------------------------------------------------------------------------

ffi::Error CheckThreads(const char* kernel, int64_t num_threads) {
  if (num_threads < 1 || num_threads > 1024) {
    return Invalid(kernel, "num_threads=" + std::to_string(num_threads) +
                               " must be in [1, 1024] (set JAXEMBED_NUM_THREADS)");
  }
  return ffi::Error::Success();
}

bool IsTableType(ffi::DataType t) { return t == ffi::DataType::F32 || t == ffi::DataType::BF16; }

ffi::Error CheckMatrix(const char* kernel, const char* name, ffi::AnyBuffer b) {
  if (b.dimensions().size() != 2) {
    return Invalid(kernel, std::string(name) + " must be 2-D [rows, H], got shape " +
                               Dims(b.dimensions()));
  }
  if (!IsTableType(b.element_type())) {
    return Invalid(kernel, std::string(name) + " must be float32 or bfloat16, got dtype code " +
                               std::to_string(static_cast<int>(b.element_type())));
  }
  return ffi::Error::Success();
}

// local i32[M] and valid bool[M] (and segments i32[M], scale f32[M] when given) agree.
ffi::Error CheckSlots(const char* kernel, ffi::Buffer<ffi::S32> local, ffi::Buffer<ffi::PRED> valid,
                      const ffi::Buffer<ffi::S32>* segments = nullptr,
                      const ffi::Buffer<ffi::F32>* scale = nullptr) {
  if (local.dimensions().size() != 1) {
    return Invalid(kernel, "local must be 1-D [M] (reshape in Python), got shape " +
                               Dims(local.dimensions()));
  }
  const int64_t m = local.element_count();
  if (m > std::numeric_limits<int32_t>::max()) {
    return Invalid(kernel, "M=" + std::to_string(m) + " slots exceeds the limit 2^31 - 1");
  }
  auto same = [&](const char* name, ffi::AnyBuffer::Dimensions d) -> ffi::Error {
    if (d.size() != 1 || d[0] != m) {
      return Invalid(kernel, std::string(name) + " has shape " + Dims(d) + " but local has [" +
                                 std::to_string(m) + "]: every per-slot operand must be [M]");
    }
    return ffi::Error::Success();
  };
  if (auto e = same("valid", valid.dimensions()); e.failure()) return e;
  if (segments)
    if (auto e = same("segments", segments->dimensions()); e.failure()) return e;
  if (scale)
    if (auto e = same("scale", scale->dimensions()); e.failure()) return e;
  return ffi::Error::Success();
}

// Runs f.template operator()<T>() with T the C++ type of a float32 / bfloat16 buffer.
template <class F>
void DispatchFloat(ffi::DataType t, const F& f) {
  if (t == ffi::DataType::F32) {
    f(float{});
  } else {
    f(bf16_t{});
  }
}

inline int64_t ClampRow(int64_t r, int64_t rows) { return r < 0 ? 0 : (r >= rows ? rows - 1 : r); }

// ---- gather_rows ------------------------------------------------------------------------------

template <class T>
void GatherRows(const T* table, int64_t R, int64_t H, const int32_t* local, const bool* valid,
                int64_t M, T* out, int64_t num_threads) {
  Team team(ThreadsFor(num_threads, M));
  const int threads = team.size();
  const int64_t bytes = H * static_cast<int64_t>(sizeof(T));
  team.Run([&](int t) {
    const int64_t e = PartStart(M, threads, t + 1);
    for (int64_t i = PartStart(M, threads, t); i < e; ++i) {
      const int64_t ahead = i + kPrefetchDistance;
      if (ahead < e && valid[ahead] && R > 0) PrefetchRow(table + ClampRow(local[ahead], R) * H, bytes);
      if (valid[i] && R > 0) {
        std::memcpy(out + i * H, table + ClampRow(local[i], R) * H, bytes);
      } else {
        std::memset(out + i * H, 0, bytes);
      }
    }
  });
}

ffi::Error GatherRowsImpl(ffi::AnyBuffer table, ffi::Buffer<ffi::S32> local,
                          ffi::Buffer<ffi::PRED> valid, ffi::Result<ffi::AnyBuffer> out,
                          int64_t num_threads) {
  constexpr const char* k = "gather_rows";
  if (auto e = CheckThreads(k, num_threads); e.failure()) return e;
  if (auto e = CheckMatrix(k, "table", table); e.failure()) return e;
  if (auto e = CheckSlots(k, local, valid); e.failure()) return e;
  const int64_t R = table.dimensions()[0], H = table.dimensions()[1], M = local.element_count();
  if (auto e = CheckShape(k, "out", out->dimensions(), {M, H}); e.failure()) return e;
  if (out->element_type() != table.element_type()) return Invalid(k, "out must have the table's dtype");
  if (M == 0 || H == 0) return ffi::Error::Success();
  DispatchFloat(table.element_type(), [&](auto zero) {
    using T = decltype(zero);
    GatherRows<T>(static_cast<const T*>(table.untyped_data()), R, H, local.typed_data(),
                  valid.typed_data(), M, static_cast<T*>(out->untyped_data()), num_threads);
  });
  return ffi::Error::Success();
}

// ---- segments: visit every bag once, its slots in slot order ---------------------------------

// Calls v.Bag(s, a, b, get) once for every bag s in [0, S), each bag on one thread: the live
// slots of bag s (valid[i] and 0 <= segments[i] < S) are the `get(k)` >= 0 for k in [a, b),
// in slot order.
//
// Bags usually arrive as runs of consecutive slots (flat or dense forms): then the slots are
// split among threads at bag boundaries and each bag is the run of slots in place. Otherwise a
// stable counting sort (per-thread counts, bag-major / thread-minor offsets) lists each bag's
// slots first. Either way the result does not depend on the number of threads.
template <class Visitor>
void ForEachSegment(int64_t M, int64_t S, const int32_t* seg, const bool* valid, Team& team,
                    const Visitor& v) {
  const int threads = team.size();
  auto live = [=](int64_t i) { return valid[i] && seg[i] >= 0 && seg[i] < S; };
  // Are the live slots' bags non-decreasing?
  struct Chunk {
    bool sorted = true;
    int64_t first = -1, last = -1;
  };
  std::vector<Chunk> chunks(threads);
  team.Run([&](int t) {
    Chunk c;
    for (int64_t i = PartStart(M, threads, t), e = PartStart(M, threads, t + 1); i < e; ++i) {
      if (!live(i)) continue;
      if (c.first < 0) c.first = seg[i];
      if (seg[i] < c.last) c.sorted = false;
      c.last = seg[i];
    }
    chunks[t] = c;
  });
  bool sorted = true;
  int64_t last = -1;
  for (const Chunk& c : chunks) {
    sorted = sorted && c.sorted && (c.first < 0 || c.first >= last);
    if (c.last >= 0) last = c.last;
  }
  auto none = [](int64_t) -> int64_t { return -1; };
  auto empty_bags = [&](int64_t from, int64_t to) {
    for (int64_t s = from; s < to; ++s) v.Bag(s, 0, 0, none);
  };

  if (sorted) {
    // Thread t: slots [start[t], start[t + 1]), bags [first[t], first[t + 1]).
    std::vector<int64_t> start(threads + 1, M), first(threads + 1, S);
    start[0] = 0;
    first[0] = 0;
    for (int t = 1; t < threads; ++t) {
      int64_t j = PartStart(M, threads, t);
      while (j < M && !live(j)) ++j;
      if (j == M) continue;
      const int64_t s = seg[j];
      int64_t k = j;
      for (int64_t i = j - 1; i >= 0; --i) {
        if (!live(i)) continue;
        if (seg[i] != s) break;
        k = i;
      }
      start[t] = k;
      first[t] = s;
    }
    auto in_run = [=](int64_t i) -> int64_t { return live(i) ? i : -1; };
    team.Run([&](int t) {
      const int64_t end = start[t + 1];
      int64_t next = first[t];
      for (int64_t i = start[t]; i < end;) {
        if (!live(i)) {
          ++i;
          continue;
        }
        const int64_t s = seg[i];
        int64_t j = i + 1;  // the run of bag s: up to the next live slot of another bag
        while (j < end && (!live(j) || seg[j] == s)) ++j;
        empty_bags(next, s);
        v.Bag(s, i, j, in_run);
        next = s + 1;
        i = j;
      }
      empty_bags(next, first[t + 1]);
    });
    return;
  }

  // Counting sort of the live slots by bag, stable.
  std::vector<int64_t> counts(static_cast<size_t>(threads) * S);
  team.Run([&](int t) {
    int64_t* c = counts.data() + t * S;
    for (int64_t i = PartStart(M, threads, t), e = PartStart(M, threads, t + 1); i < e; ++i)
      if (live(i)) ++c[seg[i]];
  });
  std::vector<int64_t> bag_start(S + 1);
  int64_t total = 0;
  for (int64_t s = 0; s < S; ++s) {
    bag_start[s] = total;
    for (int t = 0; t < threads; ++t) {
      int64_t c = counts[t * S + s];
      counts[t * S + s] = total;
      total += c;
    }
  }
  bag_start[S] = total;
  auto order = Uninitialized<int32_t>(total);
  team.Run([&](int t) {
    int64_t* c = counts.data() + t * S;
    for (int64_t i = PartStart(M, threads, t), e = PartStart(M, threads, t + 1); i < e; ++i)
      if (live(i)) order[c[seg[i]]++] = static_cast<int32_t>(i);
  });
  const int32_t* listed = order.get();
  auto in_list = [=](int64_t k) -> int64_t { return listed[k]; };
  team.Run([&](int t) {
    // Bags split so that each thread gets about total / threads slots.
    auto bag_at = [&](int p) -> int64_t {
      if (p == 0) return 0;
      if (p == threads) return S;
      const int64_t target = PartStart(total, threads, p);
      return std::lower_bound(bag_start.begin(), bag_start.end() - 1, target) - bag_start.begin();
    };
    const int64_t lo = bag_at(t), hi = std::max(lo, bag_at(t + 1));
    for (int64_t s = lo; s < hi; ++s) v.Bag(s, bag_start[s], bag_start[s + 1], in_list);
  });
}

// ---- segments_from_lengths -------------------------------------------------------------------

// The bag of every slot of L flat blocks of N slots, from the blocks' bag lengths [L, B]: block
// l's bag b is the next lengths[l, b] slots (a negative length counts as 0), and slots past the
// block's total are -1 (`jaxembed.ragged.segments_from_lengths`, one pass: XLA's form is two
// parallel prefix sums and a scatter over the slots, ~60 small ops).
ffi::Error SegmentsFromLengthsImpl(ffi::Buffer<ffi::S32> lengths,
                                   ffi::ResultBuffer<ffi::S32> out) {
  constexpr const char* k = "segments_from_lengths";
  if (lengths.dimensions().size() != 2 || out->dimensions().size() != 2 ||
      lengths.dimensions()[0] != out->dimensions()[0]) {
    return Invalid(k, "expected lengths [L, B] and segments [L, N], got " +
                          Dims(lengths.dimensions()) + " and " + Dims(out->dimensions()));
  }
  const int64_t L = lengths.dimensions()[0], B = lengths.dimensions()[1];
  const int64_t N = out->dimensions()[1];
  const int32_t* len = lengths.typed_data();
  int32_t* seg = out->typed_data();
  for (int64_t l = 0; l < L; ++l) {
    int32_t* row = seg + l * N;
    int64_t at = 0;
    for (int64_t b = 0; b < B && at < N; ++b) {
      const int64_t end = std::min(N, at + std::max<int64_t>(0, len[l * B + b]));
      std::fill(row + at, row + end, static_cast<int32_t>(b));
      at = end;
    }
    std::fill(row + at, row + N, -1);
  }
  return ffi::Error::Success();
}

// ---- pool_sum ---------------------------------------------------------------------------------

// Where row r of a table lives: one [R, H] buffer, or the n pieces [C, H] of a tuple
// all_to_all's operands or results, row r at row r % C of piece r / C (read or written in
// place, never sliced or concatenated). Row(r) is its address; Zero(lo, hi) zeroes rows
// [lo, hi) of a float buffer (one memset for the block, one per piece the range touches).
template <class T>
struct DenseRows {
  T* table;
  int64_t H;
  T* Row(int64_t r) const { return table + r * H; }
  void Zero(int64_t lo, int64_t hi) const {
    std::memset(table + lo * H, 0, (hi - lo) * H * sizeof(T));
  }
};

template <class T>
struct PieceRows {
  T* const* rows;  // R pointers, row r's (RowsOfPieces: no division per slot)
  int64_t C, H;
  T* Row(int64_t r) const { return rows[r]; }
  void Zero(int64_t lo, int64_t hi) const {
    for (int64_t r = lo; r < hi;) {
      const int64_t end = std::min(hi, (r / C + 1) * C);
      std::memset(rows[r], 0, (end - r) * H * sizeof(T));
      r = end;
    }
  }
};

// Each row's address in n pieces of C rows, H wide: row r is row r % C of piece r / C.
template <class T>
std::vector<T*> RowsOfPieces(const std::vector<T*>& pieces, int64_t C, int64_t H) {
  std::vector<T*> rows(pieces.size() * static_cast<size_t>(C));
  for (size_t j = 0; j < pieces.size(); ++j)
    for (int64_t c = 0; c < C; ++c) rows[j * C + c] = pieces[j] + c * H;
  return rows;
}

// The same for pieces given untyped (CheckPieces' data), read as T.
template <class T>
std::vector<const T*> RowsOfPiecesAs(const std::vector<const void*>& pieces, int64_t C,
                                     int64_t H) {
  std::vector<const T*> typed(pieces.size());
  for (size_t j = 0; j < pieces.size(); ++j) typed[j] = static_cast<const T*>(pieces[j]);
  return RowsOfPieces(typed, C, H);
}

template <class T, class Rows = DenseRows<const T>>
struct SumVisitor {
  Rows tab;
  int64_t R, H, M;
  const int32_t* local;
  const float* scale;
  float* out;

  template <class Get>
  void Bag(int64_t s, int64_t a, int64_t b, const Get& get) const {
    const Rows t = tab;
    const int64_t rows = R, h = H, m = M;
    const int32_t* loc = local;
    const float* sc = scale;
    WeightedSum<T>(out + s * H, H, a, b, [&](int64_t k, const T** row, float* f, int64_t c) {
      const int64_t i = get(k);
      if (i < 0 || rows == 0) return false;
      if (i + kPrefetchDistance < m) {  // slot order: the next bags' rows (these columns)
        PrefetchRow(t.Row(ClampRow(loc[i + kPrefetchDistance], rows)) + c,
                    std::min<int64_t>(64, h - c) * sizeof(T));
      }
      *row = t.Row(ClampRow(loc[i], rows));
      *f = sc[i];
      return true;
    });
  }
};

ffi::Error PoolSumImpl(ffi::AnyBuffer table, ffi::Buffer<ffi::S32> local,
                       ffi::Buffer<ffi::PRED> valid, ffi::Buffer<ffi::S32> segments,
                       ffi::Buffer<ffi::F32> scale, ffi::Result<ffi::Buffer<ffi::F32>> out,
                       int64_t num_threads) {
  constexpr const char* k = "pool_sum";
  if (auto e = CheckThreads(k, num_threads); e.failure()) return e;
  if (auto e = CheckMatrix(k, "table", table); e.failure()) return e;
  if (auto e = CheckSlots(k, local, valid, &segments, &scale); e.failure()) return e;
  const int64_t R = table.dimensions()[0], H = table.dimensions()[1], M = local.element_count();
  if (out->dimensions().size() != 2 || out->dimensions()[1] != H) {
    return Invalid(k, "out has shape " + Dims(out->dimensions()) + ", expected [S, " +
                          std::to_string(H) + "]");
  }
  const int64_t S = out->dimensions()[0];
  if (S * H == 0) return ffi::Error::Success();
  Team team(ThreadsFor(num_threads, std::max(M, S)));
  DispatchFloat(table.element_type(), [&](auto zero) {
    using T = decltype(zero);
    SumVisitor<T> v{{static_cast<const T*>(table.untyped_data()), H}, R, H, M,
                    local.typed_data(), scale.typed_data(), out->typed_data()};
    ForEachSegment(M, S, segments.typed_data(), valid.typed_data(), team, v);
  });
  return ffi::Error::Success();
}

// The pieces f[C, H] of a table (all one shape and dtype): their data pointers, or an error.
ffi::Error CheckPieces(const char* k, const char* what, ffi::RemainingArgs pieces,
                       std::vector<const void*>* data, int64_t* C, int64_t* H,
                       ffi::DataType* type, size_t count = SIZE_MAX) {
  count = std::min(count, pieces.size());  // the first `count` operands are the pieces
  if (count == 0) return Invalid(k, std::string("no ") + what);
  for (size_t j = 0; j < count; ++j) {
    auto piece = pieces.get<ffi::AnyBuffer>(j);
    if (!piece.has_value()) return Invalid(k, std::string("cannot decode ") + what);
    if (auto e = CheckMatrix(k, what, *piece); e.failure()) return e;
    if (j == 0) {
      *C = piece->dimensions()[0], *H = piece->dimensions()[1], *type = piece->element_type();
    } else if (piece->dimensions()[0] != *C || piece->dimensions()[1] != *H ||
               piece->element_type() != *type) {
      return Invalid(k, std::string(what) + " " + std::to_string(j) + " has shape " +
                            Dims(piece->dimensions()) + " but the first is [" +
                            std::to_string(*C) + ", " + std::to_string(*H) +
                            "]: every piece must have one shape and dtype");
    }
    data->push_back(piece->untyped_data());
  }
  return ffi::Error::Success();
}

// n gradient pieces of C rows must hold the M slots' gradients, one a row.
ffi::Error CheckPieceSlots(const char* k, size_t n, int64_t C, int64_t M) {
  const int64_t rows = C * static_cast<int64_t>(n);
  if (rows == M) return ffi::Error::Success();
  return Invalid(k, std::to_string(n) + " gradient pieces of " + std::to_string(C) +
                        " rows hold " + std::to_string(rows) +
                        " slots' gradients, but local has M=" + std::to_string(M));
}

// pool_sum over a table held as n pieces f[C, H] (row r: piece r / C), read in place.
ffi::Error PoolSumPiecesImpl(ffi::Buffer<ffi::S32> local, ffi::Buffer<ffi::PRED> valid,
                             ffi::Buffer<ffi::S32> segments, ffi::Buffer<ffi::F32> scale,
                             ffi::RemainingArgs pieces, ffi::Result<ffi::Buffer<ffi::F32>> out,
                             int64_t num_threads) {
  constexpr const char* k = "pool_sum_pieces";
  if (auto e = CheckThreads(k, num_threads); e.failure()) return e;
  if (auto e = CheckSlots(k, local, valid, &segments, &scale); e.failure()) return e;
  std::vector<const void*> data;
  int64_t C = 0, H = 0;
  ffi::DataType type{};
  if (auto e = CheckPieces(k, "table piece", pieces, &data, &C, &H, &type); e.failure()) return e;
  const int64_t R = C * static_cast<int64_t>(data.size()), M = local.element_count();
  if (out->dimensions().size() != 2 || out->dimensions()[1] != H) {
    return Invalid(k, "out has shape " + Dims(out->dimensions()) + ", expected [S, " +
                          std::to_string(H) + "]");
  }
  const int64_t S = out->dimensions()[0];
  if (S * H == 0) return ffi::Error::Success();
  Team team(ThreadsFor(num_threads, std::max(M, S)));
  DispatchFloat(type, [&](auto zero) {
    using T = decltype(zero);
    const std::vector<const T*> rows = RowsOfPiecesAs<T>(data, C, H);
    SumVisitor<T, PieceRows<const T>> v{{rows.data(), C, H}, R, H, M, local.typed_data(),
                                        scale.typed_data(), out->typed_data()};
    ForEachSegment(M, S, segments.typed_data(), valid.typed_data(), team, v);
  });
  return ffi::Error::Success();
}

// ---- pool_max ---------------------------------------------------------------------------------

template <class T>
struct MaxVisitor {
  const T* table;
  int64_t R, H, M;
  const int32_t* local;
  float* maxima;
  int32_t* winners;

  // The first slot reaching the maximum wins; a NaN makes the maximum NaN with no winner (as
  // XLA's NaN-propagating max, and `rows == maxima` false for NaN).
  template <class Get>
  void Bag(int64_t s, int64_t a, int64_t b, const Get& get) const {
    float* mx = maxima + s * H;
    int32_t* wn = winners + s * H;
    std::fill(mx, mx + H, -std::numeric_limits<float>::infinity());
    std::fill(wn, wn + H, static_cast<int32_t>(M));
    for (int64_t k = a; k < b; ++k) {
      const int64_t i = get(k);
      if (i < 0 || R == 0) continue;
      const T* row = table + ClampRow(local[i], R) * H;
      for (int64_t h = 0; h < H; ++h) {
        const float x = ToF32(row[h]);
        const float m = mx[h];
        if (std::isnan(m)) continue;
        if (std::isnan(x)) {
          mx[h] = x;
          wn[h] = static_cast<int32_t>(M);
        } else if (x > m || (x == m && wn[h] == M)) {
          mx[h] = x;
          wn[h] = static_cast<int32_t>(i);
        }
      }
    }
  }
};

ffi::Error PoolMaxImpl(ffi::AnyBuffer table, ffi::Buffer<ffi::S32> local,
                       ffi::Buffer<ffi::PRED> valid, ffi::Buffer<ffi::S32> segments,
                       ffi::Result<ffi::Buffer<ffi::F32>> maxima,
                       ffi::Result<ffi::Buffer<ffi::S32>> winners, int64_t num_threads) {
  constexpr const char* k = "pool_max";
  if (auto e = CheckThreads(k, num_threads); e.failure()) return e;
  if (auto e = CheckMatrix(k, "table", table); e.failure()) return e;
  if (auto e = CheckSlots(k, local, valid, &segments); e.failure()) return e;
  const int64_t R = table.dimensions()[0], H = table.dimensions()[1], M = local.element_count();
  if (maxima->dimensions().size() != 2 || maxima->dimensions()[1] != H) {
    return Invalid(k, "maxima has shape " + Dims(maxima->dimensions()) + ", expected [S, " +
                          std::to_string(H) + "]");
  }
  const int64_t S = maxima->dimensions()[0];
  if (auto e = CheckShape(k, "winners", winners->dimensions(), {S, H}); e.failure()) return e;
  if (S * H == 0) return ffi::Error::Success();
  Team team(ThreadsFor(num_threads, std::max(M, S)));
  DispatchFloat(table.element_type(), [&](auto zero) {
    using T = decltype(zero);
    MaxVisitor<T> v{static_cast<const T*>(table.untyped_data()), R, H, M, local.typed_data(),
                    maxima->typed_data(), winners->typed_data()};
    ForEachSegment(M, S, segments.typed_data(), valid.typed_data(), team, v);
  });
  return ffi::Error::Success();
}

// ---- scatter_add, bag_scatter_add ------------------------------------------------------------

// out f32[R, H] = 0, then out[row(i)] += grad(i) for the slots i in order, `out` held as
// `rows` (DenseRows<float> or PieceRows<float>). Thread t owns rows [R·t/T, R·(t+1)/T): it
// zeroes them and adds the slots that land there, so every row is written by one thread in
// slot order. Rows as XLA's scatter with mode="drop": a negative row counts from the end, one
// outside [0, R) after that is dropped.
template <class Rows, class GradOf>
void ScatterRows(int64_t R, const int32_t* local, const bool* valid, int64_t M, const Rows& rows,
                 int64_t num_threads, const GradOf& grad_of) {
  Team team(ThreadsFor(num_threads, std::max(M, R), 65536));
  const int threads = team.size();
  team.Run([&](int t) {
    const int64_t lo = PartStart(R, threads, t), hi = PartStart(R, threads, t + 1);
    rows.Zero(lo, hi);
    for (int64_t i = 0; i < M; ++i) {
      if (!valid[i]) continue;
      int64_t r = local[i];
      if (r < 0) r += R;
      if (r < lo || r >= hi) continue;
      grad_of(i, rows.Row(r));
    }
  });
}

// out f32[R, H] = 0, then out[local[i]] += grads.Row(i) for the valid slots i in order
// (ScatterRows); `grads` one [M, H] buffer or n pieces [C, H] (DenseRows / PieceRows of T).
template <class T, class Grads>
void ScatterGrads(int64_t R, int64_t H, int64_t M, ffi::Buffer<ffi::S32> local,
                  ffi::Buffer<ffi::PRED> valid, const Grads& grads, float* out,
                  int64_t num_threads) {
  ScatterRows(R, local.typed_data(), valid.typed_data(), M, DenseRows<float>{out, H},
              num_threads, [&](int64_t i, float* __restrict acc) {
                const T* __restrict gi = grads.Row(i);
                for (int64_t h = 0; h < H; ++h) acc[h] = acc[h] + ToF32(gi[h]);
              });
}

ffi::Error ScatterAddImpl(ffi::Buffer<ffi::S32> local, ffi::Buffer<ffi::PRED> valid,
                          ffi::AnyBuffer grads, ffi::Result<ffi::Buffer<ffi::F32>> out,
                          int64_t num_threads) {
  constexpr const char* k = "scatter_add";
  if (auto e = CheckThreads(k, num_threads); e.failure()) return e;
  if (auto e = CheckSlots(k, local, valid); e.failure()) return e;
  if (auto e = CheckMatrix(k, "grads", grads); e.failure()) return e;
  if (out->dimensions().size() != 2) {
    return Invalid(k, "out must be [R, H], got shape " + Dims(out->dimensions()));
  }
  const int64_t R = out->dimensions()[0], H = out->dimensions()[1], M = local.element_count();
  if (auto e = CheckShape(k, "grads", grads.dimensions(), {M, H}); e.failure()) return e;
  if (R * H == 0) return ffi::Error::Success();
  DispatchFloat(grads.element_type(), [&](auto zero) {
    using T = decltype(zero);
    const DenseRows<const T> rows{static_cast<const T*>(grads.untyped_data()), H};
    ScatterGrads<T>(R, H, M, local, valid, rows, out->typed_data(), num_threads);
  });
  return ffi::Error::Success();
}

// scatter_add with the slots' gradients as n pieces f[C, H] (slot i's: row i % C of piece
// i / C), read in place: the results of a tuple all_to_all, never concatenated first.
ffi::Error ScatterAddPiecesImpl(ffi::Buffer<ffi::S32> local, ffi::Buffer<ffi::PRED> valid,
                                ffi::RemainingArgs pieces,
                                ffi::Result<ffi::Buffer<ffi::F32>> out, int64_t num_threads) {
  constexpr const char* k = "scatter_add_pieces";
  if (auto e = CheckThreads(k, num_threads); e.failure()) return e;
  if (auto e = CheckSlots(k, local, valid); e.failure()) return e;
  std::vector<const void*> data;
  int64_t C = 0, H = 0;
  ffi::DataType type{};
  if (auto e = CheckPieces(k, "gradient piece", pieces, &data, &C, &H, &type); e.failure())
    return e;
  if (out->dimensions().size() != 2 || out->dimensions()[1] != H) {
    return Invalid(k, "out has shape " + Dims(out->dimensions()) + ", expected [R, " +
                          std::to_string(H) + "]");
  }
  const int64_t R = out->dimensions()[0], M = local.element_count();
  if (auto e = CheckPieceSlots(k, data.size(), C, M); e.failure()) return e;
  if (R * H == 0) return ffi::Error::Success();
  DispatchFloat(type, [&](auto zero) {
    using T = decltype(zero);
    const std::vector<const T*> rows = RowsOfPiecesAs<T>(data, C, H);
    ScatterGrads<T>(R, H, M, local, valid, PieceRows<const T>{rows.data(), C, H},
                    out->typed_data(), num_threads);
  });
  return ffi::Error::Success();
}

// rows(r) = 0, then rows(r) += scale[i] · out_grad[segments[i]] for the valid slots i of row
// r = local[i], in slot order (ScatterRows); rows: DenseRows<float> or PieceRows<float>.
template <class Rows>
void BagScatter(int64_t R, int64_t H, int64_t M, ffi::Buffer<ffi::S32> local,
                ffi::Buffer<ffi::PRED> valid, ffi::Buffer<ffi::S32> segments,
                ffi::Buffer<ffi::F32> scale, ffi::AnyBuffer out_grad, int64_t num_threads,
                const Rows& rows) {
  const int64_t S = out_grad.dimensions()[0];
  const int32_t* seg = segments.typed_data();
  const float* sc = scale.typed_data();
  DispatchFloat(out_grad.element_type(), [&](auto zero) {
    using T = decltype(zero);
    const T* og = static_cast<const T*>(out_grad.untyped_data());
    ScatterRows(R, local.typed_data(), valid.typed_data(), M, rows, num_threads,
                  [&](int64_t i, float* __restrict acc) {
                    const int64_t s = seg[i];
                    if (s < 0 || s >= S) return;  // a slot in no bag: no gradient
                    const T* __restrict row = og + s * H;
                    const float a = sc[i];
                    for (int64_t h = 0; h < H; ++h) acc[h] = acc[h] + ToF32(row[h]) * a;
                  });
  });
}

ffi::Error BagScatterAddImpl(ffi::Buffer<ffi::S32> local, ffi::Buffer<ffi::PRED> valid,
                             ffi::Buffer<ffi::S32> segments, ffi::Buffer<ffi::F32> scale,
                             ffi::AnyBuffer out_grad, ffi::Result<ffi::Buffer<ffi::F32>> out,
                             int64_t num_threads) {
  constexpr const char* k = "bag_scatter_add";
  if (auto e = CheckThreads(k, num_threads); e.failure()) return e;
  if (auto e = CheckSlots(k, local, valid, &segments, &scale); e.failure()) return e;
  if (auto e = CheckMatrix(k, "out_grad", out_grad); e.failure()) return e;
  if (out->dimensions().size() != 2) {
    return Invalid(k, "out must be [R, H], got shape " + Dims(out->dimensions()));
  }
  const int64_t R = out->dimensions()[0], H = out->dimensions()[1], M = local.element_count();
  if (out_grad.dimensions()[1] != H) {
    return Invalid(k, "out_grad has shape " + Dims(out_grad.dimensions()) + " but out is " +
                          Dims(out->dimensions()) + ": both must have H columns");
  }
  if (R * H == 0) return ffi::Error::Success();
  BagScatter(R, H, M, local, valid, segments, scale, out_grad, num_threads,
             DenseRows<float>{out->typed_data(), H});
  return ffi::Error::Success();
}

// bag_scatter_add into n pieces f32[C, H] (row r: piece r / C), the buffers a tuple
// all_to_all sends as they are (never sliced out of one f32[n·C, H]).
ffi::Error BagScatterAddPiecesImpl(ffi::Buffer<ffi::S32> local, ffi::Buffer<ffi::PRED> valid,
                                   ffi::Buffer<ffi::S32> segments, ffi::Buffer<ffi::F32> scale,
                                   ffi::AnyBuffer out_grad, ffi::RemainingRets pieces,
                                   int64_t num_threads) {
  constexpr const char* k = "bag_scatter_add_pieces";
  if (auto e = CheckThreads(k, num_threads); e.failure()) return e;
  if (auto e = CheckSlots(k, local, valid, &segments, &scale); e.failure()) return e;
  if (auto e = CheckMatrix(k, "out_grad", out_grad); e.failure()) return e;
  if (pieces.size() == 0) return Invalid(k, "no output pieces");
  std::vector<float*> data;
  int64_t C = 0;
  const int64_t H = out_grad.dimensions()[1];
  for (size_t j = 0; j < pieces.size(); ++j) {
    auto piece = pieces.get<ffi::Buffer<ffi::F32>>(j);
    if (!piece.has_value()) return Invalid(k, "every output piece must be float32");
    const auto dims = (*piece)->dimensions();
    if (j == 0 && dims.size() == 2) C = dims[0];
    if (auto e = CheckShape(k, "an output piece", dims, {C, H}); e.failure()) return e;
    data.push_back((*piece)->typed_data());
  }
  const int64_t R = C * static_cast<int64_t>(data.size()), M = local.element_count();
  if (R * H == 0) return ffi::Error::Success();
  const std::vector<float*> rows = RowsOfPieces(data, C, H);
  BagScatter(R, H, M, local, valid, segments, scale, out_grad, num_threads,
             PieceRows<float>{rows.data(), C, H});
  return ffi::Error::Success();
}

// ---- dedup_rows -------------------------------------------------------------------------------

// sparse.dedup_rows exactly: key = local where valid else num_rows; unique = the sorted distinct
// keys padded with num_rows + position; which = each slot's position in unique.
ffi::Error DedupRowsImpl(ffi::Buffer<ffi::S32> local, ffi::Buffer<ffi::PRED> valid,
                         ffi::Result<ffi::Buffer<ffi::S32>> unique,
                         ffi::Result<ffi::Buffer<ffi::S32>> which, int64_t num_rows,
                         int64_t num_threads) {
  constexpr const char* k = "dedup_rows";
  if (auto e = CheckThreads(k, num_threads); e.failure()) return e;
  if (auto e = CheckSlots(k, local, valid); e.failure()) return e;
  const int64_t M = local.element_count();
  if (num_rows < 0 || num_rows + M > std::numeric_limits<int32_t>::max()) {
    return Invalid(k, "num_rows=" + std::to_string(num_rows) + " plus M=" + std::to_string(M) +
                          " must lie in [0, 2^31 - 1] (padding ids are num_rows + position)");
  }
  if (auto e = CheckShape(k, "unique", unique->dimensions(), {M}); e.failure()) return e;
  if (auto e = CheckShape(k, "which", which->dimensions(), {M}); e.failure()) return e;
  if (M == 0) return ffi::Error::Success();
  const int32_t* loc = local.typed_data();
  const bool* val = valid.typed_data();
  auto key = [&](int64_t i) -> int64_t { return val[i] ? loc[i] : num_rows; };
  int64_t lo = key(0), hi = key(0);
  for (int64_t i = 1; i < M; ++i) {
    lo = std::min(lo, key(i));
    hi = std::max(hi, key(i));
  }
  Team team(ThreadsFor(num_threads, M));
  SortedSlots sorted = SortSlotsByKey(
      M, BitsFor(static_cast<uint64_t>(hi - lo) + 1), [&](int64_t i) { return key(i) - lo; },
      team);
  int32_t* u = unique->typed_data();
  int32_t* w = which->typed_data();
  int64_t position = -1, previous = 0;
  for (int64_t j = 0; j < M; ++j) {
    const int64_t slot = sorted.slots[j], current = sorted.keys[j] + lo;
    if (j == 0 || current != previous) {
      ++position;
      u[position] = static_cast<int32_t>(current);
    }
    previous = current;
    w[slot] = static_cast<int32_t>(position);
  }
  for (int64_t p = position + 1; p < M; ++p) u[p] = static_cast<int32_t>(num_rows + p);
  return ffi::Error::Success();
}

// ---- bucket_ids -------------------------------------------------------------------------------

// local.bucket_ids exactly (the sort + dedup of routed.bucketize), without sorting the slots:
//
//   1. a stable counting sort of the slots by bucket dest[i] in [0, n] (n + 1 buckets; n: the
//      slot reads no row), O(M), each thread counting and placing its chunk as ForEachSegment;
//   2. every bucket on one thread: an open-addressing hash of its ids (linear probing,
//      multiplicative hash) numbers its distinct ids by first occurrence, O(slots);
//   3. only the bucket's distinct ids are sorted, ascending as signed int32 (XLA's order): an
//      LSD radix over their span (digits of at most 11 bits), std::sort when there are few;
//   4. each slot's pos is its id's rank; send[b] the first C sorted ids (-1 after), for b < n.
//
// A bucket whose ids increase with the slot (every id distinct, already in order: the keys of
// the owner-pooled exchange, each slot's own index) skips 2 and 3: each slot's rank is its place.
//
// O(M + D·p) with D the distinct (bucket, id) pairs and p = ceil(span bits / 11) <= 3 passes.
// Bucket n is ranked like the others (pos as XLA gives it) but never sent nor counted for the
// overflow. Each bucket is written by one thread: the result does not depend on the threads.
// The idea of step 1 is FBGEMM's block_bucketize_sparse_features (TorchRec's input dist):
// count each slot's owner, lay the owners out by prefix sums, place the slots; the dedup per
// owner and the ascending order (XLA's) are ours.
struct BucketWork {
  std::vector<int32_t> hash_key, hash_val;  // the hash: an id and its distinct number (-1: free)
  std::vector<int32_t> ids;                 // the distinct ids, in first-occurrence order
  std::vector<int32_t> which;               // each of the bucket's slots: its distinct number
  std::vector<uint64_t> sort_a, sort_b;     // (id - lowest) << 32 | distinct number
  std::vector<int32_t> rank;                // each distinct number: its place in the bucket
  std::vector<int64_t> digits;
};

// Sorts a[0:d] (keys in the high 32 bits, below 2^bits; all distinct) ascending.
inline void SortDistinct(uint64_t* a, uint64_t* b, int64_t d, int bits, std::vector<int64_t>& hist) {
  if (d < 128 || bits == 0) {
    std::sort(a, a + d);
    return;
  }
  const int passes = (bits + kMaxDigitBits - 1) / kMaxDigitBits;
  const int digit_bits = (bits + passes - 1) / passes;
  const int64_t size = int64_t{1} << digit_bits;
  const uint64_t mask = static_cast<uint64_t>(size - 1);
  hist.resize(static_cast<size_t>(size));
  for (int pass = 0; pass < passes; ++pass) {
    const int shift = 32 + pass * digit_bits;
    std::fill(hist.begin(), hist.end(), 0);
    for (int64_t j = 0; j < d; ++j) ++hist[(a[j] >> shift) & mask];
    int64_t total = 0;
    for (int64_t& h : hist) {
      const int64_t c = h;
      h = total;
      total += c;
    }
    for (int64_t j = 0; j < d; ++j) b[hist[(a[j] >> shift) & mask]++] = a[j];
    std::swap(a, b);
  }
  if (passes % 2 == 1) std::memcpy(b, a, d * sizeof(uint64_t));  // the result in the caller's a
}

// One bucket: its slots order[0:count] (ascending), their ids key[slot]. Writes pos of its
// slots and, when send_row is given, its first C distinct ids; returns its distinct ids.
int64_t BucketOne(const int32_t* order, int64_t count, const int32_t* key, int32_t* pos,
                  int32_t* send_row, int64_t C, BucketWork& w) {
  // Ids that increase with the slot (the owner-pooled exchange keys each slot by its index):
  // each is distinct and its rank is its place, so no hash and no sort.
  bool increasing = true;
  for (int64_t j = 1; j < count && increasing; ++j) increasing = key[order[j]] > key[order[j - 1]];
  if (increasing) {
    for (int64_t j = 0; j < count; ++j) pos[order[j]] = static_cast<int32_t>(j);
    if (send_row) {
      const int64_t sent = std::min(count, C);
      for (int64_t r = 0; r < sent; ++r) send_row[r] = key[order[r]];
      for (int64_t r = sent; r < C; ++r) send_row[r] = -1;
    }
    return count;
  }
  int log2 = 4;
  while ((int64_t{1} << log2) < 2 * count) ++log2;
  const uint64_t size = uint64_t{1} << log2, mask = size - 1;
  w.hash_key.resize(size);
  w.hash_val.assign(size, -1);
  w.ids.resize(static_cast<size_t>(count));
  w.which.resize(static_cast<size_t>(count));
  int64_t d = 0;
  int32_t lo = std::numeric_limits<int32_t>::max(), hi = std::numeric_limits<int32_t>::min();
  for (int64_t j = 0; j < count; ++j) {
    const int32_t k = key[order[j]];
    uint64_t h = (static_cast<uint32_t>(k) * 0x9E3779B1u) >> (32 - log2);  // Fibonacci hash
    while (w.hash_val[h] >= 0 && w.hash_key[h] != k) h = (h + 1) & mask;
    if (w.hash_val[h] < 0) {
      w.hash_key[h] = k;
      w.hash_val[h] = static_cast<int32_t>(d);
      w.ids[d++] = k;
      lo = std::min(lo, k);
      hi = std::max(hi, k);
    }
    w.which[j] = w.hash_val[h];
  }
  w.sort_a.resize(static_cast<size_t>(d));
  w.sort_b.resize(static_cast<size_t>(d));
  for (int64_t e = 0; e < d; ++e) {
    const uint64_t above = static_cast<uint64_t>(static_cast<int64_t>(w.ids[e]) - lo);
    w.sort_a[e] = (above << 32) | static_cast<uint64_t>(e);
  }
  const uint64_t span = d ? static_cast<uint64_t>(static_cast<int64_t>(hi) - lo) + 1 : 1;
  SortDistinct(w.sort_a.data(), w.sort_b.data(), d, BitsFor(span), w.digits);
  w.rank.resize(static_cast<size_t>(d));
  for (int64_t r = 0; r < d; ++r) {
    const int64_t e = static_cast<int64_t>(w.sort_a[r] & 0xffffffffu);
    w.rank[e] = static_cast<int32_t>(r);
    if (send_row && r < C) send_row[r] = w.ids[e];
  }
  if (send_row)
    for (int64_t r = d; r < C; ++r) send_row[r] = -1;
  for (int64_t j = 0; j < count; ++j) pos[order[j]] = w.rank[w.which[j]];
  return d;
}

ffi::Error BucketIdsImpl(ffi::Buffer<ffi::S32> dest, ffi::Buffer<ffi::S32> key,
                         ffi::Result<ffi::Buffer<ffi::S32>> send,
                         ffi::Result<ffi::Buffer<ffi::S32>> pos,
                         ffi::Result<ffi::Buffer<ffi::PRED>> overflow, int64_t num_buckets,
                         int64_t capacity, int64_t num_threads) {
  constexpr const char* k = "bucket_ids";
  if (auto e = CheckThreads(k, num_threads); e.failure()) return e;
  if (dest.dimensions().size() != 1) {
    return Invalid(k, "dest must be 1-D [M], got shape " + Dims(dest.dimensions()));
  }
  const int64_t M = dest.element_count(), n = num_buckets, C = capacity;
  if (M > std::numeric_limits<int32_t>::max()) {
    return Invalid(k, "M=" + std::to_string(M) + " slots exceeds the limit 2^31 - 1");
  }
  if (n < 0 || n >= std::numeric_limits<int32_t>::max() || C < 0 ||
      C > std::numeric_limits<int32_t>::max()) {
    return Invalid(k, "num_buckets=" + std::to_string(n) + " and capacity=" + std::to_string(C) +
                          " must lie in [0, 2^31 - 2] and [0, 2^31 - 1]");
  }
  if (auto e = CheckShape(k, "key", key.dimensions(), {M}); e.failure()) return e;
  if (auto e = CheckShape(k, "send", send->dimensions(), {n, C}); e.failure()) return e;
  if (auto e = CheckShape(k, "pos", pos->dimensions(), {M}); e.failure()) return e;
  if (auto e = CheckShape(k, "overflow", overflow->dimensions(), {}); e.failure()) return e;
  const int32_t* ds = dest.typed_data();
  const int32_t* ks = key.typed_data();
  int32_t* sd = send->typed_data();
  int32_t* ps = pos->typed_data();
  const int64_t B = n + 1;  // bucket n: the slots that read no row

  // 1. Counting sort of the slots by bucket (per-thread counts, bucket-major / thread-minor).
  Team team(ThreadsFor(num_threads, M));
  const int threads = team.size();
  std::vector<int64_t> counts(static_cast<size_t>(threads * B));
  std::vector<int64_t> bad(threads, -1);  // each thread's first slot with dest outside [0, n]
  team.Run([&](int t) {
    int64_t* c = counts.data() + t * B;
    for (int64_t i = PartStart(M, threads, t), e = PartStart(M, threads, t + 1); i < e; ++i) {
      const int32_t b = ds[i];
      if (b < 0 || b > n) {
        bad[t] = i;
        return;
      }
      ++c[b];
    }
  });
  for (int t = 0; t < threads; ++t) {
    if (bad[t] >= 0) {
      return Invalid(k, "dest[" + std::to_string(bad[t]) + "]=" + std::to_string(ds[bad[t]]) +
                            " is outside [0, num_buckets=" + std::to_string(n) +
                            "] (num_buckets: the slot reads no row)");
    }
  }
  std::vector<int64_t> start(B + 1);
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) {
    start[b] = total;
    for (int t = 0; t < threads; ++t) {
      const int64_t c = counts[t * B + b];
      counts[t * B + b] = total;
      total += c;
    }
  }
  start[B] = total;
  auto order = Uninitialized<int32_t>(M);
  team.Run([&](int t) {
    int64_t* c = counts.data() + t * B;
    for (int64_t i = PartStart(M, threads, t), e = PartStart(M, threads, t + 1); i < e; ++i)
      order[c[ds[i]]++] = static_cast<int32_t>(i);
  });

  // 2-4. Each bucket on one thread; thread t takes the buckets that start in its share of M.
  std::vector<uint8_t> over(static_cast<size_t>(B), 0);
  team.Run([&](int t) {
    auto bucket_at = [&](int p) -> int64_t {
      if (p == 0) return 0;
      if (p == threads) return B;
      return std::lower_bound(start.begin(), start.end() - 1, PartStart(M, threads, p)) -
             start.begin();
    };
    const int64_t lo = bucket_at(t), hi = std::max(lo, bucket_at(t + 1));
    BucketWork w;
    for (int64_t b = lo; b < hi; ++b) {
      int32_t* row = b < n ? sd + b * C : nullptr;
      const int64_t d = BucketOne(order.get() + start[b], start[b + 1] - start[b], ks, ps, row,
                                  C, w);
      over[b] = b < n && d > C;
    }
  });
  bool any = false;
  for (int64_t b = 0; b < n; ++b) any = any || over[b];
  *overflow->typed_data() = any;
  return ffi::Error::Success();
}

// ---- apply_rows, bag_apply_rows -------------------------------------------------------------

struct UpdateBuffers {
  void* table;  // f[R, H] (in place)
  ffi::DataType table_type;
  float* slot[2];  // state f32[R, H] or f32[R] (in place)
  bool per_row[2];
};

// Checks the state operands against the formula; copies inputs to the outputs if XLA did not
// alias them (it does when input_output_aliases is honored).
ffi::Error PrepareUpdate(const char* k, Formula f, int64_t R, int64_t H, ffi::AnyBuffer table,
                         ffi::RemainingArgs args, ffi::RemainingRets rets, UpdateBuffers* ub,
                         size_t first = 0) {
  const int slots = NumSlots(f);
  const size_t given = args.size() - first;  // the table/state operands start at `first`
  if (given != static_cast<size_t>(1 + slots) || rets.size() != given) {
    return Invalid(k, "the formula takes " + std::to_string(slots) + " state arrays: expected " +
                          std::to_string(1 + slots) + " table/state operands and results, got " +
                          std::to_string(given) + " and " + std::to_string(rets.size()));
  }
  for (size_t a = 0; a < given; ++a) {
    auto in = args.get<ffi::AnyBuffer>(first + a);
    auto out = rets.get<ffi::AnyBuffer>(a);
    if (!in.has_value() || !out.has_value()) return Invalid(k, "cannot decode table/state");
    if (a > 0) {
      const bool per_row = SlotPerRow(f, static_cast<int>(a - 1));
      std::vector<int64_t> want = per_row ? std::vector<int64_t>{R} : std::vector<int64_t>{R, H};
      std::string name = "state " + std::to_string(a - 1);
      if (auto e = CheckShape(k, name.c_str(), in->dimensions(), want); e.failure()) return e;
      if (in->element_type() != ffi::DataType::F32) {
        return Invalid(k, name + " must be float32 (compute state in float32)");
      }
      ub->slot[a - 1] = static_cast<float*>((*out)->untyped_data());
      ub->per_row[a - 1] = per_row;
    }
    if ((*out)->element_type() != in->element_type() ||
        (*out)->size_bytes() != in->size_bytes()) {
      return Invalid(k, "result " + std::to_string(a) + " must match its operand");
    }
    if ((*out)->untyped_data() != in->untyped_data() && in->size_bytes() > 0) {
      std::memcpy((*out)->untyped_data(), in->untyped_data(), in->size_bytes());
    }
  }
  ub->table = rets.get<ffi::AnyBuffer>(0).value()->untyped_data();
  ub->table_type = table.element_type();
  return ffi::Error::Success();
}

constexpr int kRowsAhead = 8;  // distinct rows prefetched ahead by the update
constexpr int kGradsAhead = 16;  // slots whose gradient rows are prefetched ahead

// The per-row update over the grouped slots: thread t takes a run-aligned share of the sorted
// slots, sums each row's gradients in slot order (FBGEMM's CPU backward does the same: group by
// row, accumulate a row's gradient in a small buffer, then apply the optimizer to it), then
// applies the formula to that row and its state in place. `grad_of(slot, &row, &factor)` gives
// a slot's gradient as factor · row (G[H]), or false for none.
template <Formula F, class T, class G, class GradOf>
void UpdateRows(const SortedSlots& sorted, Team& team, const UpdateBuffers& ub, int64_t H,
                const Hyper& hp, const GradOf& grad_of) {
  const int threads = team.size();
  T* table = static_cast<T*>(ub.table);
  const int32_t* slots = sorted.slots.get();
  const int32_t* kp = sorted.keys.get();
  team.Run([&](int t) {
    const int64_t begin = RunAlignedStart(sorted, threads, t);
    const int64_t end = RunAlignedStart(sorted, threads, t + 1);
    // Each sorted slot's gradient source (row and factor), gathered into sorted order in one
    // pass whose reads do not wait on each other: read inside the sum, a bag's segment and
    // scale were two random reads in the chain before its gradient row's address was known.
    auto src_of = Uninitialized<const G*>(end - begin);
    auto factor_of = Uninitialized<float>(end - begin);
    const G** src = src_of.get() - begin;
    float* factor = factor_of.get() - begin;
    for (int64_t k = begin; k < end; ++k) {
      const G* row = nullptr;
      float f = 0.0f;
      src[k] = grad_of(slots[k], &row, &f) ? row : nullptr;
      factor[k] = f;
    }
    std::vector<float> g(H), w(H);
    // The rows touched are sparse and ascending, which the hardware prefetcher does not follow:
    // a cursor kRowsAhead distinct rows ahead prefetches each row and its state.
    int64_t ahead = begin;
    auto prefetch_next = [&]() {
      if (ahead >= end) return;
      const int64_t r = kp[ahead];
      PrefetchRowForWrite(table + r * H, H * sizeof(T));
      for (int s = 0; s < NumSlots(F); ++s) {
        if (ub.per_row[s]) {
          __builtin_prefetch(ub.slot[s] + r, 1, 3);
        } else {
          PrefetchRowForWrite(ub.slot[s] + r * H, H * sizeof(float));
        }
      }
      do ++ahead;
      while (ahead < end && kp[ahead] == r);
    };
    for (int i = 0; i < kRowsAhead; ++i) prefetch_next();
    for (int64_t a = begin; a < end;) {
      const int64_t r = kp[a];
      int64_t b = a + 1;
      while (b < end && kp[b] == r) ++b;
      prefetch_next();
      // The slots of a row read their gradients (a bag's out_grad row) in no order the
      // hardware prefetcher follows: the one kGradsAhead slots on is asked for.
      WeightedSum<G>(g.data(), H, a, b, [&](int64_t k, const G** row, float* f, int64_t c) {
        if (c == 0 && k + kGradsAhead < end && src[k + kGradsAhead] != nullptr)
          PrefetchRow(src[k + kGradsAhead], H * sizeof(G));
        *row = src[k];
        *f = factor[k];
        return *row != nullptr;
      });
      T* wr = table + r * H;
      for (int64_t h = 0; h < H; ++h) w[h] = ToF32(wr[h]);
      float* s0 = nullptr;
      float* s1 = nullptr;
      if (NumSlots(F) > 0) s0 = ub.slot[0] + (ub.per_row[0] ? r : r * H);
      if (NumSlots(F) > 1) s1 = ub.slot[1] + (ub.per_row[1] ? r : r * H);
      UpdateRow<F>(w.data(), g.data(), s0, s1, hp, H);
      for (int64_t h = 0; h < H; ++h) FromF32(w[h], wr + h);
      a = b;
    }
  });
}

// The same update with each touched row's gradient summed in a zeroed block of float rows as
// the slots come, in slot order, no sort per slot: slot i adds into block row `index_of(i)`
// (-1: none), and block row u, once summed, updates table row `row_at(u)`. For a bag, the slots
// of a bag come one after the other and read its gradient row once for all its ids, where the
// sorted path reads it once per slot, at random (the high-duplication case that made the update
// 3x FBGEMM's). Two blocks use it:
//   * dense: a small table (R·H floats of gradient fit kDenseGradBytes) and a batch that
//     touches it often (M >= R / kDenseMinRowsPerSlot): block row u is table row u, no sort;
//   * compact: the batch's U distinct rows, found by the sort (block row u: the u-th distinct
//     row, ascending), when they fit kDenseGradBytes, repeat (M >= kCompactMinSlotsPerRow·U)
//     and are no more than the gradient's rows (`grad_rows`: bags, or slots): Zipf ids over a
//     big table, whose hot rows stay in cache while the gradient rows stream in order. Where
//     the gradient has fewer rows than the block (4096 bags, 14k distinct rows) the sorted
//     path's random reads of it are the cheaper ones (measured: 30 against 38 ms a step).
//
// Threads split the columns, not the rows: thread t sums columns [c0, c1) (whole cache lines)
// of every slot, so every thread walks every slot with no test of whose row it is (split by
// rows, each thread tested every slot on a branch that went either way at random, and a
// skewed batch loaded one thread). A table narrower than two cache lines sums on one thread.
// The block's rows come at random: each thread fetches the row kPrefetchDistance slots ahead for
// writing (without it the stores waited on their lines and held the store buffer: 3x the time
// on 1e4 rows). Then thread t applies the formula to its contiguous range of block rows. A
// value's sum is ((0 + g_0) + g_1) + ... in slot order, as the sorted path's, so the result is
// bitwise the same, whatever the block and the thread count.
constexpr int64_t kDenseGradBytes = int64_t{8} << 20;
constexpr int64_t kDenseMinRowsPerSlot = 4;
constexpr int64_t kCompactMinSlotsPerRow = 4;
constexpr int64_t kLineFloats = 16;  // floats in a 64-byte cache line

template <Formula F, class T, class G, class IndexOf, class RowAt, class GradOf>
void UpdateBlock(int64_t M, int64_t U, Team& team, const UpdateBuffers& ub, int64_t H,
                 const Hyper& hp, const IndexOf& index_of, const RowAt& row_at,
                 const GradOf& grad_of) {
  T* table = static_cast<T*>(ub.table);
  // The block starts on a cache line, so that no line holds two threads' columns.
  auto block = Uninitialized<float>(U * H + kLineFloats);
  float* const gbase = block.get() + (kLineFloats - reinterpret_cast<uintptr_t>(block.get()) %
                                                      64 / sizeof(float)) % kLineFloats;
  auto touched = Uninitialized<uint8_t>(U);
  const int64_t lines = (H + kLineFloats - 1) / kLineFloats;
  const int summing = static_cast<int>(std::min<int64_t>(team.size(), lines));
  team.Run([&](int t) {
    if (t >= summing) return;
    const int64_t c0 = std::min(H, lines * t / summing * kLineFloats);
    const int64_t c1 = std::min(H, lines * (t + 1) / summing * kLineFloats);
    const int64_t w = c1 - c0;
    float* gt = gbase + c0;
    uint8_t* seen = touched.get();
    for (int64_t u = 0; u < U; ++u) std::memset(gt + u * H, 0, w * sizeof(float));
    if (t == 0) std::memset(seen, 0, U);
    for (int64_t i = 0; i < M; ++i) {
      if (i + kPrefetchDistance < M) {
        const int64_t ahead = index_of(i + kPrefetchDistance);
        if (ahead >= 0) PrefetchRowForWrite(gt + ahead * H, w * sizeof(float));
      }
      const int64_t u = index_of(i);
      if (u < 0) continue;
      if (t == 0) seen[u] = 1;
      const G* row;
      float f;
      if (!grad_of(i, &row, &f)) continue;  // a slot in no bag: its row is touched, by zero
      row += c0;
      float* __restrict acc = gt + u * H;
      for (int64_t h = 0; h < w; ++h) acc[h] = acc[h] + ToF32(row[h]) * f;
    }
  });
  const int threads = team.size();
  team.Run([&](int t) {
    const uint8_t* seen = touched.get();
    std::vector<float> w(H);
    for (int64_t u = PartStart(U, threads, t), e = PartStart(U, threads, t + 1); u < e; ++u) {
      if (!seen[u]) continue;
      const int64_t r = row_at(u);
      T* wr = table + r * H;
      for (int64_t h = 0; h < H; ++h) w[h] = ToF32(wr[h]);
      float* s0 = nullptr;
      float* s1 = nullptr;
      if (NumSlots(F) > 0) s0 = ub.slot[0] + (ub.per_row[0] ? r : r * H);
      if (NumSlots(F) > 1) s1 = ub.slot[1] + (ub.per_row[1] ? r : r * H);
      UpdateRow<F>(w.data(), gbase + u * H, s0, s1, hp, H);
      for (int64_t h = 0; h < H; ++h) FromF32(w[h], wr + h);
    }
  });
}

template <class T, class G, class IndexOf, class RowAt, class GradOf>
void UpdateBlockFor(Formula f, int64_t M, int64_t U, Team& team, const UpdateBuffers& ub,
                    int64_t H, const Hyper& hp, const IndexOf& index_of, const RowAt& row_at,
                    const GradOf& grad_of) {
  const auto run = [&](auto formula) {
    UpdateBlock<decltype(formula)::value, T, G>(M, U, team, ub, H, hp, index_of, row_at, grad_of);
  };
  switch (f) {
    case Formula::kSgd: return run(std::integral_constant<Formula, Formula::kSgd>{});
    case Formula::kAdagrad: return run(std::integral_constant<Formula, Formula::kAdagrad>{});
    case Formula::kFbgemmAdagrad:
      return run(std::integral_constant<Formula, Formula::kFbgemmAdagrad>{});
    case Formula::kRowwiseAdagrad:
      return run(std::integral_constant<Formula, Formula::kRowwiseAdagrad>{});
    case Formula::kAdam: return run(std::integral_constant<Formula, Formula::kAdam>{});
    case Formula::kPartialRowwiseAdam:
      return run(std::integral_constant<Formula, Formula::kPartialRowwiseAdam>{});
    case Formula::kFtrl: return run(std::integral_constant<Formula, Formula::kFtrl>{});
  }
}

template <class T, class G, class GradOf>
void UpdateRowsFor(Formula f, const SortedSlots& sorted, Team& team, const UpdateBuffers& ub,
                   int64_t H, const Hyper& hp, const GradOf& grad_of) {
  const auto run = [&](auto formula) {
    UpdateRows<decltype(formula)::value, T, G>(sorted, team, ub, H, hp, grad_of);
  };
  switch (f) {
    case Formula::kSgd: return run(std::integral_constant<Formula, Formula::kSgd>{});
    case Formula::kAdagrad: return run(std::integral_constant<Formula, Formula::kAdagrad>{});
    case Formula::kFbgemmAdagrad:
      return run(std::integral_constant<Formula, Formula::kFbgemmAdagrad>{});
    case Formula::kRowwiseAdagrad:
      return run(std::integral_constant<Formula, Formula::kRowwiseAdagrad>{});
    case Formula::kAdam: return run(std::integral_constant<Formula, Formula::kAdam>{});
    case Formula::kPartialRowwiseAdam:
      return run(std::integral_constant<Formula, Formula::kPartialRowwiseAdam>{});
    case Formula::kFtrl: return run(std::integral_constant<Formula, Formula::kFtrl>{});
  }
}

ffi::Error ParseUpdate(const char* k, const UpdateAttrs& at, ffi::Buffer<ffi::F32> scalars,
                       Formula* f, Hyper* hp) {
  if (auto e = CheckThreads(k, at.num_threads); e.failure()) return e;
  if (!ParseFormula(at.formula, f)) {
    return Invalid(k, "unknown formula '" + std::string(at.formula) +
                          "': expected sgd, adagrad, fbgemm_adagrad, rowwise_adagrad, "
                          "adam, partial_rowwise_adam or ftrl");
  }
  if (auto e = CheckShape(k, "scalars", scalars.dimensions(), {3}); e.failure()) return e;
  if (at.power_mode < 0 || at.power_mode > 2) {
    return Invalid(k, "power_mode=" + std::to_string(at.power_mode) + " must be 0, 1 or 2");
  }
  const float* s = scalars.typed_data();
  *hp = Hyper{s[0],         s[1],         s[2],
              at.weight_decay, at.has_weight_decay != 0, at.decoupled != 0,
              at.eps,       at.b1,        at.one_minus_b1,
              at.b2,        at.one_minus_b2, at.hidden,
              at.q,         at.l1,        at.two_l2,
              at.beta,      static_cast<int>(at.power_mode)};
  return ffi::Error::Success();
}

// The rows a valid slot touches: 0 <= local < R (others are dropped, as XLA's scatter drops the
// out-of-range rows of sparse.apply_rows).
template <class G, class GradOf>
ffi::Error RunUpdate(const char* k, const UpdateAttrs& at, ffi::Buffer<ffi::F32> scalars,
                     ffi::Buffer<ffi::S32> local, ffi::Buffer<ffi::PRED> valid,
                     ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t grad_H,
                     int64_t grad_rows, const GradOf& grad_of, size_t first = 0) {
  Formula f;
  Hyper hp;
  if (auto e = ParseUpdate(k, at, scalars, &f, &hp); e.failure()) return e;
  if (args.size() < first + 1) return Invalid(k, "missing the table operand");
  auto table = args.get<ffi::AnyBuffer>(first);
  if (!table.has_value()) return Invalid(k, "cannot decode the table");
  if (auto e = CheckMatrix(k, "table", *table); e.failure()) return e;
  const int64_t R = table->dimensions()[0], H = table->dimensions()[1];
  if (grad_H != H) {
    return Invalid(k, "the gradients have " + std::to_string(grad_H) + " columns but the table " +
                          Dims(table->dimensions()) + " has " + std::to_string(H));
  }
  UpdateBuffers ub{};
  if (auto e = PrepareUpdate(k, f, R, H, *table, args, rets, &ub, first); e.failure()) return e;
  const int64_t M = local.element_count();
  if (M == 0 || R == 0 || H == 0) return ffi::Error::Success();
  const int32_t* loc = local.typed_data();
  const bool* val = valid.typed_data();
  Team team(ThreadsFor(at.num_threads, M));
  auto row_of = [=](int64_t i) -> int64_t {
    return val[i] && loc[i] >= 0 && loc[i] < R ? loc[i] : -1;
  };
  const int64_t row_bytes = H * static_cast<int64_t>(sizeof(float));
  if (R * row_bytes <= kDenseGradBytes && M * kDenseMinRowsPerSlot >= R) {
    auto itself = [](int64_t u) { return u; };
    DispatchFloat(ub.table_type, [&](auto zero) {
      using T = decltype(zero);
      UpdateBlockFor<T, G>(f, M, R, team, ub, H, hp, row_of, itself, grad_of);
    });
    return ffi::Error::Success();
  }
  SortedSlots sorted = SortSlotsByKey(M, BitsFor(static_cast<uint64_t>(R)), row_of, team);
  // Each sorted slot's row came with it from the sort (row_of(slot) is two reads at random).
  const int32_t* slots = sorted.slots.get();
  const int32_t* kp = sorted.keys.get();
  // The distinct rows, ascending: U of them. Few and repeated: sum them in a compact block.
  std::vector<int64_t> distinct;
  for (int64_t j = 0; j < sorted.n; ++j) {
    if (distinct.empty() || distinct.back() != kp[j]) distinct.push_back(kp[j]);
  }
  const int64_t U = static_cast<int64_t>(distinct.size());
  if (U * row_bytes <= kDenseGradBytes && sorted.n >= kCompactMinSlotsPerRow * U &&
      U <= grad_rows) {
    auto compact = Uninitialized<int32_t>(M);
    int32_t* ci = compact.get();
    std::fill(ci, ci + M, -1);
    for (int64_t j = 0, u = -1, last = -1; j < sorted.n; ++j) {
      if (kp[j] != last) ++u, last = kp[j];
      ci[slots[j]] = static_cast<int32_t>(u);
    }
    auto index_of = [=](int64_t i) -> int64_t { return ci[i]; };
    const int64_t* rows = distinct.data();
    auto row_at = [=](int64_t u) { return rows[u]; };
    DispatchFloat(ub.table_type, [&](auto zero) {
      using T = decltype(zero);
      UpdateBlockFor<T, G>(f, M, U, team, ub, H, hp, index_of, row_at, grad_of);
    });
    return ffi::Error::Success();
  }
  DispatchFloat(ub.table_type, [&](auto zero) {
    using T = decltype(zero);
    UpdateRowsFor<T, G>(f, sorted, team, ub, H, hp, grad_of);
  });
  return ffi::Error::Success();
}

ffi::Error ApplyRowsImpl(ffi::Buffer<ffi::F32> scalars, ffi::Buffer<ffi::S32> local,
                         ffi::Buffer<ffi::PRED> valid, ffi::AnyBuffer grads,
                         ffi::RemainingArgs args, ffi::RemainingRets rets, UpdateAttrs at) {
  constexpr const char* k = "apply_rows";
  if (auto e = CheckSlots(k, local, valid); e.failure()) return e;
  if (auto e = CheckMatrix(k, "grads", grads); e.failure()) return e;
  const int64_t M = local.element_count(), H = grads.dimensions()[1];
  if (grads.dimensions()[0] != M) {
    return Invalid(k, "grads has shape " + Dims(grads.dimensions()) + ", expected [M=" +
                          std::to_string(M) + ", H]");
  }
  ffi::Error result = ffi::Error::Success();
  DispatchFloat(grads.element_type(), [&](auto zero) {
    using G = decltype(zero);
    const G* gp = static_cast<const G*>(grads.untyped_data());
    auto grad_of = [=](int64_t i, const G** row, float* f) {
      *row = gp + i * H;
      *f = 1.0f;  // exact: the sum is XLA's segment_sum of the rows
      return true;
    };
    result = RunUpdate<G>(k, at, scalars, local, valid, args, rets, H, M, grad_of);
  });
  return result;
}

ffi::Error BagApplyRowsImpl(ffi::Buffer<ffi::F32> scalars, ffi::Buffer<ffi::S32> local,
                            ffi::Buffer<ffi::PRED> valid, ffi::Buffer<ffi::S32> segments,
                            ffi::Buffer<ffi::F32> scale, ffi::AnyBuffer out_grad,
                            ffi::RemainingArgs args, ffi::RemainingRets rets, UpdateAttrs at) {
  constexpr const char* k = "bag_apply_rows";
  if (auto e = CheckSlots(k, local, valid, &segments, &scale); e.failure()) return e;
  if (auto e = CheckMatrix(k, "out_grad", out_grad); e.failure()) return e;
  const int64_t S = out_grad.dimensions()[0], H = out_grad.dimensions()[1];
  const int32_t* seg = segments.typed_data();
  const float* sc = scale.typed_data();
  ffi::Error result = ffi::Error::Success();
  DispatchFloat(out_grad.element_type(), [&](auto zero) {
    using G = decltype(zero);
    const G* og = static_cast<const G*>(out_grad.untyped_data());
    // Slot i's gradient, scale[i]·out_grad[segments[i]], made on the fly (no [M, H] temporary);
    // a slot in no bag (segment outside [0, S)) touches its row with a zero gradient.
    auto grad_of = [=](int64_t i, const G** row, float* f) {
      const int64_t s = seg[i];
      if (s < 0 || s >= S) return false;
      *row = og + s * H;
      *f = sc[i];
      return true;
    };
    result = RunUpdate<G>(k, at, scalars, local, valid, args, rets, H, S, grad_of);
  });
  return result;
}

// apply_rows with the gradients as n pieces f[C, H] (slot i's in piece i / C): the results of
// an all_to_all, read in place. The operands after valid are the n pieces, then the table and
// the state as apply_rows' (n: the operands beyond the results).
ffi::Error ApplyRowsPiecesImpl(ffi::Buffer<ffi::F32> scalars, ffi::Buffer<ffi::S32> local,
                               ffi::Buffer<ffi::PRED> valid, ffi::RemainingArgs args,
                               ffi::RemainingRets rets, UpdateAttrs at) {
  constexpr const char* k = "apply_rows_pieces";
  if (auto e = CheckSlots(k, local, valid); e.failure()) return e;
  if (args.size() <= rets.size()) {
    return Invalid(k, "expected the gradient pieces before the " + std::to_string(rets.size()) +
                          " table/state operands, got " + std::to_string(args.size()) +
                          " operands in all");
  }
  const size_t n = args.size() - rets.size();
  std::vector<const void*> data;
  int64_t C = 0, H = 0;
  ffi::DataType type{};
  if (auto e = CheckPieces(k, "gradient piece", args, &data, &C, &H, &type, n); e.failure())
    return e;
  if (auto e = CheckPieceSlots(k, n, C, local.element_count()); e.failure()) return e;
  ffi::Error result = ffi::Error::Success();
  DispatchFloat(type, [&](auto zero) {
    using G = decltype(zero);
    const std::vector<const G*> rows = RowsOfPiecesAs<G>(data, C, H);
    const G* const* row_of = rows.data();
    auto grad_of = [=](int64_t i, const G** row, float* f) {
      *row = row_of[i];
      *f = 1.0f;  // exact: the sum is XLA's segment_sum of the rows
      return true;
    };
    const int64_t M = local.element_count();
    result = RunUpdate<G>(k, at, scalars, local, valid, args, rets, H, M, grad_of, n);
  });
  return result;
}

}  // namespace
}  // namespace jaxembed

// ---- the handlers (symbols looked up by build.py) ---------------------------------------------

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxembedGatherRows, jaxembed::Safe<jaxembed::GatherRowsImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("num_threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxembedPoolSum, jaxembed::Safe<jaxembed::PoolSumImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("num_threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxembedPoolSumPieces,
                              jaxembed::Safe<jaxembed::PoolSumPiecesImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("num_threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxembedBagScatterAddPieces,
                              jaxembed::Safe<jaxembed::BagScatterAddPiecesImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingRets()
                                  .Attr<int64_t>("num_threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxembedSegmentsFromLengths,
                              jaxembed::Safe<jaxembed::SegmentsFromLengthsImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxembedPoolMax, jaxembed::Safe<jaxembed::PoolMaxImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("num_threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxembedScatterAdd, jaxembed::Safe<jaxembed::ScatterAddImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("num_threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxembedScatterAddPieces,
                              jaxembed::Safe<jaxembed::ScatterAddPiecesImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("num_threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxembedBagScatterAdd, jaxembed::Safe<jaxembed::BagScatterAddImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("num_threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxembedDedupRows, jaxembed::Safe<jaxembed::DedupRowsImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("num_rows")
                                  .Attr<int64_t>("num_threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxembedBucketIds, jaxembed::Safe<jaxembed::BucketIdsImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>()
                                  .Attr<int64_t>("num_buckets")
                                  .Attr<int64_t>("capacity")
                                  .Attr<int64_t>("num_threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxembedApplyRows, jaxembed::Safe<jaxembed::ApplyRowsImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attrs<jaxembed::UpdateAttrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxembedApplyRowsPieces,
                              jaxembed::Safe<jaxembed::ApplyRowsPiecesImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attrs<jaxembed::UpdateAttrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxembedBagApplyRows, jaxembed::Safe<jaxembed::BagApplyRowsImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attrs<jaxembed::UpdateAttrs>());
