"""One process of `jaxembed bench planner`: the planner's layout against four uniform ones.

The driver (`benchmarks.planner.bench`) starts this as `python -m benchmarks.planner.bench
--worker ...` with `XLA_FLAGS=--xla_force_host_platform_device_count=N`. `run_worker`:

1. draws the DLRM workload (`workloads.dlrm_workload`: 26 Zipf multi-hot features), measures
   the ids of a few batches the timed steps never see (`jaxembed.id_stats`), and plans five
   layouts with `plan_collection` (`plan_layouts`): the planner's own choice within the
   budget, and every table fixed to one placement — replicated where its replica fits,
   rows, table, columns — each priced by the same model (modelled step, peak memory, bytes);
2. compiles each layout's training step (lookup, `loss = sum(pooled * cotangent)`, row-wise
   Adagrad row-sparse update, tables and state donated) and reads its memory
   (`memory_analysis()`) and wire bytes (`jaxembed.hlo`);
3. runs two steps of each from the initial tables against the float64 reference on the rows
   they touch (`recsys_check`; every replica of a replicated row is read);
4. times them interleaved (`recsys_worker`'s rounds: wall and process CPU time) and traces a
   step of each (`recsys_profile.breakdown`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.common.reference import reference_pooled
from benchmarks.recsys import check as C
from jaxembed import workloads as W

__all__ = ["LAYOUTS", "WorkerConfig", "plan_layouts", "run_worker"]

SCHEMA = "jaxembed.bench.planner.worker/1"
LAYOUTS = ("planner", "replicated", "rows", "table", "columns")
"""The layouts measured: the planner's, then the uniform ones."""
_NO_LIMIT = "1TiB"  # plans a fixed layout whatever it needs; the budget is compared after


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """What one worker process runs.

    Attributes:
      batch_size, scale, dim: the DLRM workload's (`workloads.dlrm_workload`).
      devices: the 1-D mesh `("data",)` (the process must have that many devices).
      memory_per_device: the planner's budget, bytes or a string like `"32MiB"`.
      layouts: which of `LAYOUTS` to run.
      seed: of the tables, batches and cotangent.
      batches: distinct batches the timed steps cycle through; stats_batches: other batches
        (steps 1000, 1001, ...) whose ids the planner measures.
      check_steps: steps from the initial tables checked against the reference.
      repeats, warmup, min_samples, max_seconds, profile_calls: as `recsys_worker`.
    """

    batch_size: int = 2048
    scale: float = 1 / 32
    dim: int = 32
    devices: int = 8
    memory_per_device: int | str = "64MiB"
    layouts: tuple[str, ...] = LAYOUTS
    seed: int = 0
    batches: int = 4
    stats_batches: int = 4
    check_steps: int = 2
    repeats: int = 9
    warmup: int = 1
    min_samples: int = 7
    max_seconds: float = 10.0
    profile_calls: int = 1


def plan_layouts(
    tables: Sequence[Any], features: Sequence[Any], mesh: Any, *, batch_size: int,
    memory_per_device: int | str, optimizer: Any = None, id_stats: Any = None,
    layouts: Sequence[str] = LAYOUTS,
) -> dict[str, Any]:  # fmt: skip
    """The planner's `CollectionPlan` and the uniform layouts', priced by the same model.

    `"planner"` plans every table within the budget. `"rows"`, `"table"` and `"columns"` fix
    every table to that placement (planned without a limit: `peak_bytes` says whether it
    fits). `"replicated"` replicates the tables whose replica fits, smallest first, each kept
    while the whole layout stays within the budget; the others stay split by rows (the
    placement that needs the least memory).

    Args:
      tables: `TableConfig`s (their placements are replaced).
      features, mesh, batch_size, memory_per_device, optimizer, id_stats: as
        `jaxembed.plan_collection`.
      layouts: which of `LAYOUTS`.

    Returns:
      `{layout: CollectionPlan}` in the order of `layouts`.

    Examples:
      >>> from jax.sharding import AbstractMesh
      >>> from jaxembed.collection import FeatureConfig, TableConfig
      >>> tables = [TableConfig("big", 400_000, 16), TableConfig("small", 100, 16)]
      >>> features = [FeatureConfig("a", "big", max_ids=4), FeatureConfig("b", "small")]
      >>> plans = plan_layouts(tables, features, AbstractMesh((8,), ("data",)),
      ...                      batch_size=256, memory_per_device="4MiB")
      >>> plans["replicated"].placements  # big's replica (27 MB) does not fit
      {'big': 'rows', 'small': 'replicated'}
      >>> plans["table"].placements, plans["table"].peak_bytes > 4 * 2**20
      ({'big': 'table', 'small': 'table'}, True)
    """
    from jaxembed.plan.collection import parse_bytes, plan_collection

    budget = parse_bytes(memory_per_device)
    kw = {"batch_size": batch_size, "optimizer": optimizer, "id_stats": id_stats}

    def fixed(placements: Mapping[str, str]):
        configs = [dataclasses.replace(t, placement=placements[t.name]) for t in tables]
        return plan_collection(configs, features, mesh, memory_per_device=_NO_LIMIT, **kw)

    out = {}
    for name in layouts:
        if name == "planner":
            auto = [dataclasses.replace(t, placement="auto") for t in tables]
            out[name] = plan_collection(auto, features, mesh, memory_per_device=budget, **kw)
        elif name == "replicated":
            choice = {t.name: "rows" for t in tables}
            for t in sorted(tables, key=lambda t: (t.vocab_size * t.dim, t.name)):
                trial = {**choice, t.name: "replicated"}
                if fixed(trial).peak_bytes <= budget:
                    choice = trial
            out[name] = fixed(choice)
        elif name in ("rows", "table", "columns"):
            out[name] = fixed({t.name: name for t in tables})
        else:
            raise ValueError(f"unknown layout {name!r}: choose from {LAYOUTS}")
    return out


def _features(w: W.Workload) -> list[Any]:
    from jaxembed.collection import FeatureConfig

    return [FeatureConfig(f.name, f.table, max_ids=f.max_ids) for f in w.features]


def _variant(name: str, plan: Any, w: W.Workload, mesh: Any, opt: Any) -> Any:
    """The benchmark's step (`recsys_impls`' jaxembed one) on `plan`'s layout."""
    from benchmarks.recsys.impls import collection_variant
    from jaxembed.collection import layout_collection

    layout = layout_collection(plan.table_configs, _features(w), mesh)
    info = {"layout": str(layout), "exchange": {str(k): v for k, v in plan.exchanges.items()}}
    return collection_variant(name, layout, mesh, opt, [f.name for f in w.features], info,
                              exchange=plan.exchanges)  # fmt: skip


def modelled(plan: Any, budget: int) -> dict[str, Any]:
    """What the model says of a plan: step, memory and bytes per device (JSON-ready)."""
    calls = plan.calls
    fallback = sum(c.fallback_forward_bytes + c.fallback_update_bytes for c in calls)
    again = sum(c.ids_again_bytes for c in calls)
    return {
        "placements": dict(plan.placements),
        "row_sharding": {t.name: t.row_sharding for t in plan.table_configs
                         if t.placement in ("rows", "table_rows")},
        "placement_counts": {p: list(plan.placements.values()).count(p)
                             for p in dict.fromkeys(plan.placements.values())},
        "exchanges": {str(k): v for k, v in plan.exchanges.items()},
        "modelled_step_in_ms": round(plan.step_ms, 4),
        "modelled_update_state_in_ms": round(max(plan.update_ms, default=0.0), 4),
        "modelled_peak_bytes": int(plan.peak_bytes),
        "modelled_allocated_bytes": int(plan.allocated_bytes),
        "modelled_buffer_bytes": int(plan.buffer_bytes),
        "over_budget": bool(plan.peak_bytes > budget),
        "modelled_wire_bytes": float(sum(c.wire_bytes for c in calls) + fallback),
        # The update's second move of the ids (and weights) into its body: compiled in one
        # step with the lookup, XLA may share the lookup's collectives instead.
        "modelled_update_ids_again_bytes": float(again),
        "modelled_forward_wire_bytes": float(sum(
            c.forward_bytes + c.out_move_bytes[0] + c.fallback_forward_bytes for c in calls)),
        "calls": [{"stack": c.stack_name, "combiner": c.combiner, "x_shape": list(c.x_shape),
                   "num_bags": c.num_bags, "exchange": c.exchange,
                   "modelled_in_ms": round(c.modelled_ms, 4),
                   "options_in_ms": {n: round(ms, 4) for n, ms in c.options},
                   "forward_bytes": c.forward_bytes, "update_bytes": c.update_bytes,
                   "out_move_bytes": list(c.out_move_bytes), "note": c.note}
                  for c in calls],
    }  # fmt: skip


def _compiled_facts(facts: dict[str, Any], budget: int) -> dict[str, Any]:
    m = facts["memory_per_device_bytes"]
    peak = m["argument"] + m["output"] - m["alias"] + m["temp"]
    return {"compiled_peak_bytes": int(peak), "compiled_over_budget": bool(peak > budget)}


def run_worker(config: WorkerConfig) -> dict[str, Any]:
    """Plans, compiles, checks, times and profiles the layouts of `config`.

    Returns:
      A JSON-ready record: the workload, the budget, the machine's load, and per layout
      (`layouts`, in order) the model's figures (`modelled`), the compiled ones, the check
      and the times.

    Raises:
      RuntimeError: the process has fewer devices than `config.devices`.
    """
    import jax
    from jax.sharding import AxisType

    import jaxembed
    from benchmarks.recsys import hlo_profile as recsys_profile
    from benchmarks.recsys import worker as RW
    from benchmarks.recsys.impls import dense_ids
    from jaxembed.collection import TableConfig
    from jaxembed.plan.collection import parse_bytes
    from jaxembed.plan.cost import calibration_path, load_constants

    RW.require_devices(config.devices)
    w = W.dlrm_workload(config.batch_size, scale=config.scale, dim=config.dim)
    budget = parse_bytes(config.memory_per_device)
    mesh = jax.make_mesh((config.devices,), ("data",), axis_types=(AxisType.Explicit,))
    opt = jaxembed.optim.rowwise_adagrad(W.LEARNING_RATE, eps=W.EPS)
    features = _features(w)
    sample = [dense_ids(w, W.make_batch(w, config.seed, 1000 + s))
              for s in range(config.stats_batches)]  # fmt: skip
    stats = jaxembed.id_stats(sample, features)
    tables = [TableConfig(t.name, t.rows, t.dim) for t in w.tables]
    plans = plan_layouts(tables, features, mesh, batch_size=w.batch_size,
                         memory_per_device=budget, optimizer=opt, id_stats=stats,
                         layouts=config.layouts)  # fmt: skip

    host = W.make_tables(w, config.seed)
    batches = [W.make_batch(w, config.seed, s) for s in range(config.batches)]
    cot = W.make_cotangent(w, config.seed)
    checked = batches[: config.check_steps]
    expected = C.touched_reference(w, host, checked, cot, optimizer="rowwise_adagrad")
    untouched = C.untouched_sample(w, expected, host)
    forward_ref = reference_pooled(w, host, batches[0])
    constants = {c.backend: dataclasses.asdict(c)  # XLA's kernels, and the native ones'
                 for c in (load_constants("cpu"), load_constants("cpu", "native"))}  # fmt: skip
    result: dict[str, Any] = {
        "schema": SCHEMA, "config": dataclasses.asdict(config),
        "workload": {"name": w.name, "batch_size": w.batch_size, "dim": w.dim,
                     "num_features": len(w.features), "num_tables": len(w.tables),
                     "total_rows": w.total_rows, "table_rows": {t.name: t.rows for t in w.tables},
                     "ids_per_step": [sum(int(n.sum()) for _, n in b.values()) for b in batches]},
        "mesh": {"data": config.devices}, "memory_per_device_bytes": budget,
        "cost_constants": constants,
        "calibration_file": str(calibration_path()) if calibration_path() and
        calibration_path().exists() else None,
        "planner_text": str(plans["planner"]) if "planner" in plans else None,
        "loadavg_before": list(os.getloadavg()), "layouts": {},
    }  # fmt: skip
    host_bytes = sum(a.nbytes for a in host.values())
    ram_budget = int(0.7 * RW._available_bytes()) - host_bytes
    readies, held = {}, 0
    for name, plan in plans.items():
        rec: dict[str, Any] = {"status": "compiled", "modelled": modelled(plan, budget)}
        result["layouts"][name] = rec
        try:
            variant = _variant(name, plan, w, mesh, opt)
            facts, step, fwd = RW._compile(variant, w)
        except Exception as err:  # a layout that does not compile is a result
            rec.update(RW._error("compile", err))
            continue
        rec.update(info=variant.info, **facts, **_compiled_facts(facts, budget))
        m = facts["memory_per_device_bytes"]
        need = (m["argument"] + m["output"] - m["alias"] + m["temp"]) * config.devices
        if held + need > ram_budget:
            why = (f"needs {need / 2**30:.2f} GiB of RAM with {held / 2**30:.2f} GiB held, "
                   f"over {ram_budget / 2**30:.2f} GiB")  # fmt: skip
            rec.update(status="not_run", reason=why)
            continue
        try:
            state = jax.device_put(variant.make_state(host), step.input_shardings[0][0])
            inputs = [variant.prepare(w, b) for b in batches]
            cot_dev = jax.device_put(cot, variant.cotangent_sharding)
        except Exception as err:
            rec.update(RW._error("setup", err))
            continue
        held += m["argument"] * config.devices
        readies[name] = RW._Ready(variant, step, fwd, state, inputs, cot_dev)
    del host
    for name, ready in list(readies.items()):
        rec = result["layouts"][name]
        try:
            rec["check"] = RW._check(ready, w, expected, untouched, forward_ref,
                                     config.check_steps)  # fmt: skip
            rec["agrees_with_reference"] = rec["check"]["agrees_with_reference"]
            rec["status"] = "ok"
        except Exception as err:
            rec.update(RW._error("check", err))
            del readies[name]
    timing = RW.WorkerConfig(repeats=config.repeats, warmup=config.warmup,
                             min_samples=config.min_samples,
                             max_seconds=config.max_seconds)  # fmt: skip
    try:
        for name, times in RW._time(readies, timing).items():
            result["layouts"][name].update(times)
    except Exception as err:
        result["timing_error"] = RW._error("time", err)["error"]
    for name, ready in readies.items() if config.profile_calls else ():
        try:
            profile = recsys_profile.breakdown(ready.run_step, config.profile_calls,
                                               ready.step.as_text())  # fmt: skip
        except Exception as err:
            profile = RW._error("profile", err)
        result["layouts"][name]["profile"] = profile
    result["loadavg_after"] = list(os.getloadavg())
    return result
