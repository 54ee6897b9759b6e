"""_values.py's direct_init: a frozen slotted dataclass built through it is the same value as
one built by the dataclass's own __init__, and stays frozen; classes it cannot serve are
refused."""

import dataclasses
import inspect
import pickle
from dataclasses import dataclass, field

import pytest

from omni_trio._values import direct_init
from omni_trio.context import RequestContext
from omni_trio.outputs import OmniOutput, StageInput, StageOutput


@dataclass(frozen=True, slots=True)
class Plain:
    name: str
    size: int = 3
    tags: dict[str, int] = field(default_factory=dict)
    note: str | None = None


@direct_init
@dataclass(frozen=True, slots=True)
class Direct:
    name: str
    size: int = 3
    tags: dict[str, int] = field(default_factory=dict)
    note: str | None = None


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        (("a",), {}),
        (("a", 5), {}),
        (("a", 5, {"x": 1}, "n"), {}),
        ((), {"name": "b", "note": "m"}),
        (("c",), {"tags": {"y": 2}, "size": 0}),
    ],
)
def test_the_same_value_as_the_dataclass_init(args, kwargs):
    direct, plain = Direct(*args, **kwargs), Plain(*args, **kwargs)
    assert dataclasses.astuple(direct) == dataclasses.astuple(plain)
    assert repr(direct).removeprefix("Direct") == repr(plain).removeprefix("Plain")
    assert direct == Direct(*args, **kwargs)
    named = dict(zip(("name", "size", "tags", "note")[: len(args)], args, strict=True))
    unhashed = {**named, **kwargs, "tags": None}
    assert hash(Direct(**unhashed)) == hash(Plain(**unhashed))


def test_a_default_factory_makes_a_new_object_each_time():
    one, two = Direct("a"), Direct("b")
    assert one.tags == {} and one.tags is not two.tags


def test_the_signature_is_the_dataclass_one():
    assert list(inspect.signature(Direct).parameters) == list(inspect.signature(Plain).parameters)
    with pytest.raises(TypeError):
        Direct()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Direct("a", colour="red")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Direct("a", 1, {}, None, "extra")  # type: ignore[call-arg]


def test_it_stays_frozen_and_works_with_replace_and_pickle():
    d = Direct("a", 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.size = 5  # type: ignore[misc]
    assert dataclasses.replace(d, size=5) == Direct("a", 5)
    assert pickle.loads(pickle.dumps(d)) == d


def test_classes_it_cannot_serve_are_refused():
    @dataclass(slots=True)
    class NotFrozen:
        x: int = 0

    @dataclass(frozen=True)
    class NoSlots:
        x: int = 0

    @dataclass(frozen=True, slots=True)
    class PostInit:
        x: int = 0

        def __post_init__(self) -> None:
            pass

    @dataclass(frozen=True, slots=True, kw_only=True)
    class KeywordOnly:
        x: int = 0

    @dataclass(frozen=True, slots=True)
    class NotInInit:
        x: int = field(default=0, init=False)

    for cls in (NotFrozen, NoSlots, PostInit, KeywordOnly, NotInInit, int):
        with pytest.raises(TypeError):
            direct_init(cls)


@pytest.mark.parametrize("cls", [StageInput, StageOutput, OmniOutput, RequestContext])
def test_the_value_classes_take_every_field_in_order(cls):
    # every field, in the dataclass's order, with its default: what the generated __init__ took
    params = inspect.signature(cls).parameters
    fields = dataclasses.fields(cls)
    assert list(params) == [f.name for f in fields]
    for f in fields:
        if f.default is not dataclasses.MISSING:
            assert params[f.name].default == f.default
    values = {f.name: object() for f in fields}
    built = cls(**values)
    assert all(getattr(built, name) is value for name, value in values.items())
    assert cls.__init__.__qualname__ == f"{cls.__qualname__}.__init__"
