"""Where a compiled step's time goes: `jax.profiler` traces summed by HLO op and category.

XLA:CPU records one trace event per executed thunk, named after its HLO instruction
(`ffi_call.7`, `sort.43`, `all-to-all.1`, ...), on whichever thread ran it. `breakdown` traces
a few calls of a step, keeps the events of the step's HLO instructions (and the collectives'
`Rendezvous`; not the runtime's own events), takes each one's *self* time (its time minus the
events nested in it on the same thread: a `conditional` holds the ops of its branch), and
sums them by instruction and by category, per call. With simulated devices the sums run over
all of them: the total is the CPU time of the devices' work. A collective's own time includes
waiting for the other devices to arrive; `Rendezvous` events are waits too.

| category | what |
|---|---|
| `native:<kernel>` | a jaxembed native CPU kernel (the custom call's target, prefix cut) |
| `collectives` | all-gather, all-reduce, reduce-scatter, all-to-all, collective-permute |
| `collectives (wait)` | `Rendezvous`: a device waiting for the others in a collective |
| `sort`, `scatter`, `fusion`, ... | XLA ops by opcode (`fusion`: elementwise, reductions) |
"""

from __future__ import annotations

import collections
import glob
import re
import tempfile
from collections.abc import Callable
from typing import Any

__all__ = ["breakdown", "categories_of", "self_times"]

_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*)$", re.M)
_OPCODE = re.compile(r"(?:^|[\s)}\]])([a-z][a-z0-9\-]*)\(")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')


def categories_of(hlo_text: str) -> dict[str, str]:
    """Each HLO instruction's category (see the module's table), by instruction name.

    Examples:
      >>> categories_of('''
      ...   %ffi.7 = f32[8]{0} custom-call(f32[8]{0} %p), custom_call_target="jaxembed_pool_sum"
      ...   %all-to-all.1 = s32[8]{0} all-to-all(s32[8]{0} %x), replica_groups={{0,1}}
      ...   ROOT %sort.3 = s32[8]{0} sort(s32[8]{0} %y), dimensions={0}''')
      {'ffi.7': 'native:pool_sum', 'all-to-all.1': 'collectives', 'sort.3': 'sort'}
    """
    out = {}
    for name, rest in _OP.findall(hlo_text):
        m = _OPCODE.search(rest)
        opcode = m.group(1) if m else "other"
        if opcode == "custom-call":
            target = _TARGET.search(rest)
            t = target.group(1) if target else "custom-call"
            out[name] = "native:" + t.removeprefix("jaxembed_") if "jaxembed" in t else t
        else:
            out[name] = _category(opcode)
    return out


def _category(opcode: str) -> str:
    base = opcode.removesuffix("-start").removesuffix("-done")
    if base in _COLLECTIVES:
        return "collectives"
    if base in ("conditional", "while", "call"):
        return "control"
    return base


def _event_category(name: str, known: dict[str, str]) -> str:
    if name in known:
        return known[name]
    if name == "Rendezvous":
        return "collectives (wait)"
    base = name.split(".")[0]
    if "fusion" in base:
        return "fusion"
    return _category(base.replace("_", "-"))


def self_times(events: list[tuple[int, int, str]]) -> dict[str, int]:
    """Self time (ns) by name of one thread's `(start_ns, duration_ns, name)` events.

    Examples:
      >>> self_times([(0, 100, "conditional.1"), (10, 30, "sort.2"), (50, 20, "sort.2")])
      {'conditional.1': 50, 'sort.2': 50}
    """
    out: dict[str, int] = collections.defaultdict(int)
    stack: list[tuple[int, str]] = []  # (end, name) of the open events
    for start, duration, name in sorted(events, key=lambda e: (e[0], -e[1])):
        while stack and stack[-1][0] <= start:
            stack.pop()
        if stack:
            out[stack[-1][1]] -= duration
        out[name] += duration
        stack.append((start + duration, name))
    return dict(out)


def breakdown(run: Callable[[int], Any], calls: int, hlo_text: str, top: int = 10):
    """Traces `run(i)` for `i < calls` and sums the self time of its ops, per call.

    Args:
      run: one call of the step (blocking until its outputs are ready).
      calls: how many calls to trace.
      hlo_text: the compiled step's HLO (names the ops' categories).
      top: how many ops to list.

    Returns:
      `{"calls", "total_in_ms", "share_by_category", "by_category_in_ms", "top_ops_in_ms"}`:
      milliseconds per call, summed over the threads (devices) that ran them, and each
      category's share of that sum; or `{"error": ...}` when the trace could not be read.
      With more device threads than cores the sums hold the time the threads waited for a
      core too (an op's span, not its CPU time): read the shares, not the sums.
    """
    import jax
    from jax.profiler import ProfileData

    known = categories_of(hlo_text)
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        try:
            for i in range(calls):
                run(i)
        finally:
            jax.profiler.stop_trace()
        files = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)
        if not files:
            return {"error": "the profiler wrote no trace"}
        data = ProfileData.from_file(files[0])
    per_op: dict[str, int] = collections.defaultdict(int)
    for plane in data.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLA"):
                continue
            events = [(e.start_ns, e.duration_ns, e.name) for e in line.events
                      if e.name in known or e.name == "Rendezvous"]  # fmt: skip
            for name, ns in self_times(events).items():
                per_op[name] += ns
    by_cat: dict[str, float] = collections.defaultdict(float)
    for name, ns in per_op.items():
        by_cat[_event_category(name, known)] += ns / 1e6 / calls
    ops = sorted(per_op.items(), key=lambda kv: -kv[1])[:top]
    total = sum(by_cat.values()) or 1.0
    return {
        "calls": calls,
        "total_in_ms": round(sum(per_op.values()) / 1e6 / calls, 3),
        "share_by_category": {k: round(v / total, 4) for k, v in
                              sorted(by_cat.items(), key=lambda kv: -kv[1]) if v / total >= 1e-3},
        "by_category_in_ms": {k: round(v, 3) for k, v in
                              sorted(by_cat.items(), key=lambda kv: -kv[1]) if v >= 0.0005},
        "top_ops_in_ms": {f"{n} ({_event_category(n, known)})": round(ns / 1e6 / calls, 3)
                          for n, ns in ops},
    }  # fmt: skip
