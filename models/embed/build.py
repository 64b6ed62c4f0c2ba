"""Build the bundled sentence-embedding example: models/embed/1/{tokenizer.json,model.onnx}.

    python models/embed/build.py [OUT_DIR]     # default: models/embed/1 (a few seconds)

Offline, deterministic (seeded; the same bytes on a rerun on the same machine) and
without torch: the tokenizer is trained with ``tokenizers`` and the model written
with ``onnx.helper`` and numpy.

- ``tokenizer.json``: a lowercasing BPE tokenizer (about 1,000 entries, words
  split at spaces and punctuation, ``[PAD]`` ``[UNK]`` ``[CLS]`` ``[SEP]``, each
  text framed as ``[CLS] ... [SEP]``), TRAINED on corpus.txt beside this script
  (a few KB of English about model serving, cooking, weather, sports and travel).
- ``model.onnx``: a transformer encoder with a real architecture and RANDOM
  weights (seed 16): token embeddings and learned positions (at most 128), two
  post-norm layers of 4-head self-attention that honours ``attention_mask``,
  layer norms and a GELU feed-forward; ``input_ids`` and ``attention_mask`` int64
  [N, L] in, ``last_hidden_state`` float32 [N, L, 64] out. Nothing in it is
  trained, so its embeddings are geometric, not semantic: texts that share
  word pieces land near each other, synonyms do not. A real model in its place
  is a sentence-transformers encoder such as all-MiniLM-L6-v2 exported to ONNX
  (docs/plugins.md, "Exporting a real model"): same inputs and output, D = 384.
"""

import string
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer

HERE = Path(__file__).resolve().parent
SEED = 16
VOCAB = 1000
DIM = 64
HEADS = 4
FFN = 128
LAYERS = 2
MAX_LENGTH = 128
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]


def train_tokenizer(corpus: str) -> Tokenizer:
    """A lowercasing BPE tokenizer trained on ``corpus``, with every printable ASCII character.

    Metaspace marks word starts (``▁the``) so that ``decode`` restores the spaces.
    (BPE rather than WordPiece: ``tokenizers``' WordPiece trainer breaks ties in hash
    order, so its vocabulary changes from run to run; its BPE trainer does not.)
    """
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Punctuation(), pre_tokenizers.Metaspace()]
    )
    tok.decoder = decoders.Metaspace()
    alphabet = sorted(set(string.printable.lower()) - set(string.whitespace))
    trainer = BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIAL, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(corpus.splitlines(), trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    return tok


class Graph:
    """Nodes and initializers of one ONNX graph, with fresh names."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.count = 0

    def name(self, hint: str) -> str:
        self.count += 1
        return f"{hint}_{self.count}"

    def const(self, hint: str, value: np.ndarray) -> str:
        name = self.name(hint)
        self.inits.append(numpy_helper.from_array(value, name))
        return name

    def weight(self, hint: str, shape: tuple[int, ...], std: float) -> str:
        return self.const(hint, (self.rng.standard_normal(shape) * std).astype(np.float32))

    def op(self, op_type: str, inputs: list[str], hint: str | None = None, **attrs: object) -> str:
        out = self.name(hint or op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], **attrs))
        return out

    def linear(self, x: str, d_in: int, d_out: int, hint: str) -> str:
        w = self.weight(f"{hint}_w", (d_in, d_out), 1.0 / np.sqrt(d_in))
        b = self.const(f"{hint}_b", np.zeros(d_out, np.float32))
        return self.op("Add", [self.op("MatMul", [x, w]), b], hint)

    def layer_norm(self, x: str, hint: str) -> str:
        scale = self.const(f"{hint}_scale", np.ones(DIM, np.float32))
        bias = self.const(f"{hint}_bias", np.zeros(DIM, np.float32))
        return self.op("LayerNormalization", [x, scale, bias], hint, axis=-1, epsilon=1e-12)

    def gelu(self, x: str) -> str:
        """0.5 * x * (1 + erf(x / sqrt 2)): GELU in ops older than opset 20."""
        scaled = self.op("Mul", [x, self.const("inv_sqrt2", np.array(1 / np.sqrt(2), np.float32))])
        one_plus = self.op(
            "Add", [self.op("Erf", [scaled]), self.const("one", np.array(1, np.float32))]
        )
        return self.op(
            "Mul", [self.op("Mul", [x, one_plus]), self.const("half", np.array(0.5, np.float32))]
        )


def attention(g: Graph, x: str, mask_bias: str, layer: int) -> str:
    """Multi-head self-attention over [N, L, D]; ``mask_bias`` is [N, 1, 1, L]."""
    head = DIM // HEADS
    split = g.const("split_shape", np.array([0, 0, HEADS, head], np.int64))
    q = g.op(
        "Transpose",
        [g.op("Reshape", [g.linear(x, DIM, DIM, f"l{layer}_q"), split])],
        perm=[0, 2, 1, 3],
    )
    k = g.op(
        "Transpose",
        [g.op("Reshape", [g.linear(x, DIM, DIM, f"l{layer}_k"), split])],
        perm=[0, 2, 3, 1],
    )
    v = g.op(
        "Transpose",
        [g.op("Reshape", [g.linear(x, DIM, DIM, f"l{layer}_v"), split])],
        perm=[0, 2, 1, 3],
    )
    scores = g.op(
        "Mul",
        [g.op("MatMul", [q, k]), g.const("inv_sqrt_dk", np.array(1 / np.sqrt(head), np.float32))],
    )
    weights = g.op("Softmax", [g.op("Add", [scores, mask_bias])], axis=-1)
    context = g.op("Transpose", [g.op("MatMul", [weights, v])], perm=[0, 2, 1, 3])
    merged = g.op("Reshape", [context, g.const("merge_shape", np.array([0, 0, DIM], np.int64))])
    return g.linear(merged, DIM, DIM, f"l{layer}_o")


def encoder(rng: np.random.Generator, vocab: int) -> onnx.ModelProto:
    """The encoder graph: embeddings for ``vocab`` ids, ``LAYERS`` post-norm transformer layers."""
    g = Graph(rng)
    tokens = g.op("Gather", [g.weight("token_embedding", (vocab, DIM), 0.5), "input_ids"])
    length = g.op(
        "Gather", [g.op("Shape", ["input_ids"]), g.const("one_i", np.array(1, np.int64))], axis=0
    )
    positions = g.op(
        "Range",
        [g.const("zero_i", np.array(0, np.int64)), length, g.const("step", np.array(1, np.int64))],
    )
    pos = g.op("Gather", [g.weight("position_embedding", (MAX_LENGTH, DIM), 0.5), positions])
    x = g.layer_norm(g.op("Add", [tokens, pos]), "embedding_norm")
    # 0 where attended, -10000 where padded; [N, 1, 1, L] broadcasts over heads and queries.
    mask = g.op("Cast", ["attention_mask"], to=TensorProto.FLOAT)
    padded = g.op("Sub", [g.const("one_f", np.array(1, np.float32)), mask])
    bias = g.op("Mul", [padded, g.const("neg", np.array(-10000, np.float32))])
    mask_bias = g.op("Unsqueeze", [bias, g.const("axes", np.array([1, 2], np.int64))])
    for layer in range(LAYERS):
        x = g.layer_norm(g.op("Add", [x, attention(g, x, mask_bias, layer)]), f"l{layer}_attn_norm")
        hidden = g.gelu(g.linear(x, DIM, FFN, f"l{layer}_ffn_in"))
        x = g.layer_norm(
            g.op("Add", [x, g.linear(hidden, FFN, DIM, f"l{layer}_ffn_out")]), f"l{layer}_ffn_norm"
        )
    g.nodes.append(helper.make_node("Identity", [x], ["last_hidden_state"]))
    graph = helper.make_graph(
        g.nodes,
        "embed",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["N", "L"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["N", "L"]),
        ],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["N", "L", DIM])],
        g.inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="plugserve"
    )
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def build(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer((HERE / "corpus.txt").read_text(encoding="utf-8"))
    tok.save(str(out / "tokenizer.json"))
    onnx.save(encoder(np.random.default_rng(SEED), tok.get_vocab_size()), str(out / "model.onnx"))


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "1"
    build(target)
    print("wrote", target / "tokenizer.json", "and", target / "model.onnx")
