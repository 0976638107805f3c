"""Fine-tune a HuggingFace causal LM on a text file, as a pipeline on any (pp, dp_shard, dp_replicate, tp) mesh.

The road a pretrained model travels through pipe, with no process ever holding
the whole model:

1. every rank builds the model from its ``config.json`` on ``torch.device("meta")``
   (no memory), cuts it into ``--pp`` stages with ``pipe.split``, and
   ``DistributedPipe(..., init_weights=False)`` shards it on ``meta`` and allocates
   only the rank's shards of its own stage, in fp32 or, with
   ``--dtype bf16``, in bf16 (sharded: fp32 parameters, FSDP's bf16 compute);
2. ``pipe.distributed.hf.load`` reads the rank's tensors (its stage's, and under
   FSDP only its shard of them) from the directory's safetensors (a resumed run
   reads them from its checkpoint instead, once);
3. training: AdamW with a linear LR warmup then a cosine decay
   (``--warmup``, ``--lr``, ``--min-lr``), a tqdm bar on rank 0, each step's
   figures in ``OUT/metrics.jsonl`` (and TensorBoard when it is installed),
   ``eval_step`` on held-out text, DCP checkpoints (``pipe.distributed.state``)
   in ``OUT/checkpoints/step-<8 digits>`` every ``--save-every`` steps, the last
   ``--keep`` kept, that ``--resume auto`` (or a path) continues from, at the same
   or another layout, the LR schedule where it was; with ``--async-save`` written
   in the background while training goes on (``state.save(asynchronous=True)``);
   ``--accumulate K``: K forward/backward passes per optimizer step, the
   gradients those of the mean over all of them (``DistributedPipe.step(..., accumulate=True)``);
4. ``pipe.distributed.hf.save`` writes a HuggingFace directory (safetensors
   shards, their index and the config) from every rank at once, which
   ``AutoModelForCausalLM.from_pretrained`` loads; ``loss.png`` beside it.

The flags can come from a YAML file (``--config-file run.yaml``, keys the
flags' names); flags on the command line override it, and the effective
configuration is written to ``OUT/config.yaml``, which ``--config-file``
takes back.

Without ``--model``, ``--config`` (a ``config.json`` or a directory holding
one) gives a random start, initialised by the model's own initialiser.

The text is tokenized with the model directory's tokenizer if it has one, else
as bytes (the vocabulary must then hold 256 ids). ``--data`` is a text file
(tokenized at the start of each run, batches drawn at random from
``(--seed, step)``) or a token file that ``prepare`` wrote once: a flat array
of token ids (uint16, or uint32 beyond 65536 ids) memory-mapped by every rank,
read in order (each data-parallel rank reads only its own rows of a batch),
the number of sequences read saved in each checkpoint (``data_position``), so
that a resumed run reads the next batch, not the first; its JSON header
(``tokens.bin.json``: vocabulary size, dtype, count, tokenizer) must name the
model's vocabulary size. Run it (2 ranks, the model directory and text files
local; nothing is downloaded)::

    python examples/finetune_hf.py prepare --model ./my-llama --text a.txt b.txt --out tokens.bin
    bash launch/single_node.sh examples/finetune_hf.py --model ./my-llama --data tokens.bin --out ./run
    NPROC=4 bash launch/single_node.sh examples/finetune_hf.py --config-file ./run/config.yaml \\
        --pp 2 --dp-shard 2 --steps 200 --resume auto
    python -c "from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained('./run/hf')"

Tensor parallelism (``tp``) is not offered here: ``pipe.split`` stages are
graphs that apply their weights directly, which torch's tensor-parallel styles
cannot split (docs/parallelism.md); models written as ``nn.Sequential`` of
modules take ``tensor_parallel=`` (``examples/parallelism.py``).

The last line printed (by rank 0) is a summary: first and last training loss,
the validation loss before and after, and where the export went.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch import nn
from tqdm import tqdm

import pipe
import pipe.distributed as pd
import pipe.plan
import pipe.trace
from pipe.distributed import hf, state

log = logging.getLogger("finetune_hf")


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy: position t predicts token t + 1. logits [B, T, V], ids [B, T]."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), ids[:, 1:].reshape(-1))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config-file", type=Path, help="a YAML file of flags (keys: the flags' names); flags given here "
                   "override it")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", type=Path, help="a local HuggingFace model directory (config.json + safetensors)")
    source.add_argument("--config", type=Path, help="a config.json (or a directory with one): a random start")
    p.add_argument("--data", type=Path, help="a local text file, or a token file written by 'prepare' (read in "
                   "order, the position saved in the checkpoints); its last 10%% is held out")
    p.add_argument("--out", type=Path, help="folder for checkpoints/, hf/, metrics.jsonl, config.yaml and loss.png")
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks (default: %(default)s)")
    p.add_argument("--dp-shard", type=int, default=1, help="FSDP2 shards of each stage")
    p.add_argument("--dp-replicate", type=int, default=1, help="replicas of the pipeline")
    p.add_argument("--fsdp-unit", default=None, choices=["stage", "layer"],
                   help="with --dp-shard > 1, what FSDP2 gathers at a time: each decoder layer around its forward "
                        "and backward (least memory; the default, but with --schedule zbv) or a stage whole (least "
                        "traffic)")
    p.add_argument("--keep-gathered", action="store_true",
                   help="with --fsdp-unit layer: keep each layer gathered from its first backward to the step's "
                        "reduce, as torch's PipelineStage does (fewer gathers, more memory)")
    p.add_argument("--no-prefetch", action="store_true",
                   help="with --fsdp-unit layer: gather each layer only when it runs, none beside it (least memory; "
                        "the gathers no longer overlap the compute before them)")
    p.add_argument("--peak-tflops", type=float, default=0.0,
                   help="the peak TFLOP/s of one device (rank), for the MFU in the metrics; 0: no MFU (default)")
    p.add_argument("--trace-every", type=int, default=0,
                   help="record every N-th step with pipe.trace (OUT/trace/step-N.RANK.json) and log its bubble "
                        "fraction; 0: never (default)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of each stage (the config's standard "
                   "plan: attention heads and MLP columns split; LLaMA, Mistral, Qwen2)")
    p.add_argument("--tp-vocabulary", action="store_true",
                   help="with --tp: split the embedding and the LM head by the vocabulary too, tied or not (each tp "
                        "rank holds its rows; --tp must divide the vocabulary size)")
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved", "zbv"])
    p.add_argument("--virtual-stages", type=int, default=1, help="stages per pipeline rank (interleaved: 2, zbv: 2)")
    p.add_argument("--chunks", type=int, default=4, help="micro-batches per mini-batch")
    p.add_argument("--checkpoint", default="except_last", choices=["always", "except_last", "never"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="bf16: the model in bfloat16, or with "
                   "--dp-shard > 1 fp32 parameters and FSDP's bf16 compute (default: %(default)s, whatever "
                   "config.json says)")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps in all (a resumed run counts on); the "
                   "LR decays over them")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step, over all data-parallel ranks")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW's peak learning rate, reached after the warmup")
    p.add_argument("--min-lr", type=float, default=0.0, help="the learning rate at the last step (cosine decay)")
    p.add_argument("--warmup", type=int, default=0, help="steps of linear LR warmup from lr/warmup to lr")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=50, help="held-out loss every N steps (and at the end)")
    p.add_argument("--save-every", type=int, default=0, help="DCP checkpoint every N steps, in OUT/checkpoints "
                   "(0: at the end only)")
    p.add_argument("--async-save", action="store_true", help="write the checkpoints in the background "
                   "(state.save(asynchronous=True)): training goes on while the files are written; a checkpoint "
                   "counts (for --resume auto and --keep) once every rank has written it")
    p.add_argument("--accumulate", type=int, default=1, help="forward/backward passes of --batch-size sequences per "
                   "optimizer step; the gradients are those of the mean over all of them (default: %(default)s)")
    p.add_argument("--keep", type=int, default=3, help="how many of the newest checkpoints to keep (default: %(default)s; 0: all)")
    p.add_argument("--resume", help="'auto': from the newest complete checkpoint in OUT/checkpoints (none: from "
                   "step 0); or a checkpoint folder, or a folder of step checkpoints (its newest complete one)")
    return p


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    first = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    first.add_argument("--config-file", type=Path)
    given, _ = first.parse_known_args(argv)
    if given.config_file is not None:  # the file's values come first: the command line's override them
        argv = file_arguments(p, given.config_file, argv) + argv
    args = p.parse_args(argv)
    for name in ("data", "out"):
        if getattr(args, name) is None:
            p.error(f"--{name} is required (on the command line or as '{name}:' in --config-file)")
    if args.model is None and args.config is None:
        p.error("give --model (a HF model directory) or --config (a config.json: a random start)")
    for name in ("steps", "batch_size", "seq_len", "chunks", "pp", "dp_shard", "dp_replicate", "tp", "virtual_stages",
                 "eval_every", "accumulate"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: give an integer >= 1")
    for name in ("warmup", "save_every", "keep", "trace_every"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: give an integer >= 0")
    if args.fsdp_unit == "layer" and args.dp_shard == 1:
        p.error("--fsdp-unit layer gathers the layers FSDP2 shards: give --dp-shard > 1 too, or leave it out")
    if args.keep_gathered and (args.fsdp_unit == "stage" or args.dp_shard == 1):
        p.error("--keep-gathered keeps each layer gathered through the backwards: it goes with FSDP2 gathering a "
                "layer at a time (--dp-shard > 1, without --fsdp-unit stage)")
    if args.no_prefetch and (args.fsdp_unit == "stage" or args.dp_shard == 1):
        p.error("--no-prefetch gathers each layer only when it runs: it goes with FSDP2 gathering a layer at a time "
                "(--dp-shard > 1, without --fsdp-unit stage)")
    if args.tp_vocabulary and args.tp == 1:
        p.error("--tp-vocabulary splits the vocabulary over the tensor-parallel ranks: give --tp 2 or more too")
    if not args.peak_tflops >= 0:
        p.error(f"--peak-tflops {args.peak_tflops}: give one device's peak in TFLOP/s (> 0), or 0 for no MFU")
    if not (args.lr > 0 and 0 <= args.min_lr <= args.lr):
        p.error(f"--lr {args.lr} with --min-lr {args.min_lr}: give --lr > 0 and 0 <= --min-lr <= --lr")
    return args


def file_arguments(p: argparse.ArgumentParser, path: Path, argv: list[str]) -> list[str]:
    """The flags a YAML file of ``flag: value`` gives (keys with dashes or underscores), as command-line words.

    A group of alternatives (``--model`` or ``--config``) given on the command
    line replaces the file's choice in it.
    """
    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise SystemExit(f"--config-file {path}: {error.strerror}; give a YAML file of flags (steps: 100, ...)")
    except yaml.YAMLError as error:
        raise SystemExit(f"--config-file {path}: not YAML ({error}); give a file of flags (steps: 100, ...)")
    values = {} if values is None else values
    if not isinstance(values, dict):
        raise SystemExit(f"--config-file {path}: holds a {type(values).__name__}, not a mapping of flags to values; "
                         "write one 'flag: value' per line (steps: 100)")
    options = {action.dest: action for action in p._actions if action.option_strings and
               action.dest not in ("help", "config_file")}
    on_command_line = {action.dest for action in options.values() if any(
        word == option or word.startswith(option + "=") for word in argv for option in action.option_strings)}
    for group in p._mutually_exclusive_groups:
        if any(action.dest in on_command_line for action in group._group_actions):
            on_command_line.update(action.dest for action in group._group_actions)
    words: list[str] = []
    seen: dict[str, str] = {}
    for key, value in values.items():
        dest = str(key).replace("-", "_")
        if dest not in options:
            known = ", ".join(name.replace("_", "-") for name in options)
            raise SystemExit(f"--config-file {path}: unknown key {key!r}; the known keys are the flags' names: "
                             f"{known}")
        if dest in seen:
            raise SystemExit(f"--config-file {path}: {seen[dest]!r} and {key!r} are one flag; give it once")
        seen[dest] = str(key)
        switch = isinstance(options[dest], argparse._StoreTrueAction)  # a flag without a value: true or false
        if isinstance(value, (list, dict)) or isinstance(value, bool) != switch:
            expected = "true or false" if switch else "one number, word or path"
            raise SystemExit(f"--config-file {path}: {key}: {value!r} is not a value of the flag; give {expected}")
        if value is None or dest in on_command_line:  # null: the default; the command line's value wins
            continue
        if switch:
            words += [options[dest].option_strings[-1]] if value else []
        else:
            words.append(f"{options[dest].option_strings[-1]}={value}")
    return words


def effective_config(args: argparse.Namespace) -> dict[str, Any]:
    """The run's flags as a ``--config-file`` takes them back (flag names, paths as text, no defaults left out)."""
    return {name.replace("_", "-"): str(value) if isinstance(value, Path) else value
            for name, value in vars(args).items() if name != "config_file" and value is not None}


class TokenStream:
    """The text file as token ids, cut into training and held-out sequences."""

    def __init__(self, path: Path, model_dir: Optional[Path], vocab_size: int, seq_len: int) -> None:
        text = path.read_text(encoding="utf-8")
        tokenizer = _tokenizer(model_dir)
        if tokenizer is not None:
            ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
        elif vocab_size >= 256:
            ids = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
        else:
            raise SystemExit(f"the model has no tokenizer files and a vocabulary of {vocab_size} < 256 ids: give it "
                             "a tokenizer (tokenizer.save_pretrained into the model directory) or a byte vocabulary")
        held = max(seq_len, len(ids) // 10)
        self.train, self.held_out = ids[:-held], ids[-held:]
        if len(self.train) <= seq_len or len(self.held_out) < seq_len:
            raise SystemExit(f"{path}: {len(ids)} tokens are too few for --seq-len {seq_len}: give more text")
        self.seq_len = seq_len

    def batch(self, step: int, size: int, seed: int) -> torch.Tensor:
        """``size`` training sequences [B, T], drawn from ``(seed, step)``: a resumed run draws the same."""
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(len(self.train) - self.seq_len, (size,), generator=generator)
        return torch.stack([self.train[s:s + self.seq_len] for s in starts.tolist()])

    def evaluation(self, size: int) -> torch.Tensor:
        """The held-out text's first ``size`` sequences (fewer if it is short), [B, T]."""
        count = min(size, len(self.held_out) // self.seq_len)
        return self.held_out[:count * self.seq_len].view(count, self.seq_len)


HEADER_FORMAT = "pipe-tokens-1"
"""The ``format`` of a token file's JSON header."""


def header_path(tokens: Path) -> Path:
    """Where the JSON header of the token file ``tokens`` is: beside it, ``<name>.json`` (tokens.bin.json)."""
    return tokens.with_name(tokens.name + ".json")


def prepare_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="finetune_hf.py prepare", description="Tokenize text files once, with a model "
                                "directory's tokenizer (or as bytes when it has none), into a flat token file "
                                "(uint16 or uint32 by the vocabulary's size) and its JSON header OUT.json, which "
                                "--data OUT reads memory-mapped.")
    p.add_argument("--model", type=Path, required=True, help="the HF model directory: its tokenizer and "
                   "config.json's vocab_size")
    p.add_argument("--text", type=Path, nargs="+", required=True, help="text files (UTF-8), in this order; each "
                   "is tokenized whole, followed by the tokenizer's end-of-text token if it has one")
    p.add_argument("--out", type=Path, required=True, help="the token file to write, e.g. tokens.bin")
    return p


def prepare(model_dir: Path, texts: list[Path], out: Path) -> dict[str, Any]:
    """Writes the token file ``out`` and its header (:func:`header_path`) from ``texts``; returns the header.

    The tokens are written as they come, one text file at a time (a corpus
    bigger than memory: in files smaller than it), into ``out.writing``, renamed
    to ``out`` once all are in; the header is written last.
    """
    from transformers import AutoConfig

    vocab_size = int(AutoConfig.from_pretrained(model_dir).vocab_size)
    tokenizer = _tokenizer(model_dir)
    if tokenizer is None and vocab_size < 256:
        raise SystemExit(f"{model_dir}: no tokenizer files and a vocabulary of {vocab_size} < 256 ids: give it a "
                         "tokenizer (tokenizer.save_pretrained into the model directory) or a byte vocabulary")
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    end = None if tokenizer is None else tokenizer.eos_token_id
    count = 0
    out.parent.mkdir(parents=True, exist_ok=True)
    writing = out.with_name(out.name + ".writing")
    with writing.open("wb") as file:
        for text in texts:
            try:
                content = text.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as error:
                raise SystemExit(f"--text {text}: cannot be read as UTF-8 text ({error}); give text files")
            if tokenizer is None:
                ids = np.frombuffer(content.encode("utf-8"), dtype=np.uint8).astype(np.int64)
            else:
                ids = np.asarray(tokenizer(content, verbose=False)["input_ids"] + ([] if end is None else [end]),
                                 dtype=np.int64)
            if len(ids) and int(ids.max()) >= vocab_size:
                raise SystemExit(f"--text {text}: the tokenizer gave id {int(ids.max())}, beyond the model's "
                                 f"vocabulary of {vocab_size} (config.json's vocab_size): give the model the "
                                 "tokenizer it was trained with")
            file.write(ids.astype(dtype).tobytes())
            count += len(ids)
    writing.replace(out)
    header = {"format": HEADER_FORMAT, "vocab_size": vocab_size, "dtype": np.dtype(dtype).name, "count": count,
              "tokenizer": "bytes (UTF-8)" if tokenizer is None else str(tokenizer.name_or_path),
              "tokenizer_class": "bytes" if tokenizer is None else type(tokenizer).__name__,
              "end_of_text": end, "texts": [str(text) for text in texts]}
    header_path(out).write_text(json.dumps(header, indent=1) + "\n", encoding="utf-8")
    return header


def is_token_file(path: Path) -> bool:
    """Whether ``--data path`` names a token file (``prepare``'s: a header beside it, or a ``.bin`` name)."""
    return header_path(path).exists() or path.suffix == ".bin"


class TokenFile:
    """A token file written by ``prepare``, memory-mapped: sequences of ``seq_len`` tokens read in order.

    Sequence ``r`` is tokens ``[r * seq_len, (r + 1) * seq_len)`` of the file's
    first 90% (the rest is held out). A step's batch of ``size`` sequences is
    the ``size`` after the ``position`` sequences read before it (the count
    goes on past the end: the file is read again from its start), and each
    data-parallel part reads only its own consecutive rows of it, so the
    position, saved in a checkpoint, is all a resumed run needs to read the
    next batch.
    """

    def __init__(self, path: Path, vocab_size: int, model: Path, seq_len: int) -> None:
        head = header_path(path)
        try:
            header = json.loads(head.read_text(encoding="utf-8"))
        except OSError as error:
            raise SystemExit(f"--data {path}: its header {head} cannot be read ({error.strerror}); write the token "
                             f"file and its header with: python examples/finetune_hf.py prepare --model "
                             f"{model} --text FILE... --out {path}")
        except ValueError as error:
            raise SystemExit(f"--data {path}: its header {head} is not JSON ({error}); write it again with "
                             "'python examples/finetune_hf.py prepare'")
        missing = {"format", "vocab_size", "dtype", "count", "tokenizer"} - set(header)
        if header.get("format") != HEADER_FORMAT or missing or header["dtype"] not in ("uint16", "uint32"):
            raise SystemExit(f"--data {path}: {head} is not a header 'prepare' wrote (format {HEADER_FORMAT}; "
                             f"missing {sorted(missing)}); write it again with 'python examples/finetune_hf.py "
                             "prepare'")
        if header["vocab_size"] != vocab_size:
            raise SystemExit(f"--data {path}: its tokens are for a vocabulary of {header['vocab_size']} ids "
                             f"(tokenizer {header['tokenizer']}), the model {model} has {vocab_size}: a file of "
                             f"another tokenizer; prepare the data with this model's: python "
                             f"examples/finetune_hf.py prepare --model {model} --text FILE... --out {path}")
        dtype, count = np.dtype(header["dtype"]), int(header["count"])
        size = path.stat().st_size if path.exists() else None
        if size != count * dtype.itemsize:
            raise SystemExit(f"--data {path}: {'absent' if size is None else f'{size} bytes'}, its header says "
                             f"{count} {dtype.name} tokens ({count * dtype.itemsize} bytes): prepare it again")
        self.path, self.header, self.seq_len = path, header, seq_len
        self.tokens = np.memmap(path, dtype=dtype, mode="r", shape=(count,)) if count else np.zeros(0, dtype)
        held = max(seq_len, count // 10)
        self.sequences = (count - held) // seq_len  # training sequences in one pass over the file
        if self.sequences < 1 or held > count:
            raise SystemExit(f"--data {path}: {count} tokens are too few for --seq-len {seq_len}: give more text")
        self.held_out = self.tokens[count - held:]

    def batch(self, position: int, size: int, part: int = 0, parts: int = 1) -> torch.Tensor:
        """Data-parallel part ``part`` of ``parts``'s rows of the ``size`` sequences after ``position``, [B, T]."""
        first, last = position + part * size // parts, position + (part + 1) * size // parts
        rows = [self.tokens[r * self.seq_len:(r + 1) * self.seq_len]
                for r in (index % self.sequences for index in range(first, last))]
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    def evaluation(self, size: int) -> torch.Tensor:
        """The held-out part's first ``size`` sequences (fewer if it is short), [B, T]."""
        count = min(size, len(self.held_out) // self.seq_len)
        return torch.from_numpy(np.asarray(self.held_out[:count * self.seq_len], dtype=np.int64)).view(count, self.seq_len)


def open_data(args: argparse.Namespace, vocab_size: int) -> "TokenStream | TokenFile":
    """``--data``: a token file (``prepare``'s) read in order, or a text file tokenized here."""
    if is_token_file(args.data):
        return TokenFile(args.data, vocab_size, args.model or args.config, args.seq_len)
    return TokenStream(args.data, args.model, vocab_size, args.seq_len)



def _tokenizer(model_dir: Optional[Path]) -> Any:
    if model_dir is None or not any((model_dir / name).exists() for name in ("tokenizer.json", "tokenizer.model",
                                                                             "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def build(args: argparse.Namespace, world: int, loaded: bool) -> tuple[pd.DistributedPipe, Any, float]:
    """The pipeline on this rank and the model's config: with ``loaded`` (weights from --model or a checkpoint)
    only the rank's shards are allocated, for the load to fill (``init_weights=False``); else its stage is
    materialised and initialised by the model's own code."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(args.model or args.config)
    config.use_cache = False
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32  # whatever config.json says
    # bf16 sharded: fp32 parameters (and AdamW state), FSDP computes in bf16 and reduces in fp32; unsharded: all bf16.
    mixed = args.dtype == "bf16" and args.dp_shard > 1
    torch.manual_seed(args.seed)  # a random start is the same on every rank (a loaded one needs no seed)
    with torch.device("meta"):  # no memory: each rank materialises its own stage only
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    flops = flops_per_token(model, config, args.seq_len)
    virtual = args.virtual_stages
    # One piece per stage, cut where the costliest stage's FLOPs (the head's weighed too) are smallest; with one
    # stage (--pp 1), two pieces on the one rank: pipe.split needs a cut.
    pieces = max(args.pp * virtual, 2)
    if pieces > config.num_hidden_layers:
        raise SystemExit(f"{pieces} stages for {config.num_hidden_layers} decoder layers: use at most "
                         f"{config.num_hidden_layers} (--pp x --virtual-stages)")
    example = torch.zeros(2, args.seq_len, dtype=torch.long, device="meta")
    stages = pipe.split(model, (example,), {"use_cache": False}, at="auto", stages=pieces)
    if mixed:  # traced in bf16, the dtype FSDP gives the graphs; the parameters it keeps are fp32
        for parameter in stages.parameters():
            parameter.data = parameter.data.float()
    ranks = args.pp * args.dp_shard * args.dp_replicate * args.tp
    if ranks != world:
        raise SystemExit(f"--pp {args.pp} x --dp-shard {args.dp_shard} x --dp-replicate {args.dp_replicate} x --tp "
                         f"{args.tp} != {world} ranks: launch {ranks} (NPROC=...)")
    mesh = pd.make_mesh(pp=args.pp, dp_shard=args.dp_shard, dp_replicate=args.dp_replicate, tp=args.tp)
    plan = hf.tensor_parallel_plan(model, vocabulary=args.tp_vocabulary) if args.tp > 1 else None
    shard = None
    if args.dp_shard > 1:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None
        unit = {"layer": "block", "stage": "stage", None: None}[args.fsdp_unit]  # None: the engine's choice
        shard = pd.Shard(mp_policy=policy, unit=unit, reshard_after_backward=not args.keep_gathered,
                         prefetch=not args.no_prefetch)
    piped = pd.DistributedPipe(stages, chunks=args.chunks, checkpoint=args.checkpoint, schedule=args.schedule,
                               virtual_stages=virtual, mesh=mesh, loss_fn=lm_loss, shard=shard,
                               tensor_parallel=plan, init_weights=not loaded)
    if piped.shard is not None:  # the unit DistributedPipe chose for this schedule, where --fsdp-unit left it open
        log.info("FSDP2 gathers %s", "a stage at a time" if piped.shard.unit == "stage" else
                 "a layer at a time" + (", kept from its first backward to the reduce" if args.keep_gathered else "")
                 + (", each only when it runs" if args.no_prefetch else ""))
    log.info("dtype: %s", "bf16 compute, fp32 parameters and gradient reduction (FSDP mixed precision)" if mixed
             else f"{args.dtype} parameters and compute")
    return piped, config, flops


def flops_per_token(model: nn.Module, config: Any, seq_len: int) -> float:
    """A training step's model FLOPs per token (forward and backward, recomputation not counted), as PaLM's
    appendix and torchtitan count them: 6 per weight outside the input embedding, plus 12 x layers x heads x
    head dim x sequence length for attention's scores and values."""
    weights = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 6.0 * weights + 12.0 * config.num_hidden_layers * heads * head_dim * seq_len


def evaluate(model: pd.DistributedPipe, data: "TokenStream | TokenFile", args: argparse.Namespace) -> float:
    """The held-out loss, forwards only, the same on every rank."""
    ids = data.evaluation(args.batch_size)
    parts, part = model.topology.data_parallel, model.topology.replica
    rows = ids[part * len(ids) // parts:(part + 1) * len(ids) // parts].to(model.device)
    model.eval()
    loss = model.eval_step(rows, rows, broadcast_loss=True)
    model.train()
    return float(loss)


def lr_schedule(optimizer: torch.optim.Optimizer, args: argparse.Namespace) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over ``--warmup`` steps to ``--lr``, then a cosine decay to ``--min-lr`` at the last step.

    The factor of ``--lr`` for the optimizer step taken after ``taken`` steps:
    ``(taken + 1) / warmup`` during the warmup, then from 1 down the half cosine.
    """
    warmup, decay, floor = args.warmup, max(1, args.steps - args.warmup - 1), args.min_lr / args.lr

    def factor(taken: int) -> float:
        if taken < warmup:
            return (taken + 1) / warmup
        progress = min(1.0, (taken - warmup) / decay)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def restore_schedule(schedule: torch.optim.lr_scheduler.LambdaLR, saved: Optional[dict[str, Any]], start: int,
                     args: argparse.Namespace) -> None:
    """Puts the schedule where the checkpoint's was; the flags give its shape (a resumed run may change --steps).

    With the flags unchanged, the LR of every later step is the one the run
    that saved would have used, bit for bit.
    """
    if saved is not None:
        schedule.load_state_dict(saved)  # the steps it has taken
    else:  # a checkpoint written without the schedule: it stood at the step
        schedule.last_epoch = start
    schedule.base_lrs = [args.lr for _ in schedule.optimizer.param_groups]
    for group, base, factor in zip(schedule.optimizer.param_groups, schedule.base_lrs, schedule.lr_lambdas):
        group["lr"] = base * factor(schedule.last_epoch)  # as LambdaLR computes it


def resume_from(args: argparse.Namespace) -> Optional[Path]:
    """The checkpoint ``--resume`` names: None (from step 0), or a complete checkpoint's folder.

    ``auto`` is the newest complete checkpoint in ``OUT/checkpoints``, or None
    when there is none yet (a first run); a path is a checkpoint, or a folder
    of step checkpoints whose newest complete one is taken. A path with no
    complete checkpoint is refused.
    """
    if args.resume is None:
        return None
    if args.resume == "auto":
        found = state.latest(args.out / "checkpoints")
        if found is None:
            log.info("--resume auto: no complete checkpoint in %s yet: starting at step 0", args.out / "checkpoints")
        return found
    path = Path(args.resume)
    if state.is_complete(path):
        return path
    found = state.latest(path)
    if found is None:
        unfinished = sorted(entry.name for entry in path.glob(f"*{state.STAGING}")) if path.is_dir() else []
        why = (f"saves that did not finish: {', '.join(unfinished)}" if unfinished else
               "the folder does not exist" if not path.exists() else "no step-<N> folder with a .metadata file")
        raise SystemExit(f"--resume {path}: no complete checkpoint there ({why}); give a checkpoint folder, a folder "
                         f"of them ({args.out / 'checkpoints'}), or --resume auto, which starts at step 0 when "
                         "there is none")
    return found


class Metrics:
    """Each step's figures on rank 0: a JSON line in ``OUT/metrics.jsonl``, and TensorBoard's if it is installed.

    A resumed run keeps the lines of the steps up to where it resumed and
    writes on from there, so the file holds one line per step taken.
    """

    def __init__(self, out: Path, start: int, write: bool) -> None:
        self.file = None
        self.board: Any = None
        if not write:
            return
        path = out / "metrics.jsonl"
        kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= start] \
            if start and path.exists() else []
        path.write_text("".join(line + "\n" for line in kept))
        self.file = path.open("a", encoding="utf-8")
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # optional: pip install tensorboard
            log.info("metrics: %s (tensorboard is not installed: no TensorBoard events)", path)
        else:
            self.board = SummaryWriter(str(out / "tensorboard"), purge_step=start + 1 if start else None)
            log.info("metrics: %s and TensorBoard events in %s", path, out / "tensorboard")

    def write(self, record: dict[str, float]) -> None:
        if self.file is None:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()  # a dashboard (or a killed run) sees every step taken
        if self.board is not None:
            for name, value in record.items():
                if name != "step":
                    self.board.add_scalar(name, value, record["step"])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.board is not None:
            self.board.close()


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: the CUDA allocator's peak on a GPU, else the peak resident set (VmHWM)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, kB elsewhere


def plot(path: Path, losses: list[tuple[int, float]], evals: list[tuple[int, float]],
         speeds: list[tuple[int, float]]) -> None:
    """The loss curve (training and held-out) and the throughput (tokens/s per step) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file
    import matplotlib.pyplot as plt

    figure, (axes, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    if losses:
        axes.plot(*zip(*losses), label="training", linewidth=1)
    if evals:
        axes.plot(*zip(*evals), "o-", label="held out")
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.legend()
    if speeds:
        right.plot(*zip(*speeds), linewidth=1)
    right.set_xlabel("step")
    right.set_ylabel("tokens/s")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def traced(args: argparse.Namespace, step: int) -> bool:
    """Whether step ``step`` (1-based) is recorded (``--trace-every``)."""
    return bool(args.trace_every) and step % args.trace_every == 0


def tracing(args: argparse.Namespace, rank: int, step: int) -> Any:
    """``pipe.trace.record`` of this rank's part of step ``step`` into ``OUT/trace``, or nothing."""
    if not traced(args, step):
        return contextlib.nullcontext()
    (args.out / "trace").mkdir(parents=True, exist_ok=True)
    return pipe.trace.record(str(args.out / "trace" / f"step-{step}.{{rank}}.json"), rank=rank,
                             schedule=args.schedule, chunks=args.chunks)


def bubble(args: argparse.Namespace, env: Any, step: int) -> dict[str, float]:
    """The recorded step's idle shares on rank 0, from every rank's trace (``pipe.plan.explain``):
    ``bubble_fraction``, the schedule's own waits over all ranks' wall time; ``idle_fraction``, every idle
    interval (waits beyond the schedule's and runtime overhead too)."""
    dist.barrier()  # every rank's file is written
    if env.rank != 0:
        return {}
    files = [str(args.out / "trace" / f"step-{step}.{rank}.json") for rank in range(env.world_size)]
    explanation = pipe.plan.explain(pipe.trace.merge(files))
    wall = explanation.wall * len(explanation.rows)
    if wall <= 0:
        return {}
    idle = [explanation.idle_by(row) for row in range(len(explanation.rows))]
    waits = [explanation.idle_by(row, "bubble") for row in range(len(explanation.rows))]
    return {"bubble_fraction": sum(waits) / wall, "idle_fraction": sum(idle) / wall}


KILL = "FINETUNE_KILL"
"""The fault drill's variable: ``RANK:STEP`` makes that rank SIGKILL itself as that step begins, in a job's first
attempt only (torchrun's ``TORCHELASTIC_RESTART_COUNT`` 0 or unset), so that a job under ``--max-restarts``
restarts and resumes (``--resume auto``) once."""


def kill_drill(rank: int) -> Optional[int]:
    """The step (1-based) at which this rank kills itself, from ``$FINETUNE_KILL``; None when it does not."""
    given = os.environ.get(KILL)
    if not given:
        return None
    try:
        victim, step = (int(word) for word in given.split(":"))
    except ValueError:
        raise SystemExit(f"{KILL}={given!r}: give RANK:STEP (1:3: rank 1 kills itself as step 3 begins)")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return step if victim == rank and attempt == 0 else None


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["prepare"]:  # python examples/finetune_hf.py prepare --model DIR --text a.txt --out tokens.bin
        given = prepare_parser().parse_args(argv[1:])
        header = prepare(given.model, given.text, given.out)
        print(f"wrote {header['count']:,} tokens ({header['dtype']}, vocabulary {header['vocab_size']}, tokenizer "
              f"{header['tokenizer']}) to {given.out} and its header {header_path(given.out)}")
        return
    args = parse_args(argv)
    env = pd.init_from_env()
    logging.basicConfig(level=logging.INFO if env.rank == 0 else logging.WARNING, format="%(message)s")
    resume = resume_from(args)
    if env.rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "config.yaml").write_text(yaml.safe_dump(effective_config(args), sort_keys=False))
    model, config, flops = build(args, env.world_size, loaded=bool(args.model) or resume is not None)
    if args.model and resume is None:
        hf.load(args.model, model)  # each rank reads its own tensors (its shards under FSDP)
    elif args.model:  # state.load below sets every tensor (it refuses a checkpoint that lacks one): read them once
        log.info("weights from %s (the config from %s)", resume, args.model)
    parameters = list(model.parameters())
    # With --tp and no FSDP the split weights are DTensors and the rest plain tensors: AdamW's multi-tensor path
    # (CUDA's default) refuses a list that mixes them, so it steps one tensor at a time there.
    mixed = len({isinstance(p, DTensor) for p in parameters}) > 1
    optimizer = torch.optim.AdamW(parameters, lr=args.lr, weight_decay=0.0, foreach=False if mixed else None)
    schedule = lr_schedule(optimizer, args)
    data = open_data(args, config.vocab_size)
    start = 0
    position = 0  # sequences read so far, over all data-parallel ranks
    if resume is not None:
        extra = state.load(resume, model, optimizer)
        start = int(extra["step"])
        # A checkpoint from before the position was saved: the steps it took, of this run's batch size.
        position = int(extra.get("data_position", start * args.accumulate * args.batch_size))
        restore_schedule(schedule, extra.get("schedule"), start, args)
        log.info("resumed from %s at step %d", resume, start)
    parts, part = model.topology.data_parallel, model.topology.replica
    if args.batch_size % (parts * args.chunks):
        raise SystemExit(f"--batch-size {args.batch_size} must divide into {parts} data-parallel part(s) of "
                         f"--chunks {args.chunks} micro-batches")
    if isinstance(data, TokenFile):
        log.info("data: %s, %s tokens of a vocabulary of %d (tokenizer %s): %s sequences of %d a pass, read in order "
                 "from sequence %d (pass %d)", args.data, f"{len(data.tokens):,}", data.header["vocab_size"],
                 data.header["tokenizer"], f"{data.sequences:,}", args.seq_len, position % data.sequences,
                 position // data.sequences + 1)
    log.info("rank %d/%d: stages %s of %d, mesh pp %d x dp_shard %d x dp_replicate %d x tp %d, %s parameters here",
             env.rank, env.world_size, model.stages, model.schedule.stages, args.pp, args.dp_shard,
             args.dp_replicate, args.tp, f"{sum(p.numel() for p in model.parameters()):,}")

    checkpoints = args.out / "checkpoints"
    metrics = Metrics(args.out, start, write=env.rank == 0)
    losses: list[tuple[int, float]] = []
    speeds: list[tuple[int, float]] = []
    evals = [(start, evaluate(model, data, args))]
    began = time.perf_counter()
    kill_at = kill_drill(env.rank)
    bar = tqdm(range(start, args.steps), desc="fine-tune", unit="step", disable=env.rank != 0, dynamic_ncols=True)
    for step in bar:
        if step + 1 == kill_at:
            print(f"{KILL}: rank {env.rank} kills itself (SIGKILL) as step {step + 1} begins", file=sys.stderr,
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        lr = optimizer.param_groups[0]["lr"]  # this step's
        tick = time.perf_counter()
        with tracing(args, env.rank, step + 1):  # --trace-every: every pass of the step, on every rank
            for k in range(args.accumulate):  # the last pass reduces and divides by the sequences of all (pipe's accumulate)
                if isinstance(data, TokenFile):  # in order: this part's rows of the next --batch-size sequences
                    rows = data.batch(position, args.batch_size, part, parts).to(model.device)
                else:  # drawn from (--seed, pass)
                    ids = data.batch(step * args.accumulate + k, args.batch_size, args.seed)
                    rows = ids[part * len(ids) // parts:(part + 1) * len(ids) // parts].to(model.device)
                position += args.batch_size
                last = k == args.accumulate - 1
                reported = model.step(rows, rows, broadcast_loss=True, accumulate=not last)
        loss = float(reported)  # the last pass's: the mean over every pass
        if not math.isfinite(loss):
            raise SystemExit(f"step {step}: the loss is {loss}; lower --lr or check the model and data")
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        seconds = time.perf_counter() - tick
        done = step + 1
        peak = torch.tensor([peak_memory_bytes(model.device)], device=model.device)
        rank_peak = int(peak.item())
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # the highest of every rank's
        tokens_per_s = args.accumulate * args.batch_size * args.seq_len / seconds
        record = {"step": done, "loss": loss, "lr": lr, "tokens_per_s": tokens_per_s, "seconds": seconds,
                  "peak_memory_bytes": rank_peak, "max_peak_memory_bytes": int(peak.item()),
                  "data_position": position}
        if args.peak_tflops:  # the model FLOPs done per second over what the world's devices could do
            record["mfu"] = flops * tokens_per_s / (args.peak_tflops * 1e12 * env.world_size)
        if traced(args, done):
            record.update(bubble(args, env, done))
        metrics.write(record)
        losses.append((done, loss))
        speeds.append((done, tokens_per_s))
        bar.set_postfix(loss=f"{loss:.3f}")
        if done % args.eval_every == 0 or done == args.steps:
            evals.append((done, evaluate(model, data, args)))
        if (args.save_every and done % args.save_every == 0) or done == args.steps:
            state.save(state.step_path(checkpoints, done), model, optimizer, step=done,
                       schedule=schedule.state_dict(), data_position=position, asynchronous=args.async_save)
            if args.keep:  # complete checkpoints only: one still being written is not counted, nor deleted
                state.prune(checkpoints, keep=args.keep)
    bar.close()
    metrics.close()
    if state.wait() is not None and args.keep:  # the last asynchronous save, written and published
        state.prune(checkpoints, keep=args.keep)

    hf.save(args.out / "hf", model, config=config)  # every rank writes its own tensors
    if env.rank == 0:
        plot(args.out / "loss.png", losses, evals, speeds)
    first = losses[0][1] if losses else float("nan")
    last = losses[-1][1] if losses else float("nan")
    log.info("done: steps %d-%d, loss %.3f -> %.3f, held-out %.3f -> %.3f, %.1f s; exported to %s",
             start, args.steps, first, last, evals[0][1], evals[-1][1], time.perf_counter() - began,
             args.out / "hf")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
