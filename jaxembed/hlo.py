"""Collectives read out of compiled HLO text, with the bytes they move in one run.

`collectives` walks every instruction line of an HLO module (the text of
`jax.jit(f).lower(...).compile().as_text()`), in every computation, and returns one
`Collective` per all-reduce, reduce-scatter, all-gather, all-to-all or collective-permute.
An asynchronous pair (`all-gather-start` / `all-gather-done`, or an `async-start` wrapper
printed as `reduce-scatter-start`) counts once, at its start. Replica groups come back as
explicit partition ids whichever way XLA spelled them: `{{0,1},{2,3}}`, the iota form
`[4,2]<=[2,4]T(1,0)`, or the mesh form `mesh['x'=2,'y'=4] {'y'}`.

Bytes are per device. Wire bytes follow the ring model of DESIGN.md, with n the group size
and N the result bytes: all-reduce 2(n-1)/n·N, reduce-scatter (n-1)·N, all-gather and
all-to-all (n-1)/n·N, collective-permute N.

Loops count their trips. The module's call graph (a `while`'s `body=` and `condition=`, a
`conditional`'s branches, `calls=`, `to_apply=`, async wrappers) gives each collective its
`trips`: how many times one run of the module executes it. A `while` runs its body n times
and its condition n + 1 times, n being the `known_trip_count` XLA prints on it (a
`lax.scan`, a `fori_loop` with static bounds); loops nest as products, and a computation
called from several places adds them up. A `lax.while_loop` whose condition reads data has
no known count: its collectives have `trips=None`, and `total_wire_bytes` refuses to guess
(pass `unknown_trips=N`). A collective in a branch of a `conditional` counts as if its branch
ran each time (`branches` names the conditional and branch), so a total over a program with
branches is an upper bound that callers can split by branch.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxembed import _hlo_text
from jaxembed.plan.cost import ring_wire_bytes

__all__ = [
    "KINDS",
    "Collective",
    "TableCopy",
    "TableCopyWarning",
    "check_in_place",
    "collectives",
    "compiled_hlo",
    "largest_collective",
    "mesh_axes",
    "ring_wire_bytes",
    "summarize",
    "table_copies",
    "total_wire_bytes",
]

KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")

_BITS = {
    "pred": 8,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "f16": 16,
    "bf16": 16,
    "s32": 32,
    "u32": 32,
    "f32": 32,
    "s64": 64,
    "u64": 64,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "token": 0,
    "opaque": 0,
}

_ARRAY = re.compile(r"(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[^\]]*)\](?:\{[^}]*\})?")
_EXPLICIT = re.compile(r"\{(?:\{\d+(?:,\d+)*\}(?:,\{\d+(?:,\d+)*\})*)?\}")
_IOTA = re.compile(r"\[(\d+),(\d+)\]<=\[(\d+(?:,\d+)*)\](?:T\((\d+(?:,\d+)*)\))?")
_MESH_AXIS = re.compile(r"'?(?P<name>[^',=\s]+)'?=(?P<size>\d+)")
_AXIS_REF = re.compile(r"'?(?P<name>[^':,]+)'?(?::\((?P<pre>\d+)\)(?P<size>\d+))?")

Groups = tuple[tuple[int, ...], ...]


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled program, with its bytes on one device.

    `collectives` returns one per collective instruction of an HLO module; the per-device
    bytes make it comparable with a plan's `jaxembed.plan.Collective`. The bytes are those
    of one execution; `trips` says how many executions one run of the module makes.

    Attributes:
        kind: 'all-reduce', 'reduce-scatter', 'all-gather', 'all-to-all' or
            'collective-permute'; an async `-start` is reported under its plain kind.
        name: the HLO instruction name.
        dtype: element type of the result, e.g. 'f32' (the first array's, for a tuple).
        result_shape: one dims tuple per array of the result (a combined op has several).
        result_bytes: bytes of the result, summed over its arrays.
        operand_bytes: bytes of the operands, summed.
        replica_groups: the groups as explicit partition ids; for a collective-permute,
            its (source, target) pairs.
        group_size: devices per group; for a collective-permute, the distinct devices
            named by its pairs.
        wire_bytes: bytes one device sends in one execution, ring model.
        trips: executions in one run of the module: the product of the trip counts of
            the `while` loops around it (1 outside loops, and for a line outside any
            computation); None where a loop's trip count is unknown to XLA.
        branches: `(conditional, branch index)` of each `conditional` whose branch holds
            it, outermost first (empty: it runs whichever branch is taken). For
            `true_computation` / `false_computation`, the true branch is index 0.

    Examples:
        An all-gather of `f32[2, 128]` blocks over groups of 4 devices:

        >>> (c,) = collectives("%ag = f32[8,128]{1,0} all-gather(f32[2,128]{1,0} %x), "
        ...                    "replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}")
        >>> c.kind, c.dtype, c.result_shape, c.group_size, c.trips
        ('all-gather', 'f32', ((8, 128),), 4, 1)
        >>> c.operand_bytes, c.result_bytes, c.wire_bytes    # (n - 1) / n of the result
        (1024, 4096, 3072.0)
    """

    kind: str
    name: str
    dtype: str
    result_shape: tuple[tuple[int, ...], ...]
    result_bytes: int
    operand_bytes: int
    replica_groups: Groups
    group_size: int
    wire_bytes: float
    trips: int | None = 1
    branches: tuple[tuple[str, int], ...] = ()


def collectives(
    hlo_text: str, *, num_devices: int | None = None, unknown_trips: int | None = None
) -> list[Collective]:
    """Lists the collectives of an HLO module in the order they appear.

    Every computation is read (fusions, while bodies, async wrappers); only instruction
    lines are parsed. A `-done` op is skipped: its `-start` is the collective. Operand
    shapes are read inline when printed, else from the operands' own instruction lines.
    Each one's `trips` comes from the module's call graph (see the module docstring); a
    computation that nothing calls (the ENTRY, or every computation of a text without
    one) runs once.

    Args:
        hlo_text: HLO module text, e.g. `jax.jit(f).lower(x).compile().as_text()`.
        num_devices: how many devices `replica_groups={}` (or no groups) spans; by
            default the header's `num_partitions`, or its `replica_count` when that is 1.
        unknown_trips: how many times to count a `while` whose trip count XLA does not
            know (its condition then counts once more); by default such a loop's
            collectives get `trips=None`.

    Returns:
        One `Collective` per collective instruction.

    Raises:
        ValueError: a replica-group or shape spelling this parser does not know, or
            all-device groups in a text without a header; the message quotes the line.

    Examples:
        >>> (c,) = collectives("%rs = f32[2,128]{1,0} reduce-scatter(f32[8,128]{1,0} %x), "
        ...                    "replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}")
        >>> c.replica_groups, c.operand_bytes, c.result_bytes, c.wire_bytes
        (((0, 2, 4, 6), (1, 3, 5, 7)), 4096, 1024, 3072.0)
    """
    return [c for c, _ in _read(hlo_text, num_devices, unknown_trips)]


def total_wire_bytes(hlo_text: str, *, unknown_trips: int | None = None) -> float:
    """Sums `wire_bytes × trips` over the collectives of an HLO module.

    A collective in a loop counts once per trip. One in a branch of a `conditional` counts
    as if its branch ran each time: with branches, the total is an upper bound, every
    branch's bytes together; split it with `Collective.branches` (`collectives`).

    Args:
        hlo_text: HLO module text.
        unknown_trips: how many times to count a `while` whose trip count XLA does not
            know; by default such a loop holding a collective is an error.

    Returns:
        Bytes one device sends in one run of the module; 0.0 when it has no collectives.

    Raises:
        ValueError: a collective inside a `while` with no known trip count (a
            `lax.while_loop` whose condition reads data), and no `unknown_trips`.

    Examples:
        A `while` that XLA knows runs 5 times, around an all-reduce of 32 bytes over 4
        devices (2 · 3/4 · 32 = 48 bytes a trip):

        >>> body = "%ar = f32[8]{0} all-reduce(f32[8]{0} %p), replica_groups={{0,1,2,3}}"
        >>> loop = "%w = f32[8]{0} while(f32[8]{0} %x), condition=%cond, body=%body"
        >>> def module(loop):
        ...     return "\\n".join(["%body (p: f32[8]) -> f32[8] {", "  ROOT " + body, "}",
        ...                       "ENTRY %main (x: f32[8]) -> f32[8] {", "  ROOT " + loop, "}"])
        >>> text = module(loop + ', backend_config={"known_trip_count":{"n":"5"}}')
        >>> [(c.name, c.trips, c.wire_bytes) for c in collectives(text)]
        [('ar', 5, 48.0)]
        >>> total_wire_bytes(text)
        240.0
        >>> total_wire_bytes(module(loop), unknown_trips=2)   # a lax.while_loop: no known count
        96.0
        >>> total_wire_bytes("%t = f32[8]{0} add(f32[8]{0} %a, f32[8]{0} %b)")
        0.0
    """
    found = _read(hlo_text, None, unknown_trips)
    unknown = [(c, loops) for c, loops in found if c.trips is None]
    if unknown:
        loops = list(dict.fromkeys(w for _, around in unknown for w in around))
        runs = ", ".join(f"{c.kind} {c.name!r}" for c, _ in unknown[:3])
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        one = len(loops) == 1
        raise ValueError(
            f"{'while' if one else 'whiles'} {', '.join(map(repr, loops))} "
            f"{'has' if one else 'have'} no known trip count (XLA prints known_trip_count on a "
            "loop with static bounds, such as lax.scan, but not on a lax.while_loop whose "
            f"condition reads data), and {'it runs' if one else 'they run'} {runs}{more}: the "
            "bytes of one run depend on how many times it loops. Pass "
            "total_wire_bytes(hlo_text, unknown_trips=N) to count each such loop N times, or "
            "weigh the collectives of collectives(hlo_text) (trips=None there) yourself."
        )
    return float(sum(c.wire_bytes * c.trips for c, _ in found))  # type: ignore[operator]


def largest_collective(hlo_text: str) -> Collective | None:
    """Returns the collective with the most `result_bytes` (the first one on a tie).

    One execution's bytes, whatever its `trips`: the largest buffer a collective moves.

    Args:
        hlo_text: HLO module text.

    Returns:
        That `Collective`, or None when the module has none.

    Examples:
        >>> largest_collective("%t = f32[8]{0} add(f32[8]{0} %a, f32[8]{0} %b)") is None
        True
    """
    return max(collectives(hlo_text), key=lambda c: c.result_bytes, default=None)


def mesh_axes(collective: Collective, mesh: Any) -> tuple[str, ...]:
    """Names the mesh axes that a collective's replica groups span.

    Partition id p is position p of `mesh.devices.flat`, row-major over
    `mesh.axis_names`, whatever the device ids are. An axis is spanned when its
    coordinate varies inside some group (inside some pair, for a collective-permute).

    Args:
        collective: a `Collective` of a program compiled over `mesh`.
        mesh: a `jax.sharding.Mesh` or `jax.sharding.AbstractMesh`.

    Returns:
        The spanned axis names, in `mesh.axis_names` order.

    Raises:
        ValueError: a partition id outside the mesh.

    Examples:
        >>> from jax.sharding import AbstractMesh
        >>> (c,) = collectives("%a = f32[4]{0} all-reduce(f32[4]{0} %p), "
        ...                    "replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add")
        >>> mesh_axes(c, AbstractMesh((2, 4), ("data", "model")))
        ('data',)
    """
    names = tuple(mesh.axis_names)
    sizes = tuple(mesh.shape[name] for name in names)
    spanned: set[int] = set()
    for group in collective.replica_groups:
        if not all(0 <= p < math.prod(sizes) for p in group):
            raise ValueError(
                f"{collective.kind} {collective.name!r} has group {group}, outside the "
                f"{math.prod(sizes)} partitions of mesh {dict(zip(names, sizes, strict=True))}"
            )
        coords = np.unravel_index(np.asarray(group, dtype=np.int64), sizes)
        spanned.update(i for i, c in enumerate(coords) if np.unique(c).size > 1)
    return tuple(names[i] for i in sorted(spanned))


def compiled_hlo(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """Compiles `fn` for the given arguments and returns the optimized HLO text.

    Args:
        fn: a function, or one already wrapped by `jax.jit` (its jit options are kept).
        *args: arguments, or `jax.ShapeDtypeStruct`s, to lower for.
        **kwargs: keyword arguments to lower for.

    Returns:
        `jax.jit(fn).lower(*args, **kwargs).compile().as_text()`.

    Examples:
        >>> import jax.numpy as jnp
        >>> collectives(compiled_hlo(lambda x: 2 * x, jnp.ones(4)))
        []
    """
    import jax  # lazily: parsing HLO text needs no jax

    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    return jitted.lower(*args, **kwargs).compile().as_text()


def summarize(hlo_text: str, mesh: Any = None, *, unknown_trips: int | None = None) -> str:
    """Renders the collectives of an HLO module as a table, with a total row.

    Args:
        hlo_text: HLO module text.
        mesh: the mesh the module was compiled over; adds a column of spanned mesh axes.
        unknown_trips: how many times to count a `while` whose trip count XLA does not
            know; by default its collectives show trips `?`, and so do the totals.

    Returns:
        One row per collective (kind, mesh axes, dtype[shape], its branches when the module
        has a `conditional` holding collectives, trips, and the bytes of one execution:
        result and wire) and a row of totals over one run of the module: each row's bytes
        times its trips, every branch counted (`total_wire_bytes`). A tuple result shows
        each array's dims, `f32[8,128],[4]`.

    Examples:
        >>> print(summarize("%g = bf16[8,4]{1,0} all-gather(bf16[2,4]{1,0} %p), "
        ...                 "replica_groups={{0,1,2,3}}, dimensions={0}"))
        kind        shape      trips  result_bytes  wire_bytes
        all-gather  bf16[8,4]      1            64          48
        total                                   64          48
    """
    found = collectives(hlo_text, unknown_trips=unknown_trips)
    branched = any(c.branches for c in found)
    head = [
        "kind",
        *(["mesh_axes"] if mesh is not None else []),
        "shape",
        *(["branch"] if branched else []),
        "trips",
        "result_bytes",
        "wire_bytes",
    ]
    rows = [head]
    for c in found:
        axes = [",".join(mesh_axes(c, mesh)) or "-"] if mesh is not None else []
        shape = c.dtype + ",".join(f"[{','.join(map(str, dims))}]" for dims in c.result_shape)
        branch = [" ".join(f"{n}:{i}" for n, i in c.branches) or "-"] if branched else []
        trips = "?" if c.trips is None else str(c.trips)
        row = [c.kind, *axes, shape, *branch, trips]
        rows.append([*row, _number(c.result_bytes), _number(c.wire_bytes)])
    known = all(c.trips is not None for c in found)
    totals = [
        _number(sum(getattr(c, key) * c.trips for c in found)) if known else "?"
        for key in ("result_bytes", "wire_bytes")
    ]
    rows.append(["total", *[""] * (len(head) - 3), *totals])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    numeric = len(head) - 3  # trips and the byte columns align right
    return "\n".join(
        "  ".join(
            cell.rjust(w) if i >= numeric else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    )


def _read(
    hlo_text: str, num_devices: int | None, unknown_trips: int | None
) -> list[tuple[Collective, tuple[str, ...]]]:
    """The collectives of a module, each with the unknown-count loops around it."""
    header = re.search(r"^HloModule\b.*$", hlo_text, re.MULTILINE)
    if num_devices is None and header:
        partitions = re.search(r"\bnum_partitions=(\d+)", header.group())
        replicas = re.search(r"\breplica_count=(\d+)", header.group())
        num_devices = int(partitions.group(1)) if partitions else 1
        if num_devices == 1 and replicas:
            num_devices = int(replicas.group(1))
    instructions = _hlo_text.instructions(hlo_text)
    runs = _hlo_text.runs_of(_hlo_text.call_graph(instructions), unknown_trips)
    shapes: dict[str, str] = {}  # instruction name -> the text of its result shape
    found = []
    for i in instructions:
        shapes[i.name] = i.shape_text
        kind = (i.opcode or "").removesuffix("-start")
        if kind in KINDS:
            c = _collective(kind, kind != i.opcode, i, shapes, num_devices)
            run = runs(i.computation)
            found.append((dataclasses.replace(c, trips=run.trips, branches=run.branches),
                          run.unknown_loops))  # fmt: skip
    return found


# --- One collective's bytes and groups --------------------------------------------------------


def _collective(
    kind: str,
    is_start: bool,
    instruction: _hlo_text.Instruction,
    shapes: dict[str, str],
    num_devices: int | None,
) -> Collective:
    """Builds the `Collective` of one instruction line; `_read` adds its trips and branches."""
    shape_text, attrs, line = instruction.shape_text, instruction.attrs, instruction.line
    result, operand = shape_text, None
    elements = _elements(shape_text)
    if is_start and kind != "all-reduce" and len(elements) >= 2:
        # (operands, outputs[, contexts]) for all-gather-start, collective-permute-start and
        # the async wrappers reduce-scatter-start / all-to-all-start. all-reduce-start's
        # result is its output alone.
        operand, result = elements[0], elements[1]
    arrays = _arrays(result, line)
    result_bytes = _nbytes(arrays, line)
    if kind == "collective-permute":
        groups = _explicit(_hlo_text.attribute(attrs, "source_target_pairs") or "{}", line)
        group_size = len({device for pair in groups for device in pair})
        moves = any(source != target for source, target in groups)
        wire = float(result_bytes) if moves else 0.0
    else:
        groups = _replica_groups(_hlo_text.attribute(attrs, "replica_groups"), line, num_devices)
        group_size = len(groups[0])
        wire = ring_wire_bytes(kind, group_size, result_bytes)
    if operand is not None:
        operand_bytes = _nbytes(_arrays(operand, line), line)
    else:
        operand_bytes = _operand_bytes(instruction.operands[1:-1], shapes, line)
    if operand_bytes is None:  # an operand defined outside the text we were given
        scale = {"reduce-scatter": group_size, "all-gather": 1 / group_size}.get(kind, 1)
        operand_bytes = round(result_bytes * scale)
    return Collective(
        kind=kind,
        name=instruction.name,
        dtype=arrays[0][0],
        result_shape=tuple(dims for _, dims in arrays),
        result_bytes=result_bytes,
        operand_bytes=operand_bytes,
        replica_groups=groups,
        group_size=group_size,
        wire_bytes=wire,
    )


def _replica_groups(text: str | None, line: str, num_devices: int | None) -> Groups:
    """Expands a `replica_groups=` value (explicit, iota or mesh form) to explicit groups."""
    if text is None or text == "{}":
        if num_devices is None:
            raise ValueError(
                "the replica groups span all devices, but the text has no 'HloModule ... "
                "num_partitions=N' header to count them: pass collectives(hlo_text, "
                f"num_devices=N). Line: {line.strip()}"
            )
        return (tuple(range(num_devices)),)
    if text.startswith("{"):
        return _explicit(text, line)
    try:
        if iota := _IOTA.fullmatch(text):
            num_groups, group_size, dims, perm = iota.groups()
            return _rows(_iota(dims, perm).reshape(int(num_groups), int(group_size)))
        if mesh := _hlo_text.MESH.fullmatch(text):
            return _mesh_groups(mesh)
    except (KeyError, ValueError) as err:  # sizes that do not multiply up, a bad axis
        raise ValueError(
            f"cannot expand replica_groups={text}: {err}. Line: {line.strip()}"
        ) from err
    raise ValueError(
        f"cannot parse replica_groups={text}: expected explicit groups like {{{{0,1}},{{2,3}}}}, "
        f"the iota form [2,2]<=[4], or the mesh form mesh['x'=2,'y'=2] {{'y'}}. "
        f"Line: {line.strip()}"
    )


def _mesh_groups(match: re.Match[str]) -> Groups:
    """Groups of the mesh form: the devices that vary along the listed (sub-)axes.

    As in XLA's MeshAxesReplicaGroupList, a sub-axis `'x':(pre)size` cuts mesh axis x
    into [pre, size, rest] (major first); the grouped pieces move last, in the listed
    order, and each row of the reshaped device array is one group.
    """
    axes = _MESH_AXIS.findall(match.group("axes"))
    names, sizes = [name for name, _ in axes], [int(size) for _, size in axes]
    ids = match.group("ids")
    if ids is None:
        devices = np.arange(math.prod(sizes))
    elif ids.startswith("["):
        dims, _, perm = ids[1:].partition("]")
        devices = _iota(dims, perm[2:-1] or None).ravel()
    else:
        devices = np.array([int(i) for i in ids.split(",")])
    refs = []  # (mesh axis index, pre-size, size) per listed axis; pre-size 1 for a full axis
    for item in filter(None, (s.strip() for s in match.group("grouped").split(","))):
        ref = _AXIS_REF.fullmatch(item)
        if ref is None or ref.group("name") not in names:
            raise ValueError(f"axis {item} is not one of the mesh axes {names}")
        axis = names.index(ref.group("name"))
        pre, size = int(ref.group("pre") or 1), int(ref.group("size") or sizes[axis])
        refs.append((axis, pre, size))
    pieces: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (mesh axis, pre-size) -> piece
    for axis, size in enumerate(sizes):
        cuts = sorted({1, size} | {c for a, p, s in refs if a == axis for c in (p, p * s)})
        for low, high in zip(cuts, cuts[1:] or cuts, strict=False):
            index[axis, low] = len(pieces)
            pieces.append(high // low)
    grouped = [index[axis, pre] for axis, pre, _ in refs]
    order = [i for i in range(len(pieces)) if i not in grouped] + grouped
    group_size = math.prod(size for _, _, size in refs)
    return _rows(devices.reshape(pieces).transpose(order).reshape(-1, group_size))


def _iota(dims: str, perm: str | None) -> np.ndarray:
    """`iota(prod(dims))` reshaped to `dims`, then transposed by `perm` when given."""
    shape = [int(d) for d in dims.split(",")]
    array = np.arange(math.prod(shape)).reshape(shape)
    return array.transpose([int(p) for p in perm.split(",")]) if perm else array


def _rows(array: np.ndarray) -> Groups:
    return tuple(tuple(int(v) for v in row) for row in array)


def _explicit(text: str, line: str) -> Groups:
    """Parses `{{0,1},{2,3}}`: replica groups, or the pairs of `source_target_pairs`."""
    if not _EXPLICIT.fullmatch(text):
        raise ValueError(f"cannot parse device groups {text}. Line: {line.strip()}")
    return tuple(tuple(map(int, g.split(","))) for g in re.findall(r"\{([\d,]+)\}", text))


def _elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape `(a, (b, c), u32[])`; `[shape]` for an array."""
    if not shape.startswith("("):
        return [shape]
    elements, depth, start = [], 0, 1
    for i, char in enumerate(shape):
        depth += (char in "([{") - (char in ")]}")
        if depth == 0 or (depth == 1 and char == ","):
            elements.append(shape[start:i].strip())
            start = i + 1
        if depth == 0:
            break
    return [e for e in elements if e]


def _arrays(text: str, line: str) -> list[tuple[str, tuple[int, ...]]]:
    """The `(dtype, dims)` of every array spelled in `text`; a dynamic dim counts at its bound."""
    arrays = [
        (
            a["dtype"],
            tuple(int(d.strip().removeprefix("<=")) for d in a["dims"].split(",") if d.strip()),
        )
        for a in _ARRAY.finditer(text)
    ]
    if not arrays:
        raise ValueError(f"cannot parse the shape {text!r}. Line: {line.strip()}")
    return arrays


def _nbytes(arrays: list[tuple[str, tuple[int, ...]]], line: str) -> int:
    """Bytes of some arrays; sub-byte types (s4, f4e2m1fn) round up to whole bytes."""
    total = 0
    for dtype, dims in arrays:
        small_float = re.fullmatch(r"f([48])e\d+m\d+\w*", dtype)  # f8e4m3fn, f4e2m1fn
        if dtype not in _BITS and not small_float:
            raise ValueError(f"unknown element type {dtype!r}. Line: {line.strip()}")
        bits = _BITS[dtype] if dtype in _BITS else int(small_float.group(1))
        total += -(-math.prod(dims) * bits // 8)
    return total


def _operand_bytes(operands: str, shapes: dict[str, str], line: str) -> int | None:
    """Operand bytes from inline operand shapes, else from the operands' own lines."""
    if _ARRAY.search(operands):
        return _nbytes(_arrays(operands, line), line)
    names = re.findall(r"%?([\w.\-]+)", operands)
    if not all(name in shapes for name in names):
        return None
    return sum(_nbytes(_arrays(shapes[name], line), line) for name in names)


def _number(value: float) -> str:
    return f"{int(value):,}" if float(value).is_integer() else f"{value:,.2f}"


# --- Table-sized copies: a donated table that a compiled step does not update in place ------

_HLO_DTYPES = {"bool": "pred", "float16": "f16", "bfloat16": "bf16", "float32": "f32",
               "float64": "f64", "complex64": "c64", "complex128": "c128"}  # fmt: skip
_OP_NAME = re.compile(r'\bop_name="(?P<name>[^"]*)"')
_PASS_THROUGH = ("copy", "copy-start", "copy-done", "bitcast", "get-tuple-element")


class TableCopyWarning(UserWarning):
    """A compiled step copies a donated table: it is not updated in place (`check_in_place`)."""


@dataclasses.dataclass(frozen=True)
class TableCopy:
    """The copies, in one compiled program, of buffers of one donated array's size.

    Attributes:
        names: the donated arrays of that dtype and per-device shape (their keys, or paths
            in the pytree given); a copy of one cannot be told from a copy of another.
        dtype: their HLO element type, e.g. 'f32'.
        shape: their global shape (the first one's).
        shard_shape: the shape of the buffer one device holds (what the HLO copies).
        copies: the names of the copy instructions.
        sources: the step's arguments the copies start from, as the HLO names them (the
            parameter's `op_name`, e.g. 'table'), where a chain of copies leads to one.
    """

    names: tuple[str, ...]
    dtype: str
    shape: tuple[int, ...]
    shard_shape: tuple[int, ...]
    copies: tuple[str, ...]
    sources: tuple[str, ...] = ()

    def __str__(self) -> str:
        spelled = [f"{self.dtype}[{','.join(map(str, d))}]" for d in (self.shape, self.shard_shape)]
        where = "" if self.shard_shape == self.shape else f", {spelled[1]} a device"
        source = f" from argument {', '.join(map(repr, self.sources))}" if self.sources else ""
        names = " or ".join(map(repr, self.names))
        return f"{names} ({spelled[0]}{where}) copied {len(self.copies)}x{source}"


def table_copies(hlo_text: Any, tables: Any) -> list[TableCopy]:
    """The copies of a buffer of a donated table's (per-device) shape and dtype in a program.

    A donated table updated in place has no copy in its step. A copy of its shape means XLA
    could not order every read of the old table before the update's write (or kept a second
    table for another reason): the step moves the whole table, whatever the batch touched.
    Read are `copy` and `copy-start` instructions and fusions whose root is a copy, in every
    computation but the fused ones.

    Args:
        hlo_text: the compiled program (`jit(f).lower(...).compile()`) or its `as_text()`.
        tables: the donated arrays, by name: a mapping, or any pytree (an optimizer state;
            names are the leaves' paths). Arrays, or `jax.ShapeDtypeStruct`s with shardings;
            scalars are skipped.

    Returns:
        One `TableCopy` per dtype and shape of the arrays given that has a copy, in order.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> hlo = "%copy.1 = f32[64,8]{1,0} copy(f32[64,8]{1,0} %table)"
        >>> (c,) = table_copies(hlo, {"item": jax.ShapeDtypeStruct((64, 8), jnp.float32)})
        >>> c.copies, str(c)
        (('copy.1',), "'item' (f32[64,8]) copied 1x")
    """
    text = hlo_text if isinstance(hlo_text, str) else hlo_text.as_text()
    groups: dict[tuple[str, tuple[int, ...]], list[Any]] = {}
    for key, dtype, shape, shard in _donated(tables):
        groups.setdefault((dtype, shard), [[], shape])[0].append(key)
    copies = _copies(text)
    result = []
    for (dtype, shard), (names, shape) in groups.items():
        spelled = f"{dtype}[{','.join(map(str, shard))}]"
        mine = [c for c in copies if c[1] == spelled]
        if mine:
            sources = tuple(dict.fromkeys(c[2] for c in mine if c[2] is not None))
            result.append(TableCopy(tuple(names), dtype, shape, shard,
                                    tuple(c[0] for c in mine), sources))  # fmt: skip
    return result


def check_in_place(compiled: Any, tables: Any) -> list[TableCopy]:
    """Warns once, naming each table a compiled step copies, with the fix; returns them.

    Call it on a step compiled with the tables donated, e.g. on
    `jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile()`: one `TableCopyWarning`
    names every copied table (none when nothing is copied), so that a step that moves whole
    tables does not go unnoticed.

    Args:
        compiled: the compiled step, or its HLO text.
        tables: the donated arrays by name (see `table_copies`).

    Returns:
        `table_copies(compiled, tables)`.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> step = jax.jit(lambda t: t.at[0].add(1.0), donate_argnums=0)
        >>> table = jnp.zeros((64, 8))
        >>> check_in_place(step.lower(table).compile(), {"item": table})
        []
    """
    found = table_copies(compiled, tables)
    if found:
        import warnings

        warnings.warn(
            f"the compiled step copies {len(found)} kind(s) of donated table: "
            f"{'; '.join(map(str, found))}. Each step then moves the whole table, not the rows "
            "the batch touched. Usually nothing orders the step's reads of the old table (the "
            "lookup) before the row-sparse update's write, because the update's gradient does "
            "not depend on the forward (a linear loss, a fixed cotangent). Fix: pass what "
            "read the table, opt.update(table, state, ids, out_grad, after=emb), or "
            "out_grads = jaxembed.optim.sparse.after(out_grads, emb) before "
            "coll.apply_gradients; jaxembed.nnx.value_and_grad and "
            "jaxembed.flax.value_and_grad do it for you. An update inside a lax.cond (the "
            "routed exchange's exact fallback) is copied by XLA whatever the order: "
            "exchange='rows' avoids it",
            TableCopyWarning,
            stacklevel=2,
        )
    return found


def _copies(text: str) -> list[tuple[str, str, str | None]]:
    """`(name, result array, source argument)` of each copy outside fused computations."""
    instructions = _hlo_text.instructions(text)
    fused = {c.callee for c in _hlo_text.call_graph(instructions) if c.key == "calls"}
    roots = {i.computation: i.opcode for i in instructions
             if i.opcode is not None and i.line.lstrip().startswith("ROOT")}  # fmt: skip
    lines: dict[str, tuple[str, str, str | None, list[str], str]] = {}
    for i in instructions:
        if i.opcode is None or i.computation in fused:
            continue
        operands = re.findall(r"%([\w.\-]+)", i.operands)
        called = _hlo_text.called(i.attrs, "calls")
        first = (_elements(i.shape_text) or [""])[0]  # `()`: an empty tuple holds no array
        lines[i.name] = (i.opcode, first.split("{")[0], called[0] if called else None,
                         operands, i.attrs)  # fmt: skip
    found = []
    for name, (op, array, called, _, _) in lines.items():
        if op in ("copy", "copy-start") or (op == "fusion" and roots.get(called) == "copy"):
            found.append((name, array, _source(name, lines)))
    return found


def _source(name: str, lines: dict[str, Any]) -> str | None:
    """The `op_name` of the parameter a chain of copies (and bitcasts) starts from."""
    for _ in range(64):
        op, _, _, operands, rest = lines[name]
        if op == "parameter":
            found = _OP_NAME.search(rest)  # printed escaped: state[\'mu\']
            return re.sub(r"\\(.)", r"\1", found.group("name")) if found else None
        if not operands or operands[0] not in lines:
            return None
        if op not in _PASS_THROUGH:
            return None
        name = operands[0]
    return None


def _donated(tables: Any) -> list[tuple[str, str, tuple[int, ...], tuple[int, ...]]]:
    """`(name, hlo dtype, shape, per-device shape)` of each non-scalar array of `tables`."""
    from collections.abc import Mapping

    import jax  # lazily: parsing HLO text needs no jax

    named = tables.items() if isinstance(tables, Mapping) else [("", tables)]
    out = []
    for name, tree in named:
        for path, a in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if getattr(a, "shape", ()):
                out.append(_donated_array(f"{name}{jax.tree_util.keystr(path)}" or "table", a))
    return out


def _donated_array(key: str, a: Any) -> tuple[str, str, tuple[int, ...], tuple[int, ...]]:
    dtype = np.dtype(a.dtype).name
    dtype = _HLO_DTYPES.get(dtype, dtype.replace("uint", "u").replace("int", "s"))
    sharding = getattr(a, "sharding", None)
    shape = tuple(a.shape)
    shard = tuple(sharding.shard_shape(shape)) if sharding is not None else shape
    return key, dtype, shape, shard
