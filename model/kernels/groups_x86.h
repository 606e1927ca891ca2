// The x86 group kernels (groups.h says what a group kernel computes): AVX2's maddubs + madd, and VNNI's
// vpdpbusd where the CPU has it. Included by groups.h inside its namespace.
#pragma once
#ifdef ES_AVX2

// quantize_row in AVX2 (groups.h: the same bits as quantize_row_portable). max_ps returns its second operand
// when either is NaN, so a NaN |x| leaves the running max, as std::max(amax, |x|) does.
inline void quantize_row_avx2(const float* x, int64_t K, int8_t* qx, float* dx, float* sx, float* sh,
                              int64_t step) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleaving
  auto hsum = [](__m256i v) {
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1)));
  };
  for (int64_t b = 0; b < K / QK; ++b) {
    const float* xb = x + b * QK;
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      m = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), m);
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qx + b * step * QK), _mm256_permutevar8x32_epi32(p, order));
    block_sums(b * step, d, hsum(_mm256_add_epi32(q[0], q[1])), hsum(_mm256_add_epi32(q[2], q[3])), dx, sx, sh);
  }
}

// The 8 outputs of one weight group for R activation rows (R a compile-time count, so the accumulators stay
// in registers): pw [nb, 4, 8] words, d8, m8 [nb, 8]; activation rows K apart, their scales nb apart; out
// gets 8 floats per row, rows ldo apart. The int16 sums cannot overflow: 8 maddubs of at most 2 * 15 * 127.
template <int R>
void group_q4(const int32_t* pw, const float* d8, const float* m8, const int8_t* qx, const float* dx,
              const float* sx, int64_t nb, float* out, int64_t ldo) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    __m256i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pw + (b * 4 + j) * G8));
      const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      for (int r = 0; r < R; ++r) {
        const int8_t* xb = qx + (b * ROWS + r) * QK;
        s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(word(xb + 4 * j))));
        s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(word(xb + 16 + 4 * j))));
      }
    }
    const __m256 d = _mm256_loadu_ps(d8 + b * G8), m = _mm256_loadu_ps(m8 + b * G8);
    for (int r = 0; r < R; ++r) {
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[r], ones));
      acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(dx[b * ROWS + r])), acc[r]);
      acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[b * ROWS + r]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo, acc[r]);
}

// The same for q8: pw [nb, 8, 8] words of signed bytes, d8 [nb * S, 8] with S scales per block (1, or 2 when
// each half block of 16 has its own: words 0..3 are the first half); when A (affine), m8 [nb * S, 8] offsets and
// ss the activations' sums per scale, S per block, rows nb * S apart. maddubs takes |w| times x with w's sign; a
// pair of products reaches 2 * 127 * 127, so each maddubs is widened to int32 before adding.
template <int R, int S, bool A>
void group_q8(const int32_t* pw, const float* d8, const float* m8, const int8_t* qx, const float* dx,
              const float* ss, int64_t nb, float* out, int64_t ldo) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    __m256i s[S][R];
    for (int h = 0; h < S; ++h)
      for (int r = 0; r < R; ++r) s[h][r] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pw + (b * 8 + j) * G8));
      const __m256i a = _mm256_sign_epi8(v, v);  // |w| (w = -128 never occurs: |q| <= 127)
      for (int r = 0; r < R; ++r) {
        const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(word(qx + (b * ROWS + r) * QK + 4 * j)), v);
        __m256i& acc_s = s[j * S / 8][r];
        acc_s = _mm256_add_epi32(acc_s, _mm256_madd_epi16(_mm256_maddubs_epi16(a, x), ones));
      }
    }
    for (int h = 0; h < S; ++h) {
      const __m256 d = _mm256_loadu_ps(d8 + (b * S + h) * G8);
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[h][r]), _mm256_mul_ps(d, _mm256_set1_ps(dx[b * ROWS + r])),
                                 acc[r]);
        if constexpr (A)
          acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(m8 + (b * S + h) * G8), _mm256_set1_ps(ss[(b * ROWS + r) * S + h]),
                                   acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo, acc[r]);
}

#ifdef ES_VNNI
// independent int32 sums per row in a VNNI kernel's block: one chain of 8 vpdpbusd (4-5 cycles each) per block
// would bound a pass of 1 or 2 rows by latency where maddubs' int16 adds take a cycle, so fewer rows take more
// chains, added at the block's end (exact, so the order is free). A reasoned choice: on the shared 2-core EPYC
// it was written on, one row measured 1.04x AVX2's time with one chain and with four alike.
template <int R>
constexpr int chains() { return R == 1 ? 4 : R == 2 ? 2 : 1; }

// VNNI: vpdpbusd multiplies unsigned bytes by signed bytes and adds each lane's 4 products into its int32, in
// place of maddubs + madd + add (three instructions, and an int16 step): the same exact integer dot per block,
// so the same float steps after it, and one instruction per 4 products instead of two or three, which is what
// lets a group take up to 8 rows at once (ROWS) for little more than the cost of reading its weights.
// Tried and dropped: a 512-bit kernel over two weight groups at once (16 outputs per vpdpbusd, half the
// broadcasts): on this Zen 4 EPYC, which runs a 512-bit op as two 256-bit halves, the layer matmuls took 8.4 ms
// at one row against 6.1 for these 256-bit kernels, 13.2 against 11.0 at eight (one thread, same run).
template <int R>
void group_q4_vnni(const int32_t* pw, const float* d8, const float* m8, const int8_t* qx, const float* dx,
                   const float* sx, int64_t nb, float* out, int64_t ldo) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    constexpr int C = chains<R>();
    __m256i s[C][R];
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < R; ++r) s[c][r] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pw + (b * 4 + j) * G8));
      const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      for (int r = 0; r < R; ++r) {
        const int8_t* xb = qx + (b * ROWS + r) * QK;
        s[(2 * j) % C][r] = dpbusd(s[(2 * j) % C][r], lo, _mm256_set1_epi32(word(xb + 4 * j)));
        s[(2 * j + 1) % C][r] = dpbusd(s[(2 * j + 1) % C][r], hi, _mm256_set1_epi32(word(xb + 16 + 4 * j)));
      }
    }
    for (int c = 1; c < C; ++c)
      for (int r = 0; r < R; ++r) s[0][r] = _mm256_add_epi32(s[0][r], s[c][r]);
    const __m256 d = _mm256_loadu_ps(d8 + b * G8), m = _mm256_loadu_ps(m8 + b * G8);
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[0][r]), _mm256_mul_ps(d, _mm256_set1_ps(dx[b * ROWS + r])), acc[r]);
      acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[b * ROWS + r]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo, acc[r]);
}

// q8's weights are signed, so the activations go in as the unsigned bytes ux = qx + 128 (qx ^ 0x80, made once
// per pass): <w, ux> = <w, qx> + 128 sum(w), and 128 sum(w), one vpdpbusd per word for all the rows, is taken
// off (exact in int32: |<w, ux>| <= 32 * 127 * 255). That is one instruction per row and word where the sign
// trick (|w| times x with w's sign) takes two.
template <int R, int S, bool A>
void group_q8_vnni(const int32_t* pw, const float* d8, const float* m8, const uint8_t* ux, const float* dx,
                   const float* ss, int64_t nb, float* out, int64_t ldo) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < nb; ++b) {
    // chains: C per scale (words 0..3 of a half block alternate over them when S = 2, 0..7 when S = 1)
    constexpr int C = S == 1 ? chains<R>() : std::max(1, chains<R>() / 2);
    __m256i s[S][C][R], c[S][C];
    for (int h = 0; h < S; ++h)
      for (int k = 0; k < C; ++k) {
        c[h][k] = _mm256_setzero_si256();
        for (int r = 0; r < R; ++r) s[h][k][r] = _mm256_setzero_si256();
      }
    for (int j = 0; j < 8; ++j) {
      const int h = j * S / 8, k = j % C;
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pw + (b * 8 + j) * G8));
      c[h][k] = dpbusd(c[h][k], bias, v);
      for (int r = 0; r < R; ++r) {
        const int8_t* xb = reinterpret_cast<const int8_t*>(ux + (b * ROWS + r) * QK);
        s[h][k][r] = dpbusd(s[h][k][r], _mm256_set1_epi32(word(xb + 4 * j)), v);
      }
    }
    for (int h = 0; h < S; ++h)
      for (int k = 1; k < C; ++k) {
        c[h][0] = _mm256_add_epi32(c[h][0], c[h][k]);
        for (int r = 0; r < R; ++r) s[h][0][r] = _mm256_add_epi32(s[h][0][r], s[h][k][r]);
      }
    for (int h = 0; h < S; ++h) {
      const __m256 d = _mm256_loadu_ps(d8 + (b * S + h) * G8);
      for (int r = 0; r < R; ++r) {
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_sub_epi32(s[h][0][r], c[h][0]));
        acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(dx[b * ROWS + r])), acc[r]);
        if constexpr (A)
          acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(m8 + (b * S + h) * G8), _mm256_set1_ps(ss[(b * ROWS + r) * S + h]),
                                   acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo, acc[r]);
}
#endif  // ES_VNNI

#endif  // ES_AVX2
