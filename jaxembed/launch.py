"""A local multi-process launcher for JAX's multi-controller runtime, for development and tests.

    python -m jaxembed.launch --processes 2 --devices-per-process 4 -- SCRIPT [ARGS...]

starts `--processes` copies of `python SCRIPT ARGS` with a coordinator on 127.0.0.1 and a
free port. Each copy calls `jaxembed.launch.initialize()` first, which gives it
`--devices-per-process` CPU devices and runs `jax.distributed.initialize` (CPU collectives
over gloo), so `jax.devices()` then lists every process's devices. The launcher prefixes
each line a process prints with `[pN]`. When one process fails while others still run, it
says so at once and again at the end (the errors the others print next, such as gloo's
"collective mismatch" or a heartbeat timeout, follow from that death), gives them `--grace`
seconds to notice through the runtime's heartbeat (and exit with its message), kills those
still running, and returns the first failed process's exit code.

On a real cluster the same script runs unchanged: without the launcher's environment,
`initialize()` calls `jax.distributed.initialize()` with no arguments, which detects SLURM,
Open MPI, Kubernetes (JobSet) and Cloud TPU settings by itself. See `docs/multihost.md`.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

from jaxembed import host

__all__ = ["LaunchError", "free_port", "initialize", "launch", "main", "process_mesh"]

ENV_COORDINATOR = "JAXEMBED_COORDINATOR"
ENV_NUM_PROCESSES = "JAXEMBED_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXEMBED_PROCESS_ID"
ENV_DEVICES = "JAXEMBED_DEVICES_PER_PROCESS"
ENV_HEARTBEAT = "JAXEMBED_HEARTBEAT_TIMEOUT"
ENV_INIT_TIMEOUT = "JAXEMBED_INIT_TIMEOUT"


class LaunchError(RuntimeError):
    """The processes cannot be started or cannot form one runtime.

    Raised by `launch` for a bad process or device count, no command, or a coordinator port
    in use, and by `initialize` when the processes do not add up to one runtime. `main`
    prints its message and exits with code 2.

    Examples:
      >>> launch([], processes=1, devices_per_process=1)
      Traceback (most recent call last):
        ...
      jaxembed.launch.LaunchError: no command to run: pass a script after --, e.g. -- train.py
      --steps 10
    """


def process_mesh(spec: str, *, axes: Sequence[str] | None = None):
    """A mesh from `"data=2,model=4"` (Explicit axes, major first) over the first devices in
    process order, so that the major axis spans processes and the minor ones stay inside one
    (put the axis that carries the every-step collectives last).

    Args:
      spec: `name=size` pairs separated by commas.
      axes: the axis names allowed, or None for any.

    Raises:
      ValueError: a malformed spec, an axis not in `axes`, or more devices than jax has; the
        message names the spec and the fix.

    Examples:
      >>> dict(process_mesh("data=2,model=4").shape)
      {'data': 2, 'model': 4}
      >>> process_mesh("seq=8", axes=("data", "model"))
      Traceback (most recent call last):
        ...
      ValueError: --mesh 'seq=8': axes must be 'data' and/or 'model', got ['seq']
    """
    import jax
    import numpy as np
    from jax.sharding import AxisType

    try:
        pairs = [(name, int(size)) for name, size in (a.split("=") for a in spec.split(","))]
    except ValueError:
        raise ValueError(f"--mesh {spec!r}: expected axes like data=2,model=4") from None
    unknown = sorted({name for name, _ in pairs} - set(axes)) if axes is not None else []
    if unknown:
        allowed = " and/or ".join(repr(a) for a in axes)
        raise ValueError(f"--mesh {spec!r}: axes must be {allowed}, got {unknown}")
    size = int(np.prod([s for _, s in pairs]))
    if size > len(jax.devices()):
        raise ValueError(
            f"--mesh {spec!r} needs {size} devices but jax has {len(jax.devices())}: run the "
            "script directly (it sets --devices) or set XLA_FLAGS="
            f"--xla_force_host_platform_device_count={size} before jax is imported"
        )
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))[:size]
    return jax.sharding.Mesh(
        np.array(devices).reshape([s for _, s in pairs]), tuple(n for n, _ in pairs),
        axis_types=(AxisType.Explicit,) * len(pairs),
    )  # fmt: skip


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now.

    The operating system picks it; another program may take it before the coordinator
    binds it, which `launch` then reports as a failed start.

    Returns:
      The port number.

    Examples:
      >>> 0 < free_port() < 2**16
      True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_port_free(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            raise LaunchError(
                f"coordinator port {port} on 127.0.0.1 is already in use ({e.strerror}): pick "
                "another --port, or leave it out to take a free one"
            ) from None


def _cluster_detected() -> bool:
    """Whether this process is one of several that a cluster manager started."""
    env = os.environ
    if env.get("JAXEMBED_DISTRIBUTED", "").lower() in ("1", "auto", "true"):
        return True
    if "JAX_COORDINATOR_ADDRESS" in env or "JOB_COMPLETION_INDEX" in env:  # set / k8s JobSet
        return True
    for count in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if int(env.get(count, "1") or "1") > 1:
            return True
    return "," in env.get("TPU_WORKER_HOSTNAMES", "")  # a multi-host Cloud TPU slice


def initialize(
    *, heartbeat_timeout_seconds: int | None = None, initialization_timeout: int | None = None
) -> bool:
    """Joins the multi-process runtime; call it before anything else touches jax devices.

    In a process started by `launch`, sets the CPU device count and calls
    `jax.distributed.initialize` with the launcher's coordinator. Started by a cluster
    manager as one of several processes (`SLURM_NTASKS` or `OMPI_COMM_WORLD_SIZE` above 1, a
    Kubernetes indexed job, a multi-host Cloud TPU slice, `JAX_COORDINATOR_ADDRESS`, or
    `JAXEMBED_DISTRIBUTED=1`), calls it with no arguments: JAX detects the cluster itself.
    Otherwise does nothing: a single-process run.

    Args:
      heartbeat_timeout_seconds: how long the runtime waits for a silent peer before it
        declares it lost and stops every process (default 10 under the launcher).
      initialization_timeout: how long to wait for every peer to join (default 60).

    Returns:
      True when the process joined a multi-process runtime.

    Raises:
      LaunchError: a process count or device count that does not add up.

    Examples:
      The first lines of a script that runs under `launch` and on a cluster alike:

      ```python
      from jaxembed.launch import initialize

      initialize()  # before anything touches jax devices
      import jax

      print(jax.process_index(), jax.device_count())  # "[p1] 1 8" under --processes 2
      ```
    """
    import jax

    if ENV_COORDINATOR not in os.environ:
        if not _cluster_detected():
            return False
        jax.distributed.initialize()  # JAX reads SLURM, Open MPI, Kubernetes, Cloud TPU
        return True
    num_processes = int(os.environ[ENV_NUM_PROCESSES])
    process_id = int(os.environ[ENV_PROCESS_ID])
    devices = int(os.environ[ENV_DEVICES])
    if not 0 <= process_id < num_processes:
        raise LaunchError(
            f"process id {process_id} is outside the {num_processes} processes of this launch"
        )
    heartbeat = heartbeat_timeout_seconds or int(os.environ.get(ENV_HEARTBEAT, "10"))
    init_timeout = initialization_timeout or int(os.environ.get(ENV_INIT_TIMEOUT, "60"))
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        os.environ[ENV_COORDINATOR],
        num_processes=num_processes,
        process_id=process_id,
        heartbeat_timeout_seconds=heartbeat,
        initialization_timeout=init_timeout,
        shutdown_timeout_seconds=max(heartbeat, 10),
    )
    if jax.process_count() != num_processes:
        raise LaunchError(
            f"process {process_id} was started as one of {num_processes} processes, but the "
            f"runtime at {os.environ[ENV_COORDINATOR]} has {jax.process_count()}: start every "
            "process with the same --processes"
        )
    if jax.local_device_count() != devices or jax.device_count() != devices * num_processes:
        raise LaunchError(
            f"process {process_id} sees {jax.local_device_count()} local and "
            f"{jax.device_count()} global devices, expected {devices} and "
            f"{devices * num_processes} ({num_processes} processes x {devices}): every process "
            "must be started with the same --devices-per-process"
        )
    return True


def _pump(stream, prefix: str, out: TextIO, lock: threading.Lock) -> None:
    for line in iter(stream.readline, ""):
        with lock:
            out.write(f"{prefix}{line}" if line.endswith("\n") else f"{prefix}{line}\n")
            out.flush()
    stream.close()


def _exit_code(code: int) -> int:
    """Shell convention: killed by signal N -> 128 + N."""
    return 128 - code if code < 0 else code


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _names(pids: Sequence[int]) -> str:
    return ("process " if len(pids) == 1 else "processes ") + ", ".join(map(str, pids))


def _death(pid: int, code: int, running: Sequence[int], grace_seconds: float) -> str:
    """What the launcher says when process `pid` fails while `running` still run."""
    message = f"process {pid} {_describe(code)}"
    if not running:
        return message
    return (
        f"{message} while {_names(running)} still {'runs' if len(running) == 1 else 'run'}: "
        f"process {pid} failed first, so the errors the others print from now on (gloo's "
        f"'collective mismatch', a heartbeat timeout naming task {pid}, an abort) are a "
        f"consequence of its exit, not bugs of their own; its cause is in the [p{pid}] lines "
        f"above. The others get {grace_seconds:g} s to stop, then are killed"
    )


def launch(
    command: Sequence[str],
    *,
    processes: int,
    devices_per_process: int,
    port: int | None = None,
    grace_seconds: float = 60.0,
    timeout_seconds: float | None = None,
    heartbeat_timeout_seconds: int = 10,
    env: Mapping[str, str] | None = None,
    out: TextIO | None = None,
) -> int:
    """Runs `python *command` in `processes` processes that form one JAX runtime.

    Args:
      command: a script and its arguments (`["train.py", "--steps", "10"]`) or
        `["-m", "module", ...]`; run with this Python.
      processes: how many processes.
      devices_per_process: CPU devices each process gets.
      port: the coordinator's port on 127.0.0.1 (default: a free one).
      grace_seconds: after one process fails, how long the others get to exit on their own
        (the runtime's heartbeat stops them with a message naming the lost process) before
        the launcher kills them.
      timeout_seconds: kill everything after this long (exit code 124).
      heartbeat_timeout_seconds: passed to `jax.distributed.initialize` in each process.
      env: extra environment variables for every process. Each also starts with
        `jaxembed.host.host_env()`'s `GLIBC_TUNABLES` (`JAXEMBED_MALLOC=default`: not).
      out: where the prefixed output goes (default `sys.stdout`).

    Returns:
      0 when every process succeeded, else the exit code of the process that failed first
      (128+N for a signal N; the others' failures follow from it: the launcher says so, as
      `[launch] process 1 exited with code 3 while process 0 still runs: ...`, and kills
      those still running after `grace_seconds`), or 124 after `timeout_seconds`.

    Raises:
      LaunchError: a bad process or device count, no command, or a coordinator port in use.

    Examples:
      Each line a process prints comes back prefixed with its process id:

      >>> launch(["-c", "print('hello')"], processes=1, devices_per_process=1)
      [p0] hello
      0
      >>> launch(["-c", "raise SystemExit(3)"], processes=1, devices_per_process=1)
      [launch] process 0 exited with code 3
      3
    """
    if processes < 1 or devices_per_process < 1:
        raise LaunchError(
            f"need at least 1 process and 1 device per process, got --processes {processes} "
            f"--devices-per-process {devices_per_process}"
        )
    if not command:
        raise LaunchError("no command to run: pass a script after --, e.g. -- train.py --steps 10")
    if port is None:
        port = free_port()
    else:
        _check_port_free(port)
    out = out or sys.stdout
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps = []
    for pid in range(processes):
        child_env = host.host_env({  # glibc's malloc keeps XLA's per-step buffers for reuse
            **os.environ,
            **(env or {}),
            ENV_COORDINATOR: f"127.0.0.1:{port}",
            ENV_NUM_PROCESSES: str(processes),
            ENV_PROCESS_ID: str(pid),
            ENV_DEVICES: str(devices_per_process),
            ENV_HEARTBEAT: str(heartbeat_timeout_seconds),
            "JAX_PLATFORMS": "cpu",
            "PYTHONUNBUFFERED": "1",
        })  # fmt: skip
        child_env.pop("XLA_FLAGS", None)  # the device count comes from jax_num_cpu_devices
        proc = subprocess.Popen(
            [sys.executable, *command],
            env=child_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        procs.append(proc)
        t = threading.Thread(target=_pump, args=(proc.stdout, f"[p{pid}] ", out, lock), daemon=True)
        t.start()
        pumps.append(t)

    def say(message: str) -> None:
        with lock:
            out.write(f"[launch] {message}\n")
            out.flush()

    start = time.monotonic()
    failed_at: float | None = None
    first: int | None = None  # the process that failed first
    peers_ran = False  # whether others still ran then: their failures follow from it
    reported: set[int] = set()

    def report(pid: int, code: int) -> None:
        nonlocal first, peers_ran
        reported.add(pid)
        if code == 0:
            return
        if first is None:
            first = pid
            running = [q for q, p in enumerate(procs) if p.poll() is None]
            peers_ran = bool(running)
            say(_death(pid, code, running, grace_seconds))
        else:
            after = f" (after process {first} failed)" if peers_ran else ""
            say(f"process {pid} {_describe(code)}{after}")

    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            for pid, p in enumerate(procs):
                code = p.poll()
                if code is not None and pid not in reported:
                    report(pid, code)
                    if code != 0 and failed_at is None:
                        failed_at = now
            if failed_at is not None and now - failed_at > grace_seconds:
                say(f"killing the processes still running {grace_seconds:.0f} s after a failure")
                _kill(procs)
                break
            if timeout_seconds is not None and now - start > timeout_seconds:
                say(f"timed out after {timeout_seconds:.0f} s: killing every process")
                _kill(procs)
                for p in procs:
                    p.wait()
                return 124
            time.sleep(0.1)
    except KeyboardInterrupt:
        _kill(procs)
        raise
    for p in procs:
        p.wait()
    for t in pumps:
        t.join(timeout=5)
    for pid, p in enumerate(procs):
        if pid not in reported:
            report(pid, p.returncode)
    if first is None:
        return 0
    followers = [q for q, p in enumerate(procs) if q != first and p.returncode != 0]
    if followers and peers_ran:  # the last lines are read first: name the cause again
        say(
            f"process {first} failed first ({_describe(procs[first].returncode)}); the "
            f"failures of {_names(followers)} followed from its exit: see the [p{first}] "
            "lines above for the cause"
        )
    return _exit_code(procs[first].returncode)


def _kill(procs: Sequence[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m jaxembed.launch`: parses flags and calls `launch`.

    Flags: `--processes` (default 2), `--devices-per-process` (default 4), `--port`,
    `--grace`, `--timeout` and `--heartbeat-timeout` (seconds), then `-- SCRIPT [ARGS...]`.

    Args:
      argv: the arguments after the program name (default `sys.argv[1:]`).

    Returns:
      The exit code: `launch`'s (the first failed process's), or 2 after printing a
      `LaunchError` to stderr.

    Examples:
      >>> main(["--processes", "1", "--devices-per-process", "1", "--", "-c", "print(6 * 7)"])
      [p0] 42
      0
      >>> main(["--processes", "0", "--", "-c", "pass"])       # the error goes to stderr
      2
    """
    parser = argparse.ArgumentParser(
        prog="python -m jaxembed.launch",
        description="Run a script in several processes that form one JAX runtime on this "
        "machine (CPU devices, gloo collectives).",
    )
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices-per-process", type=int, default=4)
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
    parser.add_argument("--grace", type=float, default=60.0,
                        help="seconds the others get to exit after one fails")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=None, help="kill all after this long")
    parser.add_argument("--heartbeat-timeout", type=int, default=10)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        return launch(
            command, processes=args.processes, devices_per_process=args.devices_per_process,
            port=args.port, grace_seconds=args.grace, timeout_seconds=args.timeout,
            heartbeat_timeout_seconds=args.heartbeat_timeout,
        )  # fmt: skip
    except LaunchError as e:
        print(f"jaxembed.launch: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
