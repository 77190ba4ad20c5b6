"""Train a small language model with a sharded, tied embedding table on 8 CPU devices.

    python examples/train_lm.py                                  # mesh data=2,model=4
    python examples/train_lm.py --steps 2000 --vocab 4093 --hidden 128 --blocks 4
    python examples/train_lm.py --ckpt-dir /tmp/lm --save-every 50 --stop-after 100
    python examples/train_lm.py --ckpt-dir /tmp/lm --resume --mesh data=4,model=2
    python examples/train_lm.py --processes 2                    # 2 processes x 4 devices

The corpus is a fixed random Markov chain over the vocabulary: every token has `--branching`
successors with Dirichlet weights. Its entropy rate (nats per token) is the lowest loss any
model can reach, and the run prints how close it gets.

The model: `jaxembed.nnx.Embed` (rows split over `model`, padded to a multiple of 64 so that
the parameter's shape does not depend on the mesh) -> residual MLP blocks -> RMSNorm -> the
tied head, trained through `Embed.cross_entropy` (the vocab-parallel loss: no device holds
full-vocabulary logits) with `optax.adamw`. Layouts are logical names (`batch`, `vocab`,
`embed`, `mlp`) resolved by `logical_rules(mesh)`, so the same model runs on any mesh.

Checkpoints (orbax) hold the parameters and the optimizer state; the batch of step `s` is a
function of `(--seed, s)` only. `--resume` restores the latest checkpoint onto the mesh given
now, which may differ from the one that saved it, and continues with the numbers an
uninterrupted run would have produced (up to float32 rounding in the collectives).

Run as a script it gives the CPU platform `--devices` devices before jax is imported;
imported, `main(argv)` runs on the devices jax already has. With `--processes N` it starts
itself N times under `jaxembed.launch` (N processes x devices/N CPU devices, one JAX
runtime); the `data` axis then spans the processes, every process builds the same global
batch and places only its own slice, and all of them write the orbax checkpoint together.
On a cluster, start one copy per host the cluster's way (see docs/multihost.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=8, help="CPU devices (set before jax loads)")
    p.add_argument("--mesh", default="data=2,model=4", help="mesh axes, e.g. data=4,model=2")
    p.add_argument("--vocab", type=int, default=509, help="vocabulary size (any; it is padded)")
    p.add_argument("--branching", type=int, default=8, help="successors per token in the chain")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--blocks", type=int, default=2, help="residual MLP blocks")
    p.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=400, help="total optimizer steps")
    p.add_argument("--lr", type=float, default=2e-2, help="peak learning rate")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--vocab-chunk", type=int, default=None, help="loss chunk (rows/device)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-dir", default=None, help="orbax checkpoint directory")
    p.add_argument("--save-every", type=int, default=100, help="checkpoint interval (steps)")
    p.add_argument("--resume", action="store_true", help="restore the latest checkpoint")
    p.add_argument("--stop-after", type=int, default=None, help="stop at this step (preempt)")
    p.add_argument("--metrics-out", default=None, help="write per-step losses as JSON here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--processes", type=int, default=1, help="processes (jaxembed.launch)")
    p.add_argument(
        "--crash-at-step", type=int, default=None,
        help="fault injection: --crash-process kills itself (SIGKILL) before this step",
    )  # fmt: skip
    p.add_argument("--crash-process", type=int, default=1)
    args = p.parse_args(argv)
    if args.resume and not args.ckpt_dir:
        p.error("--resume needs --ckpt-dir")
    if args.processes < 1 or args.devices % args.processes:
        p.error(f"--devices {args.devices} must split evenly over --processes {args.processes}")
    return args


def configure_host_devices(n: int) -> None:
    """Gives the CPU platform `n` devices; must run before jax is imported."""
    if "jax" in sys.modules:
        return
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={n}")
    os.environ["XLA_FLAGS"] = " ".join(flags)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _start() -> None:
    """Run as a script: join the launcher's runtime, or start it, or set the device count."""
    from jaxembed import launch

    args = parse_args(sys.argv[1:])
    if launch.ENV_COORDINATOR in os.environ or launch._cluster_detected():
        launch.initialize()  # one of several processes: the launcher (or cluster) set it up
    elif args.processes > 1:
        sys.exit(
            launch.launch(
                [os.path.abspath(__file__), *sys.argv[1:]],
                processes=args.processes,
                devices_per_process=args.devices // args.processes,
            )
        )
    else:
        configure_host_devices(args.devices)


if __name__ == "__main__":
    _start()

# ruff: noqa: E402  (jax and what imports it load after the device count is set)
import signal

import flax.linen as nn
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxembed.launch
import jaxembed.nnx

# --- mesh and layouts -----------------------------------------------------------------------


def make_mesh(spec: str) -> jax.sharding.Mesh:
    """The training mesh from `"data=2,model=4"` (Explicit axes), over `jax.devices()`.

    The one place that decides which devices train; a multi-process run changes only this
    (and how `shard_batch` places the batch). Devices are taken in process order: the major
    axis (`data`) spans processes, and the minor one (`model`, which carries the forward's
    psum every step) stays inside a process (`jaxembed.launch.process_mesh`).
    """
    try:
        return jaxembed.launch.process_mesh(spec, axes=("data", "model"))
    except ValueError as err:
        raise SystemExit(str(err)) from None


def logical_rules(mesh: jax.sharding.Mesh) -> list[tuple[str, str | None]]:
    """Logical axis -> mesh axis: tokens over `data`, the vocabulary over `model`."""
    has = set(mesh.axis_names)
    return [
        ("batch", "data" if "data" in has else None),
        ("vocab", "model" if "model" in has else None),
        ("embed", None),
        ("mlp", None),
    ]


def batch_spec(mesh: jax.sharding.Mesh) -> P:
    return P("data" if "data" in mesh.axis_names else None, None)


def shard_batch(batch: np.ndarray, mesh: jax.sharding.Mesh) -> jax.Array:
    """Places a global numpy batch; each device (of any process) takes its own slice."""
    sharding = NamedSharding(mesh, batch_spec(mesh))
    return jax.make_array_from_callback(batch.shape, sharding, lambda index: batch[index])


# --- the corpus -----------------------------------------------------------------------------


class MarkovCorpus:
    """A fixed random Markov chain over `vocab` tokens, and its entropy rate."""

    def __init__(self, vocab: int, branching: int, seed: int):
        rng = np.random.default_rng(seed)
        k = min(branching, vocab)
        self.successors = np.stack([rng.choice(vocab, k, replace=False) for _ in range(vocab)])
        self.probs = rng.dirichlet(np.ones(k), size=vocab)  # [vocab, k]
        self.cumulative = np.cumsum(self.probs, axis=1)
        dense = np.zeros((vocab, vocab))
        np.put_along_axis(dense, self.successors, self.probs, axis=1)
        pi = np.full(vocab, 1.0 / vocab)
        for _ in range(10_000):  # the stationary distribution, by power iteration
            nxt = pi @ dense
            if np.abs(nxt - pi).max() < 1e-13:
                break
            pi = nxt
        self.stationary = pi / pi.sum()
        row_entropy = -(self.probs * np.log(self.probs)).sum(axis=1)
        self.entropy_rate = float(self.stationary @ row_entropy)  # nats per token
        self.seed = seed

    def batch(self, step: int, batch: int, seq: int) -> np.ndarray:
        """`int32[batch, seq + 1]` for this step: a function of (seed, step) only."""
        rng = np.random.default_rng([self.seed, step])
        tokens = np.empty((batch, seq + 1), np.int32)
        tokens[:, 0] = rng.choice(len(self.stationary), batch, p=self.stationary)
        for t in range(seq):
            u = rng.random(batch)[:, None]
            pick = (self.cumulative[tokens[:, t]] < u).sum(axis=1)
            pick = np.minimum(pick, self.successors.shape[1] - 1)
            tokens[:, t + 1] = self.successors[tokens[:, t], pick]
        return tokens

    def oracle_loss(self, tokens: np.ndarray) -> float:
        """The chain's own mean loss on `tokens` (nats per predicted token)."""
        cur, nxt = tokens[:, :-1], tokens[:, 1:]
        hit = self.successors[cur] == nxt[..., None]  # [batch, seq, k]
        return float(-np.log((self.probs[cur] * hit).sum(axis=-1)).mean())


# --- the model ------------------------------------------------------------------------------


class Block(nnx.Module):
    """A residual MLP block: x + W2 gelu(W1 rmsnorm(x))."""

    def __init__(self, hidden: int, *, rngs: nnx.Rngs):
        self.norm = nnx.RMSNorm(hidden, rngs=rngs)
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(
            hidden, 4 * hidden, rngs=rngs,
            kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
        )  # fmt: skip
        self.down = nnx.Linear(
            4 * hidden, hidden, rngs=rngs,
            kernel_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("mlp", "embed")),
        )  # fmt: skip

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class LanguageModel(nnx.Module):
    """Embed -> blocks -> RMSNorm -> tied head; `__call__` returns the mean loss."""

    def __init__(self, vocab: int, hidden: int, blocks: int, *, rngs: nnx.Rngs):
        self.embed = jaxembed.nnx.Embed(
            vocab, hidden, pad_to_multiple_of=64, rngs=rngs,
            embedding_init=nnx.with_partitioning(
                nnx.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0),
                ("vocab", "embed"),
            ),
        )  # fmt: skip
        self.blocks = nnx.List([Block(hidden, rngs=rngs) for _ in range(blocks)])
        self.norm = nnx.RMSNorm(hidden, rngs=rngs)

    def features(self, tokens: jax.Array) -> jax.Array:
        """The last hidden states `[batch, seq, hidden]`, laid out like the tokens."""
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.norm(h)

    def __call__(self, tokens: jax.Array, labels: jax.Array, vocab_chunk: int | None = None):
        return self.embed.cross_entropy(
            self.features(tokens), labels, reduction="mean", vocab_chunk_size=vocab_chunk
        )


def make_optimizer(model: LanguageModel, args: argparse.Namespace) -> nnx.Optimizer:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, warmup_steps=max(1, args.steps // 20), decay_steps=args.steps,
        end_value=args.lr / 10,
    )  # fmt: skip
    tx = optax.adamw(schedule, weight_decay=args.weight_decay)
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


def build(args: argparse.Namespace, mesh: jax.sharding.Mesh):
    """The model and optimizer, laid out on `mesh` (call under `jax.set_mesh` and the rules)."""
    model = LanguageModel(args.vocab, args.hidden, args.blocks, rngs=nnx.Rngs(args.seed))
    return model, make_optimizer(model, args)


# --- checkpoints ----------------------------------------------------------------------------


def checkpoint_state(model: LanguageModel, optimizer: nnx.Optimizer) -> dict:
    """What a checkpoint holds: parameters and optimizer state, as plain arrays."""
    return {
        "params": nnx.to_pure_dict(nnx.state(model, nnx.Param)),
        "optimizer": nnx.to_pure_dict(nnx.state(optimizer)),
    }


def checkpoint_manager(directory: str) -> ocp.CheckpointManager:
    """Keeps every checkpoint it is asked to save (the loop decides when)."""
    return ocp.CheckpointManager(os.path.abspath(directory))


def save(manager: ocp.CheckpointManager, step: int, model, optimizer) -> None:
    state = checkpoint_state(model, optimizer)
    manager.save(step, args=ocp.args.StandardSave(state), force=True)


def restore(manager: ocp.CheckpointManager, step: int, model, optimizer) -> None:
    """Restores `step` into `model` and `optimizer` in *their* current layouts.

    The target is the abstract state of the freshly built model and optimizer on the current
    mesh: orbax reads each array straight into that sharding, whatever mesh saved it.
    """
    target = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
        checkpoint_state(model, optimizer),
    )
    restored = manager.restore(step, args=ocp.args.StandardRestore(target))
    for obj, key in ((model, "params"), (optimizer, "optimizer")):
        state = nnx.state(obj, nnx.Param) if key == "params" else nnx.state(obj)
        nnx.replace_by_pure_dict(state, restored[key])
        nnx.update(obj, state)


# --- training -------------------------------------------------------------------------------


@nnx.jit(static_argnames="vocab_chunk")
def train_step(model, optimizer, tokens, labels, vocab_chunk=None):
    loss, grads = nnx.value_and_grad(lambda m: m(tokens, labels, vocab_chunk))(model)
    optimizer.update(model, grads)
    return loss


def main(argv: list[str] | None = None) -> dict:
    """Trains (or resumes); returns the metrics it also writes to `--metrics-out`."""
    args = parse_args(argv)
    mesh = make_mesh(args.mesh)
    rules = logical_rules(mesh)
    corpus = MarkovCorpus(args.vocab, args.branching, args.seed)
    manager = checkpoint_manager(args.ckpt_dir) if args.ckpt_dir else None
    losses: dict[int, float] = {}
    oracle: dict[int, float] = {}  # the chain's own loss on the same batches
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        model, optimizer = build(args, mesh)
        start = 0
        if args.resume:
            start = manager.latest_step()
            if start is None:
                raise SystemExit(f"--resume: no checkpoint in {args.ckpt_dir}")
            restore(manager, start, model, optimizer)
        end = min(args.steps, args.stop_after or args.steps)
        t0 = time.perf_counter()
        quiet = args.no_progress or jax.process_index() != 0
        with _progress(quiet, end - start) as advance:
            for step in range(start + 1, end + 1):  # step s trains on batch s
                if step == args.crash_at_step and jax.process_index() == args.crash_process:
                    print(f"process {args.crash_process}: crashing before step {step}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                batch = corpus.batch(step, args.batch, args.seq)
                oracle[step] = corpus.oracle_loss(batch)
                tokens = shard_batch(batch, mesh)
                loss = train_step(model, optimizer, tokens[:, :-1], tokens[:, 1:], args.vocab_chunk)
                losses[step] = float(loss)
                advance(step, losses[step])
                if manager is not None and (step % args.save_every == 0 or step == end):
                    save(manager, step, model, optimizer)
        if manager is not None:
            manager.wait_until_finished()
    tail = list(losses.values())[-max(1, len(losses) // 10) :]
    oracle_tail = list(oracle.values())[-len(tail) :]
    metrics = {
        "mesh": dict(mesh.shape),
        "entropy_rate": corpus.entropy_rate,
        "uniform_loss": float(np.log(args.vocab)),
        "first_step": start + 1,
        "losses": {str(k): v for k, v in losses.items()},
        "final_loss": float(np.mean(tail)) if tail else None,
        "final_oracle_loss": float(np.mean(oracle_tail)) if tail else None,
        "seconds": time.perf_counter() - t0,
        "table_shape": list(model.embed.embedding.shape),
        "table_spec": str(model.embed.embedding.sharding.spec),
    }
    if tail:
        print(
            f"steps {start + 1}-{end} on mesh {dict(mesh.shape)}, mean of the last "
            f"{len(tail)}: loss {metrics['final_loss']:.4f}, the chain's own loss on those "
            f"batches {metrics['final_oracle_loss']:.4f} (entropy rate "
            f"{corpus.entropy_rate:.4f} nats/token, uniform {metrics['uniform_loss']:.4f}); "
            f"{metrics['seconds']:.1f} s"
        )
    metrics["processes"] = jax.process_count()
    if args.metrics_out and jax.process_index() == 0:
        with open(args.metrics_out, "w") as f:
            json.dump(metrics, f, indent=1)
    return metrics


class _progress:
    """A rich progress bar with the loss (or nothing, with --no-progress)."""

    def __init__(self, off: bool, total: int):
        self.off, self.total = off, total

    def __enter__(self):
        if self.off:
            return lambda step, loss: None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

        self.bar = Progress(
            "train", BarColumn(), MofNCompleteColumn(), "{task.fields[loss]}",
            TimeRemainingColumn(),
        )  # fmt: skip
        self.bar.__enter__()
        task = self.bar.add_task("train", total=self.total, loss="")

        def advance(step, loss):
            self.bar.update(task, advance=1, loss=f"step {step} loss {loss:.4f}")

        return advance

    def __exit__(self, *exc):
        if not self.off:
            self.bar.__exit__(*exc)


if __name__ == "__main__":
    main(sys.argv[1:])
