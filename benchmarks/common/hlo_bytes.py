"""Wire bytes of a compiled step, with the routed exchange's two branches told apart.

The routed exchange compiles both of its paths into one program: a `conditional` whose
branches are the routed path (all-to-alls) and its exact fallback (the gather path). Summing
every collective of the text (`jaxembed.hlo.total_wire_bytes`) counts both; `hlo_bytes`
reports the bytes of a step that takes each branch. Which branch holds a collective, and how
many times a step runs it (loops count their trips), is `jaxembed.hlo`'s reading of the call
graph (`Collective.branches`, `Collective.trips`).
"""

from __future__ import annotations

from typing import Any

from benchmarks.common.compiled import collective_record as _collective_record
from jaxembed import hlo

__all__ = ["hlo_bytes"]


def _branch_of_each_collective(found: list[hlo.Collective]) -> list[str]:
    """`"main"`, `"routed"` or `"fallback"` for each collective, in order.

    A collective inside a branch of a `conditional` belongs to that branch (of the outermost
    conditional, when they nest); a branch holding an all-to-all is the routed exchange's,
    the other branch its exact fallback (the gather exchange).
    """
    kinds: dict[tuple[str, int], set[str]] = {}
    for c in found:
        if c.branches:
            kinds.setdefault(c.branches[0], set()).add(c.kind)
    return [
        "main" if not c.branches else "routed" if "all-to-all" in kinds[c.branches[0]]
        else "fallback"
        for c in found
    ]  # fmt: skip


def hlo_bytes(text: str, mesh: Any, *, unknown_trips: int | None = None) -> dict[str, Any]:
    """Collectives and wire bytes per device of a compiled program.

    Bytes count each collective `trips` times (`jaxembed.hlo.total_wire_bytes`); a loop
    whose trip count XLA does not know raises unless `unknown_trips` says how many to count.

    Returns:
      `wire_bytes`: the bytes of a step that takes the routed branch (or of the one path
      when there is no conditional); `fallback_wire_bytes`: of a step that falls back (None
      without a routed exchange); `all_branches_wire_bytes`: every collective of the text;
      `collectives`: one record each (bytes of one execution), with its `branch` and
      `trips`; `largest_collective`.

    Examples:
      A conditional whose branch 0 routes ids (all-to-all) and branch 1 gathers them:

      >>> import jax
      >>> text = '''HloModule m, num_partitions=8
      ... %routed (p: s32[8]) -> s32[8] {
      ...   %p = s32[8]{0} parameter(0)
      ...   ROOT %a2a = s32[8]{0} all-to-all(s32[8]{0} %p), replica_groups={}, dimensions={0}
      ... }
      ... %fallback (q: s32[8]) -> s32[64] {
      ...   %q = s32[8]{0} parameter(0)
      ...   ROOT %ag = s32[64]{0} all-gather(s32[8]{0} %q), replica_groups={}, dimensions={0}
      ... }
      ... ENTRY %main (i: s32[], x: s32[8]) -> s32[8] {
      ...   %i = s32[] parameter(0)
      ...   %x = s32[8]{0} parameter(1)
      ...   %flag = s32[] all-reduce(s32[] %i), replica_groups={}, to_apply=%add
      ...   ROOT %c = s32[8]{0} conditional(%flag, %x, %x), branch_computations={%routed, %fallback}
      ... }'''
      >>> b = hlo_bytes(text, jax.make_mesh((8,), ("x",)))
      >>> b["wire_bytes"], b["fallback_wire_bytes"], b["all_branches_wire_bytes"]  # 7 + 28, 7 + 224
      (35.0, 231.0, 259.0)
      >>> [(c["branch"], c["trips"]) for c in b["collectives"]]
      [('routed', 1), ('fallback', 1), ('main', 1)]
    """
    total = hlo.total_wire_bytes(text, unknown_trips=unknown_trips)  # raises on unknown trips
    found = hlo.collectives(text, unknown_trips=unknown_trips)
    records = [
        {**_collective_record(c, mesh), "branch": branch}
        for c, branch in zip(found, _branch_of_each_collective(found), strict=True)
    ]
    by = {b: sum(r["wire_bytes"] * r["trips"] for r in records if r["branch"] == b)
          for b in ("main", "routed", "fallback")}  # fmt: skip
    has_branches = any(r["branch"] != "main" for r in records)
    taken = [r for r in records if r["branch"] in ("main", "routed")]
    return {
        "wire_bytes": float(by["main"] + by["routed"]),
        "fallback_wire_bytes": float(by["main"] + by["fallback"]) if has_branches else None,
        "all_branches_wire_bytes": float(total),
        "largest_collective": max(taken, key=lambda r: r["result_bytes"], default=None),
        "collectives": records,
    }
