"""Checks for values from outside: ``plugin.toml``, ``routes.toml``, the config file, admin bodies.

Every check takes a value and the field it came from, and returns the value
typed or raises :class:`ValueProblem` naming the field. Numbers are finite and
bounded, texts short and free of control characters, nesting shallow. Each
source turns a problem into its own error (a failed load, a 400, a config
error at start), so nothing read from outside escapes as a stray exception.
"""

from __future__ import annotations

import functools
import json
import math
import tomllib
import types
import typing
import unicodedata
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, cast

import annotated_types
import pydantic
from pydantic.fields import FieldInfo

from plugserve.registry.refs import NAME_PATTERN, is_valid_name

MAX_DEPTH = 32
"""Deepest nesting of tables and arrays accepted in a file or body."""
MAX_TEXT = 4096
"""Longest string accepted where no other limit is given."""
MAX_ITEMS = 10_000
"""Longest list or table accepted where no other limit is given."""
MAX_FILE_BYTES = 16 * 1024 * 1024
"""Largest TOML file read (a manifest, ``routes.toml``, the config file)."""
MAX_INTEGER = 2**53
MAX_NUMBER = 1e15


class ValueProblem(ValueError):
    """A value from outside that is not valid: ``field`` says where, ``reason`` what."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}" if field else reason)
        self.field = field
        self.reason = reason


def shown(value: Any) -> str:
    """A short rendering of a bad value for an error message (never the whole of it)."""
    if isinstance(value, bool | int | float):
        text = (
            repr(value) if not isinstance(value, int) or abs(value) < 10**30 else "a huge integer"
        )
        return text
    if isinstance(value, str):
        return repr(value[:40] + "...") if len(value) > 40 else repr(value)
    return f"a {type(value).__name__}"


def number(
    value: Any, field: str, *, low: float = 0.0, high: float = MAX_NUMBER, above: bool = False
) -> float:
    """A finite int or float in ``[low, high]`` (``(low, high]`` when ``above``)."""
    lower = f"> {low:g}" if above else f">= {low:g}"
    wanted = f"must be a finite number {lower} and <= {high:g}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueProblem(field, f"{wanted}, not {shown(value)}")
    if isinstance(value, int) and abs(value) > MAX_INTEGER:
        raise ValueProblem(field, f"{wanted}, not {shown(value)}")
    result = float(value)
    if not math.isfinite(result) or result > high or result < low or (above and result == low):
        raise ValueProblem(field, f"{wanted}, not {shown(value)}")
    return result


def integer(value: Any, field: str, *, low: int = 0, high: int = MAX_INTEGER) -> int:
    """An int (not a bool, not a float) in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueProblem(field, f"must be an integer >= {low} and <= {high}, not {shown(value)}")
    return value


def boolean(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise ValueProblem(field, f"must be true or false, not {shown(value)}")
    return value


def text(value: Any, field: str, *, max_length: int = MAX_TEXT, multiline: bool = False) -> str:
    """A string of at most ``max_length`` characters, without control characters
    (``multiline`` allows newlines and tabs) or unpaired surrogates."""
    if not isinstance(value, str):
        raise ValueProblem(field, f"must be a string, not {shown(value)}")
    if len(value) > max_length:
        raise ValueProblem(field, f"must be at most {max_length} characters, not {len(value)}")
    allowed = "\n\t\r" if multiline else ""
    for char in value:
        if char not in allowed and unicodedata.category(char) in ("Cc", "Cs"):
            raise ValueProblem(field, f"must not hold control characters ({char!r})")
    return value


def relative_path(value: Any, field: str) -> str:
    """A path text the file system can take: at most 1024 characters, each part at most
    255 bytes (longer ones make ``stat`` raise instead of answering "no such file")."""
    path = text(value, field, max_length=1024)
    if any(len(part.encode("utf-8", "surrogatepass")) > 255 for part in path.split("/")):
        raise ValueProblem(field, "has a path part longer than 255 bytes")
    return path


def name(value: Any, field: str) -> str:
    """A plugin or route name: ``[a-z0-9][a-z0-9_-]{0,63}``, nothing before or after."""
    if not isinstance(value, str) or not is_valid_name(value):
        raise ValueProblem(field, f"{shown(value)} must match {NAME_PATTERN}")
    return value


def table(value: Any, field: str, *, max_items: int = MAX_ITEMS) -> Mapping[str, Any]:
    """A table (a TOML table, a JSON object) of at most ``max_items`` keys."""
    if not isinstance(value, dict):
        raise ValueProblem(field, f"must be a table, not {shown(value)}")
    if len(value) > max_items:
        raise ValueProblem(field, f"must have at most {max_items} keys, not {len(value)}")
    return value


def text_list(value: Any, field: str, *, max_items: int = MAX_ITEMS) -> list[str]:
    """A list of strings, each checked by :func:`text`."""
    if not isinstance(value, list) or len(value) > max_items:
        raise ValueProblem(field, f"must be a list of at most {max_items} strings")
    return [text(v, f"{field}[{i}]") for i, v in enumerate(value)]


def known_keys(value: Mapping[str, Any], field: str, known: Iterable[str]) -> None:
    """Refuse keys outside ``known``, listing the known ones (a typo is never ignored)."""
    allowed = set(known)
    unknown = sorted(str(k) for k in set(value) - allowed)
    if unknown:
        raise ValueProblem(field, f"unknown key(s) {unknown}; known: {', '.join(sorted(allowed))}")


def shallow(value: Any, field: str = "", *, max_depth: int = MAX_DEPTH) -> None:
    """Refuse tables and arrays nested deeper than ``max_depth`` (walked without recursion)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth >= max_depth:
                raise ValueProblem(field, f"nests tables or arrays deeper than {max_depth}")
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)


def read_toml(path: Path, max_bytes: int = MAX_FILE_BYTES) -> dict[str, Any]:
    """Read a UTF-8 TOML file of at most ``max_bytes``, no deeper than :data:`MAX_DEPTH`.

    Raises ``FileNotFoundError`` when it is absent (each source decides what
    that means) and :class:`ValueProblem` for anything else that is wrong.
    """
    try:
        with path.open("rb") as f:
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ValueProblem("", f"cannot read: {exc.strerror or exc}") from None
    if len(data) > max_bytes:
        raise ValueProblem("", f"larger than {max_bytes / (1024 * 1024):g} MiB")
    return parse_toml(data)


def parse_toml(data: bytes) -> dict[str, Any]:
    """Parse TOML bytes; any failure (encoding, syntax, nesting) is a :class:`ValueProblem`."""
    try:
        raw = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueProblem("", f"not UTF-8 (byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueProblem("", f"invalid TOML: {exc}") from None
    except RecursionError:
        raise ValueProblem("", f"nests tables or arrays deeper than {MAX_DEPTH}") from None
    except (ValueError, OverflowError, MemoryError) as exc:
        raise ValueProblem("", f"invalid TOML: {type(exc).__name__}: {exc}") from None
    shallow(raw)
    return raw


def parse_json(data: bytes, *, strict: bool = False) -> Any:
    """Parse JSON bytes; any failure (encoding, syntax, nesting) is a :class:`ValueProblem`.

    Lenient by default (``NaN`` and ``1e999`` parse, so the field's own check
    can name them); ``strict`` wants UTF-8 and finite numbers only, for stored
    state (etcd values, the runtime routes file) that no check reads after.
    """
    try:
        if not strict:
            value = json.loads(data)
        else:
            value = json.loads(
                data.decode("utf-8"), parse_constant=_refuse_constant, parse_float=_finite_float
            )
    except UnicodeDecodeError as exc:
        raise ValueProblem("", f"not UTF-8 (byte {exc.start})") from None
    except ValueProblem:
        raise
    except RecursionError:
        raise ValueProblem("", f"nests objects or arrays deeper than {MAX_DEPTH}") from None
    except (ValueError, OverflowError, MemoryError) as exc:
        raise ValueProblem("", f"invalid JSON: {exc}") from None
    shallow(value)
    return value


def _refuse_constant(name: str) -> Any:
    raise ValueProblem("", f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueProblem("", f"the number {text[:40]} is out of range")
    return value


# -- a schema's errors, in these words -------------------------------------------------------

KINDS: dict[type, str] = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    Path: "a path (a string)",
    list: "a list",
    dict: "a table",
}
"""A value's type in words, for "must be ..., not ..."."""
_BOUND_ERRORS = frozenset(
    {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number"}
)


def described(value: Any) -> str:
    """A wrong value and what it is, for a message: ``a string ("abc")``."""
    shown_value = json.dumps(value) if isinstance(value, str) else repr(value)
    if len(shown_value) > 40:
        shown_value = shown_value[:37] + "..."
    return f"{KINDS.get(type(value), 'a ' + type(value).__name__)} ({shown_value})"


def kind_of(annotation: Any, *, within: bool = False) -> str:
    """What a field of ``annotation`` must be, in words: ``an integer``, ``a, b or c``
    (a choice among others quoted: ``an integer or 'auto'``)."""
    annotation = bare(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        choices = [repr(c) if within else str(c) for c in typing.get_args(annotation)]
        return _either(choices)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        words = [kind_of(a, within=len(members) > 1) for a in members]
        return " or ".join(dict.fromkeys(words))
    if typing.get_origin(annotation) in (list, tuple, set, frozenset):
        return "a list"
    if typing.get_origin(annotation) in (dict, Mapping):
        return "a table"
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return "a table"
    if isinstance(annotation, type):
        return KINDS.get(annotation, annotation.__name__)
    return str(annotation)


def bare(annotation: Any) -> Any:
    """``Annotated[T, ...]`` as ``T``."""
    return (
        typing.get_args(annotation)[0]
        if typing.get_origin(annotation) is typing.Annotated
        else annotation
    )


def _either(words: list[str]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def schema_problems(error: pydantic.ValidationError, model: type[pydantic.BaseModel]) -> list[str]:
    """Each field's first validation error in this module's words, naming the field as the
    hand-written checks do: ``port must be an integer, not a string ("x")``, ``port: must be
    an integer >= 0 and <= 65535, not 70000``; a validator's own ``ValueError`` as it says."""
    found: dict[str, str] = {}
    for item in _telling(error.errors(include_url=False), model):
        name, field = _located(item["loc"], model)
        if name in found:
            continue
        kind, value, context = item["type"], item.get("input"), item.get("ctx") or {}
        if kind == "value_error" and isinstance(context.get("error"), ValueProblem):
            problem = context["error"]  # said of the value: named here, where it is
            where = f"{name}.{problem.field}" if problem.field else name
            found[name] = f"{where}: {problem.reason}"
        elif kind == "value_error" and "error" in context:
            found[name] = str(context["error"])
        elif kind == "extra_forbidden":
            key, known = item["loc"][-1], _fields_at(item["loc"][:-1], model)
            where = f"{name}: " if name != key else ""
            found[name] = f"{where}unknown key(s) {[key]}; known: {', '.join(known)}"
        elif kind == "missing":
            found[name] = f"{name}: is required"
        elif kind == "string_pattern_mismatch":
            found[name] = f"{name}: must match {context.get('pattern')}, not {shown(value)}"
        elif kind in _LENGTH_ERRORS:
            least, most = context.get("min_length"), context.get("max_length")
            items = "characters" if kind.startswith("string") else "items"
            bound = f"at least {least}" if kind.endswith("short") else f"at most {most}"
            said = "must not be empty" if least == 1 else f"must have {bound} {items}"
            found[name] = f"{name}: {said}"
        elif kind in _BOUND_ERRORS and field is not None:
            found[name] = f"{name}: {wanted(field)}, not {shown(value)}"
        elif field is not None and (kind.endswith("_type") or kind in _CHOICE_ERRORS):
            found[name] = f"{name} must be {kind_of(field.annotation)}, not {described(value)}"
        else:
            found[name] = f"{name}: {item['msg']}"
    return list(found.values())


_LENGTH_ERRORS = frozenset({"too_short", "too_long", "string_too_short", "string_too_long"})
_CHOICE_ERRORS = frozenset({"literal_error", "int_from_float", "enum"})


def _telling(errors: list[Any], model: type[pydantic.BaseModel]) -> list[Any]:
    """The errors, those of a union's member whose type the value has first: for a field of
    a text or a list, a list too long says more than "not a text"."""
    typed = ("_type", "literal_error", "model_attributes_type", "dict_type", "list_type")

    names = [_located(item["loc"], model)[0] for item in errors]
    first = {name: names.index(name) for name in names}
    order = sorted(
        range(len(errors)),
        key=lambda i: (first[names[i]], errors[i]["type"].endswith(typed)),
    )
    return [errors[i] for i in order]


def _located(
    loc: tuple[int | str, ...], model: type[pydantic.BaseModel]
) -> tuple[str, FieldInfo | None]:
    """An error's field, as ``a.b[2].c``, and its declaration: the parts of ``loc`` that
    name a field or an index (a union's member tags are left out)."""
    name, field, fields = "", None, model.model_fields
    for part in loc:
        if isinstance(part, int):
            name += f"[{part}]"
        elif part in fields:
            field = fields[part]
            name = f"{name}.{part}" if name else str(part)
            nested = _model_in(field.annotation)
            fields = nested.model_fields if nested is not None else {}
    return name, field


def _fields_at(loc: tuple[int | str, ...], model: type[pydantic.BaseModel]) -> list[str]:
    """The field names of the table ``loc`` leads to."""
    fields = model.model_fields
    for part in loc:
        if isinstance(part, str) and part in fields:
            nested = _model_in(fields[part].annotation)
            fields = nested.model_fields if nested is not None else {}
    return list(fields)


def _model_in(annotation: Any) -> type[pydantic.BaseModel] | None:
    """The model a field holds (itself, or in a list, dict or union), if any."""
    stack = [annotation]
    while stack:
        item = bare(stack.pop())
        if isinstance(item, type) and issubclass(item, pydantic.BaseModel):
            return item
        stack.extend(typing.get_args(item))
    return None


def wanted(field: FieldInfo) -> str:
    """A number field's bounds in words, as :func:`integer` and :func:`number` say them
    (the bounds of a union's number member, for a field that may be a number)."""
    numeric = (annotated_types.Ge, annotated_types.Gt, annotated_types.Le)
    base, bounds = field.annotation, [b for b in field.metadata if isinstance(b, numeric)]
    if not bounds:
        for member in typing.get_args(field.annotation):
            if typing.get_origin(member) is typing.Annotated:
                base, *extra = typing.get_args(member)
                for item in extra:
                    bounds.extend(item.metadata if isinstance(item, FieldInfo) else [item])
                break
    return _bounds_wanted(base, bounds)


def _bounds_wanted(base: Any, bounds: Iterable[Any]) -> str:
    """The words of :func:`wanted` for a number of type ``base`` within ``bounds``."""
    low: float = -MAX_INTEGER
    high: float = MAX_INTEGER
    above = False
    for bound in bounds:
        if isinstance(bound, annotated_types.Ge):
            low = bound.ge  # type: ignore[assignment]
        elif isinstance(bound, annotated_types.Gt):
            low, above = bound.gt, True  # type: ignore[assignment]
        elif isinstance(bound, annotated_types.Le):
            high = bound.le  # type: ignore[assignment]
    if bare(base) is int:
        return f"must be an integer >= {int(low)} and <= {int(high)}"
    return f"must be a finite number {'>' if above else '>='} {low:g} and <= {high:g}"


def field_problems(
    error: pydantic.ValidationError, model: type[pydantic.BaseModel]
) -> list[ValueProblem]:
    """Each field's first validation error as a :class:`ValueProblem` in this module's
    words (``must be an integer >= 0 and <= 8, not -1``, ``must be one of a, b``), its
    field dotted (``a.b[2].c``): an item of a list of values is named by its list, a bad
    key by its table. A table's unknown keys make one problem, worded as
    :func:`known_keys` words it; a validator's :class:`ValueProblem` keeps its reason,
    its field named under the one that failed."""
    found: dict[str, str] = {}
    unknown: dict[str, tuple[list[str], tuple[str, ...]]] = {}
    for item in error.errors(include_url=False):
        field, annotation, known = _placed(item["loc"], model)
        kind, value, context = item["type"], item.get("input"), item.get("ctx") or {}
        if kind == "extra_forbidden":
            unknown.setdefault(field, ([], known))[0].append(str(item["loc"][-1]))
            found.setdefault(field, "")
            continue
        reason = _reason(kind, annotation, value, context) or item["msg"]
        cause = context.get("error")
        if kind == "value_error" and isinstance(cause, ValueProblem):
            field, reason = dotted(field, cause.field), cause.reason
        elif kind == "value_error" and cause is not None:
            reason = str(cause)
        found.setdefault(field, reason)
    for field, (keys, known) in unknown.items():
        found[field] = f"unknown key(s) {sorted(keys)}; known: {', '.join(sorted(known))}"
    return [ValueProblem(field, reason) for field, reason in found.items()]


def dotted(field: str, inner: str) -> str:
    """``inner`` (``x``, ``[2]``, ``x.y``: a validator's field) named under ``field``."""
    if not inner or not field:
        return field or inner
    return field + inner if inner.startswith("[") else f"{field}.{inner}"


def _placed(
    loc: tuple[int | str, ...], model: type[pydantic.BaseModel]
) -> tuple[str, Any, tuple[str, ...]]:
    """An error's field, its declared type (``Annotated`` with its bounds) and the keys of
    the table it names (for an unknown key)."""
    name, annotation = "", cast(Any, None)
    holder: type[pydantic.BaseModel] | None = model
    for index, part in enumerate(loc):
        bare = _core(annotation)
        origin = typing.get_origin(bare)
        if isinstance(part, int) and origin in (list, tuple):
            annotation = typing.get_args(bare)[0]
            scalar = _model_in(annotation) is None
            name = name if scalar and index == len(loc) - 1 else f"{name}[{part}]"
        elif origin in (dict, Mapping) and isinstance(part, str):
            key, annotation = typing.get_args(bare)
            if loc[index + 1 : index + 2] == ("[key]",):
                return name, key, ()
            name = dotted(name, part)
        elif holder is not None and isinstance(part, str) and part in holder.model_fields:
            field = holder.model_fields[part]
            name = dotted(name, part)
            annotation = (
                Annotated[(field.annotation, *field.metadata)]
                if field.metadata
                else field.annotation
            )
        else:  # a union's member tag, or an unknown key
            continue
        holder = _model_in(annotation)
    return name, annotation, tuple(holder.model_fields) if holder is not None else ()


def _core(annotation: Any) -> Any:
    """``Annotated[T | None, ...]`` as ``T``."""
    while True:
        inner = bare(annotation)
        if typing.get_origin(inner) in (typing.Union, types.UnionType):
            members = [a for a in typing.get_args(inner) if a is not type(None)]
            inner = members[0] if len(members) == 1 else inner
        if inner is annotation:
            return inner
        annotation = inner


def _bounds(annotation: Any) -> list[Any]:
    """The constraints of ``Annotated`` types in ``annotation`` (``T | None`` too), those of
    a ``Field(...)`` among them included."""
    found: list[Any] = []
    while True:
        if typing.get_origin(annotation) is typing.Annotated:
            for item in typing.get_args(annotation)[1:]:
                found.extend(item.metadata if isinstance(item, FieldInfo) else [item])
            annotation = typing.get_args(annotation)[0]
        elif _core(annotation) is not annotation:
            annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
        else:
            return found


_KINDS_WANTED = {
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "tuple_type": "a list",
    "dict_type": "a table",
    "model_type": "a table",
    "model_attributes_type": "a table",
}
"""What a value must be, by the type of the error a value of another type gets."""


def _reason(kind: str, annotation: Any, value: Any, context: Mapping[str, Any]) -> str | None:
    """What a value of ``annotation`` must be, for a pydantic error of type ``kind``."""
    if kind == "missing":
        return "is required"
    if kind == "string_too_long":
        return f"must be at most {context['max_length']} characters, not {len(value)}"
    if kind == "string_unicode":
        return "must not hold unpaired surrogates"
    if kind == "too_long":
        return f"must hold at most {context['max_length']} items, not {context['actual_length']}"
    if kind == "literal_error":
        return f"must be one of {', '.join(str(c) for c in typing.get_args(_core(annotation)))}"
    if kind in _BOUND_ERRORS or kind in ("int_type", "float_type"):
        return f"{_bounds_wanted(_core(annotation), _bounds(annotation))}, not {shown(value)}"
    wanted_kind = _KINDS_WANTED.get(kind)
    return None if wanted_kind is None else f"must be {wanted_kind}, not {shown(value)}"


def with_docstrings(*models: type[pydantic.BaseModel]) -> None:
    """Give the fields of ``models``, and of the models their fields hold, their attribute
    docstrings (the string under each field) as descriptions, and rebuild them, for what
    reads descriptions: a JSON Schema, ``--help``. Each module's source is parsed once, here
    and not when the models are defined: a process that never shows a schema never
    parses it."""
    found: list[type[pydantic.BaseModel]] = []
    stack = list(models)
    while stack:
        model = stack.pop()
        if model in found:
            continue
        found.append(model)
        for field in model.model_fields.values():
            for item in _models_in(field.annotation):
                stack.append(item)
    by_module: dict[str, dict[str, dict[str, str]]] = {}
    for model in found:
        docs = by_module.get(model.__module__)
        if docs is None:
            docs = by_module[model.__module__] = _attribute_docs(model.__module__)
        for klass in model.__mro__:
            for name, doc in docs.get(klass.__qualname__, {}).items():
                declared = model.model_fields.get(name)
                if declared is not None and declared.description is None:
                    declared.description = doc
    for model in reversed(found):  # what a model holds first
        model.model_rebuild(force=True)


def _models_in(annotation: Any) -> list[type[pydantic.BaseModel]]:
    found, stack = [], [annotation]
    while stack:
        item = bare(stack.pop())
        if isinstance(item, type) and issubclass(item, pydantic.BaseModel):
            found.append(item)
        else:
            stack.extend(typing.get_args(item))
    return found


@functools.cache
def _attribute_docs(module: str) -> dict[str, dict[str, str]]:
    """``{class name: {field: its docstring}}`` of a module's classes."""
    import ast
    import inspect
    import sys

    tree = ast.parse(inspect.getsource(sys.modules[module]))
    docs: dict[str, dict[str, str]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        fields = docs.setdefault(node.name, {})
        for this, after in zip(node.body, node.body[1:], strict=False):
            documented = (
                isinstance(this, ast.AnnAssign)
                and isinstance(this.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            )
            if documented:
                fields[this.target.id] = inspect.cleandoc(after.value.value)  # type: ignore[attr-defined]
    return docs
