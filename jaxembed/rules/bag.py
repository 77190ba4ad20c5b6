"""Sharding rules of the pooled lookup `embedding_bag` and its table gradient.

A bag pools the rows its ids read, so the bag's slots are summed away like the table's rows.
Letters: the table is `jk` (`j` vocab, `k` hidden); the ids take `ids_letters` (`a, b, ...`,
never `j` or `k`). As einsums, with `onehot(x)[..., j]` the one-hot of each id and `scale`
the per-slot factor of the combiner (`jaxembed.ragged.bag_scales`):

    dense x[*batch, l]   out[*batch, k]  = einsum('...lj,jk->...k', scale*onehot(x), weight)
    flat  x[*lead, n]    out[*lead, b, k] = einsum('...nj,...nb,jk->...bk',
                                                   scale*onehot(x), bag_of(x, lengths), weight)
    gradient             weight_grad      = einsum('...j,...k->jk', ..., out_grad)

| form | inputs | output | partial |
|---|---|---|---|
| dense forward | x, weight merged | `x_dm[:-1] + [w_dm[1]]` | rows (j) and the bag axis (l) |
| flat forward | x, lengths (shared lead), weight merged | `lead + [b] + [w_dm[1]]` | j and n |
| grad | x, out_grad (lengths) merged; weight as is | `[w_dm[0], og_dm[-1]]` | every ids axis |

"Partial" means a partial reduction by the combiner: a partial sum for sum, mean and sqrtn
(whose factors are computed where bags are whole), a partial max for max. A mesh axis that
splits the bag's slots (l, or n) leaves each shard the pooled part of its own slots; one that
splits the table's rows leaves each shard the pool of the rows it owns.

    >>> from jaxembed.rules import DistSpec
    >>> x = DistSpec((32, 8), (0, -1))                 # 32 bags of 8 slots, bags on mesh 0
    >>> weight = DistSpec((1000, 64), (1, -1))         # rows on mesh 1
    >>> embedding_bag_forward(x, weight).outputs[0]
    DistSpec(shape=(32, 64), dims_mapping=(0, -1), partial_dims=frozenset({1}))

Pure Python: this module never imports jax.
"""

from __future__ import annotations

from jaxembed.rules.embedding import HIDDEN, VOCAB, _check_table, ids_letters
from jaxembed.rules.engine import (
    DistSpec,
    SpmdInfo,
    _check_rank,
    as_dist_spec,
    dims_mapping_for,
    merge_letters,
    partial_dims_for,
)

__all__ = ["embedding_bag_forward", "embedding_bag_grad"]


def _letters(x: DistSpec, lengths: DistSpec | None) -> tuple[str, str, str]:
    """(lead letters, slot letter, bag letter or '') of the dense or the flat form."""
    if x.ndim < 1:
        raise ValueError(f"bag ids have rank >= 1 ([*batch, L] or [*lead, N]), got x {x.shape}")
    if lengths is None:
        letters = ids_letters(x.ndim)
        return letters[:-1], letters[-1], ""
    _check_rank(lengths, "lengths")
    if lengths.ndim != x.ndim or lengths.shape[:-1] != x.shape[:-1]:
        raise ValueError(
            f"lengths {lengths.shape} must be [*lead, B] with x's leading dims {x.shape[:-1]} "
            f"(x is [*lead, N] = {x.shape})"
        )
    letters = ids_letters(x.ndim + 1)
    return letters[:-2], letters[-2], letters[-1]


def embedding_bag_forward(
    x: DistSpec, weight: DistSpec, *, lengths: DistSpec | None = None
) -> SpmdInfo:
    """Forward rule of `embedding_bag`: pooled rows, partial over the rows and the slots.

    Dense form (`lengths` None): x `[*batch, l]`, out `[*batch, k]`; the bag axis `l` is
    pooled away. Flat form: x `[*lead, n]`, lengths `[*lead, b]`, out `[*lead, b, k]`; the
    slots `n` are pooled into the bags `b`. Either way out is partial over the mesh axes of
    the table's rows `j` and of the pooled slot axis.

    Args:
      x: the ids' layout, a `DistSpec` or a `(shape, dims_mapping[, partial_dims])` tuple.
      weight: the table's layout `[vocab, hidden]`, likewise.
      lengths: the flat form's bag lengths `[*lead, b]`, likewise; None for the dense form.

    Returns:
      `SpmdInfo(inputs=(x, weight) or (x, weight, lengths), outputs=(out,))`.

    Raises:
      ValueError: a dims mapping whose length is not its tensor's rank, a table not 2-D,
        scalar ids, lengths whose leading dims are not x's.
      ShardingConflictError: one mesh axis on two letters (e.g. the bags and the table's
        rows), or one letter on two mesh axes (e.g. x's and lengths' lead).

    Examples:
      Flat form, one lead block per data shard (mesh axis 0), rows on mesh axis 1:

      >>> x = DistSpec((2, 4096), (0, -1))             # ids i32[2, N]
      >>> lengths = DistSpec((2, 512), (-1, -1))       # lengths i32[2, B]
      >>> weight = DistSpec((10_000, 64), (1, -1))
      >>> info = embedding_bag_forward(x, weight, lengths=lengths)
      >>> info.inputs[2].dims_mapping, info.outputs[0]
      ((0, -1), DistSpec(shape=(2, 512, 64), dims_mapping=(0, -1, -1), partial_dims=frozenset({1})))

      The bags' axis and the table's rows cannot share a mesh axis:

      >>> embedding_bag_forward(DistSpec((32, 8), (1, -1)), weight)
      Traceback (most recent call last):
        ...
      jaxembed.rules.engine.ShardingConflictError: Multiple tensor axes [a,j] are sharded by
      the same mesh dimension [1] (a: x axis 0; j: weight axis 0); a mesh axis can split
      only one of them
    """
    x, weight = as_dist_spec(x, "x"), as_dist_spec(weight, "weight")
    lengths = None if lengths is None else as_dist_spec(lengths, "lengths")
    _check_rank(x, "x")
    _check_table(weight)
    lead, slot, bag = _letters(x, lengths)
    operands = [("x", lead + slot, x.dims_mapping)]
    if lengths is not None:
        operands.append(("lengths", lead + bag, lengths.dims_mapping))
    operands.append(("weight", VOCAB + HIDDEN, weight.dims_mapping))
    merged = merge_letters(operands)
    inputs = [
        DistSpec(x.shape, dims_mapping_for(lead + slot, merged)),
        DistSpec(weight.shape, dims_mapping_for(VOCAB + HIDDEN, merged), weight.partial_dims),
    ]
    if lengths is not None:
        inputs.append(DistSpec(lengths.shape, dims_mapping_for(lead + bag, merged)))
        out_shape = (*lengths.shape, weight.shape[1])
    else:
        out_shape = (*x.shape[:-1], weight.shape[1])
    # A shard pools only the rows it owns and the slots it holds: partial over both.
    partial = partial_dims_for(VOCAB + slot, merged) | weight.partial_dims
    out = DistSpec(out_shape, dims_mapping_for(lead + bag + HIDDEN, merged), partial)
    return SpmdInfo(tuple(inputs), (out,))


def embedding_bag_grad(
    x: DistSpec,
    weight: DistSpec,
    out_grad: DistSpec,
    *,
    lengths: DistSpec | None = None,
) -> SpmdInfo:
    """Gradient rule of `embedding_bag`: the table's gradient, born in its row layout.

    Every slot scatters its bag's `out_grad` row (times its factor) into the row it read, so
    the gradient is a sum over all ids axes: the lead / batch, the slots and (flat form) the
    bags. It is partial over every mesh axis that splits one of them. As `embedding_grad`
    with `vocab_parallel=True`: x and out_grad take their merged layout, the table keeps its
    own, and `weight_grad = [w_dm[0], og_dm[-1]]`.

    Args:
      x: the ids' layout: dense `[*batch, l]`, or flat `[*lead, n]` with `lengths`.
      weight: the table's layout `[vocab, hidden]`.
      out_grad: the output gradient's layout: `[*batch, k]` (dense) or `[*lead, b, k]`.
      lengths: the flat form's bag lengths `[*lead, b]`; None for the dense form.

    Returns:
      `SpmdInfo(inputs=(x, weight, out_grad) [+ (lengths,)], outputs=(weight_grad,))`.

    Raises:
      ValueError: a dims mapping whose length is not its tensor's rank, a table not 2-D,
        out_grad's shape not the output's.
      ShardingConflictError: e.g. a batch axis split over the mesh axis of the table's rows.

    Examples:
      Bags on mesh axis 0, rows on mesh axis 1: the gradient keeps the row split and is
      partial over the batch's mesh axis 0.

      >>> x = DistSpec((32, 8), (0, -1))
      >>> weight = DistSpec((1000, 64), (1, -1))
      >>> out_grad = DistSpec((32, 64), (-1, -1))
      >>> info = embedding_bag_grad(x, weight, out_grad)
      >>> info.inputs[2].dims_mapping, info.outputs[0]
      ((0, -1), DistSpec(shape=(1000, 64), dims_mapping=(1, -1), partial_dims=frozenset({0})))
    """
    x, weight = as_dist_spec(x, "x"), as_dist_spec(weight, "weight")
    out_grad = as_dist_spec(out_grad, "out_grad")
    lengths = None if lengths is None else as_dist_spec(lengths, "lengths")
    _check_rank(x, "x")
    _check_rank(out_grad, "out_grad")
    _check_table(weight)
    lead, slot, bag = _letters(x, lengths)
    batch_shape = x.shape[:-1] if lengths is None else lengths.shape
    if out_grad.shape != (*batch_shape, weight.shape[1]):
        raise ValueError(
            f"out_grad {out_grad.shape} must be the output's shape "
            f"{(*batch_shape, weight.shape[1])}: x {x.shape}, weight {weight.shape}"
            + ("" if lengths is None else f", lengths {lengths.shape}")
        )
    row = weight.dims_mapping[0]
    operands = [("onehot(x)", lead + slot + VOCAB, (*x.dims_mapping, row))]
    if lengths is not None:
        operands.append(("lengths", lead + bag, lengths.dims_mapping))
    operands.append(("out_grad", lead + bag + HIDDEN, out_grad.dims_mapping))
    merged = merge_letters(operands)
    inputs = [
        DistSpec(x.shape, dims_mapping_for(lead + slot, merged)),
        weight,
        DistSpec(
            out_grad.shape, dims_mapping_for(lead + bag + HIDDEN, merged), out_grad.partial_dims
        ),
    ]
    if lengths is not None:
        inputs.append(DistSpec(lengths.shape, dims_mapping_for(lead + bag, merged)))
    # Every ids axis is summed away: each mesh axis that splits one leaves a partial sum.
    partial = partial_dims_for(lead + slot + bag, merged) | out_grad.partial_dims
    weight_grad = DistSpec(weight.shape, dims_mapping_for(VOCAB + HIDDEN, merged), partial)
    return SpmdInfo(tuple(inputs), (weight_grad,))
