"""Dynamic tables' benchmarks.

* `python -m benchmarks.dynamic.throughput` (`jaxembed bench dynamic-throughput`): the remap
  step (lookup, admission, insertion and eviction) in ids per second on one CPU device, native
  against XLA, for the `lru`, `lfu` and `ttl` policies on a Zipf stream whose vocabulary turns
  over each "day";
* `python -m benchmarks.dynamic.auc` (`jaxembed bench dynamic-auc`): the drifting-stream
  example (`examples/train_dynamic.py`) with a dynamic table, the hashing trick and an
  unbounded table at equal rows, AUC by day against the stream's Bayes AUC.
"""
