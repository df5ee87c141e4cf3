// rwkv8 forward and backward on the CPU: one (batch, head) per OpenMP task, the
// [L, E] state in cache, every inner loop a unit-stride SIMD loop: over E in the
// forward, over L in the backward (which works on the transposed state, so that
// three of its four reductions are per-lane sums, see backward_rows).
//
// Layout: q [B, T, H, L], v [B, T, Hv, E] (Hv = 1: shared by every head),
// d [H, L], y [B, T, H, E], rho [B, H, L, E], n [B, H, L]; snapshots
// [B, H, n_chunks, L, E] and [B, H, n_chunks, L] hold the state before the first
// step of each chunk. dv is written per head, [B, T, H, E] (summed over heads by
// the caller when Hv = 1) and dd per batch row, [B, H, L].
//
// Document starts: starts [B, T], one byte per token (null: none). Where it is set, the state
// before the step is zero: the forward zeroes ρ and n (before the snapshot, so a chunk's snapshot
// is already reset), the backward's recomputation writes the zero state there, and the reverse
// scan zeroes dρ and dn after the step, so no gradient crosses the start.
//
// Forward, per step (s = Σ_l q_l + eps, m_l = n_l + eps, z_l = q_l / (s m_l)):
//   y += z_l ρ_l ;  ρ_l = d_l ρ_l + q_l v ;  n_l = d_l n_l + q_l      (row l of ρ, one pass)
// Backward, reverse over t with dρ, dn the gradients of the state after step t and
// ρ, n the state before it (recomputed per chunk from its snapshot):
//   dz_l = ρ_l · dy ;  dq_l = dρ_l · v + dn_l + dz_l / (s m_l) - Σ_j dz_j z_j / s
//   dd_l += dρ_l · ρ_l + dn_l n_l ;  dv += q_l dρ_l
//   dρ_l = d_l dρ_l + z_l dy ;  dn_l = d_l dn_l - dz_l z_l / m_l
// E (forward) and L (backward) = 16, 32, 64 or 128 compile to fixed-length vector code
// (csrc/simd.h), in column blocks whose accumulators fit the register file;
// other sizes take the generic loops.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../../csrc/simd.h"

namespace {

constexpr double EPS = 1e-6;
constexpr int PF = 2;  // steps ahead to prefetch inputs (see simd::prefetch)

using simd::hsum;
using simd::Vec;

template <typename F>
inline typename Vec<F>::type vload(const F* p) {
  return simd::load(p);
}

template <typename F>
inline void vstore(F* p, typename Vec<F>::type x) {
  simd::store(p, x);
}

template <typename F, int NE>
void forward(const F* q, const F* v, const F* d, const F* rho0, const F* n0, const uint8_t* starts, F* y, F* rhoT,
             F* nT, F* snaps, F* nsnaps, int B, int T, int H, int Hv, int L, int e_runtime, int chunk, int threads) {
  const int E = NE ? NE : e_runtime;
  const int n_chunks = (T + chunk - 1) / chunk;
  const int64_t LE = (int64_t)L * E;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int bh = 0; bh < B * H; bh++) {
    const int b = bh / H, h = bh % H;
    std::vector<F> rho(rho0 + bh * LE, rho0 + (bh + 1) * LE), n(n0 + (int64_t)bh * L, n0 + (int64_t)(bh + 1) * L), z(L);
    const F* dh = d + (int64_t)h * L;
    for (int t = 0; t < T; t++) {
      if (starts && starts[(int64_t)b * T + t]) {  // a document starts: the zero state before step t
        std::fill(rho.begin(), rho.end(), F(0));
        std::fill(n.begin(), n.end(), F(0));
      }
      if (t % chunk == 0) {
        const int64_t c = (int64_t)bh * n_chunks + t / chunk;
        std::memcpy(snaps + c * LE, rho.data(), LE * sizeof(F));
        std::memcpy(nsnaps + c * L, n.data(), L * sizeof(F));
      }
      if (t + PF < T) {
        simd::prefetch(q + (((int64_t)b * T + t + PF) * H + h) * L, L);
        simd::prefetch(v + (((int64_t)b * T + t + PF) * Hv + (Hv == 1 ? 0 : h)) * E, E);
        simd::prefetch(y + (((int64_t)b * T + t + PF) * H + h) * E, E, true);
      }
      const F* qt = q + (((int64_t)b * T + t) * H + h) * L;
      const F* __restrict vt = v + (((int64_t)b * T + t) * Hv + (Hv == 1 ? 0 : h)) * E;
      F* __restrict yt = y + (((int64_t)b * T + t) * H + h) * E;
      const F s = (F)EPS + simd::dot<F>(qt, nullptr, L);
      if constexpr (NE > 0) {  // per block of QB column vectors, y and v in registers
        typedef typename Vec<F>::type V;
        constexpr int W = Vec<F>::L, NV = NE / W, QB = simd::block(NV, 2, 5);
        for (int l = 0; l < L; l++) z[l] = qt[l] / (s * (n[l] + (F)EPS));
        for (int j0 = 0; j0 < NV; j0 += QB) {
          V yv[QB], vv[QB];
          for (int j = 0; j < QB; j++) yv[j] = V{}, vv[j] = vload(vt + (j0 + j) * W);
          for (int l = 0; l < L; l++) {
            const F ql = qt[l], dl = dh[l], zl = z[l];
            F* __restrict row = rho.data() + (int64_t)l * NE + j0 * W;
            for (int j = 0; j < QB; j++) {
              const V x = vload(row + j * W);
              yv[j] += zl * x;
              vstore(row + j * W, dl * x + ql * vv[j]);
            }
          }
          for (int j = 0; j < QB; j++) vstore(yt + (j0 + j) * W, yv[j]);
        }
        for (int l = 0; l < L; l++) n[l] = dh[l] * n[l] + qt[l];
        continue;
      }
#pragma omp simd
      for (int e = 0; e < E; e++) yt[e] = 0;
      for (int l = 0; l < L; l++) {
        const F ql = qt[l], dl = dh[l], z = ql / (s * (n[l] + (F)EPS));
        F* __restrict row = rho.data() + (int64_t)l * E;
#pragma omp simd
        for (int e = 0; e < E; e++) {
          yt[e] += z * row[e];
          row[e] = dl * row[e] + ql * vt[e];
        }
        n[l] = dl * n[l] + ql;
      }
    }
    std::memcpy(rhoT + bh * LE, rho.data(), LE * sizeof(F));
    std::memcpy(nT + (int64_t)bh * L, n.data(), L * sizeof(F));
  }
}

template <typename F>
void transpose(const F* __restrict src, F* __restrict dst, int rows, int cols) {
  for (int i = 0; i < rows; i++)
    for (int j = 0; j < cols; j++) dst[(int64_t)j * rows + i] = src[(int64_t)i * cols + j];
}

// One reverse step on the transposed state (row e holds ρ[:, e] over the L latents),
// where three of the four reductions (dρ·v, dρ·ρ, ρ·dy over e) become per-lane sums kept
// in registers, and only dv_e = Σ_l q_l dρ[l, e] needs a horizontal sum:
//   a += dρ[:, e] v_e ;  g += dρ[:, e] ⊙ ρ[:, e] ;  r += ρ[:, e] dy_e ;  dv_e = q · dρ[:, e]
//   dρ[:, e] = d ⊙ dρ[:, e] + dy_e z
// NL = L at compile time (a multiple of the vector width), or 0 for the generic loops.
template <typename F, int NL>
inline void backward_rows(F* __restrict dRT, const F* __restrict PT, const F* __restrict q, const F* __restrict d,
                          const F* __restrict z, const F* __restrict v, const F* __restrict dy, F* __restrict dv,
                          F* __restrict a, F* __restrict g, F* __restrict r, F* __restrict pd_part, int L, int E) {
  if constexpr (NL > 0) {
    // Blocks of QB column vectors keep their three accumulators in registers over the
    // sweep of the rows; each row's share of dv_e waits in pd_part (aligned: it is read as
    // vectors) until the last block, then L rows' sums are reduced at once.
    typedef typename Vec<F>::type V;
    constexpr int W = Vec<F>::L, NV = NL / W, QB = simd::block(NV, 4, 4);
    for (int j0 = 0; j0 < NV; j0 += QB) {
      V acc_a[QB], acc_g[QB], acc_r[QB];
      for (int j = 0; j < QB; j++) acc_a[j] = acc_g[j] = acc_r[j] = V{};
      for (int e = 0; e < E; e++) {
        F* __restrict row = dRT + (int64_t)e * NL + j0 * W;
        const F* __restrict prow = PT + (int64_t)e * NL + j0 * W;
        const F ve = v[e], dye = dy[e];
        V pd = j0 ? vload(pd_part + (int64_t)e * W) : V{};
        for (int j = 0; j < QB; j++) {
          const V x = vload(row + j * W), p = vload(prow + j * W);
          acc_a[j] += x * ve, acc_g[j] += x * p, acc_r[j] += p * dye;
          pd += x * vload(q + (j0 + j) * W);
          vstore(row + j * W, x * vload(d + (j0 + j) * W) + dye * vload(z + (j0 + j) * W));
        }
        vstore(pd_part + (int64_t)e * W, pd);
      }
      for (int j = 0; j < QB; j++) {
        vstore(a + (j0 + j) * W, acc_a[j]), vstore(g + (j0 + j) * W, acc_g[j]), vstore(r + (j0 + j) * W, acc_r[j]);
      }
    }
    V* pd = reinterpret_cast<V*>(pd_part);
    int e = 0;
    for (; e + W <= E; e += W) vstore(dv + e, simd::hsums<F>(pd + e));
    for (; e < E; e++) dv[e] = hsum<F>(pd[e]);
  } else {
    for (int l = 0; l < L; l++) a[l] = g[l] = r[l] = 0;
    for (int e = 0; e < E; e++) {
      F* __restrict row = dRT + (int64_t)e * L;
      const F* __restrict prow = PT + (int64_t)e * L;
      const F ve = v[e], dye = dy[e];
      F pd = 0;
#pragma omp simd reduction(+ : pd)
      for (int l = 0; l < L; l++) {
        const F x = row[l], p = prow[l];
        a[l] += x * ve, g[l] += x * p, r[l] += p * dye;
        pd += x * q[l];
        row[l] = x * d[l] + dye * z[l];
      }
      dv[e] = pd;
    }
  }
}

// The backward's recomputation of one step on the transposed state: ρᵀ[e] = d ⊙ ρᵀ[e] + v_e q,
// for a compile-time L in blocks of QB column vectors whose d and q stay in registers.
template <typename F, int NL>
inline void recompute_rows(const F* __restrict cur, F* __restrict next, const F* __restrict d,
                           const F* __restrict q, const F* __restrict v, int L, int E) {
  if constexpr (NL > 0) {
    typedef typename Vec<F>::type V;
    constexpr int W = Vec<F>::L, NV = NL / W, QB = simd::block(NV, 2, 4);
    for (int j0 = 0; j0 < NV; j0 += QB) {
      V dv[QB], qv[QB];
      for (int j = 0; j < QB; j++) dv[j] = vload(d + (j0 + j) * W), qv[j] = vload(q + (j0 + j) * W);
      for (int e = 0; e < E; e++) {
        const F ve = v[e];
        for (int j = 0; j < QB; j++) {
          const int64_t o = (int64_t)e * NL + (j0 + j) * W;
          vstore(next + o, dv[j] * vload(cur + o) + ve * qv[j]);
        }
      }
    }
  } else {
    for (int e = 0; e < E; e++) {
      const F* __restrict src = cur + (int64_t)e * L;
      F* __restrict dst = next + (int64_t)e * L;
      const F ve = v[e];
#pragma omp simd
      for (int l = 0; l < L; l++) dst[l] = d[l] * src[l] + ve * q[l];
    }
  }
}

template <typename F, int NL>
void backward(const F* q, const F* v, const F* d, const F* snaps, const F* nsnaps, const uint8_t* starts,
              const F* dy, const F* drhoT, const F* dnT, F* dq, F* dv, F* dd, F* drho0, F* dn0, int B, int T, int H,
              int Hv, int L_runtime, int E, int chunk, int threads) {
  const int L = NL ? NL : L_runtime;
  const int n_chunks = (T + chunk - 1) / chunk;
  const int64_t LE = (int64_t)L * E;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int bh = 0; bh < B * H; bh++) {
    const int b = bh / H, h = bh % H;
    const F* dh = d + (int64_t)h * L;
    std::vector<F> dRT(LE), dn(dnT + (int64_t)bh * L, dnT + (int64_t)(bh + 1) * L);
    transpose(drhoT + bh * LE, dRT.data(), L, E);
    // The transposed state before each step of the chunk, and n before each step.
    std::vector<F> rhos((int64_t)chunk * LE), ns((int64_t)chunk * L);
    std::vector<F> z(L), a(L), g(L), r(L);
    std::vector<typename Vec<F>::type> pd_part(E);
    std::vector<double> dd_acc(L, 0.0);
    std::vector<F> dd_chunk(L);
    auto prefetch_step = [&](int t) {  // every input and output row of step t, ahead of its use
      const int64_t o = ((int64_t)b * T + t) * H + h;
      simd::prefetch(q + o * L, L), simd::prefetch(dy + o * E, E);
      simd::prefetch(v + (((int64_t)b * T + t) * Hv + (Hv == 1 ? 0 : h)) * E, E);
      simd::prefetch(dq + o * L, L, true), simd::prefetch(dv + o * E, E, true);
    };
    for (int t = (n_chunks - 1) * chunk; t < T; t++) prefetch_step(t);
    for (int c = n_chunks - 1; c >= 0; c--) {
      const int t0 = c * chunk, len = T - t0 < chunk ? T - t0 : chunk;
      transpose(snaps + ((int64_t)bh * n_chunks + c) * LE, rhos.data(), L, E);
      std::memcpy(ns.data(), nsnaps + ((int64_t)bh * n_chunks + c) * L, L * sizeof(F));
      for (int i = 0; i + 1 < len; i++) {  // ρᵀ[e] = d ⊙ ρᵀ[e] + v_e q
        const int t = t0 + i;
        F* next = rhos.data() + (i + 1) * LE;
        if (starts && starts[(int64_t)b * T + t + 1]) {  // step t + 1 starts a document: the zero state
          std::fill(next, next + LE, F(0));
          std::fill(ns.begin() + (i + 1) * L, ns.begin() + (i + 2) * L, F(0));
          continue;
        }
        const F* __restrict qt = q + (((int64_t)b * T + t) * H + h) * L;
        const F* vt = v + (((int64_t)b * T + t) * Hv + (Hv == 1 ? 0 : h)) * E;
        const F* cur = rhos.data() + i * LE;
        recompute_rows<F, NL>(cur, next, dh, qt, vt, L, E);
        for (int l = 0; l < L; l++) ns[(i + 1) * L + l] = dh[l] * ns[i * L + l] + qt[l];
      }
      for (int l = 0; l < L; l++) dd_chunk[l] = 0;
      for (int i = len - 1; i >= 0; i--) {
        const int t = t0 + i;
        if (c > 0) prefetch_step(t - chunk);  // the previous chunk's step i
        const int64_t o = ((int64_t)b * T + t) * H + h;
        const F* qt = q + o * L;
        const F* vt = v + (((int64_t)b * T + t) * Hv + (Hv == 1 ? 0 : h)) * E;
        const F* np = ns.data() + i * L;
        const F s = (F)EPS + simd::dot<F>(qt, nullptr, L);
        for (int l = 0; l < L; l++) z[l] = qt[l] / (s * (np[l] + (F)EPS));
        backward_rows<F, NL>(dRT.data(), rhos.data() + i * LE, qt, dh, z.data(), vt, dy + o * E, dv + o * E,
                             a.data(), g.data(), r.data(), reinterpret_cast<F*>(pd_part.data()), L, E);
        const F zdz = simd::dot(r.data(), z.data(), L);
        F* dqt = dq + o * L;
        for (int l = 0; l < L; l++) {
          const F im = 1 / (np[l] + (F)EPS);
          dd_chunk[l] += g[l] + dn[l] * np[l];
          dqt[l] = a[l] + dn[l] + (r[l] * im - zdz) / s;
          dn[l] = dh[l] * dn[l] - r[l] * z[l] * im;
        }
        if (starts && starts[(int64_t)b * T + t]) {  // the gradient stops at a document's start
          std::fill(dRT.begin(), dRT.end(), F(0));
          std::fill(dn.begin(), dn.end(), F(0));
        }
      }
      for (int l = 0; l < L; l++) dd_acc[l] += dd_chunk[l];
    }
    transpose(dRT.data(), drho0 + bh * LE, E, L);
    std::memcpy(dn0 + (int64_t)bh * L, dn.data(), L * sizeof(F));
    for (int l = 0; l < L; l++) dd[(int64_t)bh * L + l] = (F)dd_acc[l];
  }
}

}  // namespace

extern "C" {

// Compile-time sizes: the forward's E, the backward's L (see the top of this file).
#define RWKVX_PICK(fn, F, X) \
  (X == 16 ? fn<F, 16> : X == 32 ? fn<F, 32> : X == 64 ? fn<F, 64> : X == 128 ? fn<F, 128> : fn<F, 0>)

#define RWKVX_EXPORT(F, SUFFIX)                                                                                      \
  void rwkv8_forward_##SUFFIX(const F* q, const F* v, const F* d, const F* rho0, const F* n0,                        \
                              const uint8_t* starts, F* y, F* rhoT, F* nT, F* snaps, F* nsnaps, int B, int T, int H, \
                              int Hv, int L, int E, int chunk, int threads) {                                        \
    auto fn = RWKVX_PICK(forward, F, E);                                                                             \
    fn(q, v, d, rho0, n0, starts, y, rhoT, nT, snaps, nsnaps, B, T, H, Hv, L, E, chunk, threads);                    \
  }                                                                                                                  \
  void rwkv8_backward_##SUFFIX(const F* q, const F* v, const F* d, const F* snaps, const F* nsnaps,                  \
                               const uint8_t* starts, const F* dy, const F* drhoT, const F* dnT, F* dq, F* dv,       \
                               F* dd, F* drho0, F* dn0, int B, int T, int H, int Hv, int L, int E, int chunk,        \
                               int threads) {                                                                        \
    auto fn = RWKVX_PICK(backward, F, L);                                                                            \
    fn(q, v, d, snaps, nsnaps, starts, dy, drhoT, dnT, dq, dv, dd, drho0, dn0, B, T, H, Hv, L, E, chunk, threads);   \
  }

RWKVX_EXPORT_PRECISIONS
}
