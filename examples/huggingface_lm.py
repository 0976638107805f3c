"""Pipeline a HuggingFace causal LM with ``pipe.split`` + ``Pipe``: no adapter layers, tied embeddings kept.

A GPT-2 (or, with ``--arch llama``, a LLaMA) built from a small config with
random weights (nothing is downloaded) is cut in two where its middle block
begins: ``pipe.split`` captures the model with ``torch.export`` and hands
``Pipe`` two stages that pass the hidden states and the attention mask on.
The input embedding and the LM head stay one tied weight across the cut. The
text is Python's own interactive help (``pydoc_data.topics``) as characters,
in padded batches of sentences of different lengths with an attention mask;
the loss ignores the padding.

Run it (about 2 minutes on 2 busy CPU cores; the loss falls from ~4.6, a
uniform guess over the characters, to ~2.5 in 300 steps)::

    pip install transformers            # or: pip install -e ".[test]"
    python examples/huggingface_lm.py
    python examples/huggingface_lm.py --arch llama --chunks 8 --checkpoint always
    python examples/huggingface_lm.py --steps 3 --layers 2 --width 32   # smoke test

The last line printed is a summary: first and last training loss, whether the
pipelined model's state dict loads into the original model class, wall time.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

import pipe
from pipe import Pipe

log = logging.getLogger("huggingface_lm")


class Sentences:
    """Lines of ``pydoc``'s help topics as character ids: variable lengths, so batches need padding."""

    def __init__(self, seq_len: int, seed: int) -> None:
        from pydoc_data.topics import topics

        text = "\n".join(topics[name] for name in sorted(topics))
        chars = sorted(set(text))
        self.pad = 0  # id 0 is padding; characters are 1..len(chars)
        self.vocab_size = len(chars) + 1
        stoi = {c: i + 1 for i, c in enumerate(chars)}
        lines = [line.strip() for line in text.splitlines() if len(line.strip()) >= 8]
        self.lines = [torch.tensor([stoi[c] for c in line[:seq_len]]) for line in lines]
        self.seq_len = seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ids, mask, labels)``: [B, T] each; right padding, labels -100 on padding."""
        picks = torch.randint(len(self.lines), (size,), generator=self.generator)
        ids = torch.full((size, self.seq_len), self.pad, dtype=torch.long)
        mask = torch.zeros(size, self.seq_len, dtype=torch.long)
        for row, pick in enumerate(picks.tolist()):
            line = self.lines[pick]
            ids[row, :len(line)] = line
            mask[row, :len(line)] = 1
        return ids, mask, ids.masked_fill(mask == 0, -100)


def build_model(arch: str, vocab_size: int, layers: int, width: int, seq_len: int) -> tuple[nn.Module, str]:
    """A random-init causal LM with tied input/output embeddings, and where its second half begins."""
    if arch == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=vocab_size, n_positions=seq_len, n_embd=width, n_layer=layers, n_head=4,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(config), f"transformer.h.{layers // 2}"
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=width, intermediate_size=4 * width,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=seq_len, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)
    return LlamaForCausalLM(config), f"model.layers.{layers // 2}"


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy over the real (non-padding) tokens. logits [B, T, V], labels [B, T]."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2", help="model family (default: %(default)s)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=16, help="sentences per step, split into --chunks micro-batches")
    p.add_argument("--seq-len", type=int, default=64, help="characters per sentence (longer ones are cut)")
    p.add_argument("--chunks", type=int, default=4, help="micro-batches per mini-batch")
    p.add_argument("--checkpoint", choices=["always", "except_last", "never"], default="except_last")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (cut in the middle)")
    p.add_argument("--width", type=int, default=64, help="hidden size")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate of AdamW")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50, help="print the loss every N steps")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(args.seed)
    data = Sentences(args.seq_len, args.seed)
    model, cut = build_model(args.arch, data.vocab_size, args.layers, args.width, args.seq_len)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied

    # Capture once with an example batch (its sizes are only examples: batch and length are dynamic).
    ids, mask, _ = data.batch(args.batch_size)
    stages = pipe.split(model, (ids,), {"attention_mask": mask, "use_cache": False}, at=[cut])
    piped = Pipe(stages, chunks=args.chunks, checkpoint=args.checkpoint, balance=[1, 1], devices=["cpu", "cpu"])
    optimizer = torch.optim.AdamW(piped.parameters(), lr=args.lr)  # the model's own parameters, tied once
    print(f"{args.arch}: {sum(p.numel() for p in piped.parameters()):,} parameters, cut at {cut!r} into 2 "
          f"partitions, chunks {args.chunks}, checkpoint {args.checkpoint!r}")

    start = time.perf_counter()
    losses: list[float] = []
    for step in range(args.steps):
        ids, mask, labels = data.batch(args.batch_size)
        logits = piped(ids, mask)  # [B, T, V]: model(ids, attention_mask=mask).logits
        loss = lm_loss(logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if args.log_every and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step}: loss {losses[-1]:.3f}")

    # The pipelined model's checkpoint is the original model's: it loads into a fresh one unchanged.
    fresh, _ = build_model(args.arch, data.vocab_size, args.layers, args.width, args.seq_len)
    fresh.load_state_dict(piped.state_dict())
    ids, mask, labels = data.batch(args.batch_size)
    with torch.no_grad():
        same = torch.allclose(lm_loss(fresh(ids, attention_mask=mask).logits, labels), lm_loss(piped(ids, mask), labels))
    piped.close()
    first, last = sum(losses[:10]) / len(losses[:10]), sum(losses[-10:]) / len(losses[-10:])
    print(f"done: {args.steps} steps, loss {first:.3f} -> {last:.3f} (first/last 10 steps), checkpoint loads into "
          f"{type(fresh).__name__}: {'yes' if same else 'NO'}, {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
