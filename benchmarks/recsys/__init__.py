"""`jaxembed bench recsys`: the recommender step against XLA, Flax, keras-rs and TorchRec
(`bench` drives, `worker` measures the JAX side, the runners the others)."""
