"""The one batch walker (autotune.tasks.batches): every container the trial, the accumulator, verify and
the client's local probe met keeps its type and its other values, and the tensors are found in order."""

from __future__ import annotations

import doctest
from collections import OrderedDict, UserDict, defaultdict, namedtuple
from typing import Any

import pytest
import torch

import autotune.tasks.batches as batches_module
from autotune.loop.accumulate import batch_size, split_batch
from autotune.measure.trial import move_to_device
from autotune.tasks.batches import has_tensor, map_tensors, samples, tensors

Pair = namedtuple("Pair", "inputs labels")


class Encoding(UserDict):  # type: ignore[type-arg]
    """A tokenizer's BatchEncoding in miniature: a Mapping that is no dict, read by key or attribute."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self.data[name]
        except KeyError:
            raise AttributeError(name) from None


class Features(dict):  # type: ignore[type-arg]
    """A dict subclass torch.utils._pytree does not know."""


class Row(list):  # type: ignore[type-arg]
    """A list subclass torch.utils._pytree does not know."""


def test_the_doctests_hold() -> None:
    failures, tried = doctest.testmod(batches_module)
    assert (failures, tried >= 8) == (0, True)


@pytest.mark.parametrize(
    "make",
    [
        lambda x, y: {"x": x, "y": y},
        lambda x, y: OrderedDict(x=x, y=y),
        lambda x, y: (x, y),
        lambda x, y: [x, y],
        lambda x, y: Pair(x, y),
        lambda x, y: Encoding(x=x, y=y),
        lambda x, y: Features(x=x, y=y),
        lambda x, y: Row([x, y]),
    ],
    ids=["dict", "OrderedDict", "tuple", "list", "namedtuple", "Mapping", "dict-subclass", "list-subclass"],
)
def test_every_container_keeps_its_type_around_the_new_tensors(make: Any) -> None:
    batch = make(torch.arange(6).reshape(3, 2), torch.tensor([1.0, 2.0, 3.0]))
    doubled = map_tensors(lambda t: t * 2, batch)
    assert type(doubled) is type(batch)
    assert [t.tolist() for t in tensors(doubled)] == [[[0, 2], [4, 6], [8, 10]], [2.0, 4.0, 6.0]]
    # The input is left as it was.
    assert [t.tolist() for t in tensors(batch)] == [[[0, 1], [2, 3], [4, 5]], [1.0, 2.0, 3.0]]
    assert batch_size(batch) == 3
    assert [batch_size(piece) for piece in split_batch(batch, 2)] == [2, 1]
    assert all(type(piece) is type(batch) for piece in split_batch(batch, 2))


def test_a_mapping_that_is_no_dict_stays_itself_to_the_loss() -> None:
    batch = Encoding(input_ids=torch.ones(4, 8, dtype=torch.long), attention_mask=torch.ones(4, 8))
    moved = move_to_device(batch, torch.device("meta"))
    assert isinstance(moved, Encoding)
    assert moved.input_ids.device.type == "meta" and moved.input_ids.dtype == torch.long
    assert moved.attention_mask.device.type == "meta"
    assert batch.input_ids.device.type == "cpu"


def test_a_defaultdict_keeps_its_default() -> None:
    batch: defaultdict[str, Any] = defaultdict(lambda: "missing", x=torch.zeros(2))
    cut = samples(batch, 0, 1)
    assert isinstance(cut, defaultdict) and cut["absent"] == "missing"
    assert cut["x"].shape == (1,)


def test_other_values_are_kept_in_every_copy() -> None:
    batch = {
        "ids": torch.arange(4),
        "scale": torch.tensor(0.5),  # 0-dim: no batch dimension, kept whole in every piece
        "name": "wiki",
        "epoch": 3,
        "mask": None,
        "shape": torch.Size([4, 16]),
        "nested": [("tag", torch.ones(4, 2)), {"weights": (1.0, 2.0)}],
    }
    pieces = split_batch(batch, 3)
    assert [p["ids"].tolist() for p in pieces] == [[0, 1, 2], [3]]
    for piece in pieces:
        assert piece["scale"].item() == 0.5 and piece["scale"].dim() == 0
        assert (piece["name"], piece["epoch"], piece["mask"]) == ("wiki", 3, None)
        assert type(piece["shape"]) is torch.Size and piece["shape"] == (4, 16)
        assert piece["nested"][0][0] == "tag" and piece["nested"][1] == {"weights": (1.0, 2.0)}
    assert [p["nested"][0][1].shape[0] for p in pieces] == [3, 1]


def test_tensors_come_depth_first_in_the_containers_order() -> None:
    a, b, c, d = (torch.tensor([n]) for n in range(4))
    batch = {"z": (a, Encoding(q=b, p=[c])), "a": Pair(d, "label")}
    assert [t.item() for t in tensors(batch)] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("batch", "found"),
    [
        (torch.zeros(()), True),
        ({"ids": [1, 2, 3], "text": "no tensor"}, False),
        (Encoding(ids=[torch.zeros(1)]), True),
        (Row([None, ("a", torch.zeros(1))]), True),
        ((), False),
        (None, False),
    ],
)
def test_has_tensor_looks_everywhere(batch: Any, found: bool) -> None:
    assert has_tensor(batch) is found
