// rwkv7_out forward and backward on the CPU: RWKV-7's per-head GroupNorm (ln_x), the bonus and the
// output gate, one pass over each tensor. OpenMP over ranges of the B·T rows; each row's H heads
// of N channels in SIMD vectors (any N: a partial last vector is loaded zero-filled, masked where
// a zero would count, and stored lane by lane).
//
// Layout: y, bonus, g, out and their gradients [rows, C] contiguous (rows = B·T, C = H·N); weight
// and bias [C]; mean and rstd [rows, H] in fp64, saved by the forward for the backward. Per head:
//   mean = Σ y / N    rstd = 1 / sqrt(Σ (y - mean)² / N + eps)    n = (y - mean) rstd
//   out = (n ⊙ weight + bias + bonus) ⊙ g
// Backward, with e = dout ⊙ g and q = e ⊙ weight:
//   dg = dout ⊙ (n ⊙ weight + bias + bonus)    dbonus = e    dweight += e ⊙ n    dbias += e
//   dy = rstd (q - mean_N(q) - n mean_N(q ⊙ n))
// Each head takes a sweep per sum and one for the outputs, over data that stays in L1; a row does
// every head's sums before any head's outputs, so that the sums' scalar tail (cross-lane adds,
// sqrt, division) overlaps other heads' vector work. weight and bias are converted to fp64 once
// per call. The parameter gradients (sums over the rows) go to per-thread partials, summed over
// the threads in order at the end: deterministic for a given thread count.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../../csrc/simd.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

using simd::Vec;

// The math runs in fp64 vectors (half as many lanes as fp32's) for fp32 data too: dy is a
// difference of terms much larger than itself (its N values sum to 0), so fp32 intermediates
// (n, q, rstd) would leave errors of a few fp32 ulps of those terms in it (gate A's multihead
// case: 1.04e-3 in fp32). The forward's n ⊙ weight + bias + bonus, and dg's, cancel the same way
// (the fp32 reference reaches 2.4e-4 on out), so they stay fp64 too, which keeps every column
// within a few 1e-8. Memory stays in F.
typedef Vec<double>::type VD;
constexpr int L = Vec<double>::L;
constexpr int kBlock = 64;  // rows per partial sum of the parameter gradients

// The first n of L values at p (n > 0) as fp64; the lanes from n on are zero. The partial
// vector has a path of its own: one shared with the full load would keep the vector on the stack.
template <typename F>
inline VD ld(const F* p, int n) {
  typedef F VF __attribute__((vector_size(L * sizeof(F))));
  if (n >= L) {
    if constexpr (sizeof(F) == 4) {  // GCC 12 converts a half-width fp32 vector in pieces
#if defined(__AVX512F__) && RWKVX_SIMD_BYTES == 64
      return (VD)_mm512_cvtps_pd(_mm256_loadu_ps(p));
#elif defined(__AVX__) && RWKVX_SIMD_BYTES == 32
      return (VD)_mm256_cvtps_pd(_mm_loadu_ps(p));
#elif defined(__SSE2__) && RWKVX_SIMD_BYTES == 16
      return (VD)_mm_cvtps_pd(_mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#endif
    }
    VF x;
    std::memcpy(&x, p, sizeof(x));
    return __builtin_convertvector(x, VD);
  }
  VD x = {};
  for (int l = 0; l < n; l++) x[l] = p[l];
  return x;
}

template <typename F>
inline void st(F* p, VD x, int n) {
  typedef F VF __attribute__((vector_size(L * sizeof(F))));
  if (n >= L) {
    const VF y = __builtin_convertvector(x, VF);
    std::memcpy(p, &y, sizeof(y));
    return;
  }
  for (int l = 0; l < n; l++) p[l] = F(x[l]);
}

// x with the lanes from n on zeroed.
inline VD first(VD x, int n) {
  if (n < L)
    for (int l = n; l < L; l++) x[l] = 0;
  return x;
}

// f(i, n) over a head's N channels, L at a time: the whole vectors with n = L, so that their code
// (f is inlined at both calls) has no partial-vector paths, then the partial one if any.
#define RWKVX_INLINE __attribute__((always_inline))
template <typename Fn>
RWKVX_INLINE inline void sweep(int N, Fn&& f) {
  int i = 0;
  for (; i + L <= N; i += L) f(i, L);
  if (i < N) f(i, N - i);
}

// K sums over a head's N channels into out[K]: f(i, n, s) adds the terms of channels i .. i + n
// to the vectors s[K]. Four sets of partial sums, so that a head is not one chain of dependent
// adds (at N = 64, sixteen of them, twice per head, would set the pace).
template <int K, typename Fn>
inline void head_sums(int N, double* out, Fn f) {
  VD s0[K] = {}, s1[K] = {}, s2[K] = {}, s3[K] = {};
  int i = 0;
  for (; i + 4 * L <= N; i += 4 * L) f(i, L, s0), f(i + L, L, s1), f(i + 2 * L, L, s2), f(i + 3 * L, L, s3);
  for (; i < N; i += L) f(i, std::min(L, N - i), s0);
  for (int k = 0; k < K; k++) out[k] = simd::hsum<double>((s0[k] + s1[k]) + (s2[k] + s3[k]));
}

// weight and bias in fp64, converted once per call rather than on every row.
template <typename F>
std::vector<double> to_fp64(const F* p, int C) {
  return std::vector<double>(p, p + C);
}

// One row of the forward: every head's statistics first, then every head's outputs, so that the
// statistics' scalar tail (sums across lanes, the square root, the division) overlaps other
// heads' vector work instead of holding up its own head's outputs.
template <typename F>
RWKVX_INLINE inline void forward_row(const F* y, const F* bonus, const F* g, const double* wd, const double* bd,
                                     F* out, double* mean, double* rstd, int64_t row, int H, int N, double eps) {
  const int64_t off = row * H * N;
  y += off, bonus += off, g += off, out += off, mean += row * H, rstd += row * H;
  const double inv_n = 1.0 / N;
  for (int h = 0; h < H; h++) {
    const F* yh = y + h * N;
    // One sweep for both moments of d = y - y[0]: var = E[d²] - E[d]², and since
    // (y[0] - mean)² <= N var, E[d²] <= (N + 1) var: the difference costs at most
    // log2(N + 1) of fp64's 53 bits, whatever the mean.
    const double y0 = yh[0];
    double sums[2];
    head_sums<2>(N, sums, [&](int i, int n, VD* s) {
      const VD d = first(ld(yh + i, n) - y0, n);
      s[0] += d, s[1] += d * d;
    });
    const double md = sums[0] * inv_n;
    mean[h] = y0 + md, rstd[h] = 1 / std::sqrt(std::max(sums[1] * inv_n - md * md, 0.0) + eps);
  }
  for (int h = 0; h < H; h++) {
    const double mu = mean[h], rs = rstd[h];
    sweep(N, [&](int i, int n) RWKVX_INLINE {
      const int c = h * N + i;
      const VD t = (ld(y + c, n) - mu) * (rs * ld(wd + c, n)) + ld(bd + c, n) + ld(bonus + c, n);
      st(out + c, t * ld(g + c, n), n);
    });
  }
}

template <typename F>
void forward(const F* y, const F* bonus, const F* g, const F* weight, const F* bias, F* out, double* mean,
             double* rstd, int64_t rows, int H, int N, double eps, int threads) {
  const std::vector<double> wd = to_fp64(weight, H * N), bd = to_fp64(bias, H * N);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t row = 0; row < rows; row++)
    forward_row(y, bonus, g, wd.data(), bd.data(), out, mean, rstd, row, H, N, eps);
}

// One row of the backward, as the forward: every head's two sums (into mq [2H]), then every
// head's outputs, whose parameter-gradient terms go to the partials [2][C].
template <typename F>
RWKVX_INLINE inline void backward_row(const F* y, const F* bonus, const F* g, const double* wd, const double* bd,
                                      const double* mean, const double* rstd, const F* dout, F* dy, F* dbonus, F* dg,
                                      double* part, double* mq, int64_t row, int H, int N) {
  const int C = H * N;
  const int64_t off = row * C;
  y += off, bonus += off, g += off, dout += off, dy += off, dbonus += off, dg += off;
  mean += row * H, rstd += row * H;
  const double inv_n = 1.0 / N;
  for (int h = 0; h < H; h++) {
    const double mu = mean[h], rs = rstd[h];
    const int c0 = h * N;
    double sums[2];
    head_sums<2>(N, sums, [&](int i, int n, VD* s) {
      const int c = c0 + i;
      const VD q = ld(dout + c, n) * ld(g + c, n) * ld(wd + c, n);  // 0 past n
      s[0] += q, s[1] += q * (ld(y + c, n) - mu);
    });
    mq[2 * h] = sums[0] * inv_n, mq[2 * h + 1] = sums[1] * rs * inv_n;
  }
  double *pw = part, *pb = part + C;
  for (int h = 0; h < H; h++) {
    const double mu = mean[h], rs = rstd[h], m = mq[2 * h], mn = mq[2 * h + 1];
    sweep(N, [&](int i, int n) RWKVX_INLINE {
      const int c = h * N + i;
      const VD wt = ld(wd + c, n), nv = (ld(y + c, n) - mu) * rs, dot = ld(dout + c, n);
      const VD e = dot * ld(g + c, n);
      st(dg + c, dot * (nv * wt + ld(bd + c, n) + ld(bonus + c, n)), n);
      st(dbonus + c, e, n);
      st(dy + c, rs * (e * wt - m - nv * mn), n);
      st(pw + c, ld(pw + c, n) + e * nv, n), st(pb + c, ld(pb + c, n) + e, n);
    });
  }
}

// The parameter gradients' sums over rows: each thread's range of rows adds into its partials,
// those into its totals every kBlock rows, and the totals over the threads in order make
// dweight and dbias: deterministic for a given thread count.
template <typename F>
void backward(const F* y, const F* bonus, const F* g, const F* weight, const F* bias, const double* mean,
              const double* rstd, const F* dout, F* dy, F* dbonus, F* dg, F* dweight, F* dbias, int64_t rows, int H,
              int N, int threads) {
  const int C = H * N;
  const std::vector<double> wd = to_fp64(weight, C), bd = to_fp64(bias, C);
  std::vector<double> totals((size_t)threads * 2 * C, 0.0);
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t lo = rows * t / nt, hi = rows * (t + 1) / nt;
    std::vector<double> part((size_t)2 * C, 0.0), mq((size_t)2 * H);
    double* mine = totals.data() + (size_t)t * 2 * C;
    for (int64_t r0 = lo; r0 < hi; r0 += kBlock) {
      for (int64_t row = r0; row < std::min(hi, r0 + kBlock); row++)
        backward_row(y, bonus, g, wd.data(), bd.data(), mean, rstd, dout, dy, dbonus, dg, part.data(), mq.data(), row,
                     H, N);
      for (size_t j = 0; j < part.size(); j++) mine[j] += part[j], part[j] = 0;
    }
  }
  F* const grads[2] = {dweight, dbias};
  for (int p = 0; p < 2; p++)
    for (int c = 0; c < C; c++) {
      double s = 0;
      for (int t = 0; t < threads; t++) s += totals[((size_t)t * 2 + p) * C + c];
      grads[p][c] = F(s);
    }
}

}  // namespace

extern "C" {

#define RWKVX_EXPORT(F, SUFFIX)                                                                                   \
  void rwkv7_out_forward_##SUFFIX(const F* y, const F* bonus, const F* g, const F* weight, const F* bias, F* out, \
                                  double* mean, double* rstd, int rows, int H, int N, int threads, double eps) {  \
    forward<F>(y, bonus, g, weight, bias, out, mean, rstd, rows, H, N, eps, threads);                             \
  }                                                                                                               \
  void rwkv7_out_backward_##SUFFIX(const F* y, const F* bonus, const F* g, const F* weight, const F* bias,        \
                                   const double* mean, const double* rstd, const F* dout, F* dy, F* dbonus,       \
                                   F* dg, F* dweight, F* dbias, int rows, int H, int N, int threads) {            \
    backward<F>(y, bonus, g, weight, bias, mean, rstd, dout, dy, dbonus, dg, dweight, dbias, rows, H, N, threads); \
  }

RWKVX_EXPORT_PRECISIONS
}
