"""`jaxembed bench planner-scaling`: a strong-scaling table on paper, from the plans alone.

The DLRM tables (`workloads.dlrm_workload`) at a fixed global batch, planned for 8, 64 and
512 devices without any device: the meshes are `jax.sharding.AbstractMesh((n,), ("x",))`
and, the 2-D variant, `AbstractMesh((n // 8, 8), ("hosts", "local"))` (shapes and axis
names only; a plan needs no more). For each mesh `jaxembed.plan_collection` plans the
collection's step as `EmbeddingBagCollection` runs it (one `embedding_bag` call per stack,
lookup + row-sparse update, row-wise Adagrad), with every table split by rows ("rows"), or
with the planner's own placements within a memory budget ("auto"). Each call's plan is then
read for both exchanges that apply to a row-split table: the gather path (`none` on these
meshes: every id gathered over the group, looked up, the pooled partial sums
reduce-scattered) and `routed`. Per device and step:

| column | from the plans |
|---|---|
| forward / update bytes | Σ calls `plan.forward_wire_bytes` / `plan.backward_wire_bytes` |
| slots | Σ calls max(`rows_gathered`, `rows_scattered`) of the exchange's `ExchangeCandidate` |
| C, n·C | `plan.routed.capacity`, `num_buckets · capacity` |
| step | the collection's `step_ms` with that exchange in every call (`CallCost.options`) |

    jaxembed bench planner-scaling --json benchmarks/results/planner/scaling.json \\
        --markdown benchmarks/results/planner/scaling.md
    python -m benchmarks.planner.scaling --quick      # tiny shapes, seconds

Nothing is timed or compiled: every figure is the cost model's (`jaxembed.plan.cost`, the
backend's constants), and the ids are its default (every bag full, ids uniform).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import inspect
import math
import platform
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.common.report import write_outputs
from jaxembed import workloads as W

__all__ = ["EXCHANGES", "QUICK", "ScalingConfig", "exchange_figures", "main", "make_mesh",
           "markdown", "run_scaling"]  # fmt: skip

SCHEMA = "jaxembed.bench.planner.scaling/1"
EXCHANGES = ("gather", "routed")
"""The exchanges reported: the gather path (the plan's `none`, or `rows` where the batch is
split inside the kernel) and `routed`."""
DEFAULT_SCALE = inspect.signature(W.dlrm_workload).parameters["scale"].default
_NO_LIMIT = "1TiB"  # fixed placements are planned whatever they need (peak_bytes says)


@dataclasses.dataclass(frozen=True)
class ScalingConfig:
    """What `run_scaling` plans.

    Attributes:
      batch_size: the global batch (examples per step), the same on every mesh.
      scales: `dlrm_workload`'s factors on Criteo's cardinalities (1.0: the full 33.8M rows).
      dim: every table's.
      devices: the mesh sizes n; the smallest is the strong-scaling baseline.
      meshes: `"1d"` (`(n,)`, axis `x`) and/or `"2d"` (`(n // 8, 8)`, axes `hosts`, `local`).
      placements: `"rows"` (every table split by rows, block rows) and/or `"auto"` (the
        planner's choice within `memory_per_device`).
      memory_per_device: the planner's budget per device under `"auto"`.
      backend: the cost constants (`"cpu"`, `"gpu"`, `"tpu"`).
      quick: tiny shapes (the tests).
    """

    batch_size: int = 65536
    scales: tuple[float, ...] = (DEFAULT_SCALE, 1.0)
    dim: int = 64
    devices: tuple[int, ...] = (8, 64, 512)
    meshes: tuple[str, ...] = ("1d", "2d")
    placements: tuple[str, ...] = ("rows", "auto")
    memory_per_device: str = "16GiB"
    backend: str = "cpu"
    quick: bool = False


QUICK = ScalingConfig(batch_size=512, scales=(1 / 4096,), dim=16, devices=(8, 64),
                      meshes=("1d",), quick=True)  # fmt: skip
"""Tiny shapes: batch 512, 26 features over 9 tables of 10-2473 rows, dim 16, n = 8, 64."""


def make_mesh(kind: str, n: int) -> Any:
    """The abstract mesh of n devices: `(n,)` over `x`, or `(n // 8, 8)` over `hosts, local`.

    Examples:
      >>> make_mesh("2d", 64)
      AbstractMesh('hosts': 8, 'local': 8, axis_types=(Auto, Auto))
    """
    from jax.sharding import AbstractMesh

    if kind == "1d":
        return AbstractMesh((n,), ("x",))
    if kind == "2d" and n % 8 == 0:
        return AbstractMesh((n // 8, 8), ("hosts", "local"))
    raise ValueError(f"mesh {kind!r} of {n} devices: choose '1d', or '2d' with n a multiple of 8")


def _features(w: W.Workload) -> list[Any]:
    from jaxembed.collection import FeatureConfig

    return [FeatureConfig(f.name, f.table, max_ids=f.max_ids) for f in w.features]


def _replan(call: Any, mesh: Any, name: str) -> Any:
    """`call`'s plan forced to exchange `name`, with the arguments the collection's cost
    model plans it with (`collection_cost._options`; its routed call's pooling and capacity
    where the planner chose them, `_routed_choice`)."""
    from jax.sharding import PartitionSpec as P

    from jaxembed.plan.lookup import plan_embedding_bag

    p = call.plan
    dense = p.bag.form == "dense"
    own = name == "routed" == call.exchange
    return plan_embedding_bag(
        mesh, p.x_shape, p.weight_shape, num_bags=None if dense else p.bag.num_bags,
        combiner=p.bag.combiner, weighted=p.bag.weighted, x_spec=p.x_spec,
        lengths_spec=None if dense else P(), weights_spec=p.x_spec if p.bag.weighted else None,
        weight_spec=p.weight_spec, dtype=p.dtype, exchange="rows" if name == "none" else name,
        update=True, backend=p.backend, optimizer_slots=(True,),  # row-wise Adagrad
        routed_pool=call.routed_pool if own else "auto",
        capacity_factor=call.capacity_factor if own else None,
    )  # fmt: skip


def _scale(s: float) -> str:
    """`1/8` for 0.125, `1` for 1.0."""
    inv = 1 / s
    return f"1/{round(inv)}" if s < 1 and abs(inv - round(inv)) < 1e-9 else f"{s:g}"


def _gather_name(names: Sequence[str]) -> str:
    return "none" if "none" in names else "rows"


def _tablewise_figures(c: Any) -> dict[str, Any]:
    """A table-wise call's figures (`jaxembed.kernels.tablewise`): its ids to the owner and
    the pooled rows back, the busiest owner walking `batch · F_o · L` slots each way."""
    return {
        "stack": c.stack_name, "x_shape": list(c.x_shape), "exchange": "table",
        "applies": False, "global_slots": math.prod(c.x_shape),
        "forward_wire_bytes": c.forward_bytes, "update_wire_bytes": c.update_bytes,
        "out_move_bytes": list(c.out_move_bytes), "forward_slots": c.owner_slots,
        "update_slots": c.owner_slots, "modelled_in_ms": c.modelled_ms, "overflow": False,
        "routed": None, "host_wire_bytes": None,
    }  # fmt: skip


def exchange_figures(plan: Any, mesh: Any, exchange: str) -> dict[str, Any]:
    """Per device, what `plan`'s step costs with `exchange` in every call it applies to.

    Args:
      plan: a `CollectionPlan`.
      mesh: the mesh it was planned on.
      exchange: `"gather"` or `"routed"`; a call where it does not apply keeps its own.

    Returns:
      JSON-ready figures: bytes, slots, the routed capacities, the modelled step, and per
      call the same (`calls`).
    """
    calls, rest = [], plan.step_ms - sum(c.modelled_ms for c in plan.calls)
    for c in plan.calls:
        if c.exchange == "table":  # table-wise: its own exchange, whatever is asked
            calls.append(_tablewise_figures(c))
            continue
        cands = {k.name: k for k in c.plan.candidates}
        name = _gather_name(list(cands)) if exchange == "gather" else exchange
        applies = name in cands
        name = name if applies else c.exchange
        p = c.plan if name == c.exchange else _replan(c, mesh, name)
        k, r = cands[name], p.routed
        again = _replan(c, mesh, name) if name == c.exchange else p
        if (again.forward, again.backward) != (p.forward, p.backward) or (
            r is not None
            and k.rows_gathered
            != r.rows_looked_up
            + (0 if r.pooled_at_owner else r.slots)  # the owner pools: no rows come back
        ):  # the replanned call must be the one the collection prices
            raise RuntimeError(f"call {c.stack_name}: its {name} plan, planned again, differs "
                               f"from the collection's: update _replan")  # fmt: skip
        calls.append({
            "stack": c.stack_name, "x_shape": list(c.x_shape), "exchange": name,
            "applies": applies, "global_slots": math.prod(c.x_shape),
            "forward_wire_bytes": p.forward_wire_bytes,
            "update_wire_bytes": p.backward_wire_bytes,
            "out_move_bytes": list(c.out_move_bytes),
            "forward_slots": k.rows_gathered, "update_slots": k.rows_scattered,
            "modelled_in_ms": dict(c.options)[name],
            "overflow": name == "routed" and c.note.startswith("routed would overflow"),
            "routed": None if r is None else {
                "num_buckets": r.num_buckets, "slots": r.slots, "capacity": r.capacity,
                "pooled_at_owner": r.pooled_at_owner,
                "capacity_factor": round(r.capacity_factor, 4),
                "rows_looked_up": r.rows_looked_up},
            "host_wire_bytes": p.wire_bytes_over(["hosts"])
            if "hosts" in dict(p.mesh_axes) else None,
        })  # fmt: skip
    hosts = [c["host_wire_bytes"] for c in calls]
    looked_up = sum(c["routed"]["rows_looked_up"] for c in calls if c["routed"])
    return {
        "forward_wire_bytes": sum(c["forward_wire_bytes"] for c in calls),
        "update_wire_bytes": sum(c["update_wire_bytes"] for c in calls),
        "out_move_bytes": sum(sum(c["out_move_bytes"]) for c in calls),
        "host_wire_bytes": None if None in hosts else sum(hosts),
        "forward_slots": sum(c["forward_slots"] for c in calls),
        "update_slots": sum(c["update_slots"] for c in calls),
        "slots_per_device": sum(max(c["forward_slots"], c["update_slots"]) for c in calls),
        "capacity": [c["routed"]["capacity"] for c in calls if c["routed"]],
        "buckets_times_capacity": looked_up,
        "calls_applied": sum(c["applies"] for c in calls),
        "overflow": any(c["overflow"] for c in calls),
        "modelled_step_in_ms": rest + sum(c["modelled_in_ms"] for c in calls),
        "calls": calls,
    }


def _case(w: W.Workload, scale: float, kind: str, n: int, placement: str,
          config: ScalingConfig) -> tuple[dict[str, Any], list[dict[str, Any]]]:  # fmt: skip
    """Plans one workload on one mesh; the plan's facts and a row per exchange."""
    from jaxembed.collection import TableConfig
    from jaxembed.plan.collection import parse_bytes, plan_collection

    mesh = make_mesh(kind, n)
    tables = [TableConfig(t.name, t.rows, t.dim, placement=placement) for t in w.tables]
    budget = config.memory_per_device if placement == "auto" else _NO_LIMIT
    start = time.perf_counter()
    plan = plan_collection(tables, _features(w), mesh, batch_size=w.batch_size,
                           memory_per_device=budget, backend=config.backend)  # fmt: skip
    seconds = time.perf_counter() - start
    placements = list(plan.placements.values())
    facts = {
        "scale": scale, "workload": w.name, "mesh_kind": kind, "devices": n,
        "mesh": dict(zip(mesh.axis_names, (int(s) for s in mesh.axis_sizes), strict=True)),
        "placements": placement,
        "memory_per_device_bytes": parse_bytes(budget) if placement == "auto" else None,
        "placement_counts": {p: placements.count(p) for p in dict.fromkeys(placements)},
        "planned_exchanges": [c.exchange for c in plan.calls],
        "planned_step_in_ms": plan.step_ms, "peak_bytes": int(plan.peak_bytes),
        "num_calls": len(plan.calls), "global_slots": sum(math.prod(c.x_shape)
                                                          for c in plan.calls),
        "evaluations": plan.evaluations, "plan_time_in_s": round(seconds, 3),
    }  # fmt: skip
    rows = []
    for exchange in EXCHANGES:
        fig = exchange_figures(plan, mesh, exchange)
        g = facts["global_slots"]
        name = (f"scale={_scale(scale)},mesh={'x'.join(map(str, facts['mesh'].values()))},"
                f"placements={placement},exchange={exchange}")  # fmt: skip
        rows.append({"name": name, **{k: facts[k] for k in ("scale", "mesh_kind", "devices",
                     "mesh", "placements", "global_slots")}, "exchange": exchange, **fig,
                     "slots_over_g_per_n": fig["slots_per_device"] / (g / n)})  # fmt: skip
    return facts, rows


def _efficiency(rows: list[dict[str, Any]]) -> None:
    """Adds `strong_scaling_efficiency`: T(n0) · n0 / (n · T(n)), n0 the smallest n of the
    same scale, mesh kind, placements and exchange."""
    base: dict[tuple, tuple[int, float]] = {}
    key = lambda r: (r["scale"], r["mesh_kind"], r["placements"], r["exchange"])
    for r in sorted(rows, key=lambda r: r["devices"]):
        base.setdefault(key(r), (r["devices"], r["modelled_step_in_ms"]))
    for r in rows:
        n0, t0 = base[key(r)]
        r["baseline_devices"] = n0
        r["strong_scaling_efficiency"] = t0 * n0 / (r["devices"] * r["modelled_step_in_ms"])


def run_scaling(config: ScalingConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Plans every scale, mesh and placement of `config` and reads both exchanges.

    Returns:
      The record: `schema`, `config`, `machine`, `definitions` (what each figure is),
      `workloads` (per scale), `plans` (per scale, mesh and placements: the plan's own
      choice, its peak memory and how long it took) and `rows` (per plan and exchange: the
      figures of `exchange_figures`, `slots_over_g_per_n` and `strong_scaling_efficiency`).
    """
    import jax

    record: dict[str, Any] = {
        "schema": SCHEMA, "config": dataclasses.asdict(config),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"python": platform.python_version(), "jax": jax.__version__,
                    "platform": platform.platform()},
        "definitions": DEFINITIONS, "workloads": [], "plans": [], "rows": [],
    }  # fmt: skip
    for scale in config.scales:
        w = W.dlrm_workload(config.batch_size, scale=scale, dim=config.dim)
        record["workloads"].append({
            "scale": scale, "name": w.name, "batch_size": w.batch_size, "dim": w.dim,
            "num_features": len(w.features), "num_tables": len(w.tables),
            "total_rows": w.total_rows, "max_ids": sorted({f.max_ids for f in w.features}),
        })  # fmt: skip
        for kind in config.meshes:
            for n in config.devices:
                for placement in config.placements:
                    facts, rows = _case(w, scale, kind, n, placement, config)
                    log(f"[planner-scaling] {w.name} mesh {facts['mesh']} {placement}: "
                        f"planned in {facts['plan_time_in_s']:.1f} s")  # fmt: skip
                    record["plans"].append(facts)
                    record["rows"].extend(rows)
    _efficiency(record["rows"])
    record["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
    return record


DEFINITIONS = {
    "mesh": "jax.sharding.AbstractMesh((n,), ('x',)) or AbstractMesh((n // 8, 8), ('hosts', "
            "'local')): shapes and names only, no devices; the batch is split over every axis",
    "global_slots": "G: the id slots of the global batch, sum over calls of prod(x_shape) "
                    "(batch x features x max_ids, every bag full)",
    "forward_wire_bytes": "per device, sum over calls of the exchange's plan.forward_wire_bytes "
                          "(ring model)",
    "update_wire_bytes": "per device, sum over calls of the row-sparse update plan's "
                         "backward_wire_bytes",
    "forward_slots": "per device, sum over calls of ExchangeCandidate.rows_gathered: gather G; "
                     "routed M + n*C (its own M = G/n slots fetched back, and the n*C ids the "
                     "n buckets of capacity C send it to look up)",
    "update_slots": "per device, sum over calls of ExchangeCandidate.rows_scattered: gather G, "
                    "routed n*C",
    "slots_per_device": "sum over calls of max(forward_slots, update_slots)",
    "slots_over_g_per_n": "slots_per_device / (G / n)",
    "capacity": "RoutedPlan.capacity C per routed call: mu + 4 sqrt(mu) + 1, mu = M / n",
    "modelled_step_in_ms": "the collection's modelled step with this exchange in every call "
                           "(CallCost.options) plus the slowest device's optimizer state traffic",
    "strong_scaling_efficiency": "T(n0) * n0 / (n * T(n)), n0 the smallest mesh",
    "host_wire_bytes": "2-D meshes: plan.wire_bytes_over(['hosts']), summed over calls",
}  # fmt: skip


# --- the report ------------------------------------------------------------------------------


def _mib(v: float | None) -> str:
    return "–" if v is None else f"{v / 2**20:,.1f}"


def _row(r: dict[str, Any]) -> str:
    mesh = " x ".join(f"{a}={s}" for a, s in r["mesh"].items())
    cap = (f"{'/'.join(map(str, r['capacity']))} ({r['buckets_times_capacity']:,})"
           if r["capacity"] else "–")  # fmt: skip
    flag = " (overflows)" if r["overflow"] else ""
    return (
        f"| {mesh} | {r['exchange']}{flag} | {_mib(r['forward_wire_bytes'])} | "
        f"{_mib(r['update_wire_bytes'])} | {r['slots_per_device']:,} | "
        f"{r['slots_over_g_per_n']:.3f} | {cap} | {r['modelled_step_in_ms']:,.1f} | "
        f"{r['strong_scaling_efficiency']:.3f} |"
    )


def _findings(rows: list[dict[str, Any]]) -> list[str]:
    """What the first table shows, in numbers read from it."""
    first = rows[0]
    same = [r for r in rows if (r["scale"], r["mesh_kind"], r["placements"]) ==
            (first["scale"], first["mesh_kind"], first["placements"])]  # fmt: skip
    by = {e: sorted((r for r in same if r["exchange"] == e), key=lambda r: r["devices"])
          for e in EXCHANGES}  # fmt: skip
    g, r = by["gather"], by["routed"]
    if len(g) < 2 or len(r) < 2:
        return []
    ns = " → ".join(str(x["devices"]) for x in g)

    def walk(xs, key, fmt):
        return " → ".join(fmt(x[key]) for x in xs)

    return [
        f"At scale {_scale(first['scale'])}, {first['mesh_kind']} mesh, {first['placements']} "
        f"placements, n = {ns}: the gather exchange's bytes per device "
        f"(forward + update) go {walk(g, 'total', _mib)} MiB and every device walks all "
        f"G = {first['global_slots']:,} slots whatever n (slots / (G/n) = "
        f"{walk(g, 'slots_over_g_per_n', '{:.0f}'.format)}); the routed exchange's go "
        f"{walk(r, 'total', _mib)} MiB with slots / (G/n) = "
        f"{walk(r, 'slots_over_g_per_n', '{:.3f}'.format)}: they shrink with n, but the "
        f"ratio creeps up as the capacity's 4√μ + 1 headroom grows against μ = M/n "
        f"(C = {walk(r, 'capacity', lambda c: '/'.join(map(str, c)))}). Modelled step: gather "
        f"{walk(g, 'modelled_step_in_ms', '{:,.1f}'.format)} ms (efficiency "
        f"{walk(g, 'strong_scaling_efficiency', '{:.3f}'.format)}), routed "
        f"{walk(r, 'modelled_step_in_ms', '{:,.1f}'.format)} ms (efficiency "
        f"{walk(r, 'strong_scaling_efficiency', '{:.3f}'.format)}).",
        *(["", *_same_as(rows)] if _same_as(rows) else []),
    ]


_COMPARED = ("forward_wire_bytes", "update_wire_bytes", "slots_per_device", "capacity",
             "modelled_step_in_ms")  # fmt: skip


_VARIANT = ("scale", "mesh_kind", "devices", "placements", "exchange")


def _same_as(rows: list[dict[str, Any]]) -> list[str]:
    """Which variants give the same figures (`_COMPARED`) as another: the 2-D meshes as the
    1-D ones, auto placements as all rows, the largest scale as the smallest."""

    def key(r, field):
        return tuple(r[k] for k in _VARIANT if k != field)

    scales = sorted({r["scale"] for r in rows})
    out = []
    for field, a, b, what, compared in (
        ("mesh_kind", "2d", "1d", "The 2-D meshes against the 1-D ones", _COMPARED),
        ("placements", "auto", "rows", "auto placements against all rows", _COMPARED),
        ("scale", scales[-1], scales[0], f"scale {_scale(scales[-1])} against "
         f"{_scale(scales[0])}", _COMPARED[:4]),
    ):  # fmt: skip
        base = {key(r, field): r for r in rows if r[field] == b}
        pairs = [(base[key(r, field)], r) for r in rows
                 if a != b and r[field] == a and key(r, field) in base]  # fmt: skip
        if pairs:
            same = sum(all(x[k] == y[k] for k in compared) for x, y in pairs)
            out.append(f"{what}: the same {', '.join(compared)} in {same} of {len(pairs)} "
                       f"rows.")  # fmt: skip
    return [" ".join(out)] if out else []


def markdown(record: dict[str, Any]) -> str:
    """The record as Markdown: how it was made, what the columns mean, one table per
    workload scale and placements, and the plans' own choices."""
    cfg = record["config"]
    rows = [dict(r, total=r["forward_wire_bytes"] + r["update_wire_bytes"])
            for r in record["rows"]]  # fmt: skip
    budget = cfg["memory_per_device"]
    out = [
        f"# jaxembed bench planner-scaling{' (quick)' if cfg.get('quick') else ''}", "",
        f"Strong scaling on paper: the DLRM tables (`workloads.dlrm_workload`, batch "
        f"{cfg['batch_size']:,} global on every mesh, dim {cfg['dim']}, 26 features of up to "
        f"20 ids, every bag full, ids uniform) planned for n = "
        f"{', '.join(map(str, cfg['devices']))} devices that do not exist. The meshes are "
        f"`jax.sharding.AbstractMesh((n,), ('x',))` (1-D) and `AbstractMesh((n // 8, 8), "
        f"('hosts', 'local'))` (2-D: hosts of 8): shapes and axis names, no devices; the "
        f"batch is split over every axis. `jaxembed.plan_collection(..., backend="
        f"'{cfg['backend']}')` plans the collection's step (lookup + row-wise Adagrad "
        f"row-sparse update, one `embedding_bag` call per stack) with every table split by "
        f"rows (`rows`, block rows) or with its own placements within {budget} per device "
        f"(`auto`); each call's plan is then read for the gather exchange (every id of the "
        f"batch gathered over the group, looked up, the pooled sums reduce-scattered) and for "
        f"the routed one (each distinct id sent to its owner).", "",
        "Columns, per device and step: **fwd / update MiB**: Σ calls' `plan.forward_wire_bytes`"
        " / `plan.backward_wire_bytes` (ring model); **slots**: Σ calls' max(`rows_gathered`, "
        "`rows_scattered`) of the exchange's `ExchangeCandidate`, the id slots the device walks"
        " — gather: all G slots of the batch, routed: its own M = G/n plus the n·C ids the n "
        "buckets of capacity C send it (`plan.routed`); **slots/(G/n)**: against a perfect "
        "split; **C (n·C)**: the routed capacity per call, C = μ + 4√μ + 1 with μ = M/n (less"
        " where the planner sized the call: no owner is sent more distinct ids than the rows "
        "it holds of the call's tables), and n·C; **step ms**: the collection's modelled step "
        "with that exchange in every call "
        f"(the `{cfg['backend']}` cost constants); **efficiency**: T(n₀)·n₀ / (n·T(n)), n₀ = "
        f"{min(cfg['devices'])}. \"(overflows)\": the model expects a routed bucket to overflow "
        "(its step is then the gather path's).", "",
        *_findings(rows),
    ]  # fmt: skip
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["scale"], r["placements"]), []).append(r)
    works = {w["scale"]: w for w in record["workloads"]}
    for (scale, placement), group in groups.items():
        w = works[scale]
        what = ("every table split by rows" if placement == "rows" else
                f"the planner's placements within {budget} per device")  # fmt: skip
        out += [
            "", f"## `{w['name']}`: {w['num_tables']} tables, {w['total_rows']:,} rows; {what}",
            "", f"G = {group[0]['global_slots']:,} id slots in the global batch.", "",
            "| mesh | exchange | fwd MiB | update MiB | slots | slots/(G/n) | C (n·C) | "
            "step ms | efficiency |", "|---|---|---|---|---|---|---|---|---|",
            *(_row(r) for r in sorted(group, key=lambda r: (r["mesh_kind"], r["devices"],
                                                            EXCHANGES.index(r["exchange"])))),
        ]  # fmt: skip
    out += ["", "## The plans' own choices", "",
            "| workload | mesh | placements | placements chosen | exchanges chosen | step ms | "
            "peak GiB | host-axis MiB (2-D, routed) | planned in s |",
            "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    host = {(r["scale"], r["mesh_kind"], r["devices"], r["placements"]): r["host_wire_bytes"]
            for r in rows if r["exchange"] == "routed"}  # fmt: skip
    for p in record["plans"]:
        mesh = " x ".join(f"{a}={s}" for a, s in p["mesh"].items())
        counts = ", ".join(f"{k} {v}" for k, v in p["placement_counts"].items())
        h = host[(p["scale"], p["mesh_kind"], p["devices"], p["placements"])]
        out.append(
            f"| {p['workload']} | {mesh} | {p['placements']} | {counts} | "
            f"{'/'.join(dict.fromkeys(p['planned_exchanges']))} | "
            f"{p['planned_step_in_ms']:,.1f} | {p['peak_bytes'] / 2**30:.2f} | {_mib(h)} | "
            f"{p['plan_time_in_s']:.1f} |"
        )
    return "\n".join(out) + "\n"


# --- the command -----------------------------------------------------------------------------


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x)


def _floats(s: str) -> tuple[float, ...]:
    from fractions import Fraction

    return tuple(float(Fraction(x)) for x in s.split(",") if x)


def _names(s: str) -> tuple[str, ...]:
    return tuple(x for x in s.split(",") if x)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxembed bench planner-scaling",
                                description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("--quick", action="store_true", help="tiny shapes (for the tests)")
    p.add_argument("--json", help="write the record here")
    p.add_argument("--markdown", help="write the tables here")
    p.add_argument("--batch-size", type=int, help="global batch (default 65536)")
    p.add_argument("--scales", type=_floats, help=f"e.g. 1/8,1 (default {DEFAULT_SCALE:g},1)")
    p.add_argument("--dim", type=int)
    p.add_argument("--devices", type=_ints, help="mesh sizes, e.g. 8,64,512")
    p.add_argument("--meshes", type=_names, help="1d and/or 2d")
    p.add_argument("--placements", type=_names, help="rows and/or auto")
    p.add_argument("--memory", dest="memory_per_device", help="auto's budget, e.g. 16GiB")
    p.add_argument("--backend", help="cost constants: cpu, gpu or tpu")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """`jaxembed bench planner-scaling [--quick] [--json PATH] [--markdown PATH] ...`.

    Returns:
      The exit status: 0, or 2 for bad flags.
    """
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    base = QUICK if args.quick else ScalingConfig()
    flags = ("batch_size", "scales", "dim", "devices", "meshes", "placements",
             "memory_per_device", "backend")  # fmt: skip
    fields = {k: getattr(args, k) for k in flags if getattr(args, k) is not None}
    config = dataclasses.replace(base, **fields)
    bad = ([m for m in config.meshes if m not in ("1d", "2d")]
           + [p for p in config.placements if p not in ("rows", "auto")])  # fmt: skip
    if bad or not config.devices:
        print(f"jaxembed bench planner-scaling: error: unknown {bad} (meshes: 1d,2d; "
              f"placements: rows,auto) or no --devices", file=sys.stderr)  # fmt: skip
        return 2
    try:
        record = run_scaling(config, log=lambda m: print(m, flush=True))
    except ValueError as err:  # a batch that does not divide, a budget nothing fits
        print(f"jaxembed bench planner-scaling: error: {err}", file=sys.stderr)
        return 2
    text = markdown(record)
    print(text)
    write_outputs(record, json_path=args.json, markdown_path=args.markdown,
                  markdown=lambda: text)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
