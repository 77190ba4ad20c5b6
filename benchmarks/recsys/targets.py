"""The goals of `jaxembed bench recsys`, met or missed, from a record.

On each workload: the jaxembed step against XLA's dense-gradient step (<= 0.25x, on every
device count), against TorchRec + FBGEMM on one device (<= 1.0x, ambitious; <= 1.5x), its
forward against FBGEMM's (<= 1.5x), the step on 8 simulated devices against the 1-device step
on the same cores (`SCALE_OUT`: <= 1.3x with the planner's placements, <= 1.5x with every
table by rows; the forced exchanges for information; the 1-device step is the one timed in
the same rounds of the n-device worker, `jaxembed@1 beside @n`, where the run has it, and the
ratio to the 1-device process's step rides along); on the sweep, the step as the largest table
grows (within 1.3x; XLA's as a reference point). Ratios of wall-time medians; the ratio of
process CPU times rides along (robust to other processes on the machine).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["SCALE_OUT", "targets"]

SCALE_OUT = (
    ("jaxembed[auto]", 1.3, "the placements placements='auto' picks"),
    ("jaxembed", 1.5, "every table by rows"),
    ("jaxembed[planned]", 1.5, "every table by rows, the planner's exchanges"),
    ("jaxembed[mod]", 1.5, "every table by mod rows"),
    ("jaxembed[mod-planned]", 1.5, "every table by mod rows, the planner's exchanges"),
    (
        "jaxembed[rows-planned]",
        1.5,
        "every table by rows, the planner's row sharding (row_sharding='auto') and exchanges",
    ),
    ("jaxembed[rows]", 1.5, "every table by rows, the gather exchange"),
    ("jaxembed[routed]", 1.5, "every table by rows, the routed exchange"),
)
"""The scale-out goals: (variant, t(n devices) / t(1 device) at most, what it runs). The
forced exchanges (`[rows]`, `[routed]`) are information, the others goals."""

_INFORMATION = ("jaxembed[rows]", "jaxembed[routed]")


def _find(rows: Sequence[dict], name: str, devices: int | None, beside: int | None = None):
    for r in rows:
        if (r["implementation"], r.get("devices"), r.get("beside")) == (name, devices, beside):
            ok = r.get("status") == "ok" and r.get("agrees_with_reference")
            return r if ok and "step_time_median_in_ms" in r else None
    return None


def _target(name: str, goal: float, num: dict | None, den: dict | None, key: str = "step",
            what: str = "") -> dict[str, Any]:  # fmt: skip
    out: dict[str, Any] = {"target": name, "goal_ratio": goal, "compares": what}
    if num is None or den is None:
        out.update(status="not measured", met=None)
        return out
    a, b = num[f"{key}_time_median_in_ms"], den[f"{key}_time_median_in_ms"]
    out.update(
        numerator_in_ms=a,
        denominator_in_ms=b,
        ratio=round(a / b, 3),
        met=bool(a / b <= goal),
        status="met" if a / b <= goal else "missed",
    )
    ca, cb = num.get(f"{key}_time_cpu_median_in_ms"), den.get(f"{key}_time_cpu_median_in_ms")
    if ca and cb:
        out["cpu_time_ratio"] = round(ca / cb, 3)
    return out


def targets(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The recommender step's goals, met or missed, from one run's record.

    Wall-time medians; `cpu_time_ratio` beside them is the ratio of process CPU times (robust
    to other processes on the machine). A goal whose implementations did not run or did not
    agree with the reference is `not measured`.
    """
    out = []
    for kind, entry in record["workloads"].items():
        rows = entry["implementations"]
        tag = f"({kind})"
        multi = sorted({r["devices"] for r in rows if r.get("devices") and r["devices"] > 1})
        for n in sorted({r["devices"] for r in rows if r.get("devices")}, reverse=True):
            for v in ("jaxembed", "jaxembed[rows]"):
                if _find(rows, v, n) or v == "jaxembed":
                    out.append(_target(f"{tag} {v} step <= 0.25x XLA dense step, {n} device(s)",
                                       0.25, _find(rows, v, n), _find(rows, "xla", n),
                                       what=f"{v}@{n} / xla@{n}"))  # fmt: skip
        one = _find(rows, "jaxembed", 1)
        torchrec = _find(rows, "torchrec", None)
        fbgemm = _find(rows, "fbgemm", None)
        forward_base = "fbgemm (TBE)" if fbgemm else "torchrec (FBGEMM's kernels + TorchRec)"
        fbgemm = fbgemm or torchrec
        out.append(_target(f"{tag} jaxembed step <= 1.0x TorchRec+FBGEMM (ambitious), 1 device",
                           1.0, one, torchrec, what="jaxembed@1 / torchrec"))  # fmt: skip
        out.append(_target(f"{tag} jaxembed step <= 1.5x TorchRec+FBGEMM, 1 device", 1.5, one,
                           torchrec, what="jaxembed@1 / torchrec"))  # fmt: skip
        out.append(
            _target(
                f"{tag} jaxembed forward <= 1.5x FBGEMM forward, 1 device",
                1.5,
                one,
                fbgemm,
                key="forward",
                what=f"jaxembed@1 / {forward_base} forward",
            )
        )
        for n in multi:  # scale-out: n devices on the same cores cost about one device's step
            beside = _find(rows, "jaxembed", 1, beside=n)
            base, base_name = (beside, f"jaxembed@1 beside @{n}") if beside else (one, "jaxembed@1")
            for v, goal, what in SCALE_OUT:
                if _find(rows, v, n) or v == "jaxembed":
                    t = _target(f"{tag} {v} step on {n} devices <= {goal}x the 1-device step "
                                f"({what})", goal, _find(rows, v, n), base,
                                what=f"{v}@{n} / {base_name}")  # fmt: skip
                    if v in _INFORMATION and t["status"] != "not measured":
                        t["status"] = "info"
                    if beside and one and t["status"] != "not measured":
                        t["ratio_to_the_1_device_process"] = round(
                            t["numerator_in_ms"] / one["step_time_median_in_ms"], 3
                        )
                    out.append(t)
    sweep = record.get("sweep", [])
    for v in sorted({r["implementation"] for r in sweep}):
        pts = sorted(((r["largest_table_rows"], r) for r in sweep if r["implementation"] == v
                      and _find([r], v, r.get("devices"))), key=lambda p: p[0])  # fmt: skip
        t = _target(f"(a) {v} step within 1.3x as the largest table grows", 1.3,
                    pts[-1][1] if len(pts) > 1 else None, pts[0][1] if len(pts) > 1 else None,
                    what=(f"{v} at {pts[-1][0]} rows / at {pts[0][0]} rows" if len(pts) > 1
                          else v))  # fmt: skip
        if v != "jaxembed" and t["status"] != "not measured":
            t["note"] = "reference point: the dense path grows with the table"
            t["status"] = "info"
            t["met"] = None
        out.append(t)
    return out
