"""Token-by-token text generation with continuous batching, on ONNX Runtime.

The model (models/chat/build.py) is recurrent: ``input_ids`` [B, T] and ``state``
[B, H] in, the last position's ``logits`` [B, V] and ``state_out`` [B, H] out, so a
step costs the same at any length. ``start`` runs a request's prompt (the
prefill, B = 1) and keeps its state and pending logits; ``step`` samples one
token for each stream in progress and advances all that go on with ONE
``session.run`` (T = 1, B = streams). Sampling is per stream, with the stream's
own generator seeded from its request: greedy at temperature 0, else
temperature and top-p (nucleus) sampling. A stream ends (``None``) when it
samples ``<|end|>`` (not sent; never, with ``ignore_eos``) or has sent ``max_tokens``
tokens.
"""

import numpy as np
import onnxruntime as ort
import pluggy
from tokenizers import Tokenizer

hookimpl = pluggy.HookimplMarker("plugserve")

SCALARS = {
    "max_tokens": np.int32,
    "temperature": np.float32,
    "top_p": np.float32,
    "seed": np.int64,
    "ignore_eos": np.bool_,
}


class Stream:
    """One request's generation: its recurrent state, the logits of its next token, its settings."""

    __slots__ = ("ignore_eos", "left", "logits", "rng", "state", "temperature", "top_p")

    def __init__(self, state, logits, settings):
        self.state = state  # [H]
        self.logits = logits  # [V], or None once ended
        self.left = int(settings["max_tokens"])
        self.temperature = float(settings["temperature"])
        self.top_p = float(settings["top_p"])
        self.rng = np.random.default_rng(int(settings["seed"]) & 0xFFFF_FFFF_FFFF_FFFF)
        self.ignore_eos = bool(settings["ignore_eos"])

    def sample(self) -> int:
        """The next token from the pending logits."""
        if self.temperature == 0.0:
            return int(np.argmax(self.logits))
        z = self.logits.astype(np.float64) / self.temperature
        p = np.exp(z - z.max())
        if self.top_p >= 1.0:
            cumulative = np.cumsum(p)
            return int(np.searchsorted(cumulative, self.rng.random() * cumulative[-1], "right"))
        order = np.argsort(-p, kind="stable")  # the nucleus: most likely first, up to top_p
        cumulative = np.cumsum(p[order])
        cut = int(np.searchsorted(cumulative, self.top_p * cumulative[-1])) + 1
        draw = self.rng.random() * cumulative[cut - 1]
        return int(order[min(int(np.searchsorted(cumulative[:cut], draw, "right")), cut - 1)])

    def release(self) -> None:
        self.state = self.logits = None


class Chat:
    def __init__(self, plugin, model_path, eos_id: int):
        self.InvalidInput = plugin.InvalidInput
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(
            str(model_path), options, providers=["CPUExecutionProvider"]
        )
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.hidden = int(inputs["state"].shape[1])
        self.vocab = int(self.session.get_outputs()[0].shape[1])
        self.eos = eos_id

    def validate(self, inputs):
        ids = inputs.get("input_ids")
        if ids is None or np.ndim(ids) != 2 or np.shape(ids)[0] != 1 or np.shape(ids)[1] < 1:
            raise self.InvalidInput("input_ids must be one prompt of token ids, shape [1, T>=1]")
        ids = np.asarray(ids)
        if ids.min() < 0 or ids.max() >= self.vocab:
            raise self.InvalidInput(f"input_ids must lie in [0, {self.vocab})")
        for name in SCALARS:
            if np.size(inputs.get(name, ())) != 1:
                raise self.InvalidInput(f"{name} must hold one value")
        if int(np.asarray(inputs["max_tokens"]).ravel()[0]) < 1:
            raise self.InvalidInput("max_tokens must be at least 1")

    def start(self, inputs):
        """The prefill: run the prompt from a zero state; its logits are the first token's."""
        self.validate(inputs)
        ids = np.asarray(inputs["input_ids"], dtype=np.int64)
        zero = np.zeros((1, self.hidden), dtype=np.float32)
        logits, state = self.session.run(None, {"input_ids": ids, "state": zero})
        settings = {name: np.asarray(inputs[name]).ravel()[0] for name in SCALARS}
        return Stream(state[0], logits[0], settings)

    def step(self, states):
        """One token for each stream in ``states``; one batched model call for those that go on."""
        responses = [None] * len(states)
        going = []
        for i, stream in enumerate(states):
            if stream.logits is None or stream.left <= 0:
                stream.logits = None
                continue
            if stream.ignore_eos:  # vLLM's ignore_eos: never end before max_tokens
                stream.logits[self.eos] = -np.inf
            token = stream.sample()
            if token == self.eos:
                stream.logits = None
                continue
            stream.left -= 1
            responses[i] = {"token_id": np.array([token], dtype=np.int64)}
            if stream.left > 0:  # else the next step ends it: no logits needed
                going.append((stream, token))
        if going:
            ids = np.array([[token] for _, token in going], dtype=np.int64)
            state = np.stack([stream.state for stream, _ in going])
            logits, state_out = self.session.run(None, {"input_ids": ids, "state": state})
            for row, (stream, _) in enumerate(going):
                stream.state, stream.logits = state_out[row], logits[row]
        return responses

    def stop(self, state):
        state.release()

    def metadata(self):
        return {
            "inputs": [
                {"name": "input_ids", "datatype": "INT64", "shape": [1, -1]},
                {"name": "max_tokens", "datatype": "INT32", "shape": [1]},
                {"name": "temperature", "datatype": "FP32", "shape": [1]},
                {"name": "top_p", "datatype": "FP32", "shape": [1]},
                {"name": "seed", "datatype": "INT64", "shape": [1]},
                {"name": "ignore_eos", "datatype": "BOOL", "shape": [1]},
            ],
            "outputs": [{"name": "token_id", "datatype": "INT64", "shape": [1]}],
        }


@hookimpl
def plugserve_create_component(plugin, config):
    tokenizer = Tokenizer.from_file(str(plugin.resolve(config["tokenizer"])))
    eos = tokenizer.token_to_id(config.get("eos_token", "<|end|>"))
    if eos is None:
        raise ValueError(f"the tokenizer has no {config.get('eos_token', '<|end|>')} token")
    return Chat(plugin, plugin.model, eos)
