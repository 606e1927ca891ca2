// AMX-INT8 group kernels (Sapphire Rapids and later Xeons): the block dots of 16 activation rows by 16 outputs in
// one tile op, for passes of AMX_ROWS rows or more. Included by groups.h inside its namespace; groups.h says
// what a group kernel computes.
//
// A tile op takes A [16 rows, K bytes] (a tile of activation rows, block b: groups.h's layout with ROWS = 16 is
// already one, rows QK bytes apart) and B [K / 4 rows, 16 outputs x 4 bytes] (two weight groups' block as they
// are interleaved, word j of 8 outputs side by side, the two groups' side by side: B's row j), and adds C [16, 16]
// int32 = A . B, exact. So a block's dot of 16 rows and 16 outputs is one tdpbssd (q8) or tdpbsud (q4, its
// nibbles unpacked to bytes) where the VNNI kernels take 8 vpdpbusd per row and group; the float steps after it
// are the VNNI kernels' per output and block, in the same order, so the bits are the same. The dots go through
// memory (a tile's C is stored, then read into vectors), each step a block behind the one before it, so that
// none waits on the tile unit: block b's words are paired while block b - 2's are dotted, its C stored once
// block b + 1's dots are issued, read once block b + 2's are (a 1536 x 576 matmul at 16 rows, one thread: 135 us
// with C read at once, against 26 us for the tile ops alone; the served model's layer matmuls, on 1 or 2 threads, with
// the store and the pairing a block later each: 0.76-0.99x the time at 16 rows, 0.89-1.02x at 8, faster the
// longer the machine's latencies were at the time; bench/results/issue39-amx-pipeline).
#pragma once
#ifdef ES_AMX
#include <sys/syscall.h>
#include <unistd.h>

// the fewest rows a pass takes through the tiles (below: the VNNI kernels). A tile op costs the same for any
// rows, the float steps after it are per row (group_amx's RT): the served model's batch steps, tiles against
// VNNI in one process, the two alternated step by step: 0.98x the time at 5 rows, 0.91-0.93x at 6, 0.95x at 7;
// 0.97-1.07x at 4, where the VNNI kernels stay.
constexpr int AMX_ROWS = 5;
// how many blocks ahead the tile kernels fetch their weights (groups_x86.h's `ahead`): a block takes them about
// half the VNNI kernels' time, so their fetches came too late at the VNNI kernels' 8. The served model's layer
// matmuls (2 threads, AMX against VNNI in one run, three runs one after another): 1.04x the VNNI kernels' time at
// 8 rows and 0.86x at 16 with 8 blocks ahead, 0.90x and 0.81x with 16, 0.88x and 0.78x with 32.
constexpr int64_t AMX_AHEAD = 32;

// Linux hands a process the tiles' register state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA, once for all its threads; Linux 5.16 and later); where it refuses, the VNNI kernels run
inline bool amx_ready() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// The tile shapes of the kernels below, loaded once per thread and pass (ldtilecfg took ~120 ns here, a
// quarter of a 16-row group's time over K = 576), for a pass of `rows` activation rows (none below AMX_ROWS):
// `k` the bytes of one dot, 32 for a block (q4, q8 with a scale per block), 16 for a half block (q8 with a scale
// per half). Tiles: A 0 (and 5, a second half's), B 1 (two groups' words side by side), C 3 and 4 by block
// parity (and 6 and 7); A and C of 8 rows for a pass of 8 rows at most (half the tile loads, dots and stores).
class Tiles {
 public:
  Tiles(int k, int64_t rows) : on_(rows >= AMX_ROWS && amx_ready()) {
    if (!on_) return;
    struct alignas(64) {
      uint8_t palette = 1, start_row = 0, reserved[14] = {};
      uint16_t colsb[16] = {};
      uint8_t rows[16] = {};
    } cfg;
    const int m = rows <= 8 ? 8 : 16;
    auto tile = [&](int t, int height, int bytes) { cfg.rows[t] = static_cast<uint8_t>(height), cfg.colsb[t] = bytes; };
    tile(0, m, k);
    tile(1, k / 4, 64);
    tile(3, m, 64), tile(4, m, 64);
    if (k == 16) tile(5, m, 16), tile(6, m, 64), tile(7, m, 64);
    _tile_loadconfig(&cfg);
  }
  ~Tiles() {
    if (on_) _tile_release();
  }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
  bool on() const { return on_; }

 private:
  bool on_;
};

// One block's (or half block's) dots of 16 rows by 16 outputs: A (tile a) from the activations at x, B (tile 1)
// from two groups' words side by side at w (rows 64 bytes apart), into C (tile c); Q4: B holds unsigned bytes.
// The C tiles alternate by block parity (3 and 4, a half block's 6 and 7): a block's C is stored after the next
// block's dots are issued, since a store right after its own dots waited for them (a third of group_amx's time
// at 16 rows, `perf record`). Macros: GCC's tile intrinsics paste their tile numbers into the instruction's text,
// so they take literals only.
#define ES_BLOCK_DOTS(NAME, a, c)                                    \
  template <bool Q4>                                                 \
  inline void NAME(const int8_t* x, const int32_t* w) {              \
    _tile_loadd(a, x, QK);                                           \
    _tile_zero(c);                                                   \
    _tile_loadd(1, w, 64);                                           \
    if constexpr (Q4) _tile_dpbsud(c, a, 1);                         \
    else _tile_dpbssd(c, a, 1);                                      \
  }
ES_BLOCK_DOTS(block_dots_even, 0, 3)
ES_BLOCK_DOTS(block_dots_odd, 0, 4)
ES_BLOCK_DOTS(half_dots_even, 5, 6)
ES_BLOCK_DOTS(half_dots_odd, 5, 7)
#undef ES_BLOCK_DOTS

// Block b's dots (S dots of 32 / S bytes: x its activations, w its words) into the C tiles of its parity
template <bool Q4, int S>
inline void block_dots(int64_t b, const int8_t* x, const int32_t* w) {
  if (b & 1) {
    block_dots_odd<Q4>(x, w);
    if constexpr (S == 2) half_dots_odd<Q4>(x + 16, w + 4 * 16);
  } else {
    block_dots_even<Q4>(x, w);
    if constexpr (S == 2) half_dots_even<Q4>(x + 16, w + 4 * 16);
  }
}

// Block b's C tiles stored at o: [S][16 rows][16] int32
template <int S>
inline void store_dots(int64_t b, int32_t* o) {
  if (b & 1) {
    _tile_stored(4, o, 64);
    if constexpr (S == 2) _tile_stored(7, o + 16 * 16, 64);
  } else {
    _tile_stored(3, o, 64);
    if constexpr (S == 2) _tile_stored(6, o + 16 * 16, 64);
  }
}

// Block b of two groups (g0 and g1, W words per block, interleaved: [W, 8] int32 each) as one B of 16 outputs:
// row j of `to` [8, 16] int32 is word j of g0's 8 outputs, then of g1's. Q4: the W = 4 words' nibbles as bytes,
// their low nibbles elements 0..15 of the block (rows 0..3), their high nibbles 16..31 (rows 4..7).
template <bool Q4>
inline void pair_words(const int32_t* g0, const int32_t* g1, int32_t* to) {
  constexpr int W = Q4 ? 4 : 8;
  const __m512i low = _mm512_set1_epi8(0x0F);
  // a, b: words j and j + 1 of g0, g1 (the all-ones masked shuffle: GCC 12 warns of the unmasked one's source)
  auto put = [&](int j, __m512i a, __m512i b) {
    _mm512_store_si512(to + 16 * j, _mm512_maskz_shuffle_i64x2(0xFF, a, b, 0x44));
    _mm512_store_si512(to + 16 * (j + 1), _mm512_maskz_shuffle_i64x2(0xFF, a, b, 0xEE));
  };
  for (int j = 0; j < W; j += 2) {
    const __m512i a = _mm512_loadu_si512(g0 + 8 * j), b = _mm512_loadu_si512(g1 + 8 * j);
    if constexpr (Q4) {
      put(j, _mm512_and_si512(a, low), _mm512_and_si512(b, low));
      put(4 + j, _mm512_and_si512(_mm512_srli_epi16(a, 4), low), _mm512_and_si512(_mm512_srli_epi16(b, 4), low));
    } else {
      put(j, a, b);
    }
  }
}

// The 8 G outputs of V's groups (Y8: one, Z16: two) for R <= RT rows of a 16-row tile (RT: the rows
// whose float steps run), q8 with S scales per block (A: affine), or Q4 (its steps are affine q8's, groups.h).
// Arguments as the VNNI kernels'; the caller loaded Tiles(32 / S). A tile op's cost is the same for 8 outputs as
// for 16 (~6 ns for a dot of 16 rows, as for a store of its C, measured here), so two groups go through one:
// their words are paired two blocks ahead of their tile load (pair_words: a load of words just stored waited on
// the stores); one group is paired with itself, its second 8 outputs never read. (Layer matmuls in the served model's
// shapes, q4, 2 threads, against the VNNI kernels: 1.04x the time at 8 rows with a tile op per group, 0.86x
// paired.)
template <typename V, int RT, int S, bool A, bool Q4>
void group_amx(const int32_t* pw, const float* d8, const float* m8, const int8_t* qx, const float* dx,
               const float* ss, int64_t nb, int64_t R, float* out, int64_t ldo) {
  static_assert(ROWS == 16 && (!Q4 || (S == 1 && A)));
  constexpr int W = Q4 ? 4 : 8;  // words per block as stored
  const int64_t gw = nb * W * G8, gs = nb * S * G8;
  const int32_t* second = pw + (V::G - 1) * gw;
  alignas(64) int32_t dots[2][S][16][16];  // by block parity: [half][row][group * 8 + output]
  alignas(64) int32_t words[4][8][16];     // by block mod 4: B, two groups' words side by side
  typename V::F acc[RT];
  for (int r = 0; r < RT; ++r) acc[r] = V::fzero();
  auto floats = [&](int64_t b) {  // block b's float steps, from its stored dots
    for (int h = 0; h < S; ++h) {
      const typename V::F d = V::floats(d8 + (b * S + h) * G8, gs);
      // unrolled, the rows' sums stay in registers (a loop kept them on the stack; 0.89-0.93x the time at 16 rows)
#pragma GCC unroll 16
      for (int r = 0; r < RT; ++r) {
        const typename V::F dot = V::cvt(V::words(dots[b & 1][h][r], 8));
        acc[r] = V::fma(dot, V::mul(d, V::bcast(dx[b * ROWS + r])), acc[r]);
        if constexpr (A)
          acc[r] = V::fma(V::floats(m8 + (b * S + h) * G8, gs), V::bcast(ss[(b * ROWS + r) * S + h]), acc[r]);
      }
    }
  };
  pair_words<Q4>(pw, second, words[0][0]);
  if (nb > 1) pair_words<Q4>(pw + W * G8, second + W * G8, words[1][0]);
  for (int64_t b = 0; b < nb; ++b) {
    ahead<V::G, W, S, AMX_AHEAD>(pw, d8, A ? m8 : nullptr, b, gw, gs);
    if (b + 2 < nb) pair_words<Q4>(pw + (b + 2) * W * G8, second + (b + 2) * W * G8, words[(b + 2) & 3][0]);
    block_dots<Q4, S>(b, qx + b * ROWS * QK, words[b & 3][0]);
    if (b > 0) store_dots<S>(b - 1, dots[(b - 1) & 1][0][0]);
    if (b > 1) floats(b - 2);
  }
  store_dots<S>(nb - 1, dots[(nb - 1) & 1][0][0]);
  if (nb > 1) floats(nb - 2);
  floats(nb - 1);
  for (int r = 0; r < R; ++r) V::store(out + r * ldo, acc[r]);
}

// group_amx for G groups (1: Y8, 2: Z16) at RT = R rounded up to an even count (R >= AMX_ROWS): the float
// steps are most of the tile kernels' time, and at RT = 16 for any 9-15 rows a batch step of 10 sequences cost
// about what one of 16 did (the served model's batch steps against RT = 8 or 16, processes alternated, the
// machine's speed drifting: 0.62-0.98x the time at 10 rows, 0.70-0.86x at 12; bench/results/issue39-tile-padding).
// Even counts only: each RT is a build of every kernel form.
template <int S, bool A, bool Q4>
void group_amx_rows(const int32_t* pw, const float* d8, const float* m8, const int8_t* qx, const float* dx,
                    const float* ss, int64_t nb, int64_t R, float* out, int64_t ldo, int G) {
  static_assert(AMX_ROWS >= 5, "no kernel takes fewer than 6 rows");
  auto rows = [&](auto V) {
    using Vec = decltype(V);
    switch ((R + 1) / 2) {
      case 3: return group_amx<Vec, 6, S, A, Q4>(pw, d8, m8, qx, dx, ss, nb, R, out, ldo);
      case 4: return group_amx<Vec, 8, S, A, Q4>(pw, d8, m8, qx, dx, ss, nb, R, out, ldo);
      case 5: return group_amx<Vec, 10, S, A, Q4>(pw, d8, m8, qx, dx, ss, nb, R, out, ldo);
      case 6: return group_amx<Vec, 12, S, A, Q4>(pw, d8, m8, qx, dx, ss, nb, R, out, ldo);
      case 7: return group_amx<Vec, 14, S, A, Q4>(pw, d8, m8, qx, dx, ss, nb, R, out, ldo);
      default: return group_amx<Vec, 16, S, A, Q4>(pw, d8, m8, qx, dx, ss, nb, R, out, ldo);
    }
  };
  G == 2 ? rows(Z16{}) : rows(Y8{});
}
#endif  // ES_AMX
