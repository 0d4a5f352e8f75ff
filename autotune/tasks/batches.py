"""One walker for the nested batches a task makes and a job feeds: tensors inside dicts, tuples, lists and
namedtuples, on ``torch.utils._pytree``.

The trial moves a batch to its device with it, the accumulator cuts micro-batches with it, ``verify``
casts and slices with it, and the client's local probe makes its batches with it: one set of rules for
what a batch may hold.

- Every container ``torch.utils._pytree`` knows (dict, OrderedDict, defaultdict, tuple, list, namedtuple,
  deque, and whatever a library registered, such as transformers' ``ModelOutput``) is rebuilt as its own
  type around the new tensors.
- A Mapping, tuple or list that pytree does not know (a tokenizer's ``BatchEncoding``, a ``UserDict``, a
  ``dict`` subclass) is walked too and rebuilt as ``type(container)(...)``: batches come as such objects,
  and the walkers this one replaced walked every Mapping, tuple and list.
- Anything else (strings, numbers, None, a ``torch.Size``) is a leaf kept as it is, in every copy.

    >>> batch = {"x": torch.zeros(4, 3), "meta": ("tag", torch.arange(4))}
    >>> cut = samples(batch, 1, 3)
    >>> cut["x"].shape, cut["meta"][0], cut["meta"][1].tolist()
    (torch.Size([2, 3]), 'tag', [1, 2])
    >>> [tuple(t.shape) for t in tensors(batch)]
    [(4, 3), (4,)]
    >>> has_tensor({"ids": [1, 2, 3]})
    False

Imports: torch only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["has_tensor", "map_tensors", "samples", "tensors"]


def _is_shape(value: Any) -> bool:
    # pytree registers torch.Size as a node and rebuilds it as a plain tuple; in a batch it is a fact
    # about one tensor, not a container of data.
    return isinstance(value, torch.Size)


def _unknown_container(leaf: Any) -> bool:
    """A pytree leaf that is still a container: a Mapping, tuple or list of a type pytree does not know."""
    return isinstance(leaf, (Mapping, tuple, list)) and not isinstance(leaf, torch.Size)


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """The batch with every tensor replaced by ``fn(tensor)``, its containers rebuilt around them.

    Args:
        fn: called once per tensor, in the order :func:`tensors` gives them.
        batch: a tensor, or any nesting of containers (see the module docstring) holding tensors and
            other values; the other values are kept as they are.

    Returns:
        A new batch of the same structure and container types (the input is not modified).

    >>> from collections import namedtuple
    >>> Pair = namedtuple("Pair", "inputs labels")
    >>> out = map_tensors(lambda t: t * 2, Pair(torch.ones(2), [torch.ones(1), "keep"]))
    >>> type(out).__name__, out.inputs.tolist(), out.labels[0].tolist(), out.labels[1]
    ('Pair', [2.0, 2.0], [2.0], 'keep')
    """

    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return fn(value)
        if isinstance(value, Mapping) and _unknown_container(value):
            rebuilt = {key: map_tensors(fn, item) for key, item in value.items()}
            return type(value)(rebuilt)  # type: ignore[call-arg]
        if _unknown_container(value):
            return type(value)(map_tensors(fn, item) for item in value)
        return value

    return pytree.tree_map(leaf, batch, is_leaf=_is_shape)


def tensors(batch: Any) -> list[torch.Tensor]:
    """The tensors of a batch, depth first in the containers' own order (a dict's insertion order).

    >>> [t.tolist() for t in tensors([torch.tensor([1]), {"b": torch.tensor([2]), "a": 3}])]
    [[1], [2]]
    """
    found: list[torch.Tensor] = []
    for leaf in pytree.tree_leaves(batch, is_leaf=_is_shape):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif _unknown_container(leaf):
            for item in leaf.values() if isinstance(leaf, Mapping) else leaf:
                found.extend(tensors(item))
    return found


def has_tensor(batch: Any) -> bool:
    """Whether the batch holds at least one tensor anywhere in its nesting.

    >>> has_tensor((1, {"x": torch.zeros(())}))
    True
    """
    return bool(tensors(batch))


def samples(batch: Any, start: int, stop: int) -> Any:
    """Samples ``start`` to ``stop`` of a batch: dim 0 of every tensor that has one (0-dim tensors and
    other values are kept whole in the result).

    >>> samples((torch.arange(5), torch.tensor(7.0), "id"), 1, 3)
    (tensor([1, 2]), tensor(7.), 'id')
    """
    return map_tensors(lambda t: t[start:stop] if t.dim() > 0 else t, batch)
