"""The clipped layer types, one file per type: its module, its sensitivity bound and proof (or the
per-example representation whose docstring proves it), its converter and its registration in
:mod:`bpclip_fast.registry`. Importing this package registers every type (``bpclip_fast.nn``
imports it, and ``import bpclip_fast`` imports ``bpclip_fast.nn``). A new layer type is one new
file here, imported below (a type of an optional library: registry._OPTIONAL, imported once that
library is; Hugging Face's Conv1D in hf_conv1d.py).

The import order is the registration order, which is the order in which the registry's messages
list the types: keep it.
"""

from . import (base, norms, embedding, tokens, linear, conv2d, conv1d, attention, embedding_bag,  # noqa: F401
               recurrent, conv3d)  # (registration order)
from .base import CLIP_FNS, SUPPORTED_DTYPES
from .attention import MultiheadAttention
from .conv1d import Conv1d
from .conv2d import CONV_NORMS, Conv2d
from .conv3d import Conv3d
from .embedding import Embedding
from .embedding_bag import EmbeddingBag
from .linear import Linear
from .recurrent import GRU, LSTM, RNN
from .norms import GroupNorm, InstanceNorm1d, InstanceNorm2d, InstanceNorm3d, LayerNorm, RMSNorm
from .tokens import ClassToken, PositionalEmbedding

__all__ = ["CLIP_FNS", "CONV_NORMS", "SUPPORTED_DTYPES", "ClassToken", "Conv1d", "Conv2d", "Conv3d", "Embedding",
           "EmbeddingBag",
           "GroupNorm", "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "LayerNorm", "Linear",
           "MultiheadAttention", "PositionalEmbedding", "LSTM", "GRU", "RNN",
           "RMSNorm"]
