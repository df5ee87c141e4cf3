// shift_mix forward and backward on the CPU: LayerNorm, token shift and M lerps, one pass over
// the rows. Memory-bound, so every input is read from memory once and every output written once
// per call: OpenMP threads take contiguous ranges of the B·T rows, and a row's few passes (its
// LayerNorm's sums, then the outputs) run on data already in L1. Each thread carries x̂[t-1]
// (the forward keeps it, the backward recomputes it from x[t-1], still in cache, with its mean
// and 1/std) and computes it afresh for its first row; x̂ is never stored.
//
// Layout: x, y_m, dy_m, dx, dx_add [B, T, C] contiguous; weight, bias [C]; mix, dmix [M, C];
// state, state_out and their gradients [B, C]; mean, rstd [B, T]. The M outputs and their
// gradients are arrays of M pointers (a null gradient is absent: zero); a null dstate_out or
// dx_add is zero too.
//
// Forward, per row: n = (x - mean) rstd (two-pass statistics, biased variance), x̂ = n w + b,
//   y_m = x̂ + (x̂[t-1] - x̂) mix_m   (x̂[-1] = state),  state_out = x̂[T-1]
// Backward, per row (nxt = Σ_m dy_m[t+1] mix_m, which row t+1 computes, or dstate_out at
// t = T-1; at t = 0 the row's own Σ_m dy_m mix_m is dstate):
//   dx̂ = Σ_m dy_m (1 - mix_m) + nxt        dmix_m += dy_m (x̂[t-1] - x̂)
//   dw += dx̂ n   db += dx̂   g = dx̂ w     dx = rstd (g - mean_C(g) - n mean_C(g n)) + dx_add
// The parameter gradients are summed per thread (fp64) and the thread partials added in thread
// order at the end: the result depends on the thread count only through rounding. Each thread's
// scratch (those sums and a few rows: the forward's x̂[t-1] and x̂, the backward's carried parts of
// dx̂ and a row of g) and fp64 copies of the parameters are all the kernel allocates.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "../../csrc/simd.h"

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace {

// The math runs in fp64 whatever the storage: x̂ and the outputs are differences of O(1) terms
// that come close to 0, where fp32 arithmetic (the torch composition's) would leave an absolute
// error of a few ulps of 1; in fp64 each output is the correctly rounded value of the exact one
// but for its inputs' rounding. fp32 values are converted as they are loaded and stored, L at a
// time (half a storage vector of them; the forward's output stores join two, see lerps).
typedef simd::Vec<double>::type V;
constexpr int L = simd::Vec<double>::L;

constexpr int64_t GRAIN = 8192;  // elements per thread at least: a smaller share costs more to start than it saves

// L fp32 values in fp64 lanes. GCC 12 lowers __builtin_convertvector from a half-width vector
// through the stack, so x86 takes the one instruction that does it.
inline simd::Vec<double>::type widen(const float* p) {
  simd::Vec<double>::type x;
#if defined(__AVX512F__) && RWKVX_SIMD_BYTES == 64
  const __m512d v = _mm512_cvtps_pd(_mm256_loadu_ps(p));
  std::memcpy(&x, &v, sizeof(x));
#elif defined(__AVX__)
  for (int o = 0; o < simd::Vec<double>::L; o += 4) {  // the AVX-512 layout on AVX2: twice
    const __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(p + o));
    std::memcpy(reinterpret_cast<char*>(&x) + o * sizeof(double), &v, sizeof(v));
  }
#else
  for (int l = 0; l < simd::Vec<double>::L; l++) x[l] = p[l];
#endif
  return x;
}

// The first n values (0 < n <= L) of p in fp64 lanes, the tail lanes 0; and the store back.
template <typename T>
inline V load(const T* p, int n) {
  V x = {};
  if (n == L) {
    if constexpr (sizeof(T) == sizeof(double)) {
      std::memcpy(&x, p, sizeof(x));
      return x;
    } else {
      return widen(p);
    }
  }
  for (int l = 0; l < n; l++) x[l] = p[l];
  return x;
}

template <typename T>
inline void store(T* p, V x, int n) {
  if (n == L) {
    typedef T H __attribute__((vector_size(L * sizeof(T))));
    const H h = __builtin_convertvector(x, H);
    std::memcpy(p, &h, sizeof(h));
    return;
  }
  for (int l = 0; l < n; l++) p[l] = (T)x[l];
}

// Two half vectors as one: [lo, hi].
template <typename H, size_t... I>
inline auto join(H lo, H hi, std::index_sequence<I...>) {
  return __builtin_shufflevector(lo, hi, I...);
}

template <typename H>
inline auto join(H lo, H hi) {
  return join(lo, hi, std::make_index_sequence<2 * sizeof(H) / sizeof(lo[0])>{});
}

inline double lane_sum(V x) {
  double s = 0;
  for (int l = 0; l < L; l++) s += x[l];
  return s;
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

// p in fp64: itself, or converted into `copy` (the parameters, read for every row).
template <typename F>
const double* as_double(const F* p, int64_t n, std::vector<double>& copy) {
  if constexpr (sizeof(F) == sizeof(double)) {
    return p;
  } else {
    copy.assign(p, p + n);
    return copy.data();
  }
}

// The row's mean and 1/std, two passes over it (in L1 for the second), in four chains of adds.
template <typename F>
inline void row_stats(const F* x, int C, double eps, double& mean, double& rstd) {
  V a[4] = {};
  int c = 0;
  for (; c + 4 * L <= C; c += 4 * L)
    for (int k = 0; k < 4; k++) a[k] += load(x + c + k * L, L);
  for (int k = 0; c < C; c += L, k++) a[k] += load(x + c, lanes(C, c));
  mean = lane_sum((a[0] + a[1]) + (a[2] + a[3])) / C;
  for (int k = 0; k < 4; k++) a[k] = V{};
  for (c = 0; c + 4 * L <= C; c += 4 * L)
    for (int k = 0; k < 4; k++) {
      const V d = load(x + c + k * L, L) - mean;
      a[k] += d * d;
    }
  for (int k = 0; c + L <= C; c += L, k++) {
    const V d = load(x + c, L) - mean;
    a[k] += d * d;
  }
  double q = lane_sum((a[0] + a[1]) + (a[2] + a[3]));
  for (; c < C; c++) q += (x[c] - mean) * (x[c] - mean);
  rstd = 1 / std::sqrt(q / C + eps);
}

// A plain loop: the compiler vectorises it, converting fp32 a whole vector at a time.
template <typename F>
inline void lerp_inputs(const F* __restrict x, const double* __restrict w, const double* __restrict b, double mu,
                        double rs, double* __restrict xn, double* __restrict d, int C) {
  for (int c = 0; c < C; c++) {
    const double v = (x[c] - mu) * rs * w[c] + b[c];
    xn[c] = v, d[c] -= v;
  }
}

// y_m = x̂ + d mix_m for every m, a storage vector at a time: the M output streams interleaved
// (the stores are what bounds the forward; whole-vector stores keep the most of them in flight).
template <typename F>
inline void lerps(const double* __restrict xn, const double* __restrict d, const double* __restrict mix,
                  F* const* ys, int64_t offset, int C, int M) {
  typedef typename simd::Vec<F>::type FV;
  constexpr int LF = simd::Vec<F>::L;
  int c = 0;
  for (; c + LF <= C; c += LF) {
    const V x0 = load(xn + c, L), d0 = load(d + c, L);
    const V x1 = LF > L ? load(xn + c + L, L) : V{}, d1 = LF > L ? load(d + c + L, L) : V{};
    for (int m = 0; m < M; m++) {
      const double* mx = mix + (int64_t)m * C + c;
      FV out;
      if constexpr (LF == L) {
        out = x0 + d0 * load(mx, L);
      } else {  // fp32: two fp64 vectors, narrowed and joined
        typedef F H __attribute__((vector_size(sizeof(FV) / 2)));
        out = join(__builtin_convertvector(x0 + d0 * load(mx, L), H),
                   __builtin_convertvector(x1 + d1 * load(mx + L, L), H));
      }
      std::memcpy(ys[m] + offset + c, &out, sizeof(out));
    }
  }
  for (; c < C; c++)
    for (int m = 0; m < M; m++) ys[m][offset + c] = (F)(xn[c] + d[c] * mix[(int64_t)m * C + c]);
}

template <typename F>
void forward(const F* x, const F* weight, const F* bias, const F* mix, const F* state, F* const* ys, F* state_out,
             F* mean, F* rstd, int B, int T, int C, int M, int threads, double eps) {
  const int64_t rows = (int64_t)B * T;
  if (rows == 0 || C == 0) return;
  std::vector<double> wc, bc, mc;
  const double *w64 = as_double(weight, C, wc), *b64 = as_double(bias, C, bc);
  const double* m64 = as_double(mix, (int64_t)M * C, mc);
  const int nt = team(threads, rows, C);
  std::vector<double> rows64((size_t)nt * 2 * C);  // per thread: x̂ of the row before and of this one
#pragma omp parallel num_threads(nt)
  {
    const int i = omp_get_thread_num();
    int64_t r0, r1;
    share(rows, i, omp_get_num_threads(), r0, r1);
    double *prev = rows64.data() + (size_t)i * 2 * C, *cur = prev + C;
    double mu, rs;
    if (r0 < r1 && r0 % T) {  // x̂[t-1] of the first row
      const F* xp = x + (r0 - 1) * C;
      row_stats(xp, C, eps, mu, rs);
      for (int c = 0; c < C; c++) prev[c] = (xp[c] - mu) * rs * w64[c] + b64[c];
    }
    for (int64_t r = r0; r < r1; r++) {
      const int64_t b = r / T, t = r % T;
      row_stats(x + r * C, C, eps, mu, rs);
      mean[r] = (F)mu, rstd[r] = (F)rs;
      if (!t) std::copy(state + b * C, state + (b + 1) * C, prev);
      // x̂ into cur and x̂[t-1] - x̂ into prev, in place; then the outputs
      lerp_inputs(x + r * C, w64, b64, mu, rs, cur, prev, C);
      lerps(cur, prev, m64, ys, r * C, C, M);
      if (t == T - 1) std::copy(cur, cur + C, state_out + b * C);
      std::swap(prev, cur);
    }
  }
}

// The backward of the rows a thread takes, in ascending order (the order the hardware prefetchers
// follow best): row t gives its own part of dx̂, Σ_m dy_m (1 - mix_m), and row t-1's missing one,
// nxt = Σ_m dy_m[t] mix_m, so row t-1 is finished one row later.
template <typename F>
struct Backward {
  const F *const *dys, *dstate_out, *x, *mix, *state, *mean, *rstd, *dx_add;
  const double *w, *b;
  F *dx, *dstate;
  int T, C, M;
  const int* present;
  int P;
  double *dw, *db, *dm, *g;  // the thread's sums and a row of g = dx̂ w

  // Row r's own part of dx̂ into own, its Σ_m dy_m mix_m into nx (dstate at t = 0), dmix's sums.
  void lerp_grads(int64_t r, double* own, double* nx) const {
    const int64_t bb = r / T, t = r % T;
    const F* xr = x + r * C;
    const double mu = mean[r], rs = rstd[r], mu_p = t ? mean[r - 1] : 0, rs_p = t ? rstd[r - 1] : 0;
    for (int c = 0; c < C; c += L) {
      const int n = lanes(C, c);
      const V wv = load(w + c, n), nc = (load(xr + c, n) - mu) * rs;
      // x̂[t-1] - x̂[t]: the bias cancels but at t = 0, where x̂[t-1] is the state
      const V d = t ? ((load(xr - C + c, n) - mu_p) * rs_p - nc) * wv
                    : load(state + bb * C + c, n) - (nc * wv + load(b + c, n));
      V o = {}, s = {};
      for (int p = 0; p < P; p++) {
        const int m = present[p];
        const V dy = load(dys[m] + r * C + c, n), dymx = dy * load(mix + (int64_t)m * C + c, n);
        o += dy - dymx, s += dymx;
        double* dmc = dm + (int64_t)m * C + c;
        store(dmc, load(dmc, n) + dy * d, n);
      }
      store(own + c, o, n);
      if (t)
        store(nx + c, s, n);
      else
        store(dstate + bb * C + c, s, n);
    }
  }

  // Row r's nxt alone (the row after a thread's range).
  void next_part(int64_t r, double* nx) const {
    for (int c = 0; c < C; c += L) {
      const int n = lanes(C, c);
      V s = {};
      for (int p = 0; p < P; p++) {
        const int m = present[p];
        s += load(dys[m] + r * C + c, n) * load(mix + (int64_t)m * C + c, n);
      }
      store(nx + c, s, n);
    }
  }

  // Row r with dx̂ = own + nxt (the carried row, or dstate_out's row; null: 0).
  template <typename N>
  void finish(int64_t r, const double* own, const N* nxt) const {
    const F* xr = x + r * C;
    const double mu = mean[r], rs = rstd[r];
    V sg[2] = {}, sgn[2] = {};
    for (int c = 0, k = 0; c < C; c += L, k ^= 1) {
      const int n = lanes(C, c);
      const V nc = (load(xr + c, n) - mu) * rs;
      const V dxh = load(own + c, n) + (nxt ? load(nxt + c, n) : V{});
      store(dw + c, load(dw + c, n) + dxh * nc, n), store(db + c, load(db + c, n) + dxh, n);
      const V gv = dxh * load(w + c, n);  // 0 in the tail lanes (w loads 0 there)
      sg[k] += gv, sgn[k] += gv * nc;
      store(g + c, gv, n);
    }
    const double mg = lane_sum(sg[0] + sg[1]) / C, mgn = lane_sum(sgn[0] + sgn[1]) / C;
    const F* add = dx_add ? dx_add + r * C : nullptr;
    F* dxr = dx + r * C;
    for (int c = 0; c < C; c += L) {
      const int n = lanes(C, c);
      const V nc = (load(xr + c, n) - mu) * rs;
      V out = rs * (load(g + c, n) - mg - nc * mgn);
      if (add) out += load(add + c, n);
      store(dxr + c, out, n);
    }
  }

  void rows(int64_t r0, int64_t r1, double* own, double* prev_own, double* nx) const {
    for (int64_t r = r0; r < r1; r++) {
      const int64_t bb = r / T, t = r % T;
      lerp_grads(r, own, nx);
      if (t && r > r0) finish(r - 1, prev_own, nx);
      if (t == T - 1) finish(r, own, dstate_out ? dstate_out + bb * C : nullptr);
      std::swap(own, prev_own);
    }
    if ((r1 - 1) % T != T - 1) {  // the last row's nxt is the next range's first row's
      next_part(r1, nx);
      finish(r1 - 1, prev_own, nx);
    }
  }
};

template <typename F>
void backward(const F* const* dys, const F* dstate_out, const F* x, const F* weight, const F* bias, const F* mix,
              const F* state, const F* mean, const F* rstd, const F* dx_add, F* dx, F* dweight, F* dbias, F* dmix,
              F* dstate, int B, int T, int C, int M, int threads) {
  const int64_t rows = (int64_t)B * T;
  const int nsum = (M + 2) * C;  // per thread: dweight, dbias, dmix (summed at the end), then four row buffers
  if (rows == 0 || C == 0) {
    std::fill(dweight, dweight + C, F(0)), std::fill(dbias, dbias + C, F(0));
    std::fill(dmix, dmix + (int64_t)M * C, F(0)), std::fill(dstate, dstate + (int64_t)B * C, F(0));
    return;
  }
  int present[8], P = 0;  // the lerps with a gradient (M <= 8)
  for (int m = 0; m < M; m++)
    if (dys[m]) present[P++] = m;
  std::vector<double> wc, bc;
  const double *w64 = as_double(weight, C, wc), *b64 = as_double(bias, C, bc);
  const int nt = team(threads, rows, C);
  const size_t stride = nsum + 4 * C;
  std::vector<double> scratch((size_t)nt * stride);  // zero: a thread that gets no rows adds nothing
#pragma omp parallel num_threads(nt)
  {
    const int i = omp_get_thread_num(), used = omp_get_num_threads();
    int64_t r0, r1;
    share(rows, i, used, r0, r1);
    double* acc = scratch.data() + (size_t)i * stride;
    const Backward<F> k{dys, dstate_out, x, mix, state, mean, rstd, dx_add, w64, b64, dx, dstate, T, C, M,
                        present, P, acc, acc + C, acc + 2 * C, acc + nsum + 3 * C};
    if (r0 < r1) k.rows(r0, r1, acc + nsum, acc + nsum + C, acc + nsum + 2 * C);
#pragma omp barrier
    // the thread partials, added in thread order
#pragma omp for schedule(static)
    for (int j = 0; j < nsum; j++) {
      double s = scratch[j];
      for (int q = 1; q < used; q++) s += scratch[(size_t)q * stride + j];
      (j < C ? dweight[j] : j < 2 * C ? dbias[j - C] : dmix[j - 2 * C]) = (F)s;
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
