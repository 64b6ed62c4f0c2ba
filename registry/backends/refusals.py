"""Which backend errors refuse a request's inputs rather than say the runner is broken.

ONNX Runtime raises ``InvalidArgument`` when the inputs do not fit the model (a dimension,
a datatype, an index out of range) and ``Fail`` when a kernel finds its inputs' shapes
inconsistent at run time (a MatMul whose inner dimensions, symbolic under different names,
differ; a broadcast, a concat, a reshape that cannot be done). Those are the request's
fault: a 400 for it alone, never counted by the runner's circuit breaker. Errors about the
session, its provider, the device or memory stay the runner's (a 500 the breaker counts).

Nothing here imports ONNX Runtime: an exception is recognised by its class's module (or,
from a run through IOBinding, a ``RuntimeError`` in its words).
"""

from __future__ import annotations

import re

ORT_ERRORS = "onnxruntime.capi.onnxruntime_pybind11_state"
BOUND_RUN = "Error in execution: "
"""How ``run_with_iobinding`` words a failed run: a plain ``RuntimeError``, no status."""
MAX_MESSAGE = 300
"""The longest backend text a client is shown (the rest is cut, with an ellipsis)."""

_HEADER = re.compile(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ")
_NODE = re.compile(
    r"Non-zero status code returned while running (?P<op>\w+) node\. "
    r"Name:'[^']*' Status Message: (?P<text>.*)",
    re.S,
)
_SOURCE = re.compile(
    r"(?:\S*/)?[\w.-]+\.(?:h|hpp|cc|cpp|cu|cuh):\d+ "  # file:line
    r"(?:(?:[\w:*&<>~]+ )?[\w:~<>]+\([^)]*\)(?: const)? (?:\[with [^\]]*\] )?|\w+ )"  # the function
)
_CONDITION = re.compile(r"^[^.]*? was false\. ")
_RUNNER_FAULT = re.compile(
    r"alloc|memory|cuda|cudnn|cublas|tensorrt|provider|device|stream", re.IGNORECASE
)
_INPUT_FAULT = re.compile(
    r"dimension|shape|broadcast|mismatch|must match|must equal|not equal|out of (?:data )?bounds"
    r"|reshape|rank|indices|index|out of range|invalid input|expected",
    re.IGNORECASE,
)


def ort_refusal(exc: BaseException) -> str | None:
    """The trimmed message of an ONNX Runtime error that refuses the inputs; ``None`` for any
    other exception (one of the runner's own)."""
    kind = type(exc)
    message = str(exc).strip()
    if kind is RuntimeError and message.startswith(BOUND_RUN):
        status, message = "Fail", message.removeprefix(BOUND_RUN)  # IOBinding's words for it
    elif kind.__module__ == ORT_ERRORS and kind.__name__ in ("InvalidArgument", "Fail"):
        status, message = kind.__name__, _HEADER.sub("", message)
    else:
        return None
    node = _NODE.search(message)
    op, text = (node["op"], _readable(node["text"])) if node else (None, _readable(message))
    if _RUNNER_FAULT.search(text):
        return None
    if status == "Fail" and (node is None or not _INPUT_FAULT.search(text)):
        return None
    return trimmed(f"{op}: {text}" if op else text)


def _readable(text: str) -> str:
    """``text`` without the source file, line and function, nor an assertion's condition."""
    text = _SOURCE.sub("", text)
    text = _CONDITION.sub("", text.strip())
    return " ".join(text.split())


def trimmed(text: str) -> str:
    """At most :data:`MAX_MESSAGE` characters of ``text``."""
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 1] + "…"
