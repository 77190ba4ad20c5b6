"""Test fixtures. Every test runs on 8 CPU devices.

The device count is set in the repository's root `conftest.py`, which pytest loads before
this file and before any module that imports jax; it is checked again here so that a test
run from another root fails loudly instead of running on one device.
"""

import os

import jax
import numpy as np
import pytest
from hypothesis import settings
from jax.sharding import AxisType

# CI runs the property tests on hypothesis's fixed seed, so that a red run is reproducible and
# never a fresh draw; locally every run explores new examples.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

assert len(jax.devices()) == 8, (
    "tests need 8 CPU devices: set XLA_FLAGS=--xla_force_host_platform_device_count=8 "
    "before jax is imported (the repository's conftest.py does this)"
)


@pytest.fixture
def fresh_warnings():
    """jaxembed warns once per process for each assumption and call site; a test that expects
    such a warning asks for this fixture, so that it sees it whatever ran before."""
    from jaxembed.kernels import arrays

    arrays._WARNED.clear()


@pytest.fixture(params=[AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def axis_type(request):
    return request.param


@pytest.fixture
def mesh_2x4(axis_type):
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2)


@pytest.fixture
def mesh_8(axis_type):
    return jax.make_mesh((8,), ("model",), axis_types=(axis_type,))


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# Scripts run by the multi-process tests under jaxembed.launch, not test modules: importing
# them (e.g. for doctests) would start their work in this single process.
collect_ignore = ["multihost"]
