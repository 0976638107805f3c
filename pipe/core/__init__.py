"""What both runners share: the pieces of one pipeline step that do not depend on threads or processes.

``schedule`` (the order of work, as data, no torch), ``microbatch``
(splitting and gathering), ``checkpoint`` (the cell: run, checkpoint,
recompute), ``rng`` (random-number replay), ``partition`` (balance and
placement), ``phony``/``dependency`` (autograd edges without data),
``stream``/``copy`` (devices and the copies between them) and ``options``
(the front ends' argument checks).
"""
