"""Who may call what: the inference token, the admin token, loopback, hostile Authorization headers."""

import asyncio
import socket
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from aiohttp.test_utils import TestClient
from hypothesis import assume, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from tritonclient.utils import InferenceServerException

from plugserve.registry.errors import Forbidden, NotFound, Unauthorized
from plugserve.server.config import Settings
from plugserve.server.http.auth import check_admin_call, is_loopback
from tests.helpers import ServerProcess, write_add_runner

INFERENCE, ADMIN = "inf-t0ken", "adm-t0ken"
X = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
DATA_PLANE = [
    ("GET", "/v2", None),
    ("GET", "/v2/models/add", None),
    ("GET", "/v2/models/add/ready", None),
    ("GET", "/v2/models/add/versions/1.0.0", None),
    ("POST", "/v2/models/add/infer", X),
    ("POST", "/v2/models/add/versions/1.0.0/infer", X),
    ("POST", "/predict/add", {"x": [[1, 2, 3, 4]]}),
    ("GET", "/v2/models/stats", None),
    ("GET", "/v2/models/add/stats", None),
]
OPEN = ["/v2/health/live", "/v2/health/ready", "/metrics", "/openapi.json"]
HEADERS = {
    "none": {},
    "wrong": {"Authorization": "Bearer nope"},
    "basic": {"Authorization": f"Basic {INFERENCE}"},
    "inference": {"Authorization": f"Bearer {INFERENCE}"},
    "admin": {"Authorization": f"Bearer {ADMIN}"},
}


@pytest.fixture
async def secured(plugins_dir: Path, client: Callable[..., object]) -> TestClient:
    write_add_runner(plugins_dir, "add", "1.0.0")
    return await client(inference_token=INFERENCE, admin_token=ADMIN)  # type: ignore[operator,no-any-return]


@pytest.mark.parametrize("who", list(HEADERS))
async def test_the_data_plane_needs_the_inference_or_the_admin_token(
    secured: TestClient, who: str
) -> None:
    """CONTRACT "Data plane access": 401 with WWW-Authenticate unless a token is given."""
    for method, path, body in DATA_PLANE:
        resp = await secured.request(method, path, json=body, headers=HEADERS[who])
        if who in ("inference", "admin"):
            assert resp.status == 200, (path, await resp.text())
        else:
            assert resp.status == 401, path
            assert resp.headers["WWW-Authenticate"].startswith("Bearer")
            assert "inference token" in (await resp.json())["error"]


@pytest.mark.parametrize("who", list(HEADERS))
async def test_health_metrics_and_the_api_description_stay_open(
    secured: TestClient, who: str
) -> None:
    for path in OPEN:
        assert (await secured.get(path, headers=HEADERS[who])).status == 200, path


@pytest.mark.parametrize("who", list(HEADERS))
async def test_the_inference_token_is_never_accepted_on_admin(
    secured: TestClient, who: str
) -> None:
    for path in ("/admin/plugins", "/admin/status", "/admin/routes"):
        resp = await secured.get(path, headers=HEADERS[who])
        assert resp.status == (200 if who == "admin" else 401), path
    assert (await secured.get("/admin/")).status == 200  # the static shell, as before


async def test_unknown_paths_need_the_token_too(secured: TestClient) -> None:
    assert (await secured.get("/nope")).status == 401
    assert (await secured.get("/nope", headers=HEADERS["inference"])).status == 404
    resp = await secured.post("/v2/models/nope/infer", json=X, headers=HEADERS["inference"])
    assert resp.status == 404


async def test_without_an_inference_token_the_data_plane_has_no_check(
    plugins_dir: Path, client: Callable[..., object]
) -> None:
    """No middleware at all: the hot path costs nothing when no token is configured."""
    write_add_runner(plugins_dir, "add", "1.0.0")
    cli: TestClient = await client(admin_token=ADMIN)  # type: ignore[operator]
    assert not [m for m in cli.app.middlewares if m.__module__ == "plugserve.server.http.auth"]  # type: ignore[union-attr]
    assert (await cli.post("/v2/models/add/infer", json=X)).status == 200
    assert (await cli.get("/admin/plugins")).status == 401


async def raw_status(cli: TestClient, path: str, authorization: bytes) -> int:
    """Send a request with exactly these Authorization bytes; return the status code."""
    reader, writer = await asyncio.open_connection(cli.host, cli.port)
    writer.write(
        b"GET " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Authorization: " + authorization + b"\r\n\r\n"
    )
    await writer.drain()
    status_line = await reader.readline()
    writer.close()
    return int(status_line.split()[1])


HOSTILE = [
    b"Bearer \xff",
    b"\xff\xfe",
    b"Bearer " + INFERENCE.encode() + b"\xff",
    b"Bearer \xc3\xa9t\xc3\xa9",
    b"Bearer \xed\xa0\x80",  # an encoded surrogate: not UTF-8
    b"Bearer",
    b"Bearer ",
    b"bearer\t\xff\x80",
    b"Bearer " + b"A" * 6000,
    b"\x80 \x80",
]


@pytest.mark.parametrize("authorization", HOSTILE)
async def test_any_authorization_bytes_answer_401_never_500(
    secured: TestClient, authorization: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """issue 12, finding 15 (Authorization): a 0xff byte gave 500 and a logged traceback."""
    for path in ("/admin/plugins", "/v2/models/add", "/predict/add"):
        assert await raw_status(secured, path, authorization) == 401, path


async def test_a_token_sent_as_raw_bytes_still_matches(
    plugins_dir: Path, client: Callable[..., object]
) -> None:
    """A token set through the environment with non-UTF-8 bytes matches the same header bytes."""
    write_add_runner(plugins_dir, "add", "1.0.0")
    token = b"t\xffk".decode("utf-8", "surrogateescape")  # how os.environ holds such bytes
    cli: TestClient = await client(admin_token=token, inference_token="other")  # type: ignore[operator]
    assert await raw_status(cli, "/admin/plugins", b"Bearer t\xffk") == 200
    assert await raw_status(cli, "/v2/models/add", b"Bearer t\xffk") == 200
    assert await raw_status(cli, "/admin/plugins", b"Bearer t\xfek") == 401


@pytest.mark.workers(1, 2)
def test_hostile_authorization_bytes_log_no_traceback(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    """issue 12, finding 15 (Authorization): 401, and nothing but the access of it in the log."""
    write_add_runner(plugins_dir, "add", "1.0.0")
    srv = server(
        "--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
        env={"PLUGSERVE_ADMIN_TOKEN": ADMIN, "PLUGSERVE_INFERENCE_TOKEN": INFERENCE},
    )  # fmt: skip
    for path in ("/admin/plugins", "/v2/models/add"):
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            sock.sendall(
                b"GET " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                b"Authorization: Bearer \xff\r\n\r\n"
            )
            assert sock.makefile("rb").readline().split()[1] == b"401"
    log = srv.log()
    assert "Traceback" not in log and "internal_error" not in log
    # The start log says whether each token is set, never what it is.
    assert "inference_token=True" in log and "admin_token=True" in log
    assert INFERENCE not in log and ADMIN not in log


@pytest.mark.workers(1, 2)
def test_any_authorization_bytes_never_yield_a_5xx(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    """issue 12, finding 15 (the class, as a property): whatever the header holds, 400 or 401."""
    write_add_runner(plugins_dir, "add", "1.0.0")
    srv = server(
        "--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
        env={"PLUGSERVE_ADMIN_TOKEN": ADMIN, "PLUGSERVE_INFERENCE_TOKEN": INFERENCE},
    )  # fmt: skip

    @hypothesis_settings(max_examples=150, deadline=None, database=None)
    @given(
        value=st.binary(max_size=200), path=st.sampled_from(["/admin/plugins", "/v2/models/add"])
    )
    def check(value: bytes, path: str) -> None:
        assume(INFERENCE.encode() not in value and ADMIN.encode() not in value)
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            sock.sendall(
                b"GET " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                b"Authorization: " + value + b"\r\n\r\n"
            )
            status = int(sock.makefile("rb").readline().split()[1])
        assert status in (400, 401), (value, status)

    check()
    assert "internal_error" not in srv.log()


@pytest.mark.workers(1, 2)
def test_tritonclient_passes_the_inference_token(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    """CONTRACT "Data plane access" with the unchanged tritonclient against a real server."""
    write_add_runner(plugins_dir, "add", "1.0.0")
    srv = server(
        "--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
        env={"PLUGSERVE_INFERENCE_TOKEN": INFERENCE},
    )  # fmt: skip
    triton = httpclient.InferenceServerClient(url=f"127.0.0.1:{srv.port}")
    try:
        x = httpclient.InferInput("x", [1, 4], "FP32")
        x.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
        assert triton.is_server_live()  # health needs no token
        with pytest.raises(InferenceServerException, match="inference token"):
            triton.infer("add", [x])
        with pytest.raises(InferenceServerException, match="inference token"):
            triton.infer("add", [x], headers={"Authorization": "Bearer wrong"})
        auth = {"Authorization": f"Bearer {INFERENCE}"}
        result = triton.infer("add", [x], headers=auth)
        assert result.as_numpy("y").tolist() == [[2.0, 2.0, 2.0, 2.0]]
        assert triton.get_model_metadata("add", headers=auth)["name"] == "add"
        assert triton.is_model_ready("add", headers=auth)
    finally:
        triton.close()


@pytest.mark.parametrize(
    ("remote", "expected"),
    [("::ffff:127.0.0.1", True), ("::ffff:127.1.2.3", True), ("::ffff:10.0.0.1", False),
     ("::ffff:8.8.8.8", False), ("::1", True), ("fe80::1%lo", False), ("::", False)],
)  # fmt: skip
def test_ipv4_mapped_loopback_is_loopback(remote: str, expected: bool) -> None:
    """issue 12, finding 9: a dual-stack socket sees 127.0.0.1 as ``::ffff:127.0.0.1``."""
    assert is_loopback(remote) is expected


def dual_stack() -> bool:
    """Whether ``::`` can be bound and reached over IPv4 (IPv4-mapped addresses)."""
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(("::", 0))
            sock.listen(1)
            with socket.create_connection(("127.0.0.1", sock.getsockname()[1]), timeout=2):
                return True
    except OSError:
        return False


@pytest.mark.workers(1, 2)
@pytest.mark.skipif(not dual_stack(), reason="no dual-stack IPv6 on this machine")
def test_admin_from_ipv4_loopback_on_a_dual_stack_listener(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    """issue 12, finding 9: with ``--host ::`` admin calls from 127.0.0.1 got 403."""
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir), "--host", "::")
    status, _, body = srv.request("GET", "/admin/plugins")
    assert status == 200, body


def test_the_admin_rules_without_a_request(tmp_path: Path) -> None:
    """check_admin_call: what another protocol (gRPC) calls with its peer, token and port."""
    open_ = Settings(plugins_dir=tmp_path, models_dir=tmp_path)
    check_admin_call(open_, 8001, "127.0.0.1", None)
    with pytest.raises(Forbidden):
        check_admin_call(open_, 8001, "10.0.0.1", None)
    tokened = Settings(plugins_dir=tmp_path, models_dir=tmp_path, admin_token=ADMIN)
    check_admin_call(tokened, 8001, "10.0.0.1", ADMIN.encode())
    for token in (None, INFERENCE.encode(), b""):
        with pytest.raises(Unauthorized):
            check_admin_call(tokened, 8001, "127.0.0.1", token)
    own_port = Settings(plugins_dir=tmp_path, models_dir=tmp_path, admin_port=9000)
    with pytest.raises(NotFound):
        check_admin_call(own_port, 8001, "127.0.0.1", None)


async def test_a_wrong_token_and_a_missing_one_get_different_messages(
    secured: TestClient,
) -> None:
    """issue 17: both 401 with WWW-Authenticate; the message says which it was."""
    errors = {}
    for who in ("none", "wrong"):
        resp = await secured.post("/v2/models/add/infer", json=X, headers=HEADERS[who])
        assert resp.status == 401 and resp.headers["WWW-Authenticate"].startswith("Bearer")
        errors[who] = (await resp.json())["error"]
    assert "needs 'Authorization: Bearer <inference token>'" in errors["none"]
    assert "is not the inference token" in errors["wrong"]
    for who, expected in (("none", "need 'Authorization"), ("wrong", "not the admin token")):
        resp = await secured.get("/admin/plugins", headers=HEADERS[who])
        assert resp.status == 401 and expected in (await resp.json())["error"], who
