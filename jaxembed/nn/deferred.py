"""The deferred logits of a tied head: models whose `__call__` ends in `embedder.attend(x)`.

Under `deferred_logits()`, `Embed.attend(h)` (NNX and Linen) returns a `DeferredLogits`
handle, the hidden states and the table, instead of `[tokens, V]` logits; `cross_entropy`
(or the handle's own method) computes the vocab-parallel loss from it
(`jaxembed.losses.vocab_parallel_cross_entropy`), so such a model trains without restating
its forward up to the head. Any other use of the handle raises, naming the context.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxembed.kernels.arrays import spec_of
from jaxembed.kernels.cross_entropy import vocab_parallel_cross_entropy
from jaxembed.nn.common import as_spec, tied_logits
from jaxembed.plan.cross_entropy import CrossEntropyPlan, plan_cross_entropy

__all__ = ["DeferredLogits", "cross_entropy", "deferred_logits", "deferring"]


class _Deferral:
    __slots__ = ("query_sharding",)

    def __init__(self, query_sharding: P | None):
        self.query_sharding = query_sharding


_DEFERRAL: contextvars.ContextVar[_Deferral | None] = contextvars.ContextVar(
    "jaxembed_deferred_logits", default=None
)


@contextlib.contextmanager
def deferred_logits(*, query_sharding: Any = None) -> Iterator[None]:
    """Under it, `Embed.attend(query)` returns a `DeferredLogits` handle, not the logits.

    For a model whose `__call__` ends in `embed.attend(h)`: called inside this context, the
    model returns a handle holding `h`, the table and its layout, whose one use is the
    vocab-parallel loss (`cross_entropy(logits, labels)`), so the model trains with it
    without restating its forward up to the head, and no device builds `[tokens, vocab]`
    logits. Outside the context `attend` returns the logits, as ever. Both `jaxembed.nnx.Embed`
    and `jaxembed.flax.Embed` honour it.

    The context is read when `attend` runs, i.e. when a jitted function is traced: enter it
    inside the function you jit (around the model call in the loss), as in the example, not
    around a call of a function jitted elsewhere without it.

    Args:
      query_sharding: the hidden states' layout, for the loss under `jit` in an Auto mesh (in
        an Explicit mesh their type says it); `cross_entropy(..., query_sharding=...)`
        overrides it.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from flax import nnx
      >>> import jaxembed.nnx
      >>> class LM(nnx.Module):
      ...     def __init__(self, rngs):
      ...         self.embed = jaxembed.nnx.Embed(100, 8, rngs=rngs)
      ...     def __call__(self, ids):
      ...         return self.embed.attend(self.embed(ids))
      >>> model, ids = LM(nnx.Rngs(0)), jnp.arange(12).reshape(2, 6)
      >>> def loss_fn(model):
      ...     with jaxembed.nnx.deferred_logits():
      ...         logits = model(ids)               # a DeferredLogits [2, 6, 100]
      ...     return jaxembed.nnx.cross_entropy(logits, ids, reduction="mean")
      >>> loss, grads = nnx.jit(nnx.value_and_grad(loss_fn))(model)
      >>> dense = optax.softmax_cross_entropy_with_integer_labels(model(ids), ids).mean()
      >>> bool(jnp.allclose(loss, dense, rtol=1e-5))
      True
    """
    token = _DEFERRAL.set(_Deferral(as_spec(query_sharding)))
    try:
        yield
    finally:
        _DEFERRAL.reset(token)


def deferring() -> _Deferral | None:
    """The active `deferred_logits` context (its options), or None."""
    return _DEFERRAL.get()


class DeferredLogits:
    """The logits `query @ table[:vocab_size].T` of a tied head, not computed.

    `Embed.attend` returns one inside `deferred_logits()`. It is a pytree of the hidden states
    and the table (so it crosses `jit`, `value_and_grad` and `nnx.jit` as they do), with
    `shape`, `ndim` and `dtype` of the logits it stands for, and indexing over the token axes
    (`logits[:, :-1]`, the vocab axis whole). Its use is the loss, `cross_entropy(labels)`;
    `materialize()` builds the logits. Anything else (arithmetic, `jnp` functions, `optax`
    losses) raises a `TypeError` saying so: silently building the logits would undo what the
    context is for.
    """

    __slots__ = ("mesh", "out_sharding", "query", "query_sharding", "table", "vocab_size",
                 "weight_spec", "where")  # fmt: skip

    def __init__(
        self, query: Any, table: Any, *, vocab_size: int, mesh: Any, weight_spec: P | None,
        query_sharding: P | None = None, out_sharding: Any = None, where: str = "Embed.attend",
    ):  # fmt: skip
        for name, value in (("query", query), ("table", table), ("vocab_size", vocab_size),
                            ("mesh", mesh), ("weight_spec", weight_spec),
                            ("query_sharding", query_sharding),
                            ("out_sharding", out_sharding), ("where", where)):  # fmt: skip
            object.__setattr__(self, name, value)

    def _replace(self, **changes: Any) -> DeferredLogits:
        fields = {name: getattr(self, name) for name in self.__slots__}
        return DeferredLogits(**{**fields, **changes})

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.query.shape[:-1], self.vocab_size)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> Any:
        return self.query.dtype

    def cross_entropy(
        self, labels: jax.Array, *, query_sharding: Any = None, **options: Any
    ) -> jax.Array:
        """Softmax cross-entropy of these logits against integer labels, vocab-parallel.

        Equals `optax.softmax_cross_entropy_with_integer_labels(logits, labels)` on the logits
        this handle stands for (with the options), with its gradients, without building them.

        Args:
          labels: integer `[*tokens]`.
          query_sharding: the hidden states' layout (default the context's); needed under
            `jit` in an Auto mesh.
          **options: the keywords of `jaxembed.losses.vocab_parallel_cross_entropy`
            (`reduction`, `label_smoothing`, `z_loss`, `ignore_index`, `vocab_chunk_size`, ...).

        Returns:
          float32 per-token losses `[*tokens]`, or a scalar when reduced.
        """
        spec = as_spec(query_sharding) if query_sharding is not None else self.query_sharding
        return vocab_parallel_cross_entropy(
            self.query, self.table, labels, vocab_size=self.vocab_size, mesh=self.mesh,
            hidden_spec=spec, weight_spec=self.weight_spec, **options,
        )  # fmt: skip

    def plan(self, *, query_sharding: Any = None, **options: Any) -> CrossEntropyPlan:
        """The plan `cross_entropy` would run (`jaxembed.losses.plan_cross_entropy`): its
        layouts, chunks, move and every collective with its bytes; `print` it.

        Args:
          query_sharding: as `cross_entropy`'s.
          **options: `cross_entropy`'s keywords; those that do not change the plan
            (`reduction`, `weights`) are ignored.
        """
        spec = as_spec(query_sharding) if query_sharding is not None else self.query_sharding
        options = {k: v for k, v in options.items() if k not in ("reduction", "weights")}
        mesh = self.mesh
        if spec is None and mesh is not None:
            spec = spec_of(self.query, mesh)
        w_spec = self.weight_spec
        if w_spec is None and mesh is not None:
            w_spec = spec_of(self.table, mesh)
        return plan_cross_entropy(
            mesh, self.query.shape, self.table.shape, hidden_spec=spec, weight_spec=w_spec,
            vocab_size=self.vocab_size, dtype=self.query.dtype, table_dtype=self.table.dtype,
            **options,
        )  # fmt: skip

    def materialize(self, out_sharding: Any = None) -> jax.Array:
        """The logits themselves, `[*tokens, vocab]` (what `attend` returns outside the
        context), laid out as `out_sharding`, else as `attend` was asked to."""
        sharding = out_sharding if out_sharding is not None else self.out_sharding
        return tied_logits(self.query, self.table, self.vocab_size, self.mesh, sharding)

    def astype(self, dtype: Any) -> DeferredLogits:
        """`self` for float32: the loss computes the logits in float32 already."""
        if jnp.dtype(dtype) == jnp.float32:
            return self
        raise self._misuse(f"astype({jnp.dtype(dtype).name})")

    def __getitem__(self, key: Any) -> DeferredLogits:
        """The logits of some tokens: indexes the token axes, never the vocab axis."""
        key = key if isinstance(key, tuple) else (key,)
        if len(key) == self.ndim and isinstance(key[-1], slice) and key[-1] == slice(None):
            key = key[:-1]  # logits[:, :-1, :]: the vocab axis whole
        if len(key) >= self.ndim or any(k is Ellipsis or k is None for k in key):
            raise self._misuse(f"indexing with {key!r} (only the token axes can be indexed)")
        return self._replace(query=self.query[key])

    def __repr__(self) -> str:
        try:
            shape = self.shape
        except AttributeError:  # leaves that are not arrays (a transformation's placeholders)
            shape = "?"
        return f"DeferredLogits(shape={shape}, from {self.where})"

    def _misuse(self, what: str) -> TypeError:
        face = self.where.rsplit(".Embed", 1)[0] if ".Embed" in self.where else "jaxembed.nnx"
        return TypeError(
            f"{what} on a DeferredLogits: {self.where} ran inside {face}.deferred_logits(), "
            f"so it returned a handle standing for logits of shape {self.shape}, not the "
            f"array. Its use is the vocab-parallel loss, {face}.cross_entropy(logits, labels, "
            f"...) (or logits.cross_entropy(labels, ...)), which never builds the "
            f"[tokens, {self.vocab_size}] logits. For the logits as an array, call the model "
            f"outside the `with {face}.deferred_logits():` block, or take logits.materialize()."
        )

    def __getattr__(self, name: str) -> Any:  # only for names the class does not define
        if name.startswith("__") or name in self.__slots__:
            raise AttributeError(name)
        raise AttributeError(str(self._misuse(f".{name}")))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"DeferredLogits is immutable: cannot set .{name}")


def _refuse(op: str) -> Any:
    def method(self, *args, **kwargs):
        raise self._misuse(op)

    method.__name__ = op
    return method


for _op in ("add", "radd", "sub", "rsub", "mul", "rmul", "truediv", "rtruediv", "floordiv",
            "rfloordiv", "mod", "rmod", "pow", "rpow", "matmul", "rmatmul", "neg", "pos", "abs",
            "lt", "le", "gt", "ge", "array", "jax_array", "bool", "float", "int", "index",
            "iter", "len"):  # fmt: skip
    setattr(DeferredLogits, f"__{_op}__", _refuse(f"__{_op}__"))
del _op


def _flatten_with_keys(x: DeferredLogits):
    keys = jax.tree_util.GetAttrKey
    aux = (x.vocab_size, x.mesh, x.weight_spec, x.query_sharding, x.out_sharding, x.where)
    return ((keys("query"), x.query), (keys("table"), x.table)), aux


def _unflatten(aux: tuple[Any, ...], children: Any) -> DeferredLogits:
    vocab_size, mesh, weight_spec, query_sharding, out_sharding, where = aux
    query, table = children
    return DeferredLogits(
        query, table, vocab_size=vocab_size, mesh=mesh, weight_spec=weight_spec,
        query_sharding=query_sharding, out_sharding=out_sharding, where=where,
    )  # fmt: skip


jax.tree_util.register_pytree_with_keys(
    DeferredLogits, _flatten_with_keys, _unflatten,
    flatten_func=lambda x: ((x.query, x.table), _flatten_with_keys(x)[1]),
)  # fmt: skip


def cross_entropy(logits: DeferredLogits, labels: jax.Array, **options: Any) -> jax.Array:
    """The vocab-parallel softmax cross-entropy of deferred logits against integer labels.

    `logits` is what a model ending in `Embed.attend` returns inside `deferred_logits()`. The
    loss equals `optax.softmax_cross_entropy_with_integer_labels(model(x), labels)` on the
    model called outside the context (with the options), with its gradients for every
    parameter, but no device builds the logits of the whole vocabulary.

    Args:
      logits: a `DeferredLogits`.
      labels: integer `[*tokens]`.
      **options: `query_sharding` and the keywords of
        `jaxembed.losses.vocab_parallel_cross_entropy` (`reduction`, `label_smoothing`,
        `z_loss`, `ignore_index`, `vocab_chunk_size`, ...), passed through.

    Returns:
      float32 per-token losses `[*tokens]`, or a scalar when reduced.

    Raises:
      TypeError: `logits` is an array (the model ran outside `deferred_logits()`).
    """
    if not isinstance(logits, DeferredLogits):
        raise TypeError(
            f"cross_entropy takes the DeferredLogits that Embed.attend returns inside "
            f"deferred_logits(), got {type(logits).__name__} of shape "
            f"{getattr(logits, 'shape', '?')}: call the model inside `with "
            "jaxembed.nnx.deferred_logits():` (jaxembed.flax's for Linen), or, for logits "
            "you hold, use optax.softmax_cross_entropy_with_integer_labels"
        )
    return logits.cross_entropy(labels, **options)
