"""Privacy accounting for backpropagation clipping (see docs/accounting.md).

* :class:`RDPAccountant`, :class:`PLDAccountant`: Poisson sampling, add/remove adjacency; each
  step is a Poisson-subsampled Gaussian with the step's effective noise multiplier; the privacy
  arithmetic is Google's ``dp_accounting``. ``bands=b > 1``: amplified BandMF with cyclic Poisson
  sampling (correlated noise), the worst of ``b`` cyclic positions (:mod:`.cyclic`).
* :class:`ZCDPAccountant`: disjoint batches of a data-independent shuffle (the paper's setting),
  replace-one (default) or add/remove adjacency; parallel composition within an epoch,
  sequential across epochs; three conversions to (ε, δ).

Every accountant is fed ``noise_multiplier = effective_noise_multiplier(per-layer σ's)``.
"""

from .base import Accountant, PrivacyBudgetError, effective_noise_multiplier
from .calibration import ACCOUNTANTS, MAX_SIGMA, default_accountant, get_noise_multiplier, make_accountant
from .poisson import OPACUS_RDP_ORDERS, PLDAccountant, RDPAccountant
from .zcdp import (ZCDP_CONVERSIONS, ZCDPAccountant, bun_steinke_epsilon, cks_epsilon,
                   gaussian_delta, gaussian_epsilon, zcdp_epsilon)

__all__ = [
    "Accountant", "ZCDPAccountant", "RDPAccountant", "PLDAccountant", "make_accountant",
    "get_noise_multiplier", "effective_noise_multiplier", "PrivacyBudgetError",
    "ACCOUNTANTS", "MAX_SIGMA", "default_accountant", "OPACUS_RDP_ORDERS", "ZCDP_CONVERSIONS",
    "bun_steinke_epsilon", "cks_epsilon", "gaussian_delta", "gaussian_epsilon", "zcdp_epsilon",
]
