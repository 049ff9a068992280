"""Checks a user can run on the guarantee of their own set-up (issue 16).

* :func:`sensitivity` (in :mod:`.contribution`) — each example's exact contribution to every clipped layer's release,
  measured through the real layers, against the bound the noise is scaled to; with an adversarial
  search for examples that push it up.
* :mod:`.empirical` — an ε lower bound from training runs of the real engine, layers, kernels,
  sampler and accountant with white-box gradient canaries: one-run (Steinke, Nasr, Jagielski 2023)
  and many-run (Clopper–Pearson) audits.
* :mod:`.stats` — the statistics both empirical audits end in: the one-run bound, Clopper–Pearson
  bounds, and each audit's power (the largest ε its sizes could certify at all).
* :mod:`.cli` — ``bpclip-audit``.
"""

# The module is not named after the function: `from bpclip_fast.audit import sensitivity` must give
# the function (README), and a submodule of the same name would be shadowed by it for
# `import bpclip_fast.audit.sensitivity as m` and monkeypatching.
from .contribution import SensitivityReport, sensitivity

__all__ = ["SensitivityReport", "sensitivity"]
