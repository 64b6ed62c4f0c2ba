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


# Prompts that fail together beside one that streams: "go" asks for 500 tokens; "refuse" (the
# client's 400) and "crash" (the plugin's fault, a 500) wait until both have come, then fail
# in one step of the event loop 0.3 s later, "refuse" first.
FAIL_TOGETHER = """
    import asyncio

    import numpy as np
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class FailTogether:
        def __init__(self):
            self.failing = {}

        async def process(self, data, ctx):
            text = data.get("prompt", "")
            if text not in ("refuse", "crash"):
                ctx.usage["prompt_tokens"] = 1
                return {"n": np.array([500], np.int64)}
            loop = asyncio.get_running_loop()
            mine = self.failing[text] = loop.create_future()
            if len(self.failing) == 2:
                both, self.failing = self.failing, {}
                loop.call_later(0.3, self.release, both)
            await mine
            if text == "refuse":
                raise ctx.InvalidInput("refused")
            raise RuntimeError("crashed")

        @staticmethod
        def release(both):
            for text in ("refuse", "crash"):
                both[text].set_result(None)

    @hookimpl
    def plugserve_create_component(plugin, config):
        return FailTogether()
"""


def write_failing_choices(plugins_dir: Path, log: Path) -> None:
    """The completions route ``mixed``: its prompts ``go``, ``refuse`` and ``crash`` as
    :data:`FAIL_TOGETHER` says; its runner takes a step each 0.1 s and logs each in ``log``."""
    write_plugin(
        plugins_dir, "preprocessor", "fail-together", "1.0.0", files={"plugin.py": FAIL_TOGETHER}
    )
    write_streaming_runner(
        plugins_dir,
        "mixed",
        "steps",
        runner='max_batch_size = 8\n\n[route]\nopenai = "completions"\n'
        'preprocess = ["fail-together"]\n',
        config=f'step_s = 0.1\nlog = "{log}"\n',
    )
