"""The thread runner behind :class:`pipe.Pipe`: one worker thread per partition in one process.

``pipeline`` runs a schedule's clock cycles over the workers (``worker``);
``worker_backward`` lets CPU partitions run their backward on their own
workers, which PyTorch's autograd engine would run on the caller's thread;
``backward_pass`` keeps the books of one such backward.
The process runner is :mod:`pipe.distributed`.
"""
