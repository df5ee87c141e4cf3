// shift_mix forward and backward on the CPU: LayerNorm, token shift and M lerps, one pass over
// the rows. Memory-bound, so every input is read from memory once and every output written once
// per call: OpenMP threads take contiguous ranges of the B·T rows, and a row's few passes (its
// LayerNorm's sums, then the outputs) run on data already in L1. x̂[t-1] is recomputed from
// x[t-1] (the previous row, still in cache) with its own mean and 1/std, never stored.
//
// Layout: x, y_m, dy_m, dx, dx_add [B, T, C] contiguous; weight, bias [C]; mix, dmix [M, C];
// state, state_out and their gradients [B, C]; mean, rstd [B, T]. The M outputs and their
// gradients are arrays of M pointers (a null gradient is absent: zero); a null dstate_out or
// dx_add is zero too.
//
// Forward, per row: n = (x - mean) rstd (two-pass statistics, biased variance), x̂ = n w + b,
//   y_m = x̂ + (x̂[t-1] - x̂) mix_m   (x̂[-1] = state),  state_out = x̂[T-1]
// Backward, per row in reverse (nxt = Σ_m dy_m[t+1] mix_m, carried from the row after, or
// dstate_out at t = T-1; at t = 0 its own Σ_m dy_m mix_m is dstate):
//   dx̂ = Σ_m dy_m (1 - mix_m) + nxt        dmix_m += dy_m (x̂[t-1] - x̂)
//   dw += dx̂ n   db += dx̂   g = dx̂ w     dx = rstd (g - mean_C(g) - n mean_C(g n)) + dx_add
// The parameter gradients are summed per thread (fp64) and the thread partials added in thread
// order at the end: the result depends on the thread count only through rounding. Each thread's
// scratch (those sums, the carried nxt and a row of g) is all the kernel allocates.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../../csrc/simd.h"

namespace {

using simd::hsum;

// The math runs in fp64 whatever the storage: x̂ and the outputs are differences of O(1) terms
// that come close to 0, where fp32 arithmetic (the torch composition's) would leave an absolute
// error of a few ulps of 1; in fp64 each output is the correctly rounded value of the exact one
// but for its inputs' rounding. The kernel is memory-bound, so the wider arithmetic is hidden.
typedef simd::Vec<double>::type V;
constexpr int L = simd::Vec<double>::L;

constexpr int64_t GRAIN = 8192;  // elements per thread at least: a smaller share costs more to start than it saves

// The first n values (0 < n <= L) of p as fp64 lanes, the tail lanes 0; and the store back.
template <typename F>
inline V load(const F* p, int n) {
  V x = {};
  if constexpr (sizeof(F) == sizeof(double)) {
    if (n == L) {
      std::memcpy(&x, p, sizeof(x));
      return x;
    }
  } else {
    typedef F H __attribute__((vector_size(L * sizeof(F))));
    if (n == L) {
      H h;
      std::memcpy(&h, p, sizeof(h));
      return __builtin_convertvector(h, V);
    }
  }
  for (int l = 0; l < n; l++) x[l] = p[l];
  return x;
}

template <typename F>
inline void store(F* p, V x, int n) {
  if constexpr (sizeof(F) == sizeof(double)) {
    if (n == L) {
      std::memcpy(p, &x, sizeof(x));
      return;
    }
  } else {
    typedef F H __attribute__((vector_size(L * sizeof(F))));
    if (n == L) {
      const H h = __builtin_convertvector(x, H);
      std::memcpy(p, &h, sizeof(h));
      return;
    }
  }
  for (int l = 0; l < n; l++) p[l] = (F)x[l];
}

inline int lanes(int C, int c) { return C - c < L ? C - c : L; }

// Rows [r0, r1) of thread i of nt: contiguous, in thread order.
inline void share(int64_t rows, int i, int nt, int64_t& r0, int64_t& r1) {
  r0 = rows * i / nt, r1 = rows * (i + 1) / nt;
}

inline int team(int threads, int64_t rows, int C) {
  const int64_t by_size = std::max<int64_t>(1, rows * C / GRAIN);
  return (int)std::max<int64_t>(1, std::min<int64_t>({(int64_t)threads, rows, by_size}));
}

// The row's mean and 1/std, two passes over it (it is in L1 for the second), two chains each.
template <typename F>
inline void row_stats(const F* x, int C, double eps, double& mean, double& rstd) {
  V a0 = {}, a1 = {};
  int c = 0;
  for (; c + 2 * L <= C; c += 2 * L) a0 += load(x + c, L), a1 += load(x + c + L, L);
  if (c < C) a0 += load(x + c, lanes(C, c)), a1 += c + L < C ? load(x + c + L, lanes(C, c + L)) : V{};
  mean = hsum<double>(a0 + a1) / C;
  a0 = a1 = V{};
  for (c = 0; c + 2 * L <= C; c += 2 * L) {
    const V d0 = load(x + c, L) - mean, d1 = load(x + c + L, L) - mean;
    a0 += d0 * d0, a1 += d1 * d1;
  }
  for (; c < C; c++) a0[0] += (x[c] - mean) * (x[c] - mean);
  rstd = 1 / std::sqrt(hsum<double>(a0 + a1) / C + eps);
}

template <typename F>
void forward(const F* x, const F* weight, const F* bias, const F* mix, const F* state, F* const* ys, F* state_out,
             F* mean, F* rstd, int B, int T, int C, int M, int threads, double eps) {
  const int64_t rows = (int64_t)B * T;
  if (rows == 0 || C == 0) return;
  const int nt = team(threads, rows, C);
#pragma omp parallel num_threads(nt)
  {
    int64_t r0, r1;
    share(rows, omp_get_thread_num(), omp_get_num_threads(), r0, r1);
    double mu_p = 0, rs_p = 0;
    if (r0 < r1 && r0 % T) row_stats(x + (r0 - 1) * C, C, eps, mu_p, rs_p);  // x̂[t-1] of the first row
    for (int64_t r = r0; r < r1; r++) {
      const int64_t b = r / T, t = r % T;
      const F* xr = x + r * C;
      double mu, rs;
      row_stats(xr, C, eps, mu, rs);
      mean[r] = (F)mu, rstd[r] = (F)rs;
      for (int c = 0; c < C; c += L) {
        const int n = lanes(C, c);
        const V w = load(weight + c, n), bi = load(bias + c, n);
        const V xn = (load(xr + c, n) - mu) * rs * w + bi;
        const V xp = t ? (load(xr - C + c, n) - mu_p) * rs_p * w + bi : load(state + b * C + c, n);
        const V d = xp - xn;
        for (int m = 0; m < M; m++) store(ys[m] + r * C + c, xn + d * load(mix + (int64_t)m * C + c, n), n);
        if (t == T - 1) store(state_out + b * C + c, xn, n);
      }
      mu_p = mu, rs_p = rs;
    }
  }
}

template <typename F>
void backward(const F* const* dys, const F* dstate_out, const F* x, const F* weight, const F* bias, const F* mix,
              const F* state, const F* mean, const F* rstd, const F* dx_add, F* dx, F* dweight, F* dbias, F* dmix,
              F* dstate, int B, int T, int C, int M, int threads) {
  const int64_t rows = (int64_t)B * T;
  const int nsum = (M + 2) * C;  // per thread: dweight, dbias, dmix, then the carried nxt and g's row
  if (rows == 0 || C == 0) {
    std::fill(dweight, dweight + C, F(0)), std::fill(dbias, dbias + C, F(0));
    std::fill(dmix, dmix + (int64_t)M * C, F(0)), std::fill(dstate, dstate + (int64_t)B * C, F(0));
    return;
  }
  int present[8], P = 0;  // the lerps with a gradient (M <= 8)
  for (int m = 0; m < M; m++)
    if (dys[m]) present[P++] = m;
  const int nt = team(threads, rows, C);
  std::vector<double> scratch((size_t)nt * (nsum + 2 * C));  // zero: a thread that gets no rows adds nothing
#pragma omp parallel num_threads(nt)
  {
    const int i = omp_get_thread_num(), used = omp_get_num_threads();
    int64_t r0, r1;
    share(rows, i, used, r0, r1);
    double* acc = scratch.data() + (size_t)i * (nsum + 2 * C);
    double *dw = acc, *db = acc + C, *dm = acc + 2 * C, *carry = acc + nsum, *grow = carry + C;
    if (r0 < r1 && (r1 - 1) % T != T - 1) {  // the last row's nxt, from the row after the range
      for (int c = 0; c < C; c += L) {
        const int n = lanes(C, c);
        V s = {};
        for (int p = 0; p < P; p++) {
          const int m = present[p];
          s += load(dys[m] + r1 * C + c, n) * load(mix + (int64_t)m * C + c, n);
        }
        store(carry + c, s, n);
      }
    }
    for (int64_t r = r1 - 1; r >= r0; r--) {
      const int64_t b = r / T, t = r % T;
      const F* xr = x + r * C;
      const double mu = mean[r], rs = rstd[r];
      const double mu_p = t ? mean[r - 1] : 0, rs_p = t ? rstd[r - 1] : 0;
      const double* nxt = t < T - 1 ? carry : nullptr;
      const F* nxt_state = t == T - 1 && dstate_out ? dstate_out + b * C : nullptr;
      double* nx_out = t ? carry : nullptr;  // at t = 0 the sum is dstate
      F* dxr = dx + r * C;
      V sg = {}, sgn = {};
      for (int c = 0; c < C; c += L) {
        const int n = lanes(C, c);
        const V w = load(weight + c, n);
        const V nc = (load(xr + c, n) - mu) * rs;
        // x̂[t-1] - x̂[t]: the bias cancels but at t = 0, where x̂[t-1] is the state
        const V d = t ? ((load(xr - C + c, n) - mu_p) * rs_p - nc) * w
                      : load(state + b * C + c, n) - (nc * w + load(bias + c, n));
        V cur = nxt ? load(nxt + c, n) : nxt_state ? load(nxt_state + c, n) : V{}, nx = {};
        for (int p = 0; p < P; p++) {
          const int m = present[p];
          const V dy = load(dys[m] + r * C + c, n), dymx = dy * load(mix + (int64_t)m * C + c, n);
          cur += dy - dymx, nx += dymx;
          double* dmc = dm + (int64_t)m * C + c;
          store(dmc, load(dmc, n) + dy * d, n);
        }
        if (nx_out)
          store(nx_out + c, nx, n);
        else
          store(dstate + b * C + c, nx, n);
        store(dw + c, load(dw + c, n) + cur * nc, n), store(db + c, load(db + c, n) + cur, n);
        const V g = cur * w;  // 0 in the tail lanes (w loads 0 there)
        sg += g, sgn += g * nc;
        store(grow + c, g, n);
      }
      const double mg = hsum<double>(sg) / C, mgn = hsum<double>(sgn) / C;
      const F* addr = dx_add ? dx_add + r * C : nullptr;
      for (int c = 0; c < C; c += L) {
        const int n = lanes(C, c);
        const V nc = (load(xr + c, n) - mu) * rs;
        V out = rs * (load(grow + c, n) - mg - nc * mgn);
        if (addr) out += load(addr + c, n);
        store(dxr + c, out, n);
      }
    }
#pragma omp barrier
    // the thread partials, added in thread order
#pragma omp for schedule(static)
    for (int c0 = 0; c0 < nsum; c0 += L) {
      const int n = lanes(nsum, c0);
      V s = load(scratch.data() + c0, n);
      for (int j = 1; j < used; j++) s += load(scratch.data() + (size_t)j * (nsum + 2 * C) + c0, n);
      for (int l = 0; l < n; l++) {
        const int k = c0 + l;
        (k < C ? dweight[k] : k < 2 * C ? dbias[k - C] : dmix[k - 2 * C]) = (F)s[l];
      }
    }
  }
}

}  // namespace

extern "C" {

#define RWKVX_EXPORT(F, SUFFIX)                                                                                    \
  void shift_mix_forward_##SUFFIX(const F* x, const F* weight, const F* bias, const F* mix, const F* state,      \
                                  F* const* ys, F* state_out, F* mean, F* rstd, int B, int T, int C, int M,        \
                                  int threads, double eps) {                                                       \
    forward<F>(x, weight, bias, mix, state, ys, state_out, mean, rstd, B, T, C, M, threads, eps);              \
  }                                                                                                                \
  void shift_mix_backward_##SUFFIX(const F* const* dys, const F* dstate_out, const F* x, const F* weight,        \
                                   const F* bias, const F* mix, const F* state, const F* mean, const F* rstd,      \
                                   const F* dx_add, F* dx, F* dweight, F* dbias, F* dmix, F* dstate, int B, int T, \
                                   int C, int M, int threads) {                                                    \
    backward<F>(dys, dstate_out, x, weight, bias, mix, state, mean, rstd, dx_add, dx, dweight, dbias, dmix,       \
                dstate, B, T, C, M, threads);                                                                      \
  }

#ifdef RWKVX_FP32
RWKVX_EXPORT(float, f32)
#endif
#ifdef RWKVX_FP64
RWKVX_EXPORT(double, f64)
#endif
}
