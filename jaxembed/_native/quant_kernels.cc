// jaxembed's native CPU kernels for row-wise quantized tables: the shard-local gather_rows,
// pool_sum and pool_max of jaxembed/kernels/quant.py as XLA FFI handlers, unpacking,
// dequantizing and pooling each row in one pass over its packed bytes (no float row is ever
// stored, only the pooled sums or the gathered rows the caller asked for); and pool_bags, a
// one-device sum / mean / sqrtn lookup read from the caller's ids as they are (dense [G, L]
// with negative ids as empty slots, or flat [G, N] with lengths [G, B]), which finds the bags,
// the live slots and their factors itself, so the compiled program is this one call.
//
// Shapes (per shard): data u8[R, Bq] (a row's H values packed, Bq = H·bits/8, value c in byte
// c / n at bit (c % n)·bits, n = 8 / bits), scale and bias f16[R] (int8 may have f32[R]; fp8
// has none: f32[0] operands), slots M (local i32[M], valid bool[M], segments i32[M], weights
// f32[M]), bags S.
//
// Values: q·scale + bias in float32 with one rounding (a fused multiply-add), the f16 scale and
// bias widened exactly, then · weight and added to the bag in slot order from 0, these two
// rounded apart (the library is built with -ffp-contract=off): the operations and the order
// of the XLA twin compiled by jit (XLA:CPU fuses jaxembed.quant.decode's `q * scale + bias`
// into an FMA, not `rows * scale` into segment_sum's adds), so the results are bitwise its.
// With f16 scale and bias the product q·scale is exact (8 by 11 significant bits), so the
// XLA twin run op by op (unfused) agrees too; with int8's f32 scale it may differ in the last
// bit. fp8 is
// FBGEMM's hfp8 code read as jaxembed.quant.rowwise._fp8_decode reads it (exponent 0: the
// mantissa times 2^(1 - bias - mantissa bits); otherwise the bits moved into a float32).
//
// Vectorization: with AVX-512 (F, BW, VL) 16 values at a time. int8 widens 16 bytes to floats
// and computes q·scale + bias; int4 and int2 compute the row's 16 possible values once
// (k·scale + bias for the codes k, each rounded as the value it stands for) and read each
// value from its code with one permute (vpermps): int4 shifts each 32-bit half of 8 bytes by
// 0, 4, ..., 28 bits, int2 one word of 4 bytes by 0, 2, ..., 30; fp8 rebuilds the float's bits
// with integer ops. The accumulators of up to 128 columns stay in registers for a whole bag
// (the output row is stored once); a weight of exactly 1 skips its multiply (x·1 is x). The
// last H % 16 columns, and every column without AVX-512, go one value at a time through the
// same formulas.
//
// Prefetch: the idea of prefetching the rows of the slots 16 ahead is FBGEMM's
// EmbeddingSpMDMNBit (its `prefetch=16`); here scale and bias sit in arrays of their own, so a
// slot asks for three lines: its row's bytes (into L1) and its scale and bias (into L2). The
// prefetching helpers are always inlined: GCC 12 deletes calls to a function that holds
// nothing but prefetches (it takes it for one without side effects).
//
// Threads: `num_threads` is an attribute. Bags are handed out in runs of about equal slot
// counts, 8 runs a thread, from an atomic counter (a thread the machine leaves unscheduled
// holds up only its run); every bag is pooled by one thread in slot order, so no result
// depends on the thread count. When the live slots' bags do not decrease (the flat and dense
// bag forms) each bag is the run of slots in place, found by two cheap passes (on the calling
// thread below 2^20 slots, where a fork-join costs more than the pass); otherwise a stable
// radix sort of the live slots by bag (common.h's SortSlotsByKey) lists each bag's slots.
//
// Every index is bounds-checked: a valid slot's row is clamped into [0, R) (the XLA twin's
// mode="clip"), a slot counts for a bag only when valid and 0 <= segment < S (pool_bags: when
// its id is in [0, vocab_size) and not the padding id; its bags' bounds are clamped into the
// slots). Bad shapes, dtypes and attributes return an ffi::Error naming the value and the
// limit.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "common.h"
#include "ffi_checks.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define JAXEMBED_QUANT_AVX512 1
#else
#define JAXEMBED_QUANT_AVX512 0
#endif
// Without AVX-512, AVX2 (with FMA and F16C) decodes the integer formats 8 values at a time
// for the pooled sum and the gather; fp8 and max pooling go one value at a time there.
#if !JAXEMBED_QUANT_AVX512 && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define JAXEMBED_QUANT_AVX2 1
#else
#define JAXEMBED_QUANT_AVX2 0
#endif

// Inlined always: a function holding only prefetches that GCC does not inline is taken for one
// without side effects and its calls are deleted (seen with GCC 12); the per-slot bodies must
// inline into the slot loops for the accumulators to stay in registers.
#define JAXEMBED_INLINE __attribute__((always_inline))

namespace ffi = xla::ffi;

namespace jaxembed {
namespace {

// ---- the formats ------------------------------------------------------------------------------

enum class Precision { kInt8, kInt4, kInt2, kFp8 };

bool ParsePrecision(std::string_view name, Precision* out) {
  static constexpr std::pair<std::string_view, Precision> kNames[] = {
      {"int8", Precision::kInt8},
      {"int4", Precision::kInt4},
      {"int2", Precision::kInt2},
      {"fp8", Precision::kFp8},
  };
  for (const auto& [n, p] : kNames) {
    if (n == name) {
      *out = p;
      return true;
    }
  }
  return false;
}

constexpr int BitsOf(Precision p) {
  return p == Precision::kInt4 ? 4 : p == Precision::kInt2 ? 2 : 8;
}

// float16 -> float32 (exact; XLA's convert).
inline float HalfToFloat(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  uint32_t bits;
  if (e == 0x1f) {
    bits = sign | 0x7f800000u | (m << 13);
  } else if (e != 0) {
    bits = sign | ((e + 112u) << 23) | (m << 13);
  } else {  // zero or subnormal: m · 2^-24, exact in float32
    const float f = static_cast<float>(m) * 5.9604644775390625e-8f;
    std::memcpy(&bits, &f, sizeof(bits));
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}
inline float ParamToFloat(uint16_t p) { return HalfToFloat(p); }
inline float ParamToFloat(float p) { return p; }

// fp8's format: mantissa bits and the constants of its decode.
struct Fp8Format {
  uint32_t mbits = 3, emask = 15, mmask = 7;
  uint32_t rebias = 120;  // 127 - exponent bias
  float tiny = 0.0f;      // 2^(1 - bias - mbits), the value of mantissa 1 at exponent 0
};

Fp8Format MakeFp8Format(int64_t ebits, int64_t ebias) {
  Fp8Format f;
  f.mbits = static_cast<uint32_t>(7 - ebits);
  f.emask = (1u << ebits) - 1u;
  f.mmask = (1u << f.mbits) - 1u;
  f.rebias = static_cast<uint32_t>(127 - ebias);
  f.tiny = std::ldexp(1.0f, static_cast<int>(1 - ebias - static_cast<int64_t>(f.mbits)));
  return f;
}

inline float Fp8Value(uint32_t c, const Fp8Format& f) {
  const uint32_t e = (c >> f.mbits) & f.emask, m = c & f.mmask;
  uint32_t mag;
  if (e == 0) {
    const float tiny = static_cast<float>(m) * f.tiny;
    std::memcpy(&mag, &tiny, sizeof(mag));
  } else {
    mag = ((e + f.rebias) << 23) | (m << (23 - f.mbits));
  }
  const uint32_t bits = mag | ((c & 0x80u) << 24);
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// The quantized rows of one shard: row r's packed bytes, its scale and bias as float32, and
// its values (one at a time, or 16 at a time with AVX-512).
template <Precision P, class Param>
struct QuantRows {
  static constexpr int kBits = BitsOf(P);
  static constexpr int kPerByte = 8 / kBits;

  const uint8_t* data;
  int64_t R, bytes;  // rows, bytes a row
  const Param* scale;  // [R]; null for fp8
  const Param* bias;
  Fp8Format fp8;
  bool two_lines = true;  // whether a row may span two cache lines (else one prefetch does)

  const uint8_t* Row(int64_t r) const { return data + r * bytes; }

  JAXEMBED_INLINE void Params(int64_t r, float* s, float* b) const {
    if constexpr (P == Precision::kFp8) {
      *s = 1.0f;
      *b = 0.0f;
    } else {
      *s = ParamToFloat(scale[r]);
      *b = ParamToFloat(bias[r]);
    }
  }

  // The row's bytes, scale and bias into the cache (the first and the last line of the bytes:
  // a row of at most 64 bytes spans at most two lines).
  JAXEMBED_INLINE void Prefetch(int64_t r) const {
    const uint8_t* row = Row(r);
    __builtin_prefetch(row, 0, 3);
    if (bytes > 64) {
      for (int64_t k = 64; k < bytes; k += 64) __builtin_prefetch(row + k, 0, 3);
    }
    if (two_lines) __builtin_prefetch(row + bytes - 1, 0, 3);
    if constexpr (P != Precision::kFp8) {
      // Into L2 only (prefetcht1): the L1 miss buffers stay for the rows' bytes, and the
      // scale and bias lines, hot across rows, come from L2 when read (measured here: 10-15%
      // faster than prefetching them into L1 on 100k-row tables).
      __builtin_prefetch(scale + r, 0, 2);
      __builtin_prefetch(bias + r, 0, 2);
    }
  }

  // Value h of a row: code · s + b, rounded once (fp8: its code's value).
  JAXEMBED_INLINE float Value(const uint8_t* row, int64_t h, float s, float b) const {
    const uint32_t byte = row[h / kPerByte];
    const uint32_t code = (byte >> ((h % kPerByte) * kBits)) & ((1u << kBits) - 1u);
    if constexpr (P == Precision::kFp8) {
      return Fp8Value(code, fp8);
    } else {
      return std::fma(static_cast<float>(code), s, b);
    }
  }

#if JAXEMBED_QUANT_AVX2
  static constexpr bool kVector8 = P != Precision::kFp8;

  // A row's scale and bias broadcast to 8 lanes (float16 widened: exact, as the scalar path).
  struct Decoder8 {
    __m256 s, b;
  };
  static JAXEMBED_INLINE __m256 Broadcast8(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(*p)));
  }
  static JAXEMBED_INLINE __m256 Broadcast8(const float* p) { return _mm256_set1_ps(*p); }
  JAXEMBED_INLINE Decoder8 Decoder8Of(int64_t r) const {
    return {Broadcast8(scale + r), Broadcast8(bias + r)};
  }

  // Values [c, c + 8) of a row (c a multiple of 8): fma(code, s, b), rounded once as `Value`
  // (bitwise the scalar path). int8: 8 bytes; int4: a 32-bit word, lane l its bits 4l..4l+3;
  // int2: a 16-bit word, lane l its bits 2l, 2l+1.
  JAXEMBED_INLINE __m256 Vector8(const uint8_t* row, int64_t c, const Decoder8& d) const {
    __m256i code;
    if constexpr (P == Precision::kInt8) {
      code = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c)));
    } else if constexpr (P == Precision::kInt4) {
      uint32_t word;
      std::memcpy(&word, row + c / 2, sizeof(word));
      code = _mm256_and_si256(
          _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)),
                            _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
          _mm256_set1_epi32(15));
    } else {
      uint16_t word;
      std::memcpy(&word, row + c / 4, sizeof(word));
      code = _mm256_and_si256(
          _mm256_srlv_epi32(_mm256_set1_epi32(word), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
          _mm256_set1_epi32(3));
    }
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(code), d.s, d.b);
  }
#endif

#if JAXEMBED_QUANT_AVX512
  // What a row's values need, in registers: int8 its scale and bias; int4 and int2 the
  // 16 values of a row's codes 0..15 (int2: codes k & 3), `k · scale + bias` computed as each
  // value is, so that a permute reads every value from its code; fp8 nothing.
  struct Decoder {
    __m512 s, b, lut;
  };

  // A parameter broadcast to 16 lanes (float16 widened there: exact, as the scalar widening).
  static JAXEMBED_INLINE __m512 Broadcast(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(*p)));
  }
  static JAXEMBED_INLINE __m512 Broadcast(const float* p) { return _mm512_set1_ps(*p); }

  // Row r's decoder.
  JAXEMBED_INLINE Decoder DecoderOf(int64_t r) const {
    Decoder d;
    if constexpr (P == Precision::kInt8) {
      d.s = Broadcast(scale + r);
      d.b = Broadcast(bias + r);
    } else if constexpr (P == Precision::kInt4 || P == Precision::kInt2) {
      const __m512 codes =
          kBits == 4 ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
                     : _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
      d.lut = _mm512_fmadd_ps(codes, Broadcast(scale + r), Broadcast(bias + r));
    }
    return d;
  }

  // Values [c, c + 16) of a row (c a multiple of 16): codes · s + b, rounded once (fp8: the
  // codes' values).
  JAXEMBED_INLINE __m512 Vector(const uint8_t* row, int64_t c, const Decoder& d) const {
    if constexpr (P == Precision::kInt8) {
      const __m512i q =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c)));
      return _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), d.s, d.b);
    } else if constexpr (P == Precision::kInt4) {
      // 8 bytes: lanes 0-7 take the low 32-bit word, 8-15 the high one, each shifted right by
      // 4·(lane % 8): the lane's low 4 bits are its code, the index vpermps reads.
      uint64_t word;
      std::memcpy(&word, row + c / 2, sizeof(word));
      const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
      const __m512i shifts =
          _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
      const __m512i w = _mm512_permutexvar_epi32(
          halves, _mm512_castsi128_si512(_mm_cvtsi64_si128(static_cast<long long>(word))));
      return _mm512_permutexvar_ps(_mm512_srlv_epi32(w, shifts), d.lut);
    } else if constexpr (P == Precision::kInt2) {
      // 4 bytes as one word, lane l shifted right by 2·l: its low 2 bits are its code and the
      // next 2 the next value's, which the table's period of 4 ignores.
      uint32_t word;
      std::memcpy(&word, row + c / 4, sizeof(word));
      const __m512i shifts =
          _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
      return _mm512_permutexvar_ps(
          _mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(word)), shifts), d.lut);
    } else {
      const __m512i q =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c)));
      const __m512i e = _mm512_and_si512(_mm512_srlv_epi32(q, _mm512_set1_epi32(fp8.mbits)),
                                         _mm512_set1_epi32(fp8.emask));
      const __m512i m = _mm512_and_si512(q, _mm512_set1_epi32(fp8.mmask));
      const __m512i normal = _mm512_or_si512(
          _mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(fp8.rebias)), 23),
          _mm512_sllv_epi32(m, _mm512_set1_epi32(23 - fp8.mbits)));
      const __m512 tiny = _mm512_mul_ps(_mm512_cvtepi32_ps(m), _mm512_set1_ps(fp8.tiny));
      const __mmask16 zero = _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512());
      const __m512i mag = _mm512_mask_blend_epi32(zero, normal, _mm512_castps_si512(tiny));
      const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(q, _mm512_set1_epi32(0x80)), 24);
      return _mm512_castsi512_ps(_mm512_or_si512(mag, sign));
    }
  }
#endif
};

#if JAXEMBED_QUANT_AVX512
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 1;  // no vector columns: every column goes one value at a time
#endif

constexpr int64_t kPrefetchAhead = 16;  // slots; 8, 16, 32 and 48 measured alike here
constexpr int64_t kParallelLayout = int64_t{1} << 20;  // slots from which the layout is parallel
constexpr int kChunksPerThread = 8;  // bag runs handed out per thread (see ForEachBag)

// The columns done 16 at a time; the others (H % 16, or all without AVX-512) one at a time.
inline int64_t VectorColumns(int64_t H) {
#if JAXEMBED_QUANT_AVX512
  return H / kLanes * kLanes;
#else
  (void)H;
  return 0;
#endif
}

JAXEMBED_INLINE inline int64_t ClampRow(int64_t r, int64_t rows) {
  return r < 0 ? 0 : (r >= rows ? rows - 1 : r);
}

// ---- checks -----------------------------------------------------------------------------------

ffi::Error CheckThreadCount(const char* kernel, int64_t num_threads) {
  if (num_threads >= 1 && num_threads <= 1024) return ffi::Error::Success();
  return Invalid(kernel, "num_threads=" + std::to_string(num_threads) +
                             " is outside [1, 1024] (set JAXEMBED_NUM_THREADS)");
}

// The table's operands: data u8[R, Bq], scale and bias [R] of one float type (f16, or f32)
// for the integer formats, [0] for fp8, and fp8's format.
struct Table {
  Precision precision;
  int64_t R, bytes, H;
  bool f32_params = false;
  Fp8Format fp8;
};

ffi::Error CheckTable(const char* k, std::string_view precision, int64_t ebits, int64_t ebias,
                      ffi::Buffer<ffi::U8> data, ffi::AnyBuffer scale, ffi::AnyBuffer bias,
                      Table* t) {
  if (!ParsePrecision(precision, &t->precision)) {
    return Invalid(k, "unknown precision '" + std::string(precision) +
                          "': expected int8, int4, int2 or fp8");
  }
  if (data.dimensions().size() != 2) {
    return Invalid(k, "data must be u8[rows, bytes a row], got shape " + Dims(data.dimensions()));
  }
  t->R = data.dimensions()[0];
  t->bytes = data.dimensions()[1];
  t->H = t->bytes * (8 / BitsOf(t->precision));
  const bool fp8 = t->precision == Precision::kFp8;
  if (fp8) {
    if (ebits < 1 || ebits > 7 || ebias < 0 || ebias > (int64_t{1} << ebits) - 2) {
      return Invalid(k, "fp8 takes exponent_bits in [1, 7] and exponent_bias in [0, 2^bits - 2], "
                        "got exponent_bits=" + std::to_string(ebits) + ", exponent_bias=" +
                            std::to_string(ebias));
    }
    t->fp8 = MakeFp8Format(ebits, ebias);
  }
  for (const auto& [name, p] : {std::pair<const char*, ffi::AnyBuffer*>{"scale", &scale},
                                std::pair<const char*, ffi::AnyBuffer*>{"bias", &bias}}) {
    const auto d = p->dimensions();
    if (fp8) {
      if (p->element_count() != 0) {
        return Invalid(k, std::string("fp8 rows have no ") + name + ": pass an empty [0] "
                          "array, got shape " + Dims(d));
      }
      continue;
    }
    if (d.size() != 1 || d[0] != t->R) {
      return Invalid(k, std::string(name) + " has shape " + Dims(d) + " but data has " +
                            std::to_string(t->R) + " rows: it must be [rows]");
    }
    const ffi::DataType type = p->element_type();
    if (type != ffi::DataType::F16 && type != ffi::DataType::F32) {
      return Invalid(k, std::string(name) + " must be float16 or float32, got dtype code " +
                            std::to_string(static_cast<int>(type)));
    }
  }
  if (!fp8) {
    if (scale.element_type() != bias.element_type()) {
      return Invalid(k, "scale and bias must have one dtype (both float16 or both float32)");
    }
    t->f32_params = scale.element_type() == ffi::DataType::F32;
  }
  return ffi::Error::Success();
}

// local i32[M], valid bool[M], and segments i32[M], weights f32[M] where given, all [M].
ffi::Error CheckSlotOperands(const char* k, ffi::Buffer<ffi::S32> local,
                             ffi::Buffer<ffi::PRED> valid,
                             const ffi::Buffer<ffi::S32>* segments = nullptr,
                             const ffi::Buffer<ffi::F32>* weights = nullptr) {
  if (local.dimensions().size() != 1) {
    return Invalid(k, "local must be [M] (flatten the slots), got shape " +
                          Dims(local.dimensions()));
  }
  const int64_t m = local.dimensions()[0];
  if (m > std::numeric_limits<int32_t>::max()) {
    return Invalid(k, std::to_string(m) + " slots exceed the limit of 2^31 - 1");
  }
  const std::pair<const char*, ffi::AnyBuffer::Dimensions> others[] = {
      {"valid", valid.dimensions()},
      {"segments", segments ? segments->dimensions() : local.dimensions()},
      {"weights", weights ? weights->dimensions() : local.dimensions()},
  };
  for (const auto& [name, d] : others) {
    if (d.size() != 1 || d[0] != m) {
      return Invalid(k, std::string(name) + " has shape " + Dims(d) + ", local [" +
                            std::to_string(m) + "]: every per-slot operand must be [M]");
    }
  }
  return ffi::Error::Success();
}

ffi::Error CheckOut(const char* k, const char* name, ffi::AnyBuffer::Dimensions d, int64_t H,
                    int64_t* rows) {
  if (d.size() != 2 || d[1] != H) {
    return Invalid(k, std::string(name) + " has shape " + Dims(d) + ", expected [S, " +
                          std::to_string(H) + "] (H = the packed bytes a row times the values "
                          "a byte)");
  }
  *rows = d[0];
  return ffi::Error::Success();
}

// Runs f(rows) with rows the QuantRows<P, Param> of the table.
template <class F>
void DispatchTable(const Table& t, ffi::Buffer<ffi::U8> data, ffi::AnyBuffer scale,
                   ffi::AnyBuffer bias, const F& f) {
  const uint8_t* d = data.typed_data();
  auto with = [&](auto precision, auto param) {
    constexpr Precision P = decltype(precision)::value;
    using Param = decltype(param);
    QuantRows<P, Param> rows{d, t.R, t.bytes, nullptr, nullptr, t.fp8};
    // Rows whose size divides 64 from a 64-byte aligned start never cross a line.
    rows.two_lines = t.bytes == 0 || t.bytes > 64 || 64 % t.bytes != 0 ||
                     reinterpret_cast<uintptr_t>(d) % 64 != 0;
    if constexpr (P != Precision::kFp8) {
      rows.scale = static_cast<const Param*>(scale.untyped_data());
      rows.bias = static_cast<const Param*>(bias.untyped_data());
    }
    f(rows);
  };
  using I8 = std::integral_constant<Precision, Precision::kInt8>;
  using I4 = std::integral_constant<Precision, Precision::kInt4>;
  using I2 = std::integral_constant<Precision, Precision::kInt2>;
  using F8 = std::integral_constant<Precision, Precision::kFp8>;
  switch (t.precision) {
    case Precision::kInt8:
      return t.f32_params ? with(I8{}, float{}) : with(I8{}, uint16_t{});
    case Precision::kInt4:
      return t.f32_params ? with(I4{}, float{}) : with(I4{}, uint16_t{});
    case Precision::kInt2:
      return t.f32_params ? with(I2{}, float{}) : with(I2{}, uint16_t{});
    case Precision::kFp8:
      return with(F8{}, uint16_t{});
  }
}

// ---- gather_rows ------------------------------------------------------------------------------

template <class Rows>
void GatherQuantRows(const Rows& rows, const int32_t* local, const bool* valid, int64_t M,
                     int64_t H, float* out, Team& team) {
  const int threads = team.size();
  const int64_t R = rows.R, vec = VectorColumns(H);
  team.Run([&](int t) {
    const int64_t end = PartStart(M, threads, t + 1);
    for (int64_t i = PartStart(M, threads, t); i < end; ++i) {
      const int64_t ahead = i + kPrefetchAhead;
      if (ahead < end && valid[ahead]) rows.Prefetch(ClampRow(local[ahead], R));
      float* o = out + i * H;
      if (!valid[i]) {
        std::memset(o, 0, H * sizeof(float));
        continue;
      }
      const int64_t r = ClampRow(local[i], R);
      const uint8_t* row = rows.Row(r);
      int64_t done = vec;
#if JAXEMBED_QUANT_AVX512
      const auto dec = rows.DecoderOf(r);
      for (int64_t c = 0; c < vec; c += kLanes) _mm512_storeu_ps(o + c, rows.Vector(row, c, dec));
#elif JAXEMBED_QUANT_AVX2
      if constexpr (Rows::kVector8) {
        const auto dec = rows.Decoder8Of(r);
        done = H / 8 * 8;
        for (int64_t c = 0; c < done; c += 8) _mm256_storeu_ps(o + c, rows.Vector8(row, c, dec));
      }
#endif
      if (done == H) continue;
      float s, b;
      rows.Params(r, &s, &b);
      for (int64_t h = done; h < H; ++h) o[h] = rows.Value(row, h, s, b);
    }
  });
}

ffi::Error QuantGatherRowsImpl(ffi::Buffer<ffi::U8> data, ffi::AnyBuffer scale,
                               ffi::AnyBuffer bias, ffi::Buffer<ffi::S32> local,
                               ffi::Buffer<ffi::PRED> valid, ffi::Result<ffi::Buffer<ffi::F32>> out,
                               std::string_view precision, int64_t exponent_bits,
                               int64_t exponent_bias, int64_t num_threads) {
  constexpr const char* k = "quant gather_rows";
  if (auto e = CheckThreadCount(k, num_threads); e.failure()) return e;
  Table t;
  if (auto e = CheckTable(k, precision, exponent_bits, exponent_bias, data, scale, bias, &t);
      e.failure()) {
    return e;
  }
  if (auto e = CheckSlotOperands(k, local, valid); e.failure()) return e;
  const int64_t M = local.element_count();
  if (auto e = CheckShape(k, "out", out->dimensions(), {M, t.H}); e.failure()) return e;
  if (M * t.H == 0) return ffi::Error::Success();
  float* o = out->typed_data();
  if (t.R == 0) {  // no row to read: every slot reads zeros
    std::memset(o, 0, M * t.H * sizeof(float));
    return ffi::Error::Success();
  }
  Team team(ThreadsFor(num_threads, M));
  DispatchTable(t, data, scale, bias, [&](const auto& rows) {
    GatherQuantRows(rows, local.typed_data(), valid.typed_data(), M, t.H, o, team);
  });
  return ffi::Error::Success();
}

// ---- bags: each bag's slots, in slot order ------------------------------------------------------

// Whether slot i counts: valid, with a bag in [0, S).
struct SlotLive {
  const bool* valid;
  const int32_t* seg;
  int64_t S;
  JAXEMBED_INLINE bool operator()(int64_t i) const {
    return valid[i] && static_cast<uint32_t>(seg[i]) < static_cast<uint64_t>(S);
  }
};

// Where every bag's slots are. Bag s's slots are the positions p in [begin[s], end(s)), end(s)
// = begin[s + 1] unless `ends` is given: slot p itself when `in_place` (then only the live ones
// count: the others belong to no bag or to a bag that has no live slot there), else slot
// sorted.slots[p]. `begin` never decreases; with `ends`, positions between a bag's end and
// the next bag's begin belong to no bag (the flat form's slots past a block's total).
struct Bags {
  bool in_place = true;
  bool all_live = false;      // in place, and every slot is live: no slot needs a check
  bool unit_weights = false;  // every weight is exactly 1 (pool_sum): none is read
  std::vector<int64_t> begin;  // [S + 1]
  std::vector<int64_t> ends;   // [S], or empty: bag s ends where bag s + 1 begins
  SortedSlots sorted;

  int64_t positions(int64_t S) const { return begin[S]; }
  int64_t end(int64_t s) const { return ends.empty() ? begin[s + 1] : ends[s]; }
};

// Builds `Bags` for the live slots (`SlotLive`); `weights` (f32[M], or null) for
// `unit_weights`.
//
// In place when the live slots' bags do not decrease: two passes over the slots, each split
// among the threads. The first checks each thread's chunk without a branch (every slot live,
// bags non-decreasing, weights 1: loops the compiler vectorizes), and scans a chunk that fails
// for its order and its first and last live bag. If the chunks join in order, the second has
// each chunk write the starts of the bags that begin in it: begin[s] = the first live slot
// whose bag is >= s (M after the last), chunk t writing the bags in (the last bag before it,
// its last bag], so the chunks write disjoint entries. Otherwise the live slots are
// radix-sorted by bag (stable) and begin[] is read off the sorted list.
Bags LayOutBags(int64_t M, int64_t S, const int32_t* seg, const bool* valid,
                const float* weights, Team& team) {
  // The passes cost about a nanosecond a slot: below kParallelLayout slots they run on the
  // calling thread (chunk by chunk, the same result), where a fork-join of the team costs more
  // on a loaded machine (0.1-1 ms measured on 2 shared cores) than the pass itself.
  const int threads = team.size();
  auto run = [&](const auto& fn) {
    if (M >= kParallelLayout) {
      team.Run(fn);
    } else {
      for (int t = 0; t < threads; ++t) fn(t);
    }
  };
  const SlotLive live{valid, seg, S};
  const uint8_t* valid8 = reinterpret_cast<const uint8_t*>(valid);
  struct Chunk {
    bool ordered = true, all_live = true, unit = true;
    int64_t first = -1, last = -1;  // bags of its first and last live slot
  };
  std::vector<Chunk> chunks(threads);
  run([&](int t) {
    const int64_t lo = PartStart(M, threads, t), hi = PartStart(M, threads, t + 1);
    Chunk c;
    uint32_t dead = 0, down = 0, other = 0;
    for (int64_t i = lo; i < hi; ++i) {
      dead |= static_cast<uint32_t>(valid8[i] ^ 1u) |
              static_cast<uint32_t>(static_cast<uint32_t>(seg[i]) >= static_cast<uint64_t>(S));
    }
    for (int64_t i = lo + 1; i < hi; ++i) down |= static_cast<uint32_t>(seg[i] < seg[i - 1]);
    if (weights != nullptr) {
      for (int64_t i = lo; i < hi; ++i) other |= static_cast<uint32_t>(weights[i] != 1.0f);
    }
    c.unit = weights != nullptr && other == 0;
    if (dead == 0 && down == 0) {
      if (hi > lo) {
        c.first = seg[lo];
        c.last = seg[hi - 1];
      }
    } else {
      c.all_live = dead == 0;
      for (int64_t i = lo; i < hi; ++i) {
        if (!live(i)) continue;
        const int64_t s = seg[i];
        if (c.first < 0) c.first = s;
        c.ordered = c.ordered && s >= c.last;
        c.last = s;
      }
    }
    chunks[t] = c;
  });
  std::vector<int64_t> before(threads, -1);  // the last bag of the chunks before chunk t
  bool ordered = true, all_live = true, unit = true;
  int64_t last = -1;
  for (int t = 0; t < threads; ++t) {
    const Chunk& c = chunks[t];
    before[t] = last;
    all_live = all_live && c.all_live;
    unit = unit && c.unit;
    if (c.first < 0) continue;
    ordered = ordered && c.ordered && c.first >= last;
    last = c.last;
  }
  Bags bags;
  bags.unit_weights = unit;
  bags.begin.assign(S + 1, M);
  int64_t* begin = bags.begin.data();
  if (ordered) {
    bags.all_live = all_live;
    run([&](int t) {
      int64_t prev = before[t];
      const int64_t lo = PartStart(M, threads, t), hi = PartStart(M, threads, t + 1);
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t s = seg[i];
        if (s == prev || (!all_live && !live(i))) continue;
        for (int64_t b = prev + 1; b <= s; ++b) begin[b] = i;
        prev = s;
      }
    });
    return bags;
  }
  bags.in_place = false;
  auto key_of = [&](int64_t i) -> int64_t { return live(i) ? seg[i] : -1; };
  bags.sorted = SortSlotsByKey(M, BitsFor(static_cast<uint64_t>(S)), key_of, team);
  const int64_t n = bags.sorted.n;
  const int32_t* slots = bags.sorted.slots.get();
  int64_t prev = -1;
  for (int64_t p = 0; p < n; ++p) {
    const int64_t s = seg[slots[p]];
    for (int64_t b = prev + 1; b <= s; ++b) begin[b] = p;
    prev = s;
  }
  for (int64_t b = prev + 1; b <= S; ++b) begin[b] = n;
  return bags;
}

// Calls bag(s, visit) for every bag s in [0, S), each on one thread; `visit(first, f)` calls
// f(i) for the bag's live slots i (`live(i)`, e.g. `SlotLive`) in slot order and, when `first`
// (a bag pooled in several column blocks prefetches in its first only), `prefetch(j)` for the
// slot j kPrefetchAhead positions ahead (a slot that is not live may be prefetched: its row is
// clamped into the table, so the prefetch is only wasted).
template <class Live, class Prefetch, class BagFn>
void ForEachBag(const Bags& bags, int64_t S, const Live& live, const Prefetch& prefetch,
                Team& team, const BagFn& bag) {
  const int64_t total = bags.positions(S);
  const int64_t* begin = bags.begin.data();
  const int32_t* sorted = bags.in_place ? nullptr : bags.sorted.slots.get();
  // Runs of bags of about equal slot counts, kChunksPerThread a thread, taken from a counter:
  // a thread the machine leaves unscheduled delays only the run it holds (the others take the
  // rest), and which thread pools a bag does not change its sum.
  const int chunks =
      static_cast<int>(std::min<int64_t>(S, int64_t{team.size()} * kChunksPerThread));
  auto first_bag = [&](int c) -> int64_t {  // the first bag starting at or after c's share
    if (c == 0) return 0;
    if (c == chunks) return S;
    return std::lower_bound(begin, begin + S, PartStart(total, chunks, c)) - begin;
  };
  const int64_t stop = total - kPrefetchAhead;  // positions below it prefetch ahead
  std::atomic<int> next{0};
  team.Run([&](int) {
    for (int c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
         c = next.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t lo = first_bag(c), hi = std::max(lo, first_bag(c + 1));
      for (int64_t s = lo; s < hi; ++s) {
        const int64_t a = begin[s], b = bags.end(s);
        auto visit = [&](bool first, const auto& f) JAXEMBED_INLINE {
          const int64_t ahead = first ? std::max(a, std::min(b, stop)) : a;  // [a, ahead) do
          if (sorted != nullptr) {
            int64_t p = a;
            for (; p < ahead; ++p) {
              prefetch(sorted[p + kPrefetchAhead]);
              f(sorted[p]);
            }
            for (; p < b; ++p) f(sorted[p]);
          } else if (bags.all_live) {
            int64_t p = a;
            for (; p < ahead; ++p) {
              prefetch(p + kPrefetchAhead);
              f(p);
            }
            for (; p < b; ++p) f(p);
          } else {
            for (int64_t p = a; p < b; ++p) {
              if (p < ahead) prefetch(p + kPrefetchAhead);
              if (live(p)) f(p);
            }
          }
        };
        bag(s, visit);
      }
    }
  });
}

// Runs block(std::integral_constant<int, NV>) over the vector columns [0, vec), NV = 8, 4, 2
// or 1 vectors at a time (each block advancing the caller's column).
template <class Block>
inline void ForEachBlock(int64_t vec, const Block& block) {
#if JAXEMBED_QUANT_AVX512
  for (int64_t left = vec / kLanes; left > 0;) {
    if (left >= 8) {
      block(std::integral_constant<int, 8>{});
      left -= 8;
    } else if (left >= 4) {
      block(std::integral_constant<int, 4>{});
      left -= 4;
    } else if (left >= 2) {
      block(std::integral_constant<int, 2>{});
      left -= 2;
    } else {
      block(std::integral_constant<int, 1>{});
      left -= 1;
    }
  }
#else
  (void)vec;
  (void)block;
#endif
}

// ---- pool_sum ---------------------------------------------------------------------------------

// out[s] = Σ weight(i) · row(i) over bag s's slots, in slot order from 0 (the columns in blocks
// of up to 128 held in registers, then the last H % 16 one at a time); with kUnitWeights no
// weight is asked for (each is 1).
template <bool kUnitWeights, class Rows, class Weight, class Visit>
void SumBag(const Rows& rows, const int32_t* local, const Weight& weight, int64_t H, float* dst,
            const Visit& visit) {
  const int64_t R = rows.R;
  bool first = true;
  int64_t c = 0;
#if JAXEMBED_QUANT_AVX512
  const int64_t vec = VectorColumns(H);
  auto block = [&](auto nv_tag) {
    constexpr int NV = decltype(nv_tag)::value;
    __m512 acc[NV];
    for (int j = 0; j < NV; ++j) acc[j] = _mm512_setzero_ps();
    visit(first, [&](int64_t i) JAXEMBED_INLINE {
      const int64_t r = ClampRow(local[i], R);
      const uint8_t* row = rows.Row(r);
      const auto dec = rows.DecoderOf(r);
      const float w = kUnitWeights ? 1.0f : weight(i);
      if (kUnitWeights || w == 1.0f) {  // x · 1 is x: the multiply is skipped, the result the same
        for (int j = 0; j < NV; ++j) {
          acc[j] = _mm512_add_ps(acc[j], rows.Vector(row, c + j * kLanes, dec));
        }
      } else {
        const __m512 wv = _mm512_set1_ps(w);
        for (int j = 0; j < NV; ++j) {
          acc[j] = _mm512_add_ps(acc[j], _mm512_mul_ps(rows.Vector(row, c + j * kLanes, dec), wv));
        }
      }
    });
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(dst + c + j * kLanes, acc[j]);
    c += NV * kLanes;
    first = false;
  };
  ForEachBlock(vec, block);
#elif JAXEMBED_QUANT_AVX2
  if constexpr (Rows::kVector8) {  // columns in blocks of up to 64 (8 registers), as above
    auto block8 = [&](auto nv_tag) {
      constexpr int NV = decltype(nv_tag)::value;
      __m256 acc[NV];
      for (int j = 0; j < NV; ++j) acc[j] = _mm256_setzero_ps();
      visit(first, [&](int64_t i) JAXEMBED_INLINE {
        const int64_t r = ClampRow(local[i], R);
        const uint8_t* row = rows.Row(r);
        const auto dec = rows.Decoder8Of(r);
        const float w = kUnitWeights ? 1.0f : weight(i);
        if (kUnitWeights || w == 1.0f) {
          for (int j = 0; j < NV; ++j) {
            acc[j] = _mm256_add_ps(acc[j], rows.Vector8(row, c + j * 8, dec));
          }
        } else {
          const __m256 wv = _mm256_set1_ps(w);
          for (int j = 0; j < NV; ++j) {
            acc[j] = _mm256_add_ps(acc[j], _mm256_mul_ps(rows.Vector8(row, c + j * 8, dec), wv));
          }
        }
      });
      for (int j = 0; j < NV; ++j) _mm256_storeu_ps(dst + c + j * 8, acc[j]);
      c += NV * 8;
      first = false;
    };
    for (int64_t left = H / 8; left > 0;) {
      if (left >= 8) {
        block8(std::integral_constant<int, 8>{});
        left -= 8;
      } else if (left >= 4) {
        block8(std::integral_constant<int, 4>{});
        left -= 4;
      } else if (left >= 2) {
        block8(std::integral_constant<int, 2>{});
        left -= 2;
      } else {
        block8(std::integral_constant<int, 1>{});
        left -= 1;
      }
    }
  }
#endif
  if (c == H) return;
  std::fill(dst + c, dst + H, 0.0f);
  visit(first, [&](int64_t i) JAXEMBED_INLINE {
    const int64_t r = ClampRow(local[i], R);
    const uint8_t* row = rows.Row(r);
    float s, b;
    rows.Params(r, &s, &b);
    const float w = kUnitWeights ? 1.0f : weight(i);
    for (int64_t h = c; h < H; ++h) dst[h] = dst[h] + rows.Value(row, h, s, b) * w;
  });
}

ffi::Error QuantPoolSumImpl(ffi::Buffer<ffi::U8> data, ffi::AnyBuffer scale, ffi::AnyBuffer bias,
                            ffi::Buffer<ffi::S32> local, ffi::Buffer<ffi::PRED> valid,
                            ffi::Buffer<ffi::S32> segments, ffi::Buffer<ffi::F32> weights,
                            ffi::Result<ffi::Buffer<ffi::F32>> out, std::string_view precision,
                            int64_t exponent_bits, int64_t exponent_bias, int64_t num_threads) {
  constexpr const char* k = "quant pool_sum";
  if (auto e = CheckThreadCount(k, num_threads); e.failure()) return e;
  Table t;
  if (auto e = CheckTable(k, precision, exponent_bits, exponent_bias, data, scale, bias, &t);
      e.failure()) {
    return e;
  }
  if (auto e = CheckSlotOperands(k, local, valid, &segments, &weights); e.failure()) return e;
  int64_t S;
  if (auto e = CheckOut(k, "out", out->dimensions(), t.H, &S); e.failure()) return e;
  if (S * t.H == 0) return ffi::Error::Success();
  const int64_t M = local.element_count(), R = t.R;
  float* o = out->typed_data();
  if (R == 0) {  // no row: every bag is empty
    std::memset(o, 0, S * t.H * sizeof(float));
    return ffi::Error::Success();
  }
  const int32_t* seg = segments.typed_data();
  const SlotLive live{valid.typed_data(), seg, S};
  Team team(ThreadsFor(num_threads, std::max(M, S)));
  const Bags bags = LayOutBags(M, S, seg, valid.typed_data(), weights.typed_data(), team);
  const int32_t* loc = local.typed_data();
  DispatchTable(t, data, scale, bias, [&](const auto& rows) {
    auto prefetch = [&](int64_t i) JAXEMBED_INLINE { rows.Prefetch(ClampRow(loc[i], R)); };
    const float* w = weights.typed_data();
    auto weight = [w](int64_t i) JAXEMBED_INLINE { return w[i]; };
    auto pool = [&](auto unit) {
      ForEachBag(bags, S, live, prefetch, team, [&](int64_t s, const auto& visit) {
        SumBag<decltype(unit)::value>(rows, loc, weight, t.H, o + s * t.H, visit);
      });
    };
    if (bags.unit_weights) {
      pool(std::true_type{});
    } else {
      pool(std::false_type{});
    }
  });
  return ffi::Error::Success();
}

// ---- pool_bags: sum, mean and sqrtn bags read from the ids as the caller holds them ------------

// Whether slot i of pool_bags reads a row: its id in [0, vocab) and not the padding id (-1 for
// none: no id in range is -1).
struct IdLive {
  const int32_t* ids;
  int64_t vocab, padding;
  JAXEMBED_INLINE bool operator()(int64_t i) const {
    const int64_t id = ids[i];
    return static_cast<uint64_t>(id) < static_cast<uint64_t>(vocab) && id != padding;
  }
};

enum class Combiner { kSum, kMean, kSqrtn };

bool ParseCombiner(std::string_view name, Combiner* out) {
  if (name == "sum") {
    *out = Combiner::kSum;
  } else if (name == "mean") {
    *out = Combiner::kMean;
  } else if (name == "sqrtn") {
    *out = Combiner::kSqrtn;
  } else {
    return false;
  }
  return true;
}

// The bags of ids [G, N] as `Bags` in place, positions the flat slots g·N + n. Dense form: bag g
// is row g. Flat form (lengths [G, B]): block g's bag b is the next clamp(lengths[g, b], 0, N)
// slots of its N, cut at N; the slots past a block's total belong to no bag (jaxembed.ragged's
// segments_from_lengths, its running sums taken in 64 bits).
Bags BagsOfForm(bool dense, int64_t G, int64_t N, int64_t B, const int32_t* lengths) {
  Bags bags;
  if (dense) {
    bags.begin.resize(G + 1);
    for (int64_t g = 0; g <= G; ++g) bags.begin[g] = g * N;
    return bags;
  }
  const int64_t S = G * B;
  bags.begin.resize(S + 1);
  bags.ends.resize(S);
  int64_t last = 0;
  for (int64_t g = 0; g < G; ++g) {
    int64_t total = 0;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t s = g * B + b;
      bags.begin[s] = g * N + std::min(total, N);
      total += std::clamp<int64_t>(lengths[s], 0, N);
      last = bags.ends[s] = g * N + std::min(total, N);
    }
  }
  bags.begin[S] = last;
  return bags;
}

// pool_bags: each bag pooled straight from the ids as given (no valid, segment or factor arrays
// built by XLA first): a slot reads a row when `IdLive`; its factor is its weight (1 when none)
// for sum, and weight / Σ weight (mean) or weight / √Σ weight² (sqrtn) over the bag's live
// slots, 0 where that sum is 0, the sum taken in slot order from 0 (jaxembed.ragged.bag_scales'
// segment_sum); then SumBag, as pool_sum pools (bitwise: the same factors, the same order).
ffi::Error QuantPoolBagsImpl(ffi::Buffer<ffi::U8> data, ffi::AnyBuffer scale, ffi::AnyBuffer bias,
                             ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::S32> lengths,
                             ffi::Buffer<ffi::F32> weights, ffi::Result<ffi::Buffer<ffi::F32>> out,
                             std::string_view precision, int64_t exponent_bits,
                             int64_t exponent_bias, int64_t num_threads,
                             std::string_view combiner, int64_t vocab_size, int64_t padding_idx,
                             int64_t dense) {
  constexpr const char* k = "quant pool_bags";
  if (auto e = CheckThreadCount(k, num_threads); e.failure()) return e;
  Table t;
  if (auto e = CheckTable(k, precision, exponent_bits, exponent_bias, data, scale, bias, &t);
      e.failure()) {
    return e;
  }
  Combiner how;
  if (!ParseCombiner(combiner, &how)) {
    return Invalid(k, "unknown combiner '" + std::string(combiner) +
                          "': expected sum, mean or sqrtn (max pools through pool_max)");
  }
  if (vocab_size < 0 || vocab_size > t.R) {
    return Invalid(k, "vocab_size=" + std::to_string(vocab_size) + " is outside [0, " +
                          std::to_string(t.R) + "] (the table's rows)");
  }
  if (padding_idx != -1 && (padding_idx < 0 || padding_idx >= vocab_size)) {
    return Invalid(k, "padding_idx=" + std::to_string(padding_idx) + " is outside [0, " +
                          std::to_string(vocab_size) + ") (or -1 for none)");
  }
  if (ids.dimensions().size() != 2) {
    return Invalid(k, "ids must be [G, N] (blocks, slots a block), got shape " +
                          Dims(ids.dimensions()));
  }
  const int64_t G = ids.dimensions()[0], N = ids.dimensions()[1], M = G * N;
  int64_t B = 1;
  if (dense != 0) {
    if (lengths.element_count() != 0) {
      return Invalid(k, "the dense form (a bag a row of ids) takes no lengths: pass an empty "
                        "[0] array, got shape " + Dims(lengths.dimensions()));
    }
  } else {
    const auto d = lengths.dimensions();
    if (d.size() != 2 || d[0] != G) {
      return Invalid(k, "lengths has shape " + Dims(d) + ", ids " + Dims(ids.dimensions()) +
                            ": the flat form takes lengths [G, B], a row a block of ids");
    }
    B = d[1];
  }
  const bool weighted = weights.element_count() != 0;
  if (weighted && (weights.dimensions().size() != 2 || weights.dimensions()[0] != G ||
                   weights.dimensions()[1] != N)) {
    return Invalid(k, "weights has shape " + Dims(weights.dimensions()) + ", ids " +
                          Dims(ids.dimensions()) + ": a weight a slot, or an empty [0] array");
  }
  const int64_t S = G * B;
  if (auto e = CheckShape(k, "out", out->dimensions(), {S, t.H}); e.failure()) return e;
  if (S * t.H == 0) return ffi::Error::Success();
  float* o = out->typed_data();
  if (t.R == 0 || M == 0) {  // no row or no slot: every bag is empty
    std::memset(o, 0, S * t.H * sizeof(float));
    return ffi::Error::Success();
  }
  const Bags bags = BagsOfForm(dense != 0, G, N, B, lengths.typed_data());
  const int32_t* id = ids.typed_data();
  const float* w = weighted ? weights.typed_data() : nullptr;
  const IdLive live{id, vocab_size, padding_idx};
  Team team(ThreadsFor(num_threads, std::max(M, S)));
  DispatchTable(t, data, scale, bias, [&](const auto& rows) {
    const int64_t R = t.R, H = t.H;
    auto prefetch = [&](int64_t i) JAXEMBED_INLINE {
      const int64_t r = id[i];
      if (static_cast<uint64_t>(r) < static_cast<uint64_t>(R)) rows.Prefetch(r);
    };
    ForEachBag(bags, S, live, prefetch, team, [&](int64_t s, const auto& visit) {
      float* dst = o + s * H;
      if (how == Combiner::kSum) {
        if (w == nullptr) {
          SumBag<true>(rows, id, [](int64_t) JAXEMBED_INLINE { return 1.0f; }, H, dst, visit);
        } else {
          SumBag<false>(rows, id, [w](int64_t i) JAXEMBED_INLINE { return w[i]; }, H, dst, visit);
        }
        return;
      }
      float denom = 0.0f;  // Σ w or Σ w² over the live slots, in slot order (no prefetch)
      visit(false, [&](int64_t i) JAXEMBED_INLINE {
        const float x = w == nullptr ? 1.0f : w[i];
        denom = denom + (how == Combiner::kMean ? x : x * x);
      });
      if (how == Combiner::kSqrtn) denom = std::sqrt(denom);
      const bool nonzero = denom != 0.0f;  // NaN too: it divides, as XLA's where(sum != 0)
      auto factor = [w, denom, nonzero](int64_t i) JAXEMBED_INLINE {
        return nonzero ? (w == nullptr ? 1.0f : w[i]) / denom : 0.0f;
      };
      SumBag<false>(rows, id, factor, H, dst, visit);
    });
  });
  return ffi::Error::Success();
}

// ---- pool_max ---------------------------------------------------------------------------------

// Each bag's element-wise maximum and the first slot reaching it (M where none): a value takes
// the place of the maximum when it is greater, or equal with no winner yet (the first row, or
// -inf rows); a NaN row value makes the maximum NaN with no winner, and nothing replaces a NaN
// (XLA's NaN-propagating max, and `rows == maxima` false for NaN).
template <class Rows, class Visit>
void MaxBag(const Rows& rows, const int32_t* local, int64_t H, int32_t M, float* mx, int32_t* wn,
            const Visit& visit) {
  const int64_t R = rows.R;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  bool first = true;
  int64_t c = 0;
#if JAXEMBED_QUANT_AVX512
  const int64_t vec = VectorColumns(H);
  auto block = [&](auto nv_tag) {
    constexpr int NV = decltype(nv_tag)::value;
    __m512 best[NV];
    __m512i who[NV];
    const __m512i none = _mm512_set1_epi32(M);
    for (int j = 0; j < NV; ++j) {
      best[j] = _mm512_set1_ps(neg_inf);
      who[j] = none;
    }
    visit(first, [&](int64_t i) JAXEMBED_INLINE {
      const int64_t r = ClampRow(local[i], R);
      const uint8_t* row = rows.Row(r);
      const auto dec = rows.DecoderOf(r);
      const __m512i slot = _mm512_set1_epi32(static_cast<int32_t>(i));
      for (int j = 0; j < NV; ++j) {
        const __m512 x = rows.Vector(row, c + j * kLanes, dec);
        const __mmask16 best_nan = _mm512_cmp_ps_mask(best[j], best[j], _CMP_UNORD_Q);
        const __mmask16 x_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        const __mmask16 greater = _mm512_cmp_ps_mask(x, best[j], _CMP_GT_OQ);
        const __mmask16 tie = _mm512_cmp_ps_mask(x, best[j], _CMP_EQ_OQ) &
                              _mm512_cmpeq_epi32_mask(who[j], none);
        const __mmask16 take = static_cast<__mmask16>(~best_nan & (x_nan | greater | tie));
        best[j] = _mm512_mask_mov_ps(best[j], take, x);
        who[j] = _mm512_mask_mov_epi32(who[j], take, _mm512_mask_mov_epi32(slot, x_nan, none));
      }
    });
    for (int j = 0; j < NV; ++j) {
      _mm512_storeu_ps(mx + c + j * kLanes, best[j]);
      _mm512_storeu_si512(wn + c + j * kLanes, who[j]);
    }
    c += NV * kLanes;
    first = false;
  };
  ForEachBlock(vec, block);
#endif
  if (c == H) return;
  std::fill(mx + c, mx + H, neg_inf);
  std::fill(wn + c, wn + H, M);
  visit(first, [&](int64_t i) JAXEMBED_INLINE {
    const int64_t r = ClampRow(local[i], R);
    const uint8_t* row = rows.Row(r);
    float s, b;
    rows.Params(r, &s, &b);
    for (int64_t h = c; h < H; ++h) {
      const float x = rows.Value(row, h, s, b), m = mx[h];
      if (std::isnan(m)) continue;
      if (std::isnan(x)) {
        mx[h] = x;
        wn[h] = M;
      } else if (x > m || (x == m && wn[h] == M)) {
        mx[h] = x;
        wn[h] = static_cast<int32_t>(i);
      }
    }
  });
}

ffi::Error QuantPoolMaxImpl(ffi::Buffer<ffi::U8> data, ffi::AnyBuffer scale, ffi::AnyBuffer bias,
                            ffi::Buffer<ffi::S32> local, ffi::Buffer<ffi::PRED> valid,
                            ffi::Buffer<ffi::S32> segments,
                            ffi::Result<ffi::Buffer<ffi::F32>> maxima,
                            ffi::Result<ffi::Buffer<ffi::S32>> winners, std::string_view precision,
                            int64_t exponent_bits, int64_t exponent_bias, int64_t num_threads) {
  constexpr const char* k = "quant pool_max";
  if (auto e = CheckThreadCount(k, num_threads); e.failure()) return e;
  Table t;
  if (auto e = CheckTable(k, precision, exponent_bits, exponent_bias, data, scale, bias, &t);
      e.failure()) {
    return e;
  }
  if (auto e = CheckSlotOperands(k, local, valid, &segments); e.failure()) return e;
  int64_t S;
  if (auto e = CheckOut(k, "maxima", maxima->dimensions(), t.H, &S); e.failure()) return e;
  if (auto e = CheckShape(k, "winners", winners->dimensions(), {S, t.H}); e.failure()) return e;
  if (S * t.H == 0) return ffi::Error::Success();
  const int64_t M = local.element_count(), R = t.R;
  float* mx = maxima->typed_data();
  int32_t* wn = winners->typed_data();
  if (R == 0) {  // no row: every bag is empty
    std::fill(mx, mx + S * t.H, -std::numeric_limits<float>::infinity());
    std::fill(wn, wn + S * t.H, static_cast<int32_t>(M));
    return ffi::Error::Success();
  }
  const int32_t* seg = segments.typed_data();
  const SlotLive live{valid.typed_data(), seg, S};
  Team team(ThreadsFor(num_threads, std::max(M, S)));
  const Bags bags = LayOutBags(M, S, seg, valid.typed_data(), nullptr, team);
  const int32_t* loc = local.typed_data();
  DispatchTable(t, data, scale, bias, [&](const auto& rows) {
    auto prefetch = [&](int64_t i) JAXEMBED_INLINE { rows.Prefetch(ClampRow(loc[i], R)); };
    ForEachBag(bags, S, live, prefetch, team, [&](int64_t s, const auto& visit) {
      MaxBag(rows, loc, t.H, static_cast<int32_t>(M), mx + s * t.H, wn + s * t.H, visit);
    });
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxembed

// ---- the handlers (symbols looked up by build.py's TARGETS) -------------------------------------

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxembedQuantGatherRows,
                              jaxembed::Safe<jaxembed::QuantGatherRowsImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()   // data
                                  .Arg<ffi::AnyBuffer>()         // scale
                                  .Arg<ffi::AnyBuffer>()         // bias
                                  .Arg<ffi::Buffer<ffi::S32>>()  // local
                                  .Arg<ffi::Buffer<ffi::PRED>>() // valid
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<std::string_view>("precision")
                                  .Attr<int64_t>("exponent_bits")
                                  .Attr<int64_t>("exponent_bias")
                                  .Attr<int64_t>("num_threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxembedQuantPoolSum,
                              jaxembed::Safe<jaxembed::QuantPoolSumImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()   // data
                                  .Arg<ffi::AnyBuffer>()         // scale
                                  .Arg<ffi::AnyBuffer>()         // bias
                                  .Arg<ffi::Buffer<ffi::S32>>()  // local
                                  .Arg<ffi::Buffer<ffi::PRED>>() // valid
                                  .Arg<ffi::Buffer<ffi::S32>>()  // segments
                                  .Arg<ffi::Buffer<ffi::F32>>()  // weights
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<std::string_view>("precision")
                                  .Attr<int64_t>("exponent_bits")
                                  .Attr<int64_t>("exponent_bias")
                                  .Attr<int64_t>("num_threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxembedQuantPoolMax,
                              jaxembed::Safe<jaxembed::QuantPoolMaxImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()   // data
                                  .Arg<ffi::AnyBuffer>()         // scale
                                  .Arg<ffi::AnyBuffer>()         // bias
                                  .Arg<ffi::Buffer<ffi::S32>>()  // local
                                  .Arg<ffi::Buffer<ffi::PRED>>() // valid
                                  .Arg<ffi::Buffer<ffi::S32>>()  // segments
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<std::string_view>("precision")
                                  .Attr<int64_t>("exponent_bits")
                                  .Attr<int64_t>("exponent_bias")
                                  .Attr<int64_t>("num_threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxembedQuantPoolBags,
                              jaxembed::Safe<jaxembed::QuantPoolBagsImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()   // data
                                  .Arg<ffi::AnyBuffer>()         // scale
                                  .Arg<ffi::AnyBuffer>()         // bias
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ids [G, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lengths [G, B], or [0]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // weights [G, N], or [0]
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<std::string_view>("precision")
                                  .Attr<int64_t>("exponent_bits")
                                  .Attr<int64_t>("exponent_bias")
                                  .Attr<int64_t>("num_threads")
                                  .Attr<std::string_view>("combiner")
                                  .Attr<int64_t>("vocab_size")
                                  .Attr<int64_t>("padding_idx")
                                  .Attr<int64_t>("dense"));
