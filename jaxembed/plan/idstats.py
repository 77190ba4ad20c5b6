"""`id_stats`: what a sample of batches says about a collection's ids, for the planner.

The collection planner (`jaxembed.plan.collection`) models a step from the features'
shapes. Three properties of the real ids change what a step costs, and a sample of batches
measures them:

* **ids per bag**: how many of a feature's `max_ids` slots hold an id (the rest are
  padding, `-1`);
* **duplication**: how many distinct ids of a table a batch holds, against the ids it
  holds. A hot vocabulary repeats ids, so a row-sparse update touches fewer rows and the
  routed exchange sends fewer distinct ids;
* **skew**: how the distinct ids of a batch spread over a table's row shards, block or mod
  (`jaxembed.rowsharding.bucket_loads`): the busiest shard decides whether the routed
  exchange overflows its capacity.

Examples:
  >>> import numpy as np
  >>> from jaxembed.collection import FeatureConfig
  >>> features = [FeatureConfig("clicks", "item", combiner="mean", max_ids=4),
  ...             FeatureConfig("target", "item")]
  >>> batch = {"clicks": np.array([[0, 1, 1, -1], [2, 0, -1, -1]]), "target": np.array([3, 0])}
  >>> stats = id_stats([batch], features)
  >>> stats.ids_per_bag, stats.ids_per_batch, stats.unique_per_batch
  ({'clicks': 2.5, 'target': 1.0}, {'item': 7.0}, {'item': 4.0})
  >>> stats.skew("item", vocab_size=8, num_shards=2)   # ids 0-3 all on block shard 0
  {'block': 1.0, 'mod': 0.5}
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxembed.collection.config import FeatureConfig
from jaxembed.rowsharding import bucket_loads

__all__ = ["IdStats", "distinct_draws", "effective_vocab", "id_stats"]

_MAX_SAMPLES = 8  # batches whose distinct ids are kept per table, for the skew
_MAX_SAMPLE_IDS = 1 << 20  # distinct ids kept per sampled batch and table


@dataclasses.dataclass(frozen=True, eq=False)
class IdStats:
    """Ids measured from a sample of batches (`id_stats`).

    Attributes:
      num_batches: the batches measured.
      batch_size: their mean number of examples.
      ids_per_bag: per feature, the mean ids a bag (an example's row) holds.
      ids_per_batch: per table, the mean ids a batch reads from it (all its features).
      unique_per_batch: per table, the mean distinct ids among those.
      samples: per table, the distinct ids of up to 8 batches (for `skew`).
      counts: per table, how many slots of its batch each of those ids filled (the slots'
        skew, `shard_shares(..., slots=True)`); empty where not measured.
    """

    num_batches: int
    batch_size: float
    ids_per_bag: dict[str, float]
    ids_per_batch: dict[str, float]
    unique_per_batch: dict[str, float]
    samples: dict[str, tuple[np.ndarray, ...]]
    counts: dict[str, tuple[np.ndarray, ...]] = dataclasses.field(default_factory=dict)

    def duplication(self, table: str) -> float:
        """Ids per distinct id of `table` in a batch (1.0: no id repeats)."""
        unique = self.unique_per_batch.get(table, 0.0)
        return self.ids_per_batch.get(table, 0.0) / unique if unique else 1.0

    def skew(self, table: str, *, vocab_size: int, num_shards: int) -> dict[str, float]:
        """The busiest of `num_shards` row shards' share of a batch's distinct ids of
        `table`, `{"block": share, "mod": share}` (1/n is even), averaged over the sample."""
        loads = [bucket_loads(ids, vocab_size=vocab_size, num_shards=num_shards)
                 for ids in self.samples.get(table, ())]  # fmt: skip
        if not loads:
            return {"block": 1.0 / num_shards, "mod": 1.0 / num_shards}
        return {k: float(np.mean([x[k] for x in loads])) for k in ("block", "mod")}

    def shard_shares(
        self, table: str, *, vocab_size: int, num_shards: int, row_sharding: str,
        rotation: int = 0, slots: bool = False,
    ) -> np.ndarray:  # fmt: skip
        """Each row shard's share of a batch's distinct ids of `table` (with `slots`: of its
        id slots, each id counted as often as it occurs) (sums to 1), averaged over the
        sample; uniform when the sample holds none. Mod rows go to shard
        `(id + rotation) % num_shards` (`TablePlacement.rotation`)."""
        kw = dict(vocab_size=vocab_size, num_shards=num_shards, row_sharding=row_sharding,
                  rotation=rotation)  # fmt: skip
        if slots:
            loads = self.shard_loads(table, lambda count: count, **kw)
        else:
            loads = self.shard_loads(table, None, **kw)
        shares = [load / load.sum() for load in loads if load.sum() > 0]
        if not shares:
            return np.full(num_shards, 1.0 / num_shards)
        return np.mean(shares, axis=0)

    def shard_loads(
        self, table: str, weight, *, vocab_size: int, num_shards: int, row_sharding: str,
        rotation: int = 0,
    ) -> list[np.ndarray]:  # fmt: skip
        """Per sampled batch, each row shard's load: `Σ weight(count)` over the distinct ids
        of `table` it holds (`count`: the slots each filled; unmeasured counts are 1), or
        the number of those ids where `weight` is None. Block rows put id i on shard
        `i // ceil(vocab_size / num_shards)`, mod rows on `(i + rotation) % num_shards`."""
        per_shard = -(-vocab_size // num_shards)
        counts = self.counts.get(table, ())
        loads = []
        for i, ids in enumerate(self.samples.get(table, ())):
            count = counts[i] if i < len(counts) else np.ones(ids.shape, np.int64)
            keep = ids < vocab_size
            ids, count = ids[keep], count[keep]
            if row_sharding == "mod":
                owner = (ids + rotation) % num_shards
            else:
                owner = ids // per_shard
            w = None if weight is None else weight(count)
            loads.append(np.bincount(owner, weights=w, minlength=num_shards)[:num_shards])
        return loads


def _real_ids(value: Any) -> tuple[np.ndarray, int]:
    """The ids a feature's input holds (`-1` padding and slots past a bag's length dropped),
    and the number of bags (examples of a dense input)."""
    if hasattr(value, "values") and hasattr(value, "lengths"):  # a jaxembed.Ragged
        values = np.asarray(value.values)
        lengths = np.maximum(np.asarray(value.lengths), 0)
        n = values.shape[-1]
        total = np.minimum(lengths.sum(-1), n).reshape(-1)
        flat = values.reshape(-1, n)
        ids = np.concatenate([row[:t] for row, t in zip(flat, total, strict=True)] or [flat[:0, 0]])
        return ids[ids >= 0], int(np.prod(lengths.shape))
    if isinstance(value, tuple) and len(value) == 2:
        value = value[0]
    ids = np.asarray(value)
    if ids.ndim == 1:
        ids = ids[:, None]
    if ids.ndim != 2:
        raise ValueError(
            f"id_stats: a dense input must be ids [B] or [B, L], got shape {ids.shape}; "
            "pass a jaxembed.Ragged for bags of varying length"
        )
    return ids[ids >= 0], ids.shape[0]


def id_stats(batches: Iterable[Mapping[str, Any]], features: Sequence[FeatureConfig]) -> IdStats:
    """Measures ids per bag, duplication and skew from a sample of batches.

    Args:
      batches: dicts `{feature: ids [B] | ids [B, L] | (ids, weights) | Ragged}` as the
        collection reads them (negative ids: empty slots), numpy or jax arrays.
      features: the collection's features (which table each one reads).

    Returns:
      An `IdStats` for `jaxembed.plan_collection(..., id_stats=...)`.

    Raises:
      ValueError: no batches, a batch without one of the features, a malformed input.
    """
    by_name = {f.name: f for f in features}
    bag_ids: dict[str, list[float]] = {f.name: [] for f in features}
    per_table: dict[str, list[float]] = {}
    unique: dict[str, list[float]] = {}
    samples: dict[str, list[np.ndarray]] = {}
    counts: dict[str, list[np.ndarray]] = {}
    sizes = []
    for i, batch in enumerate(batches):
        missing = sorted(set(by_name) - set(batch))
        if missing:
            raise ValueError(
                f"id_stats: batch {i} has no input for features {missing} (it has "
                f"{sorted(batch)}): give every feature of the collection"
            )
        ids_of: dict[str, list[np.ndarray]] = {}
        for name, f in by_name.items():
            ids, bags = _real_ids(batch[name])
            bag_ids[name].append(ids.size / max(bags, 1))
            ids_of.setdefault(f.table, []).append(ids.astype(np.int64))
            if name == features[0].name:
                sizes.append(bags)
        for table, parts in ids_of.items():
            ids = np.concatenate(parts)
            distinct, count = np.unique(ids, return_counts=True)
            per_table.setdefault(table, []).append(float(ids.size))
            unique.setdefault(table, []).append(float(distinct.size))
            kept = samples.setdefault(table, [])
            if len(kept) < _MAX_SAMPLES:
                kept.append(distinct[:_MAX_SAMPLE_IDS])
                counts.setdefault(table, []).append(count[:_MAX_SAMPLE_IDS])
    if not sizes:
        raise ValueError("id_stats: no batches given: pass a few batches of the training data")
    return IdStats(
        num_batches=len(sizes),
        batch_size=float(np.mean(sizes)),
        ids_per_bag={k: float(np.mean(v)) for k, v in bag_ids.items()},
        ids_per_batch={k: float(np.mean(v)) for k, v in per_table.items()},
        unique_per_batch={k: float(np.mean(v)) for k, v in unique.items()},
        samples={k: tuple(v) for k, v in samples.items()},
        counts={k: tuple(v) for k, v in counts.items()},
    )


def distinct_draws(n: float, vocab: float) -> float:
    """Expected distinct values among `n` uniform draws from `vocab` values.

    >>> round(distinct_draws(10, 1e12), 6), distinct_draws(1000, 10)
    (10.0, 10.0)
    """
    if n <= 0 or vocab <= 0:
        return 0.0
    if math.isinf(vocab):
        return float(n)
    return float(vocab * -math.expm1(n * math.log1p(-1.0 / vocab))) if vocab > 1 else 1.0


def effective_vocab(ids: float, unique: float, vocab: int) -> float:
    """The vocabulary size whose uniform draws give `unique` distinct values among `ids`
    (a measured batch's), at most `vocab`: the planner's duplication model.

    >>> effective_vocab(1000, 1000, 10**6), round(effective_vocab(1000, 632.3, 10**6))
    (1000000, 1000)
    """
    if unique >= ids * (1 - 1e-9) or unique <= 0:
        return vocab
    lo, hi = unique, float(vocab)
    if distinct_draws(ids, hi) <= unique:
        return vocab
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        if distinct_draws(ids, mid) < unique:
            lo = mid
        else:
            hi = mid
    return hi
