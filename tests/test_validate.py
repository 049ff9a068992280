"""The validator's probes (bpclip_fast.validate): each rule finds its problem, and ordinary models pass.

Only ``validate`` is imported at module level, so that the file also runs against versions of the
validator without ``dynamic_problems`` (the positive cases must fail there, the controls pass).
"""

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import bpclip_fast.nn as bnn
from bpclip_fast import models
from bpclip_fast.validate import validate

D = 6  # feature width of the toy models


def problems_of(model, example_input):
    return validate(model, example_input)


def find(problems, *parts):
    """The problems that contain every one of ``parts``."""
    return [p for p in problems if all(part in p for part in parts)]


# ------------------------------------------------------------------------------ positive cases


class TiedAutoencoder(nn.Module):
    def __init__(self, d=D, h=4):
        super().__init__()
        self.enc = nn.Linear(d, h)

    def forward(self, x):
        z = torch.tanh(self.enc(x))
        return F.linear(z, self.enc.weight.t())  # the decoder reuses the encoder's weight in plain code


class FlattenRows(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 5)

    def forward(self, x):  # [B, T, d]
        b = x.shape[0]
        return self.lin(x.flatten(0, 1)).view(b, -1)


class SequenceFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 5)

    def forward(self, x):  # [B, T, d] -> [T, B, d] -> Linear -> [B, T, 5]
        return self.lin(x.transpose(0, 1)).transpose(0, 1)


class CentreOverBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, 5)
        self.b = nn.Linear(5, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h - h.mean(0))


class FunctionalBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, 5)
        self.b = nn.Linear(5, 3)

    def forward(self, x):
        h = F.batch_norm(self.a(x), None, None, training=True)
        return self.b(torch.relu(h))


class BatchMeanEMA(nn.Module):
    """Keeps an exponential moving average of the batch mean (a monitoring statistic; output unchanged)."""

    def __init__(self, d):
        super().__init__()
        self.register_buffer("mean", torch.zeros(d))

    def forward(self, x):
        with torch.no_grad():
            self.mean.mul_(0.9).add_(0.1 * x.reshape(-1, x.shape[-1]).mean(0))
        return x


class WithEMA(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, 5)
        self.ema = BatchMeanEMA(5)
        self.b = nn.Linear(5, 3)

    def forward(self, x):
        return self.b(torch.relu(self.ema(self.a(x))))


class ThreeTimes(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Linear(D, D)
        self.head = nn.Linear(D, 2)

    def forward(self, x):
        for _ in range(3):
            x = torch.tanh(self.block(x))
        return self.head(x)


class Projection(nn.Module):
    """Another module whose forward uses a Linear's weight (held here as a parameter of its own)."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return F.linear(x, self.weight)


class WeightUsedByAnotherModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.proj = Projection(self.lin.weight)
        self.head = nn.Linear(D, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.proj(torch.tanh(self.lin(x)))))


class TwoLinearsOneWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(D, D)
        self.second = nn.Linear(D, D)
        self.second.weight = self.first.weight  # tied: the same Parameter in two layers

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


def test_tied_autoencoder_is_reported_as_gradient_ownership():
    problems = problems_of(TiedAutoencoder(), torch.randn(2, D))
    assert find(problems, "enc (Linear)", "gradient ownership", "enc.weight"), problems
    assert not find(problems, "enc.bias"), problems  # the bias is used by the layer only


def test_flatten_of_the_batch_before_a_linear_is_reported_as_example_rows():
    problems = problems_of(FlattenRows(), torch.randn(1, 4, D))
    assert find(problems, "lin (Linear)", "example rows"), problems


@pytest.mark.parametrize("tokens", [2, 3, 4, 5, 8])
def test_sequence_first_layer_is_reported_whatever_the_sequence_length(tokens):
    # 3, 4, 5: what a fixed probe batch (or one chosen without looking at the input/layer shapes) would be.
    problems = problems_of(SequenceFirst(), torch.randn(2, tokens, D))
    assert find(problems, "lin (Linear)", "example rows", f"first dimension ({tokens})"), problems


def test_centring_over_the_batch_is_reported_as_batch_mixing():
    problems = problems_of(CentreOverBatch(), torch.randn(1, D))
    mixing = find(problems, "batch independence")
    assert len(mixing) == 1, problems
    # The first trainable layer in forward order that is affected is `a` (its output gradient goes back
    # through the centring); the layer whose input mixes, `b`, is named too.
    assert mixing[0].startswith("a (Linear): its output gradient"), mixing
    assert "b (Linear) input" in mixing[0], mixing


def test_functional_batch_norm_with_batch_statistics_is_reported():
    problems = problems_of(FunctionalBatchNorm(), torch.randn(2, D))
    mixing = find(problems, "batch independence")
    assert mixing and "b (Linear) input" in mixing[0], problems


def test_attention_across_the_batch_is_reported():
    class BatchAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(D, D)
            self.head = nn.Linear(D, 2)

        def forward(self, x):
            q = self.q(x)
            return self.head(torch.softmax(q @ q.T, -1) @ q)  # every example attends to every other

    problems = problems_of(BatchAttention(), torch.randn(1, D))
    mixing = find(problems, "batch independence")
    assert mixing and "head (Linear) input" in mixing[0], problems


def test_batch_mixing_after_the_last_layer_names_the_model_output():
    class CentredOutput(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, 3)

        def forward(self, x):
            y = self.lin(x)
            return y - y.mean(0)

    class CentredExtraOutput(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, 3)

        def forward(self, x):
            return self.lin(x), x - x.mean(0)  # the second output mixes, but no gradient goes through it

    problems = problems_of(CentredOutput(), torch.randn(1, D))
    mixing = find(problems, "batch independence")
    assert len(mixing) == 1 and mixing[0].startswith("lin (Linear): its output gradient"), problems
    problems = problems_of(CentredExtraOutput(), torch.randn(1, D))
    mixing = find(problems, "batch independence")
    assert len(mixing) == 1 and mixing[0].startswith("CentredExtraOutput (CentredExtraOutput) (model output)"), problems


def test_buffer_updated_in_forward_is_reported():
    problems = problems_of(WithEMA(), torch.randn(1, D))
    assert find(problems, "ema (BatchMeanEMA)", "buffer ema.mean", "rule: buffers"), problems
    assert not find(problems, "batch independence"), problems  # the EMA does not feed the output


def test_layer_applied_three_times_is_reported_as_reuse():
    problems = problems_of(ThreeTimes(), torch.randn(1, D))
    assert find(problems, "block (Linear): reached 3 times in one forward pass", "rule: reuse"), problems
    assert not find(problems, "gradient ownership"), problems  # its own three calls are its own gradient


def test_weight_used_by_another_module_is_reported_on_the_layer():
    problems = problems_of(WeightUsedByAnotherModule(), torch.randn(1, D))
    assert find(problems, "lin (Linear)", "gradient ownership", "lin.weight"), problems


def test_weight_shared_by_two_layers_is_reported_on_both():
    problems = problems_of(TwoLinearsOneWeight(), torch.randn(1, D))
    assert find(problems, "first (Linear)", "gradient ownership", "first.weight"), problems
    assert find(problems, "second (Linear)", "gradient ownership", "second.weight"), problems


def test_every_problem_is_listed_at_once():
    class Everything(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Linear(D, D)
            self.ema = BatchMeanEMA(D)
            self.block = nn.Linear(D, D)
            self.head = nn.Linear(D, 2)

        def forward(self, x):  # [B, T, d]
            h = self.ema(torch.tanh(self.enc(x)))
            h = F.linear(h, self.enc.weight.t())
            h = self.block(self.block(h - h.mean(0)))
            return self.head(h.flatten(0, 1))

    problems = problems_of(Everything(), torch.randn(1, 4, D))
    for rule, layer in [("example rows", "head (Linear)"), ("batch independence", "(Linear)"),
                        ("rule: buffers", "ema (BatchMeanEMA)"), ("gradient ownership", "enc (Linear)"),
                        ("rule: reuse", "block (Linear)")]:
        assert find(problems, rule, layer), (rule, problems)


def test_already_converted_layers_are_probed_as_torch_layers():
    model = bnn.convert_model(TiedAutoencoder(), input_clip=1.0, grad_clip=1.0)
    assert isinstance(model.enc, bnn.Linear)
    problems = problems_of(model, torch.randn(1, D))
    assert find(problems, "enc (Linear)", "gradient ownership"), problems
    assert "forward" not in vars(model.enc)  # the probe's base-class forward is gone again


# ------------------------------------------------------------------------------ negative controls


def mlp():
    return nn.Sequential(nn.Linear(D, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def small_cnn():
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
                         nn.Conv2d(4, 6, 3, stride=2, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(24, 5), nn.LogSoftmax(-1))


class Tokens(nn.Module):
    """A Linear over [B, T, d]: T positions per example, the examples stay in the first dimension."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 5)
        self.head = nn.Linear(5, 2)

    def forward(self, x):
        return self.head(torch.relu(self.lin(x)).mean(1))


class Normalised(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.gn = nn.GroupNorm(2, 4, affine=False)
        self.lin = nn.Linear(4 * 8 * 8, 6)
        self.ln = nn.LayerNorm(6, elementwise_affine=False)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.ln(self.lin(torch.relu(self.gn(self.conv(x))).flatten(1))))


class TupleInput(nn.Module):
    """forward(features, token_ids): a frozen embedding of integer indices and a float input."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, D).requires_grad_(False)
        self.lin = nn.Linear(D, 4)

    def forward(self, x, ids):
        return self.lin(x + self.emb(ids).mean(1))


class MeanLoss(nn.Module):
    """Returns its mean loss (a scalar over the batch): per-example gradients all the same."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 3)

    def forward(self, x):
        return F.cross_entropy(self.lin(x), torch.zeros(len(x), dtype=torch.long, device=x.device))


class DictInput(TupleInput):
    def forward(self, *, features, ids):
        return super().forward(features, ids)


CONTROLS = {
    "mlp": (mlp, lambda: torch.randn(1, D)),
    "cnn": (small_cnn, lambda: torch.randn(2, 3, 8, 8)),
    "tokens": (Tokens, lambda: torch.randn(1, 4, D)),
    "dropout": (lambda: nn.Sequential(nn.Linear(D, 8), nn.Dropout(0.5), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 3)),
                lambda: torch.randn(1, D)),
    "normalised": (Normalised, lambda: torch.randn(1, 1, 8, 8)),
    "frozen": (lambda: nn.Sequential(nn.Linear(D, 8).requires_grad_(False), nn.ReLU(), nn.Linear(8, 3)),
               lambda: torch.randn(1, D)),
    "tuple": (TupleInput, lambda: (torch.randn(2, D), torch.randint(0, 10, (2, 3)))),
    "dict": (DictInput, lambda: {"features": torch.randn(1, D), "ids": torch.randint(0, 10, (1, 3))}),
    "mean_loss": (MeanLoss, lambda: torch.randn(1, D)),
    "converted": (lambda: bnn.convert_model(small_cnn(), input_clip=1.0, grad_clip=1.0),
                  lambda: torch.randn(1, 3, 8, 8)),
    "converted_mlp": (lambda: nn.Sequential(bnn.Linear(D, 8, input_clip=1.0, grad_clip=1.0), nn.ReLU(),
                                            bnn.Linear(8, 3, input_clip=1.0, grad_clip=1.0)),
                      lambda: torch.randn(1, D)),
}


@pytest.mark.parametrize("name", list(CONTROLS))
def test_ordinary_models_have_no_problem(name):
    make_model, make_input = CONTROLS[name]
    torch.manual_seed(0)
    assert problems_of(make_model(), make_input()) == []


def test_controls_have_no_problem_on_the_gpu(device):
    if device != "cuda":
        pytest.skip("the CPU runs are the tests above")
    for name, (make_model, make_input) in CONTROLS.items():
        torch.manual_seed(0)
        inp = make_input()
        inp = (tuple(t.cuda() for t in inp) if isinstance(inp, tuple)
               else {k: v.cuda() for k, v in inp.items()} if isinstance(inp, dict) else inp.cuda())
        assert problems_of(make_model().cuda(), inp) == [], name
    problems = problems_of(TiedAutoencoder().cuda(), torch.randn(1, D, device="cuda"))
    assert find(problems, "enc (Linear)", "gradient ownership"), problems
    problems = problems_of(CentreOverBatch().cuda(), torch.randn(1, D, device="cuda"))
    assert find(problems, "batch independence"), problems


def test_integer_only_input_is_perturbed_too():
    # Until 2026-11-26 the mixing probe perturbed floating-point inputs only, and this model passed;
    # an example's token ids are now rolled (validate._perturbed), so the mixing shows.
    from bpclip_fast.validate import dynamic_problems

    class Indices(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, D).requires_grad_(False)
            self.lin = nn.Linear(D, 2)

        def forward(self, ids):
            e = self.emb(ids)
            return self.lin(e - e.mean(0))

    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    problems = dynamic_problems(Indices(), ids)
    assert len(problems) == 1 and "batch independence" in problems[0]
    # A model without mixing stays accepted; a constant row has nothing to roll and is left as it is.
    class Own(Indices):
        def forward(self, ids):
            return self.lin(self.emb(ids))

    assert dynamic_problems(Own(), ids) == []
    assert dynamic_problems(Own(), torch.full((2, 3), 4)) == []


def test_the_outcome_does_not_depend_on_the_input_values():
    from bpclip_fast.validate import dynamic_problems
    x = torch.randn(1, D)
    for make in (TiedAutoencoder, CentreOverBatch, WithEMA, mlp):
        torch.manual_seed(0)
        model = make()
        assert dynamic_problems(model, x) == dynamic_problems(model, 1e3 * x + 7)


# ------------------------------------------------------------------------------ nothing changes


class Stateful(nn.Module):
    """Dropout, an updated buffer, a BatchNorm (statically refused, probed in eval mode) and a frozen layer."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, 5)
        self.bn = nn.BatchNorm1d(5)
        self.ema = BatchMeanEMA(5)
        self.drop = nn.Dropout(0.5)
        self.frozen = nn.Linear(5, 5).requires_grad_(False)
        self.b = nn.Linear(5, 3)

    def forward(self, x):
        return self.b(self.frozen(self.drop(self.ema(self.bn(self.a(x))))))


class Uncopyable(Stateful):
    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()  # copy.deepcopy refuses locks: the probes run in place


def snapshot(model):
    return ({k: v.clone() for k, v in model.state_dict(keep_vars=True).items()},
            {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()},
            {n: m.training for n, m in model.named_modules()},
            torch.get_rng_state())


def assert_same(before, after):
    (state0, grads0, modes0, rng0), (state1, grads1, modes1, rng1) = before, after
    assert state0.keys() == state1.keys()
    for k in state0:
        assert torch.equal(state0[k], state1[k]), k
    assert grads0.keys() == grads1.keys()
    for k in grads0:
        assert (grads0[k] is None) == (grads1[k] is None), k
        if grads0[k] is not None:
            assert torch.equal(grads0[k], grads1[k]), k
    assert modes0 == modes1
    assert torch.equal(rng0, rng1)


@pytest.mark.parametrize("make", [Stateful, Uncopyable], ids=["deepcopy", "in_place"])
def test_validate_leaves_the_model_and_the_rng_as_they_were(make):
    torch.manual_seed(0)
    model = make()
    model.a.weight.grad = torch.randn_like(model.a.weight)  # some gradients set, others None
    model.b.bias.grad = torch.randn_like(model.b.bias)
    model.eval()
    model.drop.train()  # a mix of modes, restored module by module
    with torch.no_grad():
        model.ema.mean.fill_(0.25)
        model.bn.running_mean.fill_(0.5)
    params = dict(model.named_parameters())
    x = torch.randn(2, D)
    before = snapshot(model)
    problems = validate(model, x)
    assert_same(before, snapshot(model))
    assert all(p is params[n] for n, p in model.named_parameters())  # the same Parameter objects
    assert find(problems, "ema (BatchMeanEMA)", "buffer ema.mean"), problems
    assert find(problems, "bn (BatchNorm1d)"), problems  # the static check
    assert not find(problems, "bn.running_mean"), problems  # reported once, by the static check
    assert not find(problems, "batch independence"), problems  # BatchNorm probed in eval mode


def test_in_place_probing_finds_the_same_problems():
    class UncopyableTied(TiedAutoencoder):
        def __init__(self):
            super().__init__()
            self.lock = threading.Lock()

    torch.manual_seed(0)
    copyable, uncopyable = TiedAutoencoder(), UncopyableTied()
    uncopyable.load_state_dict(copyable.state_dict())
    x = torch.randn(1, D)
    assert validate(copyable, x) == validate(uncopyable, x)
    converted = bnn.convert_model(UncopyableTied(), input_clip=1.0, grad_clip=1.0)
    assert find(validate(converted, x), "enc (Linear)", "gradient ownership")
    assert "forward" not in vars(converted.enc)


def test_probes_on_the_cifar10_net():
    model = models.cifar10_net()
    x = torch.randn(1, 3, 32, 32)
    before = snapshot(model)
    assert validate(model, x) == []
    assert_same(before, snapshot(model))
