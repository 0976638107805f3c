"""``@skippable``: layers that stash a tensor for a later layer, or pop one stashed earlier.

A skip connection (a ResNet shortcut, a U-Net bridge) breaks the rule that
each layer of an ``nn.Sequential`` takes only the previous layer's output.
A skippable layer's ``forward`` is a generator that *yields* its skip
commands::

    @skippable(stash=["identity"])
    class Save(nn.Module):
        def forward(self, x):
            yield stash("identity", x)
            return x

    @skippable(pop=["identity"])
    class Add(nn.Module):
        def forward(self, x):
            identity = yield pop("identity")
            return x + identity

The decorator returns a subclass of the decorated class, so parameters,
buffers and ``state_dict()`` keys are those of the class as written, and the
model runs unchanged outside a ``Pipe``. Inside one, the pipeline routes each
skip tensor from the stashing partition straight to the popping one.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Generator, Iterable, Iterator, Optional, TypeVar

from torch import Tensor, nn

from pipe.core.microbatch import Batch
from pipe.skip.namespace import Namespace, SkipKey
from pipe.skip.tracker import current_skip_tracker

__all__: list[str] = []

T = TypeVar("T", bound="Skippable")


class stash:
    """The command to stash a skip tensor: ``yield stash(name, tensor)``.

    Args:
        name: the skip's name, declared in ``@skippable(stash=[...])``.
        tensor: the tensor to hand to the layer that pops ``name`` (or ``None``).
    """

    __slots__ = ("name", "tensor")

    def __init__(self, name: str, tensor: Optional[Tensor]) -> None:
        if tensor is not None and not isinstance(tensor, Tensor):
            raise TypeError(
                f"stash({name!r}, ...) got a {type(tensor).__name__}; only a tensor or None can be stashed "
                "(pass other values as part of the layer's output)"
            )
        self.name = name
        self.tensor = tensor


class pop:
    """The command to pop a skip tensor: ``tensor = yield pop(name)``.

    Args:
        name: the skip's name, declared in ``@skippable(pop=[...])``.
    """

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class Skippable(nn.Module):
    """The base of the classes ``@skippable`` makes; see :func:`skippable`."""

    stashable_names: ClassVar[frozenset[str]] = frozenset()
    poppable_names: ClassVar[frozenset[str]] = frozenset()

    def _namespaces(self) -> dict[str, Namespace]:
        return self.__dict__.get("_skip_namespaces", {})

    def namespaced(self, name: str) -> SkipKey:
        """``(namespace, name)``: the key the skip ``name`` of this layer is matched by."""
        return self._namespaces().get(name), name

    def stashable(self) -> Iterator[SkipKey]:
        """The keys this layer stashes."""
        for name in sorted(self.stashable_names):
            yield self.namespaced(name)

    def poppable(self) -> Iterator[SkipKey]:
        """The keys this layer pops."""
        for name in sorted(self.poppable_names):
            yield self.namespaced(name)

    def isolate(self: T, ns: Namespace, *, only: Optional[Iterable[str]] = None) -> T:
        """Puts this layer's skip names (or only those in ``only``) in namespace ``ns``.

        Returns:
            This layer, so that ``Block().isolate(ns)`` can go into an ``nn.Sequential``.

        Raises:
            TypeError: ``ns`` is not a :class:`Namespace`, or ``only`` names a
                skip this layer does not declare.
        """
        if not isinstance(ns, Namespace):
            raise TypeError(f"isolate() takes a pipe.skip.Namespace, got {ns!r}; create one with Namespace()")
        declared = self.stashable_names | self.poppable_names
        names = declared if only is None else set(only)
        unknown = sorted(names - declared)
        if unknown:
            raise TypeError(
                f"isolate(only=...) names {unknown} that {type(self).__name__} does not declare; "
                f"it declares {sorted(declared)}"
            )
        namespaces = dict(self._namespaces())
        for name in names:
            namespaces[name] = ns
        self.__dict__["_skip_namespaces"] = namespaces
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        tracker = current_skip_tracker()
        popped: dict[str, Optional[Tensor]] = {}
        if self.poppable_names:
            batch = Batch(args)
            for ns, name in self.poppable():
                popped[name] = tracker.load(batch, ns, name)
            args = batch.value
        stashed: dict[str, Optional[Tensor]] = {}

        def handle_stash(name: str, tensor: Optional[Tensor]) -> None:
            if name not in self.stashable_names:
                raise TypeError(
                    f"{type(self).__name__} stashed {name!r} but declares stash={sorted(self.stashable_names)}; "
                    f"add {name!r} to @skippable(stash=[...])"
                )
            stashed[name] = tensor

        def handle_pop(name: str) -> Optional[Tensor]:
            if name not in self.poppable_names:
                raise TypeError(
                    f"{type(self).__name__} popped {name!r} but declares pop={sorted(self.poppable_names)}; "
                    f"add {name!r} to @skippable(pop=[...])"
                )
            if name not in popped:
                raise TypeError(f"{type(self).__name__} popped {name!r} twice in one forward; pop each skip once")
            return popped.pop(name)

        output = self._dispatch(super().forward(*args, **kwargs), handle_stash, handle_pop)

        not_stashed = sorted(self.stashable_names - stashed.keys())
        if not_stashed:
            raise TypeError(
                f"{type(self).__name__} declares stash={not_stashed} but did not stash them in this forward; "
                "every declared skip must be stashed in every forward (stash None if there is nothing)"
            )
        if popped:
            raise TypeError(
                f"{type(self).__name__} declares pop={sorted(popped)} but did not pop them in this forward; "
                "every declared skip must be popped in every forward"
            )
        if self.stashable_names:
            batch = Batch(output)
            for ns, name in self.stashable():
                tracker.save(batch, ns, name, stashed[name])
            output = batch.value
        return output

    @staticmethod
    def _dispatch(result: Any, handle_stash: Callable[[str, Optional[Tensor]], None],
                  handle_pop: Callable[[str], Optional[Tensor]]) -> Any:
        if not isinstance(result, Generator):
            return result  # forward returned without a yield
        try:
            command = next(result)
            while True:
                if isinstance(command, stash):
                    handle_stash(command.name, command.tensor)
                    command = next(result)
                elif isinstance(command, pop):
                    command = result.send(handle_pop(command.name))
                else:
                    raise TypeError(
                        f"a skippable forward yielded {command!r}; yield only stash(name, tensor) or pop(name)"
                    )
        except StopIteration as stop:
            return stop.value


def skippable(stash: Iterable[str] = (), pop: Iterable[str] = ()) -> Callable[[type[nn.Module]], type[Skippable]]:
    """Declares the skips a layer class stashes and pops.

    Usage::

        @skippable(stash=["skip"])
        class Stash(nn.Module):
            def forward(self, x):
                yield stash("skip", x)
                return x

    Args:
        stash: names this layer stashes with ``yield stash(name, tensor)``.
        pop: names this layer pops with ``tensor = yield pop(name)``.

    Returns:
        A decorator that returns a subclass of the class (same name, same
        ``state_dict`` keys) whose ``forward`` carries out the skip commands.

    Raises:
        TypeError: a name is not a string, or the decorated object is not an
            ``nn.Module`` class.
    """
    stash_names = _names("stash", stash)
    pop_names = _names("pop", pop)

    def extend(module_cls: type[nn.Module]) -> type[Skippable]:
        if not (isinstance(module_cls, type) and issubclass(module_cls, nn.Module)):
            raise TypeError(f"@skippable decorates an nn.Module class, got {module_cls!r}")
        attrs = {
            "stashable_names": stash_names,
            "poppable_names": pop_names,
            "__module__": module_cls.__module__,
            "__qualname__": module_cls.__qualname__,
            "__doc__": module_cls.__doc__,
        }
        return type(module_cls.__name__, (Skippable, module_cls), attrs)

    return extend


def _names(kind: str, names: Iterable[str]) -> frozenset[str]:
    if isinstance(names, str):
        raise TypeError(f"@skippable({kind}=...) takes a list of names, got the string {names!r}; write {kind}=[{names!r}]")
    names = list(names)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"@skippable({kind}=...) names must be strings, got {name!r}")
    return frozenset(names)


def named_skippables(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, Skippable]]:
    """The skippable layers in ``module`` (itself included), in registration order, with their names."""
    for name, layer in module.named_modules(prefix=prefix):
        if isinstance(layer, Skippable):
            yield name, layer


def verify_skippables(module: nn.Sequential) -> None:
    """Checks that every stash in ``module`` has one later pop and every pop one earlier stash.

    Usage::

        verify_skippables(nn.Sequential(Stash(), nn.Linear(4, 4), Pop()))

    Raises:
        TypeError: listing every unmatched or duplicated name (use
            ``layer.isolate(Namespace())`` to reuse a block that stashes and
            pops the same names).
    """
    stashed: dict[SkipKey, str] = {}
    popped: set[SkipKey] = set()
    problems: list[str] = []
    for layer_name, layer in named_skippables(module):
        for name in sorted(layer.stashable_names & layer.poppable_names):
            problems.append(f"{layer_name!r} declares {name!r} both in stash and in pop")
        for key in layer.stashable():
            name = key[1]
            if name in layer.poppable_names:
                continue
            if key in stashed:
                problems.append(
                    f"{layer_name!r} stashes {name!r} again after {stashed[key]!r} without a namespace "
                    f"(isolate one of them: layer.isolate(pipe.skip.Namespace()))"
                )
                continue
            stashed[key] = layer_name
        for key in layer.poppable():
            name = key[1]
            if name in layer.stashable_names:
                continue
            if key in popped:
                problems.append(
                    f"{layer_name!r} pops {name!r} again without a namespace "
                    f"(isolate one of them: layer.isolate(pipe.skip.Namespace()))"
                )
                continue
            if key not in stashed:
                problems.append(f"{layer_name!r} pops {name!r} but no earlier layer stashes it")
                continue
            popped.add(key)
    for key, layer_name in stashed.items():
        if key not in popped:
            problems.append(f"{layer_name!r} stashes {key[1]!r} but no later layer pops it")
    if problems:
        raise TypeError("stash and pop declarations do not match:\n" + "\n".join(f"* {p}" for p in problems))


def skippables_in(module: nn.Module) -> Iterator[Skippable]:
    """The skippable layers in ``module`` (itself included), in registration order."""
    for _, layer in named_skippables(module):
        yield layer
