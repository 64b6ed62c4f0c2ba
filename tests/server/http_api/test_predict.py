"""``POST /predict/{route}``: raw bodies in, the last stage's result out."""

from pathlib import Path

from tests.helpers import write_add_runner, write_plugin

ECHO = """
    import pluggy
    hookimpl = pluggy.HookimplMarker("plugserve")

    class Echo:
        def process(self, data, ctx):
            ctx.state["seen"] = (type(data).__name__, ctx.content_type, dict(ctx.parameters),
                                 ctx.protocol, ctx.route, ctx.versions.get("echo"))
            return {"x": [[float(len(data))] * 4]} if isinstance(data, bytes) else data

    class Shape:
        def format(self, data, ctx):
            kind = ctx.parameters.get("as")
            if kind == "bytes":
                return b"\\x00\\x01"
            if kind == "text":
                return "plain text"
            if kind == "bad":
                return object()
            return {"y": data["y"], "seen": list(ctx.state["seen"])}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Echo() if plugin.type == "preprocessor" else Shape()
"""


def write_chain(plugins_dir: Path) -> None:
    write_plugin(plugins_dir, "preprocessor", "echo", "1.0.0", files={"plugin.py": ECHO})
    write_plugin(plugins_dir, "postprocessor", "shape", "1.0.0", files={"plugin.py": ECHO})
    write_add_runner(plugins_dir, "add", "1.0.0", amount=1,
                     route='[route]\npreprocess = ["echo"]\npostprocess = ["shape"]\n')  # fmt: skip


async def test_json_body_reaches_the_first_stage_parsed(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    write_chain(plugins_dir)
    cli = await client()
    resp = await cli.post("/predict/add?mode=fast", json={"x": [[0, 1, 2, 3]]})
    assert resp.status == 200 and resp.content_type == "application/json"
    doc = await resp.json()
    assert doc["y"] == [[1, 2, 3, 4]]  # nested lists became the runner's FP32 input
    assert doc["seen"] == ["dict", "application/json", {"mode": "fast"}, "predict", "add", "1.0.0"]


async def test_plus_json_content_type_is_json(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    write_chain(plugins_dir)
    cli = await client()
    resp = await cli.post("/predict/add", data=b'{"x": [[1,1,1,1]]}',
                          headers={"Content-Type": "application/vnd.api+json"})  # fmt: skip
    assert (await resp.json())["y"] == [[2, 2, 2, 2]]


async def test_other_bodies_reach_the_first_stage_as_bytes(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    write_chain(plugins_dir)
    cli = await client()
    resp = await cli.post("/predict/add", data=b"12345", headers={"Content-Type": "image/png"})
    doc = await resp.json()
    assert doc["y"] == [[6, 6, 6, 6]]
    assert doc["seen"][:2] == ["bytes", "image/png"]


async def test_bytes_and_text_results_are_sent_as_is(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    write_chain(plugins_dir)
    cli = await client()
    resp = await cli.post("/predict/add?as=bytes", json={"x": [[0, 0, 0, 0]]})
    assert resp.content_type == "application/octet-stream" and await resp.read() == b"\x00\x01"
    resp = await cli.post("/predict/add?as=text", json={"x": [[0, 0, 0, 0]]})
    assert resp.content_type == "text/plain" and await resp.text() == "plain text"
    resp = await cli.post("/predict/add?as=bad", json={"x": [[0, 0, 0, 0]]})
    assert resp.status == 500
    assert "postprocessor/shape@1.0.0" in (await resp.json())["error"]


async def test_bare_list_goes_to_a_single_input_runner(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    write_add_runner(plugins_dir, "add", "1.0.0", amount=1)
    cli = await client()
    resp = await cli.post("/predict/add", json=[[0, 1, 2, 3]])
    assert (await resp.json()) == {"y": [[1, 2, 3, 4]]}
    resp = await cli.post("/predict/add", data=b"raw", headers={"Content-Type": "text/plain"})
    assert resp.status == 400
    assert "takes named inputs ['x'], got bytes" in (await resp.json())["error"]


async def test_invalid_json_is_400(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    write_add_runner(plugins_dir, "add", "1.0.0")
    cli = await client()
    resp = await cli.post(
        "/predict/add", data=b"{oops", headers={"Content-Type": "application/json"}
    )
    assert resp.status == 400 and "not valid JSON" in (await resp.json())["error"]
    resp = await cli.post("/predict/add", json={"x": [["a", "b", "c", "d"]]})
    assert (
        resp.status == 400
        and "input 'x' of runner runner/add@1.0.0" in (await resp.json())["error"]
    )
