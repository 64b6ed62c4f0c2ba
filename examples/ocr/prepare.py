"""Copy RapidOCR's three PP-OCR models from its installed package into ``models/``.

    pip install rapidocr-onnxruntime==1.4.4
    python examples/ocr/prepare.py

The models (Apache-2.0, by PaddleOCR, as rapidocr-onnxruntime ships them) land in
``examples/ocr/models/ocr-{det,cls,rec}/1/model.onnx``, where the example's runners
name them (``model = "models:ocr-det"``).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

MODELS = {
    "ocr-det": "ch_PP-OCRv4_det_infer.onnx",
    "ocr-cls": "ch_ppocr_mobile_v2.0_cls_infer.onnx",
    "ocr-rec": "ch_PP-OCRv4_rec_infer.onnx",
}


def prepare(dest: Path) -> Path:
    """Copy the models into ``dest`` (a models folder); returns it."""
    try:
        import rapidocr_onnxruntime
    except ImportError:
        sys.exit("pip install rapidocr-onnxruntime==1.4.4 first")
    source = Path(rapidocr_onnxruntime.__file__).parent / "models"
    for name, file in MODELS.items():
        target = dest / name / "1" / "model.onnx"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / file, target)
    return dest


if __name__ == "__main__":
    print(prepare(Path(__file__).parent / "models"))
