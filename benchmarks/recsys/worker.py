"""One process of `jaxembed bench recsys`: the JAX implementations on one device count.

The driver (`benchmarks.recsys.bench`) starts this as `python -m benchmarks.recsys.bench --worker
...` with `XLA_FLAGS=--xla_force_host_platform_device_count=N`, once per device count and
workload, so that each configuration gets a fresh process (its own memory, its own XLA
thread pools). `run_worker`:

1. draws the workload's tables, batches and cotangent (`jaxembed.workloads`, from the
   seed: every process and runner sees the same numbers) and the float64 reference of the
   first `check_steps` steps on the rows they touch (`recsys_check`);
2. compiles each implementation's step and forward on abstract inputs, reads its memory
   (`memory_analysis()`), collectives and wire bytes (`jaxembed.hlo`), and admits it if its
   buffers fit in the memory budget (else `not_run`, with why);
3. runs `check_steps` steps from the initial tables and compares (`recsys_check.compare`);
4. times the implementations interleaved: each round, in a rotated order, each runs one
   untimed step, then a timed forward and a timed step (wall and process CPU time);
5. traces a few steps of each with `jax.profiler` (`recsys_profile.breakdown`).

A variant named `name@k` runs on the first k of the process's devices: the driver adds
`jaxembed@1` to a worker of n > 1 devices, so that the scale-out ratio t(n)/t(1) compares two
steps timed in the same rounds of the same process (native kernels thread by the mesh's devices,
`jaxembed.kernels.native.num_threads`, so the 1-device step still gets every core), free of
the load that drifts between one process and the next.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import numpy as np

from benchmarks.common.reference import reference_pooled
from benchmarks.common.timing import TimingPolicy, summarize_times, time_interleaved
from benchmarks.recsys import check as C
from jaxembed import host as host_memory
from jaxembed import workloads as W

__all__ = ["WorkerConfig", "run_worker", "split_name"]

SCHEMA = "jaxembed.bench.recsys.worker/1"
_ERROR_CHARS = 600


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """What one worker process runs.

    Attributes:
      workload: `"a"` or `"dlrm"` (`benchmarks.recsys.bench.make_workload`).
      devices: the mesh size (the process must have that many devices).
      variants: names from `recsys_impls.VARIANTS`, each optionally `@k`: on the first k
        devices (k <= devices; the module docstring).
      batch_size, largest_rows, quick: the workload's (see `make_workload`).
      seed: of the tables, batches and cotangent.
      batches: distinct batches, cycled through by the timed steps.
      check_steps: steps from the initial tables checked against the reference.
      repeats, warmup, min_samples, max_seconds: the timing (rounds; untimed steps first;
        then at least `min_samples` samples each, and none after `max_seconds` spent in its
        rounds: the untimed step, the timed forward and the timed step).
      profile_calls: steps traced with `jax.profiler` (0: none).
      memory_budget_bytes: what the implementations' buffers may take together (None: 70% of
        the memory available at the start, less the host tables).
    """

    workload: str = "a"
    devices: int = 1
    variants: tuple[str, ...] = ("jaxembed", "xla")
    batch_size: int | None = None
    largest_rows: int | None = None
    quick: bool = False
    seed: int = 0
    batches: int = 4
    check_steps: int = 2
    repeats: int = 5
    warmup: int = 1
    min_samples: int = 3
    max_seconds: float = 3.0
    profile_calls: int = 2
    memory_budget_bytes: int | None = None


def split_name(name: str, devices: int) -> tuple[str, int]:
    """`(variant, mesh size)` of a worker's variant name: `"jaxembed@1"` runs `jaxembed` on one
    device, a plain name on all of the worker's.

    Examples:
      >>> split_name("jaxembed@1", 8), split_name("jaxembed[mod]", 8)
      (('jaxembed', 1), ('jaxembed[mod]', 8))
    """
    base, at, k = name.partition("@")
    if not at:
        return name, devices
    if not k.isdigit() or not 1 <= int(k) <= devices:
        raise ValueError(f"{name!r}: the mesh size after '@' must be an integer in [1, {devices}]")
    return base, int(k)


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def require_devices(n: int) -> None:
    """Raises RuntimeError, naming the fix, when this process has fewer than `n` devices."""
    import jax

    if jax.device_count() < n:
        raise RuntimeError(
            f"this process has {jax.device_count()} devices, the config wants {n}: "
            f"start it with XLA_FLAGS=--xla_force_host_platform_device_count={n}"
        )


def _error(stage: str, err: BaseException) -> dict[str, Any]:
    text = " ".join(f"{type(err).__name__}: {err}".split())
    return {"status": "error", "stage": stage, "error": text[:_ERROR_CHARS]}


@dataclasses.dataclass
class _Ready:
    """A compiled variant, its state and its inputs."""

    variant: Any
    step: Any
    forward: Any
    state: Any
    inputs: list[Any]
    cot: Any
    calls: int = 0

    def run_step(self, i: int | None = None) -> None:
        import jax

        i = self.calls if i is None else i
        self.state, loss = self.step(self.state, self.inputs[i % len(self.inputs)], self.cot)
        jax.block_until_ready((self.state, loss))
        self.calls += 1

    def run_forward(self, i: int | None = None) -> Any:
        import jax

        i = self.calls if i is None else i
        return jax.block_until_ready(self.forward(self.state, self.inputs[i % len(self.inputs)]))


def _compile(variant, workload: W.Workload) -> tuple[dict[str, Any], Any, Any]:
    """Compiles the step (state donated) and the forward on abstract inputs."""
    import jax

    from jaxembed import hlo

    ids, cot = variant.abstract_inputs(workload)
    start = time.perf_counter()
    with jax.set_mesh(variant.mesh):
        step = jax.jit(variant.step, donate_argnums=(0,), out_shardings=variant.out_shardings)
        step = step.lower(variant.abstract_state, ids, cot).compile()
        forward = jax.jit(variant.forward).lower(variant.abstract_state, ids).compile()
    text = step.as_text()
    m = step.memory_analysis()
    memory = {k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0)
              for k in ("argument", "output", "alias", "temp")}  # fmt: skip
    kinds: dict[str, int] = {}
    for c in hlo.collectives(text):
        kinds[c.kind] = kinds.get(c.kind, 0) + 1
    record = {
        "compile_time_in_s": round(time.perf_counter() - start, 3),
        "memory_per_device_bytes": memory,
        "wire_bytes": hlo.total_wire_bytes(text),
        "forward_wire_bytes": hlo.total_wire_bytes(forward.as_text()),
        "collectives": kinds,
        "hlo_copies": text.count(" copy("),
    }
    return record, step, forward


def _check(ready: _Ready, workload: W.Workload, expected, untouched, forward_ref, steps: int):
    pooled = np.asarray(ready.run_forward(0), np.float64)
    out = {"forward_max_abs_error": float(np.abs(pooled - forward_ref).max())}
    for s in range(steps):
        ready.run_step(s)
    v = ready.variant
    entries = sum(t.rows * t.dim for t in workload.tables)
    out.update(
        C.compare(lambda t, rows: v.read(ready.state, t, rows), expected, untouched,
                  optimizer=v.optimizer, steps=steps, num_table_entries=entries)
    )  # fmt: skip
    out["steps"] = steps
    out["agrees_with_reference"] = bool(
        out["agrees_with_reference"] and out["forward_max_abs_error"] <= C.FORWARD_ATOL
    )
    return out


def _time(readies: dict[str, _Ready], config: WorkerConfig) -> dict[str, dict[str, Any]]:
    """The forward and the step of each variant, interleaved (`benchmarks.common.timing`)."""
    policy = TimingPolicy(
        repeats=config.repeats, warmup=config.warmup, settle=1,
        min_samples=config.min_samples, max_seconds=config.max_seconds,
    )  # fmt: skip
    runners = {n: {"forward": r.run_forward, "step": r.run_step} for n, r in readies.items()}
    out = {}
    for name, samples in time_interleaved(runners, policy).items():
        rec = summarize_times(*samples["step"], "step_time")
        rec.update(summarize_times(*samples["forward"], "forward_time"))
        out[name] = rec
    return out


def run_worker(config: WorkerConfig) -> dict[str, Any]:
    """Checks, times and profiles `config.variants` on `config.devices` devices.

    Returns:
      A JSON-ready record: the workload, the machine's load, and per implementation its
      status, compile and memory facts, the check and the times.

    Raises:
      RuntimeError: the process has fewer devices than `config.devices`.
    """
    import jax

    from benchmarks.recsys import hlo_profile as recsys_profile
    from benchmarks.recsys import impls
    from benchmarks.recsys.workload import make_workload
    from jaxembed.kernels import native

    require_devices(config.devices)
    w = make_workload(config.workload, batch_size=config.batch_size,
                      largest_rows=config.largest_rows, quick=config.quick)  # fmt: skip
    host = W.make_tables(w, config.seed)
    batches = [W.make_batch(w, config.seed, s) for s in range(config.batches)]
    cot = W.make_cotangent(w, config.seed)
    checked = batches[: config.check_steps]
    expected = {opt: C.touched_reference(w, host, checked, cot, optimizer=opt)
                for opt in ("rowwise_adagrad", "adagrad")}  # fmt: skip
    untouched = C.untouched_sample(w, expected["rowwise_adagrad"], host)
    forward_ref = reference_pooled(w, host, batches[0])
    host_bytes = sum(a.nbytes for a in host.values())
    budget = config.memory_budget_bytes or int(0.7 * _available_bytes()) - host_bytes
    result: dict[str, Any] = {
        "schema": SCHEMA, "devices": config.devices, "config": dataclasses.asdict(config),
        "workload": w.name, "batch_size": w.batch_size, "num_features": len(w.features),
        "num_tables": len(w.tables), "largest_table_rows": max(t.rows for t in w.tables),
        "total_rows": w.total_rows, "ids_per_step": [sum(int(n.sum()) for _, n in b.values())
                                                     for b in batches],
        "native": {"available": native.available(), "why_unavailable": native.why_unavailable(),
                   "threads_per_kernel": native.num_threads()},
        "memory_budget_bytes": budget, "loadavg_before": list(os.getloadavg()),
        "malloc": host_memory.malloc_settings(),
        "implementations": {},
    }  # fmt: skip
    readies: dict[str, _Ready] = {}
    held = 0
    for name in config.variants:
        rec: dict[str, Any] = {"status": "compiled"}
        result["implementations"][name] = rec
        try:
            base, num = split_name(name, config.devices)
            mine = jax.devices()[:num] if base != name else None
            variant = impls.build_variant(base, w, num, devices=mine)
            facts, step, forward = _compile(variant, w)
        except Exception as err:  # a framework failing to build or compile is a result
            rec.update(_error("compile", err))
            continue
        rec.update(optimizer=variant.optimizer, info=variant.info, **facts)
        m = facts["memory_per_device_bytes"]
        state_bytes = m["argument"] * num
        need = (m["argument"] + m["output"] - m["alias"] + m["temp"]) * num
        rec["run_bytes"] = need
        if held + need > budget:
            rec.update(
                status="not_run",
                reason=f"needs {need / 2**30:.2f} GiB with "
                f"{held / 2**30:.2f} GiB held, over the budget of {budget / 2**30:.2f} GiB",
            )
            continue
        try:
            state = variant.make_state(host)
            state = jax.device_put(state, step.input_shardings[0][0])
            inputs = [variant.prepare(w, b) for b in batches]
            cot_dev = jax.device_put(cot, variant.cotangent_sharding)
        except Exception as err:
            rec.update(_error("setup", err))
            continue
        held += state_bytes
        readies[name] = _Ready(variant, step, forward, state, inputs, cot_dev)
    del host
    for name, ready in list(readies.items()):
        rec = result["implementations"][name]
        try:
            rec["check"] = _check(ready, w, expected[ready.variant.optimizer], untouched,
                                  forward_ref, config.check_steps)  # fmt: skip
            rec["agrees_with_reference"] = rec["check"]["agrees_with_reference"]
            rec["status"] = "ok"
        except Exception as err:
            rec.update(_error("check", err))
            del readies[name]
    try:
        for name, times in _time(readies, config).items():
            result["implementations"][name].update(times)
    except Exception as err:
        result["timing_error"] = _error("time", err)["error"]
    if config.profile_calls:
        for name, ready in readies.items():
            try:
                profile = recsys_profile.breakdown(ready.run_step, config.profile_calls,
                                                   ready.step.as_text())  # fmt: skip
            except Exception as err:
                profile = _error("profile", err)
            result["implementations"][name]["profile"] = profile
    result["loadavg_after"] = list(os.getloadavg())
    return result
