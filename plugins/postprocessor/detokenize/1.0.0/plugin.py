"""Streams text as it is generated: per response ``{"token_id": [id]}``, the new text.

The ids of the stream so far are kept in ``ctx.state`` and decoded together, so
a character whose bytes span several tokens (byte-level BPE) comes out whole:
while the decoded text ends in an incomplete character (U+FFFD), nothing is
sent (``None``); the next response sends it. Special tokens are not shown.
"""

import numpy as np
import pluggy
from tokenizers import Tokenizer

hookimpl = pluggy.HookimplMarker("plugserve")

IDS = "detokenize.ids"
SENT = "detokenize.sent"


class Detokenize:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def format(self, data, ctx):
        ids = ctx.state.setdefault(IDS, [])
        ids.extend(int(i) for i in np.asarray(data["token_id"]).ravel())
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        sent = ctx.state.get(SENT, 0)
        if text.endswith("\ufffd") or len(text) <= sent:
            return None
        ctx.state[SENT] = len(text)
        return {"text_output": text[sent:]}

    def metadata(self):
        return {"outputs": [{"name": "text_output", "datatype": "BYTES", "shape": [1]}]}


@hookimpl
def plugserve_create_component(plugin, config):
    return Detokenize(Tokenizer.from_file(str(plugin.resolve(config["tokenizer"]))))
