"""``[plugin] requires``: what a plugin needs installed, checked against this environment,
with advice that cannot break it.

An entry is a PEP 508 requirement (``"pillow>=10"``), or several separated by ``|``
(``"opencv-python-headless>=4 | opencv-python>=4"``): alternatives, any one of which
satisfies the entry. Each alternative is a whole requirement with its own marker; an
alternative whose marker does not apply here is left out, and an entry none of whose
alternatives applies is met.

Several distributions can install one import name (``cv2`` from ``opencv-python`` or
``opencv-python-headless``; ``PIL`` from ``pillow`` or ``pillow-simd``), and two of them
in one environment overwrite each other's files. So an unmet entry whose import is
already installed by another distribution is never answered with a ``pip install``:
the advice names what provides it and how to accept it in the manifest.
"""

from __future__ import annotations

import importlib.metadata
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

import tomli_w
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from plugserve.registry.errors import PluginLoadError

SEPARATOR = "|"
"""Between the alternatives of one entry; PEP 508 has no ``|`` outside a quoted string."""

KNOWN_IMPORTS: Mapping[str, tuple[str, ...]] = {
    "cv2": ("opencv-python", "opencv-python-headless", "opencv-contrib-python",
            "opencv-contrib-python-headless"),
    "onnxruntime": ("onnxruntime", "onnxruntime-gpu", "onnxruntime-directml",
                    "onnxruntime-openvino", "onnxruntime-qnn"),
    "PIL": ("pillow", "pillow-simd"),
    "tensorflow": ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-macos",
                   "tensorflow-intel"),
    "psycopg2": ("psycopg2", "psycopg2-binary"),
    "faiss": ("faiss-cpu", "faiss-gpu"),
    "paddle": ("paddlepaddle", "paddlepaddle-gpu"),
    "cupy": ("cupy", "cupy-cuda11x", "cupy-cuda12x"),
}  # fmt: skip
"""Import names that several distributions install, each a build of one project: what
an uninstalled distribution would install is read here (an installed one's files say it
themselves). A distribution not listed is taken to install its own name
(``scikit-learn``: ``scikit_learn``), which finds no clash where there is none."""


class RequirementTextError(ValueError):
    """An entry that is no requirement, or whose marker cannot be evaluated here."""


@dataclass(frozen=True)
class Entry:
    """One ``requires`` entry: its text as written and its alternatives, in order."""

    text: str
    alternatives: tuple[Requirement, ...]

    def applicable(self) -> tuple[Requirement, ...]:
        """The alternatives whose marker applies here (all those without one)."""
        return tuple(r for r in self.alternatives if r.marker is None or r.marker.evaluate())


@dataclass(frozen=True)
class Unmet:
    """An entry this environment does not satisfy, and what to do about it."""

    entry: str
    why: str
    """What is installed instead: ``not installed`` (and the other alternatives),
    ``numpy 2.1.0 installed``, or the distribution that installs the entry's import."""
    install: str | None
    """The requirement to ``pip install``; ``None`` where installing it would put a second
    distribution of an import beside the installed one."""
    instead: str = ""
    """Where ``install`` is ``None``: what to do instead, a sentence."""


def parse_entry(text: str) -> Entry:
    """``text`` parsed whole, each alternative's marker evaluated here, as
    :func:`unmet` evaluates it. Raises :class:`RequirementTextError` naming the entry
    (and the alternative, in an entry of several)."""
    parts = [part.strip() for part in split_alternatives(text)]
    alternatives = []
    for part in parts:
        if not part:
            raise RequirementTextError(f"{text!r} is not a requirement: an alternative is empty")
        subject = repr(text) if len(parts) == 1 else f"{text!r} (alternative {part!r})"
        try:
            requirement = Requirement(part)
        except ValueError as exc:  # InvalidRequirement (specifier, marker, URL)
            raise RequirementTextError(f"{subject} is not a requirement: {exc}") from None
        try:
            if requirement.marker is not None:
                requirement.marker.evaluate()
        except ValueError as exc:  # UndefinedComparison, UndefinedEnvironmentName, InvalidVersion
            raise RequirementTextError(
                f"{subject} has a marker that cannot be evaluated: {type(exc).__name__}: {exc}"
            ) from None
        alternatives.append(requirement)
    return Entry(text, tuple(alternatives))


def split_alternatives(text: str) -> list[str]:
    """``text`` cut at each ``|`` outside a quoted string (a marker's ``'a|b'`` stays whole)."""
    parts, start, quote = [], 0, ""
    for index, char in enumerate(text):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == SEPARATOR:
            parts.append(text[start:index])
            start = index + 1
    parts.append(text[start:])
    return parts


def check_installed(label: str, requires: Iterable[str]) -> None:
    """Raise :class:`PluginLoadError` for plugin ``label`` when this environment does not
    satisfy every entry of ``requires``: each unmet entry listed with what is installed,
    what to do for an entry whose import another distribution already installs, then
    the one ``pip install`` of the rest."""
    try:
        missing = unmet(requires)
    except RequirementTextError as exc:  # the manifest check parsed it already
        raise PluginLoadError(f"{label}: requires {exc}") from None
    if missing:
        raise PluginLoadError(advice(label, missing))


def unmet(requires: Iterable[str]) -> list[Unmet]:
    """The entries of ``requires`` this environment does not satisfy, in order. Raises
    :class:`RequirementTextError` for an entry :func:`parse_entry` refuses."""
    environment = _Environment()
    found = []
    for text in requires:
        applicable = parse_entry(text).applicable()
        if applicable and not any(environment.satisfies(r) for r in applicable):
            found.append(environment.unmet(text, applicable))
    return found


def advice(label: str, missing: list[Unmet]) -> str:
    """The error text for ``missing``: what is lacking, what to do where an install would
    double an import, then the one ``pip install`` of everything else."""
    listed = "; ".join(f"{m.entry} ({m.why})" for m in missing)
    text = f"{label} requires what the server's environment lacks: {listed}."
    for m in missing:
        if m.install is None:
            text += f" {m.instead}"
    installs = [m.install for m in missing if m.install is not None]
    if installs:
        command = " ".join(shlex.quote(i) for i in installs)
        text += f" Install it where plugserve runs: pip install {command}"
    return text


class _Environment:
    """The installed distributions, as ``importlib.metadata`` reads them; which
    distribution installs each import is read once, on the first unmet entry."""

    def version(self, name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    def satisfies(self, requirement: Requirement) -> bool:
        have = self.version(requirement.name)
        if have is None:
            return False
        try:
            return requirement.specifier.contains(have, prereleases=True)
        except ValueError:  # an installed version that is not PEP 440 meets no specifier
            return not requirement.specifier

    @cached_property
    def providers(self) -> dict[str, list[str]]:
        """Import name to the installed distributions that install it."""
        found: dict[str, list[str]] = {}
        for name, dists in importlib.metadata.packages_distributions().items():
            found[name] = list(dict.fromkeys(canonicalize_name(d) for d in dists))
        return found

    def unmet(self, text: str, applicable: tuple[Requirement, ...]) -> Unmet:
        """Why ``text`` is unmet, and the advice: upgrade an alternative that is installed
        in another version; where none is, but another distribution installs its import,
        install nothing; otherwise install the first alternative."""
        for requirement in applicable:
            have = self.version(requirement.name)
            if have is not None:
                return Unmet(text, f"{requirement.name} {have} installed", str(requirement))
        named = {canonicalize_name(r.name) for r in applicable}
        for requirement in applicable:
            for module in _imports(requirement.name):
                others = [d for d in self.providers.get(module, []) if d not in named]
                if others:
                    return self._clash(text, requirement, module, others[0])
        first, others = applicable[0], [str(r) for r in applicable[1:]]
        why = "not installed" if not others else f"none installed; the others: {', '.join(others)}"
        return Unmet(text, why, str(first))

    def _clash(self, text: str, wanted: Requirement, module: str, provider: str) -> Unmet:
        """``text`` unmet while ``provider`` installs ``module``, the import ``wanted`` would."""
        have = self.version(provider) or "?"
        accepted = Requirement(str(wanted))  # the same versions and marker, another name
        accepted.name = provider
        either = f"{text.strip()} {SEPARATOR} {accepted}"
        shown = tomli_w.dumps({"v": either}).removeprefix("v = ").strip()  # a TOML string
        instead = (
            f"For {text!r}: {module} is installed by {provider} {have}, and a second "
            f"distribution of {module} would overwrite its files, so install nothing; "
            f"accept {provider} in the manifest: requires = [{shown}]"
        )
        if not self.satisfies(accepted):
            accepted.marker = None
            instead += f", and upgrade it: pip install {shlex.quote(str(accepted))}"
        return Unmet(text, f"{module} installed by {provider} {have}", None, instead + ".")


def _imports(name: str) -> tuple[str, ...]:
    """The import names distribution ``name`` installs (:data:`KNOWN_IMPORTS`, else its
    own name as an identifier)."""
    canonical = canonicalize_name(name)
    known = tuple(m for m, dists in KNOWN_IMPORTS.items() if canonical in dists)
    return known or (canonical.replace("-", "_"),)
