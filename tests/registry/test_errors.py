"""The core's errors carry a status and no protocol's words: the front ends word them."""

from __future__ import annotations

import asyncio

import pytest

from plugserve.registry.errors import (
    DeadlineExceeded,
    InvalidInput,
    NotFound,
    PluginError,
    RoutesTooDeep,
    StreamingOnly,
    Unavailable,
    first_error,
    one_error,
    ungrouped,
)

PROTOCOL_WORDS = ("HTTP", "gRPC", "/v1", "generate", "ModelStreamInfer", "ModelInfer")


def test_a_single_answer_call_to_a_streaming_route_is_refused_in_neutral_words() -> None:
    refused = StreamingOnly("steps")
    assert isinstance(refused, InvalidInput) and refused.status == 400
    assert refused.route == "steps" and "'steps'" in refused.message
    assert not [word for word in PROTOCOL_WORDS if word in refused.message], refused.message


def group(*errors: BaseException) -> BaseExceptionGroup[BaseException]:
    return BaseExceptionGroup("steps", list(errors))


def test_one_error_of_a_group_the_request_end_first_then_a_fault_then_the_clients() -> None:
    refused, missing = InvalidInput("bad shape"), NotFound("no such route")
    fault, late = PluginError("runner/a@1", KeyError("k")), DeadlineExceeded("passed")
    unavailable, bug = Unavailable("loading"), ValueError("a bug")
    assert one_error(group(refused, missing)) is refused  # all the client's: the first
    assert one_error(group(refused, fault)) is fault
    assert one_error(group(refused, unavailable, bug)) is unavailable
    assert one_error(group(refused, bug)) is bug  # no PlugserveError: a fault
    assert one_error(group(refused, fault, late)) is late
    hung_up = asyncio.CancelledError()
    assert one_error(group(fault, hung_up)) is hung_up
    assert one_error(group(group(refused), group(group(fault)))) is fault  # nested
    assert one_error(refused) is refused  # not a group: itself
    assert first_error([refused, late, fault]) is late


def test_a_group_raised_within_ungrouped_is_raised_as_its_one_error() -> None:
    refused = InvalidInput("bad shape")

    async def refuse() -> None:
        raise refused

    async def steps() -> None:
        with ungrouped():
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(refuse())
                tasks.create_task(asyncio.sleep(5))

    with pytest.raises(InvalidInput) as raised:
        asyncio.run(steps())
    assert raised.value is refused and raised.value.status == 400


def test_routes_nested_too_deep_are_a_fault_not_the_clients() -> None:
    assert RoutesTooDeep("a loop").status == 500
