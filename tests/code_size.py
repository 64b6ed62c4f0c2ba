"""How large the application's code is, and where: ``python -m tests.code_size [--top N]``.

Counts the lines of the app's Python (``plugserve/``, ``server/``, ``registry/`` and the
bundled ``plugins/``; blank lines and comments included, as a reader meets them), then
lists the modules over ``MODULE_LINES`` and the classes over ``CLASS_LINES`` lines or
``CLASS_METHODS`` methods, the targets a module or class is held to. Generated code
(a ``generated/`` folder) is left out.
"""

from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
APP = ("plugserve", "server", "registry", "plugins")
MODULE_LINES = 600
CLASS_LINES = 350
CLASS_METHODS = 25


@dataclass(frozen=True)
class ClassSize:
    where: str
    name: str
    lines: int
    methods: int


GENERATED = "generated"
"""A folder of generated code (gRPC's stubs): not counted."""


def modules() -> list[Path]:
    return sorted(p for top in APP for p in (ROOT / top).rglob("*.py") if GENERATED not in p.parts)


def classes(path: Path) -> list[ClassSize]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
            methods = sum(
                isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) for item in node.body
            )
            found.append(
                ClassSize(
                    str(path.relative_to(ROOT)),
                    node.name,
                    node.end_lineno - node.lineno + 1,
                    methods,
                )
            )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=15, help="how many of each to list")
    args = parser.parse_args()
    paths = modules()
    lines = {p: len(p.read_text().splitlines()) for p in paths}
    by_top = {
        top: sum(n for p, n in lines.items() if p.parts[len(ROOT.parts)] == top) for top in APP
    }
    print(f"app: {sum(lines.values()):,} lines in {len(paths)} modules "
          f"({', '.join(f'{top}/ {n:,}' for top, n in by_top.items())})")  # fmt: skip
    large = sorted(((n, p) for p, n in lines.items() if n > MODULE_LINES), reverse=True)
    print(f"\nmodules over {MODULE_LINES} lines: {len(large)}")
    for n, p in large[: args.top]:
        print(f"  {n:>5}  {p.relative_to(ROOT)}")
    sizes = [c for p in paths for c in classes(p)]
    big = sorted(
        (c for c in sizes if c.lines > CLASS_LINES or c.methods > CLASS_METHODS),
        key=lambda c: c.lines,
        reverse=True,
    )
    print(f"\nclasses over {CLASS_LINES} lines or {CLASS_METHODS} methods: {len(big)}")
    for c in big[: args.top]:
        print(f"  {c.lines:>5} lines {c.methods:>3} methods  {c.name} ({c.where})")


if __name__ == "__main__":
    main()
