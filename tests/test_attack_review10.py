"""Attack review 10: the fused composites (attention.py, recurrent.py), EmbeddingBag and Conv1d, against
DESIGN.md §5, with ordinary training code and inputs.

Each test is one attack. Where the library is sound the test pins it (a float64 truth, a refusal, a
probe report), so a regression fails it; the one finding (a plain tensor assigned to an unpacked
recurrent layer's weight name was silently ignored) has its fix tested here.

Truth: every example run alone through a float64 deep copy of the torch model (torch's own
``nn.LSTM``/``nn.MultiheadAttention``/..., never unpacked), its gradient ``G_i`` of ``<out_i, g_i>``;
the release of a never-armed converted model (no noise, no scaling) must be ``Σ_i min(1, C/‖G_i‖) G_i``.

Tolerance (everything float64, ``u = 2^-53``): each entry of ``G_i`` is a chain of at most ``S``
floating-point stages, each a sum of at most ``K`` products (``K`` = the widest dot product: the
concatenated positions times the widths), so its error is below ``S·K·u`` times the sum of the absolute
values of the chain's terms; the models are contracting (torch's initialisation, inputs ``~N(0, 1)``,
gates with derivatives ≤ 1), so that sum is of the order of ``‖G_i‖`` times the growth ``16`` of
tests/test_fused_attention.py. Both sides err that way and the clip's norm and factor add a few
roundings, so ``‖release − truth‖ ≤ 2·16·S·K·u·(Σ_i ‖G_i‖ + ‖truth‖)``. A wrong routing (a
parameter's gradient missing a use, examples mixed, a clip per use) is off by a fraction of
``‖truth‖``, ~10^10 times this.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import bpclip_fast.nn as bnn
from bpclip_fast import PrivacyEngine, StepRefused
from bpclip_fast.layers import recurrent

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

F64 = torch.float64
U64 = 2.0 ** -53
B = 4


def _outs(o):
    return o if isinstance(o, (tuple, list)) else (o,)


def _truth(model, inputs, rows, gs):
    """``(names, [B, P])``: each example alone through a float64 copy of the plain torch model."""
    ref = copy.deepcopy(model).double()
    params = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    per = []
    for i in range(B):
        loss = sum((a * g[i:i + 1]).sum() for a, g in zip(_outs(ref(*rows(inputs, i))), gs))
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True, materialize_grads=True)
        per.append(torch.cat([g.reshape(-1) for g in grads]))
    return list(params), torch.stack(per)


def _release_matches_truth(model, inputs, rows, n_out, stages, terms, mode="flat"):
    """The converted model's release (``flat``: one cut at the median norm, some examples clipped) equals
    the clipped sum of the float64 per-example gradients; returns the converted model."""
    with torch.no_grad():
        outs = _outs(model(*inputs))[:n_out]
    gen = torch.Generator().manual_seed(5)
    gs = [torch.randn(o.shape, generator=gen, dtype=F64) for o in outs]
    names, per = _truth(model, inputs, rows, gs)
    norms = per.norm(dim=1)
    cut = float(norms.median())
    factor = torch.clamp(cut / norms, max=1.0)
    assert (factor < 1).any() and (factor == 1).any()
    want = (factor[:, None] * per).sum(0)
    conv = bnn.convert_model(copy.deepcopy(model), clipping=mode, max_grad_norm=cut)
    sum((o * g).sum() for o, g in zip(_outs(conv(*inputs))[:n_out], gs)).backward()
    state = conv.state_dict(keep_vars=True)  # torch's names for the unpacked composites' parameters
    got = torch.cat([state[n].grad.reshape(-1) if state[n].grad is not None
                     else torch.zeros(state[n].numel(), dtype=F64) for n in names])
    err = float((got - want).norm())
    tol = 2 * 16 * stages * terms * U64 * (float(norms.sum()) + float(want.norm()))
    assert err <= tol, f"‖release − truth‖ = {err:.3g} > {tol:.3g} (‖truth‖ = {float(want.norm()):.3g})"
    return conv


# ----------------------------------------------------------------------------- recurrent: h_0 from a clipped layer


class _Seq2Seq(nn.Module):
    """An encoder Linear makes the decoder LSTM's h_0/c_0 (ordinary seq2seq); sequence-first decoder."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(5, 3)
        self.rnn = nn.LSTM(2, 3, num_layers=2)
        self.head = nn.Linear(3, 2)

    def forward(self, ctx, x):
        h0 = torch.tanh(self.enc(ctx)).unsqueeze(0).repeat(2, 1, 1)
        out, (_, c) = self.rnn(x, (h0, 0.5 * h0))
        return self.head(out.transpose(0, 1)), c.transpose(0, 1)


def test_h0_made_by_a_clipped_layer_reaches_it_only_through_the_recurrence():
    """Attack: the graded recurrence runs with detached W_hh; does h_0's gradient (and so the encoder's
    per-example gradient) still carry ∂a_t/∂h_{t-1}, and does nothing reach W_hh outside hh_l*?"""
    torch.manual_seed(0)
    model = _Seq2Seq().double()
    ctx, x = torch.randn(B, 5, dtype=F64), torch.randn(6, B, 2, dtype=F64)
    conv = _release_matches_truth(model, (ctx, x), lambda inp, i: (inp[0][i:i + 1], inp[1][:, i:i + 1]), 2,
                                  stages=4 * 6, terms=2 + 3 + 4 * 3 + 6)
    assert isinstance(conv.rnn, recurrent.LSTM)


def test_gru_without_bias_two_layers_bidirectional():
    """Attack: GRU's n block (r ⊙ W_hn h) with bias=False, where the kernel has no b_hn to carry."""
    torch.manual_seed(1)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.gru = nn.GRU(3, 4, num_layers=2, bidirectional=True, bias=False, batch_first=True)
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            return self.head(self.gru(x)[0])

    conv = _release_matches_truth(Model().double(), (torch.randn(B, 5, 3, dtype=F64),),
                                  lambda inp, i: (inp[0][i:i + 1],), 1, stages=4 * 5, terms=8 + 3 * 4 + 5)
    assert isinstance(conv.gru, recurrent.GRU)


# ----------------------------------------------------------------------------- attention: other identities, masks


def test_cross_attention_value_is_query_with_3d_mask_and_returned_weights():
    """Attack: value is the query's tensor and the key another (the concatenation is [q; k], v read from
    q's positions), sequence-first, a key_padding_mask, a per-(example, head) 3-D float attn_mask, and the
    un-averaged attention weights returned into the loss."""
    torch.manual_seed(2)
    heads, L, E = 2, 5, 4

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.att = nn.MultiheadAttention(E, heads)
            self.head = nn.Linear(E, 2)

        def forward(self, q, k, kpm, am):
            out, w = self.att(q, k, q, key_padding_mask=kpm, attn_mask=am, need_weights=True,
                              average_attn_weights=False)
            return self.head(out.transpose(0, 1)), w

    q, k = torch.randn(L, B, E, dtype=F64), torch.randn(L, B, E, dtype=F64)
    kpm = torch.zeros(B, L, dtype=F64)  # float, as the attn_mask (torch deprecates mixed mask types)
    kpm[1, 3:] = float("-inf")
    kpm[2, 0] = float("-inf")
    am = torch.randn(B * heads, L, L, dtype=F64)
    rows = lambda inp, i: (inp[0][:, i:i + 1], inp[1][:, i:i + 1], inp[2][i:i + 1],  # noqa: E731
                           inp[3][heads * i:heads * (i + 1)])
    _release_matches_truth(Model().double(), (q, k, kpm, am), rows, 2, stages=12, terms=2 * L * E * heads)


# ----------------------------------------------------------------------------- parameters outside the Linears


class _LearnedState(nn.Module):
    """A learned h_0 (a parameter expanded over the batch) or a learned attention memory: parameters that
    no clipped Linear owns, next to a recurrent layer / an attention."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        if kind == "h0":
            self.h0 = nn.Parameter(torch.randn(2, 1, 3))
            self.rnn = nn.GRU(2, 3, num_layers=2)
            self.head = nn.Linear(3, 2)
        else:
            self.mem = nn.Parameter(torch.randn(3, 1, 4))
            self.att = nn.MultiheadAttention(4, 2)
            self.head = nn.Linear(4, 2)

    def forward(self, x):
        if self.kind == "h0":
            h = self.h0.expand(2, x.shape[0], 3).contiguous()
            return self.head(self.rnn(x.transpose(0, 1), h)[0][-1])
        m = self.mem.expand(-1, x.shape[0], -1)
        return self.head(self.att(x.transpose(0, 1), m, m)[0].mean(0))


@pytest.mark.parametrize("kind", ["h0", "memory"])
def test_a_learned_state_or_memory_is_clipped_with_its_owner(kind):
    """Attack: a trainable tensor that reaches the recurrence / attention outside the unpacked Linears. It
    must not train unclipped: its owner becomes one generic unit (exact), whose release is the truth."""
    torch.manual_seed(3)
    model = _LearnedState(kind).double()
    x = torch.randn(B, 5, 2 if kind == "h0" else 4, dtype=F64)
    conv = _release_matches_truth(model, (x,), lambda inp, i: (inp[0][i:i + 1],), 1, stages=24, terms=64)
    assert type(conv).__name__.startswith("Private:")  # the whole model: one generic unit
    assert [n for n, _ in bnn.clipped_layers(conv)] == [type(conv).__name__]


# ----------------------------------------------------------------------------- mixing through the composites


class _Mixing(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.enc = nn.Linear(4, 4)
        self.att = nn.MultiheadAttention(4, 2, batch_first=True)
        self.rnn = nn.LSTM(4, 4, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = self.enc(x)
        if self.how == "memory-mean":  # a memory shared across the batch, made from the batch
            m = h.mean(0, keepdim=True).expand_as(h)
            return self.head(self.att(h, m, m)[0].mean(1))
        if self.how == "key-roll":  # another example's sequence as the key
            m = h.roll(1, 0)
            return self.head(self.att(h, m, m)[0].mean(1))
        if self.how == "memory-detached":  # seen only in in_proj's input, never in a gradient
            m = x.mean(0, keepdim=True).expand_as(h)
            return self.head(self.att(h, m, m)[0].mean(1))
        # h_0 from the batch mean (no grad): visible only in hh_l0's input
        h0 = x[:, 0].mean(0, keepdim=True).expand(x.shape[0], -1).unsqueeze(0).contiguous()
        return self.head(self.rnn(h, (h0, h0))[0][:, -1])


@pytest.mark.parametrize("how", ["memory-mean", "key-roll", "memory-detached", "h0-mean"])
def test_examples_mixed_through_attention_or_recurrent_state_are_reported(how):
    problems = PrivacyEngine.validate(_Mixing(how), torch.randn(1, 5, 4), clipping="flat")
    assert any("batch independence" in p for p in problems), problems
    names = {"memory-mean": "att.in_proj", "key-roll": "att.in_proj", "memory-detached": "att.in_proj",
             "h0-mean": "rnn.hh_l0"}
    assert any(names[how] in p for p in problems), problems


# ----------------------------------------------------------------------------- plain-code uses of unpacked weights


class _RnnAttn(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(3, 4, batch_first=True)
        self.att = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = self.rnn(x)[0]
        return self.head(self.att(h, h, h)[0].mean(1))


@pytest.mark.parametrize("penalised", ["rnn.weight_hh_l0", "att.in_proj_weight", "all"])
def test_a_penalty_on_torch_named_weights_is_refused(penalised):
    """Attack: an L2 penalty on the unpacked weights read through torch's names (a property / __getattr__
    alias of the Linears' parameters) adds an unclipped, data-independent but un-noised-for gradient."""
    torch.manual_seed(4)
    model = _RnnAttn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(16, 5, 3), torch.randint(0, 2, (16,)))
    model, opt, loader = PrivacyEngine().make_private(module=model, optimizer=opt,
                                                      data_loader=DataLoader(data, batch_size=4),
                                                      noise_multiplier=1.0, max_grad_norm=1.0, clipping="flat")
    x, y = next(iter(loader))
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    if penalised == "all":
        loss = loss + 1e-3 * sum(p.pow(2).sum() for p in model.parameters())
    else:
        owner, name = penalised.split(".")
        loss = loss + 1e-3 * getattr(getattr(model, owner), name).pow(2).sum()
    with pytest.raises(StepRefused) as info:
        loss.backward()
        opt.step()
    assert info.value.rule == "weight-reuse"


def test_a_recurrent_layer_called_per_time_step_is_refused():
    """Attack: an autoregressive loop calling the LSTM once per step reaches ih/hh T times."""

    class Loop(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(2, 3, batch_first=True)
            self.head = nn.Linear(3, 2)

        def forward(self, x):
            state, outs = None, []
            for t in range(x.shape[1]):
                o, state = self.rnn(x[:, t:t + 1], state)
                outs.append(o)
            return self.head(torch.cat(outs, 1)[:, -1])

    model = Loop()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(8, 5, 2), torch.randint(0, 2, (8,)))
    with pytest.raises(ValueError, match=r"rnn\.ih_l0 \(Linear\): reached 5 times"):
        PrivacyEngine().make_private(module=model, optimizer=opt, data_loader=DataLoader(data, batch_size=4),
                                     noise_multiplier=1.0, max_grad_norm=1.0, clipping="flat")


def test_assigning_to_an_unpacked_weight_name_is_refused_not_ignored():
    """Finding: ``lstm.weight_hh_l0 = tensor`` on an unpacked layer was accepted as a plain attribute that
    shadowed the alias while the forward kept using the Linear's parameter: the assignment was silently
    ignored (torch refuses a non-Parameter for a parameter's name; a Parameter is refused here already)."""
    layer = bnn.convert_model(nn.Sequential(nn.LSTM(3, 4, batch_first=True)), clipping="flat", max_grad_norm=1.0)[0]
    before = layer.hh_l0.weight
    for value in (torch.randn(16, 4), nn.Parameter(torch.randn(16, 4))):
        with pytest.raises((TypeError, KeyError, AttributeError), match="weight_hh_l0"):
            layer.weight_hh_l0 = value
        assert layer.weight_hh_l0 is before and layer.hh_l0.weight is before
    layer.hh_l0.weight.data.mul_(0.5)  # editing the values in place stays what it is in torch
    assert layer.weight_hh_l0 is before


# ----------------------------------------------------------------------------- EmbeddingBag: weights from a layer


def test_embedding_bag_per_sample_weights_made_by_a_clipped_layer():
    """Attack: per_sample_weights that require grad, produced per entry by an upstream trainable Linear:
    its gradient must flow through the bag's backward and be clipped per example with the rest."""
    torch.manual_seed(6)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(3, 1)
            self.bag = nn.EmbeddingBag(10, 4, mode="sum")
            self.head = nn.Linear(4, 2)

        def forward(self, idx, feat):
            return self.head(self.bag(idx, per_sample_weights=torch.sigmoid(self.w(feat)).squeeze(-1)))

    idx = torch.randint(0, 10, (B, 5))
    idx[0, :2] = 7  # a repeated index inside one bag
    feat = torch.randn(B, 5, 3, dtype=F64)
    _release_matches_truth(Model().double(), (idx, feat), lambda inp, i: (inp[0][i:i + 1], inp[1][i:i + 1]), 1,
                           stages=6, terms=5 * 4)
