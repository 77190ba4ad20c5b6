"""`jaxembed.host`: glibc's malloc settings that keep XLA:CPU's per-step buffers for reuse.

The behaviour is checked where it shows, in page faults: a jitted program whose 40 MiB temp
block is bigger than glibc's mmap threshold faults that block in on every call by default.
Tuned, by `tune_malloc()` before JAX's backend starts or by `host_env()`'s `GLIBC_TUNABLES`
at the process's start, most calls fault nothing once the heap has grown to hold what is in
use at once (a call's block can still be held while the next is allocated, so the heap grows
in a few steps, and fragmentation adds an occasional step). Each case runs in its own
process.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from jaxembed import host

glibc_only = pytest.mark.skipif(not host._glibc(), reason="the settings are glibc's")

_PROGRAM = textwrap.dedent("""
    import os, resource, sys, warnings
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    mode = sys.argv[1]
    if mode == "import":  # the default: importing jaxembed before any computation tunes
        import jaxembed
    import jax, jax.numpy as jnp
    if mode == "early":
        from jaxembed import host
        assert host.tune_malloc() and host.malloc_settings()["tuned_in_process"]
    x = jnp.ones((5 << 20,), jnp.float32)
    f = jax.jit(lambda x: jnp.cumsum(x.reshape(1024, -1).T * 2.0, axis=1)[:, ::512])
    f = f.lower(x).compile()
    assert f.memory_analysis().temp_size_in_bytes > 32 << 20  # over glibc's mmap threshold
    if mode in ("late", "default"):
        from jaxembed import host  # imported after the backend started: it changes nothing
        assert not host.malloc_settings()["tuned_in_process"]
    if mode == "late":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert host.tune_malloc() is False
        assert "already started" in str(caught[0].message)
    if mode == "import":
        from jaxembed import host
        assert host.malloc_settings()["tuned_in_process"] == (
            os.environ.get(host.ENV_MALLOC) != "default")
    faults = []
    for _ in range(30):
        start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        jax.block_until_ready(f(x))
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
    print(sum(faults[1:]))  # the calls after the first
""")


def _faults(mode: str, env: dict[str, str]) -> float:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**env, "PYTHONPATH": os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, "-c", _PROGRAM, mode], env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return float(out.stdout.split()[-1])


@pytest.mark.slow  # heavy; what it checks is covered by the quicker tests beside it
@glibc_only
def test_tuned_malloc_stops_the_per_step_page_faults():
    plain = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", host.ENV_MALLOC)}
    default = _faults("default", plain)
    assert default > 29 * 10_000  # 40 MiB, faulted in again on each of 29 calls
    assert _faults("early", plain) < default / 2  # about 1/4 measured
    assert _faults("env", host.host_env(plain)) < default / 2
    assert _faults("late", plain) > default * 0.8  # too late: the arenas are taken
    assert _faults("import", plain) < default / 2  # importing jaxembed first tunes it
    declined = _faults("import", {**plain, host.ENV_MALLOC: "default"})
    assert declined > default * 0.8  # JAXEMBED_MALLOC=default keeps glibc's defaults


def test_host_env_adds_the_tunables_and_keeps_what_is_set():
    env = host.host_env({"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.mmap_max=7"})
    assert env["PATH"] == "/bin"
    assert env["GLIBC_TUNABLES"].split(":") == [
        "glibc.malloc.mmap_max=7",
        "glibc.malloc.arena_max=1",
        f"glibc.malloc.trim_threshold={1 << 36}",
    ]
    assert host.host_env(env) == env  # idempotent


def test_jaxembed_malloc_default_declines_and_a_bad_value_is_named(monkeypatch):
    env = {"JAXEMBED_MALLOC": "default", "GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}
    assert host.host_env(env) == env
    monkeypatch.setenv("JAXEMBED_MALLOC", "default")
    monkeypatch.setattr(host, "_tuned", False)  # as in a process not tuned at import
    assert host.tune_malloc() is False
    with pytest.raises(ValueError, match=r"JAXEMBED_MALLOC='fast' must be 'tuned' or 'default'"):
        host.host_env({"JAXEMBED_MALLOC": "fast"})


def test_the_launcher_and_the_bench_start_their_processes_tuned(monkeypatch, capsys):
    from benchmarks.recsys import bench as recsys
    from jaxembed import launch

    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("JAXEMBED_MALLOC", raising=False)
    show = ["-c", "import os; print(os.environ.get('GLIBC_TUNABLES'))"]
    assert launch.launch(show, processes=1, devices_per_process=1) == 0
    assert capsys.readouterr().out.strip() == "[p0] " + host.host_env({})["GLIBC_TUNABLES"]
    assert launch.launch(show, processes=1, devices_per_process=1,
                         env={"JAXEMBED_MALLOC": "default"}) == 0  # fmt: skip
    assert capsys.readouterr().out.strip() == "[p0] None"
    assert recsys._env(8, "tuned")["GLIBC_TUNABLES"] == host.host_env({})["GLIBC_TUNABLES"]
    assert "GLIBC_TUNABLES" not in recsys._env(8, "default")
