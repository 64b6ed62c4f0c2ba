"""Build the bundled text-generation example: models/chat/1/{tokenizer.json,model.onnx}.

    python models/chat/build.py [OUT_DIR]     # default: models/chat/1 (a few seconds)

Offline, deterministic (seeded; the same bytes on a rerun on the same machine) and
without torch: ``tokenizers``, ``onnx.helper``, numpy and ONNX Runtime.

- ``tokenizer.json``: a byte-level BPE tokenizer (any text encodes; 500 entries)
  with the special tokens ``<|end|>`` (end of a message: the model's EOS),
  ``<|user|>``, ``<|assistant|>`` and ``<|system|>``, TRAINED on dialogues.txt
  beside this script rendered in the chat template (each message
  ``<|role|>\\ncontent<|end|>\\n``; a prompt ends ``<|assistant|>\\n``; the
  ``chat_template`` preprocessor renders requests the same way).
- ``model.onnx``: an echo-state network, a real next-token predictor whose step
  costs the same at any length: token embedding (64) -> ONNX ``GRU`` (256) with
  fixed RANDOM weights (seed 16) -> a linear readout to the logits that is
  TRAINED: ridge regression (numpy, closed form) from the GRU's states over
  the dialogues to the next token, its scale 3 times the one that fits them
  best (``SHARPEN``). Inputs ``input_ids`` int64 [B, T] and ``state`` float32 [B, 256] (zeros
  to begin); outputs ``logits`` float32 [B, V] (of the last position) and
  ``state_out`` float32 [B, 256]. One graph serves a prompt's prefill (B = 1,
  T = its length) and a batched step (T = 1, B = streams).

It knows the few dozen dialogues it was fitted on and little else: at
temperature 0 it answers their questions with their answers (or a blend of
them) and ends with ``<|end|>``. A real causal LM in its place is exported
with its KV cache (docs/plugins.md, "Exporting a real model").
"""

import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.trainers import BpeTrainer

HERE = Path(__file__).resolve().parent
SEED = 16
VOCAB = 500
EMBED = 64
HIDDEN = 256
RIDGE = 1e-2
SHARPEN = 3.0
"""Logits are this many times sharper than the scale that fits the training text best:
a model this small compounds its errors, and at the fitted scale sampling at temperature 1
leaves its dialogues within a few tokens (3 of 50 samples were one of its answers; 36 of 50
at 3 times sharper). Greedy decoding does not change."""
SPECIAL = ["<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
EOS = "<|end|>"


def render(messages: list[tuple[str, str]], prompt: bool = False) -> str:
    """The chat template: ``<|role|>\\ncontent<|end|>\\n`` per message; a prompt adds
    ``<|assistant|>\\n`` for the model to go on from."""
    text = "".join(f"<|{role}|>\n{content}{EOS}\n" for role, content in messages)
    return text + "<|assistant|>\n" if prompt else text


def dialogues() -> list[str]:
    """dialogues.txt: blank-line separated dialogues of ``role: content`` lines, rendered."""
    found = []
    for block in (HERE / "dialogues.txt").read_text(encoding="utf-8").split("\n\n"):
        lines = [line.split(": ", 1) for line in block.strip().splitlines()]
        found.append(render([(role, content) for role, content in lines]))
    return found


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """Byte-level BPE: every byte is a token, so any text encodes and decodes back."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def reservoir(rng: np.random.Generator, vocab: int) -> dict[str, np.ndarray]:
    """The fixed random weights: embedding and GRU (ONNX gate order z, r, h).

    Update-gate biases spread over [-2, 3] give units memories from one token to
    tens of tokens; the recurrent weights are scaled to a spectral radius near 1.
    """
    embedding = rng.standard_normal((vocab, EMBED)).astype(np.float32)
    w = rng.standard_normal((1, 3 * HIDDEN, EMBED)) / np.sqrt(EMBED)
    r = rng.standard_normal((1, 3 * HIDDEN, HIDDEN)) * (1.0 / np.sqrt(HIDDEN))
    bias = np.zeros((1, 6 * HIDDEN))
    bias[0, :HIDDEN] = rng.uniform(-2.0, 3.0, HIDDEN)  # update gate z
    bias[0, 2 * HIDDEN : 3 * HIDDEN] = rng.standard_normal(HIDDEN) * 0.2
    return {
        "embedding": embedding,
        "W": w.astype(np.float32),
        "R": r.astype(np.float32),
        "B": bias.astype(np.float32),
    }


def graph(
    weights: dict[str, np.ndarray], readout: tuple[np.ndarray, np.ndarray] | None
) -> onnx.ModelProto:
    """The serving graph (``readout`` given) or, without it, one that outputs every
    position's state (``states`` [T, B, H]) to fit the readout on."""
    inits = [numpy_helper.from_array(value, name) for name, value in weights.items()]
    inits.append(numpy_helper.from_array(np.array([0], np.int64), "axis0"))
    nodes = [
        helper.make_node("Gather", ["embedding", "input_ids"], ["embedded"]),  # [B, T, E]
        helper.make_node("Transpose", ["embedded"], ["sequence"], perm=[1, 0, 2]),  # [T, B, E]
        helper.make_node("Unsqueeze", ["state", "axis0"], ["initial_h"]),  # [1, B, H]
        helper.make_node(
            "GRU",
            ["sequence", "W", "R", "B", "", "initial_h"],
            ["all_h", "last_h"],
            hidden_size=HIDDEN,
            linear_before_reset=1,
        ),
        helper.make_node("Squeeze", ["last_h", "axis0"], ["state_out"]),  # [B, H]
    ]
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["B", "T"])
    state = helper.make_tensor_value_info("state", TensorProto.FLOAT, ["B", HIDDEN])
    state_out = helper.make_tensor_value_info("state_out", TensorProto.FLOAT, ["B", HIDDEN])
    if readout is None:
        nodes.append(helper.make_node("Squeeze", ["all_h", "axis1"], ["states"]))
        inits.append(numpy_helper.from_array(np.array([1], np.int64), "axis1"))
        outputs = [helper.make_tensor_value_info("states", TensorProto.FLOAT, ["T", "B", HIDDEN])]
    else:
        nodes[3].output[0] = ""  # the serving graph needs only the last state
        weight, bias = readout
        inits += [
            numpy_helper.from_array(weight, "readout_w"),
            numpy_helper.from_array(bias, "readout_b"),
        ]
        nodes.append(helper.make_node("MatMul", ["state_out", "readout_w"], ["scores"]))
        nodes.append(helper.make_node("Add", ["scores", "readout_b"], ["logits"]))
        logits = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", weight.shape[1]])
        outputs = [logits, state_out]
    model = helper.make_model(
        helper.make_graph(nodes, "chat", [ids, state], outputs, inits),
        opset_imports=[helper.make_opsetid("", 17)],
        producer_name="plugserve",
    )
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def fit_readout(
    states: np.ndarray, targets: np.ndarray, vocab: int
) -> tuple[np.ndarray, np.ndarray]:
    """Ridge regression from states [n, H] to one-hot next tokens, then the logit scale
    (one number) that minimizes the cross-entropy of the training text, times ``SHARPEN``."""
    x = np.hstack([states, np.ones((len(states), 1))]).astype(np.float64)
    y = np.zeros((len(states), vocab))
    y[np.arange(len(states)), targets] = 1.0
    gram = x.T @ x + RIDGE * len(states) / HIDDEN * np.eye(x.shape[1])
    solved = np.linalg.solve(gram, x.T @ y)
    scores = x @ solved

    def nll(scale: float) -> float:
        z = scores * scale
        z -= z.max(axis=1, keepdims=True)
        return float(np.mean(np.log(np.exp(z).sum(axis=1)) - z[np.arange(len(z)), targets]))

    scale = min(np.arange(1.0, 40.0, 0.5), key=nll) * SHARPEN
    return (solved[:-1] * scale).astype(np.float32), (solved[-1] * scale).astype(np.float32)


def build(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    texts = dialogues()
    tok = train_tokenizer(texts)
    vocab = tok.get_vocab_size()
    weights = reservoir(np.random.default_rng(SEED), vocab)
    collect = session(graph(weights, None))
    states, targets = [], []
    for text in texts:
        ids = np.array([tok.encode(text).ids], np.int64)
        (run,) = collect.run(None, {"input_ids": ids, "state": np.zeros((1, HIDDEN), np.float32)})
        states.append(run[:-1, 0])  # the state after token t predicts token t + 1
        targets.append(ids[0, 1:])
    readout = fit_readout(np.concatenate(states), np.concatenate(targets), vocab)
    tok.save(str(out / "tokenizer.json"))
    onnx.save(graph(weights, readout), str(out / "model.onnx"))


def greedy(folder: Path, text: str, limit: int = 40) -> str:
    """What the built model answers at temperature 0 (prints a check; not part of the build)."""
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    run = session(onnx.load(str(folder / "model.onnx")))
    ids = np.array([tok.encode(text).ids], np.int64)
    logits, state = run.run(None, {"input_ids": ids, "state": np.zeros((1, HIDDEN), np.float32)})
    made: list[int] = []
    eos = tok.token_to_id(EOS)
    while len(made) < limit:
        made.append(int(logits[0].argmax()))
        if made[-1] == eos:
            break
        logits, state = run.run(
            None, {"input_ids": np.array([[made[-1]]], np.int64), "state": state}
        )
    return tok.decode(made, skip_special_tokens=False)


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "1"
    build(target)
    print("wrote", target / "tokenizer.json", "and", target / "model.onnx")
    for question in (
        "Hello!",
        "What is the capital of Italy?",
        "Will it rain tomorrow?",
        "Who won the game?",
    ):
        print(repr(question), "->", repr(greedy(target, render([("user", question)], prompt=True))))
