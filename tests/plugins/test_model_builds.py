"""models/embed/build.py and models/chat/build.py: offline, deterministic, and what they build works."""

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

from tests.plugins.bundled import MODELS


def build(name: str, out: Path) -> Path:
    subprocess.run(
        [sys.executable, str(MODELS / name / "build.py"), str(out)],
        check=True,
        timeout=60,
        capture_output=True,
    )
    return out


def script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"build_{name}", MODELS / name / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_embed_build_is_deterministic_and_gives_the_committed_files(tmp_path: Path) -> None:
    one, two = build("embed", tmp_path / "one"), build("embed", tmp_path / "two")
    for file in ("model.onnx", "tokenizer.json"):
        assert (one / file).read_bytes() == (two / file).read_bytes()
        assert (one / file).read_bytes() == (MODELS / "embed/1" / file).read_bytes(), file
    assert (one / "model.onnx").stat().st_size < 1.5 * 2**20
    tokenizer = Tokenizer.from_file(str(one / "tokenizer.json"))
    ids = np.array([tokenizer.encode("Rain tomorrow").ids], dtype=np.int64)
    session = ort.InferenceSession(str(one / "model.onnx"), providers=["CPUExecutionProvider"])
    (hidden,) = session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})
    assert hidden.shape == (1, ids.shape[1], 64) and np.isfinite(hidden).all()


def test_the_chat_build_is_deterministic_and_answers_like_its_dialogues(tmp_path: Path) -> None:
    one, two = build("chat", tmp_path / "one"), build("chat", tmp_path / "two")
    for file in ("model.onnx", "tokenizer.json"):
        assert (one / file).read_bytes() == (two / file).read_bytes()
    assert (one / "tokenizer.json").read_bytes() == (MODELS / "chat/1/tokenizer.json").read_bytes()
    assert (one / "model.onnx").stat().st_size < 2 * 2**20
    chat = script("chat")
    prompt = chat.render([("user", "What is the capital of Italy?")], prompt=True)
    assert chat.greedy(one, prompt) == "The capital of Italy is Rome.<|end|>"
    assert chat.greedy(MODELS / "chat/1", prompt) == chat.greedy(one, prompt)
