"""The core's errors carry a status and no protocol's words: the front ends word them."""

from __future__ import annotations

from plugserve.registry.errors import InvalidInput, StreamingOnly

PROTOCOL_WORDS = ("HTTP", "gRPC", "/v1", "generate", "ModelStreamInfer", "ModelInfer")


def test_a_single_answer_call_to_a_streaming_route_is_refused_in_neutral_words() -> None:
    refused = StreamingOnly("steps")
    assert isinstance(refused, InvalidInput) and refused.status == 400
    assert refused.route == "steps" and "'steps'" in refused.message
    assert not [word for word in PROTOCOL_WORDS if word in refused.message], refused.message
