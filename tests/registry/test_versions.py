import pytest

from plugserve.registry.versions import Version


@pytest.mark.parametrize(
    "ordered",
    [
        ["0.9.9", "1.0.0-alpha", "1.0.0-alpha.1", "1.0.0-alpha.beta", "1.0.0-beta.2",
         "1.0.0-beta.11", "1.0.0-rc.1", "1.0.0", "1.0.1", "1.2.0", "1.10.0", "2.0.0"],
    ],
)  # fmt: skip
def test_semver_ordering_is_numeric_and_prerelease_sorts_below_release(ordered: list[str]) -> None:
    parsed = [Version.parse(v) for v in reversed(ordered)]
    assert [str(v) for v in sorted(parsed)] == ordered


def test_versions_compare_as_numbers_not_strings() -> None:
    assert Version.parse("1.10.0") > Version.parse("1.9.0")
    assert max(Version.parse(v) for v in ["1.2.0", "1.10.0", "1.9.9"]) == Version.parse("1.10.0")


@pytest.mark.parametrize("bad", ["1", "1.0", "01.0.0", "1.0.0.0", "v1.0.0", "1.0.0-", "", "a.b.c"])
def test_invalid_versions_are_rejected(bad: str) -> None:
    with pytest.raises(ValueError, match="semantic version"):
        Version.parse(bad)


def test_model_versions_accept_integers_and_keep_their_spelling() -> None:
    versions = sorted(Version.parse_model(v) for v in ["2", "10", "1", "3.0.1"])
    assert [str(v) for v in versions] == ["1", "2", "3.0.1", "10"]
    with pytest.raises(ValueError):
        Version.parse_model("0")


def test_equal_versions_hash_alike() -> None:
    assert len({Version.parse("1.0.0"), Version(1, 0, 0)}) == 1
