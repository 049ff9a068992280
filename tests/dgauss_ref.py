"""The discrete Gaussian draw of ``csrc/include/bpclip_fast/discrete_gaussian.h`` in plain Python
integers, written from its header comment (the stream's counters and key, Lemire's uniform, CKS
Algorithms 1-3 with the exponent split into integer parts), and the integer release of
``integer_release.h`` in Python floats (IEEE doubles): the references the tests compare the CPU ops
and the emulated CUDA kernels with, bit for bit."""

from __future__ import annotations

import math

from philox_ref import philox4x32_10

MASK32 = (1 << 32) - 1
MASK64 = (1 << 64) - 1
TAG_NOISE, TAG_ROUNDING = 1, 2
TRIALS, MAX_V, MAX_K, LEMIRE_RETRIES, LEMIRE_RETRIES32, SMALL_RANGE = 512, 96, 40, 16, 48, 1 << 28


class Capped(Exception):
    """A cap of the header was reached: the draw is 0."""


class Stream:
    """Element ``element``'s words: block j is Philox at counter (j, lo(element), lo(offset),
    hi(offset)) under key (lo(seed) ^ (tag << 24 | bits 32..55 of element), hi(seed))."""

    def __init__(self, seed: int, offset: int, element: int, tag: int = TAG_NOISE):
        seed, offset = seed & MASK64, offset & MASK64
        self.key = [(seed & MASK32) ^ ((tag << 24) | ((element >> 32) & 0xFFFFFF)), seed >> 32]
        self.rest = [element & MASK32, offset & MASK32, offset >> 32]
        self.block = 0
        self.words: list[int] = []
        self.bits, self.nbits = 0, 0

    def word32(self) -> int:
        if not self.words:
            self.words = philox4x32_10([self.block, *self.rest], self.key)
            self.block += 1
        return self.words.pop(0)

    def word64(self) -> int:
        hi = self.word32()
        return hi << 32 | self.word32()

    def bit(self) -> int:
        if self.nbits == 0:
            self.bits, self.nbits = self.word32(), 32
        b = self.bits & 1
        self.bits >>= 1
        self.nbits -= 1
        return b


def uniform_below(st: Stream, m: int) -> int:
    width, word, cap = (32, st.word32, LEMIRE_RETRIES32) if m <= SMALL_RANGE else (64, st.word64, LEMIRE_RETRIES)
    product = word() * m
    threshold = (1 << width) % m
    retries = 0
    while product & ((1 << width) - 1) < threshold:
        if retries == cap:
            raise Capped
        product = word() * m
        retries += 1
    return product >> width


def bernoulli_ratio(st: Stream, n: int, d: int) -> bool:
    if n == 0:
        return False
    if n == d:
        return True
    if d == 2:
        return bool(st.bit())
    return uniform_below(st, d) < n


def _exp_loop(st: Stream, step) -> bool:
    """CKS Algorithm 1: K = 1, 2, ... while ``step(K)`` (a Bernoulli(gamma / K)) succeeds; [K odd]."""
    k = 1
    while step(k):
        k += 1
        if k > MAX_K:
            raise Capped
    return k % 2 == 1


def bernoulli_exp_frac(st: Stream, n: int, d: int) -> bool:
    return _exp_loop(st, lambda k: (k == 1 or bernoulli_ratio(st, 1, k)) and bernoulli_ratio(st, n, d))


def bernoulli_exp_square(st: Stream, r: int, s: int) -> bool:
    return _exp_loop(st, lambda k: bernoulli_ratio(st, 1, 2 * k) and bernoulli_ratio(st, r, s)
                     and bernoulli_ratio(st, r, s))


def _trial(st: Stream, s: int):
    u = uniform_below(st, s)
    if not bernoulli_exp_frac(st, u, s):
        return None
    v = 0
    while bernoulli_exp_frac(st, 1, 1):
        v += 1
        if v == MAX_V:
            raise Capped
    x = u + s * v
    negative = st.bit()
    if negative and x == 0:
        return None
    q, r = divmod(abs(x - s), s)
    for _ in range(q * q // 2 + q * r // s):
        if not bernoulli_exp_frac(st, 1, 1):
            return None
    if q % 2 and not bernoulli_exp_frac(st, 1, 2):
        return None
    if not bernoulli_exp_frac(st, q * r % s, s) or not bernoulli_exp_square(st, r, s):
        return None
    return -x if negative else x


def discrete_gaussian(seed: int, offset: int, element: int, s: int) -> int:
    """N_Z(0, s^2) for ``element`` of the draw at (seed, offset); 0 for s = 0 or a capped draw."""
    if s == 0:
        return 0
    st = Stream(seed, offset, element)
    try:
        for _ in range(TRIALS):
            y = _trial(st, s)
            if y is not None:
                return y
    except Capped:
        pass
    return 0


def grid_value(x: float, multiplier: float, grid_exp: int) -> float:
    """clamp((x * multiplier) * 2^-grid_exp, +-2^52), NaN as 0, in doubles."""
    a = (x * multiplier) * math.ldexp(1.0, -grid_exp)
    if a != a:
        return 0.0
    return max(-2.0 ** 52, min(2.0 ** 52, a))


def coupled_round(a: float, word: int) -> int:
    """floor(a) + [a - floor(a) >= v], v = (word >> 11) 2^-53: floor(a - v) + 1, exactly (Python's
    fractions decide the comparison; the header gets it from doubles)."""
    from fractions import Fraction

    v = (word >> 11) * 2.0 ** -53
    whole = math.floor(a)
    return whole + (1 if Fraction(a) - whole >= Fraction(v) else 0)


def rounding_word(seed: int, offset: int, element: int) -> int:
    return Stream(seed, offset, element, TAG_ROUNDING).word64()


def integer_release_value(x: float, seed: int, offset: int, element: int, multiplier: float, grid_exp: int,
                          sigma: int, scale: float) -> float:
    """The released double of one element, before the rounding to the buffer's dtype."""
    k = coupled_round(grid_value(x, multiplier, grid_exp), rounding_word(seed, offset, element))
    y = k + discrete_gaussian(seed, offset, element, sigma)
    return (float(y) * math.ldexp(1.0, grid_exp)) * scale
