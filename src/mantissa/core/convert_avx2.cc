// AVX2 + F16C conversion kernels. Every function carries a target attribute rather than the file
// being compiled with -mavx2, so nothing here leaks AVX2 code into shared inline functions.
//
// Results are bit-identical to the scalar reference (convert_kernels.h): the generic encoders
// below are the scalar algorithm of float_formats.h written over 8 lanes, with the same shifts
// (vpsrlvd/vpsllvd give 0 for counts >= 32, as detail::shr does). FP16 round-to-nearest uses the
// F16C instruction; BF16 uses the classic add-and-truncate trick; decoding FP8 goes through F16C.
#include <immintrin.h>

#include <algorithm>
#include <climits>
#include <cstring>

#include "mantissa/core/convert_kernels.h"

#define MANTISSA_AVX2 __attribute__((target("avx2,f16c,fma")))

namespace mantissa::detail {
namespace {

MANTISSA_AVX2 inline __m256i set1(uint32_t v) { return _mm256_set1_epi32(static_cast<int>(v)); }

// Unsigned a < b, lane-wise, as an all-ones mask.
MANTISSA_AVX2 inline __m256i ult(__m256i a, __m256i b) {
  const __m256i bias = set1(0x80000000u);
  return _mm256_cmpgt_epi32(_mm256_xor_si256(b, bias), _mm256_xor_si256(a, bias));
}

// Lanes of FP32 bits unpacked as in detail::unpack: significand with implicit bit, exponent.
struct UnpackedV {
  __m256i a;     // magnitude bits
  __m256i sign;  // sign moved to the format's sign position
  __m256i m;
  __m256i e;
};

template <FloatFormat F>
MANTISSA_AVX2 inline UnpackedV unpack_v(__m256i b) {
  UnpackedV u;
  u.a = _mm256_and_si256(b, set1(0x7fffffffu));
  u.sign = _mm256_slli_epi32(_mm256_srli_epi32(b, 31), F.total_bits() - 1);
  const __m256i expf = _mm256_srli_epi32(u.a, 23);
  const __m256i normal = _mm256_cmpgt_epi32(expf, _mm256_setzero_si256());
  u.m = _mm256_or_si256(_mm256_and_si256(u.a, set1(0x7fffffu)),
                        _mm256_and_si256(normal, set1(0x800000u)));
  u.e = _mm256_sub_epi32(_mm256_max_epi32(expf, set1(1)), set1(127));
  return u;
}

template <FloatFormat F>
MANTISSA_AVX2 inline __m256i dropped_bits_v(__m256i e) {
  return _mm256_add_epi32(
      set1(23 - F.man_bits),
      _mm256_max_epi32(_mm256_sub_epi32(set1(F.emin()), e), _mm256_setzero_si256()));
}

template <FloatFormat F>
MANTISSA_AVX2 inline __m256i assemble_v(__m256i e, __m256i q) {
  const __m256i eoff =
      _mm256_max_epi32(_mm256_sub_epi32(e, set1(F.emin())), _mm256_setzero_si256());
  return _mm256_add_epi32(_mm256_slli_epi32(eoff, F.man_bits), q);
}

// encode_rne<F> over 8 lanes.
template <FloatFormat F>
MANTISSA_AVX2 inline __m256i encode_rne_v(__m256i b, bool saturate) {
  const UnpackedV u = unpack_v<F>(b);
  const __m256i one = set1(1);
  const __m256i d = _mm256_min_epi32(dropped_bits_v<F>(u.e), set1(31));
  const __m256i half_minus_1 =
      _mm256_sub_epi32(_mm256_sllv_epi32(one, _mm256_sub_epi32(d, one)), one);
  const __m256i lsb = _mm256_and_si256(_mm256_srlv_epi32(u.m, d), one);
  const __m256i q =
      _mm256_srlv_epi32(_mm256_add_epi32(_mm256_add_epi32(u.m, half_minus_1), lsb), d);
  __m256i enc = assemble_v<F>(u.e, q);
  const __m256i over = _mm256_cmpgt_epi32(enc, set1(F.max_finite_bits()));
  enc = _mm256_blendv_epi8(enc, set1(saturate ? F.max_finite_bits() : F.overflow_bits()), over);
  __m256i nan_enc;
  if constexpr (F.ieee_nan) {
    nan_enc =
        _mm256_or_si256(set1(F.exp_mask() | (1u << (F.man_bits - 1))),
                        _mm256_srli_epi32(_mm256_and_si256(u.a, set1(0x7fffffu)), 23 - F.man_bits));
  } else {
    nan_enc = set1(F.magnitude_mask());
  }
  enc = _mm256_blendv_epi8(enc, nan_enc, _mm256_cmpgt_epi32(u.a, set1(0x7f800000u)));
  return _mm256_or_si256(u.sign, enc);
}

// encode_stochastic<F> over 8 lanes with 8 random words.
template <FloatFormat F>
MANTISSA_AVX2 inline __m256i encode_sr_v(__m256i b, __m256i r, bool saturate) {
  const UnpackedV u = unpack_v<F>(b);
  const __m256i d = dropped_bits_v<F>(u.e);
  const __m256i q = _mm256_srlv_epi32(u.m, d);
  const __m256i rem = _mm256_sub_epi32(u.m, _mm256_sllv_epi32(q, d));
  const __m256i up_small = ult(_mm256_srlv_epi32(r, _mm256_sub_epi32(set1(32), d)), rem);
  const __m256i up_tiny = ult(r, _mm256_srlv_epi32(u.m, _mm256_sub_epi32(d, set1(32))));
  const __m256i up = _mm256_and_si256(
      _mm256_blendv_epi8(up_small, up_tiny, _mm256_cmpgt_epi32(d, set1(32))), set1(1));
  const __m256i sr = _mm256_or_si256(u.sign, assemble_v<F>(u.e, _mm256_add_epi32(q, up)));
  // Inputs past the largest finite value (NaN and inf included) round to nearest; rare, so the
  // nearest-even encoding is only computed when some lane needs it.
  const __m256i beyond = _mm256_cmpgt_epi32(u.a, set1(max_finite_f32_bits<F>()));
  if (_mm256_testz_si256(beyond, beyond)) return sr;
  return _mm256_blendv_epi8(sr, encode_rne_v<F>(b, saturate), beyond);
}

// Philox-4x32-10 over 8 consecutive blocks at once, one per lane.
MANTISSA_AVX2 inline void mulhilo_v(__m256i a, uint32_t mult, __m256i& hi, __m256i& lo) {
  const __m256i m = set1(mult);
  const __m256i even = _mm256_mul_epu32(a, m);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
  lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

// Philox state of 8 blocks, one per lane: c[w] holds counter word w.
struct Philox8State {
  __m256i c[4];
};

MANTISSA_AVX2 inline Philox8State philox8_init(uint64_t first_block, uint64_t stream) {
  return {{_mm256_add_epi32(set1(static_cast<uint32_t>(first_block)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
           set1(static_cast<uint32_t>(first_block >> 32)), set1(static_cast<uint32_t>(stream)),
           set1(static_cast<uint32_t>(stream >> 32))}};
}

MANTISSA_AVX2 inline void philox8_round(Philox8State& s, __m256i k0, __m256i k1) {
  __m256i hi0, lo0, hi1, lo1;
  mulhilo_v(s.c[0], kPhiloxM0, hi0, lo0);
  mulhilo_v(s.c[2], kPhiloxM1, hi1, lo1);
  s.c[0] = _mm256_xor_si256(_mm256_xor_si256(hi1, s.c[1]), k0);
  s.c[1] = lo1;
  s.c[2] = _mm256_xor_si256(_mm256_xor_si256(hi0, s.c[3]), k1);
  s.c[3] = lo0;
}

// Words w of blocks 0..7 into element order: out[j] = random words of elements 8j..8j+7.
MANTISSA_AVX2 inline void philox8_transpose(const Philox8State& s, __m256i out[4]) {
  const __m256i t0 = _mm256_unpacklo_epi32(s.c[0], s.c[1]),
                t1 = _mm256_unpacklo_epi32(s.c[2], s.c[3]);
  const __m256i t2 = _mm256_unpackhi_epi32(s.c[0], s.c[1]),
                t3 = _mm256_unpackhi_epi32(s.c[2], s.c[3]);
  const __m256i u0 = _mm256_unpacklo_epi64(t0, t1), u1 = _mm256_unpackhi_epi64(t0, t1);
  const __m256i u2 = _mm256_unpacklo_epi64(t2, t3), u3 = _mm256_unpackhi_epi64(t2, t3);
  out[0] = _mm256_permute2x128_si256(u0, u1, 0x20);
  out[1] = _mm256_permute2x128_si256(u2, u3, 0x20);
  out[2] = _mm256_permute2x128_si256(u0, u1, 0x31);
  out[3] = _mm256_permute2x128_si256(u2, u3, 0x31);
}

// Philox-4x32-10 for 16 consecutive blocks (64 elements) as two interleaved 8-block states: the
// ten rounds are a dependency chain of multiplies, and two chains keep the multipliers busy.
MANTISSA_AVX2 inline void philox16(uint64_t first_block, uint64_t stream, uint64_t seed,
                                   __m256i out[8]) {
  Philox8State a = philox8_init(first_block, stream), b = philox8_init(first_block + 8, stream);
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
    const __m256i vk0 = set1(k0), vk1 = set1(k1);
    philox8_round(a, vk0, vk1);
    philox8_round(b, vk0, vk1);
  }
  philox8_transpose(a, out);
  philox8_transpose(b, out + 4);
}

// Stores 4x8 encoded lanes (each < 2^16, or < 2^8) as 32 consecutive 16- or 8-bit values.
MANTISSA_AVX2 inline void store32(uint16_t* dst, const __m256i v[4]) {
  const __m256i ab = _mm256_permute4x64_epi64(_mm256_packus_epi32(v[0], v[1]), 0xD8);
  const __m256i cd = _mm256_permute4x64_epi64(_mm256_packus_epi32(v[2], v[3]), 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), ab);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16), cd);
}
MANTISSA_AVX2 inline void store32(uint8_t* dst, const __m256i v[4]) {
  const __m256i ab = _mm256_packus_epi32(v[0], v[1]);
  const __m256i cd = _mm256_packus_epi32(v[2], v[3]);
  const __m256i bytes = _mm256_packus_epi16(ab, cd);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permutevar8x32_epi32(bytes, order));
}

MANTISSA_AVX2 inline __m256i load_bits(const float* p) {
  return _mm256_castps_si256(_mm256_loadu_ps(p));
}

// ---- FP32 -> narrow ----------------------------------------------------------------------------

// Eight FP32 values (as bits) to FP16 or BF16 by nearest even, as 32-bit lanes (each < 2^16).
template <FloatFormat F>
MANTISSA_AVX2 inline __m256i rne16_v(__m256i b, bool saturate) {
  if constexpr (F.exp_bits == kF16Format.exp_bits && F.man_bits == kF16Format.man_bits) {
    // F16C rounds to nearest even exactly; saturation clamps first (NaN passes through min/max
    // as the second operand).
    __m256 x = _mm256_castsi256_ps(b);
    if (saturate)
      x = _mm256_max_ps(_mm256_set1_ps(-65504.0f), _mm256_min_ps(_mm256_set1_ps(65504.0f), x));
    return _mm256_cvtepu16_epi32(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    static_assert(F.exp_bits == kBF16Format.exp_bits && F.man_bits == kBF16Format.man_bits);
    // BF16 is the top half of FP32: add 0x7fff plus the lowest kept bit, truncate. A carry past
    // the largest finite value lands exactly on infinity.
    const __m256i one = set1(1);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), one);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, set1(0x7fffu)), lsb), 16);
    const __m256i a = _mm256_and_si256(b, set1(0x7fffffffu));
    if (saturate) {
      const __m256i over = _mm256_cmpeq_epi32(_mm256_and_si256(r, set1(0x7fffu)), set1(0x7f80u));
      r = _mm256_blendv_epi8(r, _mm256_sub_epi32(r, one), over);
    }
    const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(b, 16), set1(0x40u));
    return _mm256_blendv_epi8(r, nan, _mm256_cmpgt_epi32(a, set1(0x7f800000u)));
  }
}

// Stores 8 lanes (each < 2^16) as 8 consecutive 16-bit values.
MANTISSA_AVX2 inline void store8(uint16_t* dst, __m256i v) {
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(packed));
}

template <FloatFormat F, typename Storage>
MANTISSA_AVX2 void from_f32_rne(const float* src, Storage* dst, size_t n, const CastOptions& opt) {
  size_t i = 0;
  if constexpr (sizeof(Storage) == 2) {
    // FP16 and BF16: eight at a time, and the last one to seven through a zero-padded block, so
    // that a kernel's short rows (a 59-wide output row: 7 blocks and 3) never take the scalar
    // loop. Every lane is rounded on its own: the same bits as the scalar encoder.
    for (; i + 8 <= n; i += 8) store8(dst + i, rne16_v<F>(load_bits(src + i), opt.saturate));
    if (i < n) {
      alignas(32) float in[8] = {};
      alignas(16) uint16_t out[8];
      std::memcpy(in, src + i, (n - i) * sizeof(float));
      store8(out, rne16_v<F>(load_bits(in), opt.saturate));
      std::memcpy(dst + i, out, (n - i) * sizeof(uint16_t));
    }
  } else {
    for (; i + 32 <= n; i += 32) {
      __m256i v[4];
      for (int j = 0; j < 4; ++j) v[j] = encode_rne_v<F>(load_bits(src + i + 8 * j), opt.saturate);
      store32(dst + i, v);
    }
    CastOptions tail = opt;
    tail.index = opt.index + i;
    scalar_from_f32<F>(src + i, dst + i, n - i, tail);
  }
}

template <FloatFormat F, typename Storage>
MANTISSA_AVX2 void from_f32_sr(const float* src, Storage* dst, size_t n, const CastOptions& opt) {
  // Scalar until the element index is a multiple of 4, so that 64 elements are 16 whole blocks.
  size_t i = std::min<size_t>(n, (4 - (opt.index & 3)) & 3);
  scalar_from_f32<F>(src, dst, i, opt);
  CastOptions o = opt;
  for (; i + 64 <= n; i += 64) {
    const uint64_t block = (opt.index + i) >> 2;
    if (static_cast<uint32_t>(block) > 0xFFFFFFFFu - 15u) {  // the low counter word would carry
      o.index = opt.index + i;
      scalar_from_f32<F>(src + i, dst + i, 64, o);
      continue;
    }
    __m256i r[8], v[8];
    philox16(block, opt.stream, opt.seed, r);
    for (int j = 0; j < 8; ++j)
      v[j] = encode_sr_v<F>(load_bits(src + i + 8 * j), r[j], opt.saturate);
    store32(dst + i, v);
    store32(dst + i + 32, v + 4);
  }
  o.index = opt.index + i;
  scalar_from_f32<F>(src + i, dst + i, n - i, o);
}

template <FloatFormat F, typename Storage>
MANTISSA_AVX2 void from_f32(const float* src, void* dst, size_t n, const CastOptions& opt) {
  if (opt.rounding == Rounding::kStochastic)
    from_f32_sr<F>(src, static_cast<Storage*>(dst), n, opt);
  else
    from_f32_rne<F>(src, static_cast<Storage*>(dst), n, opt);
}

// ---- narrow -> FP32 ----------------------------------------------------------------------------

// Eight FP16 or BF16 values widened to FP32 (exactly).
MANTISSA_AVX2 inline __m256 f16_to_f32_v(const uint16_t* src) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
}
MANTISSA_AVX2 inline __m256 bf16_to_f32_v(const uint16_t* src) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// Eight at a time, and the last one to seven through a zero-padded block (as from_f32_rne).
template <__m256 (*Widen)(const uint16_t*)>
MANTISSA_AVX2 inline void widen16(const void* src_v, float* dst, size_t n) {
  const uint16_t* src = static_cast<const uint16_t*>(src_v);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, Widen(src + i));
  if (i < n) {
    alignas(16) uint16_t in[8] = {};
    alignas(32) float out[8];
    std::memcpy(in, src + i, (n - i) * sizeof(uint16_t));
    _mm256_store_ps(out, Widen(in));
    std::memcpy(dst + i, out, (n - i) * sizeof(float));
  }
}

MANTISSA_AVX2 void f16_to_f32(const void* src, float* dst, size_t n) {
  widen16<f16_to_f32_v>(src, dst, n);
}
MANTISSA_AVX2 void bf16_to_f32(const void* src, float* dst, size_t n) {
  widen16<bf16_to_f32_v>(src, dst, n);
}

// E5M2 is the top byte of an FP16: shift and let F16C decode it.
MANTISSA_AVX2 void e5m2_to_f32(const void* src_v, float* dst, size_t n) {
  const uint8_t* src = static_cast<const uint8_t*>(src_v);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_slli_epi16(
        _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i))), 8);
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  scalar_to_f32<kE5M2Format>(src + i, dst + i, n - i);
}

// E4M3's magnitude shifted into an FP16 is its value times 2^-8 (exponent bias 15 against 7, and
// the subnormals line up too); multiply back exactly, and patch the one NaN pattern.
MANTISSA_AVX2 void e4m3_to_f32(const void* src_v, float* dst, size_t n) {
  const uint8_t* src = static_cast<const uint8_t*>(src_v);
  size_t i = 0;
  const __m256 scale = _mm256_set1_ps(256.0f);
  for (; i + 8 <= n; i += 8) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)));
    const __m128i mag = _mm_and_si128(b, _mm_set1_epi16(0x7f));
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8);
    const __m128i h = _mm_or_si128(sign, _mm_slli_epi16(mag, 7));
    const __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(h), scale);
    const __m256i is_nan = _mm256_cvtepi16_epi32(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f)));
    const __m256i nan = _mm256_or_si256(_mm256_cvtepi16_epi32(sign), set1(0x7fc00000u));
    // cvtepi16 sign-extends 0x8000 to 0xffff8000: keep only bit 31 of it.
    const __m256i nan_bits = _mm256_and_si256(nan, set1(0xffc00000u));
    _mm256_storeu_ps(
        dst + i, _mm256_blendv_ps(v, _mm256_castsi256_ps(nan_bits), _mm256_castsi256_ps(is_nan)));
  }
  scalar_to_f32<kE4M3Format>(src + i, dst + i, n - i);
}

}  // namespace

const ConvertKernels& avx2_kernels() {
  static const ConvertKernels k{
      {from_f32<kF16Format, uint16_t>, from_f32<kBF16Format, uint16_t>,
       from_f32<kE4M3Format, uint8_t>, from_f32<kE5M2Format, uint8_t>},
      {f16_to_f32, bf16_to_f32, e4m3_to_f32, e5m2_to_f32},
  };
  return k;
}

}  // namespace mantissa::detail
