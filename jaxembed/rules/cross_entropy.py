"""Sharding rules of the tied-head cross-entropy `loss = CE(hidden @ table.T, labels)`.

Letters: the tokens of `hidden` (rank n + 1) take `ids_letters(n)` (`a, b, ...`), its last
axis is `k` (hidden); the table is `jk` (`j` vocab, `k` hidden); labels and the per-token loss
carry the tokens' letters. As einsums:

    logits[...j]  = einsum('...k,jk->...j', hidden, table)    partial over K
    loss[...]     = logsumexp_j(logits) - logits[label] ...   j reduced over R by the kernel
    hidden_grad   = einsum('...j,jk->...k', dlogits, table)   partial over R
    table_grad    = einsum('...j,...k->jk', dlogits, hidden)  partial over the token axes B

with R the mesh axes splitting the table's rows and K those splitting its hidden axis.

The table never moves. A token axis of `hidden` split over a mesh axis of R or K cannot stay
split (one mesh axis would split two letters, Paddle's conflict): that mesh axis is dropped
from the tokens, and `hidden` (small against the table) is gathered over it instead. Its
hidden axis takes the table's K. Labels take the tokens' layout of `hidden`.

    >>> from jaxembed.rules.engine import DistSpec
    >>> hidden = DistSpec((8, 16, 64), (0, -1, -1))    # tokens on mesh axis 0
    >>> table = DistSpec((1024, 64), (1, -1))          # vocab split on mesh axis 1
    >>> loss, logits = cross_entropy_forward(hidden, table).outputs
    >>> logits.dims_mapping, loss.dims_mapping
    ((0, -1, 1), (0, -1))
    >>> [g.partial_dims for g in cross_entropy_grad(hidden, table).outputs]
    [frozenset({1}), frozenset({0})]

Pure Python: this module never imports jax.
"""

from __future__ import annotations

from jaxembed.layout import DimsEntry, entry_mesh_axes, normalize_entry
from jaxembed.rules.embedding import HIDDEN, VOCAB, ids_letters
from jaxembed.rules.engine import DistSpec, SpmdInfo, _check_rank, as_dist_spec, einsum_rule

__all__ = ["cross_entropy_forward", "cross_entropy_grad"]


def _kernel_layouts(
    hidden: DistSpec, table: DistSpec, labels: DistSpec | None
) -> tuple[DistSpec, DistSpec, DistSpec]:
    """The layouts the kernel runs in: `hidden` and `labels` moved to fit the table."""
    _check_rank(hidden, "hidden")
    _check_rank(table, "table")
    if table.ndim != 2:
        raise ValueError(f"table must be a 2-D table [vocab, hidden], got shape {table.shape}")
    if hidden.ndim < 1 or hidden.shape[-1] != table.shape[1]:
        raise ValueError(
            f"hidden {hidden.shape} must end in the table's hidden size {table.shape[1]} "
            f"(table {table.shape}): hidden is [*tokens, {table.shape[1]}]"
        )
    if table.partial_dims or hidden.partial_dims:
        raise ValueError("hidden and table cannot hold partial sums: reduce them first")
    tokens = hidden.shape[:-1]
    if labels is not None:
        _check_rank(labels, "labels")
        if labels.shape != tokens:
            raise ValueError(
                f"labels {labels.shape} must have the shape of hidden's tokens {tokens} "
                f"(hidden {hidden.shape})"
            )
    table_axes = {a for e in table.dims_mapping for a in entry_mesh_axes(e)}
    token_dm: list[DimsEntry] = []
    for entry in hidden.dims_mapping[:-1]:
        kept: list[int] = []
        for a in entry_mesh_axes(entry):  # the longest prefix the table leaves free
            if a in table_axes:
                break
            kept.append(a)
        token_dm.append(normalize_entry(tuple(kept)))
    hidden_k = DistSpec(hidden.shape, (*token_dm, table.dims_mapping[1]))
    labels_k = DistSpec(tokens, tuple(token_dm))
    return hidden_k, table, labels_k


def cross_entropy_forward(
    hidden: DistSpec, table: DistSpec, labels: DistSpec | None = None
) -> SpmdInfo:
    """Forward rule of the tied-head cross-entropy.

    Args:
      hidden: the layout of `hidden[*tokens, H]`.
      table: the layout of the table `[V, H]`; it is never changed.
      labels: the layout of `labels[*tokens]` (default: that of hidden's tokens).

    Returns:
      `SpmdInfo(inputs=(hidden, table, labels), outputs=(loss, logits))`. The inputs are the
      layouts the kernel runs in. `logits[*tokens, V]` is each device's block: its vocab axis
      is split over R (the axes the softmax statistics are combined over) and it is partial
      over K. `loss[*tokens]` has the tokens' layout and no partial dims.

    Raises:
      ValueError: ranks that do not match the mappings, a table not 2-D, a hidden size
        different from the table's, labels not shaped like hidden's tokens, partial inputs.

    Examples:
      Tokens split over mesh axes 0 and 1, vocab over mesh axis 1: the tokens give up mesh
      axis 1 (`hidden` is gathered over it), the table stays.

      >>> hidden = DistSpec((8, 16, 64), (0, 1, -1))   # f[B, S, H]
      >>> table = DistSpec((1024, 64), (1, -1))        # f[V, H], vocab on mesh axis 1
      >>> info = cross_entropy_forward(hidden, table)
      >>> info.inputs[0].dims_mapping                  # the kernel's hidden layout
      (0, -1, -1)
      >>> loss, logits = info.outputs
      >>> loss.dims_mapping, logits.dims_mapping       # logits [B, S, V/R] blocks
      ((0, -1), (0, -1, 1))
    """
    hidden, table = as_dist_spec(hidden, "hidden"), as_dist_spec(table, "table")
    labels = None if labels is None else as_dist_spec(labels, "labels")
    hidden_k, table, labels_k = _kernel_layouts(hidden, table, labels)
    tok = ids_letters(hidden.ndim - 1)
    info = einsum_rule(
        f"{tok}{HIDDEN},{VOCAB}{HIDDEN}->{tok}{VOCAB}", hidden_k, table, names=("hidden", "table")
    )
    logits = info.outputs[0]
    loss = DistSpec(labels_k.shape, labels_k.dims_mapping)
    return SpmdInfo((hidden_k, table, labels_k), (loss, logits))


def cross_entropy_grad(
    hidden: DistSpec, table: DistSpec, labels: DistSpec | None = None
) -> SpmdInfo:
    """Gradient rule of the tied-head cross-entropy.

    `dlogits` takes the forward's logits layout (resolved over K); then
    `hidden_grad = einsum('...j,jk->...k', dlogits, table)` and
    `table_grad = einsum('...j,...k->jk', dlogits, hidden)`.

    Args:
      hidden, table, labels: as for `cross_entropy_forward`.

    Returns:
      `SpmdInfo(inputs=(hidden, table, labels, loss_grad), outputs=(hidden_grad, table_grad))`:
      `hidden_grad` in the kernel's hidden layout, partial over R; `table_grad` in the
      table's layout, partial over every mesh axis that splits the tokens (B).

    Raises:
      ValueError: as for `cross_entropy_forward`.

    Examples:
      >>> hidden = DistSpec((8, 64), (0, -1))          # f[T, H], tokens on mesh axis 0
      >>> table = DistSpec((1024, 64), (1, -1))        # f[V, H], vocab on mesh axis 1
      >>> hidden_grad, table_grad = cross_entropy_grad(hidden, table).outputs
      >>> hidden_grad.dims_mapping, hidden_grad.partial_dims   # partial over R
      ((0, -1), frozenset({1}))
      >>> table_grad.dims_mapping, table_grad.partial_dims     # table's layout, partial over B
      ((1, -1), frozenset({0}))
    """
    forward = cross_entropy_forward(hidden, table, labels)
    hidden_k, table, labels_k = forward.inputs
    loss, logits = forward.outputs
    dlogits = DistSpec(logits.shape, logits.dims_mapping)
    tok = ids_letters(hidden_k.ndim - 1)
    hidden_grad = einsum_rule(
        f"{tok}{VOCAB},{VOCAB}{HIDDEN}->{tok}{HIDDEN}", dlogits, table,
        names=("dlogits", "table"),
    ).outputs[0]  # fmt: skip
    table_grad = einsum_rule(
        f"{tok}{VOCAB},{tok}{HIDDEN}->{VOCAB}{HIDDEN}", dlogits, hidden_k,
        names=("dlogits", "hidden"),
    ).outputs[0]  # fmt: skip
    return SpmdInfo((hidden_k, table, labels_k, loss), (hidden_grad, table_grad))
