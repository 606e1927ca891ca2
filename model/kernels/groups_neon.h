// The aarch64 group kernels (groups.h says what a group kernel computes): a group's 8 outputs are two 128-bit
// vectors of 4, a 16-byte load holds word j of 4 rows, and the activations' word is broadcast to all four
// lanes. With the dot product extension (the Pi 5's Cortex-A76) one sdot adds each lane's 4 products into its
// int32; without it (the Pi 4's Cortex-A72) smull widens the products to int16 (|q4 x| <= 15 * 127,
// |q8 x| <= 127 * 127: no overflow) and sadalp adds their pairs into int32, the pairs of pairs at the block's end.
// The integer dot is exact either way, so the float steps after it are the portable ones, lane for lane.
// Included by groups.h inside its namespace.
#pragma once
#ifdef ES_NEON

// The int32 dots of 4 weight rows (16 bytes: word j of each) with one activation word broadcast, over a block.
struct Dot4 {
#ifdef ES_DOTPROD
  int32x4_t s = vdupq_n_s32(0);
  void add(int8x16_t w, int8x16_t x) { s = vdotq_s32(s, w, x); }
  int32x4_t sum() const { return s; }
#else
  int32x4_t lo = vdupq_n_s32(0), hi = vdupq_n_s32(0);  // pairs of products: rows 0-1, rows 2-3
  void add(int8x16_t w, int8x16_t x) {
    lo = vpadalq_s16(lo, vmull_s8(vget_low_s8(w), vget_low_s8(x)));
    hi = vpadalq_s16(hi, vmull_high_s8(w, x));
  }
  int32x4_t sum() const { return vpaddq_s32(lo, hi); }
#endif
};

// quantize_row in NEON (groups.h: the same bits as quantize_row_portable): vmaxnm returns the number when the
// other operand is NaN, as std::max(amax, |x|) keeps amax; fcvtns rounds to nearest even, as nearbyint does.
inline void quantize_row_neon(const float* x, int64_t K, int8_t* qx, float* dx, float* sx, float* sh,
                              int64_t step) {
  for (int64_t b = 0; b < K / QK; ++b) {
    const float* xb = x + b * QK;
    float32x4_t v[8], m = vdupq_n_f32(0.f);
    for (int i = 0; i < 8; ++i) {
      v[i] = vld1q_f32(xb + 4 * i);
      m = vmaxnmq_f32(m, vabsq_f32(v[i]));
    }
    const float d = vmaxnmvq_f32(m) / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    int32x4_t q[8];
    for (int i = 0; i < 8; ++i) q[i] = vcvtnq_s32_f32(vmulq_n_f32(v[i], id));
    int16x8_t p[4];
    for (int i = 0; i < 4; ++i) p[i] = vcombine_s16(vqmovn_s32(q[2 * i]), vqmovn_s32(q[2 * i + 1]));
    vst1q_s8(qx + b * step * QK, vcombine_s8(vqmovn_s16(p[0]), vqmovn_s16(p[1])));
    vst1q_s8(qx + b * step * QK + 16, vcombine_s8(vqmovn_s16(p[2]), vqmovn_s16(p[3])));
    const int lo = vaddvq_s32(vaddq_s32(vaddq_s32(q[0], q[1]), vaddq_s32(q[2], q[3])));
    const int hi = vaddvq_s32(vaddq_s32(vaddq_s32(q[4], q[5]), vaddq_s32(q[6], q[7])));
    block_sums(b * step, d, lo, hi, dx, sx, sh);
  }
}

// a word of 4 activation bytes in every lane
inline int8x16_t broadcast(const int8_t* p) { return vreinterpretq_s8_s32(vdupq_n_s32(word(p))); }

template <int R>
void group_q4_neon(const int32_t* pw, const float* d8, const float* m8, const int8_t* qx, const float* dx,
                   const float* sx, int64_t nb, float* out, int64_t ldo) {
  float32x4_t acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vdupq_n_f32(0.f);
  const uint8x16_t low = vdupq_n_u8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    Dot4 s[R][2];
    for (int j = 0; j < 4; ++j) {
      const uint8_t* p = reinterpret_cast<const uint8_t*>(pw + (b * 4 + j) * G8);
      int8x16_t lo[2], hi[2];  // rows 0-3 and 4-7: low nibbles (elements 4j..), high (16 + 4j..)
      for (int h = 0; h < 2; ++h) {
        const uint8x16_t v = vld1q_u8(p + 16 * h);
        lo[h] = vreinterpretq_s8_u8(vandq_u8(v, low));
        hi[h] = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* xb = qx + (b * ROWS + r) * QK;
        const int8x16_t xl = broadcast(xb + 4 * j), xh = broadcast(xb + 16 + 4 * j);
        for (int h = 0; h < 2; ++h) {
          s[r][h].add(lo[h], xl);
          s[r][h].add(hi[h], xh);
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const float32x4_t d = vld1q_f32(d8 + b * G8 + 4 * h), m = vld1q_f32(m8 + b * G8 + 4 * h);
      for (int r = 0; r < R; ++r) {
        acc[r][h] = vfmaq_f32(acc[r][h], vcvtq_f32_s32(s[r][h].sum()), vmulq_n_f32(d, dx[b * ROWS + r]));
        acc[r][h] = vfmaq_f32(acc[r][h], m, vdupq_n_f32(sx[b * ROWS + r]));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    vst1q_f32(out + r * ldo, acc[r][0]);
    vst1q_f32(out + r * ldo + 4, acc[r][1]);
  }
}

template <int R, int S, bool A>
void group_q8_neon(const int32_t* pw, const float* d8, const float* m8, const int8_t* qx, const float* dx,
                   const float* ss, int64_t nb, float* out, int64_t ldo) {
  float32x4_t acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vdupq_n_f32(0.f);
  for (int64_t b = 0; b < nb; ++b) {
    Dot4 s[S][R][2];
    for (int j = 0; j < 8; ++j) {
      const int8_t* p = reinterpret_cast<const int8_t*>(pw + (b * 8 + j) * G8);
      const int8x16_t w[2] = {vld1q_s8(p), vld1q_s8(p + 16)};
      for (int r = 0; r < R; ++r) {
        const int8x16_t x = broadcast(qx + (b * ROWS + r) * QK + 4 * j);
        for (int h = 0; h < 2; ++h) s[j * S / 8][r][h].add(w[h], x);
      }
    }
    for (int k = 0; k < S; ++k)
      for (int h = 0; h < 2; ++h) {
        const float32x4_t d = vld1q_f32(d8 + (b * S + k) * G8 + 4 * h);
        for (int r = 0; r < R; ++r) {
          acc[r][h] = vfmaq_f32(acc[r][h], vcvtq_f32_s32(s[k][r][h].sum()), vmulq_n_f32(d, dx[b * ROWS + r]));
          if constexpr (A)
            acc[r][h] = vfmaq_f32(acc[r][h], vld1q_f32(m8 + (b * S + k) * G8 + 4 * h),
                                  vdupq_n_f32(ss[(b * ROWS + r) * S + k]));
        }
      }
  }
  for (int r = 0; r < R; ++r) {
    vst1q_f32(out + r * ldo, acc[r][0]);
    vst1q_f32(out + r * ldo + 4, acc[r][1]);
  }
}

#endif  // ES_NEON
