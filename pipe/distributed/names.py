"""The plain model's names for what one rank holds (``DistributedPipe.named_parameters``, ``named_modules``).

A rank holds some layers of the model, under the names they have in the
``nn.Sequential`` (``"3.linear.weight"``); the stages of a :func:`pipe.split`
model are graph modules named by stage index (``"1.transformer.h.2.ln_1.weight"``).
Its ``state_dict()`` already uses the plain model's keys; here the names of
parameters, buffers and modules are mapped the same way:

* a split stage's tensor gets the original model's name (a stage knows every
  original name of each tensor it holds, buffers outside the state dict such
  as ``model.rotary_emb.inv_freq`` included);
* a tied tensor (embedding = LM head) gets the name the plain model's
  ``named_parameters()`` gives it, the first it is registered under
  (``"transformer.wte.weight"``), also on the rank that holds only the head;
* a split stage itself, and the graph's helper modules, are no module of the
  plain model and are not listed; an intermediate module that two stages
  both hold a part of (``"transformer"``) is listed once, as the first stage's.

``torch.distributed.checkpoint`` walks a module by attribute from its
state-dict keys, which these names are not for split stages:
:mod:`pipe.distributed.state` gives it a view that holds the same tensors under
these names (:func:`pipe.distributed.state.plain_view`).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

from torch import Tensor, nn

from pipe.split_stage import SplitStage
from pipe.core.tying import find_ties

__all__: list[str] = []


class PlainNames:
    """Maps the names of ``container``'s members (one rank's layers) to the plain model's.

    Args:
        container: the module whose children are the rank's layers under their layer names.
        skeleton: every stage's layers (the same model on every rank), to find ties.
    """

    def __init__(self, container: nn.Module, skeleton: Sequence[nn.Module]) -> None:
        self.container = container
        self.stages = {name: child for name, child in container.named_children() if isinstance(child, SplitStage)}
        # Every name of the plain model a stage's submodules lead to (buffers outside the state dict too).
        self._prefixes = {name: {key.rsplit(".", 1)[0] for names in stage.original_names.values() for key in names}
                          for name, stage in self.stages.items()}
        # A tie's first use, in stage and registration order, is where the plain model registers it first
        # (a split stage lists a tied tensor's original names itself).
        # By name too: a partition's qualified names are the container's, and FSDP and tensor parallelism
        # replace the parameters (the ids of the skeleton's tensors no longer match).
        ties = find_ties(skeleton)
        self._tied = {id(tie.tensor): tie.uses[0][3] for tie in ties}
        self._tied_names = {name: tie.uses[0][3] for tie in ties for _, _, _, name in tie.uses}

    def tensor(self, name: str, tensor: Tensor) -> str:
        """The plain model's name of ``tensor``, registered in the container as ``name``."""
        child, _, local = name.partition(".")
        stage = self.stages.get(child)
        if stage is None or local not in stage.original_names:
            return self._tied.get(id(tensor)) or self._tied_names.get(name, name)
        return stage.original_names[local][0]  # in the model's order: the name its named_parameters() gives

    def module(self, name: str) -> Optional[str]:
        """The plain model's name of the container's submodule ``name``, or None if the plain model has none."""
        child, _, local = name.partition(".")
        if child not in self.stages:
            return name
        if local and any(prefix == local or prefix.startswith(local + ".") for prefix in self._prefixes[child]):
            return local
        return None  # the stage itself, or a helper of its graph

    def members(self, get: Callable[[nn.Module], Iterable[tuple[str, Any]]], prefix: str, recurse: bool,
                remove_duplicate: bool) -> Iterator[tuple[str, Any]]:
        """``(plain name, tensor)`` of the container's parameters or buffers (``get`` lists a module's own)."""
        modules: Iterable[tuple[str, nn.Module]] = [("", self.container)]
        if recurse:
            modules = nn.Module.named_modules(self.container, remove_duplicate=remove_duplicate)
        seen: set[int] = set()
        for module_name, module in modules:
            for key, value in get(module):
                if value is None or (remove_duplicate and id(value) in seen):
                    continue
                seen.add(id(value))
                name = f"{module_name}.{key}" if module_name else key
                yield _join(prefix, self.tensor(name, value)), value

    def modules(self, memo: Optional[set[nn.Module]], prefix: str,
                remove_duplicate: bool) -> Iterator[tuple[str, nn.Module]]:
        """``(plain name, module)`` of the container and its submodules that the plain model has."""
        raw = nn.Module.named_modules(self.container, memo, "", remove_duplicate)
        names: set[str] = set()
        for name, module in raw:
            plain = self.module(name) if name else ""
            if plain is None or plain in names:
                continue
            names.add(plain)
            yield _join(prefix, plain), module


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


class PlainNamed:
    """``named_parameters()``, ``named_buffers()`` and ``named_modules()`` under the plain model's names.

    Mixed into an ``nn.Module`` that sets ``self.plain_names`` (a :class:`PlainNames`).
    """

    plain_names: PlainNames

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the plain model's names (as ``state_dict()`` keys; a tied weight as
        the plain model names it)."""
        return self.plain_names.members(lambda m: m._parameters.items(), prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, Tensor]]:
        """This rank's buffers under the plain model's names."""
        return self.plain_names.members(lambda m: m._buffers.items(), prefix, recurse, remove_duplicate)

    def named_modules(self, memo: Optional[set[nn.Module]] = None, prefix: str = "",
                      remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Module]]:
        """This module and its submodules that the plain model has, under the plain model's names."""
        return self.plain_names.modules(memo, prefix, remove_duplicate)
