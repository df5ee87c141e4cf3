// WKV7 forward and backward on the CPU: one (batch, head) per OpenMP task, the
// N x N state kept in cache, every inner loop a unit-stride SIMD loop.
//
// Layout: inputs [B, T, H, N] contiguous; w is the effective decay exp(w_log),
// computed by the caller with torch's vectorised exp; states [B, H, N, N] with
// row i = value channel, column j = key channel; snapshots
// [B, H, n_chunks, N, N] hold the state before the first step of each chunk.
//
// Forward runs on the transposed state (row = key channel), where S a and S r
// become axpys over rows: no horizontal sums. Backward recomputes a chunk's
// states from its snapshot ([value, key] layout), then runs the reverse scan
// one row i at a time, so that five of its seven products are column sums
// kept in registers and only dv and dsa need a horizontal sum:
//   dS   += dy_t r_tᵀ
//   dv_i  = dS_i · k        dsa_i = dS_i · b
//   dr   += S_t,i dy_i      dk    += dS_i v_i      db += dS_i sa_i
//   dw   += dS_i ⊙ S_prev,i da    += S_prev,i dsa_i
//   dS_i  = dS_i ⊙ w + dsa_i a
// (dw is then multiplied by w: the gradient of the log-decay). Head sizes 32,
// 64 and 128 use compile-time N with explicit 64-byte vectors; others a generic
// loop. Nothing divides by the decay, so any w in (0, 1] is exact.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// 64-byte SIMD vectors through GCC/Clang vector extensions (one zmm register with
// AVX-512, two ymm with AVX2); used where the head size is a compile-time constant.
template <typename F>
struct Vec {
  typedef F type __attribute__((vector_size(64)));
  static constexpr int L = 64 / sizeof(F);
};

template <typename F>
inline typename Vec<F>::type load(const F* p) {
  typename Vec<F>::type x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

template <typename F>
inline void store(F* p, typename Vec<F>::type x) {
  std::memcpy(p, &x, sizeof(x));
}

// Horizontal sum by halving (64 -> 32 -> 16 bytes), then the last lanes.
template <typename F>
inline F hsum(typename Vec<F>::type x) {
  typedef F H32 __attribute__((vector_size(32)));
  typedef F H16 __attribute__((vector_size(16)));
  H32 lo, hi;
  std::memcpy(&lo, &x, 32);
  std::memcpy(&hi, reinterpret_cast<const char*>(&x) + 32, 32);
  const H32 s32 = lo + hi;
  H16 l16, h16;
  std::memcpy(&l16, &s32, 16);
  std::memcpy(&h16, reinterpret_cast<const char*>(&s32) + 16, 16);
  const H16 s16 = l16 + h16;
  F s = 0;
  for (int l = 0; l < int(16 / sizeof(F)); l++) s += s16[l];
  return s;
}

// The backward's recomputation of one step, out of place, in the [value, key] layout
// the reverse sweep reads: next = prev diag(w) + (prev a) bᵀ + v kᵀ; keeps sa = prev a.
template <typename F, int NC>
inline void recompute_step_vec(const F* __restrict prev, F* __restrict next, F* __restrict sa,
                               const F* __restrict w, const F* __restrict k, const F* __restrict v,
                               const F* __restrict a, const F* __restrict b) {
  typedef typename Vec<F>::type V;
  constexpr int L = Vec<F>::L, NV = NC / L;
  V kv[NV], bv[NV], av[NV], wv[NV];
  for (int q = 0; q < NV; q++) kv[q] = load(k + q * L), bv[q] = load(b + q * L), av[q] = load(a + q * L);
  for (int q = 0; q < NV; q++) wv[q] = load(w + q * L);
  for (int i = 0; i < NC; i++) {
    const F* __restrict p = prev + (int64_t)i * NC;
    V x[NV], ps = V{};
    for (int q = 0; q < NV; q++) {
      x[q] = load(p + q * L);
      ps += x[q] * av[q];
    }
    const F sai = hsum<F>(ps), vi = v[i];
    sa[i] = sai;
    for (int q = 0; q < NV; q++) store(next + (int64_t)i * NC + q * L, x[q] * wv[q] + sai * bv[q] + vi * kv[q]);
  }
}

// One reverse step of the backward for a compile-time head size: the five column
// accumulators stay in registers for the whole sweep over the rows of dS.
template <typename F, int NC>
inline void backward_step_vec(F* __restrict dS, const F* __restrict St, const F* __restrict Sp,
                              const F* __restrict r, const F* __restrict w, const F* __restrict k,
                              const F* __restrict v, const F* __restrict a, const F* __restrict b,
                              const F* __restrict sa, const F* __restrict dy, F* __restrict dr, F* __restrict dw,
                              F* __restrict dk, F* __restrict dv, F* __restrict da, F* __restrict db) {
  typedef typename Vec<F>::type V;
  constexpr int L = Vec<F>::L, NV = NC / L;
  V rv[NV], kv[NV], bv[NV], av[NV], wv[NV], acc_r[NV], acc_k[NV], acc_b[NV], acc_w[NV], acc_a[NV];
  for (int q = 0; q < NV; q++) {
    rv[q] = load(r + q * L), kv[q] = load(k + q * L), bv[q] = load(b + q * L);
    av[q] = load(a + q * L), wv[q] = load(w + q * L);
    acc_r[q] = acc_k[q] = acc_b[q] = acc_w[q] = acc_a[q] = V{};
  }
  for (int i = 0; i < NC; i++) {
    F* __restrict row = dS + (int64_t)i * NC;
    const F dyi = dy[i], vi = v[i], sai = sa[i];
    V x[NV], pv = V{}, pb = V{};
    for (int q = 0; q < NV; q++) {
      x[q] = load(row + q * L) + dyi * rv[q];
      pv += x[q] * kv[q];
      pb += x[q] * bv[q];
    }
    const F dsai = hsum<F>(pb);
    dv[i] = hsum<F>(pv);
    for (int q = 0; q < NV; q++) {
      const V st = load(St + (int64_t)i * NC + q * L), sp = load(Sp + (int64_t)i * NC + q * L);
      acc_r[q] += st * dyi;
      acc_k[q] += x[q] * vi;
      acc_b[q] += x[q] * sai;
      acc_w[q] += x[q] * sp;
      acc_a[q] += sp * dsai;
      store(row + q * L, x[q] * wv[q] + dsai * av[q]);
    }
  }
  for (int q = 0; q < NV; q++) {
    store(dr + q * L, acc_r[q]), store(dk + q * L, acc_k[q]), store(db + q * L, acc_b[q]);
    store(da + q * L, acc_a[q]), store(dw + q * L, acc_w[q] * wv[q]);
  }
}

// The backward's recomputation of one step for any head size, in place, in the
// [value, key] layout: S = S diag(w) + (S a) bᵀ + v kᵀ; keeps sa = S_prev a.
template <typename F>
inline void recompute_step(F* __restrict S, F* __restrict sa, const F* __restrict w, const F* __restrict k,
                           const F* __restrict v, const F* __restrict a, const F* __restrict b, int N) {
  for (int i = 0; i < N; i++) {
    F* __restrict row = S + (int64_t)i * N;
    F s = 0;
#pragma omp simd reduction(+ : s)
    for (int j = 0; j < N; j++) s += row[j] * a[j];
    const F vi = v[i];
#pragma omp simd
    for (int j = 0; j < N; j++) row[j] = row[j] * w[j] + s * b[j] + vi * k[j];
    sa[i] = s;
  }
}

// The forward's step on the transposed state ST[j][i] (row = key channel j):
// every loop is an axpy over i, with no horizontal reductions at all.
template <typename F, int NC>
inline void step_transposed(F* __restrict ST, F* __restrict sa, F* __restrict y, const F* __restrict r,
                            const F* __restrict w, const F* __restrict k, const F* __restrict v,
                            const F* __restrict a, const F* __restrict b, int n) {
  const int N = NC ? NC : n;
  for (int i = 0; i < N; i++) sa[i] = y[i] = 0;
  for (int j = 0; j < N; j++) {
    const F* __restrict row = ST + (int64_t)j * N;
    const F aj = a[j];
#pragma omp simd
    for (int i = 0; i < N; i++) sa[i] += row[i] * aj;
  }
  for (int j = 0; j < N; j++) {
    F* __restrict row = ST + (int64_t)j * N;
    const F wj = w[j], bj = b[j], kj = k[j], rj = r[j];
#pragma omp simd
    for (int i = 0; i < N; i++) {
      const F x = row[i] * wj + sa[i] * bj + v[i] * kj;
      row[i] = x;
      y[i] += x * rj;
    }
  }
}

template <typename F>
inline void transpose(const F* __restrict src, F* __restrict dst, int N) {
  for (int i = 0; i < N; i++)
    for (int j = 0; j < N; j++) dst[(int64_t)j * N + i] = src[(int64_t)i * N + j];
}

template <typename F, int NC>
void forward(const F* r, const F* w, const F* k, const F* v, const F* a, const F* b, const F* s0, F* y, F* sT,
             F* snaps, int B, int T, int H, int n, int chunk, int threads) {
  const int N = NC ? NC : n;
  const int n_chunks = (T + chunk - 1) / chunk;
  const int64_t NN = (int64_t)N * N;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int bh = 0; bh < B * H; bh++) {
    const int bi = bh / H, h = bh % H;
    std::vector<F> ST(NN), sa(N);
    transpose(s0 + bh * NN, ST.data(), N);
    for (int t = 0; t < T; t++) {
      if (t % chunk == 0) transpose(ST.data(), snaps + ((int64_t)bh * n_chunks + t / chunk) * NN, N);
      const int64_t o = (((int64_t)bi * T + t) * H + h) * N;
      step_transposed<F, NC>(ST.data(), sa.data(), y + o, r + o, w + o, k + o, v + o, a + o, b + o, N);
    }
    transpose(ST.data(), sT + bh * NN, N);
  }
}

template <typename F, int NC>
void backward(const F* r, const F* w, const F* k, const F* v, const F* a, const F* b, const F* snaps, const F* dy,
              const F* dsT, F* dr, F* dw, F* dk, F* dv, F* da, F* db, F* ds0, int B, int T, int H, int n, int chunk,
              int threads) {
  const int N = NC ? NC : n;
  const int n_chunks = (T + chunk - 1) / chunk;
  const int64_t NN = (int64_t)N * N;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int bh = 0; bh < B * H; bh++) {
    const int bi = bh / H, h = bh % H;
    std::vector<F> dS(dsT + bh * NN, dsT + (bh + 1) * NN);
    std::vector<F> states((int64_t)(chunk + 1) * NN), sas((int64_t)chunk * N);
    std::vector<F> dwe(N), dsa(N);
    for (int c = n_chunks - 1; c >= 0; c--) {
      const int t0 = c * chunk, L = std::min(chunk, T - t0);
      std::memcpy(states.data(), snaps + ((int64_t)bh * n_chunks + c) * NN, NN * sizeof(F));
      for (int s = 0; s < L; s++) {
        const int64_t o = (((int64_t)bi * T + t0 + s) * H + h) * N;
        F* next = states.data() + (int64_t)(s + 1) * NN;
        if constexpr (NC > 0) {
          recompute_step_vec<F, NC>(states.data() + (int64_t)s * NN, next, sas.data() + (int64_t)s * N, w + o, k + o,
                                    v + o, a + o, b + o);
        } else {
          std::memcpy(next, states.data() + (int64_t)s * NN, NN * sizeof(F));
          recompute_step<F>(next, sas.data() + (int64_t)s * N, w + o, k + o, v + o, a + o, b + o, N);
        }
      }
      for (int s = L - 1; s >= 0; s--) {
        const int64_t o = (((int64_t)bi * T + t0 + s) * H + h) * N;
        const F* Sprev = states.data() + (int64_t)s * NN;
        const F* St = states.data() + (int64_t)(s + 1) * NN;
        if constexpr (NC > 0) {
          backward_step_vec<F, NC>(dS.data(), St, Sprev, r + o, w + o, k + o, v + o, a + o, b + o,
                                   sas.data() + (int64_t)s * N, dy + o, dr + o, dw + o, dk + o, dv + o, da + o,
                                   db + o);
          continue;
        }
        const F *rt = r + o, *kt = k + o, *vt = v + o, *at = a + o, *bt = b + o, *dyt = dy + o;
        const F* wt = w + o;
        const F* sat = sas.data() + (int64_t)s * N;
        F *drt = dr + o, *dkt = dk + o, *dbt = db + o, *dat = da + o;
        for (int j = 0; j < N; j++) drt[j] = dkt[j] = dbt[j] = dat[j] = dwe[j] = 0;
        for (int i = 0; i < N; i++) {
          F* __restrict row = dS.data() + (int64_t)i * N;
          const F* __restrict st = St + (int64_t)i * N;
          const F* __restrict sp = Sprev + (int64_t)i * N;
          const F dyi = dyt[i], vi = vt[i], sai = sat[i];
          F dvi = 0, dsai = 0;
#pragma omp simd reduction(+ : dvi, dsai)
          for (int j = 0; j < N; j++) {
            const F x = row[j] + dyi * rt[j];
            row[j] = x;
            dvi += x * kt[j];
            dsai += x * bt[j];
          }
          dv[o + i] = dvi;
#pragma omp simd
          for (int j = 0; j < N; j++) {
            const F x = row[j];
            drt[j] += st[j] * dyi;
            dkt[j] += x * vi;
            dbt[j] += x * sai;
            dwe[j] += x * sp[j];
            dat[j] += sp[j] * dsai;
            row[j] = x * wt[j] + dsai * at[j];
          }
        }
        for (int j = 0; j < N; j++) dw[o + j] = dwe[j] * wt[j];
      }
    }
    std::memcpy(ds0 + bh * NN, dS.data(), NN * sizeof(F));
  }
}

}  // namespace

extern "C" {

#define RWKVX_EXPORT(F, SUFFIX)                                                                                    \
  void wkv7_forward_##SUFFIX(const F* r, const F* w, const F* k, const F* v, const F* a, const F* b, const F* s0,  \
                             F* y, F* sT, F* snaps, int B, int T, int H, int N, int chunk, int threads) {          \
    auto fn = N == 32 ? forward<F, 32> : N == 64 ? forward<F, 64> : N == 128 ? forward<F, 128> : forward<F, 0>;    \
    fn(r, w, k, v, a, b, s0, y, sT, snaps, B, T, H, N, chunk, threads);                                             \
  }                                                                                                                \
  void wkv7_backward_##SUFFIX(const F* r, const F* w, const F* k, const F* v, const F* a, const F* b,              \
                              const F* snaps, const F* dy, const F* dsT, F* dr, F* dw, F* dk, F* dv, F* da, F* db, \
                              F* ds0, int B, int T, int H, int N, int chunk, int threads) {                        \
    auto fn = N == 32 ? backward<F, 32> : N == 64 ? backward<F, 64> : N == 128 ? backward<F, 128> : backward<F, 0>; \
    fn(r, w, k, v, a, b, snaps, dy, dsT, dr, dw, dk, dv, da, db, ds0, B, T, H, N, chunk, threads);                  \
  }

// Head sizes 32, 64 and 128 get a compile-time N (fully unrolled rows); others the generic loops.
RWKVX_EXPORT(float, f32)
RWKVX_EXPORT(double, f64)
}
