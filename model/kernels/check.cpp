// A standalone check of the group kernels, without torch or Python: every kernel this build compiles (its path,
// simd.h) against the portable kernels on the same inputs, bit for bit, for the activations' quantizer and for q4
// and the four q8 forms at 1-32 activation rows, one weight group and two at once. tests/test_kernels_aarch64.py
// builds it with Debian's aarch64 cross compiler for NEON with and without sdot and runs it under qemu-user as a
// Pi 4 (Cortex-A72) and a Pi 5 (Cortex-A76) would; built natively,
// it checks this x86 CPU's path the same way. Prints one line per form, exits 1 on the first difference.
#include <cstdio>
#include <random>
#include <utility>
#include "groups.h"

using namespace groups;

namespace {

constexpr int64_t NB = 7, K = NB * QK, MAXR = 32;  // two tiles of the most rows a build's tile holds (AMX's 16)

constexpr int GROUPS = 2;  // adjacent weight groups, as a 512-bit kernel takes them (groups.h's WIDE)

struct Inputs {
  std::vector<int32_t> pw4, pw8;    // two groups' words: [2, NB, 4, 8] q4 nibbles, [2, NB, 8, 8] q8 bytes in -127..127
  std::vector<float> d8, m8;        // [2, NB * 2, 8]: scales and offsets, enough for two groups of two per block
  std::vector<int8_t> qx;           // [MAXR, K] quantized activations in tiles of ROWS rows (groups.h)
  std::vector<float> dx, sx, sh;    // [MAXR, NB], [MAXR, NB], [MAXR, NB * 2], likewise
};

Inputs make(uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> byte(-127, 127);
  Inputs in;
  for (int64_t i = 0; i < GROUPS * NB * 4 * G8; ++i) in.pw4.push_back(static_cast<int32_t>(rng()));
  for (int64_t i = 0; i < GROUPS * NB * 8 * G8; ++i) {
    uint32_t w = 0;
    for (int e = 0; e < 4; ++e) w |= static_cast<uint32_t>(static_cast<uint8_t>(byte(rng))) << (8 * e);
    in.pw8.push_back(static_cast<int32_t>(w));
  }
  for (int64_t i = 0; i < GROUPS * NB * 2 * G8; ++i) {
    in.d8.push_back(std::fabs(normal(rng)) * 1e-2f);
    in.m8.push_back(normal(rng) * 1e-3f);
  }
  std::vector<float> x(K);
  in.qx.resize(MAXR * K);
  in.dx.resize(MAXR * NB);
  in.sx.resize(MAXR * NB);
  in.sh.resize(MAXR * NB * 2);
  for (int64_t r = 0; r < MAXR; ++r) {
    for (auto& v : x) v = normal(rng);
    const int64_t at = r / ROWS * ROWS * NB + r % ROWS;  // as quant.cpp's quantize_rows places a row
    quantize_row(x.data(), K, &in.qx[at * QK], &in.dx[at], &in.sx[at], &in.sh[2 * at], ROWS);
  }
  return in;
}

// the outputs [R, 8 G] of rows 0..R-1 in steps of ROWS, as quant.cpp's run_groups takes them: G groups in one
// call of simd(G, r, n, out, ldo, R) (R: the pass's rows, for which it loads the AMX tiles as run_groups does), or
// group by group through portable(g, r, n, out, ldo)
template <typename Simd, typename Portable>
std::pair<std::vector<float>, std::vector<float>> rows(int G, int64_t R, Simd simd, Portable portable) {
  std::vector<float> a(R * G * G8), b(R * G * G8);
  for (int64_t r = 0; r < R; r += ROWS) {
    const int64_t n = std::min<int64_t>(ROWS, R - r);
    simd(G, r, n, &a[r * G * G8], G * G8, R);
    for (int g = 0; g < G; ++g) portable(g, r, n, &b[r * G * G8 + g * G8], G * G8);
  }
  return {a, b};
}

bool same(const char* form, int64_t R, const std::vector<float>& a, const std::vector<float>& b) {
  if (std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0) return true;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) {
      std::printf("DIFFERENT %s: %lld rows, output %zu: %s %.9g, portable %.9g\n", form, static_cast<long long>(R), i,
                  isa_name(), a[i], b[i]);
      break;
    }
  return false;
}

// a form's group kernel (simd) against the portable one, at 1-MAXR rows, one group and two at once (above)
template <typename Simd, typename Portable>
bool check(const char* form, Simd simd, Portable portable) {
  for (int G = 1; G <= GROUPS; ++G)
    for (int64_t R = 1; R <= MAXR; ++R) {
      const auto [a, b] = rows(G, R, simd, portable);
      if (!same(form, R, a, b)) return false;
    }
  std::printf("same bits: %s, %s, 1-%lld rows, 1-%d groups\n", isa_name(), form, static_cast<long long>(MAXR), GROUPS);
  return true;
}

template <int S, bool A>
bool check_q8(const Inputs& in, const char* form) {
  const std::vector<uint8_t> ux = q8_activations(in.qx.data(), in.qx.size());
  const float* ss = S == 2 && A ? in.sh.data() : in.sx.data();
  const float* m8 = A ? in.m8.data() : nullptr;
  return check(form, [&](int G, int64_t r, int64_t n, float* o, int64_t ldo, int64_t M) {
    const Tiles tiles(QK / S, M);
    q8_group<S, A>(in.pw8.data(), in.d8.data(), m8, &in.qx[r * K], ux.empty() ? nullptr : &ux[r * K], &in.dx[r * NB],
                   ss + r * NB * S, NB, n, o, ldo, tiles, G);
  }, [&](int g, int64_t r, int64_t n, float* o, int64_t ldo) {
    group_q8_portable<S, A>(&in.pw8[g * NB * 8 * G8], &in.d8[g * NB * S * G8], m8 ? m8 + g * NB * S * G8 : nullptr,
                            &in.qx[r * K], &in.dx[r * NB], ss + r * NB * S, NB, n, o, ldo);
  });
}

bool check_q4(const Inputs& in) {
  return check("q4", [&](int G, int64_t r, int64_t n, float* o, int64_t ldo, int64_t M) {
    const Tiles tiles(QK, M);
    q4_group(in.pw4.data(), in.d8.data(), in.m8.data(), &in.qx[r * K], &in.dx[r * NB], &in.sx[r * NB], NB, n, o, ldo,
             tiles, G);
  }, [&](int g, int64_t r, int64_t n, float* o, int64_t ldo) {
    group_q4_portable(&in.pw4[g * NB * 4 * G8], &in.d8[g * NB * G8], &in.m8[g * NB * G8], &in.qx[r * K],
                      &in.dx[r * NB], &in.sx[r * NB], NB, n, o, ldo);
  });
}

// quantize_row against quantize_row_portable on rows of normal values at several scales, a block of zeros, a
// block of ties (127 and halves: x / d lands on .5, rounded to even) and a block with an infinitely small value
bool check_quantize(uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> x(K);
  for (const float scale : {1.f, 1e-30f, 3e4f}) {
    for (auto& v : x) v = normal(rng) * scale;
    std::fill(x.begin(), x.begin() + QK, 0.f);
    for (int i = 0; i < QK; ++i) x[QK + i] = i == 0 ? 127.f : (i % 2 ? 0.5f : -1.5f) + static_cast<float>(i - 16);
    x[2 * QK + 3] = 1e-45f;
    for (const int64_t step : {int64_t{1}, int64_t{ROWS}}) {  // a plain row, and a row of a tile
      std::vector<int8_t> qa(K * step), qb(K * step);
      std::vector<float> fa(4 * NB * step), fb(4 * NB * step);  // dx, sx, sh [2 NB step]
      quantize_row(x.data(), K, qa.data(), &fa[0], &fa[NB * step], &fa[2 * NB * step], step);
      quantize_row_portable(x.data(), K, qb.data(), &fb[0], &fb[NB * step], &fb[2 * NB * step], step);
      if (qa != qb || std::memcmp(fa.data(), fb.data(), fa.size() * sizeof(float)) != 0) {
        std::printf("DIFFERENT quantize_row: %s against portable, scale %g, step %lld\n", isa_name(), scale,
                    static_cast<long long>(step));
        return false;
      }
    }
  }
  std::printf("same bits: %s, quantize_row\n", isa_name());
  return true;
}

}  // namespace

int main() {
  for (uint32_t seed = 0; seed < 3; ++seed) {
    const Inputs in = make(seed);
    if (!(check_quantize(seed) && check_q4(in) && check_q8<1, false>(in, "q8") && check_q8<2, false>(in, "q8-halves") &&
          check_q8<1, true>(in, "q8-affine") && check_q8<2, true>(in, "q8-affine-halves")))
      return 1;
  }
  return 0;
}
