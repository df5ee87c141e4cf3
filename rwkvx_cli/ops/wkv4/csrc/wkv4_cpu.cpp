// WKV4 forward and backward on the CPU: RWKV-LM v4neo's stabilised recurrence,
// one OpenMP task per (batch, group of NV vectors of channels), the group's state in SIMD
// registers for the whole sequence (channels are independent: no reductions).
//
// Layout: k, v, y, dk, dv [B, T, C] contiguous (C = H*N); w, u [C]; states and
// their gradients [B, C]; snapshots [B, n_chunks, 3, C] hold (aa, bb, pp) before
// the first step of each chunk; dw, du are written per batch row, [B, C]. starts [B, T]
// (bytes, 0 or 1; null: none) marks the steps where a document starts: the state before
// them is the fresh state (0, 0, -1e38) (docs/operators.md#document-starts).
//
// Per channel and step (see reference.py):
//   y_t = (e1 aa + e2 v) / (e1 bb + e2),  e1, e2 = e^{pp - q}, e^{u + k - q},  q = max(pp, u + k)
//   aa, bb = f1 aa + f2 v, f1 bb + f2,    f1, f2 = e^{pp + w - q'}, e^{k - q'}, pp' = q' = max(pp + w, k)
// One of e1, e2 (and of f1, f2) is 1, so a step costs two exps.
//
// Backward, reverse over t with (ga, gb, gp) = dL/d(aa, bb, pp) after step t and
// D = gp - ga aa - gb bb: a state is defined up to (aa e^c, bb e^c, pp - c), which
// leaves every output unchanged, so D is 0 unless the final pp's own cotangent reaches
// back through a chain of steps where pp + w stayed the maximum, s = [pp + w >= k].
// Each case takes the form without cancellation (nw = f2 (ga v + gb), od = f1 (ga aa + gb bb)):
//   s:   dw += gp - nw ; dk = nw     ; gp = gp - nw          (pp' = pp + w)
//   !s:  dw += od      ; dk = nw + D ; gp = od ; D = 0       (pp' = k)
//   dv = f2 ga ; ga, gb = f1 ga, f1 gb   (nw, dv, ga, gb times 1 + err: see update_select)
//   then the output: g = dy / den ; ga += g e1 ; gb -= g e1 y ; gp += g e1 (aa - y bb) ;
//   dv += g e2 ; du, dk += g e2 (v - y)
// and the initial state's gradients are (ga, gb, gp) after step 0. At a document start
// the state before the step is a constant: (ga, gb, gp) and D are 0 there (none of the
// step's gradient reaches back). The backward recomputes each chunk's states from its
// snapshot (keeping the update's exp, resetting where the forward did), then runs the
// reverse scan.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../../csrc/simd.h"

namespace {

using simd::Vec;

// Vectors per task: enough independent chains in flight to hide the exp's latency,
// few enough that a task's state (w, u, aa, bb, pp: five vectors each) and the exp's
// temporaries fit the register file: 4 with AVX-512's 32 registers, else 2.
constexpr int NV = simd::kRegs >= 32 ? 4 : 2;

// Loads and stores of the first n lanes (n > 0); the zero-filled tail lanes of a
// partial group compute harmless finite values that are never stored.
template <typename F>
inline typename Vec<F>::type load(const F* p, int n) {
  typename Vec<F>::type x = {};
  if (n >= Vec<F>::L)
    std::memcpy(&x, p, sizeof(x));
  else
    for (int l = 0; l < n; l++) x[l] = p[l];
  return x;
}

template <typename F>
inline void store(F* p, typename Vec<F>::type x, int n) {
  if (n >= Vec<F>::L)
    std::memcpy(p, &x, sizeof(x));
  else
    for (int l = 0; l < n; l++) p[l] = x[l];
}

template <typename V>
inline V vexp(V x) {
  return simd::exp_nonpos(x);
}

template <typename V>
inline V vabs(V x) {
  return x < 0 ? -x : x;
}

template <typename V>
using Mask = decltype(V{} < V{});

// pp of the fresh state (aa = bb = 0), the public function's FRESH_PP: a document's first step
// gives it weight e^{pp - q} = 0, and every exponent stays finite.
template <typename F>
constexpr F kFreshPP = (F)-1e38;

// Both exponents are formed as differences first, (pp - k) -/+ u or w: pp - k is
// exact when the two are close, so large pp and k lose nothing there.

// The output's weights e1, e2 (one of them 1), y_t and 1 / den from the state before step t.
template <typename V>
inline V output(V a, V b, V p, V u, V k, V v, V& e1, V& e2, V& inv) {
  const V d = (p - k) - u;
  const V e = vexp(-vabs(d));
  const Mask<V> s = d >= 0;
  e1 = s ? V{} + 1 : e, e2 = s ? e : V{} + 1;
  inv = 1 / (e1 * b + e2);
  return (e1 * a + e2 * v) * inv;
}

// The update's selection s = [pp + w >= k], f = e^{-|pp + w - k|}, the new pp, and
// err = (pp + w) - fl(pp + w) exactly (TwoSum) where s, else 0. The kernels scale the new
// aa and bb by 1 + err (as x + x err, so that no rounding of 1 + err biases a long run):
// without it, a long run of small decays on a large pp (|w| = 1e-4 at pp = 90, where
// the fp32 spacing is 7.6e-6) would round every step's w and drift; with it each rounding
// of pp is folded into aa and bb. (err is 0 in exact arithmetic: the backward scales the
// same way and treats it as a constant.)
template <typename V>
inline Mask<V> update_select(V p, V w, V k, V& f, V& p_new, V& err) {
  const V d = (p - k) + w;
  f = vexp(-vabs(d));
  const Mask<V> s = d >= 0;
  const V sum = p + w, bp = sum - p;
  err = s ? (p - (sum - bp)) + (w - bp) : V{};
  p_new = s ? sum : k;
  return s;
}

// The weights of the old state and of the new token: (1, f) where s, else (f, 1).
template <typename V>
inline void update_weights(Mask<V> s, V f, V& f1, V& f2) {
  f1 = s ? V{} + 1 : f, f2 = s ? f : V{} + 1;
}

template <typename F>
void forward(const F* w, const F* u, const F* k, const F* v, const F* aa0, const F* bb0, const F* pp0,
             const uint8_t* starts, F* y, F* aaT, F* bbT, F* ppT, F* snaps, int B, int T, int C, int chunk,
             int threads) {
  typedef typename Vec<F>::type V;
  constexpr int L = Vec<F>::L, G = NV * L;
  const int groups = (C + G - 1) / G, n_chunks = (T + chunk - 1) / chunk;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int task = 0; task < B * groups; task++) {
    const int b = task / groups, c0 = (task % groups) * G;
    int cnt[NV];
    V wv[NV], uv[NV], a[NV], bs[NV], p[NV];
    for (int q = 0; q < NV; q++) {
      const int c = c0 + q * L;
      cnt[q] = c < C ? C - c : 0;
      if (!cnt[q]) continue;
      wv[q] = load(w + c, cnt[q]), uv[q] = load(u + c, cnt[q]);
      const int64_t s = (int64_t)b * C + c;
      a[q] = load(aa0 + s, cnt[q]), bs[q] = load(bb0 + s, cnt[q]), p[q] = load(pp0 + s, cnt[q]);
    }
    for (int t = 0; t < T; t++) {
      const int64_t o = ((int64_t)b * T + t) * C + c0;
      F* snap = t % chunk ? nullptr : snaps + (((int64_t)b * n_chunks + t / chunk) * 3) * C + c0;
      const bool fresh = starts && starts[(int64_t)b * T + t];
      for (int q = 0; q < NV; q++) {
        if (!cnt[q]) continue;
        const int64_t oq = o + q * L;
        if (fresh) a[q] = bs[q] = V{}, p[q] = V{} + kFreshPP<F>;  // before the snapshot the backward starts from
        if (snap) {
          store(snap + q * L, a[q], cnt[q]), store(snap + C + q * L, bs[q], cnt[q]);
          store(snap + 2 * C + q * L, p[q], cnt[q]);
        }
        const V kt = load(k + oq, cnt[q]), vt = load(v + oq, cnt[q]);
        V e1, e2, inv, f, f1, f2, p_new, err;
        store(y + oq, output(a[q], bs[q], p[q], uv[q], kt, vt, e1, e2, inv), cnt[q]);
        const Mask<V> s = update_select(p[q], wv[q], kt, f, p_new, err);
        update_weights(s, f, f1, f2);
        a[q] = f1 * a[q] + f2 * vt, bs[q] = f1 * bs[q] + f2, p[q] = p_new;
        a[q] += a[q] * err, bs[q] += bs[q] * err;
      }
    }
    for (int q = 0; q < NV; q++) {
      if (!cnt[q]) continue;
      const int64_t s = (int64_t)b * C + c0 + q * L;
      store(aaT + s, a[q], cnt[q]), store(bbT + s, bs[q], cnt[q]), store(ppT + s, p[q], cnt[q]);
    }
  }
}

template <typename F>
void backward(const F* w, const F* u, const F* k, const F* v, const F* aaT, const F* bbT, const F* snaps,
              const uint8_t* starts, const F* dy, const F* daaT, const F* dbbT, const F* dppT, F* dw, F* du, F* dk,
              F* dv, F* daa0, F* dbb0, F* dpp0, int B, int T, int C, int chunk, int threads) {
  typedef typename Vec<F>::type V;
  constexpr int L = Vec<F>::L, G = NV * L;
  const int groups = (C + G - 1) / G, n_chunks = (T + chunk - 1) / chunk;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int task = 0; task < B * groups; task++) {
    const int b = task / groups, c0 = (task % groups) * G;
    int cnt[NV];
    V wv[NV], uv[NV], ga[NV], gb[NV], gp[NV], D[NV];
    double dw_acc[G] = {}, du_acc[G] = {};  // per-chunk fp32 sums are added here: long T stays accurate
    for (int q = 0; q < NV; q++) {
      const int c = c0 + q * L;
      cnt[q] = c < C ? C - c : 0;
      if (!cnt[q]) continue;
      wv[q] = load(w + c, cnt[q]), uv[q] = load(u + c, cnt[q]);
      const int64_t s = (int64_t)b * C + c;
      ga[q] = load(daaT + s, cnt[q]), gb[q] = load(dbbT + s, cnt[q]), gp[q] = load(dppT + s, cnt[q]);
      D[q] = gp[q] - ga[q] * load(aaT + s, cnt[q]) - gb[q] * load(bbT + s, cnt[q]);
    }
    // The chunk's states before each step, and the update's exp: [chunk][4][NV].
    std::vector<V> st((size_t)chunk * 4 * NV);
    for (int ch = n_chunks - 1; ch >= 0; ch--) {
      const int t0 = ch * chunk, len = T - t0 < chunk ? T - t0 : chunk;
      const F* snap = snaps + (((int64_t)b * n_chunks + ch) * 3) * C + c0;
      V a[NV], bs[NV], p[NV], dwc[NV], duc[NV];
      for (int q = 0; q < NV; q++) {
        if (!cnt[q]) continue;
        a[q] = load(snap + q * L, cnt[q]), bs[q] = load(snap + C + q * L, cnt[q]);
        p[q] = load(snap + 2 * C + q * L, cnt[q]);
        dwc[q] = duc[q] = V{};
      }
      const uint8_t* fresh = starts ? starts + (int64_t)b * T + t0 : nullptr;
      for (int i = 0; i < len; i++) {
        const int64_t o = ((int64_t)b * T + t0 + i) * C + c0;
        V* si = st.data() + (size_t)i * 4 * NV;
        for (int q = 0; q < NV; q++) {
          if (!cnt[q]) continue;
          if (fresh && fresh[i]) a[q] = bs[q] = V{}, p[q] = V{} + kFreshPP<F>;
          const V kt = load(k + o + q * L, cnt[q]), vt = load(v + o + q * L, cnt[q]);
          V f, f1, f2, p_new, err;
          const Mask<V> s = update_select(p[q], wv[q], kt, f, p_new, err);
          update_weights(s, f, f1, f2);
          si[q] = a[q], si[NV + q] = bs[q], si[2 * NV + q] = p[q], si[3 * NV + q] = f;
          a[q] = f1 * a[q] + f2 * vt, bs[q] = f1 * bs[q] + f2, p[q] = p_new;
          a[q] += a[q] * err, bs[q] += bs[q] * err;
        }
      }
      for (int i = len - 1; i >= 0; i--) {
        const int64_t o = ((int64_t)b * T + t0 + i) * C + c0;
        const V* si = st.data() + (size_t)i * 4 * NV;
        for (int q = 0; q < NV; q++) {
          if (!cnt[q]) continue;
          const int64_t oq = o + q * L;
          const V at = si[q], bt = si[NV + q], pt = si[2 * NV + q], f = si[3 * NV + q];
          const V kt = load(k + oq, cnt[q]), vt = load(v + oq, cnt[q]), dyt = load(dy + oq, cnt[q]);
          V f_again, p_new, err, f1, f2, e1, e2, inv;
          const Mask<V> s = update_select(pt, wv[q], kt, f_again, p_new, err);  // as the forward decided
          update_weights(s, f, f1, f2);
          V nw = f2 * (ga[q] * vt + gb[q]);
          nw += nw * err;
          const V od = f1 * (ga[q] * at + gb[q] * bt);
          gp[q] = s ? gp[q] - nw : od;
          dwc[q] += gp[q];
          V gk = s ? nw : nw + D[q];
          V gv = f2 * ga[q];
          gv += gv * err;
          ga[q] *= f1, gb[q] *= f1, D[q] = s ? D[q] : V{};
          ga[q] += ga[q] * err, gb[q] += gb[q] * err;
          const V yt = output(at, bt, pt, uv[q], kt, vt, e1, e2, inv), g = dyt * inv;
          ga[q] += g * e1, gb[q] -= g * e1 * yt, gp[q] += g * e1 * (at - yt * bt);
          const V gy = g * e2 * (vt - yt);
          gv += g * e2, gk += gy, duc[q] += gy;
          store(dk + oq, gk, cnt[q]), store(dv + oq, gv, cnt[q]);
          if (fresh && fresh[i]) ga[q] = gb[q] = gp[q] = D[q] = V{};  // the state before a start is a constant
        }
      }
      for (int q = 0; q < NV; q++)
        for (int l = 0; l < L; l++) dw_acc[q * L + l] += dwc[q][l], du_acc[q * L + l] += duc[q][l];
    }
    for (int q = 0; q < NV; q++) {
      if (!cnt[q]) continue;
      const int64_t s = (int64_t)b * C + c0 + q * L;
      store(daa0 + s, ga[q], cnt[q]), store(dbb0 + s, gb[q], cnt[q]), store(dpp0 + s, gp[q], cnt[q]);
      V dwq, duq;
      for (int l = 0; l < L; l++) dwq[l] = (F)dw_acc[q * L + l], duq[l] = (F)du_acc[q * L + l];
      store(dw + s, dwq, cnt[q]), store(du + s, duq, cnt[q]);
    }
  }
}

}  // namespace

extern "C" {

#define RWKVX_EXPORT(F, SUFFIX)                                                                                     \
  void wkv4_forward_##SUFFIX(const F* w, const F* u, const F* k, const F* v, const F* aa0, const F* bb0,          \
                             const F* pp0, const uint8_t* starts, F* y, F* aaT, F* bbT, F* ppT, F* snaps, int B,    \
                             int T, int C, int chunk, int threads) {                                                \
    forward<F>(w, u, k, v, aa0, bb0, pp0, starts, y, aaT, bbT, ppT, snaps, B, T, C, chunk, threads);                \
  }                                                                                                                 \
  void wkv4_backward_##SUFFIX(const F* w, const F* u, const F* k, const F* v, const F* aaT, const F* bbT,         \
                              const F* snaps, const uint8_t* starts, const F* dy, const F* daaT, const F* dbbT,     \
                              const F* dppT, F* dw, F* du, F* dk, F* dv, F* daa0, F* dbb0, F* dpp0, int B, int T,   \
                              int C, int chunk, int threads) {                                                      \
    backward<F>(w, u, k, v, aaT, bbT, snaps, starts, dy, daaT, dbbT, dppT, dw, du, dk, dv, daa0, dbb0, dpp0, B, T, \
                C, chunk, threads);                                                                                 \
  }

RWKVX_EXPORT_PRECISIONS
}
