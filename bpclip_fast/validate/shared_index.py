"""``make_private``'s probes of an Embedding whose index has one row shared by the batch, looked up
once per example in private training (:mod:`bpclip_fast.broadcast`). Part of
:func:`bpclip_fast.validate.dynamic_problems`, whose passes (``run``) and records they read.

1. *equivalence*: the model's output on the probe batch is the same with the index expanded as
   without (eval mode, so that dropout masks drawn for a ``[1, T, D]`` and a ``[B, T, D]`` tensor
   cannot differ): code after the lookup that relies on its leading 1 (``.sum(0)``, ``torch.cat``
   along dimension 0) would compute another function, so the expansion is refused there, with the
   advice to pass the index per example.
2. *own rows*: changing row ``i`` of the expanded output (the first, then the last) changes no
   other example's later layer input or model output. Then row ``i``'s gradient, a sum over the
   outputs it reaches, is example ``i``'s alone. Catches ``e[0]``, ``e.mean(0)``, ``e.flip(0)``,
   which keep the output but move an example's gradient into another's row. Runs with integer
   inputs too (a token-only model, where probe 2 has nothing to perturb).
3. *not from the data*: the shared row is the same when every integer input (token ids, masks) is
   reversed along its last dimension. A row taken from one example's tokens (``ids[:1]``) looked up
   for every example would put that example's data into every example's gradient (probe 2 of
   :mod:`bpclip_fast.validate` catches it only where a perturbed example is the one taken).

Their limits are the other probes': only what this probe batch exercises.
"""

from __future__ import annotations

import torch
from torch import nn

from .probe_input import _SEED, _map_tensors, _random_like
from .probes import _BROADCAST_HINT, _ROW_TOLERANCE, _rows_differ


def _hint() -> str:
    return _BROADCAST_HINT.lstrip("; ")


def _outputs_differ(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Whether two passes' outputs differ beyond the rounding of a different summation order
    (validate's ``_ROW_TOLERANCE``); a value that is not finite in one pass only differs."""
    if len(a) != len(b):
        return True
    for x, y in zip(a, b):
        if x.shape != y.shape or x.dtype != y.dtype:
            return True
        if x.numel() == 0:
            continue
        finite = torch.cat([x[x.isfinite()].abs().flatten(), y[y.isfinite()].abs().flatten(), x.new_zeros(1)])
        tolerance = float(_ROW_TOLERANCE * torch.finfo(x.dtype).eps * finite.max())
        if not bool(torch.isclose(x, y, rtol=0.0, atol=tolerance, equal_nan=True).all()):
            return True
    return False


def equivalence_problems(model: nn.Module, probe_input, batch: int, run, labels: dict[str, str],
                         shared: set[str]) -> tuple[list[str], set[str]]:
    """Probe 1 above: ``(problems, layers refused)``; nothing where no layer of ``shared`` (the fused
    Embeddings) has an index of one row in this batch."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        plain = run(probe_input, batch, backward=False, expand=False)
        names = list(dict.fromkeys(c.name for c in plain.calls if c.name in shared and c.input is not None
                                   and c.input.dim() > 0 and c.input.shape[0] == 1))
        if batch <= 1 or not names:
            return [], set()
        try:
            expanded = run(probe_input, batch, backward=False, expand=True)
            why = None if not _outputs_differ(plain.outputs, expanded.outputs) else "changed the model's output"
        except Exception as exc:  # noqa: BLE001 - the model's code cannot take the [B, ...] lookup
            why = f"made the model fail ({exc!r})"
        derived = _derived_from_input(probe_input, plain, batch, run, set(names)) if why is None else []
    finally:
        for m, training in modes:
            m.training = training
    if derived:
        return [f"{labels[n]}: its index has one row shared by the {batch} examples of the probe batch, and that row "
                "changed when the examples' integer inputs changed (rule: example rows): it is taken from the data "
                "(one example's tokens, ids[:1]), so looked up for every example it would put that example's data "
                f"into every example's gradient; look up each example's own indices ([B, ...]) instead"
                for n in derived], set(derived)
    if why is None:
        return [], set()
    which = ", ".join(labels[n] for n in names)
    return [f"{which}: its index has one row shared by the {batch} examples of the probe batch, which private training "
            f"looks up once per example (a [B, ...] output instead of [1, ...], so that each example's gradient is "
            f"its own), and that {why} (rule: example rows); the code after the lookup relies on its leading "
            f"dimension of 1 (.sum(0), .squeeze(0) before a reshape, torch.cat along dimension 0); {_hint()}"], set(names)


def _derived_from_input(probe_input, plain, batch: int, run, names: set[str]) -> list[str]:
    """The layers of ``names`` whose one-row index changes when every integer input of two or more
    dimensions (token ids, masks) is reversed along its last dimension: the row comes from the data.
    Probe 2 perturbs floating-point inputs only (a row from ``x[:1]`` is caught there, its expanded
    rows changing with example 0); an integer row such as ``ids[:1]`` is caught here. No verdict where
    nothing integer changes or the model fails on the reversed input."""
    changed = [False]

    def flip(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() or t.dim() < 2 or t.shape[-1] < 2:
            return t
        f = t.flip(-1)
        changed[0] |= not torch.equal(f, t)
        return f

    flipped = _map_tensors(probe_input, flip)
    if not changed[0]:
        return []
    try:
        other = run(flipped, batch, backward=False, expand=False)
    except Exception:  # noqa: BLE001 - a model that cannot take the reversed input: no verdict
        return []
    before = {c.name: c.input for c in plain.calls if c.name in names}
    after = {c.name: c.input for c in other.calls if c.name in names}
    return [n for n in before if n in after and (before[n].shape != after[n].shape or not torch.equal(before[n], after[n]))]


def row_problems(model: nn.Module, probe_input, reference, batch: int, run, labels: dict[str, str]) -> list[str]:
    """Probe 2 above, for every layer the reference pass expanded."""
    modules = dict(model.named_modules())
    problems = []
    for name in dict.fromkeys(reference.expanded):
        found = None
        for row in sorted({0, batch - 1}):
            generator = torch.Generator().manual_seed(_SEED + 7 + row)

            def perturb(mod, args, out, _row=row, _generator=generator):
                out = out.clone()
                scale = 1.0 + float(out.detach().abs().max()) if out.numel() else 1.0
                out[_row] = out[_row] + scale * _random_like(out.shape[1:], out, _generator)
                return out

            handle = modules[name].register_forward_hook(perturb)
            try:
                changed = run(probe_input, batch, backward=False)
            finally:
                handle.remove()
            found = found or _reached(reference, changed, row, batch, labels)
        if found:
            problems.append(
                f"{labels[name]}: row i of its output, the index row shared by the batch looked up for example i in "
                f"private training, reaches another example's {found} (rule: batch independence); its gradient would "
                "then hold other examples' contributions, clipped as example i's; use the lookup only where it is "
                f"broadcast over the examples (added to each example's rows), or {_hint()}")
    return problems


def _reached(reference, changed, row: int, batch: int, labels: dict[str, str]) -> str | None:
    """What of another example than ``row`` differs between the two passes (None: nothing)."""
    for a, b in zip(reference.calls, changed.calls):
        if a.name != b.name:
            return f"control flow (which layers run, from {labels[a.name]} on)"
        if _rows_differ(a.input, b.input, row, batch):
            return f"input of {labels[a.name]}"
    if len(reference.outputs) != len(changed.outputs) or any(
            _rows_differ(a, b, row, batch) for a, b in zip(reference.outputs, changed.outputs)):
        return "model output"
    return None
