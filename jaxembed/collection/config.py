"""`TableConfig` and `FeatureConfig`: what a collection of embedding tables holds and reads.

A recommender model reads many sparse features (user id, the last items clicked, ...), each
a bag of ids per example, from tables of very different sizes; several features may share a
table. A table's **placement** says where its rows live on the mesh:

| placement | over `axes` (default: the whole mesh) |
|---|---|
| `"replicated"` | whole on every device (data parallel) |
| `"table"` | whole on one device; different tables on different devices |
| `"rows"` | rows split over the devices (`row_sharding` block or mod) |
| `"columns"` | the hidden axis split over the devices |
| `"table_rows"` | rows over `within`, tables on positions of `across`: `axes=(across, within)` |
| `"auto"` | chosen by `jaxembed.plan_collection` |
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxembed.dynamic.config import DynamicTableConfig
from jaxembed.ragged import COMBINERS

__all__ = [
    "DTYPES",
    "DYNAMIC_PLACEMENTS",
    "PLACEMENTS",
    "ROW_SHARDINGS",
    "FeatureConfig",
    "TableConfig",
    "check_configs",
]

PLACEMENTS = ("replicated", "table", "rows", "columns", "table_rows", "auto")
DYNAMIC_PLACEMENTS = ("rows", "table", "replicated", "auto")
"""A dynamic table's placements: its rows reset where they live, whole rows (block rows, one
device's, or every device's), and its remap state split with them (`"rows"`) or whole."""
ROW_SHARDINGS = ("block", "mod", "auto")
"""A table's `row_sharding`: `"auto"` is the planner's choice from the ids (block without one)."""
DTYPES = ("float32", "bfloat16", "float16", "float64")  # a table's rows are trained: floats


def _axes(name: str, axes: Any) -> tuple[str, ...] | None:
    if axes is None:
        return None
    out = (axes,) if isinstance(axes, str) else axes
    if not isinstance(out, Sequence) or not all(isinstance(a, str) and a for a in out):
        raise TypeError(
            f"table {name!r}: axes must be None, a mesh axis name or a sequence of them, like "
            f"axes='model' or axes=('data', 'model'), got {axes!r}"
        )
    if len(set(out)) != len(out):
        raise ValueError(f"table {name!r}: axes {tuple(out)} name a mesh axis twice")
    return tuple(out)


def _dtype(name: str, dtype: Any) -> np.dtype:
    """The canonical dtype of a table's rows (`jnp.dtype`: `"bfloat16"` is a name too)."""
    try:
        canonical = jnp.dtype(dtype) if dtype is not None else None  # None would be float64
    except (TypeError, ValueError):
        canonical = None
    if canonical is None or canonical.name not in DTYPES:
        got = f"{dtype!r}" if canonical is None else f"{dtype!r} ({canonical.name})"
        raise TypeError(
            f"table {name!r}: dtype must be a float dtype, one of {DTYPES} (a type like "
            f"jnp.bfloat16 or its name), got {got}: the rows are trained by gradients, so use "
            "dtype='float32', or 'bfloat16' to halve their memory"
        )
    return canonical


@dataclasses.dataclass(frozen=True)
class TableConfig:
    """One embedding table of a collection.

    Attributes:
      name: the table's name (unique in the collection).
      vocab_size: its rows (ids in `[0, vocab_size)`).
      dim: the embedding size.
      placement: one of `PLACEMENTS` (see the module's table); `"auto"` lets the planner
        (`jaxembed.plan_collection`) choose.
      axes: the mesh axes the placement uses: default the whole mesh (for `"table_rows"`,
        `(across, within)`: default the mesh's first two axes).
      row_sharding: `"block"` or `"mod"` for split rows (see `jaxembed.rowsharding`), or
        `"auto"`: `jaxembed.plan_collection` chooses from its `id_stats` (mod rows where the
        sample's busiest block shard holds clearly more distinct ids), whatever the
        placement; without a plan, or without a sample of the table's ids, block rows.
      initializer: a Flax initializer `(key, shape, dtype) -> array` (default: Flax's
        embedding initializer, as `nnx.Embed`).
      dtype: the parameter's dtype, one of `DTYPES` (`"float32"`, `"bfloat16"`,
        `"float16"`, `"float64"`), as a type or its name; kept as its canonical `np.dtype`.
      dynamic: a `jaxembed.dynamic.DynamicTableConfig` for a dynamic table (raw 64-bit ids,
        admission, eviction; `jaxembed.optim.dynamic_collection`), else None. Its
        `vocab_size` is its capacity; it is placed `"rows"` (block rows) or `"replicated"`
        (`"auto"`: the planner chooses between the two), in a stack of its own.

    Raises:
      ValueError: an empty name, a vocab_size or dim that is not a positive int, an unknown
        placement or row_sharding, an axis named twice, a dynamic table whose vocab_size is
        not its capacity or whose placement or row sharding it does not support.
      TypeError: axes that are not mesh axis names, an initializer that is not callable, a
        dtype that is not a float dtype of `DTYPES`.

    Examples:
      >>> TableConfig("item", vocab_size=1_000_000, dim=64, placement="rows")
      TableConfig(name='item', vocab_size=1000000, dim=64, placement='rows', ...)
    """

    name: str
    vocab_size: int
    dim: int
    placement: str = "auto"
    axes: Any = None
    row_sharding: str = "block"
    initializer: Callable[..., Any] | None = dataclasses.field(default=None, compare=False)
    dtype: Any = np.float32
    dynamic: DynamicTableConfig | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a table needs a non-empty str name, got {self.name!r}")
        for what, value in (("vocab_size", self.vocab_size), ("dim", self.dim)):
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise ValueError(
                    f"table {self.name!r}: {what} must be a positive int, got {value!r}"
                )
        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"table {self.name!r}: placement must be one of {PLACEMENTS}, got "
                f"{self.placement!r}"
            )
        if self.row_sharding not in ROW_SHARDINGS:
            raise ValueError(
                f"table {self.name!r}: row_sharding must be one of {ROW_SHARDINGS}, got "
                f"{self.row_sharding!r}"
            )
        if self.initializer is not None and not callable(self.initializer):
            raise TypeError(
                f"table {self.name!r}: initializer must be a callable (key, shape, dtype) -> "
                f"array, like jax.nn.initializers.normal(0.01), or None, got {self.initializer!r}"
            )
        object.__setattr__(self, "axes", _axes(self.name, self.axes))
        object.__setattr__(self, "dtype", _dtype(self.name, self.dtype))
        if self.dynamic is not None:
            self._check_dynamic()

    def _check_dynamic(self) -> None:
        d = self.dynamic
        if not isinstance(d, DynamicTableConfig):
            raise TypeError(
                f"table {self.name!r}: dynamic must be a jaxembed.dynamic.DynamicTableConfig or "
                f"None, got {type(d).__name__}"
            )
        if self.vocab_size != d.capacity:
            raise ValueError(
                f"table {self.name!r}: a dynamic table's rows are its capacity, but "
                f"vocab_size={self.vocab_size} and dynamic.capacity={d.capacity}: pass "
                f"vocab_size={d.capacity}"
            )
        if self.placement not in DYNAMIC_PLACEMENTS:
            raise ValueError(
                f"table {self.name!r}: a dynamic table is placed 'rows', 'table', 'replicated' "
                f"or 'auto', got placement={self.placement!r} (its reset rows are written where "
                "the rows live: in block rows, or whole on one device or on every device)"
            )
        if self.row_sharding == "mod":
            raise ValueError(
                f"table {self.name!r}: a dynamic table's rows are split in blocks, got "
                f"row_sharding={self.row_sharding!r}: pass row_sharding='block'"
            )


@dataclasses.dataclass(frozen=True)
class FeatureConfig:
    """One sparse feature: the table it reads and how its bag is pooled.

    Attributes:
      name: the feature's name: the key of the batch and of the outputs.
      table: the name of the table it reads.
      combiner: `"sum"`, `"mean"`, `"sqrtn"` or `"max"` pool a bag into `[B, dim]`; None
        keeps the ids' rows unpooled, `[B, L, dim]` (a sequence feature, as TorchRec's
        `EmbeddingCollection`).
      max_ids: the bag capacity L this feature's dense input `[B, L]` has (for the planner's
        estimates; inputs carry their own shapes). Default 1.
      weighted: the feature's input carries per-id weights, `(ids, weights)` (for the
        planner's estimates, as `max_ids` is; TorchRec's `is_weighted`). A lookup whose
        features are all unweighted sums (or unpooled) moves no per-slot factors, so
        `jaxembed.plan_collection` prices such a call without them; the inputs decide what
        runs, and weights given to a feature marked unweighted are still applied.

    Raises:
      ValueError: an empty name, an unknown combiner, a max_ids that is not a positive int,
        weighted=True with combiner "max" (max pooling takes no weights).
      TypeError: a table that is not a table's name (e.g. the `TableConfig` itself), a
        weighted that is not a bool.

    Examples:
      >>> FeatureConfig("clicked_items", table="item", combiner="mean", max_ids=50)
      FeatureConfig(name='clicked_items', table='item', combiner='mean', max_ids=50, weighted=False)
      >>> FeatureConfig("query_terms", table="word", max_ids=8, weighted=True).weighted
      True
    """

    name: str
    table: str
    combiner: str | None = "sum"
    max_ids: int | None = None
    weighted: bool = False

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a feature needs a non-empty str name, got {self.name!r}")
        if not isinstance(self.table, str) or not self.table:
            fix = (
                f"table={self.table.name!r}"
                if isinstance(self.table, TableConfig)
                else "table='item'"
            )
            raise TypeError(
                f"feature {self.name!r}: table must be the name of a table (a non-empty str), "
                f"like {fix}, got {self.table!r}"
            )
        if self.combiner is not None and self.combiner not in COMBINERS:
            raise ValueError(
                f"feature {self.name!r}: combiner must be one of {COMBINERS} or None "
                f"(unpooled), got {self.combiner!r}"
            )
        if self.max_ids is not None and (
            isinstance(self.max_ids, bool)
            or not isinstance(self.max_ids, int | np.integer)
            or self.max_ids < 1
        ):
            raise ValueError(
                f"feature {self.name!r}: max_ids must be a positive int, got {self.max_ids!r}"
            )
        if not isinstance(self.weighted, bool | np.bool_):
            raise TypeError(
                f"feature {self.name!r}: weighted must be a bool (True when the input is "
                f"(ids, weights)), got {self.weighted!r} of type {type(self.weighted).__name__}"
            )
        object.__setattr__(self, "weighted", bool(self.weighted))
        if self.weighted and self.combiner == "max":
            raise ValueError(
                f"feature {self.name!r}: per-id weights do not apply to combiner='max': pass "
                "weighted=False, or use combiner 'sum', 'mean' or 'sqrtn'"
            )

    @property
    def pooled(self) -> bool:
        return self.combiner is not None


def check_configs(
    tables: Sequence[TableConfig], features: Sequence[FeatureConfig]
) -> dict[str, TableConfig]:
    """Raises for duplicate names and features reading unknown tables; returns tables by name."""
    by_name: dict[str, TableConfig] = {}
    for t in tables:
        if not isinstance(t, TableConfig):
            raise TypeError(f"tables must be TableConfig, got {t!r}")
        if t.name in by_name:
            raise ValueError(f"two tables are named {t.name!r}: table names must be unique")
        by_name[t.name] = t
    seen = set()
    for f in features:
        if not isinstance(f, FeatureConfig):
            raise TypeError(f"features must be FeatureConfig, got {f!r}")
        if f.name in seen:
            raise ValueError(f"two features are named {f.name!r}: feature names must be unique")
        seen.add(f.name)
        if f.table not in by_name:
            raise ValueError(
                f"feature {f.name!r} reads table {f.table!r}, which is not in the collection "
                f"(tables: {sorted(by_name)})"
            )
    if not features:
        raise ValueError("a collection needs at least one feature")
    return by_name
