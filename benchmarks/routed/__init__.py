"""`jaxembed bench routed`: the routed exchange against the gather path, Zipf sweeps and the
exchange choice over the batch (`bench`)."""
