"""`jaxembed bench sparse`: a training step whose cost follows the batch, not the table.

Each implementation runs the same step (forward, backward for a fixed cotangent, optimizer
update; table and optimizer state donated):

* `sparse`: `out = jaxembed.embedding(ids, t)`, then `t, s = opt.update(t, s, ids, g)` with
  a row-sparse `jaxembed.optim` optimizer: only the touched rows are read and written;
* `dense`: `jaxembed.embedding` under `jax.vjp` and optax's dense optimizer of the same
  formula (a gradient buffer of the table's shape, and every row updated);
* `xla`: `jnp.take(t, ids, mode="clip")` partitioned by XLA (Auto mesh) and optax.

It measures (1) a vocabulary sweep on `rows-on-model` ((data=2, model=4), rows on `model`,
ids on `data`) with SGD and with row-wise Adagrad (against `optax.adagrad` with a zero
initial accumulator and eps 0, an element-wise formula: same cost class, not the same
numbers), and (2) the five main layouts of `jaxembed bench` at one vocabulary with SGD.

    jaxembed bench sparse --quick --json /tmp/sparse.json
    jaxembed bench sparse --json benchmarks/results/rowsparse/sparse.json \\
        --markdown benchmarks/results/rowsparse/sparse.md --plot benchmarks/results/rowsparse
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxembed
from benchmarks.common import variants as harness
from benchmarks.common.timing import TimingPolicy
from benchmarks.layouts.cases import LAYOUTS, MAIN_LAYOUTS, Layout
from benchmarks.layouts.impls import make_mesh

__all__ = ["QUICK", "SparseConfig", "main", "run_sparse", "targets"]

SCHEMA = "benchmarks.rowsparse.bench/1"
ROWWISE_EPS = 1e-8


@dataclasses.dataclass(frozen=True)
class SparseConfig:
    """What `run_sparse` measures.

    Attributes:
      vocab_sweep: vocabularies of the sweep on `rows-on-model`.
      optimizers: of the sweep: `sgd` and/or `rowwise_adagrad`.
      layouts: the layouts compared at `layout_vocab` (SGD, with XLA).
      layout_vocab: their vocabulary.
      hidden: the table's hidden size.
      ids_shape: `[B, S]`.
      learning_rate: every optimizer's.
      seed: of the ids and cotangents.
      timing: the timing policy of each group.
      memory_budget_bytes: what a group's variants may hold together (None: 60% of the
        memory available when the group starts); a variant that does not fit is compiled
        and measured from its HLO, not run.
      quick: tiny shapes (a label for the record).
    """

    vocab_sweep: tuple[int, ...] = (16384, 65536, 262144, 1048576, 4194304)
    optimizers: tuple[str, ...] = ("sgd", "rowwise_adagrad")
    layouts: tuple[str, ...] = MAIN_LAYOUTS
    layout_vocab: int = 65536
    hidden: int = 128
    ids_shape: tuple[int, int] = (16, 128)
    learning_rate: float = 0.1
    seed: int = 0
    timing: TimingPolicy = harness.TIMING
    memory_budget_bytes: int | None = None
    quick: bool = False


QUICK = SparseConfig(
    vocab_sweep=(4096, 32768),
    layout_vocab=8192,
    hidden=16,
    ids_shape=(8, 16),
    timing=harness.QUICK_TIMING,
    quick=True,
)
"""Tiny shapes: every code path in seconds; timings mean nothing."""


# --- the three implementations -------------------------------------------------------------------


def _no_fallback():
    return jnp.zeros((), jnp.int32)


def _grad_of(out, ct):
    return jnp.where(jnp.isfinite(out), ct, 0.0)  # reads the forward, equals ct


def _sparse(layout: Layout, vocab: int, hidden: int, optimizer: str, lr: float) -> harness.Variant:
    mesh = make_mesh(layout, AxisType.Explicit)
    spec = P(*tuple(layout.table_spec) + (None,) * (2 - len(tuple(layout.table_spec))))
    opt = (jaxembed.optim.sgd(lr) if optimizer == "sgd"
           else jaxembed.optim.rowwise_adagrad(lr, eps=ROWWISE_EPS))  # fmt: skip
    kw = {"out_spec": layout.out_spec}

    def step(state, ids, ct):
        table, opt_state = state
        out, stats = jaxembed.embedding(ids, table, return_stats=True, **kw)
        table, opt_state = opt.update(table, opt_state, ids, _grad_of(out, ct), **kw)
        return (table, opt_state), out, stats.routed_fallback

    scalar = harness.abstract((), jnp.int32, mesh, P())
    slots = {s.name: harness.abstract(s.shape(vocab, hidden), jnp.float32, mesh,
                                 P(spec[0]) if s.per_row else spec)
             for s in opt.formula.slots}  # fmt: skip
    table = harness.abstract((vocab, hidden), jnp.float32, mesh, spec)
    state = (table, jaxembed.optim.RowSparseState(scalar, slots, scalar))

    def init():
        t = harness.init_table((vocab, hidden), mesh, spec)
        return (t, opt.init(t))

    specs = {"ids": layout.ids_spec, "ct": layout.out_spec}
    eps = ROWWISE_EPS if optimizer != "sgd" else 0.0
    return harness.Variant("sparse", mesh, step, state, init, specs, optimizer, eps=eps)


def _optax(optimizer: str, lr: float) -> tuple[optax.GradientTransformation, str]:
    if optimizer == "sgd":
        return optax.sgd(lr), "sgd"
    return optax.adagrad(lr, initial_accumulator_value=0.0, eps=0.0), "adagrad"


def _dense_state(mesh, spec, vocab, hidden, tx):
    sharding = NamedSharding(mesh, spec)
    table = jax.ShapeDtypeStruct((vocab, hidden), jnp.float32, sharding=sharding)
    opt_state = jax.eval_shape(tx.init, jax.ShapeDtypeStruct((vocab, hidden), jnp.float32))
    opt_state = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), opt_state
    )
    return (table, opt_state), sharding


def _dense(layout: Layout, vocab: int, hidden: int, optimizer: str, lr: float, *, xla: bool):
    axis_type = AxisType.Auto if xla else AxisType.Explicit
    mesh = make_mesh(layout, axis_type)
    spec = P(*tuple(layout.table_spec) + (None,) * (2 - len(tuple(layout.table_spec))))
    tx, formula = _optax(optimizer, lr)
    state, sharding = _dense_state(mesh, spec, vocab, hidden, tx)

    def lookup(w, ids):  # -> (out, fallback flag)
        if xla:
            return jnp.take(w, ids, axis=0, mode="clip"), _no_fallback()
        out, stats = jaxembed.embedding(ids, w, out_spec=layout.out_spec, return_stats=True)
        return out, stats.routed_fallback

    def step(state, ids, ct):
        table, opt_state = state
        out, vjp, fallback = jax.vjp(lambda w: lookup(w, ids), table, has_aux=True)
        (grad,) = vjp(_grad_of(out, ct))
        updates, opt_state = tx.update(grad, opt_state, table)
        return (optax.apply_updates(table, updates), opt_state), out, fallback

    def init():
        t = harness.init_table((vocab, hidden), mesh, spec)
        with jax.set_mesh(mesh):
            s = jax.jit(tx.init, out_shardings=jax.tree.map(lambda _: sharding, state[1]))(t)
        return (t, s)

    out_shardings = None
    if xla:
        out_shardings = (
            jax.tree.map(lambda _: sharding, state),
            NamedSharding(mesh, layout.out_spec),
            NamedSharding(mesh, P()),
        )
    return harness.Variant("xla" if xla else "dense", mesh, step, state, init,
                      {"ids": layout.ids_spec, "ct": layout.out_spec}, formula,
                      out_shardings=out_shardings)  # fmt: skip


# --- groups --------------------------------------------------------------------------------------


def _plan_info(layout: Layout, vocab: int, hidden: int, ids_shape) -> dict[str, Any]:
    mesh = jax.sharding.AbstractMesh(
        layout.mesh_shape,
        layout.mesh_axes,
        axis_types=(AxisType.Explicit,) * len(layout.mesh_shape),
    )
    plan = jaxembed.plan_embedding(
        mesh, ids_shape, (vocab, hidden), x_spec=layout.ids_spec,
        weight_spec=layout.table_spec, out_spec=layout.out_spec, update=True,
    )  # fmt: skip
    return {"exchange": plan.exchange, "exchange_reason": plan.exchange_reason}


def _group(config: SparseConfig, layout: Layout, vocab: int, optimizer: str, names, say):
    """Compiles, checks and times one group; returns its point of the record."""
    hidden, ids_shape, lr = config.hidden, config.ids_shape, config.learning_rate
    builders = {
        "sparse": lambda: _sparse(layout, vocab, hidden, optimizer, lr),
        "dense": lambda: _dense(layout, vocab, hidden, optimizer, lr, xla=False),
        "xla": lambda: _dense(layout, vocab, hidden, optimizer, lr, xla=True),
    }
    variants = [builders[n]() for n in names]
    ids_text = "x".join(map(str, ids_shape))
    point: dict[str, Any] = {
        "name": f"vocab={vocab},hidden={hidden},ids={ids_text},mesh={layout.mesh_text},"
                f"layout={layout.name},optimizer={optimizer}",
        "layout": layout.name, "vocab": vocab, "hidden": hidden, "ids_shape": list(ids_shape),
        "optimizer": optimizer,
        "dense_optimizer": ("optax.sgd" if optimizer == "sgd" else
                            "optax.adagrad(initial_accumulator_value=0, eps=0)"),
        "plan": _plan_info(layout, vocab, hidden, ids_shape),
    }  # fmt: skip
    rng = np.random.default_rng([config.seed, vocab])
    ids = rng.integers(0, vocab, size=ids_shape, dtype=np.int32)
    ct = harness.exact_cotangent(rng, (*ids_shape, hidden))
    host = {"ids": ids, "ct": ct}
    say(f"{layout.name} V={vocab} {optimizer}: compiling {', '.join(names)}")
    harness.compile_group(variants, host)
    admitted = harness.admit(variants, harness.memory_budget(config.memory_budget_bytes))
    try:
        for v in admitted:
            v.state = v.init_state()
        say(f"{layout.name} V={vocab} {optimizer}: checking and timing")
        harness.run_checked(admitted, harness.Reference.lookup(ids, ct, lr), host, config.seed)
        harness.time_group(admitted, config.timing)
    finally:
        for v in variants:
            v.release()
    point["implementations"] = {v.name: v.result for v in variants}
    impls = point["implementations"]
    t = {n: harness.median_ms(impls.get(n)) for n in names}
    point["summary"] = {
        "sparse_time_ratio_to_dense": harness.ratio(t.get("sparse"), t.get("dense")),
        "sparse_time_ratio_to_xla": harness.ratio(t.get("sparse"), t.get("xla")),
        "sparse_temp_ratio_to_dense": harness.ratio(
            impls["sparse"].get("temp_bytes"), impls.get("dense", {}).get("temp_bytes")
        ),
    }
    return point


def run_sparse(config: SparseConfig | None = None, *, say=None) -> dict[str, Any]:
    """Runs `jaxembed bench sparse` and returns its record (JSON-ready).

    Args:
      config: what to measure (default `SparseConfig()`; `QUICK` for tiny shapes).
      say: called with a line of progress now and then.

    Returns:
      `{"schema", "machine", "config", "vocab_sweep": [point, ...], "layouts": [point, ...],
      "targets"}`; a point has per implementation its status, wire bytes and collectives
      from the compiled HLO, memory from `memory_analysis()`, compile time, the reference
      check and its times (`time_median_in_ms`, `time_p90_in_ms`), or `not_run` with why.

    Raises:
      ValueError: an unknown optimizer or layout, or fewer than 8 devices.
    """
    from benchmarks.common.report import machine as _machine

    config = SparseConfig() if config is None else config
    bad = [o for o in config.optimizers if o not in ("sgd", "rowwise_adagrad")]
    bad += [n for n in config.layouts if n not in LAYOUTS]
    if bad:
        raise ValueError(f"unknown optimizers or layouts {bad}: optimizers sgd, "
                         f"rowwise_adagrad; layouts {', '.join(LAYOUTS)}")  # fmt: skip
    if len(jax.devices()) < 8:
        raise ValueError(f"bench sparse needs 8 devices, found {len(jax.devices())}: set "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=8")  # fmt: skip
    say = say or (lambda message: None)
    record: dict[str, Any] = {"schema": SCHEMA, "machine": _machine(),
                              "config": harness.config_record(config)}  # fmt: skip
    sweep_layout = LAYOUTS["rows-on-model"]
    record["vocab_sweep"] = [
        _group(config, sweep_layout, vocab, optimizer, ("sparse", "dense"), say)
        for vocab in config.vocab_sweep
        for optimizer in config.optimizers
    ]
    record["layouts"] = [
        _group(config, LAYOUTS[name], config.layout_vocab, "sgd", ("sparse", "dense", "xla"), say)
        for name in config.layouts
    ]
    record["targets"] = targets(record)
    return record


def targets(record: dict[str, Any]) -> dict[str, Any]:
    """The row-sparse step's targets, evaluated on a record.

    * the sparse SGD step at the largest vocabulary takes at most 1.3x its time at the
      smallest, and at most 1.2x its temp memory;
    * at V = 1M (else the largest V where both ran) sparse <= 0.2x dense;
    * over the layouts, the geometric mean of sparse / XLA <= 0.4.
    """
    out: dict[str, Any] = {"at_target_shapes": not record["config"]["quick"]}
    sgd = [p for p in record["vocab_sweep"] if p["optimizer"] == "sgd"]
    ran = [p for p in sgd if harness.median_ms(p["implementations"]["sparse"]) is not None]
    if len(ran) >= 2:
        lo, hi = ran[0], ran[-1]
        t = harness.ratio(harness.median_ms(hi["implementations"]["sparse"]),
                     harness.median_ms(lo["implementations"]["sparse"]))  # fmt: skip
        out["sparse_time_flat_in_vocab"] = {
            "vocabs": [lo["vocab"], hi["vocab"]], "value": t, "threshold": 1.3,
            "met": t is not None and t <= 1.3,
        }  # fmt: skip
    compiled = [p for p in sgd if "temp_bytes" in p["implementations"]["sparse"]]
    if len(compiled) >= 2:
        lo, hi = compiled[0], compiled[-1]
        m = harness.ratio(hi["implementations"]["sparse"]["temp_bytes"],
                     lo["implementations"]["sparse"]["temp_bytes"])  # fmt: skip
        out["sparse_temp_flat_in_vocab"] = {
            "vocabs": [lo["vocab"], hi["vocab"]], "value": m, "threshold": 1.2,
            "met": m is not None and m <= 1.2,
        }  # fmt: skip
    both = [p for p in sgd if p["summary"]["sparse_time_ratio_to_dense"] is not None]
    at = [p for p in both if p["vocab"] == 2**20] or both[-1:]
    if at:
        value = at[0]["summary"]["sparse_time_ratio_to_dense"]
        out["sparse_vs_dense"] = {"vocab": at[0]["vocab"], "value": value, "threshold": 0.2,
                                  "met": value <= 0.2}  # fmt: skip
    per_layout = {p["layout"]: p["summary"]["sparse_time_ratio_to_xla"] for p in record["layouts"]}
    geo = harness.geomean(list(per_layout.values()))
    out["sparse_vs_xla_geomean"] = {"per_layout": per_layout, "geomean": geo, "threshold": 0.4,
                                    "met": geo is not None and geo <= 0.4}  # fmt: skip
    out["all_agree_with_reference"] = harness.all_agree(
        (*record["vocab_sweep"], *record["layouts"])
    )
    return out


def main(argv: list[str]) -> int:
    """`jaxembed bench sparse [--quick] [--json PATH] [--plot DIR] [--markdown PATH] ...`."""
    p = harness.parser("jaxembed bench sparse",
                  "Row-sparse training step against jaxembed + optax and XLA + optax: time and "
                  "temp memory against the vocabulary, and per layout.")  # fmt: skip
    p.add_argument("--vocab-sweep", nargs="+", type=int, metavar="N", help="the sweep's V")
    p.add_argument("--optimizers", nargs="+", choices=("sgd", "rowwise_adagrad"))
    args = p.parse_args(argv)
    config = QUICK if args.quick else SparseConfig()
    changes = harness.common_changes(args, config)
    if args.vocab_sweep:
        changes["vocab_sweep"] = tuple(args.vocab_sweep)
    if args.optimizers:
        changes["optimizers"] = tuple(args.optimizers)
    config = dataclasses.replace(config, **changes)
    from benchmarks.rowsparse import report

    return harness.run_and_finish("jaxembed bench sparse", run_sparse, config, args,
                             report.sparse_tables, report.plot_sparse)  # fmt: skip
