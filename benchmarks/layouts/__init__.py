"""`jaxembed bench` / `python -m benchmarks layouts`: the lookup on every layout against `jnp.take`,
Flax's `Embed` and a one-hot matmul, with vocabulary, device and batch sweeps (`bench`)."""
