"""Root pytest configuration: 8 CPU devices before jax is imported anywhere.

pytest loads this file before it imports any test module or any `jaxembed` module
for its doctests, so every test and doctest sees the same 8-device CPU platform.
"""

import os

_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUMPY_RANK_PROMOTION", "raise")
# Plans follow the cost model's default constants, not a calibration file this machine may
# hold (`jaxembed bench --calibrate`): a test's plan must not depend on where it runs.
os.environ["JAXEMBED_COST_FILE"] = ""
