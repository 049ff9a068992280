// Storage behind the self-test kernels' `extern __shared__` array (see SIMT_DYNAMIC_SHARED).
#include "simt.h"

SIMT_DYNAMIC_SHARED(selftest, dyn)
