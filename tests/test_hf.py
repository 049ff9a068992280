"""Hugging Face models built from configs (no download), fine-tuned in full and with LoRA (peft):
every release equals per-example clipping computed in float64 from batches of one, and the models
train through make_private (issue 26)."""

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import bpclip_fast.nn as bnn
from bpclip_fast import PrivacyEngine
from test_generic import EPS64, clipped_truth, groups_of, per_example_grads

tf = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

V, T = 40, 6


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tf.logging.set_verbosity_error()
        yield


class Classifier(nn.Module):
    """The last position's logits of a causal LM (or a sequence classifier's), with the positions
    given per example (``position_ids`` expanded to the batch; see the README)."""

    def __init__(self, model, positions=True):
        super().__init__()
        self.model = model
        self.positions = positions

    def forward(self, ids):
        kw = {"position_ids": torch.arange(ids.shape[1]).expand(ids.shape[0], -1)} if self.positions else {}
        logits = self.model(input_ids=ids, **kw).logits
        return logits[:, -1] if logits.dim() == 3 else logits


def gpt2(tied=True):
    return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_positions=T, n_embd=8, n_layer=2, n_head=2,
                                            tie_word_embeddings=tied, attn_pdrop=0.0, resid_pdrop=0.0,
                                            embd_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def bert():
    return tf.BertForSequenceClassification(tf.BertConfig(vocab_size=V, hidden_size=8, num_hidden_layers=2,
                                                          num_attention_heads=2, intermediate_size=16,
                                                          max_position_embeddings=T, num_labels=3,
                                                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def llama():
    return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=V, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                                              num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=T,
                                              tie_word_embeddings=False, bos_token_id=0, eos_token_id=0))


def gpt2_lora():
    return peft.get_peft_model(gpt2(), peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True))


MODELS = {"gpt2_tied": lambda: Classifier(gpt2(True)), "gpt2_untied": lambda: Classifier(gpt2(False)),
          "bert": lambda: Classifier(bert()), "llama": lambda: Classifier(llama(), positions=False),
          "gpt2_lora": lambda: Classifier(gpt2_lora())}


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
@pytest.mark.parametrize("name", list(MODELS))
def test_release_equals_per_example_clipping(name, mode):
    torch.manual_seed(0)
    model = MODELS[name]().double()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, V, (5, T), generator=g), torch.randint(0, 3, (5,), generator=g)
    grads = per_example_grads(copy.deepcopy(model), x, y)
    C = 0.05  # below every example's norm here: each one is clipped
    bnn.convert_model(model, clipping=mode, max_grad_norm=C)
    truth, scale = clipped_truth(grads, groups_of(model, C if mode == "flat" else None))
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        # float64 both ways, through a transformer's backward: ≤ ~10³ roundings per entry, each within
        # an ulp of the magnitudes flowing through the backward, which scale with the example's whole
        # gradient (clipped: ≤ C each), not with the entry (the attention keys' bias has gradient 0,
        # computed as a cancellation of much larger terms)
        assert p.grad is not None, n
        assert torch.all((p.grad - truth[n]).abs() <= 1000 * EPS64 * x.shape[0] * C), n


def test_tied_embeddings_are_one_parameter_of_one_unit():
    """GPT-2's input and output embeddings are one parameter: the model under their closest common
    ancestor is one generic unit, so its per-example gradient is the sum over both uses."""
    model = Classifier(gpt2(True))
    bnn.convert_model(model, clipping="flat", max_grad_norm=1.0)
    assert "Private:" in type(model.model).__name__
    assert model.model.lm_head.weight is model.model.transformer.wte.weight


@pytest.mark.parametrize("name", ["gpt2_tied", "bert", "llama", "gpt2_lora"])
def test_make_private_fine_tunes(name):
    torch.manual_seed(2)
    model = MODELS[name]()
    trained = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in trained]
    data = TensorDataset(torch.randint(0, V, (24, T)), torch.randint(0, 3, (24,)))
    opt = torch.optim.AdamW(trained, lr=1e-2)
    model, opt, loader = PrivacyEngine().make_private(module=model, optimizer=opt,
                                                      data_loader=DataLoader(data, batch_size=8),
                                                      noise_multiplier=1.0, max_grad_norm=1.0, clipping="flat")
    for ids, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(ids), y).backward()
        opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, trained))


def test_a_broadcast_position_index_is_looked_up_per_example():
    """Untied GPT-2 called without position_ids looks its positions up as [1, T] and broadcasts them:
    under the engine the fused position Embedding looks the row up once per example (issue 26;
    bpclip_fast/broadcast.py), so make_private accepts it and trains (the releases against float64
    per-example clipping: tests/test_broadcast_index.py)."""
    torch.manual_seed(2)
    model = Classifier(gpt2(False), positions=False)
    data = TensorDataset(torch.randint(0, V, (24, T)), torch.randint(0, 3, (24,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = PrivacyEngine().make_private(module=model, optimizer=opt,
                                                      data_loader=DataLoader(data, batch_size=8), noise_multiplier=1.0,
                                                      max_grad_norm=1.0, clipping="flat")
    wpe = model.model.transformer.wpe
    before = wpe.weight.detach().clone()
    for ids, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(ids), y).backward()
        opt.step()
    assert type(wpe) is bnn.Embedding and not torch.equal(before, wpe.weight)
