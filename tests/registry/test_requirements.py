"""``[plugin] requires``: alternatives, markers, and advice that never installs a second
distribution of an import, against the distributions installed in this environment."""

import importlib.metadata
from pathlib import Path

import pytest
import tomli_w

from plugserve.registry.errors import ManifestError, PluginLoadError
from plugserve.registry.manifest import load_manifest
from plugserve.registry.requirements import (
    RequirementTextError,
    check_installed,
    parse_entry,
    split_alternatives,
    unmet,
)

ABSENT = "plugserve-no-such-package"
"""A distribution that is installed nowhere."""
LABEL = "runner/iris@1.0.0"


def failure(*requires: str) -> str:
    """The load error ``requires`` gets here."""
    with pytest.raises(PluginLoadError) as info:
        check_installed(LABEL, requires)
    return info.value.message


def manifest_folder(plugins_dir: Path, requires: list[str]) -> Path:
    folder = plugins_dir / "runner" / "iris" / "1.0.0"
    folder.mkdir(parents=True)
    head = "[plugin]\nname='iris'\nversion='1.0.0'\ntype='runner'\n"
    text = head + tomli_w.dumps({"requires": requires}) + "[runner]\nbackend='onnxruntime'\n"
    (folder / "plugin.toml").write_text(text)
    return folder


@pytest.mark.parametrize(
    "entry",
    [
        f"{ABSENT}>=1 | numpy>=1",
        f"numpy>=1 | {ABSENT}>=1",
        f"{ABSENT} | {ABSENT}-two | numpy",
        f"numpy>=1|{ABSENT}",  # no spaces needed
    ],
)
def test_an_entry_is_met_by_any_one_installed_alternative(entry: str) -> None:
    assert unmet([entry]) == []
    check_installed(LABEL, [entry])


def test_none_installed_advises_the_first_alternative_and_names_the_others() -> None:
    entry = f"{ABSENT}>=2 | {ABSENT}-two<3 | {ABSENT}-three"
    message = failure(entry)
    assert message.startswith(f"{LABEL} requires what the server's environment lacks: {entry} (")
    assert f"the others: {ABSENT}-two<3, {ABSENT}-three" in message
    assert message.endswith(f"pip install '{ABSENT}>=2'")
    assert message.count("pip install") == 1


def test_an_alternative_installed_in_another_version_is_the_one_to_change() -> None:
    """Not a second distribution beside it: the installed alternative's own version."""
    numpy = importlib.metadata.version("numpy")
    (found,) = unmet([f"{ABSENT}>=1 | numpy<1"])
    assert found.why == f"numpy {numpy} installed"
    assert found.install == "numpy<1"
    message = failure(f"{ABSENT}>=1 | numpy<1")
    assert message.endswith("pip install 'numpy<1'") and f"pip install '{ABSENT}" not in message


def test_a_plain_requirement_keeps_its_advice() -> None:
    numpy = importlib.metadata.version("numpy")
    message = failure("numpy>=1", "numpy<1", f"{ABSENT}>=2", "pywin32; sys_platform == 'nonesuch'")
    assert message == (
        f"{LABEL} requires what the server's environment lacks: numpy<1 (numpy {numpy} "
        f"installed); {ABSENT}>=2 (not installed). Install it where plugserve runs: "
        f"pip install 'numpy<1' '{ABSENT}>=2'"
    )


def test_an_import_installed_by_another_distribution_is_never_installed_twice() -> None:
    """``pillow-simd`` installs ``PIL`` as ``pillow`` (installed with plugserve) does: the
    advice accepts pillow in the manifest, and installs nothing beside it."""
    pillow = importlib.metadata.version("pillow")
    (found,) = unmet(["pillow-simd>=9"])
    assert found.install is None and found.why == f"PIL installed by pillow {pillow}"
    message = failure("pillow-simd>=9", f"{ABSENT}")
    assert f"pillow-simd>=9 (PIL installed by pillow {pillow})" in message
    assert 'accept pillow in the manifest: requires = ["pillow-simd>=9 | pillow>=9"].' in message
    assert message.endswith(f"pip install {ABSENT}") and message.count("pip install") == 1
    # The entry the advice gives is met.
    assert unmet(["pillow-simd>=9 | pillow>=9"]) == []


def test_an_installed_provider_too_old_is_upgraded_not_doubled() -> None:
    message = failure("pillow-simd>=9999")
    assert 'requires = ["pillow-simd>=9999 | pillow>=9999"], and upgrade it: ' in message
    assert message.endswith("pip install 'pillow>=9999'.")
    assert "pip install 'pillow-simd" not in message


@pytest.mark.parametrize(
    ("wanted", "installed"),
    [
        ("opencv-python>=4", "opencv-python-headless"),
        ("opencv-python-headless>=4", "opencv-python"),
    ],
)
def test_the_other_opencv_build_is_accepted_rather_than_installed(
    wanted: str, installed: str
) -> None:
    """Both builds install ``cv2``; the one not installed here is never advised."""
    try:
        importlib.metadata.version(installed)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{installed} is not installed here")
    (found,) = unmet([wanted])
    assert found.install is None and found.why.startswith(f"cv2 installed by {installed} ")
    assert f'requires = ["{wanted} | {installed}>=4"]' in found.instead
    assert unmet([f"{wanted} | {installed}>=4"]) == []


def test_what_an_installed_distribution_provides_is_read_from_its_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A distribution no list knows: its ``.dist-info`` says it installs the import that
    the requirement's distribution would (its own name)."""
    info = tmp_path / "site" / "plugserve_fake_provider-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: plugserve-fake-provider\nVersion: 1.0\n"
    )
    (info / "top_level.txt").write_text("plugserve_wanted\n")
    (found,) = unmet(["plugserve-wanted>=1"])
    assert found.install == "plugserve-wanted>=1"  # nothing installs it yet
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    (found,) = unmet(["plugserve-wanted>=1"])
    assert found.install is None
    assert found.why == "plugserve_wanted installed by plugserve-fake-provider 1.0"
    assert '"plugserve-wanted>=1 | plugserve-fake-provider>=1"' in found.instead
    assert "upgrade" not in found.instead  # 1.0 meets >=1
    assert unmet(["plugserve-wanted>=1 | plugserve-fake-provider>=1"]) == []


def test_each_alternative_has_its_own_marker() -> None:
    """An alternative whose marker does not apply here is left out; an entry with none
    left is met."""
    nowhere = "sys_platform == 'nonesuch'"
    assert unmet([f"{ABSENT}; {nowhere} | numpy"]) == []
    assert unmet([f"{ABSENT}; {nowhere}", f"{ABSENT}; {nowhere} | {ABSENT}-two; {nowhere}"]) == []
    (found,) = unmet([f"numpy; {nowhere} | {ABSENT}"])  # numpy is installed, but not for here
    assert found.install == ABSENT and found.why == "not installed"


def test_a_bar_inside_a_marker_string_separates_nothing() -> None:
    assert split_alternatives("a; platform_release == 'x|y' | b") == [
        "a; platform_release == 'x|y' ",
        " b",
    ]
    (requirement,) = parse_entry("numpy; platform_release == 'x|y'").alternatives
    assert requirement.name == "numpy"


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("numpy >>> 1", "'numpy >>> 1' is not a requirement: "),
        ("numpy | x >>> 1", "'numpy | x >>> 1' (alternative 'x >>> 1') is not a requirement: "),
        ("numpy |", "'numpy |' is not a requirement: an alternative is empty"),
        ("| numpy", "'| numpy' is not a requirement: an alternative is empty"),
        ("numpy || x", "'numpy || x' is not a requirement: an alternative is empty"),
        ("numpy | x; python_version ~= 'abc'",
         "(alternative \"x; python_version ~= 'abc'\") has a marker that cannot be evaluated"),
    ],
)  # fmt: skip
def test_a_bad_alternative_is_the_manifests_error_naming_the_entry(
    plugins_dir: Path, entry: str, message: str
) -> None:
    with pytest.raises(RequirementTextError) as parsed:
        parse_entry(entry)
    assert message in str(parsed.value)
    with pytest.raises(ManifestError) as info:
        load_manifest(manifest_folder(plugins_dir, ["numpy", entry]))
    assert info.value.fields["field"] == "plugin.requires[1]"
    assert message in info.value.message
    with pytest.raises(PluginLoadError, match="is not a requirement|cannot be evaluated"):
        check_installed(LABEL, [entry])  # the load refuses it too, never crashes


def test_a_manifest_keeps_its_entries_as_written(plugins_dir: Path) -> None:
    requires = ["opencv-python-headless>=4 | opencv-python>=4", "numpy>=1; sys_platform != 'x'"]
    assert load_manifest(manifest_folder(plugins_dir, requires)).requires == tuple(requires)
