// CPU kernel of exact_bound_: each example's sq and norm bound (csrc/exact.cpp), by the arithmetic
// of bpclip_fast/bound.h with the lanes of the CUDA warp run as a loop, so both give the same bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <math.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "../bound_args.h"
#include "bpclip_fast/bound.h"

namespace bpclip {
namespace {

// Positions per tile of row_sums' patch loop: its S * kRowTile partial sums stay in L1/L2 whatever T
// is (a 224 x 224 image's T = 50176 at S = 256 would be 100 MB untiled).
constexpr int64_t kRowTile = 64;

// One row's position sums of squares, as position_sq takes them (S interleaved parts, each
// sequential over its entries, then the parts' tree: the same bits), with the loop order that reads
// the row in its own layout: a Conv2d's patches are [n, T] per row (positions the inner loop, in
// tiles of kRowTile; a lane's strided walk over them re-read each cache line up to 16 times), a
// Linear's rows [T, n] (entries the inner loop). parts: S * kRowTile doubles of scratch.
template <typename T>
void row_sums(const T* v, int64_t T_, int64_t n, int64_t s1, int64_t s2, int S, double* out, double* parts) {
  const int64_t mask = S - 1;  // S is a power of two: part q of entry j is j & mask
  for (int64_t t0 = 0; t0 < T_; t0 += kRowTile) {
    const int64_t w = T_ - t0 < kRowTile ? T_ - t0 : kRowTile;
    for (int64_t k = 0; k < S * w; ++k) parts[k] = 0.0;
    if (s1 == 1 && s2 != 1) {
      for (int64_t j = 0; j < n; ++j) {
        const T* vj = v + j * s2 + t0;
        double* aj = parts + (j & mask) * w;
        for (int64_t t = 0; t < w; ++t) {
          const double e = static_cast<double>(vj[t]);
          aj[t] += e * e;
        }
      }
    } else {
      for (int64_t t = 0; t < w; ++t) {
        const T* vt = v + (t0 + t) * s1;
        for (int64_t j = 0; j < n; ++j) {
          const double e = static_cast<double>(vt[j * s2]);
          parts[(j & mask) * w + t] += e * e;
        }
      }
    }
    for (int off = S / 2; off > 0; off >>= 1)
      for (int q = 0; q < off; ++q)
        for (int64_t t = 0; t < w; ++t) parts[q * w + t] += parts[(q + off) * w + t];
    for (int64_t t = 0; t < w; ++t) out[t0 + t] = parts[t];
  }
}

// The position sums of one row, precomputed (row_sums).
struct RowPositions {
  const double* xs;
  const double* gs;
  double x_sq(int64_t, int64_t t) const { return xs[t]; }
  double g_sq(int64_t, int64_t t) const { return gs[t]; }
};

// Every lane's weight terms of row r (lane_weight_terms), in one contiguous pass: lane l's W is
// the same sequence of additions, 0 + the products e = l, l + kBoundLanes, ... in that order (at
// T > 1 the positions leave W at 0), but the row is read once in order rather than once per lane.
template <typename T>
void weight_terms(LaneSums* lanes, int active, const T* wa, const T* wb, const BoundGeometry& s, int64_t r) {
  if (!(s.flags & kBoundWeight) || s.L == 0) return;
  const T* ar = wa + r * s.L;
  const T* br = wb + r * s.L;
  double acc[kBoundLanes];  // lanes from `active` (>= L, or all of them once L >= kBoundLanes) get no term
  for (int l = 0; l < active; ++l) acc[l] = lanes[l].W;
  int64_t e = 0;
  for (; e + kBoundLanes <= s.L; e += kBoundLanes)
    for (int l = 0; l < kBoundLanes; ++l) acc[l] += static_cast<double>(ar[e + l]) * static_cast<double>(br[e + l]);
  for (int l = 0; e + l < s.L; ++l) acc[l] += static_cast<double>(ar[e + l]) * static_cast<double>(br[e + l]);
  for (int l = 0; l < active; ++l) lanes[l].W = acc[l];
}

template <typename T>
int64_t bound_rows(const T* x, const T* g, const T* gb, const T* wa, const T* wb, const BoundGeometry& s, const double* c,
                   double* sq, double* bound) {
  std::atomic<int64_t> bad{0};
  at::parallel_for(0, s.examples, 1, [&](int64_t begin, int64_t end) {
    int64_t local = 0;
    LaneSums lanes[kBoundLanes];
    const int active = active_lanes(s);  // the lanes past it stay zero: combine_lanes skips them
    std::vector<double> xs(static_cast<size_t>(s.T)), gs(static_cast<size_t>(s.T));
    const int split_x = position_split(s.dx), split_g = position_split(s.dg);
    std::vector<double> parts(static_cast<size_t>(std::max(split_x, split_g) * kRowTile));
    const RowPositions pos{xs.data(), gs.data()};
    for (int64_t i = begin; i < end; ++i) {
      ExampleSums e{0, 0, 0, 0, 0};
      for (int64_t k = 0; k < s.per; ++k) {
        const int64_t r = i * s.per + k;
        row_sums(x + r * s.sx0, s.T, s.dx, s.sx1, s.sx2, split_x, xs.data(), parts.data());
        row_sums(g + r * s.sg0, s.T, s.dg, s.sg1, s.sg2, split_g, gs.data(), parts.data());
        for (int l = 0; l < active; ++l) {
          lanes[l] = LaneSums{0, 0, 0, 0, 0, 0, 0};
          lane_positions(lanes[l], pos, s, c, r, l);
          lane_bias(lanes[l], gb, s, r, l);
        }
        weight_terms(lanes, active, wa, wb, s, r);
        add_row(e, combine_lanes(lanes, active), s, c);
      }
      sq[i] = e.sq;
      bound[i] = example_bound(e, c);
      local += finite_bound(bound[i]) ? 0 : 1;
    }
    bad += local;
  });
  return bad.load();
}

void exact_bound_cpu(at::Tensor& sq, at::Tensor& bound, const at::Tensor& x, const at::Tensor& g, const at::Tensor& gb, const at::Tensor& wa,
                     const at::Tensor& wb, int64_t offset, int64_t per, int64_t flags, at::ArrayRef<double> consts,
                     const c10::optional<at::Tensor>& nonfinite) {
  const BoundGeometry s = check_bound_args(sq, bound, x, g, gb, wa, wb, offset, per, flags, consts, nonfinite);
  if (s.examples == 0) return;
  int64_t bad = 0;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "exact_bound_cpu", [&] {
    const scalar_t* wap = s.L ? wa.const_data_ptr<scalar_t>() : nullptr;
    const scalar_t* wbp = s.L ? wb.const_data_ptr<scalar_t>() : nullptr;
    bad = bound_rows<scalar_t>(x.const_data_ptr<scalar_t>(), g.const_data_ptr<scalar_t>(),
                               (flags & kBoundBias) ? gb.const_data_ptr<scalar_t>() : nullptr, wap, wbp, s,
                               consts.data(), sq.mutable_data_ptr<double>() + offset,
                               bound.mutable_data_ptr<double>() + offset);
  });
  // Written in place (not add_): the op then launches no ATen kernel of its own.
  if (bad && nonfinite.has_value() && nonfinite->defined()) nonfinite->mutable_data_ptr<int64_t>()[0] += bad;
}

std::tuple<at::Tensor, at::Tensor> exact_factors_cpu(at::TensorList bounds, at::Tensor& nonfinite, double max_norm,
                                                     c10::string_view clip_fn, double gamma, bool fp64) {
  const FactorsArgs a = check_factors_args(bounds, nonfinite, max_norm, clip_fn, gamma);
  const at::TensorOptions opts = bounds[0].options();
  at::Tensor factor = at::empty({a.B}, opts.dtype(fp64 ? at::kDouble : at::kFloat));
  at::Tensor total = at::empty({a.B}, opts);
  std::vector<const double*> ptrs;
  for (const at::Tensor& b : bounds) ptrs.push_back(b.const_data_ptr<double>());
  double* tp = total.mutable_data_ptr<double>();
  int64_t bad = 0;
  std::vector<double> row(static_cast<size_t>(a.L));
  for (int64_t i = 0; i < a.B; ++i) {
    for (int64_t l = 0; l < a.L; ++l) row[l] = ptrs[l][i];
    tp[i] = layers_total(row.data(), a.L, 1, a.inflate);
    bool odd = false;
    const double f = example_factor(tp[i], fp64, a.bound_eff, a.fn, gamma, &odd);
    if (fp64) {
      factor.mutable_data_ptr<double>()[i] = f;
    } else {
      factor.mutable_data_ptr<float>()[i] = static_cast<float>(f);  // already an fp32 value
    }
    bad += odd ? 1 : 0;
  }
  if (bad) nonfinite.mutable_data_ptr<int64_t>()[0] += bad;
  return {factor, total};
}

}  // namespace

TORCH_LIBRARY_IMPL(bpclip_fast, CPU, m) {
  m.impl("exact_bound_", &exact_bound_cpu);
  m.impl("exact_factors", &exact_factors_cpu);
}

}  // namespace bpclip
