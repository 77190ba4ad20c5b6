"""Kernels: the `shard_map` bodies that execute a plan, and their shard-local work.

* `jaxembed.kernels.lookup`: `embedding` (forward and gradient);
* `jaxembed.kernels.reshard`: the plan's moves of small operands, inside a body;
* `jaxembed.kernels.local`: shard-local gather / pool / scatter (the XLA reference of the
  native kernels);
* `jaxembed.kernels.arrays`: where arrays are laid out, and what is assumed when unseen.
"""
