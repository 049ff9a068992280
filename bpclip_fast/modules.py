"""Plain modules for parameters that a model uses additively: positional embeddings and class tokens.

A bare ``nn.Parameter`` added to activations is invisible to the registry of clipped layers (it
belongs to whatever module holds it), so it could only be frozen. Wrapped in one of these modules
it has a registered type: ``bpclip_fast.nn.convert_model(..., clipping="flat" | "per_layer")``
swaps each for its clipped form (``bpclip_fast.nn.PositionalEmbedding`` / ``ClassToken``), whose
per-example gradient is a slice of the upstream gradient. Like every layer of the registry, the
parameter is ``weight`` and ``bias`` is ``None``.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["PositionalEmbedding", "ClassToken"]


class PositionalEmbedding(nn.Module):
    """``x + weight`` with ``weight`` of the per-example shape of ``x`` (``x`` is ``[B, *shape]``).

    ``PositionalEmbedding(17, 64)`` adds one learned vector to each of 17 tokens of width 64.
    Initialised ``N(0, 0.02²)`` (as ViT).
    """

    def __init__(self, *shape: int, device=None, dtype=None):
        super().__init__()
        if not shape or any(int(s) < 1 for s in shape):
            raise ValueError(f"PositionalEmbedding: shape must be positive sizes, got {shape}")
        self.weight = nn.Parameter(torch.empty(tuple(int(s) for s in shape), device=device, dtype=dtype))
        self.register_parameter("bias", None)
        nn.init.normal_(self.weight, std=0.02)

    def _check_shape(self, x: torch.Tensor) -> None:
        if tuple(x.shape[1:]) != tuple(self.weight.shape):
            raise ValueError(f"{type(self).__name__}: the input must be [B, {', '.join(map(str, self.weight.shape))}] "
                             f"(batch, then the embedding's shape); got {tuple(x.shape)}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_shape(x)
        return x + self.weight

    def extra_repr(self) -> str:
        return f"shape={tuple(self.weight.shape)}"


class ClassToken(nn.Module):
    """Prepends ``tokens`` learned tokens to a sequence: ``[B, T, dim] -> [B, tokens + T, dim]``.

    Initialised ``N(0, 0.02²)``.
    """

    def __init__(self, dim: int, tokens: int = 1, device=None, dtype=None):
        super().__init__()
        if int(dim) < 1 or int(tokens) < 1:
            raise ValueError(f"ClassToken: dim and tokens must be positive, got dim={dim}, tokens={tokens}")
        self.weight = nn.Parameter(torch.empty(int(tokens), int(dim), device=device, dtype=dtype))
        self.register_parameter("bias", None)
        nn.init.normal_(self.weight, std=0.02)

    def _check_shape(self, x: torch.Tensor) -> None:
        if x.dim() != 3 or x.shape[2] != self.weight.shape[1]:
            raise ValueError(f"{type(self).__name__}: the input must be [B, T, {self.weight.shape[1]}]; "
                             f"got {tuple(x.shape)}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_shape(x)
        return torch.cat([self.weight.expand(x.shape[0], -1, -1), x], dim=1)

    def extra_repr(self) -> str:
        return f"dim={self.weight.shape[1]}, tokens={self.weight.shape[0]}"
