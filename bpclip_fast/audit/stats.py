"""The statistics the empirical audits end in (numpy + scipy only).

Both audits turn attack scores into a lower bound on ε that holds with probability at least
``confidence`` over the randomness of the training runs, whatever the mechanism does: if the
mechanism really were (ε, δ)-DP for an ε at or above the bound, the data seen would have had
probability at most α = 1 − confidence. Each audit also reports its *power*, the largest ε its sizes
could certify at all (every guess right, or perfect separation), so that a small bound can be told
apart from a small audit.

* one run (Steinke, Nasr, Jagielski 2023): m canaries, each in the training set independently with
  probability ½; the bound comes from how many membership guesses are right.
* many runs: one canary, independent runs with and without it, one score per run; the bound comes
  from exact (Clopper–Pearson) bounds on the error rates of a threshold test.
"""

from __future__ import annotations

import math
import operator
from dataclasses import asdict, dataclass

import numpy as np
from scipy.optimize import brentq
from scipy.special import expit, logit
from scipy.stats import beta, binom

#: fractions of m guessed on by default (half "in" at the top, half "out" at the bottom)
DEFAULT_GUESS_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)


# ---------------------------------------------------------------------------------------- validation
def _int(name, x, lo=0):
    try:
        x = operator.index(x)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {x!r}") from None
    if x < lo:
        raise ValueError(f"{name} must be >= {lo}, got {x}")
    return int(x)


def _real(name, x, lo, hi, lo_open=False, hi_open=False):
    x = float(x)
    if not (math.isfinite(x) and (x > lo if lo_open else x >= lo) and (x < hi if hi_open else x <= hi)):
        raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}, "
                         f"got {x}")
    return x


def _delta(delta):
    return _real("delta", delta, 0.0, 1.0, hi_open=True)


def _alpha(confidence):
    return 1.0 - _real("confidence", confidence, 0.0, 1.0, lo_open=True, hi_open=True)


def _scores(name, x):
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D array, got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name} must be finite (found {np.count_nonzero(~np.isfinite(x))} non-finite)")
    return x


def _counts(guesses, correct, m):
    m = _int("m", m)
    guesses, correct = _int("guesses", guesses), _int("correct", correct)
    if guesses > m:
        raise ValueError(f"guesses ({guesses}) must be <= m ({m})")
    if correct > guesses:
        raise ValueError(f"correct ({correct}) must be <= guesses ({guesses})")
    return m, guesses, correct


class _Result:
    def to_dict(self) -> dict:
        """Plain JSON-able values (tuples become lists)."""
        def plain(v):
            if isinstance(v, dict):
                return {k: plain(w) for k, w in v.items()}
            if isinstance(v, (list, tuple)):
                return [plain(w) for w in v]
            return v
        return plain(asdict(self))


# ---------------------------------------------------------------------------------------- one run
def one_run_p_value(m, guesses, correct, epsilon, delta) -> float:
    """Largest probability an (ε, δ)-DP mechanism gives of ``correct`` or more right guesses.

    Theorem (Steinke, Nasr, Jagielski, "Privacy Auditing with One (1) Training Run", NeurIPS 2023,
    the main result for (ε, δ)-DP). Let each of m canaries be included independently with
    probability ½, let the mechanism be (ε, δ)-DP in each canary, and let the auditor, from the
    output alone, guess "in" or "out" on r = ``guesses`` canaries and abstain on the rest. With W
    the number of right guesses, p = e^ε / (1 + e^ε) and f(k) = P[Binom(r, p) ≥ k], for every v:

        P[W ≥ v] ≤ f(v) + 2·m·δ · max_{i = 1..v} (f(v − i) − f(v)) / i.

    At δ = 0 this is the binomial tail of ε-randomised response, which meets it with equality:
    the bound cannot be improved without assumptions on the mechanism. The value is capped at 1.
    """
    m, r, v = _counts(guesses, correct, m)
    epsilon = _real("epsilon", epsilon, 0.0, math.inf, hi_open=True)
    delta = _delta(delta)
    p = float(expit(epsilon))
    tail = float(binom.sf(v - 1, r, p))          # f(v)
    extra = 0.0
    if delta > 0.0 and v > 0:
        # f(v - i) - f(v) = P[v - i <= B < v]: summing the pmf downwards from v - 1 keeps the
        # small differences accurate where subtracting two tails near 1 would cancel.
        window = np.cumsum(binom.pmf(np.arange(v - 1, -1, -1), r, p))
        extra = 2.0 * m * delta * float(np.max(window / np.arange(1, v + 1)))
    return min(1.0, tail + extra)


def one_run_epsilon(m, guesses, correct, delta, alpha) -> float:
    """The largest ε ≥ 0 whose (ε, δ)-DP claim the p-value rejects at level α (0.0 if none is).

    Rejecting every ε' at or below the returned ε is valid: an (ε', δ)-DP mechanism is also
    (ε, δ)-DP, whose p-value is ≤ α. The p-value increases with ε (a less private mechanism makes
    more right guesses plausible), and at δ = 0 it is the binomial tail P[Binom(r, p) ≥ v], whose
    crossing of α is the one-sided Clopper–Pearson lower bound on p, in closed form. The δ term
    only adds, so that crossing brackets the δ > 0 one from above; as the δ term need not be
    monotone in ε, the bracket is scanned for the *last* crossing, which brentq then refines.
    """
    m, r, v = _counts(guesses, correct, m)
    delta = _delta(delta)
    alpha = _real("alpha", alpha, 0.0, 1.0, lo_open=True, hi_open=True)
    if v == 0:                                    # P[W >= 0] = 1: nothing is rejected
        return 0.0
    p_hi = clopper_pearson_lower(v, r, alpha)
    if p_hi <= 0.5:
        return 0.0
    eps_hi = float(logit(p_hi))
    if delta == 0.0:
        return eps_hi

    def excess(e):
        return one_run_p_value(m, r, v, e, delta) - alpha

    grid = np.linspace(0.0, eps_hi, 17)
    below = [excess(e) <= 0.0 for e in grid]
    if not below[0]:
        return 0.0
    j = max(i for i, ok in enumerate(below) if ok)
    if j == len(grid) - 1:
        return eps_hi
    eps = brentq(excess, grid[j], grid[j + 1], xtol=1e-12)
    # brentq's answer may sit a hair past the crossing; the bound must be on the rejected side
    for _ in range(8):
        if excess(eps) <= 0.0:
            return float(eps)
        eps = max(grid[j], eps - 1e-9)
    return float(grid[j])


def default_guess_counts(m) -> tuple[int, ...]:
    """The guess counts tried by default: round(f·m) for f in DEFAULT_GUESS_FRACTIONS, ≥ 1, distinct.

    Fixed before the data are seen (it depends on m only), so the Bonferroni correction over it is
    honest. It runs from a few of the most extreme scores (white-box canaries often have a small,
    very confident top) to half of all canaries. It stops at m/2: guessing k/2 "in" and k/2 "out"
    can only be all right while k/2 ≤ the number of canaries in (and out), which is ≈ m/2 by
    chance, so a larger k would promise a power (every guess right) that no audit could reach.
    """
    m = _int("m", m, lo=1)
    return tuple(sorted({max(1, round(f * m)) for f in DEFAULT_GUESS_FRACTIONS}))


def _grid(m, guess_counts, n=None):
    n = m if n is None else n
    if guess_counts is None:        # scores on only n < m canaries: the rest are abstentions
        guess_counts = {min(k, n) for k in default_guess_counts(m)}
    ks = tuple(sorted({_int("guess_counts", k, lo=1) for k in guess_counts}))
    if not ks or ks[-1] > n:
        raise ValueError(f"guess_counts must be non-empty and each <= {n} (the number of scores)")
    return ks


@dataclass(frozen=True)
class OneRunRow:
    guesses: int
    correct: int
    epsilon: float


@dataclass(frozen=True)
class OneRunResult(_Result):
    epsilon: float              #: best lower bound over the grid, valid at ``confidence``
    guesses: int                #: the guess count that gave it
    correct: int
    m: int
    delta: float
    confidence: float
    alpha_per_count: float      #: (1 - confidence) / len(table), the level of each row
    power: float                #: the bound if every guess were right (one_run_power)
    table: tuple[OneRunRow, ...]


def one_run_audit(scores, included, *, m=None, delta, confidence=0.95, guess_counts=None) -> OneRunResult:
    """One-run audit: guess on the extremes of ``scores`` (higher = more likely included) and bound
    ε from the number of right guesses.

    For each k in the grid (default :func:`default_guess_counts`), guess "in" for the ⌈k/2⌉ highest
    scores and "out" for the ⌊k/2⌋ lowest. Ties go by canary index (a stable sort): the order is
    fixed before the run, so the guesses remain a function of the output alone, as the theorem
    requires. Each k's bound is taken at level α / len(grid); by the union bound, the chance that
    *any* row overstates ε is ≤ α, so reporting the best row, chosen after seeing the data, keeps
    the confidence. (Without the correction, picking the best of several tests would inflate it.)

    ``m`` is the number of randomised canaries in the run when ``scores`` cover only some of them
    (the rest count as abstentions; the 2mδ term needs the full m); default ``len(scores)``.
    """
    scores = _scores("scores", scores)
    included = np.asarray(included)
    if included.shape != scores.shape:
        raise ValueError(f"included must have the shape of scores {scores.shape}, got {included.shape}")
    if included.dtype != bool:
        if not np.all((included == 0) | (included == 1)):
            raise ValueError("included must be boolean (or 0/1)")
        included = included.astype(bool)
    n = scores.size
    m = n if m is None else _int("m", m)
    if m < n:
        raise ValueError(f"m ({m}) must be >= the number of scores ({n})")
    delta, alpha = _delta(delta), _alpha(confidence)
    ks = _grid(m, guess_counts, n)
    a = alpha / len(ks)
    ranked = included[np.argsort(scores, kind="stable")]               # lowest score first
    right_out = np.concatenate([[0], np.cumsum(~ranked)])              # right "out" among the j lowest
    right_in = np.concatenate([[0], np.cumsum(ranked[::-1])])          # right "in" among the j highest
    rows = []
    for k in ks:
        v = int(right_in[k - k // 2] + right_out[k // 2])
        rows.append(OneRunRow(k, v, one_run_epsilon(m, k, v, delta, a)))
    best = max(rows, key=lambda row: row.epsilon)
    return OneRunResult(best.epsilon, best.guesses, best.correct, m, delta, float(confidence), a,
                        one_run_power(m, delta=delta, confidence=confidence, guess_counts=ks), tuple(rows))


def one_run_power(m, *, delta, confidence=0.95, guess_counts=None) -> float:
    """The bound :func:`one_run_audit` would give if every guess were right: the most that m canaries
    can certify at all, with the same grid and the same Bonferroni correction."""
    delta, alpha = _delta(delta), _alpha(confidence)
    ks = _grid(_int("m", m, lo=1), guess_counts)
    return max(one_run_epsilon(m, k, k, delta, alpha / len(ks)) for k in ks)


# ---------------------------------------------------------------------------------------- many runs
def _cp_upper(k, n, alpha):
    k, n = np.asarray(k), np.asarray(n)
    return np.where(k >= n, 1.0, beta.ppf(1.0 - alpha, k + 1, np.maximum(n - k, 1)))


def clopper_pearson_upper(k, n, alpha) -> float:
    """Exact one-sided upper bound u on a binomial rate: P[Binom(n, u) ≤ k] = α (u = 1 at k = n).
    P[rate > u] ≤ α whatever the rate."""
    n = _int("n", n, lo=1)
    k = _int("k", k)
    if k > n:
        raise ValueError(f"k ({k}) must be <= n ({n})")
    return float(_cp_upper(k, n, _real("alpha", alpha, 0, 1, lo_open=True, hi_open=True)))


def clopper_pearson_lower(k, n, alpha) -> float:
    """Exact one-sided lower bound l on a binomial rate: P[Binom(n, l) ≥ k] = α (l = 0 at k = 0)."""
    n = _int("n", n, lo=1)
    k = _int("k", k)
    if k > n:
        raise ValueError(f"k ({k}) must be <= n ({n})")
    alpha = _real("alpha", alpha, 0, 1, lo_open=True, hi_open=True)
    return 0.0 if k == 0 else float(beta.ppf(alpha, k, n - k + 1))


def _eps_from_rates(fpr_ub, fnr_ub, delta):
    """Both DP inequalities for the event "score ≥ τ" and its complement:
    1 − FNR ≤ e^ε FPR + δ and 1 − FPR ≤ e^ε FNR + δ. Upper bounds on the rates give lower bounds on ε."""
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.where(1 - delta - fnr_ub > 0, np.log(np.maximum(1 - delta - fnr_ub, 1e-300) / fpr_ub), 0.0)
        b = np.where(1 - delta - fpr_ub > 0, np.log(np.maximum(1 - delta - fpr_ub, 1e-300) / fnr_ub), 0.0)
    return np.maximum(0.0, a), np.maximum(0.0, b)


def _split_size(n, split, name):
    s = int(math.floor(split * n))
    if not 1 <= s <= n - 1:
        raise ValueError(f"{name} has {n} scores: too few to split into non-empty selection and "
                         f"evaluation parts at split={split}")
    return s


@dataclass(frozen=True)
class ManyRunResult(_Result):
    epsilon: float
    threshold: float            #: τ of the test "score ≥ τ ⇒ in", chosen on the selection part
    direction: str              #: which inequality gave the bound: "tpr/fpr", "tnr/fnr" or "none"
    false_positives: int        #: evaluation "out" runs with score ≥ τ
    false_negatives: int        #: evaluation "in" runs with score < τ
    fpr_upper: float
    fnr_upper: float
    n_in: int
    n_out: int
    n_eval_in: int
    n_eval_out: int
    confidence: float
    delta: float
    power: float


def many_run_audit(scores_in, scores_out, *, delta, confidence=0.95, split=0.5, rng=None) -> ManyRunResult:
    """Many-run audit of one canary by the threshold test "score ≥ τ ⇒ in".

    (ε, δ)-DP applied to the event {score ≥ τ} and to its complement gives
    1 − FNR ≤ e^ε·FPR + δ and 1 − FPR ≤ e^ε·FNR + δ, so
    ε ≥ max(log((1 − δ − FNR)/FPR), log((1 − δ − FPR)/FNR)), and the same holds with the rates
    replaced by upper bounds on them. Each rate gets a one-sided Clopper–Pearson upper bound at
    α/2: both hold together with probability ≥ 1 − α by the union bound (the in and out runs are
    independent, but the union bound needs no such assumption).

    The bounds are exact only for a τ fixed independently of the evaluated scores; a τ tuned on
    them would overfit their noise. So each side is split at random into a selection part (fraction
    ``split``) and an evaluation part; τ is picked on the selection part and the bound is computed
    on the evaluation part alone. τ is the candidate (a midpoint between adjacent selection scores)
    maximising the bound this function would report, computed on the selection part: the raw point
    estimate is infinite at every τ with a zero count, so it cannot rank them.

    Higher scores must mean "more likely in": both inequalities above favour the in runs, so scores
    oriented the other way certify nothing (negate them, deciding so before seeing them).
    """
    s_in, s_out = _scores("scores_in", scores_in), _scores("scores_out", scores_out)
    delta, alpha = _delta(delta), _alpha(confidence)
    split = _real("split", split, 0.0, 1.0, lo_open=True, hi_open=True)
    k_in, k_out = _split_size(s_in.size, split, "scores_in"), _split_size(s_out.size, split, "scores_out")
    rng = np.random.default_rng(rng)
    s_in, s_out = rng.permutation(s_in), rng.permutation(s_out)
    sel_in, ev_in = np.sort(s_in[:k_in]), s_in[k_in:]
    sel_out, ev_out = np.sort(s_out[:k_out]), s_out[k_out:]

    u = np.unique(np.concatenate([sel_in, sel_out]))
    cand = u[:-1] / 2 + u[1:] / 2 if u.size > 1 else u
    fp = k_out - np.searchsorted(sel_out, cand, side="left")
    fn = np.searchsorted(sel_in, cand, side="left")
    a, b = _eps_from_rates(_cp_upper(fp, k_out, alpha / 2), _cp_upper(fn, k_in, alpha / 2), delta)
    tau = float(cand[int(np.argmax(np.maximum(a, b)))])

    fp, fn = int(np.count_nonzero(ev_out >= tau)), int(np.count_nonzero(ev_in < tau))
    fpr_ub, fnr_ub = float(_cp_upper(fp, ev_out.size, alpha / 2)), float(_cp_upper(fn, ev_in.size, alpha / 2))
    a, b = (float(x) for x in _eps_from_rates(fpr_ub, fnr_ub, delta))
    direction = "none" if max(a, b) == 0.0 else ("tpr/fpr" if a >= b else "tnr/fnr")
    power = many_run_power(s_in.size, s_out.size, delta=delta, confidence=confidence, split=split)
    return ManyRunResult(max(a, b), tau, direction, fp, fn, fpr_ub, fnr_ub, int(s_in.size), int(s_out.size),
                         int(ev_in.size), int(ev_out.size), float(confidence), delta, power)


def many_run_power(n_in, n_out, *, delta, confidence=0.95, split=0.5) -> float:
    """The bound :func:`many_run_audit` gives under perfect separation on the evaluation part
    (no false positive, no false negative): the most these numbers of runs can certify."""
    delta, alpha = _delta(delta), _alpha(confidence)
    split = _real("split", split, 0.0, 1.0, lo_open=True, hi_open=True)
    n_in, n_out = _int("n_in", n_in, lo=1), _int("n_out", n_out, lo=1)
    e_in = n_in - _split_size(n_in, split, "n_in")
    e_out = n_out - _split_size(n_out, split, "n_out")
    a, b = _eps_from_rates(_cp_upper(0, e_out, alpha / 2), _cp_upper(0, e_in, alpha / 2), delta)
    return float(max(a, b))
