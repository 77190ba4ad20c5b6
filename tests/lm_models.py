"""Small decoder-only Transformer LMs in the style of Flax's `lm1b_nnx` and `lm1b` examples.

Test programs for the drop-in `Embed`s: the same model with `flax.nnx.Embed` or
`jaxembed.nnx.Embed` (NNX), `flax.linen.Embed` or `jaxembed.flax.Embed` (Linen), chosen by
the constructor argument `embed_cls` and nothing else. Written here after the structure of
Flax's examples (models.py, train.py, temperature_sampler.py), not copied:

- a token embedding shared with the output (`logits = embed.attend(y) / sqrt(emb)`, lm1b's
  `logits_via_embedding=True`), sinusoidal (or learned) positions, pre-LN blocks of causal
  multi-head self-attention (Flax's own attention, with its decode cache) and a ReLU MLP;
- the examples' partitioning: NNX annotates with mesh axis names through `MESH_RULES`
  (the table `('tensor', 'fsdp')`), Linen with logical names resolved by `LOGICAL_RULES`;
- an Auto mesh `data x fsdp x tensor`, a batch split `P('data')`;
- train steps built as the examples build them: NNX with `nnx.Optimizer` and
  `jax.jit(in_shardings=...)` from the state's shardings; Linen with
  `jax.jit(init, out_shardings=...)` and the parameters unboxed before training (lm1b), or
  kept boxed with the logical rules active when the step is traced;
- a decode path: the model run on ids `[1, 1]` with a cache, greedily, inside `jax.vmap`
  over the devices' prompts, as the examples' `predict_step`.

Simplifications against the examples: no dropout, no packed sequences, greedy instead of
temperature sampling, `optax.adamw` at a constant learning rate, the loss from
`optax.softmax_cross_entropy_with_integer_labels` (no one-hot) with lm1b's weights
(`ids > 0`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "LM1B",
    "LOGICAL_RULES",
    "MESH_RULES",
    "NNXLM",
    "SMALL",
    "LMConfig",
    "LinenLM",
    "TrainSetup",
    "build_linen",
    "build_nnx",
    "lm_loss",
    "make_batch",
    "make_mesh",
    "table_collectives",
]


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """Hyperparameters of the LM.

    Attributes:
      vocab: vocabulary (rows of the shared table).
      emb: model width (the table's features).
      heads: attention heads (divisible by the `tensor` axis).
      layers: Transformer blocks.
      mlp: hidden width of the MLP.
      max_len: longest sequence: the positions and the decode cache.
      learned_positions: a learned position table (lm1b's `posemb_init`) instead of the
        fixed sinusoid (lm1b's default).
      dtype: the blocks' compute dtype (the lookup and `attend` run in the table's).
      ids_sharding: when set, passed to the embedding's `__call__` as
        `inputs_sharding=` (jaxembed's modules only; Flax's take no such argument).
    """

    vocab: int = 30_000
    emb: int = 512
    heads: int = 8
    layers: int = 6
    mlp: int = 2048
    max_len: int = 512
    learned_positions: bool = False
    dtype: Any = jnp.float32
    ids_sharding: P | None = None

    def replace(self, **changes: Any) -> LMConfig:
        return dataclasses.replace(self, **changes)


# lm1b's defaults (configs/default.py: vocab_size 30_000, emb_dim 512, num_heads 8,
# num_layers 6, mlp_dim 2048; max_len = max(max_target_length 128, max_eval 512)).
LM1B = LMConfig()
SMALL = LMConfig(vocab=1024, emb=64, heads=4, layers=2, mlp=128, max_len=32)

# NNX: lm1b_nnx's MeshRules(embed='fsdp', mlp='tensor', kv='tensor', vocab='tensor'), names
# resolved when the model is built. Linen: lm1b's `logical_axis_rules` (no rule for 'kv': the
# attention kernels are split over `fsdp` only).
MESH_RULES = {"embed": "fsdp", "mlp": "tensor", "kv": "tensor", "vocab": "tensor"}
LOGICAL_RULES = (("mlp", "tensor"), ("vocab", "tensor"), ("embed", "fsdp"), ("heads", "tensor"))
MESH_AXES = ("data", "fsdp", "tensor")


def make_mesh(data: int = 2, fsdp: int = 1, tensor: int = 4) -> jax.sharding.Mesh:
    """The examples' mesh `data x fsdp x tensor`, every axis Auto."""
    return jax.make_mesh((data, fsdp, tensor), MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def mesh_axes(*names: str) -> tuple[str | None, ...]:
    """Mesh axes of logical names, as lm1b_nnx's `config.axis_rules('vocab', 'embed')`."""
    return tuple(MESH_RULES.get(name) for name in names)


def sinusoid(max_len: int, features: int) -> np.ndarray:
    """The fixed position table `[max_len, features]`: sines, then cosines (lm1b's)."""
    half = features // 2
    scale = -math.log(10_000.0) / max(half - 1, 1)
    angles = np.arange(max_len)[:, None] * np.exp(np.arange(half) * scale)[None, :]
    table = np.zeros((max_len, features), np.float32)
    table[:, :half], table[:, half : 2 * half] = np.sin(angles), np.cos(angles)
    return table


def shift_right(ids: jax.Array) -> jax.Array:
    """Teacher forcing: position i reads token i - 1; position 0 reads 0 (lm1b's BOS)."""
    return jnp.pad(ids, ((0, 0), (1, 0)))[:, :-1]


def causal_mask(ids: jax.Array, dtype: Any) -> jax.Array:
    """lm1b's training mask: causal, and padding (id 0) neither attends nor is attended."""
    return nn.combine_masks(
        nn.make_attention_mask(ids > 0, ids > 0, dtype=dtype), nn.make_causal_mask(ids, dtype=dtype)
    )


def lm_loss(logits: jax.Array, ids: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy over the tokens that are not padding (lm1b's weights)."""
    weights = (ids > 0).astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), ids)
    return jnp.sum(losses * weights) / jnp.sum(weights)


def make_batch(seed: int, batch: int, length: int, vocab: int, *, pad: bool = True) -> np.ndarray:
    """Random ids `[batch, length]` in `[1, vocab)`, with trailing padding (0) when `pad`."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab, (batch, length)).astype(np.int32)
    if pad:
        lengths = rng.integers(length // 2, length + 1, batch)
        ids[np.arange(length)[None, :] >= lengths[:, None]] = 0
    return ids


# --- NNX ------------------------------------------------------------------------------------


def _part(init: Callable, *names: str) -> Callable:
    return nnx.with_partitioning(init, mesh_axes(*names))


class NNXBlock(nnx.Module):
    """Pre-LN block: `x + attention(ln(x))`, then `x + mlp(ln(x))`."""

    def __init__(self, config: LMConfig, *, rngs: nnx.Rngs):
        dense = nnx.initializers.xavier_uniform()
        bias = nnx.initializers.normal(stddev=1e-6)

        def norm():
            return nnx.LayerNorm(
                config.emb, dtype=config.dtype, rngs=rngs,
                scale_init=_part(nnx.initializers.ones_init(), "embed"),
                bias_init=_part(nnx.initializers.zeros_init(), "embed"),
            )  # fmt: skip

        self.ln_attention = norm()
        self.attention = nnx.MultiHeadAttention(
            config.heads, config.emb, qkv_features=config.emb, dtype=config.dtype,
            kernel_init=_part(dense, "embed", "kv"), use_bias=False, decode=False,
            keep_rngs=False, rngs=rngs,
        )  # fmt: skip
        self.ln_mlp = norm()
        self.mlp_in = nnx.Linear(
            config.emb, config.mlp, dtype=config.dtype, rngs=rngs,
            kernel_init=_part(dense, "embed", "mlp"), bias_init=_part(bias, "mlp"),
        )  # fmt: skip
        self.mlp_out = nnx.Linear(
            config.mlp, config.emb, dtype=config.dtype, rngs=rngs,
            kernel_init=_part(dense, "mlp", "embed"), bias_init=_part(bias, "embed"),
        )  # fmt: skip

    def __call__(self, x: jax.Array, mask: jax.Array | None, decode: bool) -> jax.Array:
        x = x + self.attention(self.ln_attention(x), mask=mask, decode=decode)
        return x + self.mlp_out(nnx.relu(self.mlp_in(self.ln_mlp(x))))


class NNXLM(nnx.Module):
    """The decoder-only LM in NNX (lm1b_nnx's `TransformerLM`, shared embedding).

    Args:
      config: the hyperparameters.
      embed_cls: `flax.nnx.Embed` or `jaxembed.nnx.Embed`; built as
        `embed_cls(vocab, emb, embedding_init=nnx.with_partitioning(normal(1.0),
        ('tensor', 'fsdp')), rngs=rngs)`.
      rngs: the rngs (`params`).
    """

    def __init__(self, config: LMConfig, *, embed_cls: type = nnx.Embed, rngs: nnx.Rngs):
        self.config = config
        self.embed = embed_cls(
            num_embeddings=config.vocab, features=config.emb, rngs=rngs,
            embedding_init=_part(nnx.initializers.normal(stddev=1.0), "vocab", "embed"),
        )  # fmt: skip
        if config.learned_positions:
            init = _part(nnx.initializers.normal(stddev=0.02), None, "embed")
            self.positions = nnx.Param(init(rngs.params(), (config.max_len, config.emb)))
        else:
            self.positions = nnx.data(None)
        self.blocks = nnx.List([NNXBlock(config, rngs=rngs) for _ in range(config.layers)])
        self.ln_out = nnx.LayerNorm(
            config.emb, dtype=config.dtype, rngs=rngs,
            scale_init=_part(nnx.initializers.ones_init(), "embed"),
            bias_init=_part(nnx.initializers.zeros_init(), "embed"),
        )  # fmt: skip
        self.cache_index = nnx.data(None)

    def init_cache(self, batch: int) -> None:
        """Empty attention caches for `batch` sequences of up to `max_len` tokens."""
        for block in self.blocks:
            block.attention.init_cache((batch, self.config.max_len, self.config.emb))
        self.cache_index = nnx.Cache(jnp.zeros((), jnp.int32))

    def __call__(self, ids: jax.Array, *, decode: bool = False) -> jax.Array:
        """Logits `[batch, length, vocab]` of the next token at each position.

        Training (`decode=False`): ids `[batch, length]` are shifted right and attended
        causally. Decoding: ids `[batch, 1]`, the next token after the cached ones.
        """
        config = self.config
        tokens = ids if decode else shift_right(ids)
        kwargs = {} if config.ids_sharding is None else {"inputs_sharding": config.ids_sharding}
        x = self.embed(tokens, **kwargs)
        if self.positions is None:
            table = jnp.asarray(sinusoid(config.max_len, config.emb))
        else:
            table = self.positions[...]
        if decode:
            x = x + jax.lax.dynamic_slice_in_dim(table, self.cache_index[...], 1)[None]
            self.cache_index[...] += 1
        else:
            x = x + table[None, : ids.shape[1]]
        x = x.astype(config.dtype)
        mask = None if decode else causal_mask(ids, config.dtype)
        for block in self.blocks:
            x = block(x, mask, decode)
        y = self.ln_out(x)
        return self.embed.attend(y.astype(jnp.float32)) / jnp.sqrt(jnp.float32(config.emb))


# --- Linen ----------------------------------------------------------------------------------


def _logical(init: Callable, *names: str | None) -> Callable:
    return nn.with_logical_partitioning(init, names)


class LinenBlock(nn.Module):
    """Pre-LN block, as `NNXBlock`."""

    config: LMConfig
    decode: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array | None) -> jax.Array:
        config = self.config
        dense = nn.initializers.xavier_uniform()
        bias = nn.initializers.normal(stddev=1e-6)

        def norm(name):
            return nn.LayerNorm(
                dtype=config.dtype, name=name,
                scale_init=_logical(nn.initializers.ones, "embed"),
                bias_init=_logical(nn.initializers.zeros, "embed"),
            )  # fmt: skip

        h = nn.MultiHeadDotProductAttention(
            num_heads=config.heads, qkv_features=config.emb, dtype=config.dtype,
            kernel_init=_logical(dense, "embed", "kv"), use_bias=False, decode=self.decode,
            name="attention",
        )(norm("ln_attention")(x), mask=mask)  # fmt: skip
        x = x + h
        h = nn.Dense(
            config.mlp, dtype=config.dtype, name="mlp_in",
            kernel_init=_logical(dense, "embed", "mlp"), bias_init=_logical(bias, "mlp"),
        )(norm("ln_mlp")(x))  # fmt: skip
        h = nn.Dense(
            config.emb, dtype=config.dtype, name="mlp_out",
            kernel_init=_logical(dense, "mlp", "embed"), bias_init=_logical(bias, "embed"),
        )(nn.relu(h))  # fmt: skip
        return x + h


class LinenLM(nn.Module):
    """The decoder-only LM in Linen (lm1b's `TransformerLM`, shared embedding).

    Attributes:
      config: the hyperparameters.
      embed_cls: `flax.linen.Embed` or `jaxembed.flax.Embed`; built as
        `embed_cls(vocab, emb, embedding_init=nn.with_logical_partitioning(normal(1.0),
        ('vocab', 'embed')), name='embed')`.
      decode: ids `[batch, 1]` after the cached ones (the `cache` collection).
    """

    config: LMConfig
    embed_cls: Any = nn.Embed
    decode: bool = False

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        """Logits `[batch, length, vocab]` of the next token at each position."""
        config = self.config
        embed = self.embed_cls(
            num_embeddings=config.vocab, features=config.emb, name="embed",
            embedding_init=_logical(nn.initializers.normal(stddev=1.0), "vocab", "embed"),
        )  # fmt: skip
        tokens = ids if self.decode else shift_right(ids)
        kwargs = {} if config.ids_sharding is None else {"inputs_sharding": config.ids_sharding}
        x = embed(tokens, **kwargs)
        if config.learned_positions:
            init = _logical(nn.initializers.normal(stddev=0.02), None, "embed")
            table = self.param("positions", init, (config.max_len, config.emb))
        else:
            table = jnp.asarray(sinusoid(config.max_len, config.emb))
        if self.decode:
            initialized = self.has_variable("cache", "index")
            index = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
            x = x + jax.lax.dynamic_slice_in_dim(table, index.value, 1)[None]
            if initialized:
                index.value += 1
        else:
            x = x + table[None, : ids.shape[1]]
        x = x.astype(config.dtype)
        mask = None if self.decode else causal_mask(ids, config.dtype)
        for i in range(config.layers):
            x = LinenBlock(config, self.decode, name=f"block_{i}")(x, mask)
        y = nn.LayerNorm(
            dtype=config.dtype, name="ln_out",
            scale_init=_logical(nn.initializers.ones, "embed"),
            bias_init=_logical(nn.initializers.zeros, "embed"),
        )(x)  # fmt: skip
        return embed.attend(y.astype(jnp.float32)) / jnp.sqrt(jnp.float32(config.emb))


# --- train steps and decoders ---------------------------------------------------------------


@dataclasses.dataclass
class TrainSetup:
    """A jitted train step with its initial state, as an example's `train.py` builds it.

    Attributes:
      name: `"nnx"`, `"linen-unboxed"` or `"linen-boxed"`.
      mesh: the Auto mesh.
      config: the model's hyperparameters.
      step: `jax.jit`-ed `(state, ids) -> (state, loss)` with `in_shardings`.
      state: the initial train state (parameters and optimizer state), laid out.
      batch_sharding: the ids' layout, `P('data')`.
      rules: logical axis rules active while tracing and running (boxed Linen), or None.
      forward: `jax.jit`-ed `(state, ids) -> logits` (the eval step's forward).
      decoder: `state -> (fn, params)`: the jitted, vmapped greedy decoder
        `fn(params, prompts [n, 1, T]) -> (tokens [n, 1, T], logits [n, 1, T, vocab])`
        (the examples' `jit_pred_step`) and the state's parameters to call it with.
      table_shape: the shape of the embedding parameter (padded rows included).
    """

    name: str
    mesh: jax.sharding.Mesh
    config: LMConfig
    step: Callable
    state: Any
    batch_sharding: NamedSharding
    rules: tuple | None
    forward: Callable
    decoder: Callable[[Any], tuple[Callable, Any]]
    table_shape: tuple[int, int]
    _compiled: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def table_shard_shape(self) -> tuple[int, int]:
        """The per-device block of the table: rows over `tensor`, features over `fsdp`."""
        sizes = dict(zip(self.mesh.axis_names, self.mesh.axis_sizes, strict=True))
        rows, cols = mesh_axes("vocab", "embed")
        return (self.table_shape[0] // sizes[rows], self.table_shape[1] // sizes[cols])

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """`jax.set_mesh(mesh)`, and `nn.logical_axis_rules(rules)` when there are rules."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(jax.set_mesh(self.mesh))
            if self.rules is not None:
                stack.enter_context(nn.logical_axis_rules(self.rules))
            yield

    def compile(self, batch: int, length: int) -> jax.stages.Compiled:
        """The step compiled (not run) for ids `[batch, length]`; cached per shape."""
        if (batch, length) not in self._compiled:
            ids = jax.ShapeDtypeStruct((batch, length), jnp.int32, sharding=self.batch_sharding)
            with self.context():
                self._compiled[batch, length] = self.step.lower(self.state, ids).compile()
        return self._compiled[batch, length]

    def trace(self, batch: int, length: int, *, in_context: bool = True) -> jax.stages.Lowered:
        """The step traced and lowered (not compiled, not cached) for ids `[batch, length]`.

        With `in_context=False`, outside `jax.set_mesh` and the rules, as the examples'
        training loops call their jitted steps.
        """
        ids = jax.ShapeDtypeStruct((batch, length), jnp.int32, sharding=self.batch_sharding)
        with self.context() if in_context else contextlib.nullcontext():
            return self.step.lower(self.state, ids)

    def run(self, state: Any, ids: np.ndarray) -> tuple[Any, jax.Array]:
        """One training step on ids `[batch, length]`, with the compiled step."""
        compiled = self.compile(*ids.shape)
        with self.context():
            return compiled(state, jax.device_put(ids, self.batch_sharding))

    def logits(self, ids: np.ndarray, state: Any = None) -> jax.Array:
        """The forward pass (no decode cache) on ids `[batch, length]`."""
        with self.context():
            state = self.state if state is None else state
            return self.forward(state, jax.device_put(ids, self.batch_sharding))

    def decode(self, prompts: np.ndarray, state: Any = None) -> tuple[jax.Array, jax.Array]:
        """Greedy decoding of prompts `[n, 1, T]` (0: free), vmapped over `n`.

        With the parameters of `state` (default: the initial state).
        """
        fn, params = self.decoder(self.state if state is None else state)
        with self.context():
            return fn(params, jax.device_put(prompts, self.batch_sharding))


def table_collectives(hlo_text: str, setup: TrainSetup) -> list[dict[str, Any]]:
    """Each array of a compiled step's collectives shaped like the table or its shard.

    Args:
      hlo_text: the compiled step's HLO (`compiled.as_text()`).
      setup: the step's setup (mesh, table shape).

    Returns:
      One dict per such array: `kind`, `mesh_axes`, `shape`, and `moves_table`: False
      only for the data-parallel reduction of a gradient shard (an all-reduce or
      reduce-scatter of a `[V/R, H/K]` array over the batch axis `data` alone), which
      every data-parallel step has; True for anything else (a gather of the table or of
      its shard, a collective over the table's own axes, a full-table array).
    """
    from jaxembed import hlo  # the test programs need no jaxembed otherwise

    found = []
    for c in hlo.collectives(hlo_text):
        axes = hlo.mesh_axes(c, setup.mesh)
        for shape in c.result_shape:
            if shape not in (setup.table_shape, setup.table_shard_shape):
                continue
            reduction = c.kind in ("all-reduce", "reduce-scatter") and set(axes) <= {"data"}
            found.append({
                "kind": c.kind, "mesh_axes": axes, "shape": shape,
                "moves_table": not (reduction and shape == setup.table_shard_shape),
            })  # fmt: skip
    return found


def greedy(step_fn: Callable, cache: Any, prompt: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Decodes `prompt [1, T]` token by token from token 0; a 0 in the prompt is sampled.

    `step_fn(cache, token [1, 1]) -> (logits [1, vocab], cache)` runs the model on one
    token (the examples' `tokens_ids_to_logits`). Returns the tokens `[1, T]` (the prompt's
    where given, else the argmax) and each step's logits `[1, T, vocab]`.
    """

    def body(carry, target):
        cache, token = carry
        logits, cache = step_fn(cache, token)
        chosen = jnp.where(target > 0, target, jnp.argmax(logits, axis=-1).astype(jnp.int32))
        return (cache, chosen[:, None]), (chosen, logits)

    start = jnp.zeros((prompt.shape[0], 1), jnp.int32)
    _, (tokens, logits) = jax.lax.scan(body, (cache, start), prompt.T)
    return tokens.T, jnp.moveaxis(logits, 0, 1)


def _with_sharding(x: Any, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _is_box(x: Any) -> bool:
    return isinstance(x, nn.meta.AxisMetadata)


def _rebox(box: Any, x: Any) -> Any:
    return box.replace_boxed(x) if _is_box(box) else x


def _optimizer(learning_rate: float) -> optax.GradientTransformation:
    return optax.adamw(learning_rate, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.1)


def build_nnx(
    config: LMConfig,
    mesh: jax.sharding.Mesh,
    embed_cls: type = nnx.Embed,
    *,
    seed: int = 0,
    learning_rate: float = 1e-3,
    abstract: bool = False,
) -> TrainSetup:
    """lm1b_nnx's training setup: model and `nnx.Optimizer` laid out from their metadata.

    The step is `jax.jit(step, in_shardings=(state shardings, P('data')))` over the split
    `(model, optimizer)` state, as lm1b_nnx's `jit_train_step`. With `abstract=True` the
    state is `jax.ShapeDtypeStruct`s with their shardings (enough to compile the step;
    nothing is initialized).
    """

    def create():
        model = NNXLM(config, embed_cls=embed_cls, rngs=nnx.Rngs(params=seed))
        return model, nnx.Optimizer(model, _optimizer(learning_rate), wrt=nnx.Param)

    with jax.set_mesh(mesh):
        model, optimizer = nnx.eval_shape(create) if abstract else create()
    graphdef, state = nnx.split((model, optimizer))
    state_sharding = nnx.get_named_sharding(state, mesh)
    if abstract:
        state = jax.tree.map(_with_sharding, state, state_sharding)
    batch_sharding = NamedSharding(mesh, P("data"))

    def train_step(state, ids):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(lambda m: lm_loss(m(ids), ids))(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    step = jax.jit(
        train_step, in_shardings=(state_sharding, batch_sharding),
        out_shardings=(state_sharding, None),
    )  # fmt: skip

    model_def, params = nnx.split(model, nnx.Param)
    params_sharding = nnx.get_named_sharding(params, mesh)

    def decode_one(params, prompt):
        model = nnx.merge(model_def, params)
        model.init_cache(prompt.shape[0])
        decode_def, params, cache = nnx.split(model, nnx.Param, nnx.Cache)

        def step_fn(cache, token):
            model = nnx.merge(decode_def, params, cache)
            logits = model(token, decode=True)
            return logits[:, 0], nnx.state(model, nnx.Cache)

        return greedy(step_fn, cache, prompt)

    decode = jax.jit(
        jax.vmap(decode_one, in_axes=(None, 0)),
        in_shardings=(params_sharding, batch_sharding), out_shardings=batch_sharding,
    )  # fmt: skip

    def decoder(state):
        trained, _ = nnx.merge(graphdef, state)
        return decode, nnx.state(trained, nnx.Param)

    forward = jax.jit(
        lambda state, ids: nnx.merge(graphdef, state)[0](ids),
        in_shardings=(state_sharding, batch_sharding),
    )
    return TrainSetup(
        name="nnx", mesh=mesh, config=config, step=step, state=state,
        batch_sharding=batch_sharding, rules=None, forward=forward, decoder=decoder,
        table_shape=tuple(model.embed.embedding.shape),
    )  # fmt: skip


def build_linen(
    config: LMConfig,
    mesh: jax.sharding.Mesh,
    embed_cls: Any = nn.Embed,
    *,
    boxed: bool = False,
    seed: int = 0,
    learning_rate: float = 1e-3,
    abstract: bool = False,
) -> TrainSetup:
    """lm1b's training setup: `jax.jit(init, out_shardings=...)` under the logical rules.

    With `boxed=False` the state is unboxed afterwards (`nn.meta.unbox`, lm1b's
    `unbox_logicallypartioned_trainstate`) and the step runs without the rules, as lm1b;
    with `boxed=True` the `LogicallyPartitioned` boxes stay and the rules are active while
    the step is traced. With `abstract=True` the state is `jax.ShapeDtypeStruct`s with
    their shardings (the init is not run).
    """
    model = LinenLM(config, embed_cls)
    tx = _optimizer(learning_rate)
    rules = tuple(LOGICAL_RULES)

    def init_state(key):
        # lm1b inits on a batch of its training shape; one sequence per `data` shard here,
        # so that a layout given for the batch (`ids_sharding=P('data')`) fits it.
        ids = jnp.ones((mesh.shape["data"], config.max_len), jnp.int32)
        variables = model.init(key, ids)
        return train_state.TrainState.create(
            apply_fn=model.apply, params=variables["params"], tx=tx
        )

    key = jax.random.key(seed)
    shapes = jax.eval_shape(init_state, key)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        state_sharding = nn.logical_to_mesh_sharding(nn.get_partition_spec(shapes), mesh, rules)
        if abstract:
            values = jax.tree.map(lambda x: x.value if _is_box(x) else x, shapes, is_leaf=_is_box)
            state = jax.tree.map(_with_sharding, values, state_sharding)
            if boxed:  # the boxes back around the arrays
                state = jax.tree.map(_rebox, shapes, state, is_leaf=_is_box)
        else:
            state = jax.jit(init_state, out_shardings=state_sharding)(key)
    if not boxed:
        state = nn.meta.unbox(state)
    batch_sharding = NamedSharding(mesh, P("data"))

    def train_step(state, ids):
        def loss_fn(params):
            return lm_loss(model.apply({"params": params}, ids), ids)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    step = jax.jit(
        train_step, in_shardings=(state_sharding, batch_sharding),
        out_shardings=(state_sharding, None),
    )  # fmt: skip

    decoding = LinenLM(config, embed_cls, decode=True)

    def decode_one(params, prompt):
        shapes = jax.eval_shape(decoding.init, jax.random.key(0), prompt)["cache"]
        cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

        def step_fn(cache, token):
            logits, variables = decoding.apply(
                {"params": params, "cache": cache}, token, mutable=["cache"]
            )
            return logits[:, 0], variables["cache"]

        return greedy(step_fn, cache, prompt)

    decode = jax.jit(
        jax.vmap(decode_one, in_axes=(None, 0)),
        in_shardings=(state_sharding.params, batch_sharding), out_shardings=batch_sharding,
    )  # fmt: skip

    def decoder(state):
        return decode, state.params

    forward = jax.jit(
        lambda state, ids: model.apply({"params": state.params}, ids),
        in_shardings=(state_sharding, batch_sharding),
    )
    table = nn.meta.unbox(state.params)["embed"]["embedding"]
    return TrainSetup(
        name="linen-boxed" if boxed else "linen-unboxed", mesh=mesh, config=config, step=step,
        state=state, batch_sharding=batch_sharding, rules=rules if boxed else None,
        forward=forward, decoder=decoder, table_shape=tuple(table.shape),
    )  # fmt: skip
