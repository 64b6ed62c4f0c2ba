"""Generate ``server/grpc_api/generated`` from Triton's .proto files in ``protos/``.

The .proto files are Triton's own, unchanged, from triton-inference-server/common
(``protobuf/``); the generated modules are committed, so that installing plugserve
needs no protoc. Regenerate after replacing a .proto (needs ``grpcio-tools``)::

    python -m plugserve.server.grpc_api.generate

A test (tests/server/grpc_api/test_service.py) fails when the committed modules are
not what this produces; the generator's version is pinned in the ``test`` extra
(``grpcio-tools``), since each version writes its own header, and the runtime must
be at least the protobuf the generator was made for (``install_requires``).
protoc writes ``import model_config_pb2``, which works only with the folder on
``sys.path``; the imports are rewritten to the package's.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
PROTOS = HERE / "protos"
GENERATED = HERE / "generated"
PACKAGE = "plugserve.server.grpc_api.generated"
PROTO_FILES = ("model_config.proto", "grpc_service.proto", "health.proto")
_BARE_IMPORT = re.compile(r"^import (\w+_pb2) as", re.MULTILINE)


def generate(into: Path) -> list[Path]:
    """Write the modules for every .proto into ``into``; return the files written."""
    from grpc_tools import protoc  # a development dependency only

    with tempfile.TemporaryDirectory() as scratch:
        for proto in PROTO_FILES:
            code = protoc.main(
                [
                    "protoc",
                    f"-I{PROTOS}",
                    f"-I{Path(protoc.__file__).parent / '_proto'}",
                    f"--python_out={scratch}",
                    f"--pyi_out={scratch}",
                    f"--grpc_python_out={scratch}",
                    str(PROTOS / proto),
                ]
            )
            if code != 0:
                raise RuntimeError(f"protoc failed on {proto} (exit {code})")
        into.mkdir(parents=True, exist_ok=True)
        written = []
        for path in sorted(Path(scratch).iterdir()):
            text = _BARE_IMPORT.sub(rf"from {PACKAGE} import \1 as", path.read_text())
            (into / path.name).write_text(text)
            written.append(into / path.name)
        return written


def main() -> None:
    for path in generate(GENERATED):
        sys.stdout.write(f"{path}\n")


if __name__ == "__main__":
    main()
