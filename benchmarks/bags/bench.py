"""`jaxembed bench bags`: pooled lookups, pooled before they communicate.

B bags of 1 to 20 Zipf ids each (hot ids are the low ids, as `jaxembed.workloads`
draws them) read one table of V rows split over the devices. Each implementation runs a
training step: the sum-pooled lookup, the backward for a fixed cotangent of the pooled
output, and an SGD update (table and state donated):

* `jaxembed`: `jaxembed.embedding_bag(ids [B, L], t)` (the dense form: -1 pads a bag) and
  the row-sparse `jaxembed.optim.sgd` update with the same bags; `jaxembed[rows]` forces the
  gather exchange where the plan picks another; `jaxembed[mod]` stores the table in mod row
  order (`jaxembed.to_mod_order`), which spreads the hot ids over the shards, where the
  routed exchange applies;
* `jaxembed[flat]`: the flat form, `values [n, N/n]` with `lengths [n, B/n]`, one block of
  bags per shard of the bag axis;
* `jaxembed+optax`: `jaxembed.embedding_bag` under `jax.vjp` and `optax.sgd` (a dense
  gradient, as XLA's);
* `xla`: `jnp.take` of the padded ids, masked and summed over the bag axis, partitioned by
  XLA (Auto mesh), with `optax.sgd`: what keras-rs runs on CPU and GPU.

Layouts: `rows-and-bags-on-8` (an (8,) mesh: the table's rows and the bags split over the
same axis) and `rows-on-model` ((data=2, model=4): rows on `model`, bags on `data`).

    jaxembed bench bags --quick --json /tmp/bags.json
    jaxembed bench bags --json benchmarks/results/bags/bags.json \\
        --markdown benchmarks/results/bags/bags.md --plot benchmarks/results/bags
"""

from __future__ import annotations

import dataclasses
import math
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
from benchmarks.layouts.cases import Layout
from benchmarks.layouts.impls import make_mesh
from jaxembed.workloads import zipf_ids

__all__ = ["BAG_LAYOUTS", "QUICK", "BagsConfig", "main", "run_bags", "targets"]

SCHEMA = "benchmarks.bags.bench/1"

BAG_LAYOUTS = {
    layout.name: layout
    for layout in (
        Layout("rows-and-bags-on-8", (8,), ("data",), P("data", None), P("data", None),
               P("data", None), "rows-over-batch", "(8,): rows and bags split over one axis"),
        Layout("rows-on-model", (2, 4), ("data", "model"), P("model", None), P("data", None),
               P("data", None), "rows", "(2, 4): rows on model, bags on data"),
    )
}  # fmt: skip
"""The layouts of `bench bags`: ids `[B, L]` and the pooled output `[B, H]` split on B."""


@dataclasses.dataclass(frozen=True)
class BagsConfig:
    """What `run_bags` measures.

    Attributes:
      num_bags: B.
      min_ids, max_ids: a bag's length is uniform in `[min_ids, max_ids]`.
      zipf: the ids' Zipf exponent.
      vocab, hidden: the table.
      layouts: names from `BAG_LAYOUTS`.
      learning_rate: SGD's.
      seed: of the bags and the cotangent.
      timing: the timing policy of each layout's group.
      memory_budget_bytes: what a group may hold (None: 60% of the available memory).
      quick: tiny shapes (a label for the record).
    """

    num_bags: int = 4096
    min_ids: int = 1
    max_ids: int = 20
    zipf: float = 1.1
    vocab: int = 2**20
    hidden: int = 64
    layouts: tuple[str, ...] = tuple(BAG_LAYOUTS)
    learning_rate: float = 0.1
    seed: int = 0
    timing: TimingPolicy = harness.TIMING
    memory_budget_bytes: int | None = None
    quick: bool = False


QUICK = BagsConfig(num_bags=64, max_ids=6, vocab=4096, hidden=16, timing=harness.QUICK_TIMING,
                   quick=True)  # fmt: skip
"""Tiny shapes: every code path in seconds; timings mean nothing."""


# --- inputs ---------------------------------------------------------------------------------------


def make_bags(config: BagsConfig, blocks: int) -> dict[str, np.ndarray]:
    """The step's inputs: the dense form, the flat form in `blocks` blocks, cotangents.

    Returns:
      `ids [B, L]` (-1 pads), `ct [B, H]`, `values [blocks, B/blocks * L]` (each block's
      bags back to back, zeros after), `lengths [blocks, B/blocks]`, `ct_flat
      [blocks, B/blocks, H]`.
    """
    b, width = config.num_bags, config.max_ids
    rng = np.random.default_rng([config.seed, b, config.vocab])
    lengths = rng.integers(config.min_ids, config.max_ids + 1, size=b, dtype=np.int32)
    flat = zipf_ids(rng, int(lengths.sum()), config.vocab, config.zipf)
    ids = np.full((b, width), -1, np.int32)
    ids[np.arange(width)[None, :] < lengths[:, None]] = flat
    ct = harness.exact_cotangent(rng, (b, config.hidden))
    per = b // blocks
    values = np.zeros((blocks, per * width), np.int32)
    for k in range(blocks):
        block = ids[k * per : (k + 1) * per]
        got = block[block >= 0]
        values[k, : got.size] = got
    return {
        "ids": ids, "ct": ct, "values": values,
        "lengths": lengths.reshape(blocks, per), "ct_flat": ct.reshape(blocks, per, -1),
    }  # fmt: skip


def _reference(host: dict[str, np.ndarray], lr: float) -> harness.Reference:
    ids = host["ids"].astype(np.int64)
    slot_out = np.repeat(np.arange(ids.shape[0]), ids.shape[1])
    return harness.Reference(ids.reshape(-1), slot_out, host["ct"].astype(np.float64), lr)


# --- implementations ------------------------------------------------------------------------------


def _row_shards(layout: Layout) -> int:
    sizes = dict(zip(layout.mesh_axes, layout.mesh_shape, strict=True))
    entry = layout.table_spec[0]
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return math.prod(sizes[a] for a in axes)


def _mod_phys(vocab: int, n: int):
    per = -(-vocab // n)
    return lambda ids: (np.asarray(ids) % n) * per + np.asarray(ids) // n


def _jaxembed(layout: Layout, config: BagsConfig, name: str, *, exchange: str = "auto",
              row_sharding: str = "block", flat: bool = False) -> harness.Variant:  # fmt: skip
    mesh = make_mesh(layout, AxisType.Explicit)
    vocab, hidden = config.vocab, config.hidden
    n = _row_shards(layout)
    rows = -(-vocab // n) * n if row_sharding == "mod" else vocab
    opt = jaxembed.optim.sgd(config.learning_rate)
    kw = {"combiner": "sum", "exchange": exchange, "row_sharding": row_sharding,
          "vocab_size": vocab}  # fmt: skip
    axis = layout.ids_spec[0]

    def step(state, *inputs):
        table, opt_state = state
        if flat:
            values, lengths, ct = inputs
            out, stats = jaxembed.embedding_bag(values, table, lengths=lengths,
                                                return_stats=True, **kw)  # fmt: skip
            table, opt_state = opt.update(table, opt_state, values, jnp.where(
                jnp.isfinite(out), ct, 0.0), lengths=lengths, **kw)  # fmt: skip
        else:
            ids, ct = inputs
            out, stats = jaxembed.embedding_bag(ids, table, return_stats=True, **kw)
            g = jnp.where(jnp.isfinite(out), ct, 0.0)  # reads the forward, equals ct
            table, opt_state = opt.update(table, opt_state, ids, g, **kw)
        return (table, opt_state), out, stats.routed_fallback

    scalar = harness.abstract((), jnp.int32, mesh, P())
    state = (harness.abstract((rows, hidden), jnp.float32, mesh, layout.table_spec),
             jaxembed.optim.RowSparseState(scalar, {}, scalar))  # fmt: skip
    transform = (lambda t: jaxembed.to_mod_order(t, n)) if row_sharding == "mod" else None

    def init():
        t = harness.init_table((vocab, hidden), mesh, layout.table_spec, transform=transform)
        return (t, opt.init(t))

    if flat:
        specs = {"values": P(axis, None), "lengths": P(axis, None), "ct_flat": P(axis, None, None)}
    else:
        specs = {"ids": layout.ids_spec, "ct": layout.out_spec}
    info = _plan_info(mesh, layout, config, exchange, row_sharding, flat)
    phys = _mod_phys(vocab, n) if row_sharding == "mod" else (lambda ids: ids)
    return harness.Variant(name, mesh, step, state, init, specs, "sgd", phys=phys, info=info,
                      vocab=vocab)  # fmt: skip


def _plan_info(mesh, layout, config, exchange, row_sharding, flat) -> dict[str, Any]:
    rows = config.vocab
    if row_sharding == "mod":
        n = _row_shards(layout)
        rows = -(-rows // n) * n
    b, width = config.num_bags, config.max_ids
    blocks = mesh.shape[layout.ids_spec[0]]
    shape = (blocks, b // blocks * width) if flat else (b, width)
    plans = [jaxembed.plan_embedding_bag(
        mesh.abstract_mesh, shape, (rows, config.hidden), combiner="sum",
        num_bags=b // blocks if flat else None, x_spec=layout.ids_spec,
        lengths_spec=P(layout.ids_spec[0], None) if flat else None,
        weight_spec=layout.table_spec, exchange=exchange, row_sharding=row_sharding,
        vocab_size=config.vocab, update=update,
    ) for update in (False, True)]  # fmt: skip
    plan = plans[0]
    info: dict[str, Any] = {
        "exchange": plan.exchange, "update_exchange": plans[1].exchange,
        "row_sharding": row_sharding,
        "form": "flat" if flat else "dense",
        "plan_wire_bytes": plan.forward_wire_bytes + plan.backward_wire_bytes,
    }  # fmt: skip
    if plan.routed is not None:
        info["capacity"] = plan.routed.capacity
        info["rows_looked_up"] = plan.routed.rows_looked_up
    return info


def _dense(layout: Layout, config: BagsConfig, *, xla: bool) -> harness.Variant:
    mesh = make_mesh(layout, AxisType.Auto if xla else AxisType.Explicit)
    sharding = NamedSharding(mesh, layout.table_spec)
    vocab, hidden = config.vocab, config.hidden
    tx = optax.sgd(config.learning_rate)
    table = jax.ShapeDtypeStruct((vocab, hidden), jnp.float32, sharding=sharding)
    state = (table, tx.init(table))  # SGD: no arrays in its state

    def lookup(w, ids):  # -> (out, fallback flag)
        if not xla:
            out, stats = jaxembed.embedding_bag(ids, w, combiner="sum", return_stats=True)
            return out, stats.routed_fallback
        valid = ids >= 0
        rows = jnp.take(w, jnp.where(valid, ids, 0), axis=0, mode="clip")  # [B, L, H]
        return jnp.sum(jnp.where(valid[..., None], rows, 0.0), axis=1), jnp.zeros((), jnp.int32)

    def step(state, ids, ct):
        table, opt_state = state
        out, vjp, fallback = jax.vjp(lambda w: lookup(w, ids), table, has_aux=True)
        (grad,) = vjp(jnp.where(jnp.isfinite(out), ct, 0.0))
        updates, opt_state = tx.update(grad, opt_state, table)
        return (optax.apply_updates(table, updates), opt_state), out, fallback

    def init():
        t = harness.init_table((vocab, hidden), mesh, layout.table_spec)
        return (t, tx.init(t))

    out_shardings = None
    if xla:
        outs = (NamedSharding(mesh, layout.out_spec), NamedSharding(mesh, P()))
        out_shardings = (jax.tree.map(lambda _: sharding, state), *outs)
    specs = {"ids": layout.ids_spec, "ct": layout.out_spec}
    name = "xla" if xla else "jaxembed+optax"
    return harness.Variant(name, mesh, step, state, init, specs, "sgd",
                           out_shardings=out_shardings)  # fmt: skip


def _variants(layout: Layout, config: BagsConfig) -> list[harness.Variant]:
    auto = _jaxembed(layout, config, "jaxembed")
    out = [auto]
    if auto.info["exchange"] not in ("rows", "none"):
        out.append(_jaxembed(layout, config, "jaxembed[rows]", exchange="rows"))
    if auto.info["exchange"] == "routed":
        out.append(_jaxembed(layout, config, "jaxembed[mod]", row_sharding="mod"))
    out.append(_jaxembed(layout, config, "jaxembed[flat]", flat=True))
    out += [_dense(layout, config, xla=False), _dense(layout, config, xla=True)]
    return out


# --- the benchmark --------------------------------------------------------------------------------


def _effective_bytes(result: dict[str, Any]) -> float | None:
    if "wire_bytes" not in result:
        return None
    if result.get("fallback") and result.get("fallback_wire_bytes") is not None:
        return result["fallback_wire_bytes"]
    return result["wire_bytes"]


def _layout_point(config: BagsConfig, name: str, say) -> dict[str, Any]:
    layout = BAG_LAYOUTS[name]
    blocks = dict(zip(layout.mesh_axes, layout.mesh_shape, strict=True))[layout.ids_spec[0]]
    host = make_bags(config, blocks)
    mean_len = float(host["lengths"].mean())
    variants = _variants(layout, config)
    say(f"{name}: compiling {', '.join(v.name for v in variants)}")
    harness.compile_group(variants, host)
    admitted = harness.admit(variants, harness.memory_budget(config.memory_budget_bytes))
    try:
        for v in admitted:
            v.state = v.init_state()
        say(f"{name}: checking and timing")
        harness.run_checked(admitted, _reference(host, config.learning_rate), host, config.seed)
        harness.time_group(admitted, config.timing)
    finally:
        for v in variants:
            v.release()
    impls = {v.name: v.result for v in variants}
    for r in impls.values():
        r["effective_wire_bytes"] = _effective_bytes(r)
    xla = impls["xla"]
    summary = {
        n: {
            "wire_ratio_to_xla": harness.ratio(r.get("effective_wire_bytes"),
                                          xla.get("effective_wire_bytes")),
            "time_ratio_to_xla": harness.ratio(harness.median_ms(r), harness.median_ms(xla)),
        }
        for n, r in impls.items() if n != "xla"
    }  # fmt: skip
    return {
        "name": f"vocab={config.vocab},hidden={config.hidden},bags={config.num_bags}x"
                f"{config.max_ids},mesh={layout.mesh_text},layout={name}",
        "layout": name, "description": layout.description,
        "mesh": dict(zip(layout.mesh_axes, layout.mesh_shape, strict=True)),
        "vocab": config.vocab, "hidden": config.hidden, "num_bags": config.num_bags,
        "max_ids": config.max_ids, "zipf": config.zipf, "mean_bag_length": round(mean_len, 4),
        "distinct_ids": int(np.unique(host["ids"][host["ids"] >= 0]).size),
        "implementations": impls, "summary": summary,
    }  # fmt: skip


def run_bags(config: BagsConfig | None = None, *, say=None) -> dict[str, Any]:
    """Runs `jaxembed bench bags` and returns its record (JSON-ready).

    Args:
      config: what to measure (default `BagsConfig()`; `QUICK` for tiny shapes).
      say: called with a line of progress now and then.

    Returns:
      `{"schema", "machine", "config", "layouts": [point, ...], "targets"}`; a point has
      the mean bag length L̄ and per implementation its bytes (`wire_bytes` of the routed
      path, `fallback_wire_bytes`, and `effective_wire_bytes`: the path this batch took),
      memory, the reference check and its times; `summary` has each one's ratios to XLA.

    Raises:
      ValueError: an unknown layout, a batch the bag axis does not divide, too few devices.
    """
    from benchmarks.common.report import machine as _machine

    config = BagsConfig() if config is None else config
    bad = [n for n in config.layouts if n not in BAG_LAYOUTS]
    if bad:
        raise ValueError(f"unknown layouts {bad}: choose from {', '.join(BAG_LAYOUTS)}")
    if config.num_bags % 8:
        raise ValueError(f"num_bags={config.num_bags} must be a multiple of 8 (the bag axis)")
    if len(jax.devices()) < 8:
        raise ValueError(f"bench bags needs 8 devices, found {len(jax.devices())}: set "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=8")  # fmt: skip
    say = say or (lambda message: None)
    record: dict[str, Any] = {"schema": SCHEMA, "machine": _machine(),
                              "config": harness.config_record(config)}  # fmt: skip
    record["layouts"] = [_layout_point(config, name, say) for name in config.layouts]
    record["targets"] = targets(record)
    return record


def targets(record: dict[str, Any]) -> dict[str, Any]:
    """The bags' targets per layout: jaxembed's bytes <= XLA's / L̄ (the mean bag length),
    and jaxembed faster than XLA (time ratio < 1)."""
    out: dict[str, Any] = {"at_target_shapes": not record["config"]["quick"]}
    for p in record["layouts"]:
        impls = p["implementations"]
        mine, xla = impls["jaxembed"], impls["xla"]
        limit = 1.0 / p["mean_bag_length"]
        ratio = harness.ratio(mine.get("effective_wire_bytes"), xla.get("effective_wire_bytes"))
        out[f"{p['layout']}: bytes vs xla"] = {
            "value": ratio, "threshold": round(limit, 4),
            "met": ratio is not None and ratio <= limit,
            "where": f"jaxembed ({mine.get('exchange')}) / xla, L̄ = {p['mean_bag_length']:.2f}",
        }  # fmt: skip
        t = p["summary"]["jaxembed"]["time_ratio_to_xla"]
        out[f"{p['layout']}: time vs xla"] = {
            "value": t, "threshold": 1.0, "met": t is not None and t < 1.0,
            "where": "jaxembed / xla, median step",
        }  # fmt: skip
    out["all_agree_with_reference"] = harness.all_agree(record["layouts"])
    return out


def main(argv: list[str]) -> int:
    """`jaxembed bench bags [--quick] [--json PATH] [--plot DIR] [--markdown PATH] ...`."""
    p = harness.parser(
        "jaxembed bench bags",
        "Pooled bag lookups (sum) against XLA's take + sum: bytes and step time.",
    )
    p.add_argument("--layouts", nargs="+", choices=list(BAG_LAYOUTS))
    args = p.parse_args(argv)
    config = QUICK if args.quick else BagsConfig()
    changes = harness.common_changes(args, config)
    if args.layouts:
        changes["layouts"] = tuple(dict.fromkeys(args.layouts))
    config = dataclasses.replace(config, **changes)
    from benchmarks.bags import report

    return harness.run_and_finish("jaxembed bench bags", run_bags, config, args,
                             report.bags_tables, report.plot_bags)  # fmt: skip
