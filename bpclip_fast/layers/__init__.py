"""The clipped layer types, one file per type: its module, its sensitivity bound and proof (or the
per-example representation whose docstring proves it), its converter and its registration in
:mod:`bpclip_fast.registry`. Importing this package registers every type (``bpclip_fast.nn``
imports it, and ``import bpclip_fast`` imports ``bpclip_fast.nn``). A new layer type is one new
file here, imported below.

The import order is the registration order, which is the order in which the registry's messages
list the types: keep it.
"""

from . import base, norms, embedding, tokens, linear, conv2d, recurrent  # noqa: F401  (registration order)
from .base import CLIP_FNS, SUPPORTED_DTYPES
from .conv2d import CONV_NORMS, Conv2d
from .embedding import Embedding
from .linear import Linear
from .recurrent import GRU, LSTM, RNN
from .norms import GroupNorm, InstanceNorm1d, InstanceNorm2d, InstanceNorm3d, LayerNorm, RMSNorm
from .tokens import ClassToken, PositionalEmbedding

__all__ = ["CLIP_FNS", "CONV_NORMS", "SUPPORTED_DTYPES", "ClassToken", "Conv2d", "Embedding", "GRU", "GroupNorm", "LSTM", "RNN",
           "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "LayerNorm", "Linear", "PositionalEmbedding",
           "RMSNorm"]
