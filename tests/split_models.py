"""Models for the ``pipe.split`` and tied-weight tests, and the plain-model oracle they are checked against.

Small on purpose (seconds per test on two cores): a tied-embedding LM written
here, HuggingFace GPT-2 and LLaMA built from tiny configs (random init, no
downloads), and a torchvision-style CNN with in-place ReLUs and BatchNorm.
The CNN is written here because torchvision's wheels pin their own torch
build: installing torchvision would replace the CPU build of torch 2.13 the
project tests against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from helpers import assert_same_grads

VOCAB = 64


class TinyLM(nn.Module):
    """Embedding + positions -> blocks (masked mean-mixing) -> norm -> head tied to the embedding."""

    def __init__(self, width: int = 16, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.positions = nn.Embedding(32, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        x = self.embed(ids) + self.positions(torch.arange(ids.size(1), device=ids.device))
        keep = mask.unsqueeze(-1).to(x.dtype)
        for block in self.blocks:
            context = (x * keep).cumsum(1) / keep.cumsum(1).clamp(min=1)  # causal masked mean
            x = x + torch.tanh(block(context))
        return self.head(self.norm(x))


class Head(nn.Module):
    """The output projection, using the embedding's weight (a tied LM head)."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.weight = embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


def tied_model() -> nn.Sequential:
    torch.manual_seed(0)
    embedding = nn.Embedding(VOCAB, 8)
    return nn.Sequential(embedding, nn.Linear(8, 8), nn.Tanh(), nn.LayerNorm(8), Head(embedding))


def gpt2(layers: int = 2, width: int = 32) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=width, n_head=2, vocab_size=VOCAB, n_positions=32,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def llama(layers: int = 2, width: int = 32) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                         max_position_embeddings=64, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)
    return LlamaForCausalLM(config)


class Bottleneck(nn.Module):
    """A ResNet bottleneck as torchvision writes it: in-place ReLUs, BatchNorm, an identity add."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


class SmallResNet(nn.Module):
    def __init__(self, channels: int = 8, classes: int = 5) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = Bottleneck(channels)
        self.layer2 = Bottleneck(channels)
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def lm_batch(size: int = 4, length: int = 8, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """``(ids, mask, labels)``: right-padded rows of different lengths; labels ignore padding (-100)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (size, length), generator=generator)
    lengths = torch.randint(length // 2, length + 1, (size,), generator=generator)
    lengths[0] = length
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).long()
    ids = ids * mask  # pad id 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def lm_loss(logits: Tensor, labels: Tensor, tokens: int | None = None) -> Tensor:
    """Next-token cross entropy; averaged over the predicted tokens, or summed and divided by ``tokens``."""
    flat_logits = logits[:, :-1].reshape(-1, logits.size(-1))
    flat_labels = labels[:, 1:].reshape(-1)
    if tokens is None:
        return F.cross_entropy(flat_logits, flat_labels, ignore_index=-100)
    return F.cross_entropy(flat_logits, flat_labels, ignore_index=-100, reduction="sum") / tokens


def predicted_tokens(labels: Tensor) -> int:
    return int((labels[:, 1:] != -100).sum())


def assert_same_lm_step(piped: nn.Module, model: nn.Module, reference: nn.Module, ids: Tensor, mask: Tensor,
                        labels: Tensor) -> None:
    """One forward and backward of ``piped`` (over ``model``'s parameters) and of the plain ``reference`` on a
    padded batch: the same loss, and the same gradients within 1e-5."""
    loss = lm_loss(piped(ids, mask), labels)
    expected = lm_loss(reference(ids, attention_mask=mask).logits, labels)
    torch.testing.assert_close(loss, expected)
    loss.backward()
    expected.backward()
    assert_same_grads(model, reference, atol=1e-5, rtol=1e-4)


def assert_same_state(model: nn.Module, reference: nn.Module, atol: float = 1e-6, rtol: float = 1e-5) -> None:
    expected = reference.state_dict()
    got = model.state_dict()
    assert list(got) == list(expected)
    for name, value in got.items():
        torch.testing.assert_close(value, expected[name], atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")
