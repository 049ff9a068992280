// How a row reduction is split up, shared by the CPU and CUDA backends and the test emulator.
// A row (one example) of N elements is reduced as G groups of S elements, each split into K chunks
// of at most `chunk` elements: partial[(b*G + g)*K + k]. For l2 the groups are one row (q(a) = a);
// for l15 the groups are channels (q(a) = a^2) and the per-group sums are L1 norms.
#pragma once

#include <stdint.h>

namespace bpclip {

struct RowGeometry {
  int64_t B, N, G, S, K, chunk;
};

inline RowGeometry make_row_geometry(int64_t B, int64_t N, int64_t G, int64_t S, int64_t chunk) {
  RowGeometry r{};
  r.B = B;
  r.N = N;
  r.G = G;
  r.S = S;
  r.chunk = chunk;
  r.K = S == 0 ? 0 : (S + chunk - 1) / chunk;
  return r;
}

}  // namespace bpclip
