"""The OpenAPI 3 document of plugserve's HTTP API, served at ``/openapi.json``.

Kept true by ``tests/server/http_api/test_openapi.py``: every route the app registers is
documented and every documented route exists, and a schemathesis run against a
real server finds no 5xx.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

from plugserve.registry.refs import NAME_PATTERN, PLUGIN_TYPES
from plugserve.registry.routing.route_specs import route_entry_schema
from plugserve.registry.tensors.datatypes import V2_TO_NUMPY
from plugserve.server import __version__


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


ERROR = {"$ref": "#/components/schemas/Error"}


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(s): {"description": _REASONS[s], "content": _json(ERROR)} for s in statuses}


_REASONS = {
    400: "malformed request",
    401: "no or wrong bearer token: admin, or inference when one is configured",
    403: "admin call from a non-loopback address with no token configured; shared memory "
    "from a client not on loopback (setting shared_memory)",
    404: "unknown route, version, plugin or path",
    409: "the route entry moved on since the revision expected (If-Match): read it again",
    413: "body or tensor too large",
    429: "queue full or rate limited (Retry-After)",
    500: "a plugin raised; the message names it",
    503: "not ready, circuit open, or shutting down",
    504: "the request's deadline passed",
}

ROUTE = {"name": "route", "in": "path", "required": True, "schema": {"type": "string"}}
VERSION = {"name": "version", "in": "path", "required": True, "schema": {"type": "string"}}
IF_MATCH = {
    "name": "If-Match",
    "in": "header",
    "required": False,
    "description": "the entry's revision this change expects; 0: the entry must not exist",
    "schema": {"type": "string"},
}
ROLLOUT = {
    "type": "object",
    "description": "a canary that moves itself through steps of weight, gated by its "
    "error rate and latency against the stable version's (docs/operations.md)",
    "required": ["canary", "steps"],
    "properties": {
        "canary": {"type": "string", "description": "name@version"},
        "stable": {"type": "string", "description": "name@version (default: runner)"},
        "steps": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                             "maximum": 100}},
        "min_requests": {"type": "integer", "minimum": 1},
        "min_seconds": {"type": "number", "minimum": 0},
        "max_error_rate": {"type": "number", "minimum": 0, "maximum": 1},
        "max_latency_ratio": {"type": "number", "minimum": 1},
        "latency_floor_ms": {"type": "number", "minimum": 0},
        "shadow": {"type": "number", "minimum": 0, "maximum": 1},
        "min_agreement": {"type": "number", "minimum": 0, "maximum": 1},
        "atol": {"type": "number", "minimum": 0},
        "rtol": {"type": "number", "minimum": 0},
        "status": {"type": "object", "description": "written by the server"},
    },
}  # fmt: skip
"""A route entry's ``rollout`` table (``registry/routing/rollout.py``)."""


def _route_entry() -> dict[str, Any]:
    """The route entry's schema (declared in ``route_specs.py``) and the tables it holds,
    as components: ``RouteEntry``, ``StepEntry``, ``RateLimitEntry``."""
    entry = route_entry_schema("#/components/schemas/{model}")
    tables: dict[str, Any] = entry.pop("$defs", {})
    entry["properties"]["rollout"] = ROLLOUT
    return {"RouteEntry": entry, **tables}


ADMIN: list[dict[str, list[str]]] = [{"bearerAuth": []}, {}]  # token, or loopback without


def _ok(description: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    response: dict[str, Any] = {"description": description}
    if schema is not None:
        response["content"] = _json(schema)
    return {"200": response}


def _infer(versioned: bool) -> dict[str, Any]:
    return {
        "post": {
            "summary": "Run the route's chain on v2 tensors (JSON, or Triton's binary extension)",
            "parameters": [ROUTE, VERSION] if versioned else [ROUTE],
            "requestBody": {
                "required": True,
                "content": {
                    **_json({"$ref": "#/components/schemas/InferRequest"}),
                    "application/octet-stream": {
                        "schema": {"type": "string", "format": "binary"},
                        "encoding": {},
                    },
                },
            },
            "responses": {
                **_ok("the outputs", {"$ref": "#/components/schemas/InferResponse"}),
                **_errors(400, 401, 404, 413, 429, 500, 503, 504),
            },
        }
    }


def _model(versioned: bool, ready: bool) -> dict[str, Any]:
    summary = "Whether the route can serve" if ready else "The route's tensors and versions"
    return {
        "get": {
            "summary": summary,
            "parameters": [ROUTE, VERSION] if versioned else [ROUTE],
            "responses": {**_ok(summary, {"type": "object"}), **_errors(401, 404, 503)},
        }
    }


def _config(versioned: bool) -> dict[str, Any]:
    summary = "Triton's model configuration of the route, derived from its manifest"
    return {
        "get": {
            "summary": summary,
            "parameters": [ROUTE, VERSION] if versioned else [ROUTE],
            "responses": {**_ok("the configuration", {"type": "object"}), **_errors(401, 404, 503)},
        }
    }


def _repository(summary: str, routed: bool, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "security": ADMIN,
            "parameters": [ROUTE] if routed else [],
            "requestBody": {"required": False, "content": _json(body)},
            "responses": {**_ok("done", {}), **_errors(400, 401, 403, 404, 503)},
        }
    }


def _stats(routed: bool, versioned: bool) -> dict[str, Any]:
    params = [ROUTE] if routed else []
    return {
        "get": {
            "summary": "Triton's statistics extension: counts and cumulative durations per stage",
            "parameters": [*params, VERSION] if versioned else params,
            "responses": {**_ok("model_stats", {"type": "object"}), **_errors(401, 404, 503)},
        }
    }


def _shared_memory(root: str, kind: str) -> dict[str, Any]:
    """Triton's shared memory extension: register, status and unregister of regions."""
    name = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}
    errors = _errors(400, 401, 403, 404)
    register = {
        "type": "object",
        "properties": {
            "key": {"type": "string"},
            "offset": {"type": "integer"},
            "byte_size": {"type": "integer"},
        },
    }
    paths: dict[str, Any] = {
        f"{root}/region/{{name}}/register": {
            "post": {
                "summary": f"Register a {kind} shared memory region",
                "parameters": [name],
                "requestBody": {"required": True, "content": _json(register)},
                "responses": {**_ok("registered"), **errors},
            }
        }
    }
    for prefix, params, which in (
        (root, [], "every region"),
        (root + "/region/{name}", [name], "the region"),
    ):
        paths[prefix + "/status"] = {
            "get": {
                "summary": f"The status of {which} ({kind} shared memory)",
                "parameters": params,
                "responses": {
                    **_ok("regions", {"type": "array", "items": {"type": "object"}}),
                    **errors,
                },
            }
        }
        paths[prefix + "/unregister"] = {
            "post": {
                "summary": f"Unregister {which} ({kind} shared memory)",
                "parameters": params,
                "responses": {**_ok("unregistered"), **errors},
            }
        }
    return paths


def _admin_version(action: str) -> dict[str, Any]:
    segment = {"in": "path", "required": True}
    return {
        "post": {
            "summary": f"{action.capitalize()} one plugin version; answers when done",
            "security": ADMIN,
            "parameters": [
                {
                    **segment,
                    "name": "type",
                    "schema": {"type": "string", "enum": list(PLUGIN_TYPES)},
                },
                {
                    **segment,
                    "name": "name",
                    "schema": {"type": "string", "pattern": f"^{NAME_PATTERN}$"},
                },
                {**segment, "name": "version", "schema": {"type": "string"}},
            ],
            "responses": {
                **_ok("the version's state", {"type": "object"}),
                **_errors(400, 401, 403, 404),
            },
        }
    }


def _generate(versioned: bool, stream: bool) -> dict[str, Any]:
    summary = (
        "Triton's generate_stream: each response of the chain as a Server-Sent Event"
        if stream
        else "Triton's generate: the chain's response (a stream's responses merged) as JSON"
    )
    answer = (
        {"text/event-stream": {"schema": {"type": "string"}}}
        if stream
        else _json({"type": "object"})
    )
    return {
        "post": {
            "summary": summary,
            "parameters": [ROUTE, VERSION] if versioned else [ROUTE],
            "requestBody": {
                "required": True,
                "content": _json(
                    {
                        "type": "object",
                        "description": "inputs for the first stage, and 'parameters'",
                        "properties": {"parameters": {"type": "object"}},
                    }
                ),
            },
            "responses": {
                "200": {"description": summary, "content": answer},
                **_errors(400, 401, 404, 413, 429, 500, 503, 504),
            },
        }
    }


def _openai(summary: str, body: str, stream: bool) -> dict[str, Any]:
    """An OpenAI route: its body is the component ``body`` (the OpenAI front end's
    declaration, handed to :func:`document`)."""
    content: dict[str, Any] = _json({"type": "object"})
    if stream:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": _json({"$ref": f"#/components/schemas/{body}"}),
            },
            "responses": {
                "200": {"description": summary, "content": content},
                **_errors(400, 401, 404, 413, 429, 500, 503, 504),
            },
        }
    }


def document(schemas: dict[str, Any]) -> dict[str, Any]:
    """The OpenAPI document, with the components other front ends declare (``schemas``:
    the OpenAI bodies)."""
    tensor_data = {"type": "array", "items": {}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "plugserve", "version": __version__},
        "paths": {
            "/v2": {
                "get": {
                    "summary": "Server metadata",
                    "responses": {**_ok("metadata", {"type": "object"}), **_errors(401)},
                }
            },
            "/v2/health/live": {
                "get": {"summary": "Liveness", "responses": _ok("live", {"type": "object"})}
            },
            "/v2/health/ready": {
                "get": {
                    "summary": "Readiness",
                    "responses": {**_ok("ready", {"type": "object"}), **_errors(503)},
                }
            },
            "/v2/models/stats": _stats(False, False),
            "/v2/models/{route}/stats": _stats(True, False),
            "/v2/models/{route}/versions/{version}/stats": _stats(True, True),
            "/v2/models/{route}": _model(False, False),
            "/v2/models/{route}/ready": _model(False, True),
            "/v2/models/{route}/infer": _infer(False),
            "/v2/models/{route}/versions/{version}": _model(True, False),
            "/v2/models/{route}/versions/{version}/ready": _model(True, True),
            "/v2/repository/index": _repository(
                "Triton's repository index: every route's versions and their states",
                False,
                {"type": "object", "properties": {"ready": {"type": "boolean"}}},
            ),
            "/v2/repository/models/{route}/load": _repository(
                "Load the route from its files; parameters.config overrides runner settings",
                True,
                {
                    "type": "object",
                    "properties": {
                        "parameters": {
                            "type": "object",
                            "properties": {"config": {"type": "string"}},
                        }
                    },
                },
            ),
            "/v2/repository/models/{route}/unload": _repository(
                "Unload every version of the route's runner", True, {"type": "object"}
            ),
            "/v2/models/{route}/config": _config(False),
            "/v2/models/{route}/versions/{version}/config": _config(True),
            "/v2/models/{route}/versions/{version}/infer": _infer(True),
            **_shared_memory("/v2/systemsharedmemory", "system"),
            **_shared_memory("/v2/cudasharedmemory", "CUDA (400: needs a GPU)"),
            "/v2/models/{route}/generate": _generate(False, False),
            "/v2/models/{route}/generate_stream": _generate(False, True),
            "/v2/models/{route}/versions/{version}/generate": _generate(True, False),
            "/v2/models/{route}/versions/{version}/generate_stream": _generate(True, True),
            "/v1/models": {
                "get": {
                    "summary": "OpenAI: the routes served at /v1 (those with [route] openai)",
                    "responses": {**_ok("the models", {"type": "object"}), **_errors(401)},
                }
            },
            "/v1/models/{model}": {
                "get": {
                    "summary": "OpenAI: one route served at /v1",
                    "parameters": [{**ROUTE, "name": "model"}],
                    "responses": {**_ok("the model", {"type": "object"}), **_errors(401, 404)},
                }
            },
            "/v1/embeddings": _openai("OpenAI: embeddings of texts", "EmbeddingsBody", False),
            "/v1/chat/completions": _openai(
                "OpenAI: a chat completion, streamed with stream: true", "ChatBody", True
            ),
            "/v1/completions": _openai(
                "OpenAI: a text completion, streamed with stream: true", "CompletionsBody", True
            ),
            "/predict/{route}": {
                "post": {
                    "summary": "Run the chain on a raw body: JSON parsed, anything else as bytes",
                    "parameters": [ROUTE],
                    "requestBody": {
                        "content": {
                            "application/json": {"schema": {}},
                            "application/octet-stream": {
                                "schema": {"type": "string", "format": "binary"}
                            },
                        }
                    },
                    "responses": {
                        **_ok("the last stage's result"),
                        **_errors(400, 401, 404, 413, 429, 500, 503, 504),
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "responses": {
                        "200": {
                            "description": "text format",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "summary": "This document",
                    "responses": _ok("OpenAPI 3", {"type": "object"}),
                }
            },
            "/admin/plugins": {
                "get": {
                    "summary": "Every plugin version and its state",
                    "security": ADMIN,
                    "responses": {**_ok("plugins", {"type": "object"}), **_errors(401, 403, 404)},
                }
            },
            "/admin/routes": {
                "get": {
                    "summary": "The route table as served",
                    "security": ADMIN,
                    "responses": {**_ok("routes", {"type": "object"}), **_errors(401, 403, 404)},
                }
            },
            "/admin/routes/{route}": {
                "put": {
                    "summary": "Set a route's runtime entry (a routes.toml entry as JSON); "
                    "in fleet mode written to etcd and applied by every replica",
                    "security": ADMIN,
                    "parameters": [ROUTE, IF_MATCH],
                    "requestBody": {
                        "required": True,
                        "content": _json({"$ref": "#/components/schemas/RouteEntry"}),
                    },
                    "responses": {
                        **_ok(
                            "the route as now served, its entry and revision", {"type": "object"}
                        ),
                        **_errors(400, 401, 403, 404, 409, 503),
                    },
                },
                "delete": {
                    "summary": "Remove a route's runtime entry: routes.toml or its runner "
                    "applies again",
                    "security": ADMIN,
                    "parameters": [ROUTE, IF_MATCH],
                    "responses": {
                        **_ok("the revision of the deletion", {"type": "object"}),
                        **_errors(400, 401, 403, 404, 409, 503),
                    },
                },
            },
            "/admin/routes/{route}/rollout": {
                "get": {
                    "summary": "A route's rollout: policy, status, decisions, and the figures "
                    "of its window",
                    "security": ADMIN,
                    "parameters": [ROUTE],
                    "responses": {
                        **_ok("the rollout", {"type": "object"}),
                        **_errors(400, 401, 403, 404),
                    },
                }
            },
            "/admin/routes/{route}/rollout/{action}": {
                "post": {
                    "summary": "pause, resume or abort a route's rollout (body: optional "
                    '{"reason": "..."})',
                    "security": ADMIN,
                    "parameters": [
                        ROUTE,
                        IF_MATCH,
                        {
                            "name": "action",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string", "enum": ["pause", "resume", "abort"]},
                        },
                    ],
                    "responses": {
                        **_ok(
                            "the route as now served, its entry and revision", {"type": "object"}
                        ),
                        **_errors(400, 401, 403, 404, 409, 503),
                    },
                }
            },
            "/admin/fleet": {
                "get": {
                    "summary": "The replicas sharing the route table, the versions ready on each, "
                    "and this replica's sync state",
                    "security": ADMIN,
                    "responses": {**_ok("the fleet", {"type": "object"}), **_errors(401, 403, 404)},
                }
            },
            "/admin/reload": {
                "post": {
                    "summary": "Rescan everything now; 200 whatever failed, listing failures",
                    "security": ADMIN,
                    "parameters": [{"name": "force", "in": "query", "schema": {"type": "boolean"}}],
                    "responses": {
                        **_ok("what changed", {"type": "object"}),
                        **_errors(401, 403, 404),
                    },
                }
            },
            "/admin/profile": {
                "post": {
                    "summary": "Sample the live server for some seconds: HTML or speedscope",
                    "security": ADMIN,
                    "parameters": [
                        {
                            "name": "seconds",
                            "in": "query",
                            "schema": {"type": "number", "maximum": 2},
                        },
                        {
                            "name": "format",
                            "in": "query",
                            "schema": {"type": "string", "enum": ["html", "speedscope"]},
                        },
                    ],
                    "responses": {**_ok("the profile"), **_errors(400, 401, 403, 404, 429)},
                }
            },
            "/admin/": {
                "get": {
                    "summary": "The status page (HTML, refreshes itself)",
                    "security": ADMIN,
                    "responses": {**_ok("a page"), **_errors(401, 403, 404)},
                }
            },
            "/admin/status": {
                "get": {
                    "summary": "Plugins, routes and request counts: the status page's data",
                    "security": ADMIN,
                    "responses": {**_ok("status", {"type": "object"}), **_errors(401, 403, 404)},
                }
            },
            "/admin/plugins/{type}/{name}/{version}/reload": _admin_version("reload"),
            "/admin/plugins/{type}/{name}/{version}/unload": _admin_version("unload"),
        },
        "components": {
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {"error": {"type": "string"}},
                },
                "InferInput": {
                    "type": "object",
                    "required": ["name", "shape", "datatype"],
                    "properties": {
                        "name": {"type": "string"},
                        "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                        "datatype": {"type": "string", "enum": list(V2_TO_NUMPY)},
                        "parameters": {"type": "object"},
                        "data": tensor_data,
                    },
                },
                "InferRequest": {
                    "type": "object",
                    "required": ["inputs"],
                    "properties": {
                        "id": {"type": "string"},
                        "parameters": {"type": "object"},
                        "inputs": {
                            "type": "array",
                            "items": {"$ref": "#/components/schemas/InferInput"},
                        },
                        "outputs": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["name"],
                                "properties": {
                                    "name": {"type": "string"},
                                    "parameters": {"type": "object"},
                                },
                            },
                        },
                    },
                },
                **schemas,
                **_route_entry(),
                "InferResponse": {
                    "type": "object",
                    "required": ["model_name", "outputs"],
                    "properties": {
                        "model_name": {"type": "string"},
                        "model_version": {"type": "string"},
                        "id": {"type": "string"},
                        "outputs": {"type": "array", "items": {"type": "object"}},
                    },
                },
            },
        },
    }


def add_routes(app: web.Application, schemas: Callable[[], dict[str, Any]]) -> None:
    """``GET /openapi.json``, with the components other front ends declare (``schemas``,
    asked on the first request: a server that is never asked builds no schema)."""

    @functools.cache
    def body() -> bytes:
        return json.dumps(document(schemas())).encode()

    async def openapi(request: web.Request) -> web.Response:
        return web.Response(body=body(), content_type="application/json")

    app.router.add_get("/openapi.json", openapi)
