"""`jaxembed bench planner`: the collection planner's layout against uniform placements on the
DLRM workload, modelled against measured (`bench` drives, `worker` measures)."""
