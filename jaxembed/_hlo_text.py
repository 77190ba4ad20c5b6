"""The instruction lines of HLO text and its call graph (for `jaxembed.hlo`).

`instructions` splits every instruction line of a module's text and says which computation
it is in; `call_graph` lists what each instruction calls (a `while`'s `body=` and
`condition=` with its `known_trip_count`, a `conditional`'s branches, `calls=`, `to_apply=`,
`called_computations=`); `runs_of` turns that into how many times one run of the module runs
each computation, and inside which branches. One parser for every reader of HLO text: the
collectives and table copies of `jaxembed.hlo`, and the benchmarks' branch split.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import NamedTuple

import numpy as np

__all__ = [
    "MESH",
    "Call",
    "Instruction",
    "Runs",
    "attribute",
    "balanced",
    "call_graph",
    "called",
    "instructions",
    "runs_of",
]

COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[^\s(]+)\s*\(.*\{\s*$")
INSTRUCTION = re.compile(r"\s*(?:ROOT\s+)?%?(?P<name>[^\s=%(]+)\s*=\s*(?P<rest>\S.*)")
OPCODE = re.compile(r"\s*(?P<opcode>[a-z][\w\-]*)\(")
TRIP_COUNT = re.compile(r'known_trip_count\\?"\s*:\s*\{\s*\\?"n\\?"\s*:\s*\\?"(?P<n>\d+)')
MESH = re.compile(
    r"mesh\[(?P<axes>[^\]]*)\]"
    r"(?:,\s*device_ids=\((?P<ids>\[[\d,]+\](?:T\([\d,]+\))?|[\d,]+)\))?"
    r"\s*\{(?P<grouped>[^}]*)\}"
)


class Instruction(NamedTuple):
    """One instruction line, split: the computation it is in (None outside any), its name,
    result shape text, opcode (None when not parsed), `(operands)` and the attributes."""

    computation: str | None
    name: str
    shape_text: str
    opcode: str | None
    operands: str
    attrs: str
    line: str


class Call(NamedTuple):
    """A computation that an instruction calls, `times` per execution of the instruction
    (None: a `while` with no known trip count, `extra` more for its condition)."""

    caller: str | None
    callee: str
    instruction: str
    key: str  # the attribute that names it: 'body', 'calls', 'branch_computations', ...
    times: int | None
    extra: int = 0
    branch: int | None = None


class Runs(NamedTuple):
    """How a computation runs in one run of the module (see `jaxembed.hlo.Collective`)."""

    trips: int | None
    branches: tuple[tuple[str, int], ...]
    unknown_loops: tuple[str, ...]  # the `while`s around it with no known trip count


def instructions(text: str) -> list[Instruction]:
    """Every instruction line of an HLO text, in order, with the computation it is in."""
    found, computation = [], None
    for line in text.splitlines():
        header = COMPUTATION.match(line)
        if header:
            computation = header.group("name")
            continue
        if line.strip() == "}":
            computation = None
            continue
        instruction = INSTRUCTION.fullmatch(line)
        if instruction is None:
            continue
        name, rest = instruction.group("name", "rest")
        shape_text = balanced(rest) if rest.startswith("(") else rest.split()[0]
        opcode = OPCODE.match(rest, len(shape_text))
        if opcode is None:
            found.append(Instruction(computation, name, shape_text, None, "", "", line))
            continue
        operands = balanced(rest[opcode.end() - 1 :])
        attrs = rest[opcode.end() - 1 + len(operands) :]
        found.append(Instruction(computation, name, shape_text, opcode.group("opcode"),
                                  operands, attrs, line))  # fmt: skip
    return found


def call_graph(lines: Iterable[Instruction]) -> list[Call]:
    """The call graph's edges: the computations each instruction calls."""
    found = []
    for i in lines:
        if i.opcode is None or i.opcode.endswith(("-done", "-update")):
            continue  # an async op's -update and -done name the computation its start runs
        at, name = i.computation, i.name
        if i.opcode == "while":
            known = TRIP_COUNT.search(i.attrs)
            n = int(known.group("n")) if known else None
            found += [Call(at, c, name, "body", n) for c in called(i.attrs, "body")]
            found += [Call(at, c, name, "condition", n, extra=1)
                      for c in called(i.attrs, "condition")]  # fmt: skip
        elif i.opcode == "conditional":  # true_computation is branch 0, as in XLA
            branches = called(i.attrs, "branch_computations") or [
                *called(i.attrs, "true_computation"), *called(i.attrs, "false_computation")
            ]  # fmt: skip
            found += [Call(at, c, name, "branch_computations", 1, branch=b)
                      for b, c in enumerate(branches)]  # fmt: skip
        else:  # a fusion, call, async wrapper, reducer or custom call: once per execution
            for key in ("calls", "to_apply", "called_computations"):
                found += [Call(at, c, name, key, 1) for c in called(i.attrs, key)]
    return found


def called(attrs: str, key: str) -> list[str]:
    """The computations an attribute names: `key=%c` or `key={%a, %b}`."""
    value = attribute(attrs, key)
    if value is None:
        return []
    return [n.strip().lstrip("%") for n in value.strip("{}").split(",") if n.strip()]


def runs_of(calls: list[Call], unknown_trips: int | None) -> Callable[[str | None], Runs]:
    """`runs(computation)`: its trips, branches and unknown loops, from the call graph.

    A computation that nothing calls runs once (the ENTRY; `None`, the lines outside any
    computation). Otherwise each call adds the caller's trips times the call's: a `while`'s
    trip count n for its body and n + 1 for its condition (`unknown_trips` where XLA did not
    print one; without it the trips are None), 1 for anything else.
    """
    if unknown_trips is not None and (
        isinstance(unknown_trips, bool) or not isinstance(unknown_trips, int | np.integer)
        or unknown_trips < 0
    ):  # fmt: skip
        raise ValueError(f"unknown_trips must be a count >= 0 or None, got {unknown_trips!r}")
    into: dict[str, list[Call]] = {}
    for call in calls:
        into.setdefault(call.callee, []).append(call)
    memo: dict[str | None, Runs] = {}

    def runs(computation: str | None, calling: frozenset[str | None] = frozenset()) -> Runs:
        if computation in memo:
            return memo[computation]
        if computation in calling:
            raise ValueError(f"computation {computation!r} calls itself: HLO has no recursion")
        trips: int | None = 0 if into.get(computation) else 1  # nothing calls it: runs once
        branches: dict[tuple[str, int], None] = {}
        loops: dict[str, None] = {}
        for call in into.get(computation, ()):
            caller = runs(call.caller, calling | {computation})
            times = unknown_trips if call.times is None else call.times
            if trips is not None and caller.trips is not None and times is not None:
                trips += caller.trips * (times + call.extra)
            else:
                trips = None
            branches.update(dict.fromkeys(caller.branches))
            if call.branch is not None:
                branches[call.instruction, call.branch] = None
            loops.update(dict.fromkeys(caller.unknown_loops))
            if call.times is None:
                loops[call.instruction] = None
        memo[computation] = Runs(trips, tuple(branches), tuple(loops))
        return memo[computation]

    return runs


def attribute(attrs: str, key: str) -> str | None:
    """The value of `key=` in an attribute list: up to its first top-level comma."""
    found = re.search(rf"(?:^|[\s,]){key}=", attrs)
    if found is None:
        return None
    if mesh := MESH.match(attrs, found.end()):  # its device_ids part has a comma
        return mesh.group()
    depth = 0
    for i in range(found.end(), len(attrs)):
        depth += (attrs[i] in "{[(") - (attrs[i] in "}])")
        if depth == 0 and attrs[i] == ",":
            return attrs[found.end() : i].strip()
    return attrs[found.end() :].strip()


def balanced(text: str) -> str:
    """The prefix of `text` up to the `)` that closes its leading `(`."""
    depth = 0
    for i, char in enumerate(text):
        depth += (char == "(") - (char == ")")
        if depth == 0:
            return text[: i + 1]
    return text
