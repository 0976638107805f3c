"""Regressions, each with the cause it guards against."""
import subprocess
import sys
import textwrap


def test_exit_without_close_does_not_abort():
    """Cause: worker threads still alive at interpreter exit made the process
    abort with 'terminate called without an active exception' (SIGABRT); the
    workers' finalizer now joins them."""
    code = textwrap.dedent(
        """
        import torch
        from torch import nn
        from pipe import Pipe
        model = Pipe(nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64)), chunks=4,
                     checkpoint="always", balance=[2, 1], devices=["cpu", "cpu"])
        model(torch.randn(32, 64)).sum().backward()
        """
    )
    for _ in range(3):
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        assert "terminate called" not in result.stderr
