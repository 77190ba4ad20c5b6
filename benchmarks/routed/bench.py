"""`jaxembed bench routed`: the routed exchange against the gather path, and the plan's choice.

Where the ids and the table's rows are split over the same mesh axes S, the gather path
(`exchange="rows"`, which the plan calls `none` there) gathers every id over S, looks all of
them up and reduce-scatters the output; the routed exchange sends each distinct id only to
the shard that owns its row, at a static capacity C per (device, owner), and falls back to
the gather path, exactly, in a step where a bucket overflows. Each implementation runs a
training step: the lookup and the row-sparse SGD update (`jaxembed.optim.sgd`, the backward
fused with the update) with the same `exchange` and `row_sharding`:

* `rows`: the gather path; `routed`: forced; `auto`: the plan's choice;
* row sharding `block` (contiguous rows per shard: Zipf's hot low ids all on shard 0) and
  `mod` (the table stored by `jaxembed.to_mod_order`: id i on shard i mod n).

Measured per layout, ids distribution and row sharding: the wire bytes of the path the batch
took (compiled HLO; the routed program holds both branches, told apart), step times, the
fallback rate over fresh batches (`return_stats=True`), and the rows each device looks up
(`plan.routed.rows_looked_up` against G/n_S, with the busiest bucket of the batch). A Zipf
sweep runs on the first layout; the batch sweep runs `rows-on-model` (data=2, model=4) with
the exchange forced `rows` / `dense` and `auto` (fwd + bwd + optax SGD, as `jaxembed bench`).
The bucketing sweep (`benchmarks.routed.bucketing`) times the exchange's sort + dedup by owner
alone, XLA's comparison sort against the native counting sort + hash, side by side, at the
plan's M, n and C; `--layouts --batch-sweep` (no values) runs it alone.

    jaxembed bench routed --quick --json /tmp/routed.json
    jaxembed bench routed --json benchmarks/results/routed/routed.json \\
        --markdown benchmarks/results/routed/routed.md --plot benchmarks/results/routed
    python -m benchmarks routed --layouts --batch-sweep --bucketing-slots 65536
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxembed
from benchmarks.common import variants as harness
from benchmarks.common.timing import TimingPolicy
from benchmarks.layouts.cases import LAYOUTS, Layout
from benchmarks.layouts.impls import make_mesh
from benchmarks.routed.batch_sweep import batch_sweep, batch_targets
from benchmarks.routed.bucketing import bucketing_sweep
from jaxembed.workloads import zipf_ids

__all__ = ["QUICK", "ROUTED_LAYOUTS", "RoutedConfig", "main", "run_routed", "targets"]

SCHEMA = "benchmarks.routed.bench/1"

ROUTED_LAYOUTS = {
    "fully-sharded-8": Layout(
        "fully-sharded-8", (8,), ("data",), P("data", None), P("data", None),
        P("data", None, None), "rows-over-batch", "(8,): ids and rows split over one axis",
    ),
    "rows-over-data-model": LAYOUTS["rows-over-data-model"],
}  # fmt: skip
"""The layouts where the routed exchange applies."""


@dataclasses.dataclass(frozen=True)
class RoutedConfig:
    """What `run_routed` measures.

    Attributes:
      vocab, hidden, ids_shape: the lookups' table and ids `[B, S]`.
      layouts: names from `ROUTED_LAYOUTS`; the Zipf sweep runs on the first.
      row_shardings: `block` and/or `mod`.
      exchanges: of `rows`, `routed`, `auto`.
      zipf_sweep: the exponents of the sweep (0 is uniform).
      main_zipf: the exponents measured on every layout.
      fallback_batches: fresh batches per point on which the fallback rate is counted.
      batch_sweep: B of the batch sweep (ids `[B, batch_seq]`, rows-on-model).
      batch_vocab, batch_hidden, batch_seq: the batch sweep's shapes.
      bucketing_slots: M (slots per device) of the bucketing sweep, native vs XLA (V = vocab).
      learning_rate, seed: SGD's rate; the draw of ids and cotangents.
      timing: the timing policy of every group.
      memory_budget_bytes: what a group may hold (None: 60% of the available memory).
      quick: tiny shapes (a label for the record).
    """

    vocab: int = 2**20
    hidden: int = 128
    ids_shape: tuple[int, int] = (64, 128)
    layouts: tuple[str, ...] = tuple(ROUTED_LAYOUTS)
    row_shardings: tuple[str, ...] = ("block", "mod")
    exchanges: tuple[str, ...] = ("rows", "routed", "auto")
    zipf_sweep: tuple[float, ...] = (0.0, 0.5, 0.8, 1.1, 1.3)
    main_zipf: tuple[float, ...] = (0.0, 1.1)
    fallback_batches: int = 8
    batch_sweep: tuple[int, ...] = (2, 8, 32, 128, 512)
    batch_vocab: int = 65536
    batch_hidden: int = 128
    batch_seq: int = 128
    bucketing_slots: tuple[int, ...] = (65536,)
    learning_rate: float = 0.1
    seed: int = 0
    timing: TimingPolicy = harness.TIMING
    memory_budget_bytes: int | None = None
    quick: bool = False


QUICK = RoutedConfig(
    vocab=8192, hidden=16, ids_shape=(8, 16), zipf_sweep=(0.0, 1.1), fallback_batches=2,
    batch_sweep=(2, 512), batch_vocab=32768, batch_hidden=16, batch_seq=16,
    bucketing_slots=(1024,), timing=harness.QUICK_TIMING, quick=True,
)  # fmt: skip
"""Tiny shapes: every code path in seconds; timings mean nothing."""


# --- the step -------------------------------------------------------------------------------------


def _row_shards(layout: Layout) -> int:
    sizes = dict(zip(layout.mesh_axes, layout.mesh_shape, strict=True))
    entry = layout.table_spec[0]
    axes = (entry,) if isinstance(entry, str) else tuple(entry)
    return math.prod(sizes[a] for a in axes)


def _plans(mesh, layout: Layout, config: RoutedConfig, exchange: str, row_sharding: str):
    kw = dict(
        x_spec=layout.ids_spec, weight_spec=layout.table_spec, out_spec=layout.out_spec,
        exchange=exchange, row_sharding=row_sharding, vocab_size=config.vocab,
    )  # fmt: skip
    rows = _physical_rows(layout, config.vocab, row_sharding)
    shape = (rows, config.hidden)
    return tuple(jaxembed.plan_embedding(mesh.abstract_mesh, config.ids_shape, shape,
                                         update=u, **kw) for u in (False, True))  # fmt: skip


def _physical_rows(layout: Layout, vocab: int, row_sharding: str) -> int:
    n = _row_shards(layout)
    return -(-vocab // n) * n if row_sharding == "mod" else vocab


def _phys(layout: Layout, vocab: int, row_sharding: str):
    """Logical ids -> physical rows of the stored table."""
    if row_sharding == "block":
        return lambda ids: np.asarray(ids)
    n = _row_shards(layout)
    per = -(-vocab // n)
    return lambda ids: (np.asarray(ids) % n) * per + np.asarray(ids) // n


def _variant(layout: Layout, config: RoutedConfig, exchange: str, row_sharding: str):
    mesh = make_mesh(layout, AxisType.Explicit)
    vocab, hidden = config.vocab, config.hidden
    opt = jaxembed.optim.sgd(config.learning_rate)
    kw = {"exchange": exchange, "row_sharding": row_sharding, "vocab_size": vocab,
          "out_spec": layout.out_spec}  # fmt: skip

    def step(state, ids, ct):
        table, opt_state = state
        out, stats = jaxembed.embedding(ids, table, return_stats=True, **kw)
        g = jnp.where(jnp.isfinite(out), ct, 0.0)  # reads the forward, equals ct
        table, opt_state = opt.update(table, opt_state, ids, g, **kw)
        return (table, opt_state), out, stats.routed_fallback

    rows = _physical_rows(layout, vocab, row_sharding)
    n = _row_shards(layout)
    scalar = harness.abstract((), jnp.int32, mesh, P())
    state = (harness.abstract((rows, hidden), jnp.float32, mesh, layout.table_spec),
             jaxembed.optim.RowSparseState(scalar, {}, scalar))  # fmt: skip
    transform = (lambda t: jaxembed.to_mod_order(t, n)) if row_sharding == "mod" else None

    def init():
        t = harness.init_table((vocab, hidden), mesh, layout.table_spec, transform=transform)
        return (t, opt.init(t))

    lookup, update = _plans(mesh, layout, config, exchange, row_sharding)
    info: dict[str, Any] = {
        "exchange": lookup.exchange, "update_exchange": update.exchange,
        "exchange_reason": lookup.exchange_reason,
        "plan_wire_bytes": lookup.forward_wire_bytes + lookup.backward_wire_bytes,
        "candidates": [dataclasses.asdict(c) for c in lookup.candidates],
    }  # fmt: skip
    if lookup.routed is not None:
        r = lookup.routed
        info["routed"] = {"axes": list(r.axes), "num_buckets": r.num_buckets, "slots": r.slots,
                          "capacity": r.capacity, "rows_looked_up": r.rows_looked_up,
                          "dim": r.dim}  # fmt: skip
    specs = {"ids": layout.ids_spec, "ct": layout.out_spec}
    phys = _phys(layout, vocab, row_sharding)
    return harness.Variant(exchange, mesh, step, state, init, specs, "sgd", phys=phys, info=info,
                      vocab=vocab)  # fmt: skip


# --- inputs and the routing's own numbers ---------------------------------------------------------


def make_ids(config: RoutedConfig, zipf: float, batch: int) -> dict[str, np.ndarray]:
    """Ids `[B, S]` (Zipf with exponent `zipf`, hot ids low; 0 is uniform) and a cotangent."""
    rng = np.random.default_rng([config.seed, round(zipf * 1000), batch])
    if zipf == 0:
        ids = rng.integers(0, config.vocab, size=config.ids_shape, dtype=np.int32)
    else:
        ids = zipf_ids(rng, math.prod(config.ids_shape), config.vocab, zipf)
        ids = ids.reshape(config.ids_shape)
    ct = harness.exact_cotangent(rng, (*config.ids_shape, config.hidden))
    return {"ids": ids, "ct": ct}


def bucket_stats(ids: np.ndarray, routed: dict[str, Any], phys, rows: int) -> dict[str, Any]:
    """The busiest bucket of a batch: distinct ids one device sends one owner.

    The ids are split into G / M blocks along the routed dim (M: a device's slots); an id's
    owner on S is its physical row // (rows / n_S).
    """
    n, slots = routed["num_buckets"], routed["slots"]
    blocks = np.split(np.moveaxis(ids, routed["dim"], 0), ids.size // slots, axis=0)
    busiest = 0
    for block in blocks:
        distinct = np.unique(block)
        owners = phys(distinct) // (rows // n)
        busiest = max(busiest, int(np.bincount(owners, minlength=n).max()))
    ideal = ids.size / n
    return {
        "max_bucket_distinct_ids": busiest, "capacity": routed["capacity"],
        "overflows": busiest > routed["capacity"],
        "rows_looked_up": routed["rows_looked_up"], "ids_per_owner": ideal,
        "rows_looked_up_ratio": round(routed["rows_looked_up"] / ideal, 4),
    }  # fmt: skip


def _effective(result: dict[str, Any]) -> None:
    if "wire_bytes" not in result:
        return
    fell = result.get("fallback") and result.get("fallback_wire_bytes") is not None
    result["effective_wire_bytes"] = result["fallback_wire_bytes"] if fell else result[
        "wire_bytes"]  # fmt: skip


def _fallback_rate(variants, config: RoutedConfig, zipf: float) -> None:
    """Counts the fallbacks of each ready variant over fresh batches of the same draw."""
    counts = {v.name: 0 for v in variants if v.ready}
    for k in range(config.fallback_batches):
        host = make_ids(config, zipf, batch=k + 1)
        for v in variants:
            if v.ready:
                v.put_inputs(host)
                counts[v.name] += int(v()[1])
    for v in variants:
        if v.name in counts:
            v.result["fallback_rate"] = round(counts[v.name] / max(config.fallback_batches, 1), 4)


def _points(config: RoutedConfig, name: str, zipfs, row_sharding: str, say) -> list[dict]:
    layout = ROUTED_LAYOUTS[name]
    variants = [_variant(layout, config, ex, row_sharding) for ex in config.exchanges]
    say(f"{name} {row_sharding}: compiling {', '.join(config.exchanges)}")
    harness.compile_group(variants, make_ids(config, 0.0, 0))
    admitted = harness.admit(variants, harness.memory_budget(config.memory_budget_bytes))
    base = {v.name: dict(v.result) for v in variants}
    routed = next((v.info["routed"] for v in variants if "routed" in v.info), None)
    phys = _phys(layout, config.vocab, row_sharding)
    rows = _physical_rows(layout, config.vocab, row_sharding)
    points = []
    try:
        for v in admitted:
            v.state = v.init_state()
        for zipf in zipfs:
            say(f"{name} {row_sharding} zipf={zipf}: checking and timing")
            for v in variants:
                v.result = dict(base[v.name])
            host = make_ids(config, zipf, 0)
            ref = harness.Reference.lookup(host["ids"], host["ct"], config.learning_rate)
            harness.run_checked(admitted, ref, host, config.seed)
            harness.time_group(admitted, config.timing)
            _fallback_rate(admitted, config, zipf)
            impls = {v.name: v.result for v in variants}
            for r in impls.values():
                _effective(r)
            point = {
                "name": f"vocab={config.vocab},hidden={config.hidden},ids="
                        f"{'x'.join(map(str, config.ids_shape))},mesh={layout.mesh_text},"
                        f"layout={name},rows={row_sharding},zipf={zipf}",
                "layout": name, "mesh": dict(zip(layout.mesh_axes, layout.mesh_shape,
                                                 strict=True)),
                "vocab": config.vocab, "hidden": config.hidden,
                "ids_shape": list(config.ids_shape), "zipf": zipf, "row_sharding": row_sharding,
                "distinct_ids": int(np.unique(host["ids"]).size),
                "routing": None if routed is None else bucket_stats(host["ids"], routed, phys,
                                                                    rows),
                "implementations": impls, "summary": _summary(impls),
            }  # fmt: skip
            points.append(point)
    finally:
        for v in variants:
            v.release()
    return points


def _summary(impls: dict[str, Any]) -> dict[str, Any]:
    rows = impls.get("rows", {})
    out: dict[str, Any] = {}
    for n in ("routed", "auto"):
        r = impls.get(n, {})
        out[f"{n}_wire_ratio_to_rows"] = harness.ratio(r.get("effective_wire_bytes"),
                                                  rows.get("effective_wire_bytes"))  # fmt: skip
        out[f"{n}_time_ratio_to_rows"] = harness.ratio(
            harness.median_ms(r), harness.median_ms(rows)
        )
    forced = [harness.median_ms(impls.get(n)) for n in ("rows", "routed")]
    forced = [t for t in forced if t is not None]
    out["auto_time_ratio_to_best_forced"] = harness.ratio(harness.median_ms(impls.get("auto")),
                                                     min(forced) if forced else None)  # fmt: skip
    return out


def run_routed(config: RoutedConfig | None = None, *, say=None) -> dict[str, Any]:
    """Runs `jaxembed bench routed` and returns its record (JSON-ready).

    Args:
      config: what to measure (default `RoutedConfig()`; `QUICK` for tiny shapes).
      say: called with a line of progress now and then.

    Returns:
      `{"schema", "machine", "config", "points": [...], "batch_sweep": [...],
      "bucketing": [...], "targets"}`.
      A point is one (layout, row sharding, Zipf exponent) with, per exchange, the wire
      bytes of both paths and of the one this batch took (`effective_wire_bytes`), the
      check, times, `fallback_rate`, and the plan's capacity and candidates; `routing`
      has the busiest bucket and the rows looked up against G/n_S.

    Raises:
      ValueError: unknown layouts, exchanges or row shardings, or too few devices.
    """
    from benchmarks.common.report import machine as _machine

    config = RoutedConfig() if config is None else config
    bad = [n for n in config.layouts if n not in ROUTED_LAYOUTS]
    bad += [e for e in config.exchanges if e not in ("rows", "routed", "auto")]
    bad += [s for s in config.row_shardings if s not in ("block", "mod")]
    if bad:
        raise ValueError(f"unknown {bad}: layouts {', '.join(ROUTED_LAYOUTS)}; exchanges rows, "
                         "routed, auto; row shardings block, mod")  # fmt: skip
    if len(jax.devices()) < 8:
        raise ValueError(f"bench routed needs 8 devices, found {len(jax.devices())}: set "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=8")  # fmt: skip
    say = say or (lambda message: None)
    record: dict[str, Any] = {"schema": SCHEMA, "machine": _machine(),
                              "config": harness.config_record(config), "points": []}  # fmt: skip
    for i, name in enumerate(config.layouts):
        zipfs = sorted({*config.main_zipf, *(config.zipf_sweep if i == 0 else ())})
        for row_sharding in config.row_shardings:
            record["points"] += _points(config, name, zipfs, row_sharding, say)
    record["batch_sweep"] = batch_sweep(
        config.batch_sweep, vocab=config.batch_vocab, hidden=config.batch_hidden,
        seq=config.batch_seq, timing=config.timing, learning_rate=config.learning_rate,
        seed=config.seed, say=say,
    )  # fmt: skip
    record["bucketing"] = bucketing_sweep(
        config.bucketing_slots, vocab=config.vocab, timing=config.timing, seed=config.seed,
        say=say,
    )  # fmt: skip
    record["targets"] = targets(record)
    return record


def targets(record: dict[str, Any]) -> dict[str, Any]:
    """The routed exchange's targets.

    * routed wire bytes <= 0.35x the gather path's with uniform ids (block and mod rows) and
      under Zipf(1.1) with mod rows, per layout (the bytes of the path each batch took);
    * rows looked up per device (`plan.routed.rows_looked_up`) <= 1.5 G/n_S;
    * no regression with uniform ids: auto's step <= 1.1x the gather path's;
    * batch sweep: auto within 10% of the fastest forced exchange at every point.
    """
    out: dict[str, Any] = {"at_target_shapes": not record["config"]["quick"]}
    pts = record["points"]
    for layout in dict.fromkeys(p["layout"] for p in pts):
        mine = [p for p in pts if p["layout"] == layout]
        wanted = [
            p for p in mine if p["zipf"] == 0 or (p["zipf"] == 1.1 and p["row_sharding"] == "mod")
        ]
        per = {f"zipf={p['zipf']},{p['row_sharding']}": p["summary"]["routed_wire_ratio_to_rows"]
               for p in wanted}  # fmt: skip
        values = [v for v in per.values() if v is not None]
        out[f"{layout}: routed bytes / gather path"] = {
            "per_case": per, "threshold": 0.35, "met": bool(values) and max(values) <= 0.35,
            "where": "uniform ids (block, mod) and Zipf 1.1 with mod rows",
        }  # fmt: skip
        routing = [p["routing"] for p in mine if p["routing"]]
        if routing:
            ratio = max(r["rows_looked_up_ratio"] for r in routing)
            out[f"{layout}: rows looked up / (G/n_S)"] = {
                "value": ratio, "threshold": 1.5, "met": ratio <= 1.5,
                "where": f"n_S·C = {routing[0]['rows_looked_up']} rows vs G/n_S = "
                         f"{routing[0]['ids_per_owner']:.0f}",
            }  # fmt: skip
        uniform = {p["row_sharding"]: p["summary"]["auto_time_ratio_to_rows"]
                   for p in mine if p["zipf"] == 0}  # fmt: skip
        values = [v for v in uniform.values() if v is not None]
        out[f"{layout}: uniform ids, auto / gather path time"] = {
            "per_case": uniform, "threshold": 1.1, "met": bool(values) and max(values) <= 1.1,
            "where": "median step times, block and mod rows",
        }  # fmt: skip
    out.update(batch_targets(record["batch_sweep"]))
    out["all_agree_with_reference"] = harness.all_agree((*pts, *record["batch_sweep"]))
    return out


def main(argv: list[str]) -> int:
    """`jaxembed bench routed [--quick] [--json PATH] [--plot DIR] [--markdown PATH] ...`."""
    p = harness.parser(
        "jaxembed bench routed",
        "The routed exchange against the gather path: bytes, step time, fallbacks, "
        "rows looked up; a Zipf sweep and the exchange choice over the batch.",
    )
    p.add_argument("--layouts", nargs="*", choices=list(ROUTED_LAYOUTS),
                   help="the layouts of the exchange points (none with no values)")  # fmt: skip
    p.add_argument("--zipf-sweep", nargs="+", type=float, metavar="S")
    p.add_argument("--batch-sweep", nargs="*", type=int, metavar="B",
                   help="batch sizes of the batch sweep (none with no values)")  # fmt: skip
    p.add_argument("--bucketing-slots", nargs="*", type=int, metavar="M",
                   help="slots per device of the bucketing sweep (none: no values)")  # fmt: skip
    args = p.parse_args(argv)
    config = QUICK if args.quick else RoutedConfig()
    changes = harness.common_changes(args, config)
    if args.layouts is not None:
        changes["layouts"] = tuple(dict.fromkeys(args.layouts))
    if args.zipf_sweep:
        changes["zipf_sweep"] = tuple(args.zipf_sweep)
    if args.batch_sweep is not None:
        changes["batch_sweep"] = tuple(args.batch_sweep)
    if args.bucketing_slots is not None:
        changes["bucketing_slots"] = tuple(args.bucketing_slots)
    config = dataclasses.replace(config, **changes)
    from benchmarks.routed import report

    return harness.run_and_finish("jaxembed bench routed", run_routed, config, args,
                             report.routed_tables, report.plot_routed)  # fmt: skip
