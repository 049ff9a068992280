"""The training methods ``bench.step`` compares: one registry entry per method.

A method is a builder ``build(model, x, y, seed, crit) -> (step, wrapped_model)``, where ``step`` is
one whole training step as a zero-argument callable, plus the modules it needs imported before the
child takes its memory baseline. Adding a method is one entry in ``REGISTRY``. No torch at import:
the launcher reads ``METHODS`` before it sets ``OMP_WAIT_POLICY``.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

# DP hyper-parameters: they change no cost, only the numbers. sigma = 1 so that noise is drawn.
INPUT_CLIP, GRAD_CLIP, SIGMA, LR = 1.0, 1.0, 1.0, 0.01


class Method(NamedTuple):
    build: Callable
    imports: tuple = ()  # modules beyond torch, bpclip_fast and bench.models


def _nonprivate(model, x, y, seed, crit):
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step():
        opt.zero_grad(set_to_none=True)
        crit(model(x), y).backward()
        opt.step()
    return step, model


def _refuse_unbounded(model, method: str) -> None:
    """Backpropagation clipping bounds Linear/Conv2d only; any other trained layer would go unclipped
    (the reference's hooks would skip it silently), so the combination is not measured."""
    from bpclip_fast import registry

    unclipped = registry.unbounded(model, "backprop")
    if unclipped:
        raise NotImplementedError(f"{method}: backpropagation clipping is not supported for trainable "
                                  f"{', '.join(sorted({u.split(' (')[1][:-1] for u in unclipped}))} layers "
                                  "(exact per-example clipping: flat, per_layer)")


def _bpclip_fast(model, x, y, seed, crit, clipping="backprop", norm_method="auto"):
    import torch

    import bpclip_fast.nn as bnn

    if clipping == "backprop":
        _refuse_unbounded(model, "bpclip_fast")
        bnn.convert_model(model, input_clip=INPUT_CLIP, grad_clip=GRAD_CLIP)  # norm l15, clip_fn clip
    else:  # exact per-example clipping to Opacus' max_grad_norm (GRAD_CLIP), norms by the cost rule
        bnn.convert_model(model, clipping=clipping, max_grad_norm=GRAD_CLIP, norm_method=norm_method)
    bnn.set_noise_multiplier(model, SIGMA)
    stream = bnn.NoiseStream(seed=seed)  # explicit seed: reproducible (insecure; cost is the same)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step():
        opt.zero_grad(set_to_none=True)
        bnn.arm_noise(model, stream)         # noise added inside this step's backward
        crit(model(x), y).backward()
        bnn.check_finite(model)              # the per-step sync of the documented protocol
        opt.step()
    return step, model


def _engine(model, x, y, seed, crit, noise="independent", bands=1):
    """Flat clipping through ``make_private`` (the step boundary, the private loader), to compare
    independent with banded noise at the same batch: the data set is ``bands`` copies of the batch,
    so the loader's rate (the group's, under banded noise) is 1 and every batch is ``x`` whole."""
    import warnings

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import bpclip_fast

    xc, yc = x.cpu(), y.cpu()  # the loader collates on the host, as a user's does; the step moves the batch
    data = TensorDataset(xc.repeat((bands,) + (1,) * (x.dim() - 1)), yc.repeat((bands,) + (1,) * (y.dim() - 1)))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    engine = bpclip_fast.PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the explicit seed's warning
        model, opt, loader = engine.make_private(
            module=model, optimizer=opt, data_loader=DataLoader(data, batch_size=x.shape[0]), noise_multiplier=SIGMA,
            clipping="flat", max_grad_norm=GRAD_CLIP, loss_reduction="sum", noise_seed=seed, noise=noise,
            bands=bands, probe=False)
    batches = iter(())

    def step():
        nonlocal batches
        try:
            bx, by = next(batches)
        except StopIteration:
            batches = iter(loader)
            bx, by = next(batches)
        opt.zero_grad(set_to_none=True)
        crit(model(bx.to(x.device, non_blocking=True)), by.to(y.device, non_blocking=True)).backward()
        opt.step()
    return step, model


def _generic_everywhere(model) -> None:
    """Every module of a registered (fused) type or composite (MultiheadAttention, LSTM: unpacked into
    fused Linears) swapped for a trivial subclass of its type, which the registry leaves to the
    generic exact path (it takes exact types only): the same model, trained by the generic path
    alone, to measure the fused paths against it."""
    from bpclip_fast import registry

    subclasses = {}
    for module in list(model.modules()):
        kind = type(module)
        fused = registry.layer_type(module) is not None and registry.owns_trainable(module)
        if fused or registry.composite(module) is not None:
            if kind not in subclasses:
                subclasses[kind] = type(f"Generic{kind.__name__}", (kind,), {"__module__": __name__})
            module.__class__ = subclasses[kind]


def _bpclip_generic(model, x, y, seed, crit):
    import warnings

    _generic_everywhere(model)
    with warnings.catch_warnings():  # the generic path's one-per-type announcement
        warnings.simplefilter("ignore", UserWarning)
        return _bpclip_fast(model, x, y, seed, crit, clipping="flat")


def _bpclip_reference(model, x, y, seed, crit):
    import torch

    from bpclip_fast import reference as ref

    _refuse_unbounded(model, "bpclip_reference")
    ref.attach(model, input_clip=INPUT_CLIP, grad_clip=GRAD_CLIP)
    shapes, _ = ref.record_input_shapes(model)
    gen = torch.Generator(device=x.device).manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step():
        opt.zero_grad(set_to_none=True)
        crit(model(x), y).backward()
        ref.add_noise(model, SIGMA, input_clip=INPUT_CLIP, grad_clip=GRAD_CLIP, input_shapes=shapes,
                      generator=gen)
        opt.step()
    return step, model


def _opacus(grad_sample_mode: str) -> Method:
    def build(model, x, y, seed, crit):
        import warnings

        import torch
        from opacus import PrivacyEngine
        from torch.utils.data import DataLoader, TensorDataset

        warnings.filterwarnings("ignore")  # secure_mode / accountant chatter
        from opacus.validators import ModuleValidator

        if not ModuleValidator.is_valid(model):  # Opacus' own remedy, as its users run it: nn.LSTM ->
            model = ModuleValidator.fix(model)   # DPLSTM, nn.MultiheadAttention -> DPMultiheadAttention
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        # The loader only tells make_private the batch size and sampling rate; the step feeds x, y.
        loader = DataLoader(TensorDataset(x, y), batch_size=x.shape[0])
        engine = PrivacyEngine(accountant="rdp")
        out = engine.make_private(module=model, optimizer=opt, data_loader=loader, criterion=crit,
                                  noise_multiplier=SIGMA, max_grad_norm=GRAD_CLIP, loss_reduction="sum",
                                  poisson_sampling=False, grad_sample_mode=grad_sample_mode)
        if grad_sample_mode == "ghost":
            pmodel, popt, pcrit, _ = out  # the criterion runs both backward passes of ghost clipping
        else:
            pmodel, popt, _ = out
            pcrit = crit

        def step():
            popt.zero_grad(set_to_none=True)
            pcrit(pmodel(x), y).backward()
            popt.step()                          # per-example clipping + noise + SGD
        return step, pmodel
    return Method(build, ("opacus",))


# The order is the table's and the default --methods'.
REGISTRY: dict[str, Method] = {
    "nonprivate": Method(_nonprivate),
    "bpclip_fast": Method(_bpclip_fast),
    "flat": Method(functools.partial(_bpclip_fast, clipping="flat")),
    "per_layer": Method(functools.partial(_bpclip_fast, clipping="per_layer")),
    "flat_generic": Method(_bpclip_generic),  # flat with every layer on the generic path
    # flat with every layer's per-example gradients instantiated (and kept for the release where they
    # fit): fewer launches than ghost norms plus the release's GEMM, more arithmetic on a CPU
    "flat_instantiate": Method(functools.partial(_bpclip_fast, clipping="flat", norm_method="instantiate")),
    "flat_engine": Method(_engine),  # flat through make_private (independent noise)
    "flat_banded": Method(functools.partial(_engine, noise="banded", bands=4)),  # the same, banded noise, 4 bands
    "bpclip_reference": Method(_bpclip_reference),
    "opacus_hooks": _opacus("hooks"),
    "opacus_ghost": _opacus("ghost"),
    "opacus_functorch": _opacus("functorch"),
}
METHODS = tuple(REGISTRY)
# on request: the generic path (10-20x), instantiated norms, and the engine's own steps (the noise
# comparison)
DEFAULT_METHODS = tuple(m for m in METHODS
                        if m not in ("flat_generic", "flat_instantiate", "flat_engine", "flat_banded"))


def import_for(methods) -> None:
    """Imports what the methods need, so that the child's memory baseline is taken after them."""
    import importlib

    import torch  # noqa: F401

    import bench.models  # noqa: F401
    import bpclip_fast  # noqa: F401
    needed = (m for name in methods if name in REGISTRY for m in REGISTRY[name].imports)
    for module in dict.fromkeys(needed):  # once each, in a fixed order
        importlib.import_module(module)


def build_step(method: str, model, x, y, seed: int):
    """The method's training step over ``model`` (wrapped here) as a zero-argument callable."""
    from torch import nn

    if method not in REGISTRY:
        raise ValueError(f"unknown method {method!r}")
    crit = nn.CrossEntropyLoss(reduction="sum")  # sum: grad_clip is a per-example bound
    return REGISTRY[method].build(model, x, y, seed, crit)
