"""`LookupOptions`: the keyword options of a lookup, in one frozen object.

`embedding`, `embedding_bag` and `RowSparseOptimizer.update` take their options as keywords
(users call them so); each builds one `LookupOptions` and passes it down, so the functions
below the public ones take `options` instead of twenty keywords, and a new option is added
in one place.

Examples:
  >>> options = LookupOptions(vocab_size=50_000, row_sharding="mod")
  >>> options.vocab_of(50_048), options.plan_kwargs()["row_sharding"]
  (50000, 'mod')
  >>> options.replace(function="embedding_bag").function
  'embedding_bag'
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import PartitionSpec as P

__all__ = ["LookupOptions"]


@dataclasses.dataclass(frozen=True)
class LookupOptions:
    """What a lookup was asked to do, besides its arrays (see `jaxembed.embedding`).

    Attributes:
      padding_idx, vocab_size, mesh, x_spec, weight_spec, out_spec, exchange, row_sharding,
        capacity, capacity_factor, return_stats, impl: as `jaxembed.embedding` takes them
        (`exchange` already resolved from the old name `gradient_exchange`).
      combiner, include_last_offset, check_ids, routed_pool: the bag lookup's
        (`jaxembed.embedding_bag`); `combiner` is None for a lookup that pools nothing.
      x_hint: a layout for the ids used where it divides (the Flax modules' inputs).
      function, table_advice, ids_advice: how the caller's own API words the warnings.

    The values are checked by the plan (`jaxembed.plan_embedding`), with its messages, and
    the scalars against the table by `jaxembed.kernels.common.validate_scalars`.
    """

    padding_idx: int | None = None
    vocab_size: int | None = None
    mesh: Any = None
    x_spec: P | None = None
    weight_spec: P | None = None
    out_spec: P | None = None
    exchange: str = "auto"
    row_sharding: str = "block"
    capacity: int | None = None
    capacity_factor: float | None = None
    return_stats: bool = False
    impl: str = "auto"
    combiner: str | None = None
    include_last_offset: bool = False
    check_ids: bool = True
    routed_pool: str = "auto"
    x_hint: P | None = None
    function: str = "embedding"
    table_advice: str | None = None
    ids_advice: str | None = None

    def replace(self, **changes: Any) -> LookupOptions:
        """A copy with `changes` (`dataclasses.replace`)."""
        return dataclasses.replace(self, **changes)

    def vocab_of(self, num_rows: int) -> int:
        """The real vocabulary of a table of `num_rows` rows: `vocab_size`, else all rows."""
        return num_rows if self.vocab_size is None else self.vocab_size

    def plan_kwargs(self) -> dict[str, Any]:
        """The plan's keywords that come from the options alone (not the exchange, the
        layouts or the arrays' shapes and dtypes, which each caller resolves)."""
        return dict(
            padding_idx=self.padding_idx,
            vocab_size=self.vocab_size,
            row_sharding=self.row_sharding,
            capacity=self.capacity,
            capacity_factor=self.capacity_factor,
            impl=self.impl,
        )

    def layout_kwargs(self) -> dict[str, Any]:
        """The keywords of `jaxembed.kernels.common.resolve_layouts` besides the arrays."""
        return dict(
            x_spec=self.x_spec,
            weight_spec=self.weight_spec,
            x_hint=self.x_hint,
            function=self.function,
            table_advice=self.table_advice,
            ids_advice=self.ids_advice,
        )
