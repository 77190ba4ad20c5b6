"""Sharding rules of the embedding lookup `out = weight[x]`, its reverse and its gradient.

Letters: the ids `x` of rank n take `a, b, c, ...` (skipping `j` and `k`), the table
`weight` is `jk` (`j` vocab, `k` hidden), `out` is the ids' letters + `k`. As einsums:

    forward   out[...k]    = einsum('...j,jk->...k',  onehot(x), weight)
    gradient  weight_grad  = einsum('...j,...k->jk',  onehot(x), out_grad)

| rule | inputs | output | partial |
|---|---|---|---|
| forward | x, weight unchanged (row -1 if not vocab_parallel) | `x_dm + [w_dm[1]]` | `{w_dm[0]}` |
| reverse | `x = out_dm[:-1]`, `weight = [-1, out_dm[-1]]` | out as given | out's |
| grad | x, out_grad: merged batch; weight: row -1 unless vp | `[row, og_dm[-1]]` | batch axes |

(vp: `vocab_parallel`.) `vocab_parallel=False` reproduces Paddle's kernel-facing rules
exactly; `vocab_parallel=True`
(default) keeps the table's rows split in the forward and the gradient, so the gradient is
born in the table's own layout.

    >>> from jaxembed.rules import DistSpec, embedding_forward
    >>> x = DistSpec((4, 1024), (1, -1))
    >>> weight = DistSpec((512, 768), (0, -1))
    >>> embedding_forward(x, weight).outputs[0]
    DistSpec(shape=(4, 1024, 768), dims_mapping=(1, -1, -1), partial_dims=frozenset({0}))
"""

from __future__ import annotations

from jaxembed.rules.engine import (
    DistSpec,
    SpmdInfo,
    _check_rank,
    as_dist_spec,
    dims_mapping_for,
    merge_letters,
    partial_dims_for,
)

__all__ = ["embedding_forward", "embedding_grad", "embedding_reverse", "ids_letters"]

_IDS_ALPHABET = "abcdefghilmnopqrstuvwxyz"  # no j (vocab) and no k (hidden)
VOCAB, HIDDEN = "j", "k"


def ids_letters(ndim: int) -> str:
    """The axis letters of ids of rank `ndim`: `a, b, c, ...` without `j` and `k`.

    The rules name the ids' axes with these letters, the table `jk` (`j` vocab, `k`
    hidden) and the output the ids' letters plus `k`, so an ids axis never shares a letter
    with a table axis.

    Args:
      ndim: the ids' rank, from 0 (a scalar id) to 24.

    Returns:
      A string of `ndim` distinct letters.

    Raises:
      ValueError: a rank below 0 or above 24.

    Examples:
      >>> ids_letters(2), ids_letters(0)
      ('ab', '')
      >>> ids_letters(10)                          # j and k are skipped
      'abcdefghil'
    """
    if not 0 <= ndim <= len(_IDS_ALPHABET):
        raise ValueError(f"ids of rank {ndim} are not supported (0 to {len(_IDS_ALPHABET)})")
    return _IDS_ALPHABET[:ndim]


def _check_options(padding_idx: int, sparse: bool) -> None:
    # Paddle's rules raise for these with a row-split table; jaxembed's kernels handle both,
    # so they never change a layout. They are still checked for type.
    if isinstance(padding_idx, bool) or not isinstance(padding_idx, int):
        raise TypeError(f"padding_idx must be an int (-1 for none), got {padding_idx!r}")
    if not isinstance(sparse, bool):
        raise TypeError(f"sparse must be a bool, got {sparse!r}")


def _check_table(weight: DistSpec) -> None:
    _check_rank(weight, "weight")
    if weight.ndim != 2:
        raise ValueError(f"weight must be a 2-D table [vocab, hidden], got shape {weight.shape}")


def embedding_forward(
    x: DistSpec,
    weight: DistSpec,
    *,
    padding_idx: int = -1,
    sparse: bool = False,
    vocab_parallel: bool = True,
) -> SpmdInfo:
    """Forward rule of `out = weight[x]`.

    The output `out[*batch, H]` takes the ids' mapping plus the table's hidden entry:
    `x_dm + [w_dm[1]]`. Each shard of a row-split table looks up only its own rows (zeros
    elsewhere), so `out` is partial over the mesh axes that split the rows.

    Args:
      x: the ids' layout `[*batch]`, any rank: a `DistSpec`, or a
        `(shape, dims_mapping[, partial_dims])` tuple.
      weight: the table's layout `[vocab, hidden]`, likewise.
      padding_idx: accepted for parity with Paddle; it never changes a layout.
      sparse: accepted for parity with Paddle; it never changes a layout.
      vocab_parallel: keep the table's row split (the output is then partial over it).
        `False` is Paddle's kernel-facing variant: the table's rows are replicated first.

    Returns:
      `SpmdInfo(inputs=(x, weight), outputs=(out,))`; `out` is partial over the mesh axes
      that split the table's rows.

    Raises:
      ValueError: a dims mapping whose length is not its tensor's rank, a table not 2-D.
      ShardingConflictError: one mesh axis on two letters, or one letter on two mesh axes.

    Examples:
      Vocab parallel: ids split on mesh axis 1, the table's rows on mesh axis 0.

      >>> x = DistSpec((4, 1024), (1, -1))           # ids i32[4, 1024]
      >>> weight = DistSpec((512, 768), (0, -1))     # table f[512, 768]
      >>> embedding_forward(x, weight).outputs[0]    # partial over the row axis 0
      DistSpec(shape=(4, 1024, 768), dims_mapping=(1, -1, -1), partial_dims=frozenset({0}))
      >>> embedding_forward(x, weight, vocab_parallel=False).inputs[1].dims_mapping
      (-1, -1)

      One mesh axis cannot split both the ids and the table's rows:

      >>> embedding_forward(DistSpec((4, 1024), (0, -1)), weight)
      Traceback (most recent call last):
        ...
      jaxembed.rules.engine.ShardingConflictError: Multiple tensor axes [a,j] are sharded by
      the same mesh dimension [0] (a: x axis 0; j: weight axis 0); a mesh axis can split
      only one of them
    """
    x, weight = as_dist_spec(x, "x"), as_dist_spec(weight, "weight")
    _check_options(padding_idx, sparse)
    _check_rank(x, "x")
    _check_table(weight)
    w_dm = weight.dims_mapping if vocab_parallel else (-1, weight.dims_mapping[1])
    x_ax = ids_letters(x.ndim)
    merged = merge_letters([("x", x_ax, x.dims_mapping), ("weight", VOCAB + HIDDEN, w_dm)])
    x_out = DistSpec(x.shape, dims_mapping_for(x_ax, merged))
    w_out = DistSpec(weight.shape, dims_mapping_for(VOCAB + HIDDEN, merged), weight.partial_dims)
    # Each shard looks up only its own rows; the others' contributions are zero: partial.
    partial = partial_dims_for(VOCAB, merged) | weight.partial_dims
    out = DistSpec((*x.shape, weight.shape[1]), dims_mapping_for(x_ax + HIDDEN, merged), partial)
    return SpmdInfo((x_out, w_out), (out,))


def embedding_reverse(
    x: DistSpec,
    weight: DistSpec,
    out: DistSpec,
    *,
    padding_idx: int = -1,
    sparse: bool = False,
) -> SpmdInfo:
    """Reverse rule: the input layouts that produce a given output layout.

    Only `rank(x) == rank(out) - 1` is checked; x's and weight's own mappings are ignored.

    Args:
      x: the ids' layout `[*batch]` (only its shape is read).
      weight: the table's layout `[vocab, hidden]` (only its shape is read).
      out: the wanted output layout `[*batch, hidden]`, partial dims included.
      padding_idx: accepted for parity with Paddle; it never changes a layout.
      sparse: accepted for parity with Paddle; it never changes a layout.

    Returns:
      `SpmdInfo(inputs=(x, weight), outputs=(out,))` with `x = out_dm[:-1]`,
      `weight = [-1, out_dm[-1]]`, and `out` as given, partial dims included.

    Raises:
      ValueError: x's rank not out's rank minus one, or out's mapping not its rank.

    Examples:
      >>> x = DistSpec((4, 1024), (-1, -1))
      >>> weight = DistSpec((512, 768), (-1, -1))
      >>> out = DistSpec((4, 1024, 768), (0, -1, 1))   # batch on mesh 0, hidden on mesh 1
      >>> x_in, w_in = embedding_reverse(x, weight, out).inputs
      >>> x_in.dims_mapping, w_in.dims_mapping
      ((0, -1), (-1, 1))
    """
    x, weight = as_dist_spec(x, "x"), as_dist_spec(weight, "weight")
    out = as_dist_spec(out, "out")
    _check_options(padding_idx, sparse)
    if x.ndim != out.ndim - 1:
        raise ValueError(
            f"x's rank [{x.ndim}] must be out's rank [{out.ndim}] minus one: x {x.shape}, "
            f"out {out.shape}"
        )
    _check_rank(out, "out")
    out_ax = ids_letters(x.ndim) + HIDDEN
    merged = merge_letters([("out", out_ax, out.dims_mapping)])
    x_out = DistSpec(x.shape, dims_mapping_for(out_ax[:-1], merged))
    w_out = DistSpec(weight.shape, (-1, merged[HIDDEN]))
    return SpmdInfo((x_out, w_out), (out,))


def embedding_grad(
    x: DistSpec,
    weight: DistSpec,
    out_grad: DistSpec,
    *,
    padding_idx: int = -1,
    sparse: bool = False,
    vocab_parallel: bool = True,
) -> SpmdInfo:
    """Gradient rule: `weight_grad = einsum('...j,...k->jk', onehot(x), out_grad)`.

    onehot(x) takes `x_dm + [row]` with `row = w_dm[0]` if `vocab_parallel` else `-1`, and
    is merged with out_grad over the shared batch letters.

    Args:
      x: the ids' layout `[*batch]`.
      weight: the table's layout `[vocab, hidden]`.
      out_grad: the output gradient's layout `[*batch, hidden]`.
      padding_idx: accepted for parity with Paddle; it never changes a layout.
      sparse: accepted for parity with Paddle; it never changes a layout.
      vocab_parallel: keep the table's row split in the gradient (default); `False`
        replicates the rows, as Paddle's kernel-facing rule.

    Returns:
      `SpmdInfo(inputs=(x, weight, out_grad), outputs=(weight_grad,))`: x and out_grad take
      the merged batch mapping; weight keeps its mapping (rows replicated unless
      `vocab_parallel`); `weight_grad = [row, out_grad_dm[-1]]`, partial on every mesh axis
      that splits a merged batch axis.

    Raises:
      ValueError: a dims mapping whose length is not its tensor's rank, a table not 2-D,
        out_grad's rank not x's rank + 1.
      ShardingConflictError: e.g. a batch axis split over the mesh axis of the table's rows.

    Examples:
      The gradient is born in the table's layout, partial over the batch's mesh axis 1:

      >>> x = DistSpec((4, 1024), (1, -1))
      >>> weight = DistSpec((512, 768), (0, -1))
      >>> out_grad = DistSpec((4, 1024, 768), (1, -1, -1))
      >>> embedding_grad(x, weight, out_grad).outputs[0]
      DistSpec(shape=(512, 768), dims_mapping=(0, -1), partial_dims=frozenset({1}))
      >>> embedding_grad(x, weight, out_grad, vocab_parallel=False).outputs[0].dims_mapping
      (-1, -1)
    """
    x, weight = as_dist_spec(x, "x"), as_dist_spec(weight, "weight")
    out_grad = as_dist_spec(out_grad, "out_grad")
    _check_options(padding_idx, sparse)
    _check_rank(out_grad, "out_grad")
    _check_rank(x, "x")
    _check_table(weight)
    if out_grad.ndim != x.ndim + 1:
        raise ValueError(
            f"out_grad's rank [{out_grad.ndim}] must be x's rank [{x.ndim}] plus one: x "
            f"{x.shape}, out_grad {out_grad.shape}"
        )
    row = weight.dims_mapping[0] if vocab_parallel else -1
    batch = ids_letters(x.ndim)
    merged = merge_letters(
        [
            ("onehot(x)", batch + VOCAB, (*x.dims_mapping, row)),
            ("out_grad", batch + HIDDEN, out_grad.dims_mapping),
        ]
    )
    x_out = DistSpec(x.shape, dims_mapping_for(batch, merged))
    w_out = DistSpec(weight.shape, (row, weight.dims_mapping[1]), weight.partial_dims)
    og_out = DistSpec(
        out_grad.shape, dims_mapping_for(batch + HIDDEN, merged), out_grad.partial_dims
    )
    # The batch is summed away: every mesh axis that splits it leaves a partial sum.
    partial = partial_dims_for(batch, merged) | out_grad.partial_dims
    weight_grad = DistSpec(weight.shape, dims_mapping_for(VOCAB + HIDDEN, merged), partial)
    return SpmdInfo((x_out, w_out, og_out), (weight_grad,))
