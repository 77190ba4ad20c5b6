"""Running one benchmark case: compile, read the HLO, check against the dense reference, time.

`run_case` returns a plain-data record (JSON-ready) of one case: for every implementation its
status, its collectives from the compiled HLO, its memory from `memory_analysis()`, its
compile time, whether its numbers match the dense reference and its step times.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding

import jaxembed
from benchmarks.common.compiled import collective_record, error_record, memory_record, run_bytes
from benchmarks.common.reference import agreement, dense_reference
from benchmarks.common.timing import TimingPolicy, time_interleaved, time_record
from benchmarks.layouts.cases import Case, minimum_wire_bytes, spec_text
from benchmarks.layouts.impls import Program, build, make_mesh, make_step, update_floor
from jaxembed import hlo

__all__ = ["run_case", "slim"]


@dataclasses.dataclass
class _Ready:
    """A compiled step and the state it runs on."""

    program: Program
    step: Any
    params: Any
    opt_state: Any
    ids: Any
    ct: Any

    def __call__(self) -> Any:
        self.params, self.opt_state, out = self.step(self.params, self.opt_state, self.ids, self.ct)
        jax.block_until_ready((self.params, out))
        return out


def _compile(
    name: str,
    case: Case,
    host: tuple[np.ndarray, np.ndarray, np.ndarray] | None,
    optimizer: optax.GradientTransformation,
) -> tuple[dict[str, Any], _Ready | None]:
    """Builds and compiles one implementation; errors are results, not exceptions."""
    table, ids, ct = host if host is not None else (None, None, None)
    try:
        program = build(name, case, table)
    except Exception as err:  # Flax raising while it builds its module is a result
        return error_record("build", err), None
    try:
        step, ids_sharding, out_sharding = make_step(program, optimizer, case.layout)
        opt_state = optimizer.init(program.params)
        if host is None:
            ids_arg = jax.ShapeDtypeStruct(case.ids_shape, np.int32, sharding=ids_sharding)
            ct_arg = jax.ShapeDtypeStruct(
                case.out_shape, np.dtype(case.dtype), sharding=out_sharding
            )
        else:
            ids_arg = jax.device_put(ids, ids_sharding)
            ct_arg = jax.device_put(ct.astype(case.dtype), out_sharding)
        start = time.perf_counter()
        with jax.set_mesh(program.mesh):
            compiled = step.lower(program.params, opt_state, ids_arg, ct_arg).compile()
        compile_s = time.perf_counter() - start
    except Exception as err:  # e.g. ShardingTypeError from Flax in an Explicit mesh
        return error_record("compile", err), None
    text = compiled.as_text()
    found = [collective_record(c, program.mesh) for c in hlo.collectives(text)]
    largest = max(found, key=lambda c: c["result_bytes"], default=None)
    result: dict[str, Any] = {
        "status": "compiled",
        "mesh_axis_types": str(program.mesh.axis_types[0]).rsplit(".", 1)[-1],
        "compile_time_in_s": round(compile_s, 4),
        "wire_bytes": hlo.total_wire_bytes(text),  # each collective times its trips
        "largest_collective": largest,
        "collectives": found,
        **memory_record(compiled),
    }
    ready = None
    if host is not None:
        ready = _Ready(program, compiled, program.params, opt_state, ids_arg, ct_arg)
    return result, ready


def _check(ready: _Ready, reference: tuple[np.ndarray, np.ndarray]) -> dict[str, Any]:
    """Runs the compiled step once and compares its output and new table to the reference."""
    out = ready()
    return agreement(out, reference[0], ready.program.table_of(ready.params), reference[1])


def _plan_record(case: Case) -> dict[str, Any]:
    """What jaxembed's plan says it will move, to compare with its compiled HLO."""
    layout = case.layout
    try:
        mesh = jax.sharding.AbstractMesh(
            layout.mesh_shape, layout.mesh_axes,
            axis_types=(AxisType.Explicit,) * len(layout.mesh_shape),
        )  # fmt: skip
        plan = jaxembed.plan_embedding(
            mesh, case.ids_shape, case.table_shape, x_spec=layout.ids_spec,
            weight_spec=layout.table_spec, out_spec=layout.out_spec, dtype=case.dtype,
        )  # fmt: skip
    except Exception as err:
        return error_record("plan", err)
    return {
        "gradient_exchange": plan.gradient_exchange,
        "exchange_reason": plan.exchange_reason,
        "forward_wire_bytes": float(plan.forward_wire_bytes),
        "backward_wire_bytes": float(plan.backward_wire_bytes),
        "wire_bytes": float(plan.forward_wire_bytes + plan.backward_wire_bytes),
        "rows_exchange_bytes": float(plan.rows_exchange_bytes),
        "dense_exchange_bytes": float(plan.dense_exchange_bytes),
        "collectives": [_plan_collective(c) for c in (*plan.forward, *plan.backward)],
    }


def _plan_collective(c: Any) -> dict[str, Any]:
    return {
        "phase": c.phase,
        "op": c.op,
        "axes": list(c.axes),
        "operand": c.operand,
        "wire_bytes": float(c.wire_bytes),
    }


def _host_inputs(case: Case, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    table = rng.standard_normal(case.table_shape, dtype=np.float32).astype(case.dtype)
    ids = rng.integers(0, case.vocab, size=case.ids_shape, dtype=np.int32)
    ct = rng.standard_normal(case.out_shape, dtype=np.float32)
    return table, ids, ct


def _floor_runner(case: Case, optimizer: optax.GradientTransformation) -> Callable[[], Any]:
    """Times the optimizer update alone on the case's table layout (the shared floor)."""
    sharding = NamedSharding(make_mesh(case.layout, AxisType.Explicit), case.layout.table_spec)
    grads = jax.device_put(np.full(case.table_shape, 1e-3, np.float32), sharding)
    state = {"table": jax.device_put(np.zeros(case.table_shape, np.float32), sharding)}
    state["opt"] = optimizer.init(state["table"])
    compiled = update_floor(sharding, optimizer).lower(state["table"], state["opt"], grads)
    compiled = compiled.compile()

    def run() -> None:
        state["table"], state["opt"] = compiled(state["table"], state["opt"], grads)
        jax.block_until_ready(state["table"])

    return run


def run_case(
    case: Case,
    implementations: Sequence[str],
    *,
    execute: bool,
    timing: TimingPolicy | None,
    learning_rate: float = 0.1,
    seed: int = 0,
    on_compiled: Callable[[str], None] | None = None,
    on_phase: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Compiles, checks and times every implementation of one case.

    Args:
      case: the case.
      implementations: names from `benchmarks.layouts.impls.KNOWN`; `jaxembed` first is the
        baseline of the time ratios.
      execute: run the steps (check, and time when `timing` is given); False compiles only,
        on abstract inputs, so no table is allocated.
      timing: how to time; None: do not time.
      learning_rate: SGD's, in every implementation.
      seed: of the random table, ids and cotangent.
      on_compiled: called with each implementation's name once it is compiled.
      on_phase: called with `"checking"` and `"timing"` as those phases start.

    Returns:
      The case's record (JSON-ready).
    """
    layout = case.layout
    optimizer = optax.sgd(learning_rate)
    record: dict[str, Any] = {
        "name": case.name,
        "layout": layout.name,
        "description": layout.description,
        "tag": case.tag,
        "mesh": dict(zip(layout.mesh_axes, layout.mesh_shape, strict=True)),
        "vocab": case.vocab,
        "hidden": case.hidden,
        "ids_shape": list(case.ids_shape),
        "dtype": case.dtype,
        "table_spec": spec_text(layout.table_spec),
        "ids_spec": spec_text(layout.ids_spec),
        "out_spec": spec_text(layout.out_spec),
        "plan": (plan := _plan_record(case)),
        "minimum_wire_bytes": minimum_wire_bytes(case, plan.get("gradient_exchange")),
        "implementations": {},
    }
    host = _host_inputs(case, seed) if execute else None
    readies: dict[str, _Ready] = {}
    for name in implementations:
        result, ready = _compile(name, case, host, optimizer)
        if ready is not None:
            need = run_bytes(result, layout.num_devices)
            if need > (timing.max_run_bytes if timing else 3 * 2**30):
                result["not_run"] = (
                    f"needs {need / 2**30:.2f} GiB over {layout.num_devices} devices, "
                    "more than this run allows (max_run_bytes)"
                )
                ready = None
            else:
                readies[name] = ready
        record["implementations"][name] = result
        if on_compiled is not None:
            on_compiled(name)
    phase = on_phase or (lambda _: None)
    if host is not None and readies:
        phase("checking")
        reference = dense_reference(host[0], host[1], host[2], learning_rate)
        for name, ready in readies.items():
            record["implementations"][name].update(_check(ready, reference))
            record["implementations"][name]["status"] = "ok"
        if timing is not None:
            phase("timing")
            runners: dict[str, Callable[[], Any]] = dict(readies)
            runners["update-floor"] = _floor_runner(case, optimizer)
            samples = time_interleaved(runners, timing)
            for name in readies:
                record["implementations"][name].update(time_record(samples[name]))
            record["update_floor"] = time_record(samples["update-floor"])
    _add_ratios(record)
    return record


def _median(result: dict[str, Any] | None) -> float | None:
    if not result or result.get("status") != "ok" or "time_median_in_ms" not in result:
        return None
    if not result.get("agrees_with_reference", False):
        return None
    return result["time_median_in_ms"]


def _add_ratios(record: dict[str, Any]) -> None:
    """Time ratios to jaxembed, and jaxembed's bytes against the minimum and XLA."""
    impls = record["implementations"]
    base = impls.get("jaxembed")
    base_time = _median(base)
    for result in impls.values():
        t = _median(result)
        if t is not None and base_time:
            result["time_ratio_to_jaxembed"] = round(t / base_time, 4)
    summary: dict[str, Any] = {}
    if base and "wire_bytes" in base:
        minimum = record["minimum_wire_bytes"]["total"]
        summary["jaxembed_wire_bytes"] = base["wire_bytes"]
        summary["jaxembed_wire_ratio_to_minimum"] = (
            round(base["wire_bytes"] / minimum, 4) if minimum else
            (1.0 if base["wire_bytes"] == 0 else None)
        )  # fmt: skip
        xla = impls.get("xla", {})
        if "wire_bytes" in xla:
            summary["jaxembed_wire_ratio_to_xla"] = (
                round(base["wire_bytes"] / xla["wire_bytes"], 4) if xla["wire_bytes"] else
                (1.0 if base["wire_bytes"] == 0 else None)
            )  # fmt: skip
    alternatives = {n: _median(r) for n, r in impls.items() if not n.startswith("jaxembed")}
    alternatives = {n: t for n, t in alternatives.items() if t is not None}
    if base_time and alternatives:
        best = min(alternatives, key=alternatives.get)
        summary["best_alternative"] = best
        summary["jaxembed_time_ratio_to_best_alternative"] = round(
            base_time / alternatives[best], 4
        )
        if "xla" in alternatives:
            summary["jaxembed_time_ratio_to_xla"] = round(base_time / alternatives["xla"], 4)
    record["summary"] = summary


def slim(record: dict[str, Any]) -> dict[str, Any]:
    """A sweep point: the case's record without per-collective lists and samples."""
    drop = ("collectives", "time_samples_in_ms")
    out = {k: v for k, v in record.items() if k not in ("implementations", "plan")}
    out["plan"] = {k: v for k, v in record["plan"].items() if k != "collectives"}
    out["implementations"] = {
        name: {k: v for k, v in result.items() if k not in drop}
        for name, result in record["implementations"].items()
    }
    return out
