"""Lay out examples/captcha ready to serve: ddddocr's two models and character list from
its installed package, the example's plugins, and the bundled image_decode's code in its
two preprocessors.

    pip install --no-deps ddddocr==1.6.1     # its models; onnxruntime, Pillow, OpenCV beside
    python examples/captcha/prepare.py       # into examples/captcha/build/

It writes ``<dest>/models/captcha-ocr/1/`` (``model.onnx``: ddddocr's default OCR model,
``charset.json``: its characters), ``<dest>/models/captcha-det/1/model.onnx`` (its
detector) and ``<dest>/plugins/``: this folder's ``plugins/``, with the code of
``plugins/preprocessor/image_decode/1.1.0/`` copied into each preprocessor folder whose
``plugin.toml`` configures it. Nothing is downloaded, and no model enters the repository.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
IMAGE_DECODE = HERE.parents[1] / "plugins" / "preprocessor" / "image_decode" / "1.1.0"
MODELS = {"captcha-ocr": "common_old.onnx", "captcha-det": "common_det.onnx"}
"""Our model names, and ddddocr's files (``DdddOcr()`` reads ``common_old.onnx``;
``DdddOcr(det=True)`` reads ``common_det.onnx``)."""
DECODERS = ("captcha_ocr_input", "captcha_det_input")


def prepare(dest: Path) -> Path:
    """Write the models and plugins into ``dest``; returns it."""
    try:
        import ddddocr
    except ImportError:
        sys.exit("pip install --no-deps ddddocr==1.6.1 first")
    package = Path(ddddocr.__file__).parent
    for name, file in MODELS.items():
        target = dest / "models" / name / "1" / "model.onnx"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(package / file, target)
    charset = ddddocr.DdddOcr(show_ad=False).get_charset()
    text = json.dumps(charset, ensure_ascii=False)
    (dest / "models" / "captcha-ocr" / "1" / "charset.json").write_text(text, encoding="utf-8")
    plugins = dest / "plugins"
    shutil.copytree(
        HERE / "plugins", plugins, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in DECODERS:
        for module in IMAGE_DECODE.glob("*.py"):
            shutil.copyfile(module, plugins / "preprocessor" / name / "1.0.0" / module.name)
    return dest


if __name__ == "__main__":
    print(prepare(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "build"))
