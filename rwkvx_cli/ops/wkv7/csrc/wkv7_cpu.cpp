// WKV7 forward and backward on the CPU: one (batch, head) per OpenMP task, the
// N x N state kept in cache, every inner loop a unit-stride SIMD loop.
//
// Layout: inputs [B, T, H, N] contiguous; w is the effective decay exp(w_log),
// computed by the caller with torch's vectorised exp; states [B, H, N, N] with
// row i = value channel, column j = key channel.
//
// Forward runs on the transposed state (row = key channel j), where S a and S r
// become axpys over rows, and does one sweep per step: each updated row feeds
// y += row r_j and the next step's sa += row a_next,j, with y and sa in
// registers. It saves sa_t = S_{t-1} a_t ([B, T, H, N]) and, every `chunk`
// steps, a snapshot of the transposed state ([B, H, n_chunks, N, N]).
//
// Backward rebuilds a chunk's states from its snapshot in the [value, key]
// layout (S_t = S_{t-1} diag(w) + sa bᵀ + v kᵀ, with the saved sa: no
// reductions), then runs the reverse scan one row i at a time, so that five of
// its seven products are column sums kept in registers and only dv and dsa
// need a horizontal sum:
//   dS   += dy_t r_tᵀ
//   dv_i  = dS_i · k        dsa_i = dS_i · b
//   dk   += dS_i v_i        db   += dS_i sa_i      dw += dS_i ⊙ S_prev,i
//   da   += S_prev,i dsa_i  dr'  += S_prev,i dy_i
//   dS_i  = dS_i ⊙ w + dsa_i a
// and dr = S_tᵀ dy = w ⊙ dr' + b (sa·dy) + k (v·dy), so S_t itself is never
// read. dw is finally multiplied by w (the gradient of the log-decay). Head
// sizes 32, 64 and 128 use compile-time N with explicit 64-byte vectors; others
// generic loops. Nothing divides by the decay, so any w in (0, 1] is exact.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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

// Horizontal sum: AVX-512's register-only shuffle tree where available (a round trip
// through memory costs a store-forwarding stall per call); otherwise by halving.
#if defined(__AVX512F__)
inline float hsum_native(Vec<float>::type x) { return _mm512_reduce_add_ps(reinterpret_cast<__m512>(x)); }
inline double hsum_native(Vec<double>::type x) { return _mm512_reduce_add_pd(reinterpret_cast<__m512d>(x)); }
template <typename F>
inline F hsum(typename Vec<F>::type x) { return hsum_native(x); }
#else
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
#endif

// The backward's recomputation of one step, out of place, in the [value, key] layout
// the reverse sweep reads: next = prev diag(w) + (prev a) bᵀ + v kᵀ; keeps sa = prev a.
template <typename F, int NC>
inline void recompute_step_vec(const F* __restrict prev, F* __restrict next, const F* __restrict sa,
                               const F* __restrict w, const F* __restrict k, const F* __restrict v,
                               const F* __restrict a, const F* __restrict b) {
  typedef typename Vec<F>::type V;
  constexpr int L = Vec<F>::L, NV = NC / L;
  V kv[NV], bv[NV], av[NV], wv[NV];
  for (int q = 0; q < NV; q++) kv[q] = load(k + q * L), bv[q] = load(b + q * L), av[q] = load(a + q * L);
  for (int q = 0; q < NV; q++) wv[q] = load(w + q * L);
  for (int i = 0; i < NC; i++) {
    const F* __restrict p = prev + (int64_t)i * NC;
    const F sai = sa[i], vi = v[i];
    for (int q = 0; q < NV; q++) store(next + (int64_t)i * NC + q * L, load(p + q * L) * wv[q] + sai * bv[q] + vi * kv[q]);
  }
}

// One reverse step of the backward for a compile-time head size: the five column
// accumulators stay in registers for the whole sweep over the rows of dS.
template <typename F, int NC>
inline void backward_step_vec(F* __restrict dS, const F* __restrict Sp,
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
  V sdy_v = V{}, vdy_v = V{};
  for (int q = 0; q < NV; q++) {
    const V dyq = load(dy + q * L);
    sdy_v += load(sa + q * L) * dyq, vdy_v += load(v + q * L) * dyq;
  }
  const F sdy = hsum<F>(sdy_v), vdy = hsum<F>(vdy_v);
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
      const V sp = load(Sp + (int64_t)i * NC + q * L);
      acc_r[q] += sp * dyi;
      acc_k[q] += x[q] * vi;
      acc_b[q] += x[q] * sai;
      acc_w[q] += x[q] * sp;
      acc_a[q] += sp * dsai;
      store(row + q * L, x[q] * wv[q] + dsai * av[q]);
    }
  }
  for (int q = 0; q < NV; q++) {
    // dr = S_tᵀ dy with S_t = S_prev diag(w) + sa bᵀ + v kᵀ, so S_t is never loaded.
    store(dr + q * L, acc_r[q] * wv[q] + sdy * bv[q] + vdy * kv[q]);
    store(dk + q * L, acc_k[q]), store(db + q * L, acc_b[q]);
    store(da + q * L, acc_a[q]), store(dw + q * L, acc_w[q] * wv[q]);
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

// One forward step for a compile-time head size on the transposed state, fused into
// a single sweep over its rows: the update, y += row * r_j and the next step's
// sa += row * a_next_j, with y and sa held in registers.
template <typename F, int NC>
inline void step_fused(F* __restrict ST, typename Vec<F>::type* __restrict sa, F* __restrict sa_out, F* __restrict y,
                       const F* __restrict r, const F* __restrict w, const F* __restrict k, const F* __restrict v,
                       const F* __restrict b, const F* __restrict a_next) {
  typedef typename Vec<F>::type V;
  constexpr int L = Vec<F>::L, NV = NC / L;
  V s[NV], vv[NV], yy[NV], sn[NV];
  for (int q = 0; q < NV; q++) s[q] = sa[q], vv[q] = load(v + q * L), yy[q] = sn[q] = V{}, store(sa_out + q * L, s[q]);
  for (int j = 0; j < NC; j++) {
    F* __restrict row = ST + (int64_t)j * NC;
    const F wj = w[j], bj = b[j], kj = k[j], rj = r[j], aj = a_next[j];
    for (int q = 0; q < NV; q++) {
      const V x = load(row + q * L) * wj + s[q] * bj + vv[q] * kj;
      store(row + q * L, x);
      yy[q] += x * rj;
      sn[q] += x * aj;
    }
  }
  for (int q = 0; q < NV; q++) store(y + q * L, yy[q]), sa[q] = sn[q];
}

template <typename F, int NC>
void forward(const F* r, const F* w, const F* k, const F* v, const F* a, const F* b, const F* s0, F* y, F* sT,
             F* snaps, F* sas, int B, int T, int H, int n, int chunk, int threads) {
  const int N = NC ? NC : n;
  const int n_chunks = (T + chunk - 1) / chunk;
  const int64_t NN = (int64_t)N * N;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int bh = 0; bh < B * H; bh++) {
    const int bi = bh / H, h = bh % H;
    std::vector<F> ST(NN), sa(N), zeros(N);
    transpose(s0 + bh * NN, ST.data(), N);
    if constexpr (NC > 0) {
      typedef typename Vec<F>::type V;
      constexpr int L = Vec<F>::L, NV = NC / L;
      V sav[NV];
      const F* a0 = a + ((int64_t)bi * T * H + h) * N;
      for (int q = 0; q < NV; q++) sav[q] = V{};
      for (int j = 0; j < N; j++)
        for (int q = 0; q < NV; q++) sav[q] += load(ST.data() + (int64_t)j * N + q * L) * a0[j];
      for (int t = 0; t < T; t++) {
        if (t % chunk == 0) std::memcpy(snaps + ((int64_t)bh * n_chunks + t / chunk) * NN, ST.data(), NN * sizeof(F));
        const int64_t o = (((int64_t)bi * T + t) * H + h) * N;
        const F* an = t + 1 < T ? a + o + (int64_t)H * N : zeros.data();
        step_fused<F, NC>(ST.data(), sav, sas + o, y + o, r + o, w + o, k + o, v + o, b + o, an);
      }
    } else {
      for (int t = 0; t < T; t++) {
        if (t % chunk == 0) std::memcpy(snaps + ((int64_t)bh * n_chunks + t / chunk) * NN, ST.data(), NN * sizeof(F));
        const int64_t o = (((int64_t)bi * T + t) * H + h) * N;
        step_transposed<F, NC>(ST.data(), sa.data(), y + o, r + o, w + o, k + o, v + o, a + o, b + o, N);
        std::memcpy(sas + o, sa.data(), N * sizeof(F));
      }
    }
    transpose(ST.data(), sT + bh * NN, N);
  }
}

template <typename F, int NC>
void backward(const F* r, const F* w, const F* k, const F* v, const F* a, const F* b, const F* snaps, const F* sas,
              const F* dy, const F* dsT, F* dr, F* dw, F* dk, F* dv, F* da, F* db, F* ds0, int B, int T, int H, int n,
              int chunk, int threads) {
  const int N = NC ? NC : n;
  const int n_chunks = (T + chunk - 1) / chunk;
  const int64_t NN = (int64_t)N * N;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int bh = 0; bh < B * H; bh++) {
    const int bi = bh / H, h = bh % H;
    std::vector<F> dS(dsT + bh * NN, dsT + (bh + 1) * NN);
    std::vector<F> states((int64_t)chunk * NN), dwe(N), acc_r(N);
    for (int c = n_chunks - 1; c >= 0; c--) {
      const int t0 = c * chunk, L = std::min(chunk, T - t0);
      // states[s] = the state before step t0 + s, in the [value, key] layout.
      transpose(snaps + ((int64_t)bh * n_chunks + c) * NN, states.data(), N);
      for (int s = 0; s + 1 < L; s++) {
        const int64_t o = (((int64_t)bi * T + t0 + s) * H + h) * N;
        const F* prev = states.data() + (int64_t)s * NN;
        F* next = states.data() + (int64_t)(s + 1) * NN;
        if constexpr (NC > 0) {
          recompute_step_vec<F, NC>(prev, next, sas + o, w + o, k + o, v + o, a + o, b + o);
        } else {
          for (int i = 0; i < N; i++)
#pragma omp simd
            for (int j = 0; j < N; j++)
              next[(int64_t)i * N + j] = prev[(int64_t)i * N + j] * w[o + j] + sas[o + i] * b[o + j] + v[o + i] * k[o + j];
        }
      }
      for (int s = L - 1; s >= 0; s--) {
        const int64_t o = (((int64_t)bi * T + t0 + s) * H + h) * N;
        const F* Sprev = states.data() + (int64_t)s * NN;
        if constexpr (NC > 0) {
          backward_step_vec<F, NC>(dS.data(), Sprev, r + o, w + o, k + o, v + o, a + o, b + o, sas + o, dy + o,
                                   dr + o, dw + o, dk + o, dv + o, da + o, db + o);
          continue;
        }
        const F *rt = r + o, *kt = k + o, *vt = v + o, *at = a + o, *bt = b + o, *dyt = dy + o, *wt = w + o;
        const F* sat = sas + o;
        F *dkt = dk + o, *dbt = db + o, *dat = da + o;
        F sdy = 0, vdy = 0;
        for (int j = 0; j < N; j++) acc_r[j] = dkt[j] = dbt[j] = dat[j] = dwe[j] = 0;
        for (int i = 0; i < N; i++) {
          F* __restrict row = dS.data() + (int64_t)i * N;
          const F* __restrict sp = Sprev + (int64_t)i * N;
          const F dyi = dyt[i], vi = vt[i], sai = sat[i];
          sdy += sai * dyi, vdy += vi * dyi;
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
            acc_r[j] += sp[j] * dyi;
            dkt[j] += x * vi;
            dbt[j] += x * sai;
            dwe[j] += x * sp[j];
            dat[j] += sp[j] * dsai;
            row[j] = x * wt[j] + dsai * at[j];
          }
        }
        for (int j = 0; j < N; j++) {
          dw[o + j] = dwe[j] * wt[j];
          dr[o + j] = acc_r[j] * wt[j] + sdy * bt[j] + vdy * kt[j];
        }
      }
    }
    std::memcpy(ds0 + bh * NN, dS.data(), NN * sizeof(F));
  }
}

}  // namespace

extern "C" {

#define RWKVX_EXPORT(F, SUFFIX)                                                                                    \
  void wkv7_forward_##SUFFIX(const F* r, const F* w, const F* k, const F* v, const F* a, const F* b, const F* s0,  \
                             F* y, F* sT, F* snaps, F* sas, int B, int T, int H, int N, int chunk, int threads) {          \
    auto fn = N == 32 ? forward<F, 32> : N == 64 ? forward<F, 64> : N == 128 ? forward<F, 128> : forward<F, 0>;    \
    fn(r, w, k, v, a, b, s0, y, sT, snaps, sas, B, T, H, N, chunk, threads);                                             \
  }                                                                                                                \
  void wkv7_backward_##SUFFIX(const F* r, const F* w, const F* k, const F* v, const F* a, const F* b,              \
                              const F* snaps, const F* sas, const F* dy, const F* dsT, F* dr, F* dw, F* dk, F* dv, F* da, F* db, \
                              F* ds0, int B, int T, int H, int N, int chunk, int threads) {                        \
    auto fn = N == 32 ? backward<F, 32> : N == 64 ? backward<F, 64> : N == 128 ? backward<F, 128> : backward<F, 0>; \
    fn(r, w, k, v, a, b, snaps, sas, dy, dsT, dr, dw, dk, dv, da, db, ds0, B, T, H, N, chunk, threads);                  \
  }

// Head sizes 32, 64 and 128 get a compile-time N (fully unrolled rows); others the generic loops.
RWKVX_EXPORT(float, f32)
RWKVX_EXPORT(double, f64)
}
