"""Train a small ResNet with ``pipe``: skip connections, deferred BatchNorm, automatic balance.

The network is a flat ``nn.Sequential`` (stem, six residual blocks, head), so
``Pipe`` may cut it anywhere, also inside a residual block. Each block's
shortcut is a pair of ``@skippable`` layers: ``Identity`` stashes the block's
input and ``Shortcut`` pops it and adds it back, so the shortcut tensor goes
straight from the partition that stashes it to the one that pops it. Every
block is put in its own ``Namespace`` because all blocks use the same skip
name. ``deferred_batch_norm=True`` updates BatchNorm's running statistics once
per mini-batch, as the plain model would, and ``balance_by_time`` measures the
layers to decide how many go to each partition.

The data is synthetic and needs no download: 16x16 RGB images of noisy
stripes, whose class is their orientation (4 classes); the test accuracy
climbs from chance (25%) to well above 90%.

Run it (one to two minutes on 2 otherwise idle CPU cores)::

    python examples/resnet_skip.py
    python examples/resnet_skip.py --partitions 3 --chunks 8 --checkpoint always
    python examples/resnet_skip.py --steps 3 --batch 16 --profile-seconds 0.1   # smoke test

The last line printed is a summary: the balance, first and last training
loss, test accuracy and wall time.
"""
from __future__ import annotations

import argparse
import logging
import math
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from pipe import Pipe
from pipe.balance import balance_by_time
from pipe.skip import Namespace, pop, skippable, stash

log = logging.getLogger("resnet_skip")

CLASSES = 4  # stripe orientations: 0, 45, 90, 135 degrees


# --------------------------------------------------------------------------
# Data: noisy oriented stripes.
# --------------------------------------------------------------------------

def stripes(n: int, generator: torch.Generator, size: int = 16) -> tuple[Tensor, Tensor]:
    """``n`` images (n, 3, size, size) and their classes (n,)."""
    labels = torch.randint(CLASSES, (n,), generator=generator)
    angle = labels.float() * math.pi / CLASSES
    freq = 0.6 + 0.6 * torch.rand(n, generator=generator)            # stripe frequency varies
    phase = 2 * math.pi * torch.rand(n, generator=generator)
    coords = torch.arange(size).float()
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")            # (size, size)
    proj = xx * torch.cos(angle)[:, None, None] + yy * torch.sin(angle)[:, None, None]
    wave = torch.sin(freq[:, None, None] * proj + phase[:, None, None])  # (n, size, size)
    colour = torch.rand(n, 3, 1, 1, generator=generator) + 0.5
    images = wave[:, None] * colour + 0.8 * torch.randn(n, 3, size, size, generator=generator)
    return images, labels


# --------------------------------------------------------------------------
# Model: a ResNet as a flat nn.Sequential; shortcuts are skips.
# --------------------------------------------------------------------------

@skippable(stash=["identity"])
class Identity(nn.Module):
    """Start of a residual block: stashes its input for the shortcut."""

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield stash("identity", x)
        return x


@skippable(pop=["identity"])
class Shortcut(nn.Module):
    """End of a residual block: relu(x + shortcut), projecting the shortcut when the shape changes."""

    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.project: nn.Module = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.project = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride=stride, bias=False), nn.BatchNorm2d(channels_out))

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        identity = yield pop("identity")
        return F.relu(x + self.project(identity))


def residual_block(channels_in: int, channels_out: int, stride: int) -> list[nn.Module]:
    """Seven layers; the first and the last share a namespace of their own."""
    ns = Namespace()
    return [
        Identity().isolate(ns),
        nn.Conv2d(channels_in, channels_out, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(channels_out),
        nn.ReLU(),
        nn.Conv2d(channels_out, channels_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(channels_out),
        Shortcut(channels_in, channels_out, stride).isolate(ns),
    ]


def resnet(widths: tuple[int, ...] = (16, 32, 64), blocks: int = 2) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()]
    channels = widths[0]
    for stage, width in enumerate(widths):
        for block in range(blocks):
            stride = 2 if stage > 0 and block == 0 else 1
            layers += residual_block(channels, width, stride)
            channels = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, CLASSES)]
    return nn.Sequential(*layers)


# --------------------------------------------------------------------------
# Training.
# --------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=80, help="training steps")
    parser.add_argument("--batch", type=int, default=64, help="mini-batch size")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per mini-batch")
    parser.add_argument("--partitions", type=int, default=2, help="pipeline partitions (all on the CPU)")
    parser.add_argument("--checkpoint", default="except_last", choices=["always", "except_last", "never"])
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--profile-seconds", type=float, default=1.0, help="time budget of balance_by_time")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)

    model = resnet()
    sample, _ = stripes(args.batch // args.chunks or 1, generator)
    # Profile one micro-batch's forward and backward per layer; nothing in `model` changes.
    balance = balance_by_time(args.partitions, model, sample, timeout=args.profile_seconds, device="cpu")
    log.info("%d layers, balance by time: %s", len(model), balance)
    pipe = Pipe(model, chunks=args.chunks, checkpoint=args.checkpoint, balance=balance,
                devices=["cpu"] * args.partitions, deferred_batch_norm=True)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=max(args.steps, 1))

    started = time.perf_counter()
    losses: list[float] = []
    pipe.train()
    for _ in (bar := tqdm(range(args.steps), desc="train", unit="step")):
        images, labels = stripes(args.batch, generator)
        loss = F.cross_entropy(pipe(images), labels)   # output on pipe.devices[-1]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.3f}")

    pipe.eval()  # BatchNorm now uses the running statistics Pipe kept per mini-batch
    correct = total = 0
    with torch.no_grad():
        for _ in range(8):
            images, labels = stripes(128, generator)
            correct += int((pipe(images).argmax(1) == labels).sum())
            total += labels.numel()
    pipe.close()
    first = sum(losses[:10]) / max(len(losses[:10]), 1)
    last = sum(losses[-10:]) / max(len(losses[-10:]), 1)
    print(f"balance {balance} | train loss {first:.3f} -> {last:.3f} | test accuracy {correct / total:.1%} "
          f"| {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
