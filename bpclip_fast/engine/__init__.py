"""``PrivacyEngine``: backpropagation-clipping DP training in Opacus' three lines.

    engine = PrivacyEngine()                       # accountant="rdp" | "pld" | "zcdp"
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                   noise_multiplier=1.1, input_clip=1.0, grad_clip=1.0)
    ... train as usual ...
    engine.get_epsilon(delta)

What ``make_private`` does: validates the model (listing every problem at once), converts its
layers of the types in :mod:`bpclip_fast.registry` (``nn.Linear``/``nn.Conv2d``; under exact clipping also
``nn.LayerNorm``/``nn.GroupNorm``/``nn.Embedding`` and :mod:`bpclip_fast.modules`) to clipped layers
(same ``Parameter`` objects), sets every layer's noise multiplier, replaces the loader by a private
one that follows a :class:`bpclip_fast.data.SamplingPlan` and wraps the optimizer in
:class:`DPOptimizer`, whose ``step()`` is the step boundary of the privacy analysis.

Sampling and accounting must match (DESIGN.md §2)
-------------------------------------------------
``poisson_sampling=True`` (each example joins a batch independently with rate ``q = batch_size/N``,
``batch_size·W/N`` with ``W`` processes) is what the RDP and PLD accountants analyse (add/remove
one example). ``poisson_sampling=False`` gives disjoint fixed-size batches of a data-independent
shuffle, which only the zCDP accountant analyses (parallel composition within an epoch). Any other
pairing raises: the ε printed would not be a bound for the batches actually drawn.

The accountant is stepped once per optimizer step with the effective noise multiplier of the
per-layer Gaussians, ``σ_eff = (Σ_l σ_l⁻²)^(-1/2) = σ/√L`` (one Gaussian mechanism on all L layers
concatenated: layer ``l`` adds ``N(0, σ²Δ_l²)`` to a sum whose per-example contribution is at most
``Δ_l``; rescaling each layer by ``1/Δ_l`` gives sensitivity ``√L`` against noise ``σ`` per coordinate).

Noise exactly once per step, and the step boundary
--------------------------------------------------
Every layer's noise is drawn from the Philox stream at counters (seed, t, layer), ``t`` = number of
steps taken, and is added by the first backward pass that writes a fresh gradient (in the layer op:
fused into Linear's weight-gradient GEMM at scale 1, else right after it with the mean-loss scale).
What may happen between that draw and the release, and what ``step()`` verifies before releasing
anything, is owned by :mod:`bpclip_fast.boundary` (its module docstring is the argument): one draw
per gradient (a backward landing after the gradient that held the draw was cleared — ``None`` or
zeroed — is refused, ``redraw``: it would release the batch again under one charge), no other
write to a clipped gradient, no contribution from outside the layer, each example row once, the
parameters fixed within the step, the Δ fixed at ``make_private``. A layer no backward reached in this step (an empty batch the loop skipped, an
unused branch) gets draw ``t`` inside ``step()``. A refused step discards every gradient and re-arms
draw ``t``; nothing was released, and the refusal is charged unless it is one of the two that cannot
depend on the data (module docstring of :mod:`bpclip_fast.boundary`).

Loss reduction: why the layers clip at ``grad_clip/B`` with the *actual* ``B``
-------------------------------------------------------------------------------
With ``loss_reduction="sum"`` the upstream gradient of example ``i`` at a layer is ``v_i``, a
function of example ``i`` and the public parameters only, and the layer clips it at ``C_g``.

With ``loss_reduction="mean"`` the loss of a backward over ``B`` rows is ``(1/B) Σ_i ℓ_i``, so the
upstream gradient is ``u_i = v_i/B``, and ``B`` is random under Poisson sampling. Clipping at the
fixed ``C_g/B̄`` (``B̄`` the expected batch size) would clip ``v_i`` at ``C_g·B/B̄``: a data-dependent
bound, so adding one example (``B → B+1``) would change the clipped contribution of *every other*
example in the batch, and no per-example bound ``Δ`` would cover the change
(``tests/test_engine.py::test_fixed_mean_scaling_would_move_other_examples`` exhibits it). Instead each
clipped layer uses ``d = max(B, 1)`` of the backward it is in: it clips at ``C_g/d`` (and, for
``normalize``, ``γ/d``), adds noise of std ``σΔ/d`` and multiplies ``[∇W, ∇b]`` by ``d/B̄``.

*Claim.* For a mean loss, every layer returns ``(1/B̄)(Σ_i c_i + N(0, σ²Δ²))`` where ``c_i`` is the
contribution the layer computes for example ``i`` with the *sum* loss and bounds ``(C_x, C_g)``:
a function of example ``i`` alone, ``‖c_i‖ ≤ Δ``. So the noise is exactly ``σ`` times the
sensitivity ``Δ = layer.sensitivity`` of the released sum, and ``1/B̄`` (a public constant) is
post-processing. *Proof.* The clip factors are invariant under a common positive scale ``a``:
``min(1, aC/(a n)) = min(1, C/n)``, ``1[a n ≤ aC] = 1[n ≤ C]``, ``aC/(a n + a γ) = C/(n + γ)``.
Induction from the loss down: the upstream gradient reaching a clipped layer is ``v_i/B`` (at the
top by the chain rule; below, because every backward map — activations, pooling, the clipped
layer's input gradient with its clipping Jacobian, which depends on ``x_i`` only — is linear in the
upstream gradient). With ``a = 1/B`` the layer's clipped upstream gradient is ``(1/B)·clip(v_i; C_g,
γ)``, so its weight gradient is ``(1/B)Σ_i c_i + N(0, (σΔ/B)²)``, and its input gradient is ``1/B``
times the sum-loss one, which completes the induction. Multiplying by ``B/B̄`` gives the claim.
For ``B = 0`` there is no term and ``d = 1`` gives ``N(0, σ²Δ²)/B̄``. Under gradient accumulation
each backward carries its own mean over its own rows; the sum over the micro-batches of a step is
``(1/B̄)(Σ_all c_i + N(0, σ²Δ²))`` (noise in the first only). ∎

The claim needs what ``loss_reduction="mean"`` declares (as in Opacus): the loss of each backward
is the mean over the batch dimension of per-example losses, with no other factor depending on the
batch. ``B̄`` is the loader's ``batch_size`` (``= q·N``; per process under DDP, see below).

Multi-process training (DistributedDataParallel)
------------------------------------------------
``W`` processes, rank ``r`` drawing the members of the global Poisson batch with index ``≡ r (mod
W)`` (:mod:`bpclip_fast.data`: the global batch is a Poisson sample at rate ``q`` whatever ``W``),
each with ``B̄_r = batch_size`` (the loader's per-process batch size), ``q = W·batch_size/N``. Only
rank 0's layers draw noise (``σ``; the other ranks' layers have noise multiplier 0), with the seed
broadcast from rank 0. DDP all-reduces and divides by ``W``, so every rank holds

    (1/W) Σ_r (1/B̄_r)(Σ_{i∈batch_r} c_i + [r = 0]·N(0, σ²Δ²)) = (1/(W·B̄_r))(Σ_{i∈batch} c_i + N(0, σ²Δ²)),

exactly one Gaussian of std ``σΔ`` per layer on the global clipped sum, as the accountant assumes
(one accountant, stepped identically on every rank), and exactly what a single process computes
on the union batch with ``batch_size·W`` and the same seed (``tests/test_distributed.py``). A
layer rank 0's backward did not reach gets the draw in ``step()`` on every rank, divided by ``W``,
after rank 0 broadcasts which layers those are: the same post-all-reduce value on every rank.
With ``loss_reduction="sum"`` the released gradient is the same divided by ``W`` (DDP's average),
as for any DDP model.
All of this needs every rank to pass the same dataset and the same arguments; ``make_private``
checks that in one collective and refuses otherwise (:mod:`bpclip_fast.ranks`).

Budget
------
With ``max_epsilon``, ``step()`` computes the ε the accountant would report *after* this step and
refuses (``PrivacyBudgetError``) if it exceeds ``max_epsilon``: that step's gradient is discarded,
nothing is updated, no noise is released; every allowed step, the last included, is taken (with
PLD's discretised ε, possibly one step early, never late). The
number of steps left is found once by bisection on the accountant (``Accountant.max_steps``: ε
grows with the number of steps) and cached while (σ, q, max_epsilon, δ) do not change. Charged
refusals spend the budget too, so a charged event may only happen where the budget covers its
charge (``budget.covers``): the private loader does not hand over a batch the budget cannot
charge with those drawn since the last step, and every training forward, backward pass and step
checks the budget before anything whose refusal is charged. Those ``PrivacyBudgetError`` refusals
depend only on the public accountant and batch counters, and are not charged.

Checkpoints
-----------
``engine.state_dict()`` (also stored inside ``optimizer.state_dict()``, so saving the optimizer is
enough) holds the accountant's history, the step counter and the batch counters — never the noise
seed. ``load_state_dict`` after ``make_private`` restores them and draws a **fresh** noise seed
(and Poisson sampling seed) from the OS: two continuations of one checkpoint never share a draw,
and a leaked checkpoint reveals no noise. Shuffled batches keep their permutation seed in the
state, because the rest of an interrupted epoch must come from the same permutation (an example
in one batch per epoch); the zCDP analysis does not need it secret. ``state_dict(include_secrets=
True)`` adds the seeds: the explicit, insecure opt-in for a bit-for-bit reproducible resume.
Loading an optimizer state without the privacy state into a ``DPOptimizer`` raises.
"""
from ..boundary import StepRefused
from ._common import Float64NoiseWarning, InsecureSeedWarning
from .guards import _no_check_factory  # noqa: F401  (models pickled before the package refer to it here)
from .optimizer import DPOptimizer
from .privacy_engine import PrivacyEngine

__all__ = ["PrivacyEngine", "DPOptimizer", "InsecureSeedWarning", "Float64NoiseWarning", "StepRefused"]
