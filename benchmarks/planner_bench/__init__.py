"""The planner benchmark's subcommands (run them with ``python benchmarks/planner.py COMMAND``).

``budget`` (predicted against measured steps and peaks, chosen against the fastest fitting plan),
``split`` (pp x dp_replicate x dp_shard), ``threads`` (``Pipe``'s planner), ``fidelity`` (the layer
profile against a stage's own time), ``machine`` (this machine's speeds) and ``repeatability`` (one plan's
step across committed runs). ``budget`` also holds the models the others share.
"""
