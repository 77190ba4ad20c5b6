"""The DLRM training step with its two largest tables dynamic, against static tables and TorchRec.

    python -m benchmarks.dynamic.dlrm_step \\
        --json benchmarks/results/dynamic/dlrm_step.json \\
        --markdown benchmarks/results/dynamic/dlrm_step.md
    python -m benchmarks.dynamic.dlrm_step --quick          # tiny tables, two rounds (tests)
    python -m benchmarks.dynamic.dlrm_step --no-torchrec    # the JAX variants only

One CPU device (`XLA_FLAGS=--xla_force_host_platform_device_count=1`, set here before jax
starts; `python -m benchmarks` would ask for 8), no mesh.

**The workload** is `examples/train_dlrm.py`'s at its defaults: the click stream of
`examples/dlrm_data.py` (13 dense features, 26 bags of 1 to 20 Zipf(1.3) ids over 20
Criteo-like tables at scale 1/8: 10 to 1,266,403 rows, 4.2M in all), batches of 512, rows of 16,
bags mean-pooled. The two largest tables (t02 and t10, read by C3 and C12) have their rows
rounded up to a multiple of the bucket size (1,266,432 and 1,043,968) in every variant, so the
dynamic tables' capacity is the static tables' rows.

**The step**, one `jax.jit` with the whole state donated: per table one `jaxembed.embedding_bag`
of its features' bags stacked along the batch; DLRM's dense part (`dense_logits`: bottom MLP
13-64-16, the pairwise dots of the 27 vectors, top MLP to 128-64-1, as `train_dlrm.DenseArch`);
the logistic loss; `value_and_grad` in the dense parameters and the pooled bags; optax Adam on
the dense parameters; per table `opt.update` of `jaxembed.optim.rowwise_adagrad` (FBGEMM's
EXACT_ROWWISE_ADAGRAD). Variants, each stepping the same batches from the same initial state:

* `static`: every table an ordinary table, ids in `[0, rows)`.
* `dynamic`: the two largest tables are dynamic (`DynamicTableConfig(capacity=rows,
  policy="lru", admit_after=2)`), fed raw 64-bit ids: the static ids through a fixed bijection
  of 64 bits (`raw_ids`: splitmix64's finalizer of the id xor a per-table salt, so the stream
  has the same popularity), as `uint32[..., 2]` keys made on the host before the step. The step
  starts with `prepare` on each (the native remap, then the reset of the rows it assigned, from
  DLRM's uniform(±1/√rows) initializer); the rest is the static step on the rows it returns.
* `dynamic[init=zeros]`: `dynamic` with reset rows set to zeros instead of drawn (a diagnostic:
  `prepare` evaluates the initializer for every id slot of the batch, the static bound on the
  rows a step can reset, through `fold_in` and threefry per slot).
* `prepare_only`, `remap_only`: the two `prepare` calls alone, and the two native remap kernels
  alone (`remap_native.step`), each jitted with its state donated, on the same batches: the
  remap's share of the dynamic step and the reset's (`prepare` - remap).

**TorchRec** (`torchrec_mch_runner`, a child process, so torch never loads in this one) builds
the same model from the same initial tables and MLP parameters and steps the same batches (the
raw ids' int64 patterns for the dynamic tables): `torchrec_mch` (`MCHManagedCollisionModule`s,
zch_size = capacity, `LRU_EvictionPolicy`, `eviction_interval=1`, in a
`ManagedCollisionCollection`, then `FusedEmbeddingBagCollection`s: FBGEMM's fused row-wise
Adagrad), `torchrec_mcebc` (the documented `ManagedCollisionEmbeddingBagCollection`: it wraps a
plain EBC, so `torchrec.optim.RowWiseAdagrad` on dense gradients), `torchrec_mch[interval=10]`
(eviction every 10 steps: bimodal steps, so compared by means), `torchrec_static` (the fused
EBCs on the static ids). `torch.set_num_threads(n)` with n this process's native kernel threads
(XLA's CPU pool is the process's cores), `OMP_WAIT_POLICY=PASSIVE`. Semantics differ where
TorchRec's do: its MCH admits every id at once (no admission count), sends an id without a slot
to the shared row `zch_size - 1` (which it reads and trains), and the unsharded MC-EBC resets
nothing on eviction; a jaxembed id without a row reads zeros, and a reassigned row is reset.

**Timing** (`benchmarks.common.timing.time_interleaved`): every variant in rotated rounds after
warm-up, each round one untimed step of a variant right before its timed one (`settle`: without
it the variant after a TorchRec step pays for waking XLA's threads), every call on the
variant's next batch (fresh ids: the remap admits and evicts as in training). A TorchRec call is
one request to the child, which times its own step (the round trip is recorded beside it).
Median, p90, mean, process CPU time, the ratio of medians and the paired ratio (the median over
rounds of the per-round ratio); `torchrec_mch[interval=10]` by its mean over every call after
warm-up (whole eviction intervals: with one untimed call per timed one, an even interval's
evictions would all fall on timed calls or on none).

**Checks.** (1) `check_equivalence`: with every table initialised to one constant, capacity
`check_capacity_factor` x rows and `admit_after=1`, the dynamic step's losses equal the static
step's and, after `check_steps` steps, each id's dynamic row (and accumulator) equals its static
row: the tables agree up to the row permutation the remap chose (when no id was evicted or
refused, which the check reports). (2) Every variant's losses are finite and fall from its first
steps to its last. (3) TorchRec's first static loss equals ours (same tables, MLP and batch).

**Targets** (issue 24): t(dynamic) / t(static) <= 1.15 and t(torchrec_mch) / t(dynamic) >= 3.

Importing this module loads numpy only (the TorchRec child imports its workload helpers).
"""

from __future__ import annotations

import os
import sys

if "jax" not in sys.modules:  # one CPU device, before jax starts (`python -m benchmarks` asks 8)
    _flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
              if not f.startswith("--xla_force_host_platform_device_count")]  # fmt: skip
    os.environ["XLA_FLAGS"] = " ".join([*_flags, "--xla_force_host_platform_device_count=1"])

import argparse
import dataclasses
import itertools
import json
import select
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from benchmarks.common.timing import QUICK_TIMING, TimingPolicy, time_interleaved, time_record

__all__ = [
    "QUICK", "SCHEMA", "DlrmStepConfig", "Inputs", "Workload", "check_equivalence",
    "dense_logits", "initial_table", "load_inputs", "main", "make_batches", "raw_ids",
    "run_dlrm_step", "save_inputs", "tables", "targets", "workload",
]  # fmt: skip

SCHEMA = "jaxembed.bench.dynamic.dlrm_step/1"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JAX_VARIANTS = ("static", "dynamic", "dynamic[init=zeros]", "prepare_only", "remap_only")
TRAINING = JAX_VARIANTS[:3]  # the variants that train (the others time a piece of the step)
TORCHREC_VARIANTS = ("torchrec_mch", "torchrec_mcebc", "torchrec_mch[interval=10]",
                     "torchrec_static")  # fmt: skip
MEAN_VARIANTS = ("torchrec_mch[interval=10]",)
"""Variants whose steps are bimodal (an eviction every k steps): compared by their means."""
TARGET_DYNAMIC = 1.15  # t(dynamic) / t(static), at most
TARGET_TORCHREC = 3.0  # t(torchrec_mch) / t(dynamic), at least

TIMING = TimingPolicy(repeats=30, warmup=3, settle=1, min_samples=30, max_seconds=1e9)
"""30 rounds, every variant in each (paired ratios need one sample a round); one untimed step
of a variant right before each timed one, so that a sample is a step of a training loop and not
the aftermath of the variant before it (a TorchRec step leaves XLA's threads asleep)."""


@dataclasses.dataclass(frozen=True)
class DlrmStepConfig:
    """What `run_dlrm_step` measures (the module's docstring).

    Attributes:
      scale, features, batch, dim, max_ids: the DLRM example's click stream and model
        (`dlrm_data.ClickModel(scale, num_features=features, max_ids=max_ids)`).
      dynamic_tables: how many of the largest tables are dynamic.
      bucket_size, admit_after, policy: their `DynamicTableConfig`.
      table_lr, dense_lr, eps: row-wise Adagrad's rate (both frameworks), Adam's rate, eps.
      torchrec: the TorchRec variants (`torchrec_mch_runner.VARIANTS`); () runs none.
      threads: torch's threads (None: the native kernels' `native.num_threads()`).
      check_steps, check_capacity_factor: the equivalence check (0 steps: none).
      seed: of the stream, the tables and the MLP.
      timing: the interleaved rounds.
      quick: tiny shapes (a label for the record).
    """

    scale: float = 1 / 8
    features: int = 26
    batch: int = 512
    dim: int = 16
    max_ids: int = 20
    dynamic_tables: int = 2
    bucket_size: int = 32
    admit_after: int = 2
    policy: str = "lru"
    table_lr: float = 0.05
    dense_lr: float = 3e-3
    eps: float = 1e-8
    torchrec: tuple[str, ...] = TORCHREC_VARIANTS
    threads: int | None = None
    check_steps: int = 6
    check_capacity_factor: int = 1
    seed: int = 0
    timing: TimingPolicy = dataclasses.field(default_factory=lambda: TIMING)
    quick: bool = False


QUICK = DlrmStepConfig(scale=1 / 2048, features=8, batch=16, max_ids=4, bucket_size=8,
                       check_steps=4, check_capacity_factor=8, timing=QUICK_TIMING,
                       quick=True)  # fmt: skip
"""`--quick`: 8 features over tables of 10 to 618 rows, batches of 16; the times mean nothing."""


# --- the workload (numpy only: the TorchRec child uses it too) --------------------------------


class Workload(NamedTuple):
    """Tables `(name, rows)` and features `(feature, table)` in the example's order, the
    dynamic tables (the largest), the row width, the batch and the bag capacity."""

    tables: tuple[tuple[str, int], ...]
    features: tuple[tuple[str, str], ...]
    dynamic: tuple[str, ...]
    dim: int
    batch: int
    max_ids: int
    seed: int

    def rows(self, table: str) -> int:
        return dict(self.tables)[table]

    def features_of(self, table: str) -> list[str]:
        return [f for f, t in self.features if t == table]

    def index(self, table: str) -> int:
        return [t for t, _ in self.tables].index(table)

    @property
    def feature_names(self) -> tuple[str, ...]:
        return tuple(f for f, _ in self.features)


def _click_model(config: DlrmStepConfig):
    if os.path.join(REPO, "examples") not in sys.path:
        sys.path.insert(0, os.path.join(REPO, "examples"))  # dlrm_data, beside train_dlrm
    from dlrm_data import ClickModel

    return ClickModel(config.scale, config.seed, num_features=config.features,
                      max_ids=config.max_ids)  # fmt: skip


def workload(config: DlrmStepConfig) -> Workload:
    """The example's tables and features; the `dynamic_tables` largest rounded up to whole
    buckets."""
    m = _click_model(config)
    dynamic = tuple(sorted(m.tables, key=lambda t: -m.tables[t])[: config.dynamic_tables])
    s = config.bucket_size
    rows = tuple((t, -(-r // s) * s if t in dynamic else r) for t, r in m.tables.items())
    return Workload(rows, tuple(m.features.items()), dynamic, config.dim, config.batch,
                    config.max_ids, config.seed)  # fmt: skip


_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_INT64_MAX = np.uint64(2**63 - 1)  # TorchRec's MCH keeps it as its empty slot


def _mix64(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # splitmix64's finalizer: a bijection of uint64
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def raw_ids(ids: np.ndarray, table_index: int, seed: int = 0) -> np.ndarray:
    """Static ids as raw 64-bit ids (int64): `mix64(id ^ salt)`, a bijection per table; -1
    (an empty slot) stays -1, jaxembed's padding id `EMPTY_ID`.

    Examples:
      >>> r = raw_ids(np.array([[0, 1, -1]], np.int32), 0)
      >>> r.dtype, int(r[0, 2]), len(set(raw_ids(np.arange(1000), 3).tolist()))
      (dtype('int64'), -1, 1000)
    """
    x = np.asarray(ids)
    salt = _mix64(np.array([(seed << 32) + 2 * table_index + 1], np.uint64))[0]
    raw = _mix64(x.astype(np.int64).view(np.uint64) ^ salt)
    bad = (x >= 0) & ((raw == np.uint64(2**64 - 1)) | (raw == _INT64_MAX))
    if bad.any():  # never seen; named rather than silently padded
        raise ValueError(f"raw_ids: id {int(x[bad][0])} of table {table_index} maps to a "
                         "reserved value (EMPTY_ID or int64 max): change the seed")  # fmt: skip
    return np.where(x >= 0, raw.view(np.int64), np.int64(-1))


def initial_table(rows: int, dim: int, seed: int, index: int, constant: float | None = None):
    """Table `index`'s initial rows, float32 `[rows, dim]`: DLRM's uniform(±1/√rows), drawn
    by numpy from `(seed, index)` (or all `constant`)."""
    if constant is not None:
        return np.full((rows, dim), constant, np.float32)
    bound = rows**-0.5
    return (
        np.random.default_rng([seed, 7, index])
        .uniform(-bound, bound, (rows, dim))
        .astype(np.float32)
    )


def initial_dense(w: Workload) -> dict[str, np.ndarray]:
    """The MLP's parameters (`bottom_w0`, `bottom_b0`, ..., `top_b2`), kernels `[in, out]`
    LeCun-normal, biases zero."""
    rng = np.random.default_rng([w.seed, 11])
    n = len(w.features)
    sizes = {"bottom": [13, 64, w.dim], "top": [w.dim + n * (n + 1) // 2, 128, 64, 1]}
    out = {}
    for name, dims in sizes.items():
        for i, (a, b) in enumerate(itertools.pairwise(dims)):
            out[f"{name}_w{i}"] = rng.normal(0.0, a**-0.5, (a, b)).astype(np.float32)
            out[f"{name}_b{i}"] = np.zeros(b, np.float32)
    return out


def make_batches(config: DlrmStepConfig, w: Workload, count: int) -> list[dict[str, np.ndarray]]:
    """Batches 1..count of the example's training stream: `dense`, `labels`, per table
    `ids_{t}` (int32 `[F_t * B, L]`, its features' bags stacked, -1 empty) and for the dynamic
    tables `raw_{t}` (`raw_ids` of those)."""
    m = _click_model(config)
    out = []
    for step in range(1, count + 1):
        b = m.batch(step, w.batch)
        batch = {"dense": b.dense, "labels": b.labels}
        for t, _ in w.tables:
            ids = np.concatenate([b.ids[f] for f in w.features_of(t)])
            batch[f"ids_{t}"] = ids
            if t in w.dynamic:
                batch[f"raw_{t}"] = raw_ids(ids, w.index(t), w.seed)
        out.append(batch)
    return out


class Inputs(NamedTuple):
    """What `load_inputs` returns."""

    workload: Workload
    batches: list[dict[str, np.ndarray]]
    dense_params: dict[str, np.ndarray]
    hyper: dict[str, float]

    def table(self, name: str) -> np.ndarray:
        w = self.workload
        return initial_table(w.rows(name), w.dim, w.seed, w.index(name))


def save_inputs(path: str, inputs: Inputs) -> None:
    """One `.npz` for the TorchRec child: the batches, the MLP's parameters, and `meta`."""
    meta = {"workload": inputs.workload._asdict(), "hyper": inputs.hyper,
            "batches": len(inputs.batches)}  # fmt: skip
    arrays = {f"b{k}/{key}": a for k, b in enumerate(inputs.batches) for key, a in b.items()}
    arrays.update({f"p/{k}": v for k, v in inputs.dense_params.items()})
    np.savez(path, meta=np.array(json.dumps(meta)), **arrays)


def load_inputs(path: str) -> Inputs:
    """Reads what `save_inputs` wrote."""
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(str(z["meta"]))
        d = meta["workload"]
        pairs = lambda key: tuple(map(tuple, d[key]))
        w = Workload(pairs("tables"), pairs("features"), tuple(d["dynamic"]), d["dim"],
                     d["batch"], d["max_ids"], d["seed"])  # fmt: skip
        batches: list[dict[str, np.ndarray]] = [{} for _ in range(meta["batches"])]
        params = {}
        for key in z.files:
            if key.startswith("b"):
                k, name = key[1:].split("/", 1)
                batches[int(k)][name] = z[key]
            elif key.startswith("p/"):
                params[key[2:]] = z[key]
    return Inputs(w, batches, params, meta["hyper"])


# --- the JAX step ------------------------------------------------------------------------------


def dense_logits(params: dict[str, Any], dense: Any, pooled: dict[str, Any], names: Sequence[str]):
    """DLRM's dense part: logits `[B]` from `dense [B, 13]` and `{feature: [B, d]}`."""
    import jax
    import jax.numpy as jnp

    def mlp(prefix: str, x, final_relu: bool):
        n = sum(k.startswith(f"{prefix}_w") for k in params)
        for i in range(n):
            x = x @ params[f"{prefix}_w{i}"] + params[f"{prefix}_b{i}"][None, :]
            x = jax.nn.relu(x) if i + 1 < n or final_relu else x
        return x

    x = mlp("bottom", dense, True)  # [B, d]
    z = jnp.stack([x, *(pooled[f] for f in names)], axis=1)  # [B, F+1, d]
    n = z.shape[1]
    upper = np.flatnonzero(np.triu(np.ones((n, n), bool), k=1))  # the pairs i < j, flat
    dots = jnp.einsum("bid,bjd->bij", z, z).reshape(z.shape[0], n * n)[:, upper]
    return mlp("top", jnp.concatenate([x, dots], axis=1), False)[:, 0]


class _JaxStep:
    """One JAX variant: its state, its compiled program, its inputs; a call steps once.

    kind: one of `JAX_VARIANTS` (the module's docstring). `constant`: every table (and
    every reset row) initialised to it; `capacity_factor` and `admit_after` override the
    dynamic tables' (the equivalence check)."""

    def __init__(self, kind: str, config: DlrmStepConfig, inputs: Inputs, *,
                 constant: float | None = None, capacity_factor: int = 1,
                 admit_after: int | None = None):  # fmt: skip
        import jax
        import jax.numpy as jnp
        import optax

        import jaxembed
        from jaxembed.dynamic import DynamicTableConfig
        from jaxembed.kernels import remap, remap_native
        from jaxembed.optim import dynamic

        w = self.workload = inputs.workload
        self.kind, self.calls, self.losses, self.stats = kind, 0, [], []
        dyn = w.dynamic if kind != "static" else ()
        self.cfgs = {t: DynamicTableConfig(
            capacity=w.rows(t) * capacity_factor, bucket_size=config.bucket_size,
            admit_after=admit_after or config.admit_after, policy=config.policy,
            seed=config.seed) for t in dyn}  # fmt: skip
        opt = jaxembed.optim.rowwise_adagrad(config.table_lr, eps=config.eps)
        adam = optax.adam(config.dense_lr, eps=config.eps)
        self.engine = remap_native if remap_native.available() else remap
        key = jax.random.key(config.seed + 1)

        def init(t):  # a reset row: DLRM's uniform(±1/√rows), or the constant
            if constant is not None or kind == "dynamic[init=zeros]":
                return jax.nn.initializers.constant(constant or 0.0)
            b = w.rows(t) ** -0.5
            return lambda k, shape, dtype: jax.random.uniform(k, shape, dtype, -b, b)

        def prepare_all(dyns, row_states, ids, t):
            rows, stats = {}, {}
            for n in dyn:
                rows[n], dyns[n], row_states[n], stats[n] = dynamic.prepare(
                    self.cfgs[n], dyns[n], row_states[n], ids[n], t, initializer=init(n),
                    key=key, optimizer=opt)  # fmt: skip
            return rows, dyns, row_states, stats

        def train(state, dense, labels, ids, t):
            params, adam_state, tables, row_states, dyns = state
            tables, row_states, dyns, ids = dict(tables), dict(row_states), dict(dyns), dict(ids)
            rows, dyns, row_states, stats = prepare_all(dyns, row_states, ids, t)  # the remap
            ids.update(rows)
            tables.update({n: dyns[n].table for n in dyn})
            pooled = {n: jaxembed.embedding_bag(ids[n], tables[n], combiner="mean")
                      for n, _ in w.tables}  # [F_t * B, d] each  # fmt: skip

            def loss_fn(params, pooled):
                by_feature = {f: pooled[n][i * w.batch : (i + 1) * w.batch]  # [B, d]
                              for n, _ in w.tables
                              for i, f in enumerate(w.features_of(n))}  # fmt: skip
                logits = dense_logits(params, dense, by_feature, w.feature_names)
                return optax.sigmoid_binary_cross_entropy(logits, labels).mean()

            loss, (g_params, g_pooled) = jax.value_and_grad(loss_fn, (0, 1))(params, pooled)
            updates, adam_state = adam.update(g_params, adam_state, params)
            params = optax.apply_updates(params, updates)
            for n, _ in w.tables:
                tables[n], row_states[n] = opt.update(tables[n], row_states[n], ids[n],
                                                      g_pooled[n], combiner="mean",
                                                      after=pooled[n])  # fmt: skip
            for n in dyn:
                dyns[n] = dyns[n]._replace(table=tables.pop(n))
            return (params, adam_state, tables, row_states, dyns), loss, stats

        def prepare_only(state, dense, labels, ids, t):
            dyns, row_states = state
            _, dyns, row_states, stats = prepare_all(dict(dyns), dict(row_states), ids, t)
            return (dyns, row_states), jnp.float32(0), stats

        def remap_only(state, dense, labels, ids, t):
            out = {n: self.engine.step(self.cfgs[n], state[n], ids[n], t) for n in dyn}
            return {n: r.state for n, r in out.items()}, jnp.float32(0), {
                n: r.stats for n, r in out.items()}  # fmt: skip

        tables = {n: jnp.asarray(initial_table(r, w.dim, w.seed, w.index(n), constant))
                  for n, r in w.tables if n not in dyn}  # fmt: skip
        row_states = {n: opt.init(v) for n, v in tables.items()}
        dyns = {n: dynamic.init_table(self.cfgs[n], w.dim) for n in dyn}
        row_states.update({n: opt.init(dyns[n].table) for n in dyn})
        params = {k: jnp.asarray(v) for k, v in inputs.dense_params.items()}
        fn = {"prepare_only": prepare_only, "remap_only": remap_only}.get(kind, train)
        if kind in TRAINING:
            self.state = (params, adam.init(params), tables, row_states, dyns)
        elif kind == "prepare_only":
            self.state = ({n: dyns[n] for n in dyn}, {n: row_states[n] for n in dyn})
        else:
            self.state = {n: dyns[n].state for n in dyn}
        self.inputs = [self._device_inputs(b, dyn) for b in inputs.batches]
        self.compiled = jax.jit(fn, donate_argnums=0).lower(
            self.state, *self.inputs[0], jnp.int32(0)).compile()  # fmt: skip

    @staticmethod
    def _device_inputs(batch: dict[str, np.ndarray], dyn: tuple[str, ...]) -> tuple:
        import jax.numpy as jnp

        from jaxembed.dynamic.keys import keys_to_host

        ids = {}
        for key, a in batch.items():
            if key.startswith("ids_") and key[4:] not in dyn:
                ids[key[4:]] = jnp.asarray(a)
            elif key.startswith("raw_") and key[4:] in dyn:  # the padding id: -1, EMPTY_ID
                ids[key[4:]] = jnp.asarray(keys_to_host(a, check=False))
        return jnp.asarray(batch["dense"]), jnp.asarray(batch["labels"]), ids

    def __call__(self) -> Any:
        import jax
        import jax.numpy as jnp

        x = self.inputs[self.calls % len(self.inputs)]
        self.state, loss, stats = self.compiled(self.state, *x, jnp.int32(self.calls))
        self.calls += 1
        jax.block_until_ready((self.state, loss, stats))
        self.losses.append(loss)
        self.stats.append(stats)
        return loss


def _stats_sum(step: _JaxStep) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for stats in step.stats:
        for table, s in stats.items():
            acc = out.setdefault(table, {})
            for k, v in s._asdict().items():
                acc[k] = acc.get(k, 0) + int(v)
    return out


def check_equivalence(config: DlrmStepConfig, inputs: Inputs) -> dict[str, Any]:
    """The dynamic step against the static one, every table one constant, `admit_after=1`,
    capacity `check_capacity_factor` x rows: losses equal, and every seen id's row and
    accumulator equal its static row's (the tables up to the remap's row permutation)."""
    from jaxembed.optim import dynamic

    steps = {kind: _JaxStep(kind, config, inputs, constant=0.01, admit_after=1,
                            capacity_factor=config.check_capacity_factor)
             for kind in ("static", "dynamic")}  # fmt: skip
    for _ in range(config.check_steps):
        for s in steps.values():
            s()
    static, dyn = steps["static"], steps["dynamic"]
    loss_diff = max(abs(float(a) - float(b)) for a, b in zip(static.losses, dyn.losses,
                                                             strict=True))  # fmt: skip
    stats = _stats_sum(dyn)
    out: dict[str, Any] = {
        "steps": config.check_steps,
        "constant": 0.01,
        "admit_after": 1,
        "capacity_factor": config.check_capacity_factor,
        "max_abs_loss_diff": loss_diff,
        "stats": stats,
        "no_evictions_or_refusals": all(
            s["evicted"] == 0 and s["refused"] == 0 for s in stats.values()
        ),
    }
    w = inputs.workload
    table_diff = acc_diff = 0.0
    _, _, tables, row_states, dyns = dyn.state
    s_tables, s_rows = static.state[2], static.state[3]
    for n in w.dynamic:
        batches = inputs.batches[: config.check_steps]
        seen = np.unique(np.concatenate([b[f"ids_{n}"].ravel() for b in batches]))
        seen = seen[seen >= 0]
        raw = raw_ids(seen, w.index(n), w.seed)
        rows = np.asarray(dynamic.rows_for(dyn.cfgs[n], dyns[n], raw))
        has = rows < dyn.cfgs[n].capacity  # an id without a row reads zeros: compare those
        table = np.concatenate([np.asarray(dyns[n].table), np.zeros((1, w.dim), np.float32)])
        mine, ref = table[rows], np.asarray(s_tables[n])[seen]
        table_diff = max(table_diff, float(np.abs(mine - ref).max()))
        out.setdefault("rows_trained", {})[n] = int((mine != np.float32(0.01)).any(axis=1).sum())
        a = np.append(np.asarray(row_states[n].slots["accumulator"]), 0.0)[rows]
        b = np.asarray(s_rows[n].slots["accumulator"])[seen]
        acc_diff = max(acc_diff, float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)))
        out.setdefault("ids_seen", {})[n] = int(seen.size)
        out.setdefault("all_seen_have_rows", {})[n] = bool(has.all())
    for n, t in tables.items():  # the static tables of both variants
        table_diff = max(table_diff, float(np.abs(np.asarray(t) - np.asarray(s_tables[n])).max()))
    out.update(max_abs_table_diff=table_diff, max_rel_accumulator_diff=acc_diff)
    out["equal"] = bool(loss_diff <= 1e-5 and table_diff <= 1e-5 and acc_diff <= 1e-4
                        and all(out["all_seen_have_rows"].values()))  # fmt: skip
    del steps
    return out


# --- the TorchRec child ------------------------------------------------------------------------


class _Child:
    """`torchrec_mch_runner` in a subprocess: one JSON line each way."""

    def __init__(self, path: str, variants: Sequence[str], threads: int, timeout_s: float):
        self.timeout_s = timeout_s
        self.err = tempfile.TemporaryFile("w+")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [REPO, *filter(None, [os.environ.get("PYTHONPATH")])])}  # fmt: skip
        cmd = [sys.executable, "-m", "benchmarks.dynamic.torchrec_mch_runner", "--inputs", path,
               "--threads", str(threads), "--variants", *variants]  # fmt: skip
        pipe = subprocess.PIPE
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=pipe, stdout=pipe,
                                     stderr=self.err, text=True)  # fmt: skip
        self.ready = self._read()

    def _read(self) -> dict[str, Any]:
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            self.proc.wait()
            self.err.seek(0)
            tail = self.err.read()[-2000:]
            raise RuntimeError(
                f"the TorchRec child (exit {self.proc.returncode}) gave no answer within "
                f"{self.timeout_s:.0f} s; its stderr ends:\n{tail}"
            )
        return json.loads(line)

    def ask(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def runner(self, variant: str, samples: list[dict[str, float]]) -> Callable[[], None]:
        return lambda: samples.append(self.ask({"op": "step", "variant": variant}))

    def close(self) -> None:
        """Ends the child (after an error here)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def finish(self) -> dict[str, Any]:
        record = self.ask({"op": "finish"})["record"]
        self.proc.wait(timeout=60)
        return record


# --- the run -----------------------------------------------------------------------------------


def _summary(wall: Sequence[float], cpu: Sequence[float] | None) -> dict[str, Any]:
    out = time_record(wall)
    out["time_mean_in_ms"] = round(float(np.mean(wall)) * 1e3, 4)
    if cpu is not None:
        out["cpu_time_median_in_ms"] = round(float(np.median(cpu)) * 1e3, 4)
        out["cpu_time_mean_in_ms"] = round(float(np.mean(cpu)) * 1e3, 4)
    return out


def _paired(mine: Sequence[float], base: Sequence[float]) -> float | None:
    """The median over rounds of mine / base (None unless both have one sample a round)."""
    if not len(mine) or len(mine) != len(base):
        return None
    return round(float(np.median(np.asarray(mine) / np.asarray(base))), 4)


def _losses(values: Sequence[float], timed: int) -> dict[str, Any]:
    v = np.asarray([float(x) for x in values], np.float64)
    k = max(1, min(5, v.size // 4))
    return {"first": round(float(v[0]), 5), "last": round(float(v[-1]), 5), "calls": int(v.size),
            "timed": timed, "finite": bool(np.isfinite(v).all()),
            "falls": bool(v[-k:].mean() < v[:k].mean())}  # fmt: skip


def _jax_results(steps: dict[str, _JaxStep], timed: dict[str, Any]) -> tuple[dict, dict]:
    """Per JAX variant: its timed wall seconds, and its record (times, losses, remap stats)."""
    wall, variants = {}, {}
    for name, step in steps.items():
        wall[name], cpu = timed[name]["step"]
        variants[name] = _summary(wall[name], cpu)
        if name in TRAINING:
            variants[name]["losses"] = _losses(step.losses, len(wall[name]))
        if name != "static":
            variants[name]["stats"] = _stats_sum(step)
    return wall, variants


def _torchrec_result(
    name: str, samples: list[dict], round_trips: list[float], summary: dict, p: TimingPolicy
) -> tuple[list[float], dict]:
    """A TorchRec variant's timed wall seconds (the child's own) and its record."""
    got = samples[p.warmup + p.settle :: 1 + p.settle]  # the timed calls
    wall = [s["wall_s"] for s in got]
    out = _summary(wall, [s["cpu_s"] for s in got])
    if name in MEAN_VARIANTS:  # every call after warm-up: whole eviction intervals
        every = samples[p.warmup :]
        for key, part in (("time_mean_in_ms", "wall_s"), ("cpu_time_mean_in_ms", "cpu_s")):
            out[key] = round(float(np.mean([s[part] for s in every])) * 1e3, 4)
        out["mean_over_calls"] = len(every)
    out["round_trip_median_in_ms"] = round(float(np.median(round_trips)) * 1e3, 4)
    summary = dict(summary)
    out["losses"] = _losses(summary.pop("losses"), len(wall))
    out.update(summary)
    return wall, out


def _add_ratios(variants: dict[str, Any], wall: dict[str, list[float]]) -> None:
    """Each variant's ratios to `static` and `dynamic`: of medians (of means for the bimodal
    ones), paired (the median of per-round ratios) and of CPU times."""
    for name, v in variants.items():
        for base in ("static", "dynamic"):
            if name == base:
                continue
            key = "time_mean_in_ms" if name in MEAN_VARIANTS else "time_median_in_ms"
            cpu = key.replace("time_", "cpu_time_", 1)
            v[f"ratio_to_{base}"] = round(v[key] / variants[base][key], 4)
            mean = name in MEAN_VARIANTS
            v[f"paired_ratio_to_{base}"] = None if mean else _paired(wall[name], wall[base])
            v[f"cpu_ratio_to_{base}"] = round(v[cpu] / variants[base][cpu], 4)


def run_dlrm_step(config: DlrmStepConfig | None = None,
                  say: Callable[[str], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """Builds every variant, checks the dynamic step against the static one, times them all.

    Returns:
      `{"schema", "machine", "config", "workload", "check", "variants", "torchrec",
      "targets"}`: per variant its times (`time_median_in_ms`, `_p90_`, `_mean_`, samples),
      the ratios to `static` and `dynamic`, and its losses' summary.
    """
    from benchmarks.common.report import machine
    from jaxembed.kernels import native

    config = DlrmStepConfig() if config is None else config
    say = say or (lambda message: None)
    w = workload(config)
    p = config.timing
    count = p.warmup + p.repeats * (1 + p.settle)
    threads = config.threads or native.num_threads()
    record: dict[str, Any] = {
        "schema": SCHEMA,
        "machine": {**machine(), "jax_devices_used": 1, "native_threads": native.num_threads(),
                    "xla_cpu_threads": len(os.sched_getaffinity(0)), "torch_threads": threads,
                    "load_average": list(os.getloadavg())},
        "config": {**dataclasses.asdict(config), "timing": dataclasses.asdict(p)},
        "workload": {"tables": dict(w.tables), "features": dict(w.features),
                     "dynamic": list(w.dynamic), "batch": w.batch, "dim": w.dim,
                     "batches": count, "rows_total": sum(r for _, r in w.tables)},
    }  # fmt: skip
    say(f"making {count} batches")
    inputs = Inputs(
        w,
        make_batches(config, w, count),
        initial_dense(w),
        {"table": config.table_lr, "dense": config.dense_lr, "eps": config.eps},
    )
    if config.check_steps:
        say(f"equivalence check: {config.check_steps} steps, constant tables")
        record["check"] = check_equivalence(config, inputs)
    runners: dict[str, Any] = {}
    say("compiling the JAX variants")
    steps = {kind: _JaxStep(kind, config, inputs) for kind in JAX_VARIANTS}
    record["engine"] = steps["dynamic"].engine.__name__.rsplit(".", 1)[-1]
    runners.update({kind: {"step": s} for kind, s in steps.items()})
    child, child_samples = None, {}
    if config.torchrec:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "inputs.npz")
            save_inputs(path, inputs)
            say(f"starting the TorchRec child ({', '.join(config.torchrec)})")
            try:
                child = _Child(path, config.torchrec, threads, timeout_s=600)
            except RuntimeError as err:
                record["torchrec"] = {"not_run": str(err)}
        if child is not None:
            for v in config.torchrec:
                child_samples[v] = []
                runners[v] = {"step": child.runner(v, child_samples[v])}
    say(f"timing {len(runners)} variants, {p.repeats} rounds")
    load_before = os.getloadavg()
    try:
        timed = time_interleaved(runners, p)
    except BaseException:
        if child is not None:
            child.close()
        raise
    load_after = os.getloadavg()
    record["machine"]["load_average_during"] = [round(x, 2) for x in (*load_before, *load_after)]
    wall, variants = _jax_results(steps, timed)
    if child is not None:
        info = child.finish()
        record["torchrec"] = {k: v for k, v in info.items() if k != "variants"}
        for name in config.torchrec:
            wall[name], variants[name] = _torchrec_result(
                name, child_samples[name], timed[name]["step"][0], info["variants"][name], p
            )
    _add_ratios(variants, wall)
    record["variants"] = variants
    first = variants.get("torchrec_static", {}).get("losses", {}).get("first")
    if first is not None:
        record["first_static_loss_vs_torchrec"] = {
            "jax": variants["static"]["losses"]["first"], "torchrec": first,
            "equal": abs(first - variants["static"]["losses"]["first"]) <= 1e-4}  # fmt: skip
    record["targets"] = targets(record)
    return record


def targets(record: dict[str, Any]) -> dict[str, Any]:
    """t(dynamic)/t(static) <= 1.15 and t(torchrec_mch)/t(dynamic) >= 3, each a ratio of
    medians (the paired and the CPU-time ratios beside it); the remap's share and the other
    ratios with no threshold."""
    v = record["variants"]
    out: dict[str, Any] = {"at_target_shapes": not record["config"]["quick"]}
    rows = [
        ("dynamic", "static", TARGET_DYNAMIC, "<=", "median step, one device"),
        ("dynamic[init=zeros]", "static", None, "<=", "diagnostic: reset rows not drawn"),
        ("torchrec_mch", "dynamic", TARGET_TORCHREC, ">=",
         "median step; MCH (LRU, eviction every step) + fused EBC"),
        ("torchrec_mcebc", "dynamic", None, ">=", "median step; the documented MC-EBC"),
        ("torchrec_mch[interval=10]", "dynamic", None, ">=", "mean step (bimodal)"),
        ("torchrec_static", "static", None, ">=", "TorchRec's static step against ours"),
        ("prepare_only", "dynamic", None, "<=", "the remap + reset's share of the step"),
        ("remap_only", "dynamic", None, "<=", "the remap kernels' share of the step"),
    ]  # fmt: skip
    for name, base, threshold, sense, where in rows:
        if name not in v:
            continue
        value = v[name][f"ratio_to_{base}"]
        met = None if threshold is None else (
            value <= threshold if sense == "<=" else value >= threshold)  # fmt: skip
        out[f"{name} / {base}"] = {
            "value": value, "paired": v[name][f"paired_ratio_to_{base}"],
            "cpu": v[name][f"cpu_ratio_to_{base}"], "threshold": threshold, "sense": sense,
            "met": met, "where": where,
        }  # fmt: skip
    if "torchrec_mch" in v and "torchrec_static" in v:
        ratio = lambda key: round(v["torchrec_mch"][key] / v["torchrec_static"][key], 4)
        out["torchrec_mch / torchrec_static"] = {
            "value": ratio("time_median_in_ms"), "paired": None,
            "cpu": ratio("cpu_time_median_in_ms"), "threshold": None, "sense": "", "met": None,
            "where": "TorchRec's own dynamic / static",
        }  # fmt: skip
    check = record.get("check")
    out["equivalence"] = None if check is None else check["equal"]
    out["losses_finite_and_falling"] = all(
        x["losses"]["finite"] and x["losses"]["falls"] for x in v.values() if "losses" in x
    )
    return out


def tables(record: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """The record as (title, headers, rows) tables: the variants, the targets, the check."""
    m, w, cfg = record["machine"], record["workload"], record["config"]
    title = (f"dynamic dlrm step: {len(w['features'])} features, {len(w['tables'])} tables "
             f"({w['rows_total']:,} rows), {', '.join(w['dynamic'])} dynamic "
             f"({cfg['policy']}, admit_after={cfg['admit_after']}, bucket {cfg['bucket_size']}), "
             f"batch {w['batch']}, dim {w['dim']}; 1 CPU device of {m['cpu_count']} cores, "
             f"native threads {m['native_threads']}, torch threads {m['torch_threads']}; "
             f"jax {m['jax']}")  # fmt: skip
    f = lambda x, spec="{:.2f}": "-" if x is None else spec.format(x)
    headers = [
        "variant",
        "median ms",
        "p90 ms",
        "mean ms",
        "min ms",
        "cpu ms",
        "x static",
        "x static (paired)",
        "x dynamic",
        "x dynamic (paired)",
        "loss first -> last",
    ]
    rows = []
    for name, v in record["variants"].items():
        loss = v.get("losses")
        rows.append(
            [
                name,
                f(v["time_median_in_ms"]),
                f(v["time_p90_in_ms"]),
                f(v["time_mean_in_ms"]),
                f(v["time_min_in_ms"]),
                f(v.get("cpu_time_median_in_ms")),
                f(v.get("ratio_to_static")),
                f(v.get("paired_ratio_to_static")),
                f(v.get("ratio_to_dynamic")),
                f(v.get("paired_ratio_to_dynamic")),
                "-" if loss is None else f"{loss['first']:.4f} -> {loss['last']:.4f}",
            ]
        )
    t = record["targets"]
    target_rows = [[k, f(x["value"]), f(x["paired"]), f(x["cpu"]),
                    "-" if x["threshold"] is None else f"{x['sense']} {x['threshold']}",
                    "-" if x["met"] is None else "yes" if x["met"] else "NO", x["where"]]
                   for k, x in t.items() if isinstance(x, dict)]  # fmt: skip
    for what, key in (
        ("dynamic = static up to row permutation (constant init, admit_after=1)", "equivalence"),
        ("every variant's loss finite and falling", "losses_finite_and_falling"),
    ):
        target_rows.append([what, str(t[key]), "", "", "", "", ""])  # fmt: skip
    quick = "" if t["at_target_shapes"] else " (quick shapes: indicative only)"
    heads = ["ratio", "of medians", "paired", "cpu time", "threshold", "met", "where"]
    out = [(title, headers, rows), (f"dynamic dlrm targets{quick}", heads, target_rows)]
    check = record.get("check")
    if check:
        out.append(("equivalence check", ["steps", "capacity factor", "max |loss diff|",
                                          "max |table diff|", "max rel accumulator diff",
                                          "no evictions or refusals", "equal"],
                    [[str(check["steps"]), str(check["capacity_factor"]),
                      f"{check['max_abs_loss_diff']:.3g}", f"{check['max_abs_table_diff']:.3g}",
                      f"{check['max_rel_accumulator_diff']:.3g}",
                      str(check["no_evictions_or_refusals"]), str(check["equal"])]]))  # fmt: skip
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m benchmarks.dynamic.dlrm_step [--quick] [--json PATH] [--markdown PATH] ...`."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.dynamic.dlrm_step",
        description="The DLRM step with its two largest tables dynamic, against static tables "
        "and TorchRec's managed-collision modules, on one CPU device.",
    )
    p.add_argument("--quick", action="store_true", help="tiny shapes, two rounds (for tests)")
    p.add_argument("--json", metavar="PATH", help="write the record as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write the tables as Markdown")
    p.add_argument("--batch", type=int, help="examples a step (default 512)")
    p.add_argument("--admit-after", type=int, help="the dynamic tables' (default 2)")
    p.add_argument("--repeats", type=int, help="interleaved rounds (default 30)")
    p.add_argument("--check-steps", type=int, help="the equivalence check's steps (0: none)")
    p.add_argument("--no-torchrec", action="store_true", help="the JAX variants only")
    p.add_argument("--torchrec", nargs="+", choices=TORCHREC_VARIANTS, help="these only")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    config = QUICK if args.quick else DlrmStepConfig()
    changes: dict[str, Any] = {k: v for k, v in (
        ("batch", args.batch), ("admit_after", args.admit_after),
        ("check_steps", args.check_steps)) if v is not None}  # fmt: skip
    if args.repeats:
        changes["timing"] = dataclasses.replace(
            config.timing,
            repeats=args.repeats,
            min_samples=min(args.repeats, config.timing.min_samples),
        )
    if args.no_torchrec or args.torchrec:
        changes["torchrec"] = () if args.no_torchrec else tuple(args.torchrec)
    config = dataclasses.replace(config, **changes)
    start = time.perf_counter()
    say = lambda m: print(f"[{time.perf_counter() - start:7.1f}s] {m}", file=sys.stderr)
    record = run_dlrm_step(config, say)
    from benchmarks.common.report import markdown_tables, print_table_list, write_outputs

    table_list = tables(record)
    print_table_list("jaxembed bench dynamic-dlrm", table_list)
    write_outputs(record, json_path=args.json, markdown_path=args.markdown,
                  markdown=lambda: markdown_tables(table_list))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
