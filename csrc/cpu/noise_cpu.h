// The CPU Philox stream as normals, for ops that use the draw without storing it first (banded_row_).
#pragma once

#include <stdint.h>

namespace bpclip {

// z[8 (g - first_group) + q] = normal q of group g, for groups first_group .. first_group + groups - 1:
// element 8g + q of philox_noise_(buf, seed, offset, 1.0), bit for bit (the same batches as its kernel).
// The double overload gives a float64 buffer's normals (philox.h), element 8g + q of philox_noise_ on
// a float64 buffer.
void philox_normals(uint64_t seed, uint64_t offset, uint64_t first_group, int64_t groups, float* z);
void philox_normals(uint64_t seed, uint64_t offset, uint64_t first_group, int64_t groups, double* z);

}  // namespace bpclip
