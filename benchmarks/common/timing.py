"""The one timing loop every benchmark uses, and what it records.

`time_interleaved` times several runners (zero-argument callables that run one step and
block until it is done) in rounds, each round in a rotated order, so that a slow period of the
machine costs every implementation alike; `time_record` turns its samples into the record's
`time_median_in_ms`, `time_p90_in_ms`, `time_min_in_ms` and `time_samples_in_ms`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "QUICK_TIMING", "TimingPolicy", "summarize_times", "time_calls", "time_interleaved",
    "time_record",
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TimingPolicy:
    """How long to time each implementation of a case.

    Attributes:
      repeats: interleaved rounds; each round runs every implementation once.
      warmup: untimed calls per implementation after the checked first call.
      settle: untimed calls of an implementation right before each timed one, so that a
        sample measures the step in a training loop (warm caches, its own buffers) and not
        the aftermath of whichever implementation ran before it.
      min_samples: every implementation gets at least this many samples...
      max_seconds: ...and then none after it has spent this long in timed calls.
      max_run_bytes: programs whose buffers over all devices exceed this are compiled and
        measured from their HLO, but not run.
    """

    repeats: int = 30
    warmup: int = 2
    settle: int = 1
    min_samples: int = 5
    max_seconds: float = 10.0
    max_run_bytes: int = 3 * 2**30


QUICK_TIMING = TimingPolicy(repeats=2, warmup=0, settle=0, min_samples=1, max_seconds=0.2)
"""`--quick`: two rounds, to exercise the code; the times mean nothing."""


def time_interleaved(
    runners: Mapping[str, Callable[[], Any] | Mapping[str, Callable[[], Any]]],
    policy: TimingPolicy,
) -> dict[str, Any]:
    """Times the runners in rounds, each round in a rotated order; seconds per call.

    A runner is one call, or several named calls (`{"forward": f, "step": s}`) timed one after
    the other in its turn. Its last call is the one repeated untimed: `warmup` times before the
    first round, and `settle` times in a round right before the timed calls.

    Args:
      runners: by name; each call runs one step and blocks until it is done.
      policy: rounds, warm-up, settling and the time budget per runner.

    Returns:
      Per runner: for one call, its wall-clock seconds per sample; for named calls, per name
      `(wall_seconds, cpu_seconds)` (process CPU time, which counts every thread).
    """
    calls = {n: dict(r) if isinstance(r, Mapping) else {"": r} for n, r in runners.items()}
    names = list(calls)
    untimed = {n: list(c.values())[-1] for n, c in calls.items()}
    for _ in range(policy.warmup):
        for name in names:
            untimed[name]()
    wall: dict[str, dict[str, list[float]]] = {n: {k: [] for k in calls[n]} for n in names}
    cpu: dict[str, dict[str, list[float]]] = {n: {k: [] for k in calls[n]} for n in names}
    spent = dict.fromkeys(names, 0.0)
    for round_ in range(policy.repeats):
        shift = round_ % max(len(names), 1)
        for name in names[shift:] + names[:shift]:
            done = len(next(iter(wall[name].values())))
            if done >= policy.min_samples and spent[name] > policy.max_seconds:
                continue
            for _ in range(policy.settle):
                untimed[name]()
            for key, call in calls[name].items():
                start, start_cpu = time.perf_counter(), time.process_time()
                call()
                wall[name][key].append(time.perf_counter() - start)
                cpu[name][key].append(time.process_time() - start_cpu)
                spent[name] += wall[name][key][-1]
    return {
        n: wall[n][""] if not isinstance(runners[n], Mapping)
        else {k: (wall[n][k], cpu[n][k]) for k in calls[n]}
        for n in names
    }  # fmt: skip


def time_record(seconds: Sequence[float]) -> dict[str, Any]:
    """`time_median_in_ms`, `time_p90_in_ms`, `time_min_in_ms`, `time_samples_in_ms`."""
    ms = np.asarray(seconds) * 1e3
    return {
        "time_median_in_ms": round(float(np.median(ms)), 4),
        "time_p90_in_ms": round(float(np.percentile(ms, 90)), 4),
        "time_min_in_ms": round(float(np.min(ms)), 4),
        "time_samples_in_ms": [round(float(t), 3) for t in ms],
    }


def time_calls(fn: Callable[[int], Any], count: int) -> tuple[list[float], list[float]]:
    """Calls `fn(i)` for i < count, one after the other: `(wall seconds, process CPU seconds)`
    of each call (`time_interleaved` with one runner, no warm-up and no settling).

    The CPU time (all threads of the process) is the load-robust figure on a shared machine:
    when other processes take the cores, wall time grows and CPU time does not (it does grow
    with threads that spin while they wait).
    """
    calls = iter(range(count))
    policy = TimingPolicy(repeats=count, warmup=0, settle=0, min_samples=count,
                          max_seconds=float("inf"))  # fmt: skip
    return time_interleaved({"": {"call": lambda: fn(next(calls))}}, policy)[""]["call"]


def summarize_times(wall_s: Sequence[float], cpu_s: Sequence[float] | None, prefix: str):
    """`{prefix}_median_in_ms`, `_p90_in_ms`, `_samples_in_ms` and `{prefix}_cpu_median_in_ms`.

    Examples:
      >>> summarize_times([0.001, 0.002, 0.003], None, "step_time")["step_time_median_in_ms"]
      2.0
    """
    ms = np.asarray(wall_s, np.float64) * 1e3
    out = {f"{prefix}_median_in_ms": round(float(np.median(ms)), 4),
           f"{prefix}_p90_in_ms": round(float(np.percentile(ms, 90)), 4),
           f"{prefix}_samples_in_ms": [round(float(x), 4) for x in ms]}  # fmt: skip
    if cpu_s is not None:
        out[f"{prefix}_cpu_median_in_ms"] = round(float(np.median(cpu_s)) * 1e3, 4)
    return out
