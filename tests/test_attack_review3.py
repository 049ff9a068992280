"""Attack review of issue 25 ("host cost"): torch.compile of private models, the fused bound
kernels, the engine package. Each test is a finding: it failed on the code before its fix."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bpclip_fast import PrivacyEngine, StepRefused

if not hasattr(torch, "compile"):
    pytest.skip("torch.compile is unavailable", allow_module_level=True)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class _WeightAlsoInPlainCode(nn.Module):
    """The private layer's weight is used again in the forward outside the layer (an ordinary
    scale from its norm): that use's gradient, ``w·Σ_b ⟨g_b, h_b⟩``, is data-dependent and unclipped. ``layer='ln'`` puts a LayerNorm (per-example gradients instantiated) first."""

    def __init__(self, layer):
        super().__init__()
        self.which = layer
        self.a = nn.Linear(4, 4)
        if layer == "ln":
            self.ln = nn.LayerNorm(4)

    def forward(self, x):
        if self.which == "ln":
            h = self.a(self.ln(x))
            return h * (1 + 0.5 * self.ln.weight.square().sum())
        return self.a(x) * (1 + 0.5 * self.a.weight.square().sum())


def _private_plain_use(mode, layer):
    torch.manual_seed(0)
    model = _WeightAlsoInPlainCode(layer)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(20, 4, generator=g), torch.randint(0, 4, (20,), generator=g))
    bounds = dict(input_clip=1.0, grad_clip=1.0) if mode == "backprop" else dict(max_grad_norm=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(data, 5),
            noise_multiplier=1.0, clipping=mode, noise_seed=1, probe=False, **bounds)


@pytest.mark.parametrize("mode,layer", [("per_layer", "linear"), ("backprop", "linear"), ("flat", "linear"),
                                        ("per_layer", "ln")])
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_weight_used_in_plain_code_is_refused_under_inductor(mode, layer, backend):
    """Finding 1 (high). Under torch.compile the graph, not autograd, sums the layer's clipped
    gradient with the plain use's gradient; inductor writes that sum into the buffer the private
    op returned (``buf6 = buf3  # reuse``), so the AccumulateGrad check saw its own tensor object at
    its own version and the unclipped term was released. Eager refuses (weight-reuse)."""
    model, opt, loader = _private_plain_use(mode, layer)
    run = model if backend == "eager" else torch.compile(model, backend=backend)
    x, y = next(iter(loader))
    opt.zero_grad()
    with pytest.raises(StepRefused) as exc:
        F.cross_entropy(run(x), y).backward()
        opt.step()
    assert exc.value.rule == "weight-reuse"


def test_compiled_private_ops_are_never_captured_in_a_cuda_graph():
    """Finding 2 (critical, needs a GPU to show). ``mode="reduce-overhead"`` replays a CUDA graph of
    the compiled step, and inductor's graph partition (on by default) keeps every GPU op in it that
    is not tagged ``cudagraph_unsafe``, CPU ops split out. Our ops' work is Python (the step's draw,
    its rows, the flat book, the budget), which a replay never runs: every replayed step would add
    the same noise (two releases minus each other: the noise cancels) and no check would run. Each
    op of the compiled path must carry the tag, so that inductor runs it outside any CUDA graph."""
    from bpclip_fast import compiled, compiled_backprop  # noqa: F401 (registers the ops)
    from torch._inductor.utils import is_cudagraph_unsafe_fx_node

    names = ["exact_forward", "exact_backward", "flat_collect", "flat_release", "backprop_forward",
             "backprop_backward", "example_tap", "example_backward", "check_outside"]
    ns = torch.ops.bpclip_fast_compiled
    assert sorted(names) == sorted(n for n in dir(ns) if not n.startswith("_") and hasattr(getattr(ns, n), "default")
                                   and n not in ("name",)), dir(ns)
    graph = torch.fx.Graph()
    for name in names:
        node = graph.call_function(getattr(ns, name).default, ())
        assert is_cudagraph_unsafe_fx_node(node), name
