"""What docs/migration.md says a user of torchgpipe, torch's ``Pipe`` or fairscale meets, checked by running it.

One test per claim of the page that no other test file checks; the page
names the test files of the others.
"""
import copy
import gc
import re
import warnings
from collections import OrderedDict
from typing import Iterator

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from pipe import NoChunk, Pipe, PipeSequential
from pipe.batchnorm import DeferredBatchNorm, convert_deferred_batch_norm


@pytest.fixture(autouse=True, scope="module")
def _collect_pipes() -> Iterator[None]:
    yield
    gc.collect()  # these tests' Pipes end their worker threads now, not in the middle of a later module


def linear_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


# -- the constructor ----------------------------------------------------------------------


def test_balance_is_keyword_only_and_a_positional_list_says_so() -> None:
    with pytest.raises(TypeError, match=r"got \[2, 3\]; a list in this place was torchgpipe's and fairscale's "
                                        r"balance, which is keyword-only here: pass balance=\[2, 3\]"):
        Pipe(linear_model(), [2, 3])  # type: ignore[arg-type]
    assert Pipe(linear_model(), 4, balance=[2, 3], devices=["cpu", "cpu"]).balance == [2, 3]


@pytest.mark.parametrize("chunks", [4.0, np.int64(4), torch.tensor(4)], ids=["float", "numpy", "tensor"])
def test_chunks_accepts_what_int_would_convert_exactly(chunks: object) -> None:
    piped = Pipe(linear_model(), chunks)  # type: ignore[arg-type]
    assert piped.chunks == 4 and type(piped.chunks) is int


def test_chunks_with_a_fraction_is_refused_not_truncated() -> None:
    # The peers took int(2.5) == 2 without a word.
    with pytest.raises(TypeError, match=r"got 2.5; pass int\(chunks\) if 2 micro-batches is what you meant"):
        Pipe(linear_model(), chunks=2.5)  # type: ignore[arg-type]


def test_without_balance_the_cpu_layers_form_one_partition() -> None:
    # torch's Pipe made one partition per CPU layer; torchgpipe and fairscale required balance.
    piped = Pipe(linear_model(), chunks=2)
    assert piped.balance == [5] and piped.devices == [torch.device("cpu")]


def test_partitions_is_a_plain_list_outside_the_state_dict() -> None:
    model = linear_model()
    piped = Pipe(model, chunks=2, balance=[2, 3], devices=["cpu", "cpu"])
    assert type(piped.partitions) is list and all(type(p) is nn.Sequential for p in piped.partitions)
    assert list(piped.state_dict()) == list(linear_model().state_dict())  # "0.weight", not "partitions.0.0.weight"
    assert len(list(piped.parameters())) == len(list(model.parameters()))


def test_len_and_indexing_count_the_top_level_layers() -> None:
    # torch's Pipe flattened an nn.Sequential layer into its partition, so len() counted its children.
    inner = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    piped = Pipe(nn.Sequential(inner, nn.Linear(4, 2)), chunks=2)
    assert len(piped) == 2 and piped[0] is inner and list(piped) == [inner, piped[1]]


@pytest.mark.parametrize("move", ["to(0)", "to(device=0)", "to('cuda')", "to('cpu')", "cuda()", "cuda(0)", "cpu()",
                                  "to(tensor)"])
def test_moving_raises_the_documented_type_error_without_an_accelerator_too(move: str) -> None:
    piped = Pipe(linear_model(), chunks=2)
    calls = {
        "to(0)": lambda: piped.to(0), "to(device=0)": lambda: piped.to(device=0),
        "to('cuda')": lambda: piped.to("cuda"), "to('cpu')": lambda: piped.to("cpu"),
        "cuda()": lambda: piped.cuda(), "cuda(0)": lambda: piped.cuda(0), "cpu()": lambda: piped.cpu(),
        "to(tensor)": lambda: piped.to(torch.zeros(1, dtype=torch.float64)),
    }
    with pytest.raises(TypeError, match=r"^a Pipe cannot be moved: it places its partitions on pipe.devices"):
        calls[move]()


def test_dtype_changes_are_allowed() -> None:
    piped = Pipe(linear_model(), chunks=2)
    piped.to(torch.float64)
    piped.to(None, torch.float32)
    piped.to(device=None, dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in piped.parameters())


def test_forward_returns_the_output_not_an_rref() -> None:
    x = torch.randn(6, 4)
    output = Pipe(linear_model(), chunks=3)(x)
    assert type(output) is Tensor
    torch.testing.assert_close(output, linear_model()(x))


# -- inputs and outputs ---------------------------------------------------------------------


def test_micro_batches_differ_in_size_by_at_most_one() -> None:
    # The peers used Tensor.chunk: 10 samples in 4 chunks were 3, 3, 3, 1; 6 samples were 3 micro-batches.
    sizes: list[int] = []

    class Record(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            sizes.append(x.size(0))
            return x

    piped = Pipe(nn.Sequential(Record()), chunks=4)
    piped(torch.zeros(10, 1))
    assert sizes == [3, 3, 2, 2]
    sizes.clear()
    piped(torch.zeros(6, 1))
    assert sizes == [2, 2, 1, 1]


class AddBias(nn.Module):
    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        return x + bias


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_no_chunk_gives_every_micro_batch_the_whole_tensor(checkpoint: str) -> None:
    torch.manual_seed(0)
    model = PipeSequential(AddBias(), nn.Linear(3, 3))
    x = torch.randn(8, 3)
    bias = torch.randn(3, requires_grad=True)
    expected = copy.deepcopy(model)(x, bias)
    expected.square().sum().backward()
    expected_grad = bias.grad.clone()
    bias.grad = None
    piped = Pipe(model, chunks=4, checkpoint=checkpoint, balance=[1, 1], devices=["cpu", "cpu"])
    output = piped(x, NoChunk(bias))
    torch.testing.assert_close(output, expected)
    output.square().sum().backward()
    torch.testing.assert_close(bias.grad, expected_grad)  # the sum over the four micro-batches


def test_no_chunk_takes_a_tensor_only() -> None:
    with pytest.raises(TypeError, match=r"NoChunk wraps a tensor, got float"):
        NoChunk(0.5)  # type: ignore[arg-type]


def test_non_tensor_outputs_are_returned_once_or_refused() -> None:
    # torch's Pipe returned a list with one value per micro-batch.
    class Count(nn.Module):
        def forward(self, x: Tensor, flag: str) -> tuple[Tensor, str, int]:
            return x * 2, flag, x.size(0)

    model = PipeSequential(Count())
    with pytest.raises(ValueError, match=r"\(2 in micro-batch 0, 1 in micro-batch 2, .*return it as a tensor"):
        Pipe(model, chunks=3)(torch.zeros(5, 1), "on")  # sizes 2, 2, 1
    x = torch.randn(4, 1)
    output, flag, count = Pipe(model, chunks=2)(x, "on")  # both micro-batches count 2: the value, once
    torch.testing.assert_close(output, x * 2)
    assert flag == "on" and count == 2


# -- deferred batch norm --------------------------------------------------------------------


def _plain_bn_after(batches: list[Tensor]) -> nn.BatchNorm1d:
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(3)
    bn(torch.cat(batches))
    return bn


def test_standalone_deferred_batch_norm_commits_only_when_told() -> None:
    micro = [torch.randn(4, 3) for _ in range(2)]
    torch.manual_seed(0)
    bn = convert_deferred_batch_norm(nn.BatchNorm1d(3))
    for x in micro:
        bn(x)
    assert torch.equal(bn.running_mean, torch.zeros(3))  # nothing committed yet
    bn.commit()
    expected = _plain_bn_after(micro)
    torch.testing.assert_close(bn.running_mean, expected.running_mean)
    torch.testing.assert_close(bn.running_var, expected.running_var)


def test_standalone_deferred_batch_norm_with_chunks_commits_by_itself_as_torchgpipe() -> None:
    micro = [torch.randn(4, 3) for _ in range(4)]
    torch.manual_seed(0)
    model = DeferredBatchNorm.convert_deferred_batch_norm(nn.Sequential(nn.BatchNorm1d(3)), chunks=2)
    bn = model[0]
    assert isinstance(bn, DeferredBatchNorm) and bn.chunks == 2
    model(micro[0])
    assert torch.equal(bn.running_mean, torch.zeros(3))
    model(micro[1])  # the second micro-batch: one update with the statistics of both
    expected = _plain_bn_after(micro[:2])
    torch.testing.assert_close(bn.running_mean, expected.running_mean)
    torch.testing.assert_close(bn.running_var, expected.running_var)
    assert int(bn.num_batches_tracked) == 1


def test_deferred_batch_norm_counting_other_chunks_than_the_pipe_is_refused() -> None:
    model = convert_deferred_batch_norm(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)), chunks=2)
    with pytest.raises(ValueError, match=r"commits by itself after chunks=2 micro-batches but the Pipe runs chunks=4"):
        Pipe(model, chunks=4)
    Pipe(model, chunks=2).close()


# -- parameters shared by partitions --------------------------------------------------------


def test_parameters_shared_by_partitions_on_one_device_are_shared_as_in_the_plain_model() -> None:
    # torch's Pipe and fairscale accepted this when both partitions were on one device; so does pipe.
    torch.manual_seed(0)
    first, last = nn.Linear(4, 4), nn.Linear(4, 4)
    last.weight = first.weight
    plain = nn.Sequential(first, nn.Tanh(), last)
    piped = Pipe(copy.deepcopy(plain), chunks=2, balance=[2, 1], devices=["cpu", "cpu"])
    x = torch.randn(6, 4)
    plain(x).square().sum().backward()
    piped(x).square().sum().backward()
    assert piped[0].weight is piped[2].weight
    for (name, a), (_, b) in zip(plain.named_parameters(), piped.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name
    piped.close()


# -- names -----------------------------------------------------------------------------------


def test_the_names_of_the_table_exist() -> None:
    import pipe.balance
    import pipe.batchnorm
    import pipe.skip

    for name in ("Pipe", "PipeSequential", "NoChunk", "is_checkpointing", "is_recomputing"):
        assert hasattr(pipe, name), name
    for name in ("skippable", "stash", "pop", "Namespace", "verify_skippables"):
        assert hasattr(pipe.skip, name), name
    for name in ("balance_by_time", "balance_by_size", "balance_by_params", "balance_cost"):
        assert hasattr(pipe.balance, name), name
    assert hasattr(pipe.batchnorm, "DeferredBatchNorm") and hasattr(pipe.batchnorm, "convert_deferred_batch_norm")


def test_a_batch_smaller_than_chunks_warns_and_runs() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        output = Pipe(linear_model(), chunks=4)(torch.randn(2, 4))
    assert output.shape == (2, 2)
    assert any("smaller than chunks=4" in str(w.message) for w in caught)


# -- the module Pipe is ----------------------------------------------------------------------


def test_an_empty_model_returns_its_input() -> None:
    x = torch.randn(3, 2)
    assert Pipe(nn.Sequential())(x) is x
    assert Pipe(nn.Sequential(), balance=[])(x) is x


def test_layers_are_children_under_their_names_and_partition_hooks_run() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    piped = Pipe(nn.Sequential(OrderedDict([("a", a), ("b", b)])), chunks=2, balance=[1, 1], devices=["cpu"] * 2)
    assert piped.a is a and {"a", "b"} <= {name for name, _ in piped.named_modules()}
    seen = []
    piped.partitions[1].register_forward_hook(lambda module, args, output: seen.append(output.shape[0]))
    piped(torch.randn(4, 2))
    assert seen == [2, 2]


def test_wrapping_in_pipe_sequential_keeps_the_state_dict_keys() -> None:
    model = nn.Sequential(OrderedDict([("embed", nn.Linear(2, 3)), ("head", nn.Linear(3, 1))]))
    wrapped = PipeSequential(OrderedDict(model.named_children()))
    assert list(wrapped.state_dict()) == list(model.state_dict()) == ["embed.weight", "embed.bias", "head.weight",
                                                                       "head.bias"]


def _peer_layout(model: nn.Sequential, balance: list[int], flatten: bool) -> nn.ModuleDict:
    """A module whose state_dict keys are laid out as a peer's ``partitions`` ModuleList laid them out."""
    layers = list(model.named_children())
    partitions, start = [], 0
    for size in balance:
        chunk = layers[start:start + size]
        start += size
        if flatten:  # torch's Pipe: nested nn.Sequential flattened, names renumbered per partition
            flat = [m for _, layer in chunk for m in (layer.children() if isinstance(layer, nn.Sequential) else [layer])]
            partitions.append(nn.Sequential(*flat))
        else:  # torchgpipe, fairscale: original names
            partitions.append(nn.Sequential(OrderedDict(chunk)))
    return nn.ModuleDict({"partitions": nn.ModuleList(partitions)})


@pytest.mark.parametrize("peer", ["torchgpipe", "torch"])
def test_the_state_dict_recipes_load_a_peers_checkpoint(peer: str) -> None:
    torch.manual_seed(1)
    saved = nn.Sequential(OrderedDict([("stem", nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))),
                                       ("mid", nn.Linear(4, 4)), ("head", nn.Linear(4, 2))]))
    old_state = _peer_layout(saved, [1, 2], flatten=peer == "torch").state_dict()
    assert all(key.startswith("partitions.") for key in old_state)
    torch.manual_seed(2)
    fresh = nn.Sequential(OrderedDict([("stem", nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))),
                                       ("mid", nn.Linear(4, 4)), ("head", nn.Linear(4, 2))]))
    piped = Pipe(fresh, chunks=2)
    if peer == "torchgpipe":
        state = {re.sub(r"^partitions\.\d+\.", "", key): value for key, value in old_state.items()}
    else:
        new_keys = list(piped.state_dict())
        assert len(new_keys) == len(old_state)
        state = dict(zip(new_keys, old_state.values()))
    piped.load_state_dict(state)
    for (name, p), q in zip(saved.state_dict().items(), piped.state_dict().values()):
        assert torch.equal(p, q), name


def test_multi_argument_layers_in_a_plain_sequential_name_pipe_sequential() -> None:
    """torch's Pipe convention in a plain nn.Sequential fails at construction, naming the fix (issue 21)."""
    import re
    from collections import OrderedDict

    from torch import nn

    from pipe import Pipe, PipeSequential

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.linear(x) * mask, mask

    model = nn.Sequential(Masked(), Masked())
    with pytest.raises(TypeError, match=re.escape("layer 0 (Masked) takes 2 arguments (x, mask)")) as raised:
        Pipe(model, chunks=2, balance=[1, 1], devices=["cpu", "cpu"])
    assert "pipe.PipeSequential" in str(raised.value)
    with pytest.raises(TypeError):  # the plain model cannot run it either: the oracle agrees
        model((torch.randn(2, 4), torch.ones(2, 1)))
    piped = Pipe(PipeSequential(OrderedDict(model.named_children())), chunks=2, balance=[1, 1],
                 devices=["cpu", "cpu"])  # the fix the message gives
    out, _ = piped(torch.randn(2, 4), torch.ones(2, 1))
    assert out.shape == (2, 4)
    Pipe(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), balance=[1, 1], devices=["cpu", "cpu"])  # one argument: fine
