"""Tests for `jaxembed.hlo`: collectives and their bytes, read from HLO text.

The first half feeds hand-written HLO lines in every spelling XLA uses; the second half
compiles real `shard_map` programs on the 8 CPU devices and checks what XLA emitted.
Expected bytes are computed in each test from the shapes and the ring-model formula.
"""

import doctest
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxembed
from jaxembed import hlo

MESH_2X4 = AbstractMesh((2, 4), ("data", "model"))


def _one(line: str, **kwargs) -> hlo.Collective:
    (collective,) = hlo.collectives(line, **kwargs)
    return collective


def _all_reduce(groups: str) -> str:
    return f"%ar = f32[4]{{0}} all-reduce(f32[4]{{0}} %p), replica_groups={groups}, to_apply=%add"


# --- replica-group spellings ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("groups", "expected"),
    [
        ("{{0,1},{2,3},{4,5},{6,7}}", ((0, 1), (2, 3), (4, 5), (6, 7))),
        ("{{0,4},{1,5},{2,6},{3,7}}", ((0, 4), (1, 5), (2, 6), (3, 7))),
        ("{{3,1,2,0}}", ((3, 1, 2, 0),)),
        # iota: iota(8) reshaped to [2,4], transposed (1,0), read as 4 groups of 2
        ("[4,2]<=[2,4]T(1,0)", ((0, 4), (1, 5), (2, 6), (3, 7))),
        ("[2,4]<=[8]", ((0, 1, 2, 3), (4, 5, 6, 7))),
        ("[1,8]<=[8]", ((0, 1, 2, 3, 4, 5, 6, 7),)),
        # iota(8) as [2,2,2] transposed (2,1,0): element [a,b,c] is 4c + 2b + a
        ("[2,4]<=[2,2,2]T(2,1,0)", ((0, 4, 2, 6), (1, 5, 3, 7))),
        # mesh form, devices row-major over the named axes
        ("mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", ((0, 4), (1, 5), (2, 6), (3, 7))),
        ("mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", ((0, 1, 2, 3), (4, 5, 6, 7))),
        ("mesh['axis_0'=2,'axis_1'=4] {'axis_0','axis_1'}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
        # the listed order orders the devices inside a group, as in XLA
        ("mesh['axis_0'=2,'axis_1'=4] {'axis_1','axis_0'}", ((0, 4, 1, 5, 2, 6, 3, 7),)),
        ("mesh['axis_0'=4,'axis_1'=1] {'axis_0'}", ((0, 1, 2, 3),)),
        ("mesh[x=8] {x}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
        # a sub-axis x:(2)2 cuts x=8 into [2,2,2] and groups over the middle piece
        ("mesh['x'=8] {'x':(2)2}", ((0, 2), (1, 3), (4, 6), (5, 7))),
        # two sub-axes: pieces [a,b,c] = 4a + 2b + c, grouped over a (major) and c
        ("mesh['x'=8] {'x':(1)2,'x':(4)2}", ((0, 1, 4, 5), (2, 3, 6, 7))),
        # a non-iota device order: the mesh's device array is [[3,2],[1,0]]
        ("mesh['a'=2,'b'=2], device_ids=(3,2,1,0) {'b'}", ((3, 2), (1, 0))),
        # device_ids in iota form: iota(8) as [4,2] transposed, i.e. [0,2,4,6,1,3,5,7]
        ("mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'b'}", ((0, 2, 4, 6), (1, 3, 5, 7))),
    ],
)
def test_replica_group_spellings(groups, expected):
    collective = _one(_all_reduce(groups))
    assert collective.replica_groups == expected
    assert collective.group_size == len(expected[0])


def test_empty_replica_groups_span_all_partitions_of_the_header():
    header = "HloModule m, is_scheduled=true, num_partitions=8\n"
    assert _one(header + _all_reduce("{}")).replica_groups == (tuple(range(8)),)
    no_groups = "%ar = f32[4]{0} all-reduce(f32[4]{0} %p), to_apply=%add"
    assert _one(header + no_groups).group_size == 8
    replicas = "HloModule m, replica_count=4\n"
    assert _one(replicas + _all_reduce("{}")).replica_groups == ((0, 1, 2, 3),)
    assert _one(_all_reduce("{}"), num_devices=2).replica_groups == ((0, 1),)
    with pytest.raises(ValueError, match=r"num_devices=N\). Line: %ar = f32\[4\]"):
        hlo.collectives(_all_reduce("{}"))


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ("banana", r"cannot parse replica_groups=banana: expected"),
        ("{{0,1},{2,x}}", r"cannot parse device groups \{\{0,1\},\{2,x\}\}"),
        ("[3,2]<=[8]", r"cannot expand replica_groups=\[3,2\]<=\[8\]: .*reshape"),
        ("mesh['a'=2,'b'=4] {'c'}", r"axis 'c' is not one of the mesh axes \['a', 'b'\]"),
    ],
)
def test_unparseable_replica_groups_raise_quoting_the_line(groups, message):
    with pytest.raises(ValueError, match=message) as error:
        hlo.collectives(_all_reduce(groups))
    assert f"Line: {_all_reduce(groups)}" in str(error.value)


def test_unknown_element_type_raises():
    with pytest.raises(ValueError, match=r"unknown element type 'q7'. Line: %ar = q7\[4\]"):
        hlo.collectives("%ar = q7[4]{0} all-reduce(%p), replica_groups={{0,1}}")


# --- kinds, bytes and the ring model ---------------------------------------------------------


def test_each_kind_and_its_wire_bytes():
    n = 4
    groups = "replica_groups={{0,1,2,3},{4,5,6,7}}"
    text = "\n".join(
        [
            f"%ar = f32[16,128]{{1,0}} all-reduce(f32[16,128]{{1,0}} %a), {groups}, to_apply=%add",
            f"%rs = f32[4,128]{{1,0}} reduce-scatter(f32[16,128]{{1,0}} %a), {groups}, "
            "dimensions={0}, to_apply=%add",
            f"%ag = f32[64,128]{{1,0}} all-gather(f32[16,128]{{1,0}} %a), {groups}, dimensions={{0}}",
            f"%aa = f32[16,128]{{1,0}} all-to-all(f32[16,128]{{1,0}} %a), {groups}, dimensions={{0}}",
            "%cp = f32[16,128]{1,0} collective-permute(f32[16,128]{1,0} %a), "
            "source_target_pairs={{0,1},{1,2},{2,3},{3,0}}",
        ]
    )
    ar, rs, ag, aa, cp = hlo.collectives(text)
    full = 16 * 128 * 4
    assert [c.kind for c in (ar, rs, ag, aa, cp)] == list(hlo.KINDS)
    assert [c.name for c in (ar, rs, ag, aa, cp)] == ["ar", "rs", "ag", "aa", "cp"]
    bytes_of = lambda c: (c.result_bytes, c.operand_bytes, c.wire_bytes)
    assert bytes_of(ar) == (full, full, 2 * (n - 1) / n * full)
    assert bytes_of(rs) == (full // n, full, (n - 1) * (full // n))
    assert bytes_of(ag) == (full * n, full, (n - 1) / n * (full * n))
    assert bytes_of(aa) == (full, full, (n - 1) / n * full)
    assert bytes_of(cp) == (full, full, float(full))
    assert cp.replica_groups == ((0, 1), (1, 2), (2, 3), (3, 0))
    assert cp.group_size == 4
    assert hlo.total_wire_bytes(text) == sum(c.wire_bytes for c in (ar, rs, ag, aa, cp))
    assert hlo.largest_collective(text) == ag


def test_groups_of_one_and_self_pairs_move_nothing():
    assert _one(_all_reduce("{{0},{1}}")).wire_bytes == 0.0
    assert _one(_all_reduce("[8,1]<=[8]")).wire_bytes == 0.0
    permute = "%cp = f32[4]{0} collective-permute(f32[4]{0} %p), source_target_pairs={{0,0},{1,1}}"
    assert _one(permute).wire_bytes == 0.0
    assert _one(permute.replace("{{0,0},{1,1}}", "{}")).replica_groups == ()


@pytest.mark.parametrize(
    ("shape", "dtype", "dims", "nbytes"),
    [
        ("bf16[8,4]{1,0}", "bf16", (8, 4), 8 * 4 * 2),
        ("f16[8]{0}", "f16", (8,), 16),
        ("f64[3,5]{0,1}", "f64", (3, 5), 3 * 5 * 8),
        ("s8[7]{0}", "s8", (7,), 7),
        ("u8[7]{0}", "u8", (7,), 7),
        ("s32[2,3]{1,0}", "s32", (2, 3), 24),
        ("u32[5]{0}", "u32", (5,), 20),
        ("s64[5]{0}", "s64", (5,), 40),
        ("pred[10]{0}", "pred", (10,), 10),
        ("c64[4]{0}", "c64", (4,), 32),
        ("f8e4m3fn[16]{0}", "f8e4m3fn", (16,), 16),
        ("s4[5]{0}", "s4", (5,), 3),
        ("f32[]", "f32", (), 4),
        ("f32[16,128]{1,0:T(8,128)}", "f32", (16, 128), 16 * 128 * 4),
        ("f32[<=8,4]{1,0}", "f32", (8, 4), 128),
    ],
)
def test_element_types_scalars_and_layouts(shape, dtype, dims, nbytes):
    c = _one(f"%ar = {shape} all-reduce({shape} %p), replica_groups={{{{0,1}}}}, to_apply=%add")
    assert (c.dtype, c.result_shape, c.result_bytes, c.operand_bytes) == (
        dtype,
        (dims,),
        nbytes,
        nbytes,
    )
    assert c.wire_bytes == 2 * (2 - 1) / 2 * nbytes


def test_tuple_result_sums_its_arrays():
    c = _one(
        "%ar = (f32[8,128]{1,0}, f32[4]{0}, bf16[2]{0}) all-reduce(%a, %b, %c), "
        "replica_groups={{0,1,2,3}}, to_apply=%add"
    )
    assert c.dtype == "f32"
    assert c.result_shape == ((8, 128), (4,), (2,))
    assert c.result_bytes == 8 * 128 * 4 + 4 * 4 + 2 * 2
    # %a, %b and %c are not defined in this text: an all-reduce's operands equal its result
    assert c.operand_bytes == c.result_bytes
    assert c.wire_bytes == 2 * 3 / 4 * c.result_bytes


def test_operand_bytes_come_from_the_operands_own_lines():
    text = """HloModule m, num_partitions=4
ENTRY %main (p: bf16[2,8]) -> bf16[8,8] {
  %p = bf16[2,8]{1,0} parameter(0)
  %q = (bf16[2,8]{1,0}, s32[3]{0}) tuple(%p, %p)
  ROOT %ag = bf16[8,8]{1,0} all-gather(%p), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}
  %rs = s32[1]{0} reduce-scatter(%s), replica_groups=[1,4]<=[4], dimensions={0}, to_apply=%add
}"""
    ag, rs = hlo.collectives(text)
    assert (ag.operand_bytes, ag.result_bytes) == (2 * 8 * 2, 8 * 8 * 2)
    # %s is undefined: a reduce-scatter's operand is n times its result
    assert (rs.operand_bytes, rs.result_bytes) == (4 * 4, 4)


# --- async forms -------------------------------------------------------------------------------


# A backslash at a line end continues the string: each instruction is one line of HLO.
ASYNC_MODULE = """HloModule async, is_scheduled=true, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%wrapped_reduce_scatter (param: f32[8,4]) -> f32[4,4] {
  %param = f32[8,4]{1,0} parameter(0)
  ROOT %reduce-scatter.1 = f32[4,4]{1,0} reduce-scatter(%param), channel_id=5, \
replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}, to_apply=%add
}

ENTRY %main (p: f32[8,4]) -> f32[4,4] {
  %p = f32[8,4]{1,0} parameter(0)
  %ars = f32[8,4]{1,0} all-reduce-start(%p), channel_id=1, replica_groups=[2,4]<=[8], \
to_apply=%add
  %ard = f32[8,4]{1,0} all-reduce-done(%ars)
  %ags = (f32[8,4]{1,0}, f32[32,4]{1,0}) all-gather-start(%ard), channel_id=2, \
replica_groups=[2,4]<=[8], dimensions={0}
  %agd = f32[32,4]{1,0} all-gather-done(%ags)
  %cps = (f32[8,4]{1,0}, f32[8,4]{1,0}, u32[], u32[]) collective-permute-start(%p), \
channel_id=3, source_target_pairs={{0,1},{1,0}}
  %cpd = f32[8,4]{1,0} collective-permute-done(%cps)
  %rss = ((f32[8,4]{1,0}), f32[2,4]{1,0}) reduce-scatter-start(%p), channel_id=4, \
replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
  %rsu = ((f32[8,4]{1,0}), f32[2,4]{1,0}) reduce-scatter-update(%rss)
  %rsd = f32[2,4]{1,0} reduce-scatter-done(%rsu)
  %aas = ((f32[8,4]{1,0}), f32[8,4]{1,0}, u32[], u32[]) all-to-all-start(f32[8,4]{1,0} %p), \
channel_id=6, replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}
  %aad = f32[8,4]{1,0} all-to-all-done(%aas)
  %as = ((f32[8,4]{1,0}), f32[4,4]{1,0}, s32[]) async-start(%p), calls=%wrapped_reduce_scatter
  ROOT %ad = f32[4,4]{1,0} async-done(%as), calls=%wrapped_reduce_scatter
}
"""


def test_async_pairs_count_once_with_the_output_part_of_the_start():
    found = hlo.collectives(ASYNC_MODULE)
    assert [(c.kind, c.name) for c in found] == [
        ("reduce-scatter", "reduce-scatter.1"),  # inside the async-start's computation
        ("all-reduce", "ars"),
        ("all-gather", "ags"),
        ("collective-permute", "cps"),
        ("reduce-scatter", "rss"),
        ("all-to-all", "aas"),
    ]
    wrapped, ars, ags, cps, rss, aas = found
    full = 8 * 4 * 4
    assert (wrapped.result_bytes, wrapped.operand_bytes) == (full // 2, full)
    assert wrapped.wire_bytes == (2 - 1) * full // 2
    assert (ars.result_shape, ars.result_bytes, ars.operand_bytes) == (((8, 4),), full, full)
    assert ars.wire_bytes == 2 * 3 / 4 * full
    assert (ags.result_shape, ags.result_bytes, ags.operand_bytes) == (((32, 4),), 4 * full, full)
    assert ags.wire_bytes == 3 / 4 * 4 * full
    assert (cps.result_shape, cps.result_bytes, cps.operand_bytes) == (((8, 4),), full, full)
    assert (cps.group_size, cps.wire_bytes) == (2, float(full))
    assert (rss.result_shape, rss.result_bytes, rss.operand_bytes) == (((2, 4),), full // 4, full)
    assert rss.wire_bytes == 3 * full / 4
    assert (aas.result_shape, aas.result_bytes, aas.operand_bytes) == (((8, 4),), full, full)
    assert aas.wire_bytes == 1 / 2 * full


def test_combined_async_all_gather_takes_every_output():
    c = _one(
        "%ags = ((f32[2]{0}, bf16[3]{0}), (f32[8]{0}, bf16[12]{0})) all-gather-start(%a, %b),"
        " replica_groups={{0,1,2,3}}, dimensions={0}"
    )
    assert (c.dtype, c.result_shape) == ("f32", ((8,), (12,)))
    assert (c.result_bytes, c.operand_bytes) == (8 * 4 + 12 * 2, 2 * 4 + 3 * 2)


def test_collectives_in_nested_computations_and_not_the_header():
    text = """HloModule m, entry_computation_layout={(f32[8]{0})->f32[8]{0}}, num_partitions=2

%body (state: (s32[], f32[8])) -> (s32[], f32[8]) {
  %state = (s32[], f32[8]{0}) parameter(0)
  %v = f32[8]{0} get-tuple-element(%state), index=1
  %ar.1 = f32[8]{0} all-reduce(%v), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  %i = s32[] get-tuple-element(%state), index=0
  ROOT %next = (s32[], f32[8]{0}) tuple(%i, %ar.1)
}

%fused (p: f32[8]) -> f32[16] {
  %p.1 = f32[8]{0} parameter(0)
  ROOT %ag.1 = f32[16]{0} all-gather(%p.1), channel_id=2, replica_groups={}, dimensions={0}
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %loop = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
  ROOT %f = f32[16]{0} fusion(%x), kind=kLoop, calls=%fused
}
"""
    ar, ag = hlo.collectives(text)
    assert (ar.name, ar.operand_bytes, ar.wire_bytes) == ("ar.1", 32, 2 * 1 / 2 * 32)
    assert (ag.name, ag.replica_groups, ag.operand_bytes) == ("ag.1", ((0, 1),), 32)
    assert (ar.trips, ag.trips) == (None, 1)  # %loop prints no known_trip_count
    assert hlo.collectives(text.split("\n\n")[0]) == []


# --- loops and branches: the call graph -------------------------------------------------------


# Group size 4 everywhere. The outer loop runs 4 times; inside it an inner loop of 3 trips
# (whose condition runs 3 + 1 times), a conditional, and an async reduce-scatter whose -done
# names the same wrapped computation. %shared is called twice from the ENTRY.
LOOPS_MODULE = """HloModule loops, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%inner_body (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %ar.inner = f32[8]{0} all-reduce(%p), replica_groups={{0,1,2,3}}, to_apply=%add
}

%inner_cond (q: f32[8]) -> pred[] {
  %q = f32[8]{0} parameter(0)
  %s = f32[] reduce(%q, %zero), dimensions={0}, to_apply=%add
  %ar.cond = f32[] all-reduce(%s), replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %lt = pred[] compare(%ar.cond, %zero), direction=LT
}

%yes (t: f32[8]) -> f32[8] {
  %t = f32[8]{0} parameter(0)
  ROOT %a2a = f32[8]{0} all-to-all(%t), replica_groups={{0,1,2,3}}, dimensions={0}
}

%no (u: f32[8]) -> f32[8] {
  %u = f32[8]{0} parameter(0)
  ROOT %cp = f32[8]{0} collective-permute(%u), source_target_pairs={{0,1},{1,0}}
}

%wrapped (v: f32[8]) -> f32[2] {
  %v = f32[8]{0} parameter(0)
  ROOT %rs = f32[2]{0} reduce-scatter(%v), replica_groups={{0,1,2,3}}, dimensions={0}, \
to_apply=%add
}

%outer_body (r: f32[8]) -> f32[8] {
  %r = f32[8]{0} parameter(0)
  %w.inner = f32[8]{0} while(%r), condition=%inner_cond, body=%inner_body, \
backend_config={"known_trip_count":{"n":"3"}}
  %pred = pred[] constant(true)
  %cond.1 = f32[8]{0} conditional(%pred, %w.inner, %w.inner), true_computation=%yes, \
false_computation=%no
  %as = ((f32[8]{0}), f32[2]{0}) async-start(%cond.1), calls=%wrapped
  %ad = f32[2]{0} async-done(%as), calls=%wrapped
  ROOT %out = f32[8]{0} copy(%cond.1)
}

%shared (w: f32[8]) -> f32[32] {
  %w = f32[8]{0} parameter(0)
  ROOT %ag.shared = f32[32]{0} all-gather(%w), replica_groups={{0,1,2,3}}, dimensions={0}
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %w.outer = f32[8]{0} while(%x), condition=%outer_cond, body=%outer_body, \
backend_config={"dynamic_variables":[],"known_trip_count":{"n":"4"}}
  %c1 = f32[32]{0} call(%x), to_apply=%shared
  %c2 = f32[32]{0} call(%w.outer), to_apply=%shared
  ROOT %y = f32[8]{0} copy(%w.outer)
}
"""


def test_trips_multiply_through_loops_and_add_over_callers():
    found = {c.name: c for c in hlo.collectives(LOOPS_MODULE)}
    trips = {name: (c.trips, c.branches) for name, c in found.items()}
    assert trips == {
        "ar.inner": (4 * 3, ()),  # inner body, in the outer body
        "ar.cond": (4 * (3 + 1), ()),  # a condition runs once more than its body
        "a2a": (4, (("cond.1", 0),)),  # true_computation: branch 0
        "cp": (4, (("cond.1", 1),)),
        "rs": (4, ()),  # the async-done's calls= is not a second run
        "ag.shared": (2, ()),  # called from two places
    }
    n, f32 = 4, 4
    per_trip = {  # ring model: 2(n-1)/n·N, (n-1)/n·N, N, (n-1)·N
        "ar.inner": 2 * (n - 1) / n * 8 * f32,
        "ar.cond": 2 * (n - 1) / n * f32,
        "a2a": (n - 1) / n * 8 * f32,
        "cp": 8 * f32,
        "rs": (n - 1) * 2 * f32,
        "ag.shared": (n - 1) / n * 32 * f32,
    }
    assert {name: c.wire_bytes for name, c in found.items()} == per_trip
    want = sum(per_trip[name] * t for name, (t, _) in trips.items())
    assert want == 12 * 48 + 16 * 6 + 4 * 24 + 4 * 32 + 4 * 24 + 2 * 96
    assert hlo.total_wire_bytes(LOOPS_MODULE) == want  # every branch: an upper bound
    rows = hlo.summarize(LOOPS_MODULE).splitlines()
    assert rows[0].split() == ["kind", "shape", "branch", "trips", "result_bytes", "wire_bytes"]
    assert rows[1].split() == ["all-reduce", "f32[8]", "-", "12", "32", "48"]
    assert rows[3].split() == ["all-to-all", "f32[8]", "cond.1:0", "4", "32", "24"]
    assert rows[-1].split()[-1] == f"{want:,.0f}"


def test_unknown_trips_must_be_a_count():
    with pytest.raises(ValueError, match=r"unknown_trips must be a count >= 0 or None, got -1"):
        hlo.total_wire_bytes(LOOPS_MODULE, unknown_trips=-1)


def _while_names(text: str) -> list[str]:
    """The names of the `while` instructions of an HLO text."""
    return re.findall(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?\swhile\(", text, re.MULTILINE)


def test_fori_loop_psum_counts_every_trip(mesh_8):
    trips = 5
    x = jnp.ones((16, 16), jnp.float32)  # f32[2, 16] per device

    def body(a):
        return jax.lax.fori_loop(0, trips, lambda i, c: jax.lax.psum(c, "model") / 8 + c, a)

    text = _shard_map_hlo(mesh_8, body, x, P("model"), P("model"))
    assert len(_while_names(text)) == 1  # XLA keeps the loop
    (c,) = hlo.collectives(text)
    n, nbytes = 8, _local_bytes(2, 16)
    assert (c.kind, c.result_bytes, c.trips) == ("all-reduce", nbytes, trips)
    assert hlo.total_wire_bytes(text) == trips * 2 * (n - 1) / n * nbytes
    assert hlo.summarize(text).splitlines()[-1].split() == [
        "total",
        f"{trips * nbytes:,}",
        f"{trips * 2 * (n - 1) * nbytes // n:,}",
    ]


def test_scan_all_gather_counts_every_step(mesh_8):
    steps = 6
    x = jnp.ones((steps, 8, 4), jnp.float32)  # the scanned f32[steps, 1, 4] per device

    def body(xs):
        def step(total, x):  # x: f32[1, 4]
            gathered = jax.lax.all_gather(x, "model", axis=0, tiled=True)  # f32[8, 4]
            return total + gathered.sum(), None

        return jax.lax.scan(step, jnp.zeros((), xs.dtype), xs)[0]

    text = _shard_map_hlo(mesh_8, body, x, P(None, "model"), P(), check_vma=False)
    assert len(_while_names(text)) == 1
    (c,) = hlo.collectives(text)
    n, gathered = 8, _local_bytes(8, 4)
    assert (c.kind, c.result_bytes, c.trips) == ("all-gather", gathered, steps)
    assert hlo.total_wire_bytes(text) == steps * (n - 1) / n * gathered


def test_nested_loops_multiply(mesh_8):
    outer, inner = 3, 4
    x = jnp.ones((8, 16), jnp.float32)  # f32[1, 16] per device

    def body(a):
        step = lambda i, c: jax.lax.psum(c, "model") / 8 + c
        return jax.lax.fori_loop(
            0, outer, lambda i, c: jax.lax.fori_loop(0, inner, step, c) * 0.5, a
        )

    text = _shard_map_hlo(mesh_8, body, x, P("model"), P("model"))
    assert len(_while_names(text)) == 2
    (c,) = hlo.collectives(text)
    n, nbytes = 8, _local_bytes(1, 16)
    assert c.trips == outer * inner
    assert hlo.total_wire_bytes(text) == outer * inner * 2 * (n - 1) / n * nbytes


def test_data_dependent_while_loop_is_named_not_guessed(mesh_8):
    x = jnp.ones((8, 16), jnp.float32)  # f32[1, 16] per device

    def body(a):  # as many trips as the data asks for
        return jax.lax.while_loop(
            lambda c: c.sum() < 1000.0, lambda c: jax.lax.psum(c, "model") + c, a
        )

    text = _shard_map_hlo(mesh_8, body, x, P("model"), P("model"))
    (loop,) = _while_names(text)
    assert "known_trip_count" not in text
    (c,) = hlo.collectives(text)
    assert c.trips is None
    with pytest.raises(ValueError, match=rf"while '{re.escape(loop)}' has no known trip count"
                       rf".* runs all-reduce '{re.escape(c.name)}'.*unknown_trips=N"):  # fmt: skip
        hlo.total_wire_bytes(text)
    n, nbytes = 8, _local_bytes(1, 16)
    assert hlo.total_wire_bytes(text, unknown_trips=3) == 3 * 2 * (n - 1) / n * nbytes
    assert hlo.collectives(text, unknown_trips=3)[0].trips == 3
    assert [row.split() for row in hlo.summarize(text).splitlines()[1:]] == [
        ["all-reduce", "f32[1,16]", "?", f"{nbytes}", f"{2 * 7 * nbytes // 8}"],
        ["total", "?", "?"],
    ]


def test_conditional_branches_are_flagged(mesh_8):
    x = jnp.ones((8, 16), jnp.float32)  # f32[1, 16] per device

    def body(a):
        gather = lambda v: jax.lax.all_gather(v, "model", axis=0, tiled=True)[:1]  # f32[8, 16]
        return jax.lax.cond(a[0, 0] > 0, lambda v: jax.lax.psum(v, "model"), gather, a)

    text = _shard_map_hlo(mesh_8, body, x, P("model"), P("model"), check_vma=False)
    (conditional,) = re.findall(r"%([\w.\-]+) = .*?\sconditional\(", text)
    found = {c.kind: c for c in hlo.collectives(text)}
    assert set(found) == {"all-reduce", "all-gather"}
    # lax.cond's branch 0 is its false branch: the gather
    assert found["all-gather"].branches == ((conditional, 0),)
    assert found["all-reduce"].branches == ((conditional, 1),)
    assert {c.trips for c in found.values()} == {1}
    n, row = 8, _local_bytes(1, 16)
    psum, gather = 2 * (n - 1) / n * row, (n - 1) / n * 8 * row
    assert hlo.total_wire_bytes(text) == psum + gather  # both branches: an upper bound


# --- mesh_axes and summarize -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("groups", "axes"),
    [
        ("{{0,1,2,3},{4,5,6,7}}", ("model",)),
        ("{{0,4},{1,5},{2,6},{3,7}}", ("data",)),
        ("{{0,1,2,3,4,5,6,7}}", ("data", "model")),
        ("{{0,1},{2,3},{4,5},{6,7}}", ("model",)),
        ("{{0},{1},{2},{3},{4},{5},{6},{7}}", ()),
        ("mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", ("data",)),
    ],
)
def test_mesh_axes_on_an_abstract_mesh(groups, axes):
    assert hlo.mesh_axes(_one(_all_reduce(groups)), MESH_2X4) == axes


def test_mesh_axes_of_permute_pairs_and_out_of_range_ids():
    ring = "source_target_pairs={{0,4},{4,0},{1,5},{5,1}}"
    permute = _one(f"%cp = f32[4]{{0}} collective-permute(f32[4]{{0}} %p), {ring}")
    assert hlo.mesh_axes(permute, MESH_2X4) == ("data",)
    with pytest.raises(ValueError, match=r"all-reduce 'ar' has group \(8, 9\), outside the 8"):
        hlo.mesh_axes(_one(_all_reduce("{{8,9}}")), MESH_2X4)


def test_summarize_lists_each_collective_and_the_total():
    text = "\n".join(
        [
            _all_reduce("{{0,1,2,3},{4,5,6,7}}"),
            "%ag = bf16[8,4]{1,0} all-gather(bf16[2,4]{1,0} %p), replica_groups={{0,4},{1,5},{2,6},"
            "{3,7}}, dimensions={0}",
        ]
    )
    assert hlo.summarize(text, MESH_2X4).splitlines() == [
        "kind        mesh_axes  shape      trips  result_bytes  wire_bytes",
        "all-reduce  model      f32[4]         1            16          24",
        "all-gather  data       bf16[8,4]      1            64          32",
        "total                                              80          56",
    ]
    combined = "%ar = (f32[8]{0}, f32[]) all-reduce(%a, %b), replica_groups={{0,1}}"
    assert hlo.summarize(combined).splitlines()[1].split() == [
        "all-reduce",
        "f32[8],[]",
        "1",
        "36",
        "36",
    ]
    assert hlo.summarize(_all_reduce("{{0,1,2}}")).splitlines() == [
        "kind        shape   trips  result_bytes  wire_bytes",
        "all-reduce  f32[4]      1            16       21.33",
        "total                                16       21.33",
    ]


def test_docstring_examples():
    results = doctest.testmod(hlo, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert results.attempted > 0
    assert results.failed == 0


# --- real programs compiled on 8 CPU devices ---------------------------------------------------


def _shard_map_hlo(mesh, body, x, in_spec, out_spec, **kwargs) -> str:
    x = jax.device_put(x, NamedSharding(mesh, in_spec))
    fn = jax.shard_map(body, mesh=mesh, in_specs=in_spec, out_specs=out_spec, **kwargs)
    return hlo.compiled_hlo(fn, x)


def _local_bytes(*shape: int, dtype=jnp.float32) -> int:
    return math.prod(shape) * jnp.dtype(dtype).itemsize


def test_psum_over_model(mesh_2x4):
    x = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16)
    text = _shard_map_hlo(
        mesh_2x4, lambda a: jax.lax.psum(a, "model"), x, P("data", "model"), P("data", None)
    )
    c = _one(text)  # x: f32[8/2, 16/4] per device
    n, nbytes = 4, _local_bytes(4, 4)
    assert (c.kind, c.dtype, c.result_shape, c.group_size) == ("all-reduce", "f32", ((4, 4),), n)
    assert (c.result_bytes, c.operand_bytes) == (nbytes, nbytes)
    assert c.wire_bytes == 2 * (n - 1) / n * nbytes
    assert hlo.mesh_axes(c, mesh_2x4) == ("model",)
    assert hlo.total_wire_bytes(text) == c.wire_bytes


def test_psum_scatter_over_data(mesh_2x4):
    # XLA CPU keeps this a reduce-scatter (it is not rewritten to all-reduce + dynamic-slice):
    #   reduce-scatter(%param.1), replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}
    x = jnp.ones((8, 16), jnp.float32)
    body = lambda a: jax.lax.psum_scatter(a, "data", scatter_dimension=0, tiled=True)
    c = _one(_shard_map_hlo(mesh_2x4, body, x, P(None, "model"), P("data", "model")))
    n = 2  # a: f32[8, 16/4] per device, scattered to f32[8/2, 4]
    assert (c.kind, c.result_shape, c.group_size) == ("reduce-scatter", ((4, 4),), n)
    assert (c.result_bytes, c.operand_bytes) == (_local_bytes(4, 4), _local_bytes(8, 4))
    assert c.wire_bytes == (n - 1) * _local_bytes(4, 4)
    assert hlo.mesh_axes(c, mesh_2x4) == ("data",)


def test_all_gather_over_model(mesh_2x4):
    x = jnp.ones((8, 16), jnp.float32)
    body = lambda a: jax.lax.all_gather(a, "model", axis=1, tiled=True)
    # check_vma=False: jax does not infer that a tiled all_gather is invariant over 'model'
    text = _shard_map_hlo(mesh_2x4, body, x, P("data", "model"), P("data", None), check_vma=False)
    c = _one(text)  # a: f32[4, 4] per device, gathered to f32[4, 16]
    n = 4
    assert (c.kind, c.result_shape, c.group_size) == ("all-gather", ((4, 16),), n)
    assert (c.result_bytes, c.operand_bytes) == (_local_bytes(4, 16), _local_bytes(4, 4))
    assert c.wire_bytes == (n - 1) / n * _local_bytes(4, 16)
    assert hlo.mesh_axes(c, mesh_2x4) == ("model",)


def test_all_to_all_over_model(mesh_2x4):
    x = jnp.ones((8, 16), jnp.float32)
    body = lambda a: jax.lax.all_to_all(a, "model", 0, 1, tiled=True)
    c = _one(_shard_map_hlo(mesh_2x4, body, x, P("data", "model"), P("data", "model")))
    n = 4  # a: f32[4, 4] per device, split on dim 0 into 4 pieces and concatenated on dim 1
    # XLA CPU emits the tuple form: one f32[1,4] operand and result per peer,
    #   (f32[1,4]{1,0}, f32[1,4]{1,0}, f32[1,4]{1,0}, f32[1,4]{1,0}) all-to-all(%s, %s.1, ...)
    assert (c.kind, c.result_shape, c.group_size) == ("all-to-all", ((1, 4),) * n, n)
    assert (c.result_bytes, c.operand_bytes) == (_local_bytes(4, 4), _local_bytes(4, 4))
    assert c.wire_bytes == (n - 1) / n * _local_bytes(4, 4)
    assert hlo.mesh_axes(c, mesh_2x4) == ("model",)


def test_ppermute_ring_over_model(mesh_2x4):
    x = jnp.ones((8, 16), jnp.float32)
    body = lambda a: jax.lax.ppermute(a, "model", [(i, (i + 1) % 4) for i in range(4)])
    c = _one(_shard_map_hlo(mesh_2x4, body, x, P("data", "model"), P("data", "model")))
    assert c.kind == "collective-permute"
    assert sorted(c.replica_groups) == sorted(
        (r * 4 + i, r * 4 + (i + 1) % 4) for r in range(2) for i in range(4)
    )
    assert (c.result_bytes, c.wire_bytes) == (_local_bytes(4, 4), float(_local_bytes(4, 4)))
    assert hlo.mesh_axes(c, mesh_2x4) == ("model",)


def test_psum_over_every_device(mesh_8):
    x = jnp.ones((8, 16), jnp.float32)
    c = _one(_shard_map_hlo(mesh_8, lambda a: jax.lax.psum(a, "model"), x, P("model"), P()))
    n, nbytes = 8, _local_bytes(1, 16)
    assert (c.kind, c.group_size, c.replica_groups) == ("all-reduce", n, (tuple(range(8)),))
    assert (c.result_bytes, c.wire_bytes) == (nbytes, 2 * (n - 1) / n * nbytes)
    assert hlo.mesh_axes(c, mesh_8) == ("model",)


def test_scalar_psum_over_both_axes(mesh_2x4):
    x = jnp.ones((8, 16), jnp.float32)
    body = lambda a: jax.lax.psum(a.sum(), ("data", "model"))
    c = _one(_shard_map_hlo(mesh_2x4, body, x, P("data", "model"), P()))
    assert (c.kind, c.dtype, c.result_shape, c.result_bytes) == ("all-reduce", "f32", ((),), 4)
    assert (c.group_size, c.wire_bytes) == (8, 2 * 7 / 8 * 4)
    assert hlo.mesh_axes(c, mesh_2x4) == ("data", "model")


def test_bf16_psum_bytes_follow_the_dtype_xla_emits(mesh_2x4):
    x = jnp.ones((8, 16), jnp.bfloat16)
    c = _one(
        _shard_map_hlo(
            mesh_2x4, lambda a: jax.lax.psum(a, "model"), x, P("data", "model"), P("data", None)
        )
    )
    # XLA CPU promotes a bf16 all-reduce to f32 (convert, all-reduce in f32, convert back),
    # so on CPU the wire carries twice the bf16 bytes; other backends keep bf16.
    if jax.default_backend() == "cpu":
        assert c.dtype == "f32"
    assert c.result_bytes == 4 * 4 * {"f32": 4, "bf16": 2}[c.dtype]


def test_gspmd_reduction_uses_the_mesh_spelling():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x = jax.device_put(jnp.ones((8, 16), jnp.float32), NamedSharding(mesh, P("data", "model")))
    text = hlo.compiled_hlo(lambda a: a.sum(0), x)
    c = _one(text)  # partitioner-inserted: replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}
    assert "replica_groups=mesh[" in text
    assert (c.kind, c.result_shape, c.replica_groups) == (
        "all-reduce",
        ((4,),),
        ((0, 4), (1, 5), (2, 6), (3, 7)),
    )
    assert hlo.mesh_axes(c, mesh) == ("data",)


def test_no_collectives():
    text = hlo.compiled_hlo(jax.jit(lambda a, *, k: a * k, static_argnames="k"), jnp.ones(8), k=3)
    assert "multiply" in text
    assert hlo.collectives(text) == []
    assert hlo.total_wire_bytes(text) == 0.0
    assert hlo.largest_collective(text) is None
    assert hlo.summarize(text).splitlines()[-1].split() == ["total", "0", "0"]


@pytest.mark.parametrize(
    "arrange",
    [lambda d: d[::-1].reshape(2, 4), lambda d: d.reshape(4, 2).T],
    ids=["reversed", "transposed"],
)
def test_mesh_axes_on_a_permuted_device_mesh(arrange):
    # Replica groups hold partition ids: positions in mesh.devices.flat, not device ids. In
    # the transposed mesh position (0, j) holds device 2j, so reading the model group
    # {0,1,2,3} as device ids would span both axes.
    mesh = jax.sharding.Mesh(arrange(np.array(jax.devices())), ("data", "model"))
    x = jnp.ones((8, 16), jnp.float32)
    psum = _one(
        _shard_map_hlo(
            mesh, lambda a: jax.lax.psum(a, "model"), x, P("data", "model"), P("data", None)
        )
    )
    body = lambda a: jax.lax.psum_scatter(a, "data", scatter_dimension=0, tiled=True)
    scatter = _one(_shard_map_hlo(mesh, body, x, P(None, "model"), P("data", "model")))
    assert hlo.mesh_axes(psum, mesh) == ("model",)
    assert hlo.mesh_axes(scatter, mesh) == ("data",)
    ids = [d.id for d in mesh.devices.flat]
    assert ids != sorted(ids)


def test_summarize_a_compiled_program(mesh_2x4):
    x = jnp.ones((8, 16), jnp.float32)

    def body(a):  # a: f32[4, 4]
        return jax.lax.psum_scatter(
            jax.lax.psum(a, "model"), "data", scatter_dimension=0, tiled=True
        )

    text = _shard_map_hlo(mesh_2x4, body, x, P("data", "model"), P("data", None))
    rows = hlo.summarize(text, mesh_2x4).splitlines()
    kinds = [c.kind for c in hlo.collectives(text)]
    assert len(rows) == len(kinds) + 2
    assert [row.split()[0] for row in rows[1:-1]] == kinds
    assert rows[-1].split()[-1] == f"{hlo.total_wire_bytes(text):,.0f}"


def test_table_copies_reads_a_module_with_an_empty_tuple_and_a_while_loop():
    """A while loop whose state is updated in place by a native kernel holds no copy; one
    whose branches of a cond update it does. The module prints `()` results (an empty tuple),
    which the reader must pass over."""
    from jaxembed.kernels import native

    if not native.available():
        pytest.skip("native kernels unavailable")
    opt = jaxembed.optim.rowwise_adagrad(0.1)
    table, acc = jnp.zeros((64, 4)), jnp.zeros((64,))
    local, valid, grads = jnp.arange(8, dtype=jnp.int32), jnp.ones((8,), bool), jnp.ones((8, 4))

    def apply(t, a, loc):
        t, (a,) = native.apply_rows(opt.formula, t, (a,), jnp.int32(0), loc, valid, grads,
                                    hidden_size=4)  # fmt: skip
        return t, a

    def in_while(t, a, n):
        body = lambda c: (c[0] + 1, *apply(c[1], c[2], local + c[0]))
        return jax.lax.while_loop(lambda c: c[0] < n, body, (0, t, a))[1:]

    def in_cond(t, a, n):
        return jax.lax.cond(n > 0, lambda: apply(t, a, local), lambda: apply(t, a, local * 2))

    named = {"table": table, "acc": acc}
    compiled = jax.jit(in_while, donate_argnums=(0, 1)).lower(table, acc, 2).compile()
    assert hlo.table_copies(compiled, named) == []
    compiled = jax.jit(in_cond, donate_argnums=(0, 1)).lower(table, acc, 2).compile()
    assert {c.names for c in hlo.table_copies(compiled, named)} == {("table",), ("acc",)}
