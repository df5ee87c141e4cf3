// WKV7 forward and backward on the CPU: one (batch, head) per OpenMP task, the
// N x N state kept in cache, every inner loop a unit-stride SIMD loop.
//
// Layout: inputs [B, T, H, N] contiguous; w is the log-decay w_log <= 0, whose effective
// decay exp(w_log) each step computes for its N key channels (simd::exp_nonpos: ~1 ulp in fp32,
// the C library's exp in fp64); states [B, H, N, N] with row i = value channel, column j = key
// channel. A null initial state is the zero state, and a null ds0 asks for no state gradient
// (the model's first segment: no tensor of zeros to allocate, fill and read).
//
// Forward runs on the transposed state (row = key channel j), where S a and S r
// become axpys over rows and the columns (value channels) evolve independently.
// A step is one sweep over the rows per block of columns: each updated row feeds
// y += row r_j and the next step's sa += row a_next,j, with the block's y and sa
// in registers. It saves sa_t = S_{t-1} a_t ([B, T, H, N]) and, every `chunk`
// steps, a snapshot of the transposed state ([B, H, n_chunks, N, N]).
//
// Backward rebuilds a chunk's states from its snapshot in the [value, key]
// layout (S_t = S_{t-1} diag(w) + sa bᵀ + v kᵀ, with the saved sa: no
// reductions), then runs the reverse scan over the rows i, so that five of its
// seven products are column sums kept in registers and only dv and dsa need a
// horizontal sum:
//   dS   += dy_t r_tᵀ
//   dv_i  = dS_i · k        dsa_i = dS_i · b
//   dk   += dS_i v_i        db   += dS_i sa_i      dw += dS_i ⊙ S_prev,i
//   da   += S_prev,i dsa_i  dr'  += S_prev,i dy_i
//   dS_i  = dS_i ⊙ w + dsa_i a
// and dr = S_tᵀ dy = w ⊙ dr' + b (sa·dy) + k (v·dy), so S_t itself is never
// read. dw is finally multiplied by w (the gradient of the log-decay). Head
// sizes 16, 32, 64 and 128 use compile-time N with the SIMD vectors of
// csrc/simd.h, in column blocks sized so that a block's accumulators fit the
// register file of the ISA being compiled for; others take generic loops.
// Nothing divides by the decay, so any w in (0, 1] is exact.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../../csrc/simd.h"

namespace {

constexpr int PF = 2;  // steps ahead to prefetch inputs

using simd::hsum;
using simd::load;
using simd::store;
using simd::Vec;

// out[0..n) = exp(x[0..n)) for x <= 0, whole vectors then a zero-padded partial one.
template <typename F>
inline void exp_row(const F* __restrict x, F* __restrict out, int n) {
  typedef typename Vec<F>::type V;
  constexpr int L = Vec<F>::L;
  int i = 0;
  for (; i + L <= n; i += L) store(out + i, simd::exp_nonpos(load(x + i)));
  if (i < n) {
    V t = {};
    for (int l = 0; i + l < n; l++) t[l] = x[i + l];
    t = simd::exp_nonpos(t);
    for (int l = 0; i + l < n; l++) out[i + l] = t[l];
  }
}

// The backward's recomputation of one step, out of place, in the [value, key] layout
// the reverse sweep reads: next = prev diag(w) + (prev a) bᵀ + v kᵀ; keeps sa = prev a.
// Columns in blocks of QB vectors, so that w, b and k of a block stay in registers.
template <typename F, int NC>
inline void recompute_step_vec(const F* __restrict prev, F* __restrict next, const F* __restrict sa,
                               const F* __restrict w, const F* __restrict k, const F* __restrict v,
                               const F* __restrict b) {
  typedef typename Vec<F>::type V;
  constexpr int L = Vec<F>::L, NV = NC / L, QB = simd::block(NV, 3, 4);
  for (int q0 = 0; q0 < NV; q0 += QB) {
    V kv[QB], bv[QB], wv[QB];
    for (int q = 0; q < QB; q++) {
      const int c = (q0 + q) * L;
      kv[q] = load(k + c), bv[q] = load(b + c), wv[q] = load(w + c);
    }
    for (int i = 0; i < NC; i++) {
      const F* __restrict p = prev + (int64_t)i * NC + q0 * L;
      F* __restrict o = next + (int64_t)i * NC + q0 * L;
      const F sai = sa[i], vi = v[i];
      for (int q = 0; q < QB; q++) store(o + q * L, load(p + q * L) * wv[q] + sai * bv[q] + vi * kv[q]);
    }
  }
}

// One reverse step of the backward for a compile-time head size, in two sweeps over
// the rows i of dS. The first forms x_i = dS_i + dy_i r (written back) and the two
// row sums dv_i = x_i · k and dsa_i = x_i · b, RG rows at a time so that r, k and b
// are loaded once per group (the sums' lanes are reduced L rows at a time). The
// second runs over blocks of QB column vectors, whose five column accumulators
// (dr', dk, db, dw, da) stay in registers for the whole sweep over the rows, and
// writes dS_i = x_i ⊙ w + dsa_i a.
template <typename F, int NC>
inline void backward_step_vec(F* __restrict dS, const F* __restrict Sp,
                              const F* __restrict r, const F* __restrict w, const F* __restrict k,
                              const F* __restrict v, const F* __restrict a, const F* __restrict b,
                              const F* __restrict sa, const F* __restrict dy, F* __restrict dr, F* __restrict dw,
                              F* __restrict dk, F* __restrict dv, F* __restrict da, F* __restrict db,
                              F* __restrict dsa) {
  typedef typename Vec<F>::type V;
  constexpr int L = Vec<F>::L, NV = NC / L;
  // Rows per group of the first sweep: one. Grouping rows so that r, k and b are loaded once per
  // group measured slower on AVX2 (Zen 3, single thread, 1x1024x4x64: 1.9 / 2.3 / 2.5 / 3.1 ms
  // for groups of 1 / 2 / 4 / 8 rows): a group walks RG rows 256 bytes apart at each step.
  constexpr int RG = 1;
  constexpr int QB = simd::block(NV, 5, 6);                                   // column vectors per block of the second
  V sdy_v = V{}, vdy_v = V{};
  for (int q = 0; q < NV; q++) {
    const V dyq = load(dy + q * L);
    sdy_v += load(sa + q * L) * dyq, vdy_v += load(v + q * L) * dyq;
  }
  const F sdy = hsum<F>(sdy_v), vdy = hsum<F>(vdy_v);
  V pv_rows[NC], pb_rows[NC];  // the row sums' lanes, reduced L rows at a time below
  for (int i0 = 0; i0 < NC; i0 += RG) {
    V pv[RG], pb[RG];
    F dyi[RG];
    for (int g = 0; g < RG; g++) pv[g] = pb[g] = V{}, dyi[g] = dy[i0 + g];
    for (int q = 0; q < NV; q++) {
      const V rq = load(r + q * L), kq = load(k + q * L), bq = load(b + q * L);
      for (int g = 0; g < RG; g++) {
        F* __restrict row = dS + (int64_t)(i0 + g) * NC + q * L;
        const V x = load(row) + dyi[g] * rq;
        store(row, x);
        pv[g] += x * kq;
        pb[g] += x * bq;
      }
    }
    for (int g = 0; g < RG; g++) pv_rows[i0 + g] = pv[g], pb_rows[i0 + g] = pb[g];
  }
  for (int i0 = 0; i0 < NC; i0 += L) {
    store(dv + i0, simd::hsums<F>(pv_rows + i0));
    store(dsa + i0, simd::hsums<F>(pb_rows + i0));
  }
  for (int q0 = 0; q0 < NV; q0 += QB) {
    V acc_r[QB], acc_k[QB], acc_b[QB], acc_w[QB], acc_a[QB];
    for (int q = 0; q < QB; q++) acc_r[q] = acc_k[q] = acc_b[q] = acc_w[q] = acc_a[q] = V{};
    for (int i = 0; i < NC; i++) {
      F* __restrict row = dS + (int64_t)i * NC + q0 * L;
      const F* __restrict sp = Sp + (int64_t)i * NC + q0 * L;
      const F dyi = dy[i], vi = v[i], sai = sa[i], dsai = dsa[i];
      for (int q = 0; q < QB; q++) {
        const V x = load(row + q * L), s = load(sp + q * L);
        acc_r[q] += s * dyi;
        acc_k[q] += x * vi;
        acc_b[q] += x * sai;
        acc_w[q] += x * s;
        acc_a[q] += s * dsai;
        store(row + q * L, x * load(w + (q0 + q) * L) + dsai * load(a + (q0 + q) * L));
      }
    }
    for (int q = 0; q < QB; q++) {
      const int c = (q0 + q) * L;
      const V wq = load(w + c);
      // dr = S_tᵀ dy with S_t = S_prev diag(w) + sa bᵀ + v kᵀ, so S_t is never loaded.
      store(dr + c, acc_r[q] * wq + sdy * load(b + c) + vdy * load(k + c));
      store(dk + c, acc_k[q]), store(db + c, acc_b[q]);
      store(da + c, acc_a[q]), store(dw + c, acc_w[q] * wq);
    }
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
// one sweep over its rows per block of QB column vectors (columns, i.e. value
// channels, evolve independently): the update, y += row * r_j and the next step's
// sa += row * a_next_j, with the block's sa, v, y and next sa held in registers.
template <typename F, int NC>
inline void step_fused(F* __restrict ST, typename Vec<F>::type* __restrict sa, F* __restrict sa_out, F* __restrict y,
                       const F* __restrict r, const F* __restrict w, const F* __restrict k, const F* __restrict v,
                       const F* __restrict b, const F* __restrict a_next) {
  typedef typename Vec<F>::type V;
  // With 16 registers, blocks of 4 vectors: 16 accumulators and inputs, more than the register
  // file holds once the five broadcasts are counted, yet measured ~7% faster than the 2 that fit
  // (AVX2, Zen 3): the broadcasts of w, b, k, r and a serve twice the columns. AVX-512 (32
  // registers, not measured this way) keeps the block that fits.
  constexpr int L = Vec<F>::L, NV = NC / L;
  constexpr int QB = simd::kRegs >= 32 ? simd::block(NV, 4, 6) : simd::block(NV, 3, 4);
  for (int q0 = 0; q0 < NV; q0 += QB) {
    V s[QB], vv[QB], yy[QB], sn[QB];
    for (int q = 0; q < QB; q++) {
      s[q] = sa[q0 + q], vv[q] = load(v + (q0 + q) * L), yy[q] = sn[q] = V{};
      store(sa_out + (q0 + q) * L, s[q]);
    }
    for (int j = 0; j < NC; j++) {
      F* __restrict row = ST + (int64_t)j * NC + q0 * L;
      const F wj = w[j], bj = b[j], kj = k[j], rj = r[j], aj = a_next[j];
      for (int q = 0; q < QB; q++) {
        const V x = load(row + q * L) * wj + s[q] * bj + vv[q] * kj;
        store(row + q * L, x);
        yy[q] += x * rj;
        sn[q] += x * aj;
      }
    }
    for (int q = 0; q < QB; q++) store(y + (q0 + q) * L, yy[q]), sa[q0 + q] = sn[q];
  }
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
    std::vector<F> ST(NN), sa(N), zeros(N), we(N);  // we: this step's exp(w)
    if (s0) transpose(s0 + bh * NN, ST.data(), N);
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
        if (t + PF + 1 < T)
          for (const F* x : {r, w, k, v, b, a}) simd::prefetch(x + o + (int64_t)(PF + (x == a)) * H * N, N);
        exp_row(w + o, we.data(), N);
        step_fused<F, NC>(ST.data(), sav, sas + o, y + o, r + o, we.data(), k + o, v + o, b + o, an);
      }
    } else {
      for (int t = 0; t < T; t++) {
        if (t % chunk == 0) std::memcpy(snaps + ((int64_t)bh * n_chunks + t / chunk) * NN, ST.data(), NN * sizeof(F));
        const int64_t o = (((int64_t)bi * T + t) * H + h) * N;
        exp_row(w + o, we.data(), N);
        step_transposed<F, NC>(ST.data(), sa.data(), y + o, r + o, we.data(), k + o, v + o, a + o, b + o, N);
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
    // dsT null: the final state has no cotangent (training without a carried state)
    std::vector<F> dS = dsT ? std::vector<F>(dsT + bh * NN, dsT + (bh + 1) * NN) : std::vector<F>(NN, F(0));
    std::vector<F> states((int64_t)chunk * NN), dwe(N), acc_r(N), dsa(N);
    std::vector<F> wes((int64_t)chunk * N);  // the chunk's exp(w), step by step
    // Every input and output row of step t, ahead of its use (see simd::prefetch).
    auto prefetch_step = [&](int t) {
      const int64_t o = (((int64_t)bi * T + t) * H + h) * N;
      for (const F* x : {r, w, k, v, a, b, sas, dy}) simd::prefetch(x + o, N);
      for (const F* x : {dr, dw, dk, dv, da, db}) simd::prefetch(x + o, N, true);
    };
    for (int t = (n_chunks - 1) * chunk; t < T; t++) prefetch_step(t);
    for (int c = n_chunks - 1; c >= 0; c--) {
      const int t0 = c * chunk, L = std::min(chunk, T - t0);
      // states[s] = the state before step t0 + s, in the [value, key] layout.
      transpose(snaps + ((int64_t)bh * n_chunks + c) * NN, states.data(), N);
      for (int s = 0; s < L; s++) exp_row(w + (((int64_t)bi * T + t0 + s) * H + h) * N, wes.data() + (int64_t)s * N, N);
      for (int s = 0; s + 1 < L; s++) {
        const int64_t o = (((int64_t)bi * T + t0 + s) * H + h) * N;
        const F* prev = states.data() + (int64_t)s * NN;
        F* next = states.data() + (int64_t)(s + 1) * NN;
        const F* ws = wes.data() + (int64_t)s * N;
        if constexpr (NC > 0) {
          recompute_step_vec<F, NC>(prev, next, sas + o, ws, k + o, v + o, b + o);
        } else {
          for (int i = 0; i < N; i++)
#pragma omp simd
            for (int j = 0; j < N; j++)
              next[(int64_t)i * N + j] = prev[(int64_t)i * N + j] * ws[j] + sas[o + i] * b[o + j] + v[o + i] * k[o + j];
        }
      }
      for (int s = L - 1; s >= 0; s--) {
        const int64_t o = (((int64_t)bi * T + t0 + s) * H + h) * N;
        const F* Sprev = states.data() + (int64_t)s * NN;
        if (c > 0) prefetch_step(t0 - chunk + s);  // the previous chunk's step s
        if constexpr (NC > 0) {
          backward_step_vec<F, NC>(dS.data(), Sprev, r + o, wes.data() + (int64_t)s * N, k + o, v + o, a + o, b + o, sas + o, dy + o,
                                   dr + o, dw + o, dk + o, dv + o, da + o, db + o, dsa.data());
          continue;
        }
        const F *rt = r + o, *kt = k + o, *vt = v + o, *at = a + o, *bt = b + o, *dyt = dy + o;
        const F* wt = wes.data() + (int64_t)s * N;
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
    if (ds0) std::memcpy(ds0 + bh * NN, dS.data(), NN * sizeof(F));
  }
}

}  // namespace

extern "C" {

// Head sizes 16, 32, 64 and 128 get a compile-time N (fully unrolled rows); others the generic loops.
#define RWKVX_PICK(fn, F, N) \
  (N == 16 ? fn<F, 16> : N == 32 ? fn<F, 32> : N == 64 ? fn<F, 64> : N == 128 ? fn<F, 128> : fn<F, 0>)

#define RWKVX_EXPORT(F, SUFFIX)                                                                                    \
  void wkv7_forward_##SUFFIX(const F* r, const F* w, const F* k, const F* v, const F* a, const F* b, const F* s0,  \
                             F* y, F* sT, F* snaps, F* sas, int B, int T, int H, int N, int chunk, int threads) {  \
    auto fn = RWKVX_PICK(forward, F, N);                                                                              \
    fn(r, w, k, v, a, b, s0, y, sT, snaps, sas, B, T, H, N, chunk, threads);                                       \
  }                                                                                                                \
  void wkv7_backward_##SUFFIX(const F* r, const F* w, const F* k, const F* v, const F* a, const F* b,              \
                              const F* snaps, const F* sas, const F* dy, const F* dsT, F* dr, F* dw, F* dk, F* dv, \
                              F* da, F* db, F* ds0, int B, int T, int H, int N, int chunk, int threads) {          \
    auto fn = RWKVX_PICK(backward, F, N);                                                                             \
    fn(r, w, k, v, a, b, snaps, sas, dy, dsT, dr, dw, dk, dv, da, db, ds0, B, T, H, N, chunk, threads);            \
  }

RWKVX_EXPORT_PRECISIONS
}
