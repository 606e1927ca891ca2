"""nn.ModuleList that knows its items' type. torch types every item of a ModuleList as `Module`, and a Module's
unknown attributes as `Tensor | Module`, so to a type checker `stack.layers[i].rows(...)` is a call on a tensor;
this list says what it holds. At run time it is an nn.ModuleList (the same state_dict keys, the same repr)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar, cast, overload

from torch import nn

M = TypeVar("M", bound=nn.Module)


class ModuleList(nn.ModuleList, Generic[M]):
    """A ModuleList of `M`s: iteration and indexing give `M` (slicing a ModuleList of them)."""

    def __init__(self, modules: Iterable[M] = ()) -> None:
        super().__init__(modules)

    # the casts only restate what the constructor put in: torch's own signatures say Module
    def __iter__(self) -> Iterator[M]:
        return cast(Iterator[M], super().__iter__())

    @overload
    def __getitem__(self, idx: slice) -> ModuleList[M]: ...

    @overload
    def __getitem__(self, idx: int) -> M: ...

    def __getitem__(self, idx: int | slice) -> M | ModuleList[M]:
        return cast("M | ModuleList[M]", super().__getitem__(idx))
