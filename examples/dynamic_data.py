"""The stream of `examples/train_dynamic.py`: raw 64-bit ids that drift by day, known clicks.

Every example has `NUM_DENSE` (4) dense features and four sparse ones, each a bag of raw ids
from a 2^62 space (uint64, hashed-looking: no id says anything about its popularity):

| feature | ids a day (ranks) | new a day | bag length | effect |
|---|---|---|---|---|
| `user` | 60,000 | 20% | 1 | bias, latent vector |
| `item` | 30,000 | 20% | 1 | bias, latent vector |
| `tag` | 2,000 | 5% | 1 to 3 | bias (mean over the bag) |
| `context` | 100 | 0% | 1 | bias |

**Popularity and drift.** Each id of a bag is a rank drawn from a Zipf law of exponent `zipf`
(1.05) over the feature's ranks (rank 0 the most popular; the continuous law's inverse CDF,
floored), then mapped to the rank's id *of the day*: on every day d >= 1 each rank
independently gets a new id with probability `new_per_day` (its generation grows by one), so
a day starts with that share of the population, popular ranks included, new. Old ids fade
instead of vanishing: on day d a draw takes the rank's id of day d - 1 with probability
`fade` (0.3), so a replaced id still gets 30% of its rank's traffic on its last day. An id is
splitmix64 of (feature, generation, rank) cut to 62 bits: distinct ranks and generations give
distinct ids (splitmix64 is a bijection; the cut to 62 bits could merge two ids with
probability ~n²/2^63, ~10^-9 here).

**The clicks.** Each id carries effects drawn from the id alone (splitmix64 of the id and a
salt, Box-Muller): a bias b(id) ~ N(0, 1) and, for users and items, a latent vector
u(id) ~ N(0, I_r / r) (r = `rank`, 4). With dense ~ N(0, 1) and v ~ N(0, σ_dense²):

    logit = bias + dense·v + Σ_f a_f·mean_{i ∈ bag_f} b(i) + γ·⟨u(user), u(item)⟩
    y ~ Bernoulli(sigmoid(logit))

so the best AUC any model can reach on an eval set (the "Bayes" AUC) is that of the true
logit on it, and is known for every day. A rare id's effects are as large as a popular one's
but seen too seldom to be learnt: that, and ids replaced every day, is what a table that holds
only `capacity` rows has to cope with.

**Splits.** `TRAIN` and `EVAL` are independent draws from the same day's distribution: the
training script trains on day d's `TRAIN` batches and evaluates on day d + 1's `EVAL` set
before training on day d + 1 (progressive validation). Everything is a function of
`(seed, split, day, step)`; numpy only (AUC and log loss come from `dlrm_data`, beside this
file). Doctests:

    >>> s = DriftingStream(seed=0)
    >>> b = s.batch(day=2, step=5, batch_size=4)
    >>> b.dense.shape, b.ids["user"].shape, b.ids["tag"].shape, b.ids["user"].dtype
    ((4, 4), (4, 1), (4, 3), dtype('uint64'))
    >>> bool((b.ids["user"] < 2**62).all()), bool((b.ids["tag"][:, 0] != PAD).all())
    (True, True)
    >>> bool((b.ids["item"] == s.batch(2, 5, 4).ids["item"]).all())   # a function of its args
    True
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import NamedTuple

import numpy as np
from dlrm_data import auc, log_loss

__all__ = [
    "EVAL",
    "FEATURES",
    "NUM_DENSE",
    "PAD",
    "TRAIN",
    "Batch",
    "DriftingStream",
    "FeatureSpec",
    "auc",
    "log_loss",
    "mix64",
    "zipf_ranks",
]

NUM_DENSE = 4
TRAIN, EVAL = 0, 1  # the two splits of a day's examples
PAD = np.uint64(2**64 - 1)
"""An empty bag slot: all 64 bits set, jaxembed's `EMPTY_ID` (int64 -1); no id is >= 2^62."""
ID_BITS = 62
_ID_MASK = np.uint64(2**ID_BITS - 1)


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
    """One sparse feature of the stream.

    Attributes:
      name: the feature (and its table).
      ranks: the ids a day: the Zipf law's support.
      new_per_day: the chance that a rank gets a new id on each day d >= 1.
      max_ids: the bag length L; bags hold 1 to L ids (uniform), then `PAD`.
      scale: a_f, the weight of the bag's mean bias in the logit.
      latent: whether its ids carry a latent vector (user and item: their dot product).
    """

    name: str
    ranks: int
    new_per_day: float
    max_ids: int = 1
    scale: float = 0.6
    latent: bool = False


FEATURES = (
    FeatureSpec("user", 60_000, 0.2, scale=0.7, latent=True),
    FeatureSpec("item", 30_000, 0.2, scale=0.7, latent=True),
    FeatureSpec("tag", 2_000, 0.05, max_ids=3, scale=0.4),
    FeatureSpec("context", 100, 0.0, scale=0.4),
)
"""The default features (the module's docstring)."""


class Batch(NamedTuple):
    """One batch: numpy arrays, row b is example b.

    Attributes:
      dense: float32 `[B, NUM_DENSE]`.
      ids: `{feature: uint64 [B, L]}` raw ids, each bag's ids first, then `PAD`.
      labels: float32 `[B]`, 0 or 1.
      logits: float64 `[B]`, the true logit of the click probability.
    """

    dense: np.ndarray
    ids: dict[str, np.ndarray]
    labels: np.ndarray
    logits: np.ndarray


# --- hashing ----------------------------------------------------------------------------------

_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64: a bijection (distinct inputs give distinct outputs).

    Examples:
      >>> len(set(mix64(np.arange(1000, dtype=np.uint64)).tolist()))
      1000
    """
    z = np.asarray(x, np.uint64)
    with np.errstate(over="ignore"):  # wrapping multiplies
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def _uniform(ids: np.ndarray, salt: int) -> np.ndarray:
    """float64 in (0, 1) from (id, salt): 53 bits of splitmix64 of the salted id."""
    bits = mix64(np.asarray(ids, np.uint64) ^ mix64(np.uint64(salt))) >> np.uint64(11)
    return (bits.astype(np.float64) + 0.5) * 2.0**-53


def _normal(ids: np.ndarray, salt: int) -> np.ndarray:
    """N(0, 1) from (id, salt), by Box-Muller of two hashed uniforms."""
    u1, u2 = _uniform(ids, 2 * salt), _uniform(ids, 2 * salt + 1)
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def zipf_ranks(rng: np.random.Generator, shape, exponent: float, ranks: int) -> np.ndarray:
    """Ranks in `[0, ranks)` (int64) from the continuous Zipf law of `exponent` (!= 1), by its
    inverse CDF: `x = (1 + u·((ranks + 1)^(1-s) - 1))^(1/(1-s))`, rank `floor(x) - 1`.

    Examples:
      >>> r = zipf_ranks(np.random.default_rng(0), 100_000, 1.05, 1000)
      >>> int(r.min()), int(r.max()) <= 999, bool((r == 0).mean() > (r == 1).mean())
      (0, True, True)
    """
    a = 1.0 - exponent
    x = (1.0 + rng.random(shape) * ((ranks + 1.0) ** a - 1.0)) ** (1.0 / a)
    return np.minimum(np.floor(x).astype(np.int64) - 1, ranks - 1)


# --- the stream -------------------------------------------------------------------------------


class DriftingStream:
    """The generative model: features, drift, effects, and the batches it draws.

    Args:
      seed: the stream's seed (ids, effects and batches).
      features: the sparse features (`FEATURES`).
      zipf: the Zipf exponent of every feature's ranks.
      fade: the chance that a draw of day d >= 1 takes its rank's id of day d - 1.
      rank: r, the latent vectors' size.
      gamma: γ, the weight of the user-item dot product.
      sigma_dense: the dense weights' scale.
      bias: the logit's constant (the click rate is about sigmoid(bias) plus the spread).

    Raises:
      ValueError: a zipf of 1 (the inverse CDF's exponent), a fade or new_per_day outside
        [0, 1], ranks that do not fit in 40 bits, a latent feature with bags of several ids.
    """

    def __init__(
        self,
        seed: int = 0,
        *,
        features: tuple[FeatureSpec, ...] = FEATURES,
        zipf: float = 1.05,
        fade: float = 0.3,
        rank: int = 4,
        gamma: float = 1.5,
        sigma_dense: float = 0.3,
        bias: float = -1.0,
    ):
        if zipf == 1.0 or zipf <= 0:
            raise ValueError(f"zipf={zipf} must be positive and not 1 (e.g. zipf=1.05)")
        if not 0.0 <= fade <= 1.0:
            raise ValueError(f"fade={fade} must be in [0, 1]")
        for f in features:
            if not 0.0 <= f.new_per_day <= 1.0 or not 1 <= f.ranks < 2**40 or f.max_ids < 1:
                raise ValueError(
                    f"feature {f.name!r}: new_per_day={f.new_per_day} must be in [0, 1], "
                    f"ranks={f.ranks} in [1, 2**40) and max_ids={f.max_ids} positive"
                )
            if f.latent and f.max_ids != 1:
                raise ValueError(
                    f"feature {f.name!r}: a latent feature's bags hold one id (max_ids=1), "
                    f"got max_ids={f.max_ids}"
                )
        self.seed, self.features = seed, {f.name: f for f in features}
        self.zipf, self.fade, self.rank, self.gamma, self.bias = zipf, fade, rank, gamma, bias
        self.v = np.random.default_rng([seed, 99]).normal(0.0, sigma_dense, NUM_DENSE)
        self._generations: dict[tuple[str, int], np.ndarray] = {}

    def _salt(self, feature: str, what: int) -> int:
        index = list(self.features).index(feature)
        return (self.seed << 16) ^ (index << 8) ^ what

    def generations(self, feature: str, day: int) -> np.ndarray:
        """int64 `[ranks]`: each rank's generation on `day` (new ids it got on days 1..day)."""
        if day <= 0:
            return np.zeros(self.features[feature].ranks, np.int64)
        got = self._generations.get((feature, day))
        if got is None:
            spec = self.features[feature]
            cut = np.uint64(int(spec.new_per_day * 2**32))
            ranks = np.arange(spec.ranks, dtype=np.uint64)
            salt = mix64(np.uint64(self._salt(feature, 1) * 1_000_003 + day))
            new = (mix64(ranks ^ salt) >> np.uint64(32)) < cut
            got = self.generations(feature, day - 1) + new
            self._generations[(feature, day)] = got
        return got

    def ids_of(self, feature: str, ranks: np.ndarray, generations: np.ndarray) -> np.ndarray:
        """uint64 ids (< 2^62) of (rank, generation) pairs of `feature`."""
        index = np.uint64(list(self.features).index(feature))
        packed = (
            (index << np.uint64(56))
            | (np.asarray(generations, np.uint64) << np.uint64(40))
            | np.asarray(ranks, np.uint64)
        )
        return mix64(packed ^ mix64(np.uint64(self.seed))) & _ID_MASK

    def day_ids(self, feature: str, day: int) -> np.ndarray:
        """uint64 `[ranks]`: every rank's id on `day` (its generation of the day)."""
        ranks = np.arange(self.features[feature].ranks)
        return self.ids_of(feature, ranks, self.generations(feature, day))

    def distinct_ids(self, feature: str, days: int) -> int:
        """How many ids `feature` can show on days 0..days: a bound on any table of every
        id ever seen (each rank's generations, plus nothing else)."""
        return int(self.features[feature].ranks + self.generations(feature, days).sum())

    def effects(self, feature: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """(b(id) float64 `[*ids]`, u(id) float64 `[*ids, r]` or None): the ids' effects."""
        ids = np.asarray(ids, np.uint64)
        b = _normal(ids, self._salt(feature, 2))
        if not self.features[feature].latent:
            return b, None
        u = np.stack([_normal(ids, self._salt(feature, 3 + j)) for j in range(self.rank)], -1)
        return b, u * self.rank**-0.5

    def _draw_ids(self, rng: np.random.Generator, feature: str, day: int, b: int) -> np.ndarray:
        spec = self.features[feature]
        ranks = zipf_ranks(rng, (b, spec.max_ids), self.zipf, spec.ranks)
        gen = self.generations(feature, day)[ranks]
        if day > 0 and self.fade > 0:
            old = rng.random(ranks.shape) < self.fade
            gen = np.where(old, self.generations(feature, day - 1)[ranks], gen)
        ids = self.ids_of(feature, ranks, gen)
        lengths = rng.integers(1, spec.max_ids + 1, size=b)
        ids[np.arange(spec.max_ids)[None, :] >= lengths[:, None]] = PAD
        return ids

    def batch(self, day: int, step: int, batch_size: int, split: int = TRAIN) -> Batch:
        """Batch `step` of `day` in split `split`: a function of its arguments.

        Args:
          day: the day (>= 0): which ids exist and how they are drawn.
          step: the batch's index within the day and split.
          batch_size: B.
          split: `TRAIN` or `EVAL`.

        Returns:
          A `Batch` of B examples.
        """
        rng = np.random.default_rng([self.seed, split, day, step])
        b = batch_size
        dense = rng.standard_normal((b, NUM_DENSE)).astype(np.float32)
        logits = self.bias + dense.astype(np.float64) @ self.v
        ids, latent = {}, []
        for name, spec in self.features.items():
            x = self._draw_ids(rng, name, day, b)
            ids[name] = x
            real = x != PAD
            bias, u = self.effects(name, x)
            logits += spec.scale * np.where(real, bias, 0.0).sum(1) / real.sum(1)
            if u is not None:
                latent.append(u[:, 0])  # the bag's one id (a latent feature's L is 1)
        for i, j in itertools.combinations(range(len(latent)), 2):
            logits += self.gamma * (latent[i] * latent[j]).sum(axis=1)
        labels = (rng.random(b) < _sigmoid(logits)).astype(np.float32)
        return Batch(dense, ids, labels, logits)

    def eval_set(self, day: int, size: int, batch_size: int) -> list[Batch]:
        """Day `day`'s held-out examples: `size` rounded up to whole batches of `EVAL`."""
        return [self.batch(day, s, batch_size, EVAL) for s in range(-(-size // batch_size))]


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))
