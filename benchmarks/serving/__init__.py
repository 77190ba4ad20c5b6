"""`python -m benchmarks.serving.latency`: an exported DLRM-like ranker's latency after it is
loaded in a fresh process without jaxembed, at several batch sizes, float against int8 and
int4 tables (`latency`)."""
