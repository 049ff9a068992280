// Exact per-example clipping (modes flat and per_layer; DESIGN.md §6): the per-example norms of a
// layer's parameter gradient (here), and its clipped weight/bias gradient with the noise
// (csrc/exact_release.cpp, whose bound is proved here). Written once over
// ATen (bmm, convolution_backward) and our dispatcher ops, so the same code serves CPU and
// CUDA; the clip factors themselves come from clip_rows (csrc/include/bpclip_fast/clip.h).
//
// ---- The norm bound the factors are computed from --------------------------------------------
// Example i of a layer has positions t (Linear: the T rows of a [B, T, d] input, T = 1 for 2-D;
// Conv2d: the output positions of each channel group gamma) with input vectors x_t (Linear: the
// input row; Conv2d: the zero-padded patch U_{gamma,t}) and upstream gradients g_t. Its gradient is
// G = [G_W, G_b] with G_W = sum_t g_t x_t^T (block-diagonal over the groups) and G_b = sum_t g_t.
// The ops return sq (the computed ||G||^2) and bound, with c * bound an upper bound on the norm of
// what the release holds of example i at factor c (below), with the spread P = sum_t ||g_t|| sqrt(||x_t||^2 [W] + [b]) >= ||G||:
//
//   bound = sqrt(sq * grow + eps * P^2 + under) + kappa * P + extra + 2K q sqrt(p) X,
//   X = sum_t sqrt(||x_t||^2 [W] + [b])
//
// (u: unit roundoff of the GEMMs' arithmetic, 2^-24 for fp32, 2^-11 or 2^-8 when torch lets fp32
// matmuls run in TF32 or bf16, 2^-53 for fp64; v = 2^-53; gamma_k(u) = k u / (1 - k u); tau: what
// one GEMM operation may lose absolutely to underflow, 2^-126 for fp32 (the smallest normal: a
// result flushed to zero, or a subnormal input read as zero, loses less), 2^-1022 for fp64).
// The position norms a_t, b_t bound ||x_t||, ||g_t|| (bound_consts): every layer, at every T, has
// the kernel sum each position's squares itself, in double (a Linear's input rows; a Conv2d's
// zero-padded patches, [n G, d, T] from conv_patches, read transposed, d = C_in/G kh kw entries of
// its own group, padding taps exact zeros; the upstream gradient's p channels of the group): squares
// of fp32 (fp16/bf16 upcast) values are exact in double, so only the d - 1 (p - 1) additions round,
// which the slack below covers; an fp64 square may underflow, covered by adding 3 d tau (3 p tau).
// Every sum of them below (P, X, M = sum_t a_t b_t, A1 = sum_t a_t, B1 =
// sum_t b_t) is computed in double and inflated by 1 + 2 gamma_{T+d+p+G+4}(v) for its own rounding,
// the norms' sums of d or p squares and the sum over a Conv2d's G channel groups (G = 1 for Linear;
// the groups' under and extra terms are summed too, covered by 2 gamma_{G+4}(v) in out_slack).
// Everything after the GEMMs is one kernel per chunk, exact_bound_ (bpclip_fast/bound.h: the
// position norms, sq, P, X, the error terms and the bound, per example in double). Its sums run in
// the order of a warp's lanes and their reduction tree (the CPU kernel runs the same order); every
// gamma term below holds for any order of a sum, and a CUDA build may contract a*b + c into one FMA,
// which rounds once where the analysis allows two.
// * A dot product sum_e y_e z_e of length k in the GEMMs errs by <= gamma_k(u) sum |y_e z_e| + a
//   part that underflow loses: a subnormal input read as 0 loses <= tau |other factor| (summed:
//   <= tau sqrt(k) (||y|| + ||z||)); each of the k products and k additions whose result is flushed
//   to 0 loses < min(tau, its exact value) <= min(tau, (1 + gamma_k) S), S = sum |y_e z_e| <= ||y||
//   ||z||, propagated by at most 1 + gamma_k: together <= (1 + gamma_k) min(2k tau, (k + 1)(1 +
//   gamma_k) S) <= (1 + gamma_k) sqrt(2k tau (k + 1)(1 + gamma_k) S).
// * Ghost (T > 1; G_W from Gram matrices, ||G_W||^2 = sum_{s,t} <x_s, x_t><g_s, g_t>): by the above
//   and sqrt(a_s a_t) <= (a_s + a_t)/2, a computed entry of x's Gram errs by e^x_st <= gamma_d a_s
//   a_t + kappa_d (a_s + a_t), kappa_k = tau sqrt(k) + (1 + gamma_k) sqrt(2k tau (k + 1)(1 +
//   gamma_k)) / 2; likewise e^g_st with p. With |<x_s,x_t>| <= a_s a_t and |<g_s,g_t>| <= b_s b_t,
//   the products of computed entries err by <= e^x b_s b_t + e^g a_s a_t + e^x e^g, which sum over
//   (s, t) to E = (gamma_d + gamma_p + gamma_d gamma_p) M^2 + 2M (kappa_d (1 + gamma_p) B1 + kappa_p
//   (1 + gamma_d) A1) + 2 kappa_d kappa_p (T M + A1 B1) (sum_{s,t} (a_s + a_t) b_s b_t = 2 M B1, and
//   so on). The products are taken in double (rounding v; in fp32 they overflowed for finite
//   examples with entries near 1e12) and the T^2 of them summed in double, which adds <= w (M^2 +
//   E), w = v + gamma_{T^2}(v)(1 + v) (the absolute products sum to <= M^2 + E). So ||G_W||^2 <=
//   sq_W + under, under = (1 + w) E + w M^2 (times 1 + 2^-40 for the evaluation of these formulas).
//   Without the tau terms, fp32 Gram entries of an input near 1e-24 underflowed to 0 while the
//   upstream gradient's were near 1e38: bound 0 for an example of norm 0.05, 52 C by removal.
// * T = 1 layers (Linear and Conv2d alike): sq = (a a)(b b) from the double norms a = sqrt(S_x),
//   b = sqrt(S_g) (S the double sums of squares, within gamma_d(v) and gamma_p(v)): each root's
//   rounding counts twice once squared, then the two squares and their product round once each, so
//   |sq_W - ||G_W||^2| <= e1 M^2, e1 = (1 + gamma_d(v))(1 + gamma_p(v))(1 + v)^7 - 1; and eps =
//   e1 + gamma_8(v)(1 + e1) also covers the evaluation of the bound's formula (sq grow, eps P P, two
//   additions and the root: at most 7 roundings of the radicand), for which fp64 data has no other
//   slack (u = v there; fp32 data's grow carries 1/(1 - 2^-24)). (Until issue 25 e1 counted the
//   product alone and eps gamma_1: for fp64 data with few outputs the bound could fall ~3 ulp short.)
// * Instantiation (T > 1; G_W per example by one GEMM over the T positions): entry (j, k) is a dot
//   product of length T with S_jk = sum_t |g_tj||x_tk|, sum_jk S_jk <= sqrt(d p) M: its relative part
//   sums to ||.|| <= gamma_T(u) M (in kappa P); its subnormal inputs lose <= min(tau (A1 + B1),
//   S_jk) (an input entry is at most its row's norm), <= sqrt(tau (A1 + B1) S_jk); its flushed
//   results <= (1 + gamma_T) sqrt(2T tau (T + 1)(1 + gamma_T) S_jk). Summed in the Frobenius norm:
//   ||G_W - G_W^|| <= gamma_T(u) M + extra, extra = sqrt(tau (A1 + B1) sqrt(dp) M) + (1 + gamma_T)
//   sqrt(2T tau (T + 1)(1 + gamma_T) sqrt(dp) M) (times 1 + 2^-40). The squares of G_W^ are taken in
//   double (they round once, by v, and cannot overflow) and summed in double: ||G_W^||^2 <= sq_W
//   grow. (Per channel group for Conv2d; the groups' under terms add under the root and their extra
//   terms add up.)
// * The bias sum is taken in double (error <= gamma_T(v) sum_t ||g_t|| <= gamma_T(v) P).
// * The release works in the accumulation dtype A (fp32; fp64 for fp64 data), also for fp16/bf16
//   data, whose values are exact in fp32: it scales g_t by c and rounds toward zero to A
//   (scale_rows), g^_t = RZ_A(c g_t), and multiplies by the inputs x_t as stored (upcast exactly).
//   Entrywise |RZ_A(y) - y| <= r |y| for a normal result and < q for a subnormal one (r = 2^-23,
//   q = 2^-149 for fp32; 2^-52 and 2^-1074 for fp64), so g^_t - c g_t = e'_t + e''_t with
//   |e'_t| <= r c |g_t| and |e''_t| <= q entrywise. Example i's part of the release is
//   sum_t g^_t [x_t; 1]^T (over the trained parameters; per channel group for Conv2d, whose
//   groups are disjoint blocks), and the two errors move it by <= r c P and by
//   <= sum_t q sqrt(p) ||[x_t; 1]|| = q sqrt(p) X (p: the output channels of a group). Where torch
//   may run the release's fp32 GEMM or convolution in TF32/bf16 (float32_matmul_precision below
//   'highest'; cuDNN's allow_tf32 for convolutions on CUDA; oneDNN's fp32 precision), its inputs
//   g^ and x are rounded to nearest at r_in first (2^-11, 2^-8), which multiplies each position's
//   term by at most (1 + r_in)^2 more: the relative part is then (1 + r)(1 + r_in)^2 - 1 =: r'.
// Hence, by the triangle inequality on [G_W, G_b] and these perturbations, the contribution the
// release holds is <= c (bound - 2K q sqrt(p) X) + q sqrt(p) X with grow = (1 - u)^-1 (1 -
// gamma_n(v))^-1 (n the terms summed, with the groups' G - 1 additions of their rows), eps as
// above (T = 1; 0 otherwise), under and extra as above, and kappa = gamma_T(u)
// [instantiation] + gamma_T(v) + r'. The absolute part q sqrt(p) X does not scale with c: the
// bound carries it as 2K q sqrt(p) X (K = 2^60; the 2 covers the double rounding of that term and
// its share of the last addition's) and exact.factors gives factor 0 to every example whose
// factor falls below 1/K, so every kept example has c 2K q sqrt(p) X >= q sqrt(p) X and its
// contribution is <= c * bound. clip_rows then gives c with c * bound <= C (its own proof). The
// factor floor drops only examples whose bound exceeds 2^60 C; they are not counted non-finite
// (a finite example within the range below never is: the count would release a data-dependent bit
// under strict mode).
// fp16/bf16 data: the clipped sum and the noise are added in A and rounded to the parameter dtype
// once, by the caller, after the noise (post-processing of the noised value): no sum over the
// batch is rounded to a low-precision dtype before the noise, and the scaled upstream gradient is
// never rounded to fp16 (whose subnormals, 2^-24 apart, lost the cancellation of positions).
// Not covered: subnormals flushed to zero (torch.set_flush_denormal(True), or a GEMM that flushes
// its fp32 inputs) move an entry by up to 2^-126 rather than q; the rounding of the batch sum
// itself (the GEMM over all examples) is outside the per-example argument, as everywhere.
// Range: the Gram matrices and the instantiated gradients (and the kept bias sums, kept_release in
// csrc/exact_release.cpp) are fp32 for fp32 (and fp16/bf16) data, so an example with input or
// upstream-gradient rows of norm above ~2^64 can still overflow them; its bound is then +Inf and it
// gets factor 0 and is counted as non-finite (no contribution, so the bound holds). The position
// norms themselves have no such limit for fp32 data (double sums of exact squares).
// fp64 data: squares below 2^-1022 may underflow the double position norms, so those add
// 3 d tau (3 p tau) to each position's sum (not clip.h's absolute limit: a lost ||x_t|| multiplies
// ||g_t||, and x ~ 1e-163 with g ~ 1e153 gave a ghost bound of 0).
//
// ---- Memory layout ------------------------------------------------------------------------------
// Every op reads its tensors by their logical indices (reshape, narrow, convolution, the bound
// kernel's strides, and conv_patches, which reads the input through its own strides), so
// channels_last, permuted, sliced or expanded inputs and upstream gradients give the norms of the
// values the release multiplies.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "bpclip_fast/bound.h"
#include "common.h"
#include "dispatch.h"
#include "host_cache.h"

namespace bpclip {
namespace {

double gamma_k(double k, double u) { return k * u / (1.0 - k * u); }

constexpr double kV = 0x1p-53;  // double's unit roundoff: the sums of squares and the bias sums

// Unit roundoff of the norms' GEMMs: torch may run fp32 matmuls in TF32 ('high') or bf16 ('medium').
double gemm_unit(at::ScalarType acc) {
  if (acc == at::kDouble) return kV;
  switch (at::globalContext().float32MatmulPrecision()) {
    case at::Float32MatmulPrecision::HIGH:
      return 0x1p-11;
    case at::Float32MatmulPrecision::MEDIUM:
      return 0x1p-8;
    default:
      return 0x1p-24;
  }
}

// The release rounds c*g toward zero to the accumulation dtype (scale_rows; fp32 also for fp16/bf16
// data): relative error r for a normal result, absolute < q (the smallest subnormal) otherwise.
double rz_unit(at::ScalarType acc) { return acc == at::kDouble ? 0x1p-52 : 0x1p-23; }
double subnormal_quantum(at::ScalarType acc) { return acc == at::kDouble ? 0x1p-1074 : 0x1p-149; }

// tau of the file comment: what one operation of the norms' GEMMs may lose absolutely to underflow,
// allowing for flush-to-zero of results and denormals-are-zero of inputs (the smallest normal).
double underflow_unit(at::ScalarType acc) { return acc == at::kDouble ? 0x1p-1022 : 0x1p-126; }

// kFloorInverse (K of the file comment): bpclip_fast/bound.h.

// Unit of the rounding to nearest that torch may apply to the release's fp32 GEMM or convolution
// inputs (TF32: 2^-11, bf16: 2^-8), 0 where it computes in plain fp32 (or fp64).
double release_input_unit(const at::Tensor& x, at::ScalarType acc, bool conv) {
  if (acc == at::kDouble) return 0.0;
  auto& ctx = at::globalContext();
  double r = 0.0;
  switch (ctx.float32MatmulPrecision()) {
    case at::Float32MatmulPrecision::HIGH:
      r = 0x1p-11;
      break;
    case at::Float32MatmulPrecision::MEDIUM:
      r = 0x1p-8;
      break;
    default:
      break;
  }
  if (conv) {
    if (x.is_cuda() && ctx.allowTF32CuDNN(at::Float32Op::CONV)) r = std::max(r, 0x1p-11);
    const auto mkldnn = ctx.float32Precision(at::Float32Backend::MKLDNN, at::Float32Op::CONV);
    if (mkldnn == at::Float32Precision::TF32) r = std::max(r, 0x1p-11);
    if (mkldnn == at::Float32Precision::BF16) r = std::max(r, 0x1p-8);
  }
  return r;
}

enum class Method { kGhost, kInstantiate };

Method parse_method(c10::string_view s, bool ghost_cheaper) {
  if (s == "ghost") return Method::kGhost;
  if (s == "instantiate") return Method::kInstantiate;
  TORCH_CHECK(s == "auto", "bpclip_fast: norm method must be 'auto', 'ghost' or 'instantiate', got '", std::string(s),
              "'");
  return ghost_cheaper ? Method::kGhost : Method::kInstantiate;
}

// The cost rule (docs/design.md): per example and channel group, ghost costs T^2 (d + p)
// multiply-adds (two Gram matrices), instantiation T d p; ghost wins when T (d + p) < d p.
bool ghost_cheaper(int64_t T, int64_t d, int64_t p) { return T == 1 || T * (d + p) < d * p; }

// What the margins need to know about a layer's shapes (see the file comment).
struct Dims {
  int64_t T, d, p;
  bool weight, bias;
  double u;      // unit roundoff of the norms' GEMMs (gemm_unit)
  double tau;    // their absolute underflow per operation (underflow_unit)
  double r_in;   // rounding of the release's inputs by TF32/bf16 arithmetic (release_input_unit)
};

// Relative slack for sums of n non-negative double terms (and a few operations more) evaluated in
// double, in any order: an upper bound stays one after multiplying by it. Applied to the sums over
// positions of the position norms, with n covering both (T positions, rows of d or p squares).
double sum_slack(int64_t n) { return 1.0 + 2.0 * gamma_k(static_cast<double>(n + 4), kV); }

// The constants of the bound's formulas, in the order of bpclip_fast/bound.h (whose kernel
// exact_bound_ evaluates them per example in double; see the file comment for each term). groups:
// the rows per example (Conv2d's channel groups), whose sq, P, X, under and extra the kernel adds up
// in double (groups - 1 additions each).
std::vector<double> bound_consts(const Dims& dims, Method method, at::ScalarType acc, int64_t groups) {
  std::vector<double> c(kBoundConsts, 0.0);
  const double d = static_cast<double>(dims.d), p = static_cast<double>(dims.p), T = static_cast<double>(dims.T);
  const double tau = dims.tau, u = dims.u;
  // Position norms, every layer and every T: the kernel sums each position's d (p) squares itself,
  // in double (a Linear's input row; a Conv2d's zero-padded patch, whose padding taps are +0 and add
  // nothing; one (example, group) row's patch holds only its group's d = C_in/G kh kw entries).
  // fp32 (and fp16/bf16) data: a square of an fp32 value is exact in double (at most 2 x 24
  // significant bits, exponents within [-298, 256]: no overflow, no underflow), so the only error is
  // the d - 1 additions' rounding, S_t >= ||x_t||^2 (1 - gamma_d(v)), which the sums' slack below
  // covers (kSlack counts d + p). No grow, no add. (Until issue 25 a Conv2d's T > 1 positions were
  // fp32 sums of squares from a convolution of x^2 with ones: entries near 1e20 overflowed them to
  // +Inf, a bound of NaN for an example of norm ~1, and entries near 1e-24 underflowed them to the
  // 3 d tau that then had to be added, a bound ~1e5 times the norm.)
  // fp64 data: a square below 2^-1022 underflows in double (an entry below ~1.5e-162 squares to 0),
  // losing < tau each, and its addition may lose < tau (flush-to-zero): a_t^2 = RN(S + 3 d tau) >=
  // ||x_t||^2 (1 - gamma_d(v)) (1 - v). Without it, x ~ 1e-163 gave a_t = 0 while g ~ 1e153 made
  // ||G_W|| ~ 1e-10: a ghost bound of 0, whatever C (the norms are scale-free, so this is no absolute
  // 2^-537 loss as in clip.h: it multiplies ||g||).
  c[kGrowX] = c[kGrowG] = 1.0;
  const bool add = acc == at::kDouble;
  if (add) {
    c[kAddX] = 3.0 * d * tau;
    c[kAddG] = 3.0 * p * tau;
  }
  // P, X, M, A1, B1 add up T positions (and P and X the groups' rows: groups - 1 additions; a
  // depthwise conv has many) of roots of the position sums, each of d or p squares: all within
  // sum_slack(T + d + p + groups).
  c[kSlack] = sum_slack(dims.T + dims.d + dims.p + groups);
  // The few roundings of the error terms' formulas (2^-40), and the groups' sums of under and extra
  // (non-negative terms; the product by this slack too).
  c[kOutSlack] = 1.0 + 0x1p-40 + 2.0 * gamma_k(static_cast<double>(groups + 4), kV);
  // The GEMMs' error terms (T > 1), from M = sum_t a_t b_t, A1 = sum_t a_t, B1 = sum_t b_t. Every
  // term has a factor M or A1 B1, so an example whose gradient is 0 because its x or g is 0 gets none.
  // Ghost: under = (1 + w) E + w M^2 bounds |sq_W - ||G_W||^2| (added under the root).
  const double gd = gamma_k(d, u), gp = gamma_k(p, u);
  // kappa_k: a Gram entry of length-k rows errs by <= gamma_k a_s a_t + kappa_k (a_s + a_t)
  const auto kappa_k = [tau](double k, double g) {
    return tau * std::sqrt(k) + (1.0 + g) * 0.5 * std::sqrt(2.0 * k * tau * (k + 1.0) * (1.0 + g));
  };
  const double kx = kappa_k(d, gd), kg = kappa_k(p, gp);
  c[kGhostM2] = gd + gp + gd * gp;
  c[kGhostB1] = kx * (1.0 + gp);
  c[kGhostA1] = kg * (1.0 + gd);
  c[kGhostAB] = 2.0 * kx * kg;
  c[kGhostW] = kV + gamma_k(T * T, kV) * (1.0 + kV);
  // Instantiation: extra bounds the underflow part of ||G_W - G_W^|| (added to the bound; the
  // relative part gamma_T(u) M is in kappa P).
  const double gT = gamma_k(T, u), root_dp = std::sqrt(d * p);
  c[kInstDaz] = tau * root_dp;
  c[kInstF1] = 1.0 + gT;
  c[kInstF2] = 2.0 * T * tau * (T + 1.0) * (1.0 + gT) * root_dp;
  // bound = sqrt(sq grow + eps P^2 + under) + kappa P + absolute X + extra.
  const double r = (1.0 + rz_unit(acc)) * (1.0 + dims.r_in) * (1.0 + dims.r_in) - 1.0;
  c[kAbsolute] = 2.0 * kFloorInverse * subnormal_quantum(acc) * std::sqrt(p);
  // The sq of a row: its terms' sum (terms roundings), the bias's p squares, their addition; then the
  // groups' rows added (groups - 1) and the product by grow. (The groups' sum was not counted: for
  // fp64 data, where u = v leaves one rounding of slack, a depthwise conv's bound fell ~57 ulp short
  // with 255 groups each under half an ulp of the first's sq.)
  const int64_t terms = method == Method::kGhost ? dims.T * dims.T : dims.d * dims.p;
  c[kGrow] = 1.0 / ((1.0 - u) * (1.0 - gamma_k(static_cast<double>(terms + dims.p + 2 + (groups - 1)), kV)));
  c[kKappa] = gamma_k(T, kV) + r;
  if (dims.T == 1) {  // ||x||^2 ||g||^2 from double norms
    // (d + 1, p + 1: the addition of add rounds too where it is not 0)
    const double dd = add ? d + 1.0 : d, pp = add ? p + 1.0 : p;
    const double e1 = (1.0 + gamma_k(dd, kV)) * (1.0 + gamma_k(pp, kV)) * std::pow(1.0 + kV, 7) - 1.0;
    c[kEps] = e1 + gamma_k(8.0, kV) * (1.0 + e1);
  } else if (method == Method::kInstantiate) {
    c[kKappa] += gamma_k(T, u);
  }
  return c;
}

// bpclip_fast::exact_bound_ through the dispatcher (the kernel of the tensors' device).
void exact_bound_(at::Tensor& sq, at::Tensor& bound, const at::Tensor& x, const at::Tensor& g, const at::Tensor& gb,
                  const at::Tensor& wa, const at::Tensor& wb, int64_t offset, int64_t per, int64_t flags,
                  at::ArrayRef<double> consts, const c10::optional<at::Tensor>& nonfinite) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("bpclip_fast::exact_bound_", "")
                       .typed<void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t,
                                   at::ArrayRef<double>, const c10::optional<at::Tensor>&)>();
  op.call(sq, bound, x, g, gb, wa, wb, offset, per, flags, consts, nonfinite);
}

// What one norms op builds over its chunks: sq and bound [B] (each chunk writes its examples),
// the kept per-example gradients, and what every chunk shares.
struct NormsOut {
  at::Tensor sq, bound;
  at::Tensor kept_w, kept_b;  // [B, G p d] and [B, G p] when kept (each chunk's GEMM writes its rows)
  Method method;
  Dims dims;
  std::vector<double> consts;
  c10::optional<at::Tensor> nonfinite;
};

// x3 [n, T, d], g3 [n, T, p] in the accumulation dtype (any strides), n = examples x groups; the
// kernel sums their positions' squares in double itself. The weight's sq comes from the GEMMs here
// (ghost: the two Gram matrices, whose entries' products the kernel takes and sums in double: a
// finite example with entries near 1e12 has Gram entries near 1e24, whose fp32 product overflowed;
// instantiation: [G_W] per row, squared and summed in double, which cannot overflow); everything
// else of the bound, for examples [offset, offset + n / per), by exact_bound_.
void rows_norms(NormsOut& out, int64_t offset, const at::Tensor& x3, const at::Tensor& g3, int64_t per, bool keep) {
  const int64_t n = x3.size(0);
  const Dims& dims = out.dims;
  at::Tensor wa, wb, gb = g3;
  bool summed = false;
  if (dims.weight && dims.T > 1) {
    if (out.method == Method::kGhost) {
      wa = at::bmm(x3, x3.transpose(1, 2)).reshape({n, -1});
      wb = at::bmm(g3, g3.transpose(1, 2)).reshape({n, -1});
    } else if (!keep) {
      const at::Tensor inst = at::bmm(g3.transpose(1, 2), x3);  // [n, p, d]: the weight's layout per group
      wa = wb = inst.reshape({n, -1});
    } else {  // straight into the kept rows (no concatenation of the chunks after)
      const int64_t rows = n / per;
      at::Tensor inst = out.kept_w.narrow(0, offset, rows).view({n, dims.p, dims.d});
      at::bmm_out(inst, g3.transpose(1, 2), x3);
      wa = wb = inst.view({n, -1});
      // Conv2d: a channel's bias gradient is over the positions of its own group only, so the
      // per-(example, group) sums concatenate to the example's bias gradient. Summed in the
      // accumulation dtype (the dtype examples_release takes with the weight's) and normed by the
      // kernel from these very values (kBoundBiasSummed): a sum that overflows is +Inf there too.
      if (dims.bias) {
        gb = out.kept_b.narrow(0, offset, rows).view({n, 1, dims.p});  // [n, 1, p]
        at::sum_out(gb, g3, {1}, true);
        summed = true;
      }
    }
  }
  if (!wa.defined()) wa = wb = x3.new_empty({0});  // no weight terms (T = 1, or the weight frozen)
  const int64_t flags = (dims.weight ? kBoundWeight : 0) | (dims.bias ? kBoundBias : 0) |
                        (out.method == Method::kGhost ? kBoundGhost : 0) | (summed ? kBoundBiasSummed : 0);
  exact_bound_(out.sq, out.bound, x3, g3, gb, wa, wb, offset, per, flags, out.consts, out.nonfinite);
}

// Examples per chunk so that one chunk's temporaries stay within `workspace` bytes.
int64_t chunk_rows(int64_t per_example_bytes, int64_t workspace, int64_t batch) {
  return std::max<int64_t>(1, std::min<int64_t>(batch, workspace / std::max<int64_t>(per_example_bytes, 1)));
}

void check_norm_inputs(const at::Tensor& grad_out, const at::Tensor& x, int64_t workspace, const char* op) {
  check_float_tensor(x, "the input");
  check_same_device(grad_out, x, "grad_out", "the input");
  TORCH_CHECK(grad_out.scalar_type() == x.scalar_type(), "bpclip_fast.", op, ": grad_out is ",
              grad_out.scalar_type(), " but the input is ", x.scalar_type());
  TORCH_CHECK(grad_out.size(0) == x.size(0), "bpclip_fast.", op, ": grad_out has ", grad_out.size(0),
              " examples but the input has ", x.size(0));
  TORCH_CHECK(workspace > 0, "bpclip_fast.", op, ": workspace must be positive bytes, got ", workspace);
}

using Norms = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Whether to keep the instantiated per-example gradients (the accumulation dtype) for the release
// instead of the upstream gradient and the input; keeping saves the release's GEMM over the
// positions (the per-example sums are one examples_release launch). Always where they are no larger
// than the upstream gradient the release would otherwise keep (keeping them never costs memory);
// beyond that where all of them, [B, G p d] and the bias sums [B, G p], fit in `extra` bytes (the
// caller's allowance: exact.py's KEPT_BYTES, shared by a flat forward's layers). Which path
// releases changes no bound: the kept release's is the norms' own (kept_release,
// csrc/exact_release.cpp).
bool keep_instantiated(bool keep, Method method, const Dims& dims, int64_t groups, const at::Tensor& grad_out,
                       at::ScalarType acc, int64_t extra) {
  const int64_t B = grad_out.size(0);
  if (!(keep && method == Method::kInstantiate && dims.weight && dims.T > 1 && B > 0)) return false;
  const int64_t acc_size = static_cast<int64_t>(at::elementSize(acc));  // fp64 data keeps fp64
  if (acc_size * groups * dims.p * dims.d <= grad_out.element_size() * (grad_out.numel() / B)) return true;
  const double bytes = static_cast<double>(B) * groups * dims.p * (dims.d + (dims.bias ? 1 : 0)) *
                       static_cast<double>(acc_size);
  return bytes <= static_cast<double>(extra);
}

NormsOut start_norms(const at::Tensor& x, int64_t B, Method method, const Dims& dims, int64_t groups, bool kept) {
  const at::TensorOptions f64 = x.options().dtype(at::kDouble), acc = x.options().dtype(acc_type_of(x));
  at::Tensor kw, kb;
  if (kept) {
    kw = host_empty({B, groups * dims.p * dims.d}, acc);
    if (dims.bias) kb = host_empty({B, groups * dims.p}, acc);
  }
  return NormsOut{at::empty({B}, f64), at::empty({B}, f64), kw, kb, method, dims,
                  bound_consts(dims, method, acc_type_of(x), groups), c10::nullopt};
}

Norms finish(const NormsOut& out, const at::Tensor& x) {
  // Distinct empty tensors: outputs of an op without alias annotations must not alias each other.
  const auto or_empty = [&](const at::Tensor& t) { return t.defined() ? t : x.new_empty({0}); };
  return {out.sq, out.bound, or_empty(out.kept_w), or_empty(out.kept_b)};
}

// t in the accumulation dtype: itself where it already is (no dispatcher call per chunk).
at::Tensor in_acc(const at::Tensor& t, at::ScalarType acc) { return t.scalar_type() == acc ? t : t.to(acc); }

Norms linear_grad_norms(const at::Tensor& grad_out, const at::Tensor& x, std::array<bool, 2> params,
                        c10::string_view method_name, int64_t workspace, bool keep,
                        const c10::optional<at::Tensor>& nonfinite, int64_t keep_extra) {
  check_norm_inputs(grad_out, x, workspace, "linear_grad_norms");
  TORCH_CHECK(x.dim() >= 2 && grad_out.dim() == x.dim(), "bpclip_fast.linear_grad_norms: input and grad_out must be "
              "[B, *, features] with the same number of dims");
  const int64_t B = x.size(0), d = x.size(-1), p = grad_out.size(-1);
  const int64_t T = B == 0 ? 1 : x.numel() / (B * std::max<int64_t>(d, 1));
  const at::ScalarType acc = acc_type_of(x);
  const Dims dims{T, d, p, params[0], params[1], gemm_unit(acc), underflow_unit(acc), release_input_unit(x, acc, false)};
  const Method method = parse_method(method_name, ghost_cheaper(T, d, p));
  const int64_t elt = at::elementSize(acc);
  const int64_t temps = method == Method::kGhost ? 5 * T * T : 3 * d * p;  // with the double copies
  // + the double copies the position norms may make of x and g
  const int64_t rows = chunk_rows(elt * (T * (d + p) + temps) + 8 * T * (d + p), workspace, B);
  const at::Tensor x3 = x.reshape({B, T, d}), g3 = grad_out.reshape({B, T, p});
  const bool kept = keep_instantiated(keep, method, dims, 1, grad_out, acc, keep_extra);
  // The kernel sums the rows' squares itself: four launches per layer fewer than the accumulation
  // dtype's (x * x).sum(2) and (g * g).sum(2), and exact squares.
  NormsOut out = start_norms(x, B, method, dims, 1, kept);
  out.nonfinite = nonfinite;
  for (int64_t b0 = 0; b0 < B; b0 += rows) {
    const int64_t n = std::min(rows, B - b0);
    const bool whole = n == B;  // one chunk: the tensors themselves, not views of them
    const at::Tensor xc = in_acc(whole ? x3 : x3.narrow(0, b0, n), acc);
    const at::Tensor gc = in_acc(whole ? g3 : g3.narrow(0, b0, n), acc);
    rows_norms(out, b0, xc, gc, 1, kept);
  }
  return finish(out, x);
}

// The zero-padded patches as [n, C_in kh kw, T] (im2col's layout: channel-major, so channel group
// gamma's rows are one block of d) in the accumulation dtype: bpclip_fast::conv_patches, one launch
// (ATen's chain was constant_pad_nd's fill and copy, then the copy of a strided view; ATen's CPU
// im2col loops over the examples and measured 50x slower on the MNIST net). It reads the input
// through its own strides (bpclip_fast/patches.h), so a channels_last, permuted, sliced or
// expanded input gives the pixels the release's convolution reads, and it upcasts fp16/bf16 input
// exactly in the same pass.
at::Tensor patches(const at::Tensor& x, at::IntArrayRef k, at::IntArrayRef stride, at::IntArrayRef padding,
                   at::IntArrayRef dilation) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("bpclip_fast::conv_patches", "")
                       .typed<at::Tensor(const at::Tensor&, at::IntArrayRef, at::IntArrayRef, at::IntArrayRef,
                                         at::IntArrayRef)>();
  return op.call(x, k, stride, padding, dilation);
}

Norms conv2d_grad_norms(const at::Tensor& grad_out, const at::Tensor& x, at::IntArrayRef kernel_size,
                        at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                        std::array<bool, 2> params, c10::string_view method_name, int64_t workspace, bool keep,
                        const c10::optional<at::Tensor>& nonfinite, int64_t keep_extra) {
  check_norm_inputs(grad_out, x, workspace, "conv2d_grad_norms");
  TORCH_CHECK(x.dim() == 4 && grad_out.dim() == 4, "bpclip_fast.conv2d_grad_norms: input and grad_out must be "
              "[B, C, H, W]");
  TORCH_CHECK(groups >= 1 && x.size(1) % groups == 0 && grad_out.size(1) % groups == 0,
              "bpclip_fast.conv2d_grad_norms: groups must divide the input and output channels");
  const int64_t B = x.size(0), G = groups;
  const int64_t d = x.size(1) / G * kernel_size[0] * kernel_size[1], p = grad_out.size(1) / G;
  const int64_t T = grad_out.size(2) * grad_out.size(3);
  const at::ScalarType acc = acc_type_of(x);
  const Dims dims{T, d, p, params[0], params[1], gemm_unit(acc), underflow_unit(acc), release_input_unit(x, acc, true)};
  const Method method = parse_method(method_name, ghost_cheaper(T, d, p));
  const int64_t elt = at::elementSize(acc);
  const int64_t temps = method == Method::kGhost ? 5 * T * T : 3 * d * p;  // with the double copies
  // Per example: the patches (G d T) and the upstream gradient in the accumulation dtype (G p T: a
  // copy for fp16/bf16 or a layout reshape cannot view), and the GEMMs' temporaries. The kernel's
  // position sums take no workspace of their own (per thread, 2 T doubles on the CPU).
  const int64_t rows = chunk_rows(elt * G * (T * (d + p) + temps), workspace, B);
  const bool kept = keep_instantiated(keep, method, dims, G, grad_out, acc, keep_extra);
  NormsOut out = start_norms(x, B, method, dims, G, kept);
  out.nonfinite = nonfinite;
  for (int64_t b0 = 0; b0 < B; b0 += rows) {
    const int64_t n = std::min(rows, B - b0);
    const at::Tensor u = patches(x.narrow(0, b0, n), kernel_size, stride, padding, dilation);
    TORCH_CHECK(u.size(2) == T, "bpclip_fast.conv2d_grad_norms: grad_out's H x W does not match the convolution "
                "of the input");
    const at::Tensor x3 = u.reshape({n * G, d, T}).transpose(1, 2);
    const at::Tensor gt = in_acc(n == B ? grad_out : grad_out.narrow(0, b0, n), acc).reshape({n * G, p, T});
    rows_norms(out, b0, x3, gt.transpose(1, 2), G, kept);
  }
  return finish(out, x);
}

}  // namespace

TORCH_LIBRARY_IMPL(bpclip_fast, CompositeExplicitAutograd, m) {
  m.impl("linear_grad_norms", &linear_grad_norms);
  m.impl("conv2d_grad_norms", &conv2d_grad_norms);
}

}  // namespace bpclip
