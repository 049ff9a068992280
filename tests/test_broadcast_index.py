"""An Embedding's index of one row broadcast over the batch (issue 26: Hugging Face's positions,
``arange(T).unsqueeze(0)``), looked up once per example in private training (bpclip_fast/broadcast.py):
every release equals per-example clipping computed in float64 from batches of one, and the models
whose code relies on the lookup's leading 1 (or whose rows would mix examples) are refused."""

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import bpclip_fast.nn as bnn
from bpclip_fast import PrivacyEngine, broadcast
from test_generic import EPS64, clipped_truth, groups_of

T, D, V = 6, 4, 100
SIGMA = 1e-16  # the engine needs σ > 0: noise of std σC, far below the rounding tolerance


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class Positions(nn.Module):
    """``x + emb(arange(T)[None])``: the position table looked up as [1, T] and broadcast; ``use``
    what the model does with the [1, T, D] lookup afterwards."""

    def __init__(self, use="add"):
        super().__init__()
        self.emb, self.out, self.use = nn.Embedding(T, D), nn.Linear(D, 3), use

    def forward(self, x):
        e = self.emb(torch.arange(x.shape[1])[None])
        if self.use == "sum0":      # relies on the leading 1: B times the table once expanded
            e = e.sum(0)
        elif self.use == "first":   # keeps the output, but every example's gradient lands in row 0
            e = e[0]
        elif self.use == "squeeze":  # harmless: a no-op on [B, T, D]
            e = e.squeeze(0)
        return self.out(torch.tanh(x + e)).sum(1)


class TokenPositions(nn.Module):
    """Token ids only (nothing floating for probe 2 to perturb); ``use`` as in Positions."""

    def __init__(self, use="add"):
        super().__init__()
        self.tok, self.pos, self.out, self.use = nn.Embedding(V, D), nn.Embedding(T, D), nn.Linear(D, 3), use

    def forward(self, ids):
        # "data": example 0's tokens looked up for every example
        p = self.pos(ids[:1] % T if self.use == "data" else torch.arange(ids.shape[1]).unsqueeze(0))
        if self.use == "first":
            p = p[0]
        elif self.use == "mean":
            p = p.mean(0, keepdim=True)
        return self.out(torch.tanh(self.tok(ids) + p)).sum(1)


class Bias(nn.Module):
    """An index of shape [1] (one learned vector for every example): ``h + emb(tensor([0]))``."""

    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(2, D), nn.Linear(D, 3)

    def forward(self, x):
        return self.out(torch.tanh(x.sum(1) + self.emb(torch.zeros(1, dtype=torch.long))))


def _hf(kind, tied=False):
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    if kind == "gpt2":
        config = tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=V, n_positions=32, tie_word_embeddings=tied,
                               attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return tf.GPT2LMHeadModel(config)
    config = tf.BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=32, max_position_embeddings=32, num_labels=3,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return tf.BertForSequenceClassification(config)


class HF(nn.Module):
    """A Hugging Face model called without position_ids: its positions are a [1, T] index."""

    def __init__(self, kind, tied=False):
        super().__init__()
        self.model = _hf(kind, tied)

    def forward(self, ids):
        logits = self.model(input_ids=ids).logits
        return logits[:, -1, :3] if logits.dim() == 3 else logits


def _data(model_name, n=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    if model_name == "toy":
        return TensorDataset(torch.randn(n, T, D, generator=g, dtype=torch.float64), y)
    return TensorDataset(torch.randint(0, V, (n, T), generator=g), y)


MODELS = {"toy": lambda: Positions(), "tokens": lambda: TokenPositions(), "gpt2": lambda: HF("gpt2"),
          "bert": lambda: HF("bert"), "squeeze": lambda: Positions("squeeze"), "bias": lambda: Bias(),
          # tied embeddings: the whole GPT-2 is one generic unit, its Embeddings plain torch modules inside it
          # (the unit's own per-example path takes the broadcast); nothing of it is expanded
          "gpt2_tied": lambda: HF("gpt2", tied=True)}


def _private(model, data, mode, C, batch_size=6, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return PrivacyEngine().make_private(module=model, optimizer=opt, data_loader=DataLoader(data, batch_size=batch_size),
                                        noise_multiplier=SIGMA, max_grad_norm=C, clipping=mode, loss_reduction="sum",
                                        noise_seed=7, **kw)


def _truth(reference, private, x, y, mode, C):
    """Σ_i clip(G_i) in float64, G_i from a batch of one of the unconverted model (its [1, T] lookup
    is then example i's own), grouped as the private model clips."""
    names = [n for n, p in reference.named_parameters() if p.requires_grad]
    rows = {n: [] for n in names}
    for i in range(x.shape[0]):
        reference.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(reference(x[i:i + 1]), y[i:i + 1], reduction="sum").backward()
        params = dict(reference.named_parameters())
        for n in names:
            g = params[n].grad
            rows[n].append(torch.zeros_like(params[n]) if g is None else g.clone())
    grads = {n: torch.stack(v) for n, v in rows.items()}
    return clipped_truth(grads, groups_of(private, C if mode == "flat" else None))[0]


def _check_step(model, opt, x, y, truth, C):
    got = {id(p): p.grad for g in opt.param_groups for p in g["params"]}
    # float64 both ways, through at most a transformer's backward (as tests/test_hf.py): ≤ ~10³ roundings
    # per entry, each within an ulp of magnitudes that scale with an example's clipped gradient (≤ C),
    # and the noise, std σC per entry: 10 std (a fixed seed; exceeded with probability ~1e-23 per entry)
    tol = 1000 * EPS64 * x.shape[0] * C + 10 * SIGMA * C
    for n, p in model.named_parameters():
        assert got[id(p)] is not None, n
        assert torch.all((got[id(p)] - truth[n]).abs() <= tol), n


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
@pytest.mark.parametrize("name", list(MODELS))
def test_release_equals_per_example_clipping(name, mode):
    torch.manual_seed(0)
    model = MODELS[name]().double()
    reference = copy.deepcopy(model)
    C = 0.05 if mode == "flat" else 0.02  # below every example's norm here: each one is clipped
    model, opt, loader = _private(model, _data("toy" if name in ("toy", "squeeze", "bias") else name), mode, C)
    x, y = next(iter(loader))
    assert x.shape[0] > 1
    pos = next(m for n, m in model.named_modules() if n.endswith(("emb", "pos", "position_embeddings", "wpe")))
    assert type(pos) is (nn.Embedding if name == "gpt2_tied" else bnn.Embedding)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    _check_step(model, opt, x, y, _truth(reference, model, x, y, mode, C), C)
    opt.step()


def test_micro_batches_release_per_example_clipping():
    """Two calls of the model on halves of the drawn batch, one step: each call expands the table
    to its own rows, and the rows counted over the passes are the drawn batch's."""
    torch.manual_seed(0)
    model = Positions().double()
    reference = copy.deepcopy(model)
    C = 0.05
    model, opt, loader = _private(model, _data("toy"), "flat", C)
    x, y = next(iter(loader))
    opt.zero_grad()
    with opt.accumulate():
        for part in (slice(0, 2), slice(2, None)):
            nn.functional.cross_entropy(model(x[part]), y[part], reduction="sum").backward()
    _check_step(model, opt, x, y, _truth(reference, model, x, y, "flat", C), C)
    opt.step()


def test_a_batch_of_one():
    torch.manual_seed(0)
    model = Positions().double()
    reference = copy.deepcopy(model)
    C = 0.05
    model, opt, loader = _private(model, _data("toy", n=4), "flat", C, batch_size=1)
    for x, y in loader:  # Poisson sampling: the first batch of one example
        opt.zero_grad()
        if x.shape[0] == 1:
            break
        opt.step()  # an empty or larger batch: a step of its own
    assert x.shape[0] == 1
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    _check_step(model, opt, x, y, _truth(reference, model, x, y, "flat", C), C)


def test_inference_and_conversion_alone_are_unchanged():
    """Outside a grad-enabled call of the private model the lookup is the one row it was."""
    model = Positions().double()
    model, opt, loader = _private(model, _data("toy"), "flat", 1.0)
    seen = []
    model.emb.register_forward_hook(lambda m, a, out: seen.append(tuple(out.shape)))
    x, _ = next(iter(loader))
    with torch.no_grad():
        model(x)
    model.eval()
    with torch.no_grad():
        model(x)
    assert seen == [(1, T, D), (1, T, D)]
    assert broadcast.current_rows() is None  # every call popped its rows
    converted = bnn.convert_model(Positions().double(), clipping="per_layer", max_grad_norm=1.0)
    with broadcast.pushed(5):  # rows of a call, but no engine trains this layer
        assert converted.emb(torch.arange(T)[None]).shape == (1, T, D)


def test_rows_are_popped_when_the_forward_raises():
    model = Positions().double()
    model, opt, loader = _private(model, _data("toy"), "flat", 1.0)
    with pytest.raises(RuntimeError):
        model(torch.randn(2, T, D + 1, dtype=torch.float64))
    assert broadcast.current_rows() is None


@pytest.mark.parametrize("where", ["before make_private", "after make_private"])
def test_a_pre_hook_that_raises_pops_no_rows_of_an_enclosing_call(where):
    """The rows' hooks pop only what their own call pushed: a forward pre-hook of the loop's that raises
    before or after the engine's (its pre-hook is not the first: dynamo 2.11 misreads a prepended
    hook's guards) leaves an enclosing call's rows in place."""
    model = Positions().double()
    armed = []

    def refuse(module, args):
        if armed:  # not in make_private's probes
            raise KeyError("the loop's own pre-hook")

    if where == "before make_private":
        model.register_forward_pre_hook(refuse)
    model, opt, loader = _private(model, _data("toy"), "flat", 1.0)
    if where == "after make_private":
        model.register_forward_pre_hook(refuse)
    armed.append(True)
    with broadcast.pushed(7):
        with pytest.raises(KeyError):
            model(torch.randn(2, T, D, dtype=torch.float64))
        assert broadcast.current_rows() == 7
    assert broadcast.current_rows() is None


@pytest.mark.parametrize("use", ["sum0"])
def test_code_relying_on_the_leading_one_is_refused(use):
    model = Positions(use).double()
    with pytest.raises(ValueError, match=r"emb \(Embedding\): its index has one row shared by the \d+ examples.*"
                                         r"changed the model's output.*position_ids=torch\.arange\(T\)\.expand"):
        _private(model, _data("toy"), "flat", 1.0)


def test_a_concatenation_along_the_batch_is_refused():
    class Cat(Positions):
        def forward(self, x):
            e = self.emb(torch.arange(x.shape[1])[None])
            h = torch.cat([e, x], 0)  # the table, then the examples: [1 + B, T, D] only while e has one row
            return self.out(torch.tanh(h[1:] + h[:1])).sum(1)

    with pytest.raises(ValueError, match=r"emb \(Embedding\): its index has one row shared.*changed the model's output"):
        _private(Cat().double(), _data("toy"), "flat", 1.0)


@pytest.mark.parametrize("model,data", [(lambda: Positions("first"), "toy"), (lambda: TokenPositions("first"), "tokens"),
                                        (lambda: TokenPositions("mean"), "tokens")], ids=["first", "tokens-first", "tokens-mean"])
def test_rows_that_reach_other_examples_are_refused(model, data):
    """``e[0]`` and ``e.mean(0)`` keep the output but give one row the gradients of several examples;
    refused also with token ids only, where the floating-point perturbation probe has nothing to change."""
    with pytest.raises(ValueError, match=r"(emb|pos) \(Embedding\).*(reaches another example|rule: batch independence)"):
        _private(model().double(), _data(data), "flat", 1.0)


def test_a_shared_row_taken_from_the_data_is_refused():
    """``pos(ids[:1])``: one example's tokens broadcast to every example. Each expanded row reaches its
    own example only, but every row's lookup is example 0's data: refused (integer inputs, so the
    floating-point perturbation probe could not see it)."""
    with pytest.raises(ValueError, match=r"pos \(Embedding\): its index has one row shared.*changed when the examples' "
                                         r"integer inputs changed"):
        _private(TokenPositions("data").double(), _data("tokens"), "flat", 1.0)


def test_the_rows_of_a_call():
    """The examples of a call: the first dimension its tensors share; a tensor of one row is shared."""
    from bpclip_fast.batches import call_rows

    ids, pos = torch.zeros(5, T, dtype=torch.long), torch.arange(T)[None]
    assert call_rows((ids,), {"position_ids": pos}) == 5
    assert call_rows((pos,)) == 1
    assert call_rows((ids, torch.zeros(3, D))) is None  # disagreeing tensors: unknown, nothing expands
    assert call_rows((), {"flag": True}) is None
    assert call_rows(({"x": ids, "mask": ids}, [torch.tensor(2.0)])) == 5  # nested; a scalar has no rows


def test_an_index_expanded_by_the_model_from_one_examples_tokens_is_refused():
    # emb(ids[:1].expand(B, T)): every example's positions are example 0's tokens, so example 0 moves
    # every other example's contribution. The probes' perturbation of integer inputs (validate.
    # _perturbed: one example's token ids rolled) sees the other examples' layer inputs change.
    import bpclip_fast
    from torch.utils.data import DataLoader, TensorDataset

    class Leaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos, self.head = nn.Embedding(11, 4), nn.Embedding(11, 4), nn.Linear(4, 2)

        def forward(self, ids):
            shared = ids[:1].expand(ids.shape[0], -1)
            return self.head((self.tok(ids) + self.pos(shared)).mean(1))

    torch.manual_seed(0)
    model = Leaky()
    ids = torch.randint(0, 11, (6, 5))
    loader = DataLoader(TensorDataset(ids, torch.randint(0, 2, (6,))), batch_size=3)
    with pytest.raises(ValueError, match="batch independence"):
        bpclip_fast.PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                                 data_loader=loader, noise_multiplier=1.0, clipping="flat",
                                                 max_grad_norm=1.0)
