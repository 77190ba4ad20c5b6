"""The click stream of `examples/train_dlrm.py`: a generative model whose best loss is known.

Every example has 13 dense features and 26 sparse ones, bags of 1 to `max_ids` ids over
Criteo-like tables (`jaxembed.workloads.dlrm_workload`: 20 tables, several features
sharing one), each id Zipf(1.3) over its table's rows (id = rank - 1: the hot ids are the
low ones). The click is drawn from

    logit = bias + Σ_j dense_j·v_j + Σ_f a_f·mean_{i ∈ bag_f} w_t(f)[i]
            + Σ_{(f, g) ∈ PAIRS} γ·⟨mean_{i ∈ bag_f} u_t(f)[i], mean_{i ∈ bag_g} u_t(g)[i]⟩
    y ~ Bernoulli(sigmoid(logit))

with t(f) the table feature f reads, dense ~ N(0, 1), v ~ N(0, σ_dense²), w_t[i] ~ N(0, 1),
u_t[i] ~ N(0, I_r / r) and feature scales a_f ~ σ_sparse·U(0.5, 1.5); w_t and u_t are
centred so that their mean over the ids' distribution is 0 (the click rate is then about
sigmoid(bias)).

* An id's effect belongs to its row: the features that read one table share it (scaled per
  feature), as two features reading an item table share the items. A DLRM can represent
  nothing else: its dot products give every feature of a table one function of the id.
* Only the `head` (30) most frequent ids of a table carry effects; the long tail of rare ids
  has none, and the steep Zipf(1.3) puts most draws in the head, so that what there is to
  learn is seen often enough to be learnt in a few minutes. The tail's rows are still looked
  up, pooled and trained (each rare id's few noisy updates are the model's main error).

Since p = sigmoid(logit) is known, the best log loss any model can reach and the best AUC
(that of p itself) are measured on the same eval set as the model's.

Everything is a function of `(seed, split, step)`: no files. Doctests:

    >>> m = ClickModel(scale=1 / 1024, seed=0)
    >>> b = m.batch(step=3, batch_size=4)
    >>> b.dense.shape, b.ids["C1"].shape, b.labels.shape, len(b.ids)
    ((4, 13), (4, 20), (4,), 26)
    >>> bool((b.ids["C1"] == m.batch(3, 4).ids["C1"]).all())   # a function of the step
    True
    >>> auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1]))
    0.75
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxembed.workloads import dlrm_workload, zipf_ids

__all__ = ["NUM_DENSE", "PAIRS", "Batch", "ClickModel", "auc", "log_loss"]

NUM_DENSE = 13
PAIRS = (("C1", "C2"), ("C5", "C8"), ("C6", "C9"), ("C13", "C19"))
"""The feature pairs whose latent vectors interact (what DLRM's dot interaction is for): of
small tables, whose rows are seen often enough for a second-order effect to be learnt."""

TRAIN, EVAL = 0, 1  # the two streams (splits) of examples


class Batch(NamedTuple):
    """One batch: numpy arrays, row b is example b.

    Attributes:
      dense: float32 `[B, 13]`.
      ids: `{feature: int32 [B, max_ids]}`, each bag's ids first, then -1 (empty slots).
      labels: float32 `[B]`, 0 or 1.
      logits: float64 `[B]`, the true logit of the click probability.
    """

    dense: np.ndarray
    ids: dict[str, np.ndarray]
    labels: np.ndarray
    logits: np.ndarray


class ClickModel:
    """The generative model: tables, features, effects, and the batches it draws.

    Args:
      scale: the factor on Criteo's cardinalities (`dlrm_workload`; 1/8 gives 10 to
        1,266,403 rows, 4.2M in all).
      seed: the model's and the batches' seed.
      num_features: keep the first this many of the 26 features (and the tables they read;
        small tests use a few).
      max_ids: the bag capacity L; bag lengths are uniform in `[1, max_ids]`.
      zipf: the ids' Zipf exponent.
      head: the ids of each table with an effect (the most frequent ones).
      pairs: the feature pairs that interact (those of `features`).
      sigma_dense, sigma_sparse, gamma, rank, bias: the effect sizes (module docstring).

    Attributes:
      tables: `{table: rows}`; features: `{feature: table}`, in Criteo's order C1..C26;
      pairs: the interacting pairs among them.
    """

    def __init__(
        self,
        scale: float = 1 / 8,
        seed: int = 0,
        *,
        num_features: int = 26,
        max_ids: int = 20,
        zipf: float = 1.3,
        head: int = 30,
        pairs: tuple = PAIRS,
        sigma_dense: float = 0.25,
        sigma_sparse: float = 0.8,
        gamma: float = 1.5,
        rank: int = 4,
        bias: float = -1.0,
    ):
        w = dlrm_workload(batch_size=1, scale=scale)
        if not 1 <= num_features <= len(w.features):
            raise ValueError(f"num_features must be in [1, 26], got {num_features}")
        self.features = {f.name: f.table for f in w.features[:num_features]}
        self.tables = {t.name: t.rows for t in w.tables if t.name in self.features.values()}
        self.pairs = tuple((f, g) for f, g in pairs if f in self.features and g in self.features)
        self.seed, self.max_ids, self.zipf, self.head = seed, max_ids, zipf, head
        self.gamma, self.bias = gamma, bias
        rng = np.random.default_rng([seed, 99])
        self.v = rng.normal(0.0, sigma_dense, NUM_DENSE)
        self.a = {f: sigma_sparse * rng.uniform(0.5, 1.5) for f in self.features}
        # w_f and u_f over a table's first `head` ids, then a 0 for every tail id.
        # w_t and u_t over a table's first `head` ids, then a 0 for every tail id.
        self.w, self.u = {}, {}
        for t, rows in self.tables.items():
            h = min(head, rows)
            pmf = np.arange(1.0, h + 1) ** -zipf  # ∝ P(id) for the ids < h (id = rank - 1)
            w = rng.normal(0.0, 1.0, h)
            self.w[t] = np.append(w - pmf @ w / pmf.sum(), 0.0)  # E[w_t[id]] = 0 over the ids
            u = rng.normal(0.0, rank**-0.5, (h, rank))
            self.u[t] = np.vstack([u - pmf @ u / pmf.sum(), np.zeros(rank)])

    def _effect_index(self, table: str, ids: np.ndarray) -> np.ndarray:
        """Index into w_t / u_t: the id for head ids, the trailing 0 for tail and empty."""
        h = self.w[table].shape[0] - 1
        return np.where((ids >= 0) & (ids < h), ids, h)

    def batch(self, step: int, batch_size: int, split: int = TRAIN) -> Batch:
        """Batch `step` of stream `split` (`TRAIN` or `EVAL`): a function of its arguments."""
        rng = np.random.default_rng([self.seed, split, step])
        b, cap = batch_size, self.max_ids
        dense = rng.standard_normal((b, NUM_DENSE)).astype(np.float32)
        logits = self.bias + dense.astype(np.float64) @ self.v
        ids, pooled_u = {}, {}
        for f, t in self.features.items():
            lengths = rng.integers(1, cap + 1, size=b)
            x = zipf_ids(rng, b * cap, self.tables[t], self.zipf).reshape(b, cap)
            x[np.arange(cap)[None, :] >= lengths[:, None]] = -1
            ids[f] = x
            k = self._effect_index(t, x)
            logits += self.a[f] * self.w[t][k].sum(axis=1) / lengths
            pooled_u[f] = self.u[t][k].sum(axis=1) / lengths[:, None]
        for f, g in self.pairs:
            logits += self.gamma * (pooled_u[f] * pooled_u[g]).sum(axis=1)
        labels = (rng.random(b) < _sigmoid(logits)).astype(np.float32)
        return Batch(dense, ids, labels, logits)

    def eval_set(self, size: int, batch_size: int) -> list[Batch]:
        """The eval set: `size` examples of the `EVAL` stream in batches of `batch_size`."""
        return [self.batch(s, batch_size, EVAL) for s in range(-(-size // batch_size))]


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def log_loss(logits: np.ndarray, labels: np.ndarray) -> float:
    """Mean logistic loss of `logits` for 0/1 `labels`, in float64: log(1 + e^z) - y·z.

    Examples:
      >>> round(log_loss(np.array([0.0, 2.0]), np.array([1, 0])), 4)   # (log 2 + 2.1269) / 2
      1.41
    """
    z = np.asarray(logits, np.float64)
    return float(np.mean(np.logaddexp(0.0, z) - np.asarray(labels, np.float64) * z))


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """The area under the ROC curve: P(score of a positive > score of a negative), ties 1/2.

    Rank based (Mann-Whitney U with average ranks for ties), O(n log n).

    Raises:
      ValueError: labels that are all 0 or all 1.

    Examples:
      >>> auc(np.array([0.5, 0.5, 0.9]), np.array([0, 1, 1]))   # (1/2 + 1) / 2
      0.75
    """
    scores = np.asarray(scores, np.float64).ravel()
    pos = np.asarray(labels).ravel() > 0.5
    n1 = int(pos.sum())
    n0 = pos.size - n1
    if n1 == 0 or n0 == 0:
        raise ValueError(f"AUC needs both classes, got {n1} positives and {n0} negatives")
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    average_rank = np.cumsum(counts) - (counts - 1) / 2.0  # 1-based, ties share their mean
    u = average_rank[inverse][pos].sum() - n1 * (n1 + 1) / 2.0
    return float(u / (n1 * n0))
