"""The probe batch: its size, its rows and the perturbation of one example.

Its values come from one fixed seed, never from the private example, so the probes' verdict depends
on the input's shapes and integer values only; the criterion's and the broadcast probes draw from the
same seed (through the package's names), so the seed has this one home.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


# One fixed seed for the probe values, the perturbations, the output projection and the random
# layers (dropout): the probes' outcome depends neither on the private data nor on the global RNG.
_SEED = 0x5EED


def _map_tensors(obj, fn):
    """``obj`` (a tensor, or tuples/lists/dicts of them, as a model call takes) with ``fn`` applied to every tensor."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        items = [_map_tensors(o, fn) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)  # namedtuples take fields
    if isinstance(obj, Mapping):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def _tensors(obj) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _map_tensors(obj, lambda t: found.append(t) or t)
    return found


def _random_like(shape, like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    # Drawn on the CPU from our own generator, so the values are the same on every device.
    return torch.randn(tuple(shape), generator=generator).to(dtype=like.dtype, device=like.device)


def _probe_input(example_input, batch: int):
    """``batch`` rows: the given rows repeated along the first dimension (:func:`_rows_of`)."""
    return _rows_of(example_input, torch.arange(batch), _SEED, "the example input")


def _rows_of(obj, rows: torch.Tensor, seed: int, what: str):
    """``obj``'s tensors at ``rows`` of their first dimension (taken modulo its length),
    floating-point values replaced by seeded normals (the outcome must not depend on the private
    values), integer tensors (indices, masks) kept as they are; ``what`` names ``obj`` in errors."""
    generator = torch.Generator().manual_seed(seed)

    def take(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            return t
        if t.shape[0] == 0:
            raise ValueError(f"{what} has a tensor of shape {tuple(t.shape)} without rows")
        t = t[rows.to(t.device) % t.shape[0]]
        return _random_like(t.shape, t, generator) if t.is_floating_point() else t

    return _map_tensors(obj, take)


def _perturbed(probe_input, row: int):
    """``probe_input`` with one example (``row``) changed: its floating-point values drawn afresh, its
    integer and boolean values (token ids, masks, lengths) replaced by the next example's, rolled by
    one along their last dimension: values of the input's own, so still valid indices and masks.
    Without the integer part a model using one example's tokens for all of them
    (``emb(ids[:1].expand(B, T))``) passed every probe; rolling the example's own row only kept the
    batch's multiset of tokens, so a model mixing examples through it
    (``emb(ids) / bincount(ids.flatten())[ids]``, a batch-wide frequency) passed."""
    generator = torch.Generator().manual_seed(_SEED + 1 + row)

    def change(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            return t
        t = t.clone()
        if t.is_floating_point():
            t[row] = _random_like(t.shape[1:], t, generator)
        elif t.dim() > 1:  # rolled too: a probe batch built from one row holds the same ids in every row
            t[row] = t[(row + 1) % t.shape[0]].roll(1, dims=-1)
        else:
            t[row] = t[(row + 1) % t.shape[0]]
        return t

    return _map_tensors(probe_input, change)


def _has_rows_to_perturb(probe_input) -> bool:
    return any(t.dim() > 0 and not torch.equal(t, _perturbed(t, 0)) for t in _tensors(probe_input))


def _smallest_batch(excluded: set[int]) -> int:
    batch = 3  # 1 and 2 rows hide too much: with 3, every example has two others to be compared with
    while batch in excluded:
        batch += 1
    return batch


def _probe_batch(example_input, run) -> int:
    """The probe's number of rows: >= 3, and unlike every other dimension of the input and, after a
    first pass, of every layer input, so that a layer whose first dimension is not the examples' (a
    [T, B, d] layout) cannot show B rows by coincidence."""
    excluded = {d for t in _tensors(example_input) for d in t.shape[1:]}
    candidate = _smallest_batch(excluded)
    first = run(_probe_input(example_input, candidate), candidate, backward=False, expand=False)
    excluded |= {d for c in first.calls if c.input is not None for d in c.input.shape}
    excluded |= {d for u in first.units for d in u.sizes}
    return _smallest_batch(excluded)
