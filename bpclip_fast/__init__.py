"""bpclip_fast: differentially private training by backpropagation clipping, with fused kernels."""

from __future__ import annotations

import torch

from . import _ops
from ._ops import cpu_cache  # noqa: F401

__version__ = "0.1.0"


def build_info() -> dict:
    """How the extension was built and what this process can use."""
    info = {"torch_version": torch.__version__, "torch_cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(), "extension_loaded": _ops.extension_loaded()}
    if _ops.extension_loaded():
        info.update(_ops.build_config())
    else:
        info.update({"cuda_compiled": False, "cuda_archs": []})
    return info


from . import autograd, modules, nn, reference  # noqa: E402,F401
from .adaptive import Adaptive  # noqa: E402,F401
from .boundary import StepRefused  # noqa: E402,F401
from .engine import DPOptimizer, Float64NoiseWarning, InsecureSeedWarning, PrivacyEngine  # noqa: E402,F401
from .validate import fix_model  # noqa: E402,F401
