"""Quick start: pipeline a small MLP over two CPU partitions and check it is transparent.

Run it (a second or two)::

    python examples/quickstart.py
"""

import copy

import torch
from torch import nn

from pipe import Pipe

torch.manual_seed(0)
mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 4))
plain = copy.deepcopy(mlp)  # the oracle: the same weights, run without pipe

# Layers 0-1 on the first partition, 2-3 on the second; each batch is split into 4 micro-batches.
model = Pipe(mlp, chunks=4, checkpoint="except_last", balance=[2, 2], devices=["cpu", "cpu"])
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

x, target = torch.randn(32, 16), torch.randn(32, 4)  # [B, 16], [B, 4]
out = model(x.to(model.devices[0]))  # [B, 4] on model.devices[-1]
loss = nn.functional.mse_loss(out, target.to(model.devices[-1]))
loss.backward()

expected = plain(x)
nn.functional.mse_loss(expected, target).backward()
torch.testing.assert_close(out, expected)
for p, q in zip(model.parameters(), plain.parameters()):
    torch.testing.assert_close(p.grad, q.grad)
optimizer.step()

print(f"quickstart: outputs and gradients match the plain model (loss {loss.item():.4f}, balance {model.balance})")
