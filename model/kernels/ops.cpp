// The per-token ops around the matmuls, in float32, each output computed in one fixed order that depends on
// neither the number of rows in the pass nor the thread that runs it (see quant.cpp): RMS norm, rotary
// embedding, attention over the slots each query row sees, and SwiGLU's silu(gate) * up. One call each per
// layer instead of the 5-20 torch ops they replace: dispatch, not arithmetic, was half of a decoding step's
// time on 2 cores (measured: 19 ms per token of which about 9 outside the matmuls).
#include "common.h"
#include "kv.h"

#include <vector>

namespace {

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32");
}

}  // namespace

// x [..., H], w [H] -> w * (x / sqrt(mean(x^2) + eps)), rows independent
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  check_float(x, "x");
  x = x.contiguous();
  const int64_t H = x.size(-1), rows = x.numel() / H;
  TORCH_CHECK(H % 8 == 0 && w.numel() == H, "rms_norm needs H % 8 == 0 and a weight of H");
  auto out = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.contiguous().data_ptr<float>();
  float* op = out.data_ptr<float>();
  // a prompt's rows on the pool's threads in runs of 16, as quant.cpp's quantizer does (a decode pass's few rows
  // stay on this thread); each row on its own, so the split changes no bits
  parallel_chunks(0, rows, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) rms_row(xp + r * H, wp, H, static_cast<float>(eps), op + r * H);
  });
  return out;
}

// x + y (float32, one shape [..., H]), rows on the pool's threads as rms_norm's. The residual adds were torch's
// at::add, which splits a tensor of over 32768 values (a prompt's 57 rows of 576) over libgomp's team: its
// threads then spun for the two cores that the pool's threads wanted next (a 100-token prompt's pass, served
// GOMP_SPINCOUNT: 15% of its samples in libgomp's spin). One add per value, so the split changes no bits.
at::Tensor add_rows(const at::Tensor& x, const at::Tensor& y) {
  check_float(x, "x");
  check_float(y, "y");
  TORCH_CHECK(x.sizes() == y.sizes(), "add_rows takes two tensors of one shape");
  const at::Tensor xc = x.contiguous(), yc = y.contiguous();
  auto out = at::empty_like(xc);
  const int64_t H = xc.size(-1), rows = xc.numel() / std::max<int64_t>(1, H);
  const float *xp = xc.data_ptr<float>(), *yp = yc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  parallel_chunks(0, rows, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo * H; i < hi * H; ++i) op[i] = xp[i] + yp[i];
  });
  return out;
}

// y [M, N] += bias [N] in place (float32, y contiguous), rows on the pool's threads as add_rows's
void add_bias_(at::Tensor& y, const at::Tensor& bias) {
  check_float(y, "y");
  check_float(bias, "bias");
  TORCH_CHECK(y.is_contiguous() && y.dim() == 2 && bias.numel() == y.size(1), "add_bias_ takes y [M, N], bias [N]");
  const at::Tensor bc = bias.contiguous();
  const int64_t N = y.size(1);
  float* yp = y.data_ptr<float>();
  const float* bp = bc.data_ptr<float>();
  parallel_chunks(0, y.size(0), 16, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r)
      for (int64_t n = 0; n < N; ++n) yp[r * N + n] += bp[n];
  });
}

// x [B, heads, T, hd] (any strides), cos, sin [B, 1, T, hd] -> x cos + rotate_half(x) sin, contiguous
at::Tensor rope(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  check_float(x, "x");
  x = x.contiguous();
  cos = cos.expand({x.size(0), 1, x.size(2), x.size(3)}).contiguous();
  sin = sin.expand({x.size(0), 1, x.size(2), x.size(3)}).contiguous();
  const int64_t B = x.size(0), heads = x.size(1), T = x.size(2), hd = x.size(3);
  auto out = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const float* xr = xp + ((b * heads + h) * T + t) * hd;
        const float *c = cp + (b * T + t) * hd, *s = sp + (b * T + t) * hd;
        rotate(xr, c, s, hd, op + ((b * heads + h) * T + t) * hd);
      }
  return out;
}

namespace {

// <a, row> over n values (n % 8 == 0), row read by R: dot8's lanes and order
template <class R>
inline float dot_kv(const float* a, const uint8_t* row, int64_t n) {
#ifdef ES_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (int64_t k = 0; k < n; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), R::load8(row, k), acc);
  return reduce8(acc);
#else
  float acc[8] = {};
  for (int64_t k = 0; k < n; k += 8)
    for (int lane = 0; lane < 8; ++lane) acc[lane] = std::fma(a[k + lane], R::at(row, k + lane), acc[lane]);
  return reduce8(acc);
#endif
}

// y += p * row over n values, row read by R: axpy's operations
template <class R>
inline void axpy_kv(float* y, const uint8_t* row, float p, int64_t n) {
  for (int64_t k = 0; k < n; ++k) y[k] = std::fma(p, R::at(row, k), y[k]);
}

// One attention call's part (attend_keys': all of it; attend_seqs': one sequence's), checked and worked out by
// attend_part, for the body in each storage format. Query (b, h, t) is at q + b qb + h qh + t qt; its output at
// the same offsets from out.
struct AttendArgs {
  const float* q;
  float* out;
  int64_t qb, qh, qt;  // the queries' and outputs' strides in floats
  const uint8_t *k, *v;  // the stores' first bytes
  int64_t k0, k1, k2, v0, v1, v2;  // their strides in bytes
  const int64_t* table;
  int64_t trows, nb, BS, B, nq, nkv, T, hd, S, start, mrows;
  const bool* mask;
};

// the cache lines of a stored head vector of `bytes`, fetched ahead (locality L: 3 to L1, 2 to L2)
template <int L>
inline void prefetch_row(const uint8_t* row, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, L);
}
// slots a key and a value are fetched ahead of the scores (8 and 32 measured no better), and the scores' runs
constexpr int64_t PREFETCH_SLOTS = 16, SCORE_SLOTS = 4;

#ifdef ES_AVX2
// Scores of H query heads (qs[u], u < H) against the same n keys: each key's 8-value chunks are read (and
// widened) once for all H heads, where a head at a time read them H times (GQA: SmolLM2's 9 query heads share 3
// KV heads). Per (head, slot) the operations are dot_kv's: an 8-lane fma chain over the chunks, reduce8, times
// scale; slots go 4 at a time for independent chains. Slot j's scores go to sc[u][at + j] (a run's place).
template <class R, int H>
void scores_grouped(const float* const* qs, const uint8_t* const* kps, int64_t n, int64_t hd, float scale,
                    float* const* sc, int64_t at) {
  int64_t j0 = 0;
  for (; j0 + 4 <= n; j0 += 4) {
    __m256 acc[H][4];
    for (int u = 0; u < H; ++u)
      for (int s = 0; s < 4; ++s) acc[u][s] = _mm256_setzero_ps();
    for (int64_t k = 0; k < hd; k += 8) {
      __m256 kv[4];
      for (int s = 0; s < 4; ++s) kv[s] = R::load8(kps[j0 + s], k);
      for (int u = 0; u < H; ++u) {
        const __m256 qv = _mm256_loadu_ps(qs[u] + k);
        for (int s = 0; s < 4; ++s) acc[u][s] = _mm256_fmadd_ps(qv, kv[s], acc[u][s]);
      }
    }
    for (int u = 0; u < H; ++u)
      for (int s = 0; s < 4; ++s) sc[u][at + j0 + s] = reduce8(acc[u][s]) * scale;
  }
  for (int64_t j = j0; j < n; ++j)
    for (int u = 0; u < H; ++u) sc[u][at + j] = dot_kv<R>(qs[u], kps[j], hd) * scale;
}

// The float lanes the weighted values are summed in: 8 in 256-bit registers, 16 where simd.h's ES_ZMM_FLOAT says.
// A lane's fma chain is the same in either, so the bits are: a SmolLM2 head's 64 values go in one pass over the
// slots where 8 lanes took two, each reading half of every value's row (attention alone, 8 rows over 100 or 300
// slots: 0.94x the time on a Zen 5 EPYC).
template <int L>
struct Lanes {
  using F = __m256;
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, F a) { _mm256_storeu_ps(p, a); }
  template <class R>
  static F load(const uint8_t* row, int64_t i) { return R::load8(row, i); }
};
#ifdef ES_ZMM_FLOAT
template <>
struct Lanes<16> {
  using F = __m512;
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, F a) { _mm512_storeu_ps(p, a); }
  template <class R>
  static F load(const uint8_t* row, int64_t i) { return R::load16(row, i); }
};
#endif

// o[u][c0, c0 + L C) = sum_j p[u][j] v_j for H heads over the same n values, each value's chunk read once for
// all H: per output the fma chain over the slots in order, from 0 (axpy's operations); H x C accumulators of L
// lanes in registers, each p broadcast once per L C values.
//
// Each value's chunk is fetched to L1 VALUES_AHEAD slots before its fmas: fetched to L2 during the scores alone,
// the first load of each value stalled (17% of attention's samples on one instruction, 16 sequences over 500
// slots on a 2-core Zen 4 EPYC).
constexpr int64_t VALUES_AHEAD = 8;

template <class R, int H, int C, int L>
void values_chunks(const float* const* p, const uint8_t* const* vps, int64_t n, int64_t c0, float* const* o) {
  using V = Lanes<L>;
  typename V::F acc[H][C];
  for (int u = 0; u < H; ++u)
    for (int c = 0; c < C; ++c) acc[u][c] = V::zero();
  for (int64_t j = 0; j < n; ++j) {
    if (j + VALUES_AHEAD < n) prefetch_row<3>(vps[j + VALUES_AHEAD] + R::bytes(c0), R::bytes(L * C));
    typename V::F v[C];
    for (int c = 0; c < C; ++c) v[c] = V::template load<R>(vps[j], c0 + L * c);
    for (int u = 0; u < H; ++u) {
      const typename V::F pu = V::set1(p[u][j]);
      for (int c = 0; c < C; ++c) acc[u][c] = V::fma(pu, v[c], acc[u][c]);
    }
  }
  for (int u = 0; u < H; ++u)
    for (int c = 0; c < C; ++c) V::store(o[u] + c0 + L * c, acc[u][c]);
}

// the weighted values of H heads: 64 values at a time in 512-bit registers where the build has them, else 32 (64
// for one head), then 8
template <class R, int H>
void values_grouped(const float* const* p, const uint8_t* const* vps, int64_t n, int64_t hd, float* const* o) {
  constexpr int C = H == 1 ? 8 : 4;
  int64_t c0 = 0;
#ifdef ES_ZMM_FLOAT
  for (; c0 + 64 <= hd; c0 += 64) values_chunks<R, H, 4, 16>(p, vps, n, c0, o);
  for (; c0 + 16 <= hd; c0 += 16) values_chunks<R, H, 1, 16>(p, vps, n, c0, o);
#endif
  for (; c0 + 8 * C <= hd; c0 += 8 * C) values_chunks<R, H, C, 8>(p, vps, n, c0, o);
  for (; c0 < hd; c0 += 8) values_chunks<R, H, 1, 8>(p, vps, n, c0, o);
}
#endif

// One run of H query heads of a KV head's group over the same n visible slots, each as attend_keys says:
// scores <q, k> / sqrt(hd) in slot order, their max, exp(s - max), the sum in slot order, the sum of p v, times
// 1 / sum. The H heads' max and sum chains go side by side (each head's own order unchanged): one chain of
// dependent adds per slot was latency-bound. The grouped kernels above where the build has AVX2; else one head
// at a time, with the same operations.
//
// Keys are fetched to L1 and values to L2 PREFETCH_SLOTS slots ahead of the scores: a batch's sequences each
// read their own cache, which no hardware prefetcher followed across the blocks' slot pointers (8 sequences over
// 300 slots: 70% of the kernel's samples on its loads of keys and values). Attention alone, 8 rows each over its
// own float16 cache in 30 layers, the builds alternated in one process: 0.91x the time over 150 slots, 0.78x over
// 300, 0.59x over 500; 1.03x over 50, and one row over 50 slots (in cache already) 0.12 -> 0.14 ms a pass. They
// were fetched a run of 16 slots at a time, 32 lines at once that filled the core's queue of misses (the
// prefetches themselves stalled); now 4 slots' worth before each 4 slots' scores (SCORE_SLOTS). With the values'
// fetch to L1 (values_chunks), on a 2-core Zen 4 EPYC, 16 rows each over its own float16 cache in 30 layers, the
// builds alternated in one process (bench/results/issue39-attention-prefetch): 0.884x and 0.955x the time over 60
// slots, 0.86x and 0.871x over 250, 0.825x and 0.822x over 500 (two runs); float32 0.833x and 0.82x over 250. The
// order of the arithmetic is unchanged.
template <class R, int H>
void attend_run(const float* const* qs, const uint8_t* const* kps, const uint8_t* const* vps, int64_t n, int64_t hd,
                float scale, float* const* sc, float* const* o) {
  for (int64_t j = 0; j < std::min(n, PREFETCH_SLOTS); ++j) {
    prefetch_row<3>(kps[j], R::bytes(hd));
    prefetch_row<2>(vps[j], R::bytes(hd));
  }
  for (int64_t j0 = 0; j0 < n; j0 += SCORE_SLOTS) {
    const int64_t j1 = std::min(n, j0 + SCORE_SLOTS);
    for (int64_t j = j0 + PREFETCH_SLOTS; j < std::min(n, j1 + PREFETCH_SLOTS); ++j) {
      prefetch_row<3>(kps[j], R::bytes(hd));
      prefetch_row<2>(vps[j], R::bytes(hd));
    }
#ifdef ES_AVX2
    scores_grouped<R, H>(qs, kps + j0, j1 - j0, hd, scale, sc, j0);
#else
    for (int u = 0; u < H; ++u)
      for (int64_t j = j0; j < j1; ++j) sc[u][j] = dot_kv<R>(qs[u], kps[j], hd) * scale;
#endif
  }
  float mx[H], sum[H];
  for (int u = 0; u < H; ++u) mx[u] = -INFINITY, sum[u] = 0.f;
  for (int64_t j = 0; j < n; ++j)
    for (int u = 0; u < H; ++u) mx[u] = std::max(mx[u], sc[u][j]);
  for (int u = 0; u < H; ++u) exp_shifted(sc[u], mx[u], n);
  for (int64_t j = 0; j < n; ++j)
    for (int u = 0; u < H; ++u) sum[u] += sc[u][j];
#ifdef ES_AVX2
  values_grouped<R, H>(sc, vps, n, hd, o);
#else
  for (int u = 0; u < H; ++u) {
    std::fill(o[u], o[u] + hd, 0.f);
    for (int64_t j = 0; j < n; ++j) axpy_kv<R>(o[u], vps[j], sc[u][j], hd);
  }
#endif
  for (int u = 0; u < H; ++u) {
    const float inv = 1.f / sum[u];
    for (int64_t i = 0; i < hd; ++i) o[u][i] *= inv;
  }
}

// One job of a part: one query row t of one KV head's group of query heads in row b. The visible slots and
// their keys' and values' addresses are found once for the group, and each key and value read once for up to
// MAXH of its heads. Even one decode row (3 groups on 2 threads) took 0.73x the time of 9 jobs of one head each
// (0.033 ms against 0.045 over 500 slots, alternated): reading each key once outweighs the idle thread.
// Causal rows cost as many slots as they see, and the threads take equal runs of jobs: rows in the order 0,
// T-1, 1, T-2, ... so that any run of them costs about the same (in row order, one of two threads had 58% of a
// prompt's attention and the other waited for it). The order changes no bits: each job is one row's own.
// Scratch: scores [MAXH * S], slots [S], kps, vps [S] for the part's S.
constexpr int64_t MAXH = 4;  // query heads computed together (their accumulators fit the registers)

template <class R>
void attend_job(const AttendArgs& a, int64_t job, float* scores, int64_t* slots, const uint8_t** kps,
                const uint8_t** vps) {
  const int64_t T = a.T, hd = a.hd, S = a.S, BS = a.BS, group = a.nq / a.nkv;
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  const int64_t b = job / (a.nkv * T), g = (job / T) % a.nkv, i = job % T, t = i % 2 ? T - 1 - i / 2 : i / 2;
  int64_t n = 0;
  if (a.mask) {
    const bool* mrow = a.mask + ((a.mrows == 1 ? 0 : b) * T + t) * S;
    for (int64_t j = 0; j < S; ++j)
      if (mrow[j]) slots[n++] = j;
  } else {
    for (int64_t j = 0; j <= a.start + t; ++j) slots[n++] = j;
  }
  // each visible slot's key and value: the slots ascend, so the block walks forward (no division per slot)
  const int64_t* tb = a.table + (a.trows == 1 ? 0 : b) * a.nb;
  for (int64_t i = 0, blk = 0, base = 0; i < n; ++i) {
    while (slots[i] >= base + BS) ++blk, base += BS;
    const int64_t off = slots[i] - base;
    kps[i] = a.k + tb[blk] * a.k0 + g * a.k1 + off * a.k2;
    vps[i] = a.v + tb[blk] * a.v0 + g * a.v1 + off * a.v2;
  }
  // the group's heads in runs of at most MAXH, as evenly as they split (a group of 5: 3 then 2)
  const int64_t runs = (group + MAXH - 1) / MAXH;
  for (int64_t r = 0, h0 = g * group; r < runs; ++r) {
    const int64_t H = (group - (h0 - g * group) + (runs - r) - 1) / (runs - r);
    const float* qs[MAXH];
    float *o[MAXH], *sc[MAXH];
    for (int64_t u = 0; u < H; ++u) {
      const int64_t at = b * a.qb + (h0 + u) * a.qh + t * a.qt;
      qs[u] = a.q + at;
      o[u] = a.out + at;
      sc[u] = scores + u * S;
    }
    h0 += H;
    if (n == 0) {
      for (int64_t u = 0; u < H; ++u) std::fill(o[u], o[u] + hd, 0.f);
      continue;
    }
    switch (H) {
      case 1: attend_run<R, 1>(qs, kps, vps, n, hd, scale, sc, o); break;
      case 2: attend_run<R, 2>(qs, kps, vps, n, hd, scale, sc, o); break;
      case 3: attend_run<R, 3>(qs, kps, vps, n, hd, scale, sc, o); break;
      default: attend_run<R, 4>(qs, kps, vps, n, hd, scale, sc, o);
    }
  }
}

// Every part's jobs in one run over the pool's threads: a batch step's sequences were one call each, and the
// 16 sequences of a decoding batch paid 16 dispatches, 3 jobs on 2 threads each, per layer
template <class R>
void attend_body(const std::vector<AttendArgs>& parts) {
  std::vector<int64_t> first(parts.size() + 1, 0);  // part p's jobs are first[p]..first[p+1]
  int64_t S = 0;
  for (size_t p = 0; p < parts.size(); ++p) {
    first[p + 1] = first[p] + parts[p].B * parts[p].nkv * parts[p].T;
    S = std::max(S, parts[p].S);
  }
  parallel_chunks(0, first.back(), 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> scores(MAXH * S);
    std::vector<int64_t> slots(S);
    std::vector<const uint8_t*> kps(S), vps(S);
    size_t p = std::upper_bound(first.begin(), first.end(), lo) - first.begin() - 1;
    for (int64_t job = lo; job < hi; ++job) {
      while (job >= first[p + 1]) ++p;
      attend_job<R>(parts[p], job - first[p], scores.data(), slots.data(), kps.data(), vps.data());
    }
  });
}

void attend_parts(KVKind kind, const std::vector<AttendArgs>& parts) {
  switch (kind) {
    case KVKind::F32: attend_body<KVF32>(parts); break;
    case KVKind::F16: attend_body<KVF16>(parts); break;
    case KVKind::Q8_0: attend_body<KVQ8>(parts); break;
  }
}

// The checks of a call's keys, values and mask, and its part's arguments; `held` keeps the mask's bool copy
// alive for the call. q, out: see AttendArgs; B, nq, T, hd: the queries' shape.
AttendArgs attend_part(const float* q, float* out, int64_t qb, int64_t qh, int64_t qt, int64_t B, int64_t nq,
                       int64_t T, int64_t hd, const Keys& keys, int64_t start, const c10::optional<at::Tensor>& mask,
                       std::vector<at::Tensor>& held) {
  const int64_t nkv = keys.k.size(1), N = keys.k.size(0), BS = keys.k.size(2);
  TORCH_CHECK(hd % 8 == 0 && nq % nkv == 0, "attention needs head_dim % 8 == 0 and whole query groups");
  TORCH_CHECK(keys.v.scalar_type() == keys.k.scalar_type(), "keys and values must be stored alike");
  kv_kind(keys.v, hd);
  TORCH_CHECK(keys.k.stride(3) == 1 && keys.v.stride(3) == 1, "keys and values need a contiguous last dim");
  TORCH_CHECK(keys.v.size(0) == N && keys.v.size(2) == BS, "keys and values must have the same blocks");
  const int64_t nb = keys.nb, trows = keys.trows;
  const int64_t* tp = keys.table;
  TORCH_CHECK(trows == B || trows == 1, "the block table must have B rows or one");
  for (int64_t i = 0; i < trows * nb; ++i) TORCH_CHECK(tp[i] >= 0 && tp[i] < N, "block ", tp[i], " is not in the pool");
  const bool* mp = nullptr;
  int64_t mrows = 0, S = nb * BS;
  if (mask.has_value()) {
    const at::Tensor& m = held.emplace_back(mask->to(at::kBool).contiguous());
    TORCH_CHECK(m.dim() == 4 && m.size(2) == T && m.size(3) <= S, "mask must be [B or 1, 1, T, <= S]");
    mp = m.data_ptr<bool>();
    mrows = m.size(0);
    S = m.size(3);
  } else {
    TORCH_CHECK(start + T <= S, "keys hold ", S, " slots, the pass needs ", start + T);
    // no query sees past start + T: the scratch (4 vectors per chunk and layer) is sized by what is visible, not
    // by the session's room, which covers its prompt and max_tokens, up to the whole context
    S = start + T;
  }
  const int64_t ek = keys.k.element_size(), ev = keys.v.element_size();
  return AttendArgs{q, out, qb, qh, qt, static_cast<const uint8_t*>(keys.k.data_ptr()),
                    static_cast<const uint8_t*>(keys.v.data_ptr()), keys.k.stride(0) * ek, keys.k.stride(1) * ek,
                    keys.k.stride(2) * ek, keys.v.stride(0) * ev, keys.v.stride(1) * ev, keys.v.stride(2) * ev,
                    tp, trows, nb, BS, B, nq, nkv, T, hd, S, start, mrows, mp};
}

}  // namespace

// q [B, n_q, T, hd] at slots start..start+T over keys (see Keys in common.h); mask: bool [Bm, 1, T, S] (Bm 1
// or B) of the slots each query row sees, or none (slots 0..start+i, causal). Each (row, head, query) attends
// over its visible slots in slot order: scores <q, k> / sqrt(hd), a softmax with its max and sum taken in
// that order, then the sum of p v in that order. Where a slot's entry lives (which block) changes no
// arithmetic; keys and values in float16 or q8_0 are read as the floats kv.h gives. -> [B, n_q, T, hd]
at::Tensor attend_keys(at::Tensor q, const Keys& keys, int64_t start, c10::optional<at::Tensor> mask) {
  check_float(q, "q");
  q = q.contiguous();
  const int64_t B = q.size(0), nq = q.size(1), T = q.size(2), hd = q.size(3);
  const KVKind kind = kv_kind(keys.k, hd);
  auto out = at::empty_like(q);
  std::vector<at::Tensor> held;
  attend_parts(kind, {attend_part(q.data_ptr<float>(), out.data_ptr<float>(), nq * T * hd, T * hd, hd, B, nq, T, hd,
                                  keys, start, mask, held)});
  return out;
}

// q [M, n_q, hd] float contiguous: the rows of several sequences in turn (seqs[i].T each, their keys and values
// already written) -> [M, n_q, hd], each sequence's rows as attend_keys gives them alone, every sequence's
// jobs in one run over the threads
at::Tensor attend_seqs(at::Tensor q, const std::vector<SeqKV>& seqs) {
  check_float(q, "q");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be contiguous [M, n_q, hd]");
  TORCH_CHECK(!seqs.empty(), "attention needs a sequence");
  const int64_t nq = q.size(1), hd = q.size(2);
  auto out = at::empty_like(q);
  std::vector<at::Tensor> held;
  std::vector<AttendArgs> parts;
  parts.reserve(seqs.size());
  const KVKind kind = kv_kind(seqs[0].k, hd);
  int64_t r0 = 0;
  for (const SeqKV& s : seqs) {
    TORCH_CHECK(kv_kind(s.k, hd) == kind, "every sequence's keys must be stored alike");
    const Keys keys{s.k, s.v, s.table.data_ptr<int64_t>(), 1, s.table.size(0)};
    const int64_t at = r0 * nq * hd;
    parts.push_back(attend_part(q.data_ptr<float>() + at, out.data_ptr<float>() + at, 0, hd, nq * hd, 1, nq, s.T, hd,
                                keys, s.start, s.mask, held));
    r0 += s.T;
  }
  TORCH_CHECK(r0 == q.size(0), "the sequences hold ", r0, " rows, q ", q.size(0));
  attend_parts(kind, parts);
  return out;
}

// keys, values [Bk, n_kv, S, hd] (Bk 1 or B, last dim contiguous, S >= start+T): attend_keys over plain keys,
// each row's one block of S slots
at::Tensor attention(at::Tensor q, at::Tensor keys, at::Tensor values, int64_t start,
                     c10::optional<at::Tensor> mask) {
  const at::Tensor table = at::arange(keys.size(0), at::kLong);
  return attend_keys(q, Keys{keys, values, table.data_ptr<int64_t>(), keys.size(0), 1}, start, mask);
}

namespace {

// silu(g) u = g sigmoid(g) u with sigmoid from e = exp_neg(-|g|) <= 1: 1 / (1 + e) where g >= 0, e / (1 + e)
// below, i.e. (g >= 0 ? g : g e) / (1 + e) * u, the same operations in the 8-lane form. With libm's scalar
// exp a layer's silu_mul took 3.5 / 11.9 / 45.3 us at 1 / 4 / 16 rows of SmolLM2's 1536 on a 2-core Zen 5
// EPYC, all of it on the calling thread (10% of a 16-row pass); this form takes 1.1 / 2.7 / 8.9.
inline float silu_mul1(float g, float u) {
  const float e = exp_neg(-std::fabs(g));
  return (g >= 0.f ? g : g * e) / (1.f + e) * u;
}

#ifdef ES_AVX2
inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 e = exp_neg(_mm256_or_ps(g, sign));  // -|g|
  const __m256 num = _mm256_blendv_ps(_mm256_mul_ps(g, e), g, _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ));
  return _mm256_mul_ps(_mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.f), e)), u);
}
#endif

}  // namespace

// gate_up [..., 2I] -> silu(gate) * up [..., I] (silu_mul1's arithmetic)
at::Tensor silu_mul(at::Tensor gate_up) {
  check_float(gate_up, "gate_up");
  gate_up = gate_up.contiguous();
  const int64_t I = gate_up.size(-1) / 2, rows = gate_up.numel() / (2 * I);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto out = at::empty(sizes, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // rows on the pool's threads as rms_norm's: a layer's silu_mul and two norms over a 1073-row prompt took 1.92 ms
  // on the two threads of a 2-core EPYC against 3.35 on one (alternated, the same bits)
  parallel_chunks(0, rows, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float *g = gp + r * 2 * I, *u = g + I;
      float* o = op + r * I;
      int64_t i = 0;
#ifdef ES_AVX2
      for (; i + 8 <= I; i += 8) _mm256_storeu_ps(o + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
#endif
      for (; i < I; ++i) o[i] = silu_mul1(g[i], u[i]);
    }
  });
  return out;
}

// x [n, hd] float -> [n, row] head vectors stored as kv.h writes them into a cache of `like`'s dtype (float32,
// float16, uint8 for q8_0): what attention_rows writes, for model/kv_format.py's tests
at::Tensor kv_encode(at::Tensor x, at::Tensor like) {
  check_float(x, "x");
  x = x.contiguous();
  const int64_t n = x.size(0), hd = x.size(1);
  const int64_t row = like.scalar_type() == at::kByte ? hd / KV_Q8_BLOCK * KV_Q8_BYTES : hd;
  auto out = at::empty({n, row}, like.options());
  const KVKind kind = kv_kind(out, hd);
  for (int64_t i = 0; i < n; ++i)
    kv_write(kind, x.data_ptr<float>() + i * hd, hd, static_cast<uint8_t*>(out.data_ptr()) + i * row * out.element_size());
  return out;
}
