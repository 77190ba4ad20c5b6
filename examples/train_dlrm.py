"""Train a DLRM on a synthetic click stream whose best possible loss and AUC are known.

    python examples/train_dlrm.py                                 # mesh data=2,model=4
    python examples/train_dlrm.py --steps 3000 --dim 64 --placement rows
    python examples/train_dlrm.py --checkpoint-dir /tmp/dlrm --checkpoint-every 100
    python examples/train_dlrm.py --checkpoint-dir /tmp/dlrm --resume --mesh data=8
    python examples/train_dlrm.py --processes 2                   # 2 processes x 4 devices

The data (`dlrm_data.py`, beside this file) come from a known generative model: 13 dense
features and 26 bags of Zipf ids over 20 Criteo-like tables (`--scale 1/8`: 10 to 1.27M
rows), a click probability p that is a fixed function of them. The best log loss any model
can reach and the best AUC (p's own) are measured on the eval set and printed beside the
model's.

The model (DLRM): a bottom MLP over the dense features -> [B, d]; a
`jaxembed.nnx.EmbeddingBagCollection` mean-pools every bag -> [B, 26, d]; the pairwise dot
products of those 27 vectors (upper triangle) beside the bottom output -> top MLP -> logit.
One jitted step: the pooled features are looked up, `value_and_grad` differentiates the
logistic loss with respect to the dense parameters and the pooled features, optax Adam
(warmup-cosine) updates the dense parameters and `coll.apply_gradients` the tables
(row-wise Adagrad: a step costs what the batch touches). The batch is split over every
device of the mesh (`data` and `model` alike); the dense parameters are replicated, the
tables placed by `--placement`: by default `jaxembed.plan_collection` chooses each table's
placement, row sharding and exchange for the batch, the `--memory` budget and the ids of a
few batches (and prints its plan). The default run (1500 steps of 512 examples) ends within
~0.006 of the best AUC in about 4 minutes on 2 CPU cores.

Checkpoints (orbax) hold the dense parameters, Adam's state, and each table and its
row-wise Adagrad accumulator in id order (as `coll.tables()`), so `--resume` restores onto
another mesh or placement; a checkpoint of another `--dim`, `--scale` or `--features` is refused
with its shapes beside the requested ones. The batch of step s is a function of `(--seed, s)`
only.
With `--processes N` the script starts itself N times under `jaxembed.launch`, as
`examples/train_lm.py` does (see docs/multihost.md).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # dlrm_data beside this file


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=8, help="CPU devices (set before jax loads)")
    p.add_argument("--mesh", default="data=2,model=4", help="mesh axes, e.g. data=8")
    p.add_argument("--steps", type=int, default=1500, help="total optimizer steps")
    p.add_argument("--batch", type=int, default=512, help="global batch (examples)")
    p.add_argument("--dim", type=int, default=16, help="embedding dim (16 or 64)")
    p.add_argument("--scale", type=float, default=1 / 8, help="factor on Criteo's table sizes")
    p.add_argument("--features", type=int, default=26, help="the first N of features C1..C26")
    p.add_argument(
        "--placement",
        default="auto",
        choices=("auto", "rows", "table", "replicated", "columns"),
        help="every table's placement, or 'auto': jaxembed.plan_collection chooses",
    )
    p.add_argument("--memory", default="1GiB",
                   help="with --placement auto: the planner's budget per device")  # fmt: skip
    p.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate (dense)")
    p.add_argument("--final-lr", type=float, default=0.05, help="Adam's cosine decays to this x lr")
    p.add_argument("--table-lr", type=float, default=0.05, help="row-wise Adagrad's rate")
    p.add_argument("--eval-every", type=int, default=250, help="eval interval (steps)")
    p.add_argument("--eval-size", type=int, default=32768, help="eval examples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", default=None, help="orbax checkpoint directory")
    p.add_argument("--checkpoint-every", type=int, default=500, help="checkpoint interval")
    p.add_argument("--resume", action="store_true", help="restore the latest checkpoint")
    p.add_argument("--stop-after", type=int, default=None, help="stop at this step (preempt)")
    p.add_argument("--metrics-out", default=None, help="write the metrics as JSON here")
    p.add_argument("--tables-out", default=None, help="write the final tables (.npz) here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--processes", type=int, default=1, help="processes (jaxembed.launch)")
    p.add_argument("--quantized", default="",
                   help="after training, also evaluate the tables quantized row-wise at these "
                   "precisions, e.g. int8,int4 (coll.quantized): AUC and table bytes")  # fmt: skip
    args = p.parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")
    if args.processes < 1 or args.devices % args.processes:
        p.error(f"--devices {args.devices} must split evenly over --processes {args.processes}")
    return args


def _start() -> None:
    """Run as a script: join the launcher's runtime, or start it, or set the device count."""
    from jaxembed import launch

    args = parse_args(sys.argv[1:])
    if launch.ENV_COORDINATOR in os.environ or launch._cluster_detected():
        launch.initialize()
    elif args.processes > 1:
        sys.exit(
            launch.launch(
                [os.path.abspath(__file__), *sys.argv[1:]],
                processes=args.processes,
                devices_per_process=args.devices // args.processes,
            )
        )
    elif "jax" not in sys.modules:
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
        flags.append(f"--xla_force_host_platform_device_count={args.devices}")
        os.environ["XLA_FLAGS"] = " ".join(flags)
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


if __name__ == "__main__":
    _start()

# ruff: noqa: E402  (jax and what imports it load after the device count is set)
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from dlrm_data import NUM_DENSE, Batch, ClickModel, auc, log_loss
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxembed
import jaxembed.launch
import jaxembed.nnx

PLAN_SAMPLE_STEPS = 4
"""`--placement auto` measures the ids of this many training batches for the planner."""

# --- mesh, placements, batches --------------------------------------------------------------


def make_mesh(spec: str) -> jax.sharding.Mesh:
    """The mesh from `"data=2,model=4"` (Explicit axes), devices ordered by process
    (`jaxembed.launch.process_mesh`)."""
    try:
        return jaxembed.launch.process_mesh(spec, axes=("data", "model"))
    except ValueError as err:
        raise SystemExit(str(err)) from None


def batch_spec(mesh: jax.sharding.Mesh) -> P:
    """The examples split over every mesh axis: the dense part is purely data parallel."""
    return P(tuple(mesh.axis_names))


def plan(data: ClickModel, tables, features, mesh, args, row_opt):
    """`--placement auto`: `jaxembed.plan_collection` for this batch, budget and optimizer,
    from the ids of a few training batches (their duplication and skew: Zipf ids put the hot
    rows of block-sharded tables on one device, which the planner answers with mod rows)."""
    sample = [data.batch(step, args.batch).ids for step in range(1, PLAN_SAMPLE_STEPS + 1)]
    return jaxembed.plan_collection(
        tables, features, mesh, batch_size=args.batch, memory_per_device=args.memory,
        optimizer=row_opt, id_stats=jaxembed.id_stats(sample, features),
    )  # fmt: skip


def place_batch(batch: Batch, mesh: jax.sharding.Mesh) -> tuple:
    """(dense, ids, labels) as global arrays split over the batch; each process places only
    its own devices' slices of the (identical) global numpy batch."""

    def put(a):
        sharding = NamedSharding(mesh, P(*batch_spec(mesh), *(None,) * (a.ndim - 1)))
        return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])

    return put(batch.dense), {f: put(x) for f, x in batch.ids.items()}, put(batch.labels)


# --- the model ------------------------------------------------------------------------------


class MLP(nnx.Module):
    """Linear layers with ReLU between them (and after the last when `final_relu`)."""

    def __init__(self, sizes: list[int], *, final_relu: bool, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(sizes)])
        self.final_relu = final_relu

    def __call__(self, x: jax.Array) -> jax.Array:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers) or self.final_relu:
                x = jax.nn.relu(x)
        return x


class DenseArch(nnx.Module):
    """DLRM's dense part: bottom MLP, dot interaction, top MLP -> logit."""

    def __init__(self, features: list[str], dim: int, *, rngs: nnx.Rngs):
        self.features = tuple(features)  # the order of the interaction's vectors
        self.bottom = MLP([NUM_DENSE, 64, dim], final_relu=True, rngs=rngs)
        pairs = (len(features) + 1) * len(features) // 2
        self.top = MLP([dim + pairs, 128, 64, 1], final_relu=False, rngs=rngs)

    def __call__(self, dense: jax.Array, pooled: dict[str, jax.Array]) -> jax.Array:
        """Logits `[B]` from `dense [B, 13]` and the pooled features `{feature: [B, d]}`."""
        x = self.bottom(dense)  # [B, d]
        # By name: a dict that went through a jax transform comes back in sorted key order.
        z = jnp.stack([x, *(pooled[f] for f in self.features)], axis=1)  # [B, F+1, d]
        n = z.shape[1]
        upper = np.flatnonzero(np.triu(np.ones((n, n), bool), k=1))  # the pairs i < j, flat
        dots = jnp.einsum("bid,bjd->bij", z, z).reshape(z.shape[0], n * n)[:, upper]
        return self.top(jnp.concatenate([x, dots], axis=1))[:, 0]  # [B]


def table_init(key, shape, dtype):
    """DLRM's initializer: uniform in ±1/√rows (tiny for the big tables), drawn by numpy
    from the key (no compile per table shape)."""
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    rng = np.random.default_rng(np.asarray(key).ravel().tolist())
    bound = shape[0] ** -0.5
    return jnp.asarray(rng.uniform(-bound, bound, shape).astype(dtype))


def build(args: argparse.Namespace, data: ClickModel, mesh: jax.sharding.Mesh):
    """(dense model, its Adam optimizer, the collection, its row-wise Adagrad, its state);
    call under `jax.set_mesh(mesh)`."""
    tables = [jaxembed.TableConfig(t, rows, args.dim, placement=args.placement,
                                   initializer=table_init)
              for t, rows in data.tables.items()]  # fmt: skip
    features = [jaxembed.FeatureConfig(f, t, combiner="mean", max_ids=data.max_ids)
                for f, t in data.features.items()]  # fmt: skip
    row_opt = jaxembed.optim.rowwise_adagrad(args.table_lr)
    placements = None
    if args.placement == "auto":
        placements = plan(data, tables, features, mesh, args, row_opt)
        if not args.no_progress and jax.process_index() == 0:
            print(placements)
    coll = jaxembed.nnx.EmbeddingBagCollection(
        tables, features, placements=placements, rngs=nnx.Rngs(args.seed)
    )
    model = DenseArch(list(data.features), args.dim, rngs=nnx.Rngs(args.seed + 1))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, warmup_steps=max(1, args.steps // 50), decay_steps=args.steps,
        end_value=args.lr * args.final_lr,
    )  # fmt: skip
    optimizer = nnx.Optimizer(model, optax.adam(schedule), wrt=nnx.Param)
    return model, optimizer, coll, row_opt, coll.init_optimizer(row_opt)


def make_steps(graphdef, row_opt):
    """The jitted train step (model state and row states donated) and eval forward."""

    def loss_fn(model, pooled, dense, labels):
        logits = model(dense, pooled)
        return optax.sigmoid_binary_cross_entropy(logits, labels).mean()

    @jax.jit(donate_argnums=(0, 1))
    def train_step(state, row_states, dense, ids, labels):
        model, optimizer, coll = nnx.merge(graphdef, state)
        pooled = coll(ids)
        loss, (g_model, g_pooled) = nnx.value_and_grad(loss_fn, argnums=(0, 1))(
            model, pooled, dense, labels
        )
        optimizer.update(model, g_model)
        row_states = coll.apply_gradients(row_opt, row_states, ids, g_pooled)
        return nnx.state((model, optimizer, coll)), row_states, loss

    @jax.jit
    def eval_logits(state, dense, ids):
        model, _, coll = nnx.merge(graphdef, state)
        pooled = coll(ids)
        logits = model(dense, pooled)
        return jax.sharding.reshard(logits, P())  # replicated: every process reads it

    return train_step, eval_logits


def evaluate(eval_logits, state, eval_batches: list, mesh) -> tuple[float, float]:
    """(log loss, AUC) of the model on the eval set."""
    logits, labels = [], []
    for batch in eval_batches:
        dense, ids, _ = place_batch(batch, mesh)
        logits.append(np.asarray(eval_logits(state, dense, ids), np.float64))
        labels.append(batch.labels)
    logits, labels = np.concatenate(logits), np.concatenate(labels)
    return log_loss(logits, labels), auc(logits, labels)


def evaluate_quantized(model, coll, precisions, eval_batches, mesh) -> dict:
    """Per precision, the eval (log loss, AUC) with the tables quantized row-wise
    (`coll.quantized`, a serving copy) and the tables' bytes, against the float tables'."""

    @nnx.jit
    def logits_of(model, served, dense, ids):
        return jax.sharding.reshard(model(dense, served(ids)), P())

    float_bytes = sum(s.get_value().nbytes for s in coll.stacks.values())
    out = {}
    for precision in precisions:
        served = coll.quantized(precision)
        logits, labels = [], []
        for batch in eval_batches:
            dense, ids, _ = place_batch(batch, mesh)
            logits.append(np.asarray(logits_of(model, served, dense, ids), np.float64))
            labels.append(batch.labels)
        logits, labels = np.concatenate(logits), np.concatenate(labels)
        nbytes = sum(s.get_value().nbytes for s in served.stacks.values())
        out[precision] = {
            "log_loss": log_loss(logits, labels), "auc": auc(logits, labels),
            "table_bytes": int(nbytes), "float_table_bytes": int(float_bytes),
        }  # fmt: skip
    return out


# --- checkpoints: tables and row-wise state in id order -------------------------------------


def _table_rows(coll, name: str) -> tuple[int, np.ndarray]:
    """(stack index, the stack rows of table `name`'s ids 0..V-1)."""
    p = coll.layout.placement(name)
    stack = coll.layout.stacks[p.stack]
    return p.stack, p.stack_ids(np.arange(p.vocab_size, dtype=np.int32), stack.local_rows)


def _host_gather(array: jax.Array, rows: np.ndarray) -> np.ndarray:
    """`array[rows]` as a host array (every process gets all of it).

    One gather at a time, each awaited: several in flight (as `coll.tables()` queues them,
    one all-reduce of a whole table each) can deadlock the 8 CPU devices' all-reduce
    rendezvous, which then aborts the process (see /work/notes/dlrm_report.md).
    """
    return np.asarray(array.at[rows].get(out_sharding=P(*(None,) * array.ndim)))


def export_tables(coll) -> dict[str, np.ndarray]:
    """What `coll.tables()` returns, on the host: each table `[V, d]` in id order."""
    out = {}
    for name, _ in coll.layout.placements:
        index, rows = _table_rows(coll, name)
        out[name] = _host_gather(coll.stacks[coll.layout.stacks[index].name][...], rows)
    return out


def export_row_states(coll, row_states) -> dict:
    """The row-sparse optimizer's state in id order, on the host: `{slot: {table: [V] or
    [V, d]}}` and the update `count`."""
    out: dict = {"count": np.asarray(row_states[0].count)}
    for name, _ in coll.layout.placements:
        index, rows = _table_rows(coll, name)
        for slot, array in row_states[index].slots.items():
            out.setdefault(slot, {})[name] = _host_gather(array, rows)
    return out


def import_row_states(coll, row_states, saved: dict) -> dict:
    """Row states in `coll`'s layout from `export_row_states`' id-ordered arrays."""
    new = {}
    for s in coll.layout.stacks:
        state = row_states[s.index]
        slots = {}
        for slot, old in state.slots.items():
            array = jnp.zeros(old.shape, old.dtype)
            for name in s.tables:
                _, rows = _table_rows(coll, name)
                array = array.at[rows].set(jnp.asarray(saved[slot][name], old.dtype))
            slots[slot] = jax.device_put(array, old.sharding)
        count = jax.device_put(jnp.asarray(saved["count"], state.count.dtype), state.count.sharding)
        new[s.index] = state._replace(count=count, slots=slots)
    return new


def checkpoint_state(model, optimizer, coll, row_states) -> dict:
    """Everything a run needs to continue, none of it in a layout-dependent form."""
    return {
        "dense": nnx.to_pure_dict(nnx.state(model, nnx.Param)),
        "adam": nnx.to_pure_dict(nnx.state(optimizer)),
        "tables": export_tables(coll),
        "row_states": export_row_states(coll, row_states),
    }


def checkpoint_manager(directory: str) -> ocp.CheckpointManager:
    """Synchronous saves: checkpoint s is complete on disk before step s + 1 runs. The
    handler is named so that a checkpoint's metadata (its arrays' shapes) reads back."""
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    return ocp.CheckpointManager(
        os.path.abspath(directory), options=options, item_handlers=ocp.StandardCheckpointHandler()
    )


def save(manager, step: int, model, optimizer, coll, row_states) -> None:
    state = checkpoint_state(model, optimizer, coll, row_states)
    manager.save(step, args=ocp.args.StandardSave(state), force=True)


def _shapes(tree: dict) -> dict[str, tuple[int, ...]]:
    """`{"tables/C1": (rows, dim), ...}`: every array's shape, by its path in the tree."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        jax.tree_util.keystr(path, simple=True, separator="/"): tuple(getattr(a, "shape", ()))
        for path, a in leaves
    }


def check_resume(manager, step: int, target: dict, args: argparse.Namespace) -> None:
    """The checkpoint must hold the arrays this run builds, of the same shapes: a run with
    another `--dim`, `--scale` or `--features` than the one that wrote it stops here with the
    checkpoint's tables beside the requested ones (not with orbax's shape error). The mesh
    and `--placement` may change: the checkpoint is layout-free."""
    metadata = manager.item_metadata(step)
    saved = _shapes(metadata.tree if metadata is not None else {})
    want = _shapes(target)
    tables = {k[len("tables/") :]: v for k, v in saved.items() if k.startswith("tables/")}
    asked = {k[len("tables/") :]: v for k, v in want.items() if k.startswith("tables/")}
    if tables == asked and all(saved[k] == want[k] for k in saved.keys() & want.keys()):
        return
    problems, redo = [], []
    if sorted(tables) != sorted(asked):
        problems.append(
            f"it holds {len(tables)} tables {_names(tables)}, this run {len(asked)} "
            f"{_names(asked)} (--features {args.features})"
        )
        redo.append(f"--features that reads {len(tables)} tables")
    dims = sorted({s[1] for s in tables.values() if len(s) == 2})
    if dims and dims != [args.dim]:
        problems.append(f"its tables have dim {', '.join(map(str, dims))}, this run asks for "
                        f"--dim {args.dim}")  # fmt: skip
        redo.append(f"--dim {dims[0]}" if len(dims) == 1 else "its --dim")
    rows = [(t, tables[t][0], asked[t][0]) for t in sorted(tables.keys() & asked.keys())
            if tables[t][:1] != asked[t][:1]]  # fmt: skip
    if rows:
        shown = ", ".join(f"{t} {a} vs {b}" for t, a, b in rows[:3]) + ", ..." * (len(rows) > 3)
        problems.append(f"its tables have other sizes (rows in the checkpoint vs this run: "
                        f"{shown}; --scale {args.scale:g})")  # fmt: skip
        redo.append("its --scale")
    if not problems:  # the tables fit: the dense model's shapes follow --dim and --features
        diff = sorted((k for k in saved.keys() & want.keys() if saved[k] != want[k]),
                      key=lambda k: (not k.startswith("dense/"), k))  # fmt: skip
        shown = ", ".join(f"{k} {list(saved[k])} vs {list(want[k])}" for k in diff[:2])
        problems.append(f"its dense model has other shapes (checkpoint vs this run: {shown}; "
                        f"this run has --features {args.features})")  # fmt: skip
        redo.append("its --features")
    raise SystemExit(
        f"--resume: the checkpoint of step {step} in {args.checkpoint_dir} was written by a run "
        f"of other shapes: {'; '.join(problems)}. Resume with the flags that wrote it "
        f"({', '.join(redo)}; the mesh and --placement may change), or start a new "
        "--checkpoint-dir"
    )


def _names(tables) -> str:
    names = sorted(tables, key=lambda n: (len(n), n))
    return "[" + ", ".join(names[:4]) + (", ..." if len(names) > 4 else "") + "]"


def restore(manager, step: int, model, optimizer, coll, row_states, args) -> dict:
    """Restores `step` into the freshly built objects (any mesh, any placement); returns the
    row states in `coll`'s layout. Dense arrays are read straight into their layouts, the
    id-ordered ones to the host. A checkpoint of other shapes (another `--dim`, `--scale` or
    `--features`) is refused first (`check_resume`)."""
    target = {
        "dense": nnx.to_pure_dict(nnx.state(model, nnx.Param)),
        "adam": nnx.to_pure_dict(nnx.state(optimizer)),
    }
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                          target)  # fmt: skip
    target["tables"] = {
        t.name: np.zeros((t.vocab_size, t.dim), t.dtype) for t in coll.layout.tables
    }
    target["row_states"] = {"count": np.zeros((), np.int32)}
    for name, p in coll.layout.placements:
        for slot, a in row_states[p.stack].slots.items():
            target["row_states"].setdefault(slot, {})[name] = np.zeros(
                (p.vocab_size, *a.shape[1:]), a.dtype
            )
    check_resume(manager, step, target, args)
    restored = manager.restore(step, args=ocp.args.StandardRestore(target))
    for obj, key in ((model, "dense"), (optimizer, "adam")):
        state = nnx.state(obj, nnx.Param) if key == "dense" else nnx.state(obj)
        nnx.replace_by_pure_dict(state, restored[key])
        nnx.update(obj, state)
    coll.load_tables(restored["tables"])
    return import_row_states(coll, row_states, restored["row_states"])


# --- training -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    """Trains (or resumes); returns the metrics it also writes to `--metrics-out`."""
    args = parse_args(argv)
    mesh = make_mesh(args.mesh)
    if args.batch % mesh.size:
        raise SystemExit(f"--batch {args.batch} must be a multiple of the {mesh.size} devices")
    data = ClickModel(args.scale, args.seed, num_features=args.features)
    eval_batch = min(4096, args.eval_size)
    eval_batches = data.eval_set(args.eval_size, eval_batch - eval_batch % mesh.size)
    eval_true = np.concatenate([b.logits for b in eval_batches])
    eval_labels = np.concatenate([b.labels for b in eval_batches])
    bayes = {"log_loss": log_loss(eval_true, eval_labels), "auc": auc(eval_true, eval_labels)}
    manager = checkpoint_manager(args.checkpoint_dir) if args.checkpoint_dir else None
    losses: dict[int, float] = {}
    evals: dict[int, dict] = {}
    with jax.set_mesh(mesh):
        model, optimizer, coll, row_opt, row_states = build(args, data, mesh)
        start = 0
        if args.resume:
            start = manager.latest_step()
            if start is None:
                raise SystemExit(f"--resume: no checkpoint in {args.checkpoint_dir}")
            row_states = restore(manager, start, model, optimizer, coll, row_states, args)
        graphdef, state = nnx.split((model, optimizer, coll))
        train_step, eval_logits = make_steps(graphdef, row_opt)
        end = min(args.steps, args.stop_after or args.steps)
        quiet = args.no_progress or jax.process_index() != 0
        t0 = time.perf_counter()
        train_seconds = 0.0  # the steps after the first (which compiles), without evals
        with progress(quiet, end - start) as advance:
            for step in range(start + 1, end + 1):  # step s trains on batch s
                t = time.perf_counter()
                dense, ids, labels = place_batch(data.batch(step, args.batch), mesh)
                state, row_states, loss = train_step(state, row_states, dense, ids, labels)
                losses[step] = float(loss)
                train_seconds += (time.perf_counter() - t) * (step > start + 1)
                if step % args.eval_every == 0 or step == end:
                    ll, a = evaluate(eval_logits, state, eval_batches, mesh)
                    evals[step] = {"log_loss": ll, "auc": a}
                advance(step, losses[step], evals)
                if manager is not None and (step % args.checkpoint_every == 0 or step == end):
                    nnx.update((model, optimizer, coll), state)
                    save(manager, step, model, optimizer, coll, row_states)
        seconds = time.perf_counter() - t0
        if manager is not None:
            manager.wait_until_finished()
        nnx.update((model, optimizer, coll), state)
        tables = export_tables(coll)
        precisions = [p for p in args.quantized.split(",") if p]
        quantized = evaluate_quantized(model, coll, precisions, eval_batches, mesh)
    timed = max(len(losses) - 1, 0)
    metrics = {
        "mesh": dict(mesh.shape), "processes": jax.process_count(), "first_step": start + 1,
        "placements": {t: p.placement for t, p in coll.layout.placements},
        "planned": None if coll.plan is None else coll.plan.placements,
        "stacks": [s.name for s in coll.layout.stacks], "bayes": bayes,
        "losses": {str(k): v for k, v in losses.items()},
        "evals": {str(k): v for k, v in evals.items()}, "seconds": seconds,
        "steps_per_second": timed / train_seconds if timed else None,
        "quantized": quantized,
    }  # fmt: skip
    if evals:
        last = evals[max(evals)]
        print(
            f"steps {start + 1}-{end} on mesh {dict(mesh.shape)} in {seconds:.1f} s "
            f"({metrics['steps_per_second'] or 0:.1f} steps/s after the first, evals aside); "
            f"eval on {eval_labels.size} examples: log loss {last['log_loss']:.4f} (Bayes "
            f"{bayes['log_loss']:.4f}), AUC {last['auc']:.4f} (Bayes {bayes['auc']:.4f}, gap "
            f"{bayes['auc'] - last['auc']:.4f})"
        )
        for precision, q in quantized.items():
            print(
                f"  tables {precision}: AUC {q['auc']:.4f} ({last['auc'] - q['auc']:+.5f} lost "
                f"against float), log loss {q['log_loss']:.4f}; table bytes {q['table_bytes']:,} "
                f"({q['float_table_bytes'] / q['table_bytes']:.2f}x smaller)"
            )
    if jax.process_index() == 0:
        if args.metrics_out:
            with open(args.metrics_out, "w") as f:
                json.dump(metrics, f, indent=1)
        if args.tables_out:
            np.savez(args.tables_out, **tables)
    return metrics


@contextlib.contextmanager
def progress(off: bool, total: int):
    """Yields `advance(step, loss, evals)`: a rich progress bar with the loss and the last
    eval's AUC (or nothing, when `off`)."""
    if off:
        yield lambda step, loss, evals: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    columns = (BarColumn(), MofNCompleteColumn(), "{task.fields[info]}", TimeRemainingColumn())
    with Progress("train", *columns) as bar:
        task = bar.add_task("train", total=total, info="")

        def advance(step: int, loss: float, evals: dict) -> None:
            last = f"  eval AUC {evals[max(evals)]['auc']:.4f}" if evals else ""
            bar.update(task, advance=1, info=f"step {step} loss {loss:.4f}{last}")

        yield advance


if __name__ == "__main__":
    main(sys.argv[1:])
