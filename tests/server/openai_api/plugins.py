"""Plugins behind the OpenAI routes' tests: a chat route on the streaming test runner, and an
embeddings route, written as plugin authors write them (pluggy and numpy only)."""

from pathlib import Path

from tests.helpers import write_plugin, write_streaming_runner

# Chat and completions: the prompt's words are its tokens; the runner answers "t1 t2 ..." up
# to max_tokens (8 when none is asked), one token a step.
PROMPT = """
    import numpy as np
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Prompt:
        def process(self, data, ctx):
            if "messages" in data:
                text = " ".join(m["content"] for m in data["messages"])
            else:
                text = data.get("prompt", data.get("text_input", ""))
            if "forbidden" in text:
                raise ctx.InvalidInput("the prompt says forbidden")
            ctx.usage["prompt_tokens"] = len(text.split())
            n = int(ctx.parameters.get("max_tokens", data.get("max_tokens", 8)))
            ctx.usage["max_tokens"] = n
            return {"n": np.array([n], np.int64)}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Prompt()
"""

# Embeddings: [length, vowels, 1] of each text, so a test can tell inputs apart.
EMBEDDER = """
    import numpy as np
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Embedder:
        def metadata(self):
            return {"inputs": [{"name": "input", "datatype": "BYTES", "shape": [-1]}]}

        def infer(self, inputs):
            texts = [t.decode() if isinstance(t, bytes) else str(t) for t in inputs["input"]]
            rows = [[len(t), sum(c in "aeiou" for c in t), 1.0] for t in texts]
            return {"embeddings": np.array(rows, np.float32)}

    class Words:
        def process(self, data, ctx):
            ctx.usage["prompt_tokens"] = sum(len(str(t).split()) for t in data["input"])
            return data

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Words() if plugin.type == "preprocessor" else Embedder()
"""


def write_openai_plugins(plugins_dir: Path, step_s: float = 0.0, log: Path | None = None) -> None:
    write_plugin(plugins_dir, "preprocessor", "prompt", "1.0.0", files={"plugin.py": PROMPT})
    config = f"step_s = {step_s}\n" + (f'log = "{log}"\n' if log else "")
    write_streaming_runner(
        plugins_dir,
        "talk",
        "steps",
        runner="max_batch_size = 8\n\n[route]\n"
        'openai = ["chat", "completions"]\npreprocess = ["prompt"]\n',
        config=config,
    )
    write_plugin(plugins_dir, "preprocessor", "words", "1.0.0", files={"plugin.py": EMBEDDER})
    write_plugin(
        plugins_dir,
        "runner",
        "vec",
        "1.0.0",
        '[route]\nopenai = "embeddings"\npreprocess = ["words"]\n',
        {"plugin.py": EMBEDDER},
    )
