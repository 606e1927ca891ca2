// The KV cache's storage formats (model/kv_format.py says what each stores): how a stored head vector reads
// as floats, and how a float head vector is written. A pool's tensors [N, n_kv, BS, row] tell their format by
// dtype: float32 (row = hd), float16 (row = hd) or uint8 q8_0 (row = hd / 32 * 34: per 32 values a half scale d
// then 32 int8 q, value d * q). Readers give every value as one float (widened, or one rounded product), the
// same in the scalar and the 8-lane form, and attention computes with those floats exactly as with a float32
// cache; writing converts each head vector on its own (the pass shape never changes what a slot holds).
#pragma once
#include "common.h"

#include <c10/util/Half.h>

enum class KVKind { F32, F16, Q8_0 };
constexpr int64_t KV_Q8_BLOCK = 32, KV_Q8_BYTES = 34;

inline float half_bits_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// a head vector's bytes, and its floats by index i (the 8-lane load8 takes i % 8 == 0, the 16-lane load16 of a
// build with 512-bit kernels i % 16 == 0)
struct KVF32 {
  static int64_t bytes(int64_t hd) { return 4 * hd; }
  static float at(const uint8_t* row, int64_t i) { return reinterpret_cast<const float*>(row)[i]; }
#ifdef ES_AVX2
  static __m256 load8(const uint8_t* row, int64_t i) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + i);
  }
#endif
#ifdef ES_ZMM_FLOAT
  static __m512 load16(const uint8_t* row, int64_t i) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(row) + i);
  }
#endif
};

struct KVF16 {
  static int64_t bytes(int64_t hd) { return 2 * hd; }
  static float at(const uint8_t* row, int64_t i) { return half_bits_to_float(row + 2 * i); }
#ifdef ES_AVX2
  static __m256 load8(const uint8_t* row, int64_t i) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * i)));
  }
#endif
#ifdef ES_ZMM_FLOAT
  static __m512 load16(const uint8_t* row, int64_t i) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * i)));
  }
#endif
};

struct KVQ8 {
  static int64_t bytes(int64_t hd) { return hd / KV_Q8_BLOCK * KV_Q8_BYTES; }
  static float at(const uint8_t* row, int64_t i) {
    const uint8_t* b = row + i / KV_Q8_BLOCK * KV_Q8_BYTES;
    return half_bits_to_float(b) * static_cast<float>(static_cast<int8_t>(b[2 + i % KV_Q8_BLOCK]));
  }
#ifdef ES_AVX2
  static __m256 load8(const uint8_t* row, int64_t i) {
    const uint8_t* b = row + i / KV_Q8_BLOCK * KV_Q8_BYTES;
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + i % KV_Q8_BLOCK));
    return _mm256_mul_ps(_mm256_set1_ps(half_bits_to_float(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
  }
#endif
#ifdef ES_ZMM_FLOAT
  static __m512 load16(const uint8_t* row, int64_t i) {  // i % 16 == 0: the 16 values sit in one block
    const uint8_t* b = row + i / KV_Q8_BLOCK * KV_Q8_BYTES;
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + i % KV_Q8_BLOCK));
    return _mm512_mul_ps(_mm512_set1_ps(half_bits_to_float(b)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
  }
#endif
};

// The format of a pool's tensor of head vectors of hd floats (a TORCH_CHECK names what does not fit)
inline KVKind kv_kind(const at::Tensor& store, int64_t hd) {
  switch (store.scalar_type()) {
    case at::kFloat:
      TORCH_CHECK(store.size(-1) == hd, "a float32 KV row must hold ", hd, " values, not ", store.size(-1));
      return KVKind::F32;
    case at::kHalf:
      TORCH_CHECK(store.size(-1) == hd, "a float16 KV row must hold ", hd, " values, not ", store.size(-1));
      return KVKind::F16;
    case at::kByte:
      TORCH_CHECK(hd % KV_Q8_BLOCK == 0 && store.size(-1) == hd / KV_Q8_BLOCK * KV_Q8_BYTES,
                  "a q8_0 KV row of ", hd, " values is ", hd / KV_Q8_BLOCK * KV_Q8_BYTES, " bytes, not ", store.size(-1));
      return KVKind::Q8_0;
    default:
      TORCH_CHECK(false, "KV storage must be float32, float16 or uint8 (q8_0), not ", store.scalar_type());
  }
}

// x [hd] floats -> one stored head vector at out, converted as model/kv_format.py's encode: float16 rounded to
// nearest even; q8_0 per 32 values d = max|x| / 127, q = nearbyint(x * (1 / d)) (0 where d is 0), d as a half
inline void kv_write(KVKind kind, const float* x, int64_t hd, uint8_t* out) {
  if (kind == KVKind::F32) {
    std::memcpy(out, x, hd * sizeof(float));
  } else if (kind == KVKind::F16) {
    int64_t i = 0;
#ifdef ES_AVX2
    // 8 at a time: vcvtps2ph rounds to nearest even as c10::Half's conversion does (which this build compiles to
    // the same instruction, one value at a time: 40% of a 16-row decode pass's serial rotary and KV writes)
    for (; i + 8 <= hd; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; i < hd; ++i) {
      const uint16_t bits = c10::Half(x[i]).x;
      std::memcpy(out + 2 * i, &bits, 2);
    }
  } else {
    for (int64_t b = 0; b < hd / KV_Q8_BLOCK; ++b) {
      const float* xb = x + b * KV_Q8_BLOCK;
      uint8_t* ob = out + b * KV_Q8_BYTES;
      float amax = 0.f;
      for (int64_t i = 0; i < KV_Q8_BLOCK; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float d = amax / 127.f, inv = d != 0.f ? 1.f / d : 0.f;
      const uint16_t bits = c10::Half(d).x;
      std::memcpy(ob, &bits, 2);
      for (int64_t i = 0; i < KV_Q8_BLOCK; ++i)
        ob[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(std::clamp(std::nearbyint(xb[i] * inv), -127.f, 127.f)));
    }
  }
}
