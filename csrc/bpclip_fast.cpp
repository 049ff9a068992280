// The one place where the operator schemas of bpclip_fast live. Backends register their kernels
// in cpu/ and cuda/, the layer ops (one kernel for every backend) in layers.cpp; fake (meta)
// kernels are registered in bpclip_fast/_ops.py.
#include <Python.h>
#include <torch/library.h>

#include <string>

#include "host_cache.h"

#define BPCLIP_STR_(...) #__VA_ARGS__
#define BPCLIP_STR(...) BPCLIP_STR_(__VA_ARGS__)

namespace {

std::string build_config() {
#ifdef BPCLIP_WITH_CUDA
  std::string cfg = "cuda=1;archs=";
#ifdef BPCLIP_CUDA_ARCHS
  cfg += BPCLIP_STR(BPCLIP_CUDA_ARCHS);
#endif
  return cfg;
#else
  return "cuda=0;archs=";
#endif
}

}  // namespace

TORCH_LIBRARY(bpclip_fast, m) {
  // Per-example clipping: norm ('l2' over all non-batch dims, or 'l15' over [B,C,H,W]), factor
  // ('clip' | 'global' | 'normalize') and scaling, computed in double and clipped against
  // bound * (1 - eta_N) so that the stored values obey the bound after rounding (proof:
  // csrc/include/bpclip_fast/clip.h). Returns (clipped, factor, norm); factor and norm are fp32
  // (fp64 for fp64 data). Non-finite examples get factor 0 and increment `nonfinite`.
  m.def(
      "clip_rows(Tensor x, Tensor(a!) nonfinite, float bound, str norm, str clip_fn, float gamma)"
      " -> (Tensor, Tensor, Tensor)");
  // The scaling step of clip_rows alone: x~ = RZ(factor[b] * x[b]) per example (rounded toward zero
  // to x's dtype; zeros where factor[b] == 0), bit for bit what clip_rows wrote for that factor.
  // The layer backward rebuilds the clipped input from the saved x and factor with it.
  m.def("scale_rows(Tensor x, Tensor factor) -> Tensor");
  // Two row scalings in one launch: (scale_rows(x, x_factor), scale_rows(y, y_factor)), or with mask_y
  // the second as scale_rows(y, sign(y_factor)) (y's rows kept where the factor is positive, zeros
  // elsewhere): the exact modes' scaled upstream gradient and masked input. x and y share the batch.
  m.def("scale_rows2(Tensor x, Tensor x_factor, Tensor y, Tensor y_factor, bool mask_y) -> (Tensor, Tensor)");
  // clip_rows(g, ...) and scale_rows(x, x_factor) in one op, the second in the same elementwise launch
  // as clip_rows' own scaling: the layer backward's clipped upstream gradient and rebuilt clipped
  // input. Returns (clipped g, factor, norm, x rescaled).
  m.def(
      "clip_rows_rescale(Tensor g, Tensor(a!) nonfinite, float bound, str norm, str clip_fn, float gamma,"
      " Tensor x, Tensor x_factor) -> (Tensor, Tensor, Tensor, Tensor)");
  // Exact vector-Jacobian product of x -> x * s(x) (L2 input clipping), from the saved forward.
  m.def(
      "clip_rows_backward(Tensor grad, Tensor clipped, Tensor factor, Tensor norm, float bound, str clip_fn)"
      " -> Tensor");
  // buf = std * z (accumulate=False) or buf += std * z, z from Philox4x32-10 keyed by (seed, offset);
  // then buf *= scale where scale != 1, in the same pass (the values as a later buf.mul_(scale) gives).
  m.def("philox_noise_(Tensor(a!) buf, int seed, int offset, float std, bool accumulate, float scale=1.0) -> ()");
  // A layer's two noise draws in one launch: w as philox_noise_ at offset, b at offset + 1 (the same
  // bits as the two calls). w and b share a device and a dtype.
  m.def(
      "philox_noise2_(Tensor(a!) w, Tensor(b!) b, int seed, int offset, float std, bool accumulate_w,"
      " bool accumulate_b, float scale=1.0) -> ()");
  // The tail of a backpropagation-clipping layer's backward, one launch (bpclip_fast/tail.h):
  // w += std z (z: philox_noise_'s stream at offset), b += std z' (offset + 1), each then times scale
  // where it is not 1, as philox_noise2_(w, b, accumulate) gives; std 0 draws nothing and only
  // scales. With bias_rows [rows, b.numel()], b is first set to its column sums (tail.h's order).
  // With grad, returns clip_rows_backward(grad, clipped, factor, norm, input_bound, clip_fn), else
  // an empty tensor. w, b: contiguous, float32 or float64.
  m.def(
      "layer_tail_(Tensor(a!) w, Tensor(b!) b, Tensor? bias_rows, Tensor? grad, Tensor? clipped, Tensor? factor,"
      " Tensor? norm, float input_bound, str clip_fn, int seed, int offset, float std, float scale=1.0) -> Tensor");
  // One row of the banded mechanism's correlated noise (bpclip_fast/banded.py) in one pass: with
  // z = philox_noise_'s stream at (seed, offset) over the P elements of a ring row,
  //   w_i = std z_i + sum_{a = 1..bands-1} weights[a-1] ring[(newest - a + 1) mod (bands-1), i],
  // stored into the ring's oldest slot (newest + 1) mod (bands-1) and added to outs[k] where
  // starts[k] <= i < starts[k] + outs[k].numel(). ring [bands-1, P] float32/float64, contiguous; outs
  // contiguous, the ring's dtype and device, disjoint from it and from each other; at most 63 slots
  // and 4 outs (bpclip_fast/band.h).
  m.def(
      "banded_row_(Tensor(a!) ring, Tensor(b!)[] outs, int[] starts, int newest, float[] weights, int seed,"
      " int offset, float std) -> ()");
  // Layer forward: clip the input per example (L2), then ATen's linear / convolution.
  // Returns (out, x_factor, x_norm): the clipped input itself stays inside, the backward rebuilds it
  // from x and x_factor (csrc/layers.cpp, reclip).
  m.def(
      "linear_forward(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) nonfinite, float input_bound,"
      " str clip_fn, float gamma) -> (Tensor, Tensor, Tensor)");
  m.def(
      "conv2d_forward(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) nonfinite, int[2] stride,"
      " int[2] padding, int[2] dilation, int groups, float input_bound, str clip_fn, float gamma)"
      " -> (Tensor, Tensor, Tensor)");
  // Layer backward, from the forward's input x and its (x_factor, x_norm): rebuild the clipped
  // input, clip the upstream gradient per example, weight/bias gradients through ATen with the
  // noise added, and the input gradient through the clipped gradient and the clipping Jacobian.
  // The scalars come in groups, shared by both layers: bounds = [input_bound, grad_bound],
  // clip_fn and gamma (of the gradient clipping), output_mask = [grad_x, grad_bias] (what to
  // compute; grad_weight always is), and the noise draw noise_key = [seed, offset] with std
  // noise_std (stream offset for the weight, offset+1 for the bias). Conv2d adds its geometry and
  // the upstream gradient's norm ('l15' or 'l2') in front. scale: the weight and bias gradients,
  // noised, times scale (the engine's mean-loss d/B; in the noise's launch, in the accumulation dtype,
  // before the one rounding to the parameters' dtype).
  // Returns (grad_x, grad_weight, grad_bias); grad_x / grad_bias are empty when not requested.
  m.def(
      "linear_backward(Tensor grad_out, Tensor x, Tensor x_factor, Tensor x_norm, Tensor weight,"
      " Tensor(a!) nonfinite, float[2] bounds, str clip_fn, float gamma, bool[2] output_mask, int[2] noise_key,"
      " float noise_std, float scale=1.0) -> (Tensor, Tensor, Tensor)");
  m.def(
      "conv2d_backward(Tensor grad_out, Tensor x, Tensor x_factor, Tensor x_norm, Tensor weight,"
      " Tensor(a!) nonfinite, int[2] stride, int[2] padding, int[2] dilation, int groups, str grad_norm,"
      " float[2] bounds, str clip_fn, float gamma, bool[2] output_mask, int[2] noise_key, float noise_std,"
      " float scale=1.0) -> (Tensor, Tensor, Tensor)");
  // Exact per-example clipping (modes flat and per_layer; csrc/exact.cpp). The norms ops return
  // (sq, bound), float64 [B]: each example's squared gradient norm over the parameters in
  // params = [weight, bias], and an upper bound on the norm of what the release can hold of it at
  // factor 1 (rounding included); method 'auto' (the cost rule), 'ghost' or 'instantiate'; at most
  // about `workspace` bytes of temporaries (the batch is chunked). With keep, and where the
  // instantiated per-example gradients are no larger than grad_out or take at most keep_extra bytes
  // with the bias sums, they are returned too ([B, weight numel] and the bias sums [B, out], fp32;
  // fp64 for fp64 data), for the clipped_grads ops; otherwise those two are empty. nonfinite (when given, int64 [1]) += the examples whose bound is
  // not finite (flat clipping's per-layer count: its factors come later, from all layers' bounds).
  m.def(
      "linear_grad_norms(Tensor grad_out, Tensor x, bool[2] params, str method, int workspace, bool keep,"
      " Tensor(a!)? nonfinite=None, int keep_extra=0) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "conv2d_grad_norms(Tensor grad_out, Tensor x, int[2] kernel_size, int[2] stride, int[2] padding,"
      " int[2] dilation, int groups, bool[2] params, str method, int workspace, bool keep,"
      " Tensor(a!)? nonfinite=None, int keep_extra=0) -> (Tensor, Tensor, Tensor, Tensor)");
  // The zero-padded patches of a Conv2d's input, [B, C kh kw, T] (im2col's layout) in the
  // accumulation dtype, read through the input's own strides (bpclip_fast/patches.h): the input the
  // exact norms' GEMMs and position norms read (csrc/exact.cpp).
  m.def("conv_patches(Tensor x, int[2] kernel_size, int[2] stride, int[2] padding, int[2] dilation) -> Tensor");
  // The per-example part of the norms ops (csrc/exact.cpp; arithmetic in bpclip_fast/bound.h): for
  // the rows [offset, offset + x.size(0) / per) of sq and bound (float64 [B]), each example's squared
  // gradient norm and its bound, from its `per` rows of positions x [rows, T, dx] and g [rows, T, dg]
  // (by strides; their squares are summed in the kernel, in double), the upstream gradient gb [rows, T, p]
  // for the bias, the weight's squared-norm terms wa * wb [rows, L] (ghost: the Gram matrices;
  // instantiation: the per-row gradient twice; empty at T = 1), flags (1 weight, 2 bias, 4 ghost,
  // 8 the bias summed: gb is [rows, 1, p], the bias gradient itself) and the formulas' constants;
  // nonfinite (when given) += the non-finite bounds.
  m.def(
      "exact_bound_(Tensor(a!) sq, Tensor(b!) bound, Tensor x, Tensor g, Tensor gb, Tensor wa, Tensor wb, int offset,"
      " int per, int flags, float[] consts, Tensor(c!)? nonfinite=None) -> ()");
  // The clip factors of the exact modes (bpclip_fast/exact.py, factors; bpclip_fast/bound.h): per
  // example the total bound (one layer's bound; over several, flat, an upper bound on the root of
  // the sum of their squares), rounded up to fp32 (kept for fp64), clip_rows' factor for max_norm as
  // a row of one element (bit for bit), 0 below 2^-60; nonfinite += the examples clip_rows counts.
  // Returns (factor fp32 / fp64 [B], total float64 [B]).
  m.def(
      "exact_factors(Tensor[] bounds, Tensor(a!) nonfinite, float max_norm, str clip_fn, float gamma, bool fp64)"
      " -> (Tensor, Tensor)");
  // The clipped gradients sum_i c_i G_i of the parameters in params = [weight, bias] (empty where
  // not), from grad_out scaled by factor (fp32; fp64 for fp64 data), with the noise (std noise_std,
  // Philox key noise_key = [seed, offset]: the weight at offset, the bias at offset + 1); from the
  // norms op's kept per-example gradients when given (grad_out and x are then not read; the release
  // is examples_release's sum_i RZ(c_i G_i)); then times scale (the engine's mean-loss d/B, after the
  // noise: as a later mul_(scale) of each), in the noise's launch.
  m.def(
      "linear_clipped_grads(Tensor grad_out, Tensor x, Tensor factor, Tensor weight, bool[2] params,"
      " int[2] noise_key, float noise_std, Tensor? kept_w=None, Tensor? kept_b=None, float scale=1.0)"
      " -> (Tensor, Tensor)");
  m.def(
      "conv2d_clipped_grads(Tensor grad_out, Tensor x, Tensor factor, Tensor weight, int[2] stride,"
      " int[2] padding, int[2] dilation, int groups, bool[2] params, int[2] noise_key, float noise_std,"
      " Tensor? kept_w=None, Tensor? kept_b=None, float scale=1.0) -> (Tensor, Tensor)");
  // Per-example gradients of the LayerNorm / GroupNorm affine weight and bias (issue 15), from the
  // forward's statistics as native_layer_norm / native_group_norm return them (the data dtype or
  // fp32 for half data; either is accepted). layer_norm: x viewed as [B, T, D] with D =
  // x.numel() / mean.numel(), gw[b, d] = sum_t g (x - mean[b, t]) rstd[b, t]; otherwise x is
  // [B, C, *] with `groups` groups of channels and stats [B, groups]. gb = the same sums of g.
  // Returns (gw, gb), [B, D] or [B, C], fp32 (fp64 for fp64 data), accumulated in that dtype.
  m.def(
      "norm_affine_example_grads(Tensor grad_out, Tensor x, Tensor mean, Tensor rstd, int batch, int groups,"
      " bool layer_norm) -> (Tensor, Tensor)");
  // Instantiated per-example gradients (bpclip_fast/exact.py, DenseExamples; the arithmetic and its
  // proofs: bpclip_fast/examples.h). weight, bias: [B, *] values of one dtype (either may be None).
  // examples_bound: float64 [B], an upper bound on each example's norm over both, rounding included;
  // nonfinite (when given) += the examples whose bound is not finite. examples_release: the sums
  // sum_b RZ(factor[b] * x[b]) (zeros for factor 0) of each, in a fixed order in fp32 (fp64), the
  // noise of philox_noise_ (key [seed, offset]: the weight at offset, the bias at offset + 1; none
  // for std 0), times scale, rounded once to the values' dtype; empty where not given.
  m.def("examples_bound(Tensor? weight, Tensor? bias, Tensor(a!)? nonfinite=None) -> Tensor");
  // examples_factors: examples_bound and exact_factors([bound], ...) in one kernel (a per_layer
  // layer's factors; bpclip_fast/exact.py, factors): the same bound, the same factor function
  // (bound.h, example_factor) and the same count (nonfinite += the examples clip_rows counts).
  // Returns (factor fp32 / fp64 [B], bound float64 [B]).
  m.def(
      "examples_factors(Tensor? weight, Tensor? bias, Tensor(a!) nonfinite, float max_norm, str clip_fn,"
      " float gamma, bool fp64) -> (Tensor, Tensor)");
  m.def(
      "examples_release(Tensor? weight, Tensor? bias, Tensor factor, int[2] noise_key, float noise_std,"
      " float scale) -> (Tensor, Tensor)");
  // The step boundary's bit checksum (bpclip_fast/boundary.py, _fingerprint; bpclip_fast/checksum.h):
  // over int64 words (a tensor's bytes, in logical order), the sum of w + (w >> 33) (arithmetic
  // shift) modulo 2^64, as an int64 scalar on the words' device. One pass; the same bits in any order.
  m.def("word_checksum(Tensor words) -> Tensor");
  // out[i] = a draw of the discrete Gaussian N_Z(0, sigma^2) for contiguous position i, from
  // Philox words keyed by (seed, offset, i) with integer arithmetic only
  // (bpclip_fast/discrete_gaussian.h); sigma an integer in [0, 2^52], 0 drawing zeros. out: int64.
  m.def("discrete_gaussian_(Tensor(a!) out, int seed, int offset, int sigma) -> ()");
  // The integer release of a buffer of clipped sums (bpclip_fast/integer_release.h): buf[i] =
  // ((k + Y) 2^grid_exp) scale, k the coupled rounding of buf[i] * multiplier on the grid 2^grid_exp,
  // Y the discrete Gaussian draw of element first + i at (seed, offset, sigma) (the words of element
  // first + i). buf: float32 or float64.
  m.def("integer_release_(Tensor(a!) buf, int seed, int offset, int first, float multiplier, int grid_exp, int sigma,"
        " float scale) -> ()");
  m.def("_build_config() -> str", &build_config);
  // The CPU storage cache of the ops' outputs and scratch (csrc/host_cache.h): limit >= 0 sets its
  // bytes (0 empties it), poison fills its idle storages with 0xFF. Returns [limit, held, idle, storages].
  m.def("_host_cache(int limit, bool poison) -> int[]", &bpclip::host_cache_op);
}

// Importing bpclip_fast._C loads this library, which runs the registrations above.
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
