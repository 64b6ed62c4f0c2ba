"""The checks every value from outside goes through: numbers, texts, names, nesting, files."""

from pathlib import Path

import pytest

from plugserve.registry import checks
from plugserve.registry.checks import ValueProblem
from plugserve.registry.refs import Ref, is_valid_name
from plugserve.registry.versions import Version

NON_FINITE = [float("inf"), float("-inf"), float("nan"), 1e999]


@pytest.mark.parametrize("value", [*NON_FINITE, 2**64, 10**400, -1, True, "5", None, [1]])
def test_numbers_must_be_finite_and_bounded(value: object) -> None:
    """issue 12, finding 1: inf, nan, 1e999 and huge integers are refused, naming the field."""
    with pytest.raises(ValueProblem, match=r"^rps: must be a finite number") as info:
        checks.number(value, "rps", low=0.0, high=1e6)
    assert info.value.field == "rps"


def test_numbers_in_bounds_pass_typed() -> None:
    assert checks.number(3, "x") == 3.0 and isinstance(checks.number(3, "x"), float)
    assert checks.number(0.5, "x", low=0.0, above=True) == 0.5
    with pytest.raises(ValueProblem, match="> 0"):
        checks.number(0, "x", low=0.0, above=True)


@pytest.mark.parametrize("value", [*NON_FINITE, 1.0, 2**63, -1, True, "1"])
def test_integers_are_ints_in_bounds(value: object) -> None:
    with pytest.raises(ValueProblem, match=r"^n: must be an integer >= 0 and <= 100"):
        checks.integer(value, "n", low=0, high=100)
    assert checks.integer(100, "n", low=0, high=100) == 100


@pytest.mark.parametrize("value", ["a\nb", "a\x00b", "\x1b[31m", "\ud800", "x" * 5000, 5, None])
def test_texts_are_short_strings_without_control_characters(value: object) -> None:
    with pytest.raises(ValueProblem, match=r"^host: must"):
        checks.text(value, "host")


def test_multiline_texts_allow_newlines_and_tabs_only() -> None:
    assert checks.text("a\n\tb", "d", multiline=True) == "a\n\tb"
    with pytest.raises(ValueProblem, match="control characters"):
        checks.text("a\x07", "d", multiline=True)


@pytest.mark.parametrize("name", ["iris\n", "iris\r", "Iris", "", "a" * 65, "ir is", "iris\x00"])
def test_names_match_the_whole_pattern(name: str) -> None:
    """issue 12, finding 16: a trailing newline no longer slips past ``$``."""
    assert not is_valid_name(name)
    with pytest.raises(ValueProblem, match="must match"):
        checks.name(name, "route")


@pytest.mark.parametrize("text", ["1.0.0\n", "1.0.0-rc\n", "\u0661.0.0"])
def test_versions_match_whole_and_ascii_only(text: str) -> None:
    with pytest.raises(ValueError, match="semantic version"):
        Version.parse(text)
    with pytest.raises(ValueError):
        Ref.parse(f"iris@{text}")


def test_unknown_keys_are_listed_with_the_known_ones() -> None:
    with pytest.raises(
        ValueProblem, match=r"runner: unknown key\(s\) \['max_batch_sise'\]; known: a, b"
    ):
        checks.known_keys({"a": 1, "max_batch_sise": 2}, "runner", {"a", "b"})


def test_nesting_is_bounded_without_recursion() -> None:
    deep: list[object] = []
    for _ in range(100_000):  # far past the recursion limit: the walk is iterative
        deep = [deep]
    with pytest.raises(ValueProblem, match="deeper than 32"):
        checks.shallow({"a": deep})
    checks.shallow({"a": [[1]], "b": {"c": {"d": 1}}})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"a = " + b"[" * 500 + b"]" * 500, "deeper than"),
        (b"a = " + b"[" * 40 + b"]" * 40, "deeper than"),
        (b'a = "\xff\xfe"', "not UTF-8"),
        (b"a = ", "invalid TOML"),
        (b"a = 1\na = 2", "invalid TOML"),
    ],
)
def test_toml_failures_are_value_problems(tmp_path: Path, data: bytes, message: str) -> None:
    """issue 12, finding 1: RecursionError and UnicodeDecodeError never escape a TOML read."""
    path = tmp_path / "x.toml"
    path.write_bytes(data)
    with pytest.raises(ValueProblem, match=message):
        checks.read_toml(path)


def test_toml_files_are_bounded_in_size(tmp_path: Path) -> None:
    path = tmp_path / "x.toml"
    path.write_bytes(b"# " + b"x" * checks.MAX_FILE_BYTES)
    with pytest.raises(ValueProblem, match="larger than 16 MiB"):
        checks.read_toml(path)


def test_toml_read_of_a_folder_is_a_value_problem(tmp_path: Path) -> None:
    with pytest.raises(ValueProblem, match="cannot read"):
        checks.read_toml(tmp_path)
    with pytest.raises(FileNotFoundError):
        checks.read_toml(tmp_path / "absent.toml")


@pytest.mark.parametrize(
    "data",
    [b"[" * 100_000, b"[" * 40 + b"]" * 40, b"{", b"\xff", b'{"a": 1' + b"1" * 5000 + b"}"],
)
def test_json_failures_are_value_problems(data: bytes) -> None:
    with pytest.raises(ValueProblem):
        checks.parse_json(data)


def test_json_nan_and_overflow_parse_but_fail_the_number_check() -> None:
    body = checks.parse_json(b'{"a": NaN, "b": 1e999}')
    for key in ("a", "b"):
        with pytest.raises(ValueProblem, match="finite"):
            checks.number(body[key], key)
