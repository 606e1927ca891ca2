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

// The weights of block b + D fetched while block b is computed (D = AHEAD; the AMX kernels' AMX_AHEAD,
// groups_amx.h): its W words at pw and S scales at d8 and m8 (m8 may be null), per block as a group's kernel reads
// them, in G groups `gw` words and `gs` scales apart; prefetches past the end fault nothing. A pass of several rows
// computes long enough on each block that the hardware's prefetch fell behind. The served model on the 2-core
// EPYC, the builds alternated in one process: in 512-bit registers its q8 head (49152 x 576) took 0.58-0.64x the
// time at 8 rows, 0.76-0.88x at 12-16, 0.82-0.85x at 2-4, its layer matmuls 0.93-0.95x at 8 rows and the same at
// 1; the 256-bit VNNI and AVX2 paths' layer matmuls 0.92-0.99x at 1-8 rows, their head the same. 16 blocks ahead
// measured no better.
constexpr int64_t AHEAD = 8;
template <int G, int W, int S, int64_t D = AHEAD>
inline void ahead(const int32_t* pw, const float* d8, const float* m8, int64_t b, int64_t gw, int64_t gs) {
  const int64_t w0 = (b + D) * W * G8, s0 = (b + D) * S * G8;
  for (int g = 0; g < G; ++g) {
    for (int64_t i = 0; i < W * G8; i += 16) __builtin_prefetch(pw + g * gw + w0 + i, 0, 3);
    for (int64_t i = 0; i < S * G8; i += 16) {
      __builtin_prefetch(d8 + g * gs + s0 + i, 0, 3);
      if (m8 != nullptr) __builtin_prefetch(m8 + g * gs + s0 + i, 0, 3);
    }
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
    ahead<1, 4, 1>(pw, d8, m8, b, 0, 0);
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
    ahead<1, 8, S>(pw, d8, A ? m8 : nullptr, b, 0, 0);
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

// The VNNI kernels' vectors. Y8: the 8 outputs of one weight group in 256-bit registers. Z16 (ES_ZMM): the 16
// outputs of two adjacent groups in 512-bit registers, each load joining the same words of both groups (`apart`
// elements apart): every vpdpbusd, conversion and fma then serves 16 outputs, and each activation word broadcast serves
// two groups. Only where a 512-bit op does twice a 256-bit one's work (simd.h says where); the float steps per
// output are the same, so the bits are.
struct Y8 {
  static constexpr int G = 1;  // weight groups a vector holds
  using I = __m256i;
  using F = __m256;
  static I words(const int32_t* p, int64_t) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static F floats(const float* p, int64_t) { return _mm256_loadu_ps(p); }
  static I bytes(char c) { return _mm256_set1_epi8(c); }
  static I bcast(int32_t w) { return _mm256_set1_epi32(w); }
  static F bcast(float f) { return _mm256_set1_ps(f); }
  static I izero() { return _mm256_setzero_si256(); }
  static F fzero() { return _mm256_setzero_ps(); }
  static I dp(I acc, I u, I s) { return dpbusd(acc, u, s); }
  static I band(I a, I b) { return _mm256_and_si256(a, b); }
  static I nibbles_hi(I a) { return _mm256_srli_epi16(a, 4); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, F a) { _mm256_storeu_ps(p, a); }
};

#if defined(ES_ZMM) || defined(ES_AMX)
// (the all-ones masked forms of insert and cvt: GCC 12 warns of the unmasked ones' undefined source under -Wall)
struct Z16 {
  static constexpr int G = 2;
  using I = __m512i;
  using F = __m512;
  static I words(const int32_t* p, int64_t apart) {
    return _mm512_maskz_inserti64x4(0xFF, _mm512_castsi256_si512(Y8::words(p, 0)), Y8::words(p + apart, 0), 1);
  }
  static F floats(const float* p, int64_t apart) {
    auto half = [](const float* q) { return _mm256_loadu_pd(reinterpret_cast<const double*>(q)); };
    return _mm512_castpd_ps(_mm512_maskz_insertf64x4(0xFF, _mm512_castpd256_pd512(half(p)), half(p + apart), 1));
  }
  static I bytes(char c) { return _mm512_set1_epi8(c); }
  static I bcast(int32_t w) { return _mm512_set1_epi32(w); }
  static F bcast(float f) { return _mm512_set1_ps(f); }
  static I izero() { return _mm512_setzero_si512(); }
  static F fzero() { return _mm512_setzero_ps(); }
  static I dp(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
  static I band(I a, I b) { return _mm512_and_si512(a, b); }
  static I nibbles_hi(I a) { return _mm512_srli_epi16(a, 4); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static F cvt(I a) { return _mm512_maskz_cvtepi32_ps(0xFFFF, a); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, F a) { _mm512_storeu_ps(p, a); }
};
#endif

// VNNI: vpdpbusd multiplies unsigned bytes by signed bytes and adds each lane's 4 products into its int32, in
// place of maddubs + madd + add (three instructions, and an int16 step): the same exact integer dot per block,
// so the same float steps after it, and one instruction per 4 products instead of two or three, which is what
// lets a group take up to 8 rows at once (ROWS) for little more than the cost of reading its weights.
// V's groups at once (V above): their words gw, their scales and offsets gs elements apart.
template <typename V, int R>
void group_q4_vnni(const int32_t* pw, const float* d8, const float* m8, const int8_t* qx, const float* dx,
                   const float* sx, int64_t nb, float* out, int64_t ldo) {
  const int64_t gw = nb * 4 * G8, gs = nb * G8;
  typename V::F acc[R];
  for (int r = 0; r < R; ++r) acc[r] = V::fzero();
  const typename V::I low = V::bytes(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    ahead<V::G, 4, 1>(pw, d8, m8, b, gw, gs);
    constexpr int C = chains<R>();
    typename V::I s[C][R];
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < R; ++r) s[c][r] = V::izero();
    for (int j = 0; j < 4; ++j) {
      const typename V::I v = V::words(pw + (b * 4 + j) * G8, gw);
      const typename V::I lo = V::band(v, low), hi = V::band(V::nibbles_hi(v), low);
      for (int r = 0; r < R; ++r) {
        const int8_t* xb = qx + (b * ROWS + r) * QK;
        s[(2 * j) % C][r] = V::dp(s[(2 * j) % C][r], lo, V::bcast(word(xb + 4 * j)));
        s[(2 * j + 1) % C][r] = V::dp(s[(2 * j + 1) % C][r], hi, V::bcast(word(xb + 16 + 4 * j)));
      }
    }
    for (int c = 1; c < C; ++c)
      for (int r = 0; r < R; ++r) s[0][r] = V::add(s[0][r], s[c][r]);
    const typename V::F d = V::floats(d8 + b * G8, gs), m = V::floats(m8 + b * G8, gs);
    for (int r = 0; r < R; ++r) {
      acc[r] = V::fma(V::cvt(s[0][r]), V::mul(d, V::bcast(dx[b * ROWS + r])), acc[r]);
      acc[r] = V::fma(m, V::bcast(sx[b * ROWS + r]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) V::store(out + r * ldo, acc[r]);
}

// q8's weights are signed, so the activations go in as the unsigned bytes ux = qx + 128 (qx ^ 0x80, made once
// per pass): <w, ux> = <w, qx> + 128 sum(w), and 128 sum(w), one vpdpbusd per word for all the rows, is taken
// off (exact in int32: |<w, ux>| <= 32 * 127 * 255). That is one instruction per row and word where the sign
// trick (|w| times x with w's sign) takes two.
template <typename V, int R, int S, bool A>
void group_q8_vnni(const int32_t* pw, const float* d8, const float* m8, const uint8_t* ux, const float* dx,
                   const float* ss, int64_t nb, float* out, int64_t ldo) {
  const int64_t gw = nb * 8 * G8, gs = nb * S * G8;
  typename V::F acc[R];
  for (int r = 0; r < R; ++r) acc[r] = V::fzero();
  const typename V::I bias = V::bytes(static_cast<char>(0x80));
  for (int64_t b = 0; b < nb; ++b) {
    ahead<V::G, 8, S>(pw, d8, A ? m8 : nullptr, b, gw, gs);
    // chains: C per scale (words 0..3 of a half block alternate over them when S = 2, 0..7 when S = 1)
    constexpr int C = S == 1 ? chains<R>() : std::max(1, chains<R>() / 2);
    typename V::I s[S][C][R], c[S][C];
    for (int h = 0; h < S; ++h)
      for (int k = 0; k < C; ++k) {
        c[h][k] = V::izero();
        for (int r = 0; r < R; ++r) s[h][k][r] = V::izero();
      }
    for (int j = 0; j < 8; ++j) {
      const int h = j * S / 8, k = j % C;
      const typename V::I v = V::words(pw + (b * 8 + j) * G8, gw);
      c[h][k] = V::dp(c[h][k], bias, v);
      for (int r = 0; r < R; ++r) {
        const int8_t* xb = reinterpret_cast<const int8_t*>(ux + (b * ROWS + r) * QK);
        s[h][k][r] = V::dp(s[h][k][r], V::bcast(word(xb + 4 * j)), v);
      }
    }
    for (int h = 0; h < S; ++h)
      for (int k = 1; k < C; ++k) {
        c[h][0] = V::add(c[h][0], c[h][k]);
        for (int r = 0; r < R; ++r) s[h][0][r] = V::add(s[h][0][r], s[h][k][r]);
      }
    for (int h = 0; h < S; ++h) {
      const typename V::F d = V::floats(d8 + (b * S + h) * G8, gs);
      for (int r = 0; r < R; ++r) {
        const typename V::F dot = V::cvt(V::sub(s[h][0][r], c[h][0]));
        acc[r] = V::fma(dot, V::mul(d, V::bcast(dx[b * ROWS + r])), acc[r]);
        if constexpr (A)
          acc[r] = V::fma(V::floats(m8 + (b * S + h) * G8, gs), V::bcast(ss[(b * ROWS + r) * S + h]), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) V::store(out + r * ldo, acc[r]);
}
#endif  // ES_VNNI

#endif  // ES_AVX2
