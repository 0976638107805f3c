"""What both runners share: the pieces of one pipeline step that do not depend on threads or processes.

``schedule`` (the order of work, as data, no torch), ``microbatch``
(splitting and gathering), ``checkpoint`` (the cell: run, checkpoint,
recompute), ``rng`` (random-number replay), ``partition`` (balance and
placement), ``phony``/``dependency`` (autograd edges without data),
``stream``/``copy`` (devices and the copies between them), ``options``
(the front ends' argument checks), ``sequential`` (the calling convention,
``PipeSequential``), ``tying`` (parameters tied across partitions),
``iw_backward`` (the I/W backward of zero-bubble schedules), ``message`` (the
transport's header size, which the planner counts) and ``deprecation`` (old
names kept for one release).
"""
