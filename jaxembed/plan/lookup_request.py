"""A lookup's request and its layout: steps 1-4 of `jaxembed.plan.lookup`'s derivation.

`PlanRequest` is a lookup's arguments, normalized (what a plan is derived from and cached
on); `validate_request` checks it (the exchange and pool choices with `check_choices`, the
table's split, the scalars), and `lookup_layout` writes down the layouts: the table's R and K,
the output's layout, the body's (the ids restricted to the free mesh axes) and the rules'
answers (`LookupLayout`). The records the later steps fill (`LookupCollectives`,
`ExchangeChoice`) are here too, so that every step reads the same plain data.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from jax.sharding import PartitionSpec as P

from jaxembed import layout, rules
from jaxembed.plan.layouts import (
    ask_rules,
    body_layout,
    output_layout,
    table_layout,
)
from jaxembed.plan.specs import (
    check_divides,
    entries_spec,
    named,
    validate_scalars,
)
from jaxembed.plan.types import (
    BagGeometry,
)

__all__ = [
    "Exchange",
    "ExchangeChoice",
    "LookupCollectives",
    "LookupLayout",
    "PlanRequest",
    "check_choices",
    "lookup_layout",
    "validate_request",
]

Exchange = Literal["auto", "dense", "rows", "routed"]
_EXCHANGES = ("auto", "dense", "rows", "routed")
_ROUTED_POOLS = ("auto", "source", "owner")


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """A lookup's arguments, normalized: what a plan is derived from (and cached on).

    The fields are `plan_embedding_bag`'s, with the mesh as `mesh_axes` (`((name, size),
    ...)`) and `explicit` (all its axes `AxisType.Explicit`), specs as `PartitionSpec`s,
    dtypes as names, `backend` and `impl` resolved.
    """

    mesh_axes: tuple[tuple[str, int], ...]
    explicit: bool
    x_shape: tuple[int, ...]
    weight_shape: tuple[int, ...]
    x_spec: P
    weight_spec: P
    out_spec: P | None
    padding_idx: Any
    vocab_size: Any
    dtype: str
    ids_dtype: str
    exchange: str
    row_sharding: str
    backend: str
    bag: BagGeometry | None
    lengths_spec: P
    weights_spec: P
    update: bool
    capacity: int | None
    capacity_factor: float | None
    impl: str
    optimizer_slots: tuple[bool, ...]
    routed_pool: str = "auto"
    table_move: str = "none"

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.mesh_axes)

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.mesh_axes)

    @property
    def is_max(self) -> bool:
        return self.bag is not None and self.bag.combiner == "max"


@dataclasses.dataclass(frozen=True)
class LookupLayout:
    """The layouts of a lookup, from the table to the body, and the rules' answer on them.

    Attributes:
      row_axes, hidden_axes: R and K; num_rows, hidden: the table's shape; vocab_size: its
        real rows.
      x_dm: the ids' given layout, one entry per ids axis; out_batch: the output's shape
        without its hidden axis.
      out_entries, unreduced, out_spec: the output's layout as returned.
      kept, scatters, body_entries: per output batch axis, the prefix the body runs on; the
        forward's `psum_scatter`s; the layout the body produces.
      ids_entries, bag_split: the layout the ids run in; the axes splitting a flat bag's
        bags.
      forward_rule, grad_rule: the rules' answers; batch_axes: B; psum_axes: the R axes
        the forward sums over; body_out_spec: `body_entries` as a spec.
    """

    row_axes: tuple[str, ...]
    hidden_axes: tuple[str, ...]
    num_rows: int
    hidden: int
    vocab_size: int
    x_dm: list
    out_batch: tuple[int, ...]
    out_entries: list
    unreduced: tuple[str, ...]
    out_spec: P
    kept: list
    scatters: list
    body_entries: list
    ids_entries: list
    bag_split: tuple[str, ...]
    forward_rule: rules.SpmdInfo
    grad_rule: rules.SpmdInfo
    batch_axes: tuple[str, ...]
    psum_axes: tuple[str, ...]
    body_out_spec: P


@dataclasses.dataclass(frozen=True)
class LookupCollectives:
    """The operands' moves and the collectives of the forward and of the backward's first
    steps (the transposes), before any exchange."""

    operands: list
    out_moves: tuple
    grad_moves: tuple
    forward: list
    transposes: list  # the backward's: out_grad's moves, then the scatters' all_gathers
    grad_collectives: list  # out_grad's moves alone
    out_kept_local: tuple[int, ...]
    ids_local: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ExchangeChoice:
    """The exchange over B as chosen, and what it changes of the forward and the backward."""

    exchange: str
    reason: str
    candidates: tuple
    operands: list
    ids_entries: list
    ids_local: tuple[int, ...]
    forward: list
    backward: list
    buffers: int
    routed: Any
    gathers: tuple

    @property
    def touched(self) -> int:
        """The id slots one device scatters or updates with the chosen exchange."""
        return next(c.rows_scattered for c in self.candidates if c.name == self.exchange)


def check_choices(exchange: str, routed_pool: str, *, pools: bool, is_max: bool) -> None:
    """Checks `exchange` and `routed_pool` (also where no plan is made: one device).

    Raises:
      ValueError: an unknown value, or `routed_pool="owner"` for a lookup that pools nothing
        or a max bag.

    Examples:
      >>> check_choices("routed", "owner", pools=True, is_max=False)
      >>> check_choices("route", "auto", pools=True, is_max=False)
      Traceback (most recent call last):
      ...
      ValueError: exchange must be one of ('auto', 'dense', 'rows', 'routed'), got 'route'
    """
    if exchange not in _EXCHANGES:
        raise ValueError(f"exchange must be one of {_EXCHANGES}, got {exchange!r}")
    if routed_pool not in _ROUTED_POOLS:
        raise ValueError(f"routed_pool must be one of {_ROUTED_POOLS}, got {routed_pool!r}")
    if routed_pool == "owner" and (not pools or is_max):
        what = "a max bag" if is_max else "a lookup that pools nothing"
        raise ValueError(
            f"routed_pool='owner' pools partial sums at the rows' owners, which {what} does "
            "not have: pass routed_pool='auto' (or 'source')"
        )


def validate_request(
    req: PlanRequest,
) -> tuple[tuple[str, ...], tuple[str, ...], int, list]:
    """Checks the options, the table and the ids: `(R, K, vocab_size, the ids' entries)`."""
    names, sizes = req.names, req.sizes
    check_choices(req.exchange, req.routed_pool, pools=req.bag is not None, is_max=req.is_max)
    if req.row_sharding not in ("block", "mod"):
        raise ValueError(f"row_sharding must be 'block' or 'mod', got {req.row_sharding!r}")
    row_axes, hidden_axes = table_layout(req.weight_shape, req.weight_spec, names, sizes)
    vocab_size = validate_scalars(req.weight_shape[0], req.vocab_size, req.padding_idx)
    x_dm = named(layout.to_dims_mapping(req.x_spec, names, len(req.x_shape)), names)
    if layout.to_partial_dims(req.x_spec, names):
        raise ValueError("the ids cannot be unreduced (partial sums)")
    for dim, (d, e) in enumerate(zip(req.x_shape, x_dm, strict=True)):
        check_divides(
            f"ids axis {dim} of size", d, tuple(e), sizes,
            f"lay the ids out so that axis {dim} divides (e.g. x_spec without {e}), "
            "or pad the batch to {padded}.",
        )  # fmt: skip
    return row_axes, hidden_axes, vocab_size, x_dm


def lookup_layout(req: PlanRequest) -> LookupLayout:
    """Steps 1-4: validate; the output's layout; the body's (kept prefixes, scatters, the
    ids'); the rules' partial axes on it."""
    names, sizes, bag = req.names, req.sizes, req.bag
    row_axes, hidden_axes, vocab_size, x_dm = validate_request(req)
    num_rows, hidden = req.weight_shape
    x_shape = req.x_shape
    # The ids' geometry: which ids axes are output batch axes, which are pooled away.
    if bag is None:
        out_batch, given_batch = x_shape, list(x_dm)
    elif bag.form == "dense":
        out_batch, given_batch = x_shape[:-1], list(x_dm[:-1])
    else:
        out_batch, given_batch = (*x_shape[:-1], bag.num_bags), [*x_dm[:-1], ()]
    out_entries, unreduced, out_spec = output_layout(
        req.out_spec, out_batch, given_batch, hidden, row_axes, hidden_axes, names, sizes,
        req.explicit,
    )  # fmt: skip
    if req.is_max and unreduced:
        raise ValueError(
            f"out_spec {out_spec} keeps partial results unreduced, but a max-pooled bag has no "
            "partial sums: request a reduced output"
        )
    kept, scatters, body_entries = body_layout(
        out_entries, row_axes, hidden_axes, unreduced, names, scatter=not req.is_max
    )
    if bag is None:
        ids_entries, bag_split = list(kept), ()
    elif bag.form == "dense":
        ids_entries, bag_split = [*kept, ()], ()
    else:
        ids_entries, bag_split = [*kept[:-1], ()], kept[-1]
    for dim, (d, e) in enumerate(zip(x_shape, ids_entries, strict=True)):
        check_divides(f"ids axis {dim} of size", d, e, sizes, "choose another layout.")
    # The rules: partial over R in the forward, over B in the backward.
    forward_rule, grad_rule, partial, batch_axes = ask_rules(
        x_shape,
        ids_entries,
        req.weight_shape,
        (row_axes, hidden_axes),
        names,
        bag,
        kept,
    )
    scattered = {a for _, axes in scatters for a in axes}
    psum_axes = tuple(a for a in partial if a not in scattered and a not in unreduced)
    return LookupLayout(
        row_axes=row_axes, hidden_axes=hidden_axes, num_rows=num_rows, hidden=hidden,
        vocab_size=vocab_size, x_dm=x_dm, out_batch=tuple(out_batch),
        out_entries=out_entries, unreduced=unreduced, out_spec=out_spec, kept=kept,
        scatters=scatters, body_entries=body_entries, ids_entries=ids_entries,
        bag_split=bag_split, forward_rule=forward_rule, grad_rule=grad_rule,
        batch_axes=batch_axes, psum_axes=psum_axes,
        body_out_spec=entries_spec(body_entries, unreduced),
    )  # fmt: skip


# --- step 2: the operands and the collectives before the exchange ------------------------------
