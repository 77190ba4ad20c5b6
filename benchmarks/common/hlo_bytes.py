"""Wire bytes of a compiled step, with the routed exchange's two branches told apart.

The routed exchange compiles both of its paths into one program: a `conditional` whose
branches are the routed path (all-to-alls) and its exact fallback (the gather path). Summing
every collective of the text (`jaxembed.hlo.total_wire_bytes`) counts both; `hlo_bytes`
reports the bytes of a step that takes each branch.
"""

from __future__ import annotations

import re
from typing import Any

from benchmarks.common.compiled import collective_record as _collective_record
from jaxembed import hlo

__all__ = ["hlo_bytes"]

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[^\s(]+)\s*\(")
_BRANCHES = re.compile(
    r"(?:branch_computations=\{(?P<list>[^}]*)\}|true_computation=%?(?P<t>[^\s,]+),\s*"
    r"false_computation=%?(?P<f>[^\s,]+))"
)
_CALLS = re.compile(r"(?:calls|to_apply|body|condition)=%?(?P<name>[\w.\-]+)")


def _branch_of_each_collective(text: str) -> dict[str, str]:
    """Instruction name -> `"main"`, `"routed"` or `"fallback"` for every collective.

    A collective inside a branch of a `conditional` (or a computation such a branch calls)
    belongs to that branch; a branch holding an all-to-all is the routed exchange's, the
    other branch its exact fallback (the gather exchange).
    """
    computation_of: dict[str, str] = {}
    calls: dict[str, set[str]] = {}
    branch_sets: list[list[str]] = []
    current = ""
    for line in text.splitlines():
        if line and not line[0].isspace():
            m = _COMPUTATION.match(line)
            if m:
                current = m.group("name")
                calls.setdefault(current, set())
            continue
        name = line.split("=", 1)[0].strip().removeprefix("ROOT").strip().lstrip("%")
        if name:
            computation_of[name] = current
        for m in _BRANCHES.finditer(line):
            if m.group("list") is not None:
                names = [s.strip().lstrip("%") for s in m.group("list").split(",")]
            else:
                names = [m.group("f"), m.group("t")]
            branch_sets.append(names)
            calls[current].update(names)
        for m in _CALLS.finditer(line):
            calls[current].add(m.group("name"))
    found = hlo.collectives(text)

    def closure(root: str) -> set[str]:
        out, todo = set(), [root]
        while todo:
            c = todo.pop()
            if c not in out:
                out.add(c)
                todo.extend(calls.get(c, ()))
        return out

    branch_of: dict[str, str] = {c.name: "main" for c in found}
    for names in branch_sets:
        members = [closure(n) for n in names]
        kinds = [{c.kind for c in found if computation_of.get(c.name) in m} for m in members]
        if not any(kinds):
            continue
        for m, k in zip(members, kinds, strict=True):
            label = "routed" if "all-to-all" in k else "fallback"
            for c in found:
                if computation_of.get(c.name) in m:
                    branch_of[c.name] = label
    return branch_of


def hlo_bytes(text: str, mesh: Any) -> dict[str, Any]:
    """Collectives and wire bytes per device of a compiled program.

    Returns:
      `wire_bytes`: the bytes of a step that takes the routed branch (or of the one path
      when there is no conditional); `fallback_wire_bytes`: of a step that falls back (None
      without a routed exchange); `all_branches_wire_bytes`: every collective of the text;
      `collectives`: one record each, with its `branch`; `largest_collective`.

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
      >>> [c["branch"] for c in b["collectives"]]
      ['routed', 'fallback', 'main']
    """
    branch_of = _branch_of_each_collective(text)
    found = hlo.collectives(text)
    records = []
    for c in found:
        r = _collective_record(c, mesh)
        r["branch"] = branch_of[c.name]
        records.append(r)
    by = {b: sum(r["wire_bytes"] for r in records if r["branch"] == b)
          for b in ("main", "routed", "fallback")}  # fmt: skip
    has_branches = any(r["branch"] != "main" for r in records)
    taken = [r for r in records if r["branch"] in ("main", "routed")]
    return {
        "wire_bytes": float(by["main"] + by["routed"]),
        "fallback_wire_bytes": float(by["main"] + by["fallback"]) if has_branches else None,
        "all_branches_wire_bytes": float(sum(r["wire_bytes"] for r in records)),
        "largest_collective": max(taken, key=lambda r: r["result_bytes"], default=None),
        "collectives": records,
    }
