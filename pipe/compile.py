"""Compiled stages: every block of a stage through ``torch.compile``, for both runners.

``Pipe(..., compile=True)`` and ``DistributedPipe(..., compile=True)`` call
:func:`compile_stages` on their partitions once, at construction. Each layer
of a partition (a block: a transformer layer; in a stage of ``pipe.split``,
each layer it runs as a module of its own, :mod:`pipe.split_blocks`) gets
its ``forward`` replaced by a compiled one, in place, so that

* parameters, buffers and state-dict keys stay the layer's own (no
  ``_orig_mod.`` prefix, as ``torch.compile(module)`` would add);
* forward hooks (tied copies, recompute and offload policies, ``pipe.split``'s
  mode and buffer checks) stay eager around the compiled body;
* identical blocks share one compiled graph: dynamo inlines ``nn.Module`` and
  guards on the structure and the class, not on the module's identity (a split
  model's alike layers share one class for this);
* a split stage's own ops between its layers (rotary tables, masks) run eagerly,
  so its first step compiles one layer of each kind, whatever the stage's depth;
* checkpointing works unchanged: a checkpointed block runs its first forward
  under ``no_grad`` (an inference graph) and its one recomputation with grad
  (the training graph), each compiled once; the random state is restored
  before the replay as in eager, and with inductor random ops draw from
  torch's generator as eager does (``fallback_random``), so a replay draws
  the first forward's dropout masks and the plain model's too;
* the zero-bubble split backward (:mod:`pipe.core.iw_backward`) walks the
  compiled blocks' autograd nodes like any other.

By default shapes are dynamic (``dynamic=True``): the micro-batches of a step,
the smaller last one and the next step's other batch or sequence length reuse
the same graphs. The first step compiles each block class once per variant it
meets (grad mode: a checkpoint's no-grad forward and its replay; whether the
input needs grad; the first micro-batch at storage offset 0, as dynamo
specialises sizes and offsets of 0 and 1); later steps compile nothing, except
for a micro-batch of one sample, compiled once more.

The option is ``False``, ``True`` (inductor, dynamic shapes) or a dict of
``torch.compile`` keywords: ``backend``, ``mode``, ``options``, ``fullgraph``,
``dynamic``, plus ``exclude``: names of layers left eager, and ``unit``: a
stage of ``pipe.split`` compiled a layer at a time (``"block"``, the default:
the first step's compile does not grow with the stage's depth) or as one graph
(``"stage"``: a few percent faster steps on small layers, a compile that grows
with depth). A failure to compile
is raised at the first forward as :class:`CompileError`, naming the layer and
the fix.
"""
from __future__ import annotations

import functools
import logging
import shutil
import warnings
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch
from torch import fx, nn

__all__: list[str] = []

logger = logging.getLogger(__name__)

CompileOption = Union[bool, Mapping[str, Any]]

_KEYS = ("backend", "mode", "options", "fullgraph", "dynamic", "exclude", "unit")
UNITS = ("block", "stage")
_FIXES = ("pass compile={'fullgraph': False} to let dynamo fall back to eager around what it cannot trace, "
          "compile={'backend': 'aot_eager'} where inductor cannot build, or compile={'exclude': [name]} to "
          "leave this layer eager")


class CompileError(RuntimeError):
    """A layer of a stage could not be compiled; the message names the layer and the fix."""


def verify_compile(value: Any, tensor_parallel: bool = False) -> Optional[dict[str, Any]]:
    """The normalised ``compile=`` option: None (eager) or the ``torch.compile`` keywords plus ``exclude``.

    With ``tensor_parallel`` (stages whose weights become DTensors) shapes are
    static by default (``dynamic=False``: a new shape compiles once more), as
    torch 2.13 fails on DTensors with symbolic shapes: AOT autograd recurses
    without end under ``dynamic=True``, and a sharded embedding cannot hash a
    symbolic size once ``dynamic=None`` makes a dimension dynamic.

    Raises:
        TypeError, ValueError: not a bool or a dict, an unknown key, a bad value,
            or inductor on a machine without a C++ compiler.
        RuntimeError: torch older than 2.13 (see the message).
    """
    if value is False or value is None:
        return None
    if value is True:
        value = {}
    if not isinstance(value, Mapping):
        raise TypeError(f"compile must be True, False or a dict of torch.compile keywords, got {value!r}")
    _verify_torch()
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ValueError(f"compile got unknown keys {unknown}; expected some of {list(_KEYS)} "
                         "(torch.compile's keywords, and exclude: layer names left eager)")
    options: dict[str, Any] = {"backend": "inductor", "fullgraph": False, "dynamic": True, "mode": None,
                               "options": None, "exclude": (), "unit": "block"}
    if tensor_parallel:
        if value.get("dynamic") is True:
            raise ValueError("compile={'dynamic': True} fails on tensor-parallel stages (AOT autograd recurses "
                             "without end on DTensors with symbolic shapes, torch 2.13); leave 'dynamic' out "
                             "(static shapes: a new shape compiles once more)")
        options["dynamic"] = False
    options.update(value)
    for key in ("fullgraph",):
        if not isinstance(options[key], bool):
            raise TypeError(f"compile['{key}'] must be True or False, got {options[key]!r}")
    if options["dynamic"] not in (True, False, None):
        raise ValueError(f"compile['dynamic'] must be True, False or None, got {options['dynamic']!r}")
    if options["unit"] not in UNITS:
        raise ValueError(f"compile['unit'] must be one of {UNITS} (a split stage's layers one at a time, or the "
                         f"whole stage as one graph), got {options['unit']!r}")
    exclude = options["exclude"]
    if isinstance(exclude, str) or not all(isinstance(name, str) for name in exclude):
        raise TypeError(f"compile['exclude'] must be a list of layer names, got {exclude!r}")
    options["exclude"] = tuple(exclude)
    backend = options["backend"]
    if not (isinstance(backend, str) or callable(backend)):
        raise TypeError(f"compile['backend'] must be a backend name or a callable, got {backend!r}")
    if backend == "inductor":
        if not _has_cxx_compiler():
            raise ValueError(
                "compile=True uses inductor, which needs a C++ compiler on the CPU and none was found; "
                "install one (apt-get install g++) or pass compile={'backend': 'aot_eager'} "
                "(compiled autograd graphs, eager kernels)")
        # Random ops from torch's generator, as eager: a checkpoint's replay draws the same masks.
        # torch.compile takes a mode or options, not both: a mode becomes its options here.
        import torch._inductor

        from_mode = torch._inductor.list_mode_options(options["mode"], options["dynamic"]) if options["mode"] else {}
        options["options"] = {"fallback_random": True, **from_mode, **(options["options"] or {})}
        options["mode"] = None
    return options


def _verify_torch() -> None:
    if torch.torch_version.TorchVersion(torch.__version__) < "2.13":
        raise RuntimeError(
            f"compile= needs torch >= 2.13 (this is torch {torch.__version__}): on torch 2.11 compiled stages "
            "crashed the interpreter when Pipe's worker threads compiled at once, torch.compile has no "
            "per-function recompile_limit, and the zero-bubble I/W split cannot walk compiled blocks' "
            "autograd nodes; upgrade torch, or pass compile=False"
        )


def _has_cxx_compiler() -> bool:
    import torch._inductor.config

    configured = torch._inductor.config.cpp.cxx
    names = [name for name in (configured if isinstance(configured, tuple) else (configured,)) if name]
    return any(shutil.which(name) for name in names + ["g++", "c++", "clang++"])


def compile_stages(partitions: Iterable[nn.Module], options: Optional[dict[str, Any]]) -> list[str]:
    """Compiles every layer of every partition in place; returns the names of the layers compiled.

    A layer compiled already (an earlier wrap of the same modules) is left as it is.
    """
    if options is None:
        return []
    kwargs = {key: options[key] for key in ("backend", "mode", "options", "fullgraph", "dynamic")}
    done = []
    for partition in partitions:
        for name, layer in partition.named_children():
            if name in options["exclude"] or _is_compiled(layer):
                continue
            if _is_skippable(layer):
                warnings.warn(f"layer {name!r} is @skippable: its skips pass through pipe's tracker, which "
                              "dynamo cannot trace, so it stays eager (compile={'exclude': [...]} says so "
                              "without this warning)", stacklevel=3)
                continue
            for unit_name, unit in _units(name, layer, options["unit"]):
                if unit_name not in options["exclude"] and not _is_compiled(unit):
                    unit.forward = _compiled_forward(unit, unit_name, kwargs)
                    done.append(unit_name)
    logger.info("compiled %d layers with %s", len(done), kwargs)
    return done


def _units(name: str, layer: nn.Module, unit: str) -> list[tuple[str, nn.Module]]:
    """What of ``layer`` compiles as one: the layer, or with ``unit="block"`` in a stage of ``pipe.split`` whose
    layers were outlined (graph modules inside a graph module: :mod:`pipe.split_blocks`) each of those layers,
    named by its path. Alike layers share one class, so one compile serves them all; the stage's own ops
    between them (rotary tables, masks) run eagerly."""
    if unit == "stage" or not isinstance(layer, fx.GraphModule):
        return [(name, layer)]
    inner: list[tuple[str, nn.Module]] = [(f"{name}.{path}", module) for path, module in layer.named_modules()
                                          if path and isinstance(module, fx.GraphModule)]
    return inner or [(name, layer)]


def compiled_layers(module: nn.Module) -> list[str]:
    """The names of ``module``'s submodules whose forward :func:`compile_stages` compiled."""
    return [name for name, sub in module.named_modules() if _is_compiled(sub)]


def _is_compiled(layer: nn.Module) -> bool:
    return getattr(layer.__dict__.get("forward"), "_pipe_compiled", False)


def _is_skippable(layer: nn.Module) -> bool:
    from pipe.skip.skippable import Skippable

    return any(isinstance(module, Skippable) for module in layer.modules())


def _keep_graphs() -> None:
    """Turns off AOT autograd's donated buffers, process-wide and in every thread.

    The runners walk a cell's graph again after a retained backward (the split
    backward's W, the thread runner's worker backward), which donated buffers
    forbid; AOT autograd reads the flag when a backward runs, on whichever
    thread runs it, and a config set the ordinary way holds only in the thread
    that set it, so the default itself changes.
    """
    import torch._functorch.config

    entry = getattr(torch._functorch.config, "_config", {}).get("donated_buffer")
    if entry is not None:
        entry.default = False
    torch._functorch.config.donated_buffer = False


# Variants of one block class a first step may meet: grad mode (a checkpoint's no-grad forward, its
# replay), whether the input needs grad (the first stage's does not), a micro-batch at storage offset 0
# or not (dims of size 0 or 1 are specialised), train or eval; dynamo's default limit (8) would
# fall back to eager silently on a model of several block classes.
_RECOMPILE_LIMIT = 64

_COMPILED: dict[tuple[Any, ...], Callable[..., Any]] = {}  # (layer class, options) -> its compiled forward


def _compiled_forward(layer: nn.Module, name: str, kwargs: dict[str, Any]) -> Callable[..., Any]:
    """``layer.forward`` through the compiled forward of its class, shared by the layers of that class.

    Compiling the class's ``forward`` (the module an argument) rather than each
    bound method keeps one code object per class: identical blocks reuse one
    graph, and dynamo's per-code recompile limit counts variants, not layers.
    """
    _keep_graphs()
    settings = (kwargs["backend"] if isinstance(kwargs["backend"], str) else id(kwargs["backend"]),
                kwargs["mode"], repr(sorted((kwargs["options"] or {}).items())), kwargs["fullgraph"], kwargs["dynamic"])
    described = f"layer {name!r} ({type(layer).__name__})"

    def compiled() -> Callable[..., Any]:  # looked up at each call: a graph module's class changes as its code does
        key = (type(layer), *settings)
        found = _COMPILED.get(key)
        if found is None:
            compile_fn: Any = torch.compile  # recompile_limit= is missing from its typed overloads
            found = _COMPILED[key] = compile_fn(type(layer).forward, recompile_limit=_RECOMPILE_LIMIT, **kwargs)
        return found

    @functools.wraps(type(layer).forward)
    def forward(*args: Any, **inputs: Any) -> Any:
        try:
            return compiled()(layer, *args, **inputs)
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.BackendCompilerFailed) as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise CompileError(f"compiling {described} failed: {first}; {_FIXES}") from error

    forward._pipe_compiled = True  # type: ignore[attr-defined]
    return forward
