"""The layout bridge: dims mappings and partial dims <-> `PartitionSpec`, and every error path.

`PartitionSpec` with `unreduced` forbids iteration and indexing; specs are compared whole or
through `.partitions`.
"""

import jax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from jaxembed.layout import (
    axis_names_of,
    entry_mesh_axes,
    normalize_entry,
    to_dims_mapping,
    to_partial_dims,
    to_partition_spec,
)

NAMES = ("data", "model")
ALL_NAMES = ("data", "model", "pipe")


# ---------------------------------------------------------------------------------------------
# Round trips over random valid layouts
# ---------------------------------------------------------------------------------------------


@st.composite
def layouts(draw):
    """A mesh (1 to 3 axes), a tensor rank (0 to 4), a valid dims mapping, partial dims and the
    `PartitionSpec` they stand for, built independently of the code under test.

    Each mesh axis goes to at most one tensor axis (in a random major-to-minor order) or to the
    partial dims, or stays unused.
    """
    names = ALL_NAMES[: draw(st.integers(1, 3))]
    ndim = draw(st.integers(0, 4))
    groups = [[] for _ in range(ndim)]
    partial = set()
    for mesh_axis in draw(st.permutations(range(len(names)))):
        target = draw(st.integers(-2, ndim - 1))  # -2: unused, -1: partial, else a tensor axis
        if target == -1:
            partial.add(mesh_axis)
        elif target >= 0:
            groups[target].append(mesh_axis)
    dims_mapping = tuple(-1 if not g else g[0] if len(g) == 1 else tuple(g) for g in groups)
    parts = [
        None if not g else names[g[0]] if len(g) == 1 else tuple(names[a] for a in g)
        for g in groups
    ]
    spec = P(*parts, unreduced={names[a] for a in partial}) if partial else P(*parts)
    return names, ndim, dims_mapping, frozenset(partial), spec


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_round_trip_from_dims_mapping(layout):
    names, ndim, dims_mapping, partial, spec = layout
    made = to_partition_spec(dims_mapping, names, partial)
    assert made == spec
    assert made.partitions == spec.partitions
    assert made.unreduced == spec.unreduced
    assert to_dims_mapping(made, names, ndim) == dims_mapping
    assert to_partial_dims(made, names) == partial


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_round_trip_from_partition_spec(layout):
    names, ndim, dims_mapping, partial, spec = layout
    got = to_dims_mapping(spec, names, ndim)
    assert got == dims_mapping
    assert to_partial_dims(spec, names) == partial
    assert to_partition_spec(got, names, to_partial_dims(spec, names)) == spec


@settings(max_examples=100, deadline=None)
@given(layouts(), st.integers(0, 3))
def test_short_spec_pads_with_replicated(layout, extra):
    names, ndim, dims_mapping, _, spec = layout
    got = to_dims_mapping(spec, names, ndim + extra)
    assert got == dims_mapping + (-1,) * extra


@settings(max_examples=100, deadline=None)
@given(layouts())
def test_lists_and_one_element_tuples_are_accepted(layout):
    names, _, dims_mapping, partial, spec = layout
    as_lists = [
        [e] if isinstance(e, int) and e >= 0 else list(e) if isinstance(e, tuple) else e
        for e in dims_mapping
    ]
    assert to_partition_spec(as_lists, list(names), sorted(partial)) == spec


# ---------------------------------------------------------------------------------------------
# Examples, meshes and axis names
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dims_mapping, spec",
    [
        ((1, -1), P("model", None)),
        ((-1, 0), P(None, "data")),
        (((0, 1), -1), P(("data", "model"), None)),
        (((1, 0), -1), P(("model", "data"), None)),
        ((-1, (1, 0), -1), P(None, ("model", "data"), None)),
        ((), P()),
        ((-1, -1, -1), P(None, None, None)),
    ],
    ids=str,
)
def test_examples(dims_mapping, spec):
    assert to_partition_spec(dims_mapping, NAMES) == spec
    assert to_dims_mapping(spec, NAMES, len(dims_mapping)) == dims_mapping


def test_mesh_objects_and_names_give_the_same_specs():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    abstract = AbstractMesh((2, 4), ("data", "model"))
    for where in (mesh, abstract, NAMES, list(NAMES)):
        assert axis_names_of(where) == NAMES
        assert to_partition_spec((1, (0,)), where, ()) == P("model", "data")
        assert to_partition_spec((-1, 1), where, {0}) == P(None, "model", unreduced={"data"})
        assert to_dims_mapping(P(("data", "model")), where, ndim=2) == ((0, 1), -1)
        assert to_partial_dims(P(None, unreduced={"model"}), where) == frozenset({1})


def test_one_axis_mesh():
    mesh = jax.make_mesh((8,), ("model",))
    assert to_partition_spec((0, -1), mesh) == P("model", None)
    assert to_dims_mapping(P(None, "model"), mesh, ndim=3) == (-1, 0, -1)


def test_replicated_and_missing_specs():
    assert to_dims_mapping(None, NAMES, ndim=2) == (-1, -1)
    assert to_dims_mapping(P(), NAMES, ndim=3) == (-1, -1, -1)
    assert to_dims_mapping(P("model"), NAMES, ndim=3) == (1, -1, -1)
    assert to_dims_mapping(("model", None), NAMES, ndim=2) == (1, -1)
    assert to_dims_mapping(P(()), NAMES, ndim=1) == (-1,)
    assert to_dims_mapping(P(("model",)), NAMES, ndim=1) == (1,)


def test_partial_dims_both_ways():
    spec = to_partition_spec((0, -1), NAMES, partial_dims={1})
    assert spec == P("data", None, unreduced={"model"})
    assert spec.partitions == ("data", None)
    assert to_partial_dims(spec, NAMES) == frozenset({1})
    assert to_partial_dims(P("data", None), NAMES) == frozenset()
    assert to_partial_dims(None, NAMES) == frozenset()
    assert to_partition_spec((-1,), ALL_NAMES, [2, 0]) == P(None, unreduced={"data", "pipe"})
    assert to_partial_dims(P(None, unreduced={"pipe", "data"}), ALL_NAMES) == frozenset({0, 2})


def test_no_partial_dims_gives_a_spec_without_unreduced():
    spec = to_partition_spec((0, -1), NAMES, partial_dims=())
    assert spec == P("data", None)
    assert spec.unreduced == frozenset()
    assert tuple(spec) == ("data", None)


@pytest.mark.parametrize(
    "entry, normalized, axes",
    [
        (-1, -1, ()),
        (0, 0, (0,)),
        (3, 3, (3,)),
        ((), -1, ()),
        ((2,), 2, (2,)),
        ([1], 1, (1,)),
        ((1, 0), (1, 0), (1, 0)),
        ([0, 2, 1], (0, 2, 1), (0, 2, 1)),
    ],
    ids=str,
)
def test_normalize_entry(entry, normalized, axes):
    assert normalize_entry(entry) == normalized
    assert entry_mesh_axes(normalize_entry(entry)) == axes


# ---------------------------------------------------------------------------------------------
# Error paths
# ---------------------------------------------------------------------------------------------


def test_unknown_mesh_axis_name():
    with pytest.raises(
        ValueError,
        match=r"names mesh axis 'pipe', which is not one of the mesh's"
        r" axes \('data', 'model'\)",
    ):
        to_dims_mapping(P("pipe", None), NAMES, ndim=2)
    with pytest.raises(ValueError, match=r"names mesh axis 'pipe'"):
        to_dims_mapping(P(("data", "pipe")), NAMES, ndim=2)
    with pytest.raises(ValueError, match=r"names mesh axis 3"):
        to_dims_mapping(P(("data", 3)), NAMES, ndim=2)


def test_unknown_unreduced_name():
    with pytest.raises(
        ValueError,
        match=r"unreduced mesh axis 'pipe', which is not one of the "
        r"mesh's axes \('data', 'model'\)",
    ):
        to_partial_dims(P(None, unreduced={"pipe"}), NAMES)


@pytest.mark.parametrize(
    "dims_mapping, axis", [((2, -1), 2), ((-1, (0, 2)), 2), ((5,), 5)], ids=str
)
def test_mesh_index_out_of_range(dims_mapping, axis):
    pattern = rf"names mesh axis {axis}, but the mesh has 2 axes \('data', 'model'\)"
    with pytest.raises(ValueError, match=pattern):
        to_partition_spec(dims_mapping, NAMES)


@pytest.mark.parametrize("partial", [{2}, {-1}], ids=str)
def test_partial_dim_out_of_range(partial):
    with pytest.raises(ValueError, match=rf"partial dim {next(iter(partial))} is not a mesh axis"):
        to_partition_spec((0, -1), NAMES, partial)


@pytest.mark.parametrize(
    "dims_mapping, name",
    [((0, 0), "data"), (((0, 1), 1), "model"), (((1, 1), -1), "model"), ((-1, 1, 1), "model")],
    ids=str,
)
def test_mesh_axis_used_twice_in_dims_mapping(dims_mapping, name):
    with pytest.raises(ValueError, match=rf"mesh axis '{name}' is used twice in"):
        to_partition_spec(dims_mapping, NAMES)


@pytest.mark.parametrize(
    "spec, name",
    [
        (P("data", "data"), "data"),
        (P(("data", "model"), "model"), "model"),
        (P(("model", "model")), "model"),
        (("data", ("data",)), "data"),
    ],
    ids=str,
)
def test_mesh_axis_used_twice_in_spec(spec, name):
    with pytest.raises(ValueError, match=rf"mesh axis '{name}' is used twice in"):
        to_dims_mapping(spec, NAMES, ndim=2)


def test_spec_longer_than_rank():
    with pytest.raises(ValueError, match=r"has 3 entries but the tensor has rank 2"):
        to_dims_mapping(P("data", None, None), NAMES, ndim=2)
    with pytest.raises(ValueError, match=r"has 1 entries but the tensor has rank 0"):
        to_dims_mapping(P(None), NAMES, ndim=0)


def test_unconstrained_entry():
    with pytest.raises(ValueError, match=r"UNCONSTRAINED entry.*use None for a replicated axis"):
        to_dims_mapping(P(P.UNCONSTRAINED, None), NAMES, ndim=2)


@pytest.mark.parametrize("partial, name", [({0}, "data"), ({1, 0}, "data")], ids=str)
def test_partial_dim_that_also_splits(partial, name):
    with pytest.raises(
        ValueError,
        match=rf"mesh axis '{name}' both splits a tensor axis and "
        "holds partial sums",
    ):
        to_partition_spec(((0, 1),), NAMES, partial)


@pytest.mark.parametrize(
    "entry, error, pattern",
    [
        ("data", TypeError, r"must be an int or a tuple of ints, got 'data'"),
        (1.5, TypeError, r"must be an int or a tuple of ints, got 1\.5"),
        (None, TypeError, r"must be an int or a tuple of ints, got None"),
        (True, TypeError, r"must be an int or a tuple of ints, got True"),
        ((0, True), TypeError, r"must be an int or a tuple of ints, got True"),
        (-2, ValueError, r"must be -1 or a mesh axis index, got -2"),
        (
            (0, -1),
            ValueError,
            r"tuple entry of a dims mapping lists mesh axis indices >= 0, "
            r"got \(0, -1\)",
        ),
        (((0, 1),), ValueError, r"tuple entry .* got \(\(0, 1\),\)"),
    ],
    ids=str,
)
def test_bad_dims_mapping_entries(entry, error, pattern):
    with pytest.raises(error, match=pattern):
        to_partition_spec((entry, -1), NAMES)


@pytest.mark.parametrize(
    "spec, error, pattern",
    [
        (P(1.5), TypeError, r"has entry 1\.5: an entry must be None, a mesh axis name"),
        ((None, 7), TypeError, r"has entry 7: an entry must be None, a mesh axis name"),
        (42, TypeError, r"expected a PartitionSpec, got 42"),
        ("data", TypeError, r"expected a PartitionSpec, got 'data'"),
    ],
    ids=str,
)
def test_bad_spec_entries(spec, error, pattern):
    with pytest.raises(error, match=pattern):
        to_dims_mapping(spec, NAMES, ndim=2)


@pytest.mark.parametrize(
    "where, pattern",
    [
        ("data", r"expected a jax.sharding.Mesh or a sequence of mesh axis names, got 'data'"),
        (3, r"expected a jax.sharding.Mesh or a sequence of mesh axis names, got 3"),
        (("data", 1), r"mesh axis names must be strings, got \('data', 1\)"),
    ],
    ids=str,
)
def test_bad_mesh_or_axis_names(where, pattern):
    with pytest.raises(TypeError, match=pattern):
        to_partition_spec((-1,), where)
    with pytest.raises(TypeError, match=pattern):
        to_dims_mapping(P(None), where, ndim=1)
