"""Minimal JSON schemas of KServe's ServingRuntime and InferenceService.

Kubernetes' own schemas (kubernetes-validate) do not hold KServe's CRDs, so these are
written from KServe's Go types (``pkg/apis/serving/v1alpha1/servingruntime_types.go``,
``pkg/apis/serving/v1beta1/predictor_model.go`` and ``component.go``): every field the
types declare, unknown fields refused, and the Kubernetes types they embed (Container,
Volume, PodSpec, ObjectMeta...) checked against Kubernetes' schemas themselves.
"""

from __future__ import annotations

import functools
from typing import Any

import jsonschema
import kubernetes_validate.utils as kv
from referencing import Registry, Resource

PROTOCOLS = ["v1", "v2", "grpc-v1", "grpc-v2"]
_K8S = "/api/_definitions.json#/$defs/io.k8s."


def _k8s(name: str) -> dict[str, str]:
    return {"$ref": f"{_K8S}{name}"}


def _array(items: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": items}


_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_OBJECT = {"type": "object"}


@functools.cache
def _definitions() -> dict[str, Any]:
    version = kv.latest_version()
    defs: dict[str, Any] = kv.schema_contents(
        f"kubernetes-json-schema/v{version}-local-strict/_definitions.json", version
    )
    return defs


def _k8s_properties(name: str) -> dict[str, Any]:
    """The properties of Kubernetes type ``name``, to embed inline (Go's ``json:",inline"``)."""
    props: dict[str, Any] = _definitions()["$defs"][f"io.k8s.{name}"]["properties"]
    return dict(props)


def _pod_spec_fields() -> dict[str, Any]:
    """``ServingRuntimePodSpec``: the pod fields a runtime may set."""
    return {
        "containers": {**_array(_k8s("api.core.v1.Container")), "minItems": 1},
        "volumes": _array(_k8s("api.core.v1.Volume")),
        "nodeSelector": _MAP,
        "affinity": _k8s("api.core.v1.Affinity"),
        "tolerations": _array(_k8s("api.core.v1.Toleration")),
        "labels": _MAP,
        "annotations": _MAP,
        "imagePullSecrets": _array(_k8s("api.core.v1.LocalObjectReference")),
        "hostIPC": {"type": "boolean"},
    }


def serving_runtime_schema() -> dict[str, Any]:
    model_format = {
        "type": "object",
        "required": ["name"],
        "additionalProperties": False,
        "properties": {
            "name": {"type": "string", "minLength": 1},
            "version": {"type": "string"},
            "autoSelect": {"type": "boolean"},
            "priority": {"type": "integer", "minimum": 1},
        },
    }
    spec = {
        "type": "object",
        "required": ["containers"],
        "additionalProperties": False,
        "properties": {
            "supportedModelFormats": _array(model_format),
            "multiModel": {"type": "boolean"},
            "disabled": {"type": "boolean"},
            "protocolVersions": _array({"enum": PROTOCOLS}),
            "workerSpec": _OBJECT,
            **_pod_spec_fields(),
            "grpcEndpoint": {"type": "string"},
            "grpcDataEndpoint": {"type": "string"},
            "httpDataEndpoint": {"type": "string"},
            "replicas": {"type": "integer", "minimum": 0, "maximum": 65535},
            "storageHelper": {
                "type": "object",
                "additionalProperties": False,
                "properties": {"disabled": {"type": "boolean"}},
            },
            "builtInAdapter": _OBJECT,
        },
    }
    return _object("serving.kserve.io/v1alpha1", "ServingRuntime", spec)


def inference_service_schema() -> dict[str, Any]:
    model = {
        "type": "object",
        "required": ["modelFormat"],
        "additionalProperties": False,
        "properties": {
            # PredictorExtensionSpec embeds a Container: its fields, none required.
            **_k8s_properties("api.core.v1.Container"),
            "modelFormat": {
                "type": "object",
                "required": ["name"],
                "additionalProperties": False,
                "properties": {"name": {"type": "string"}, "version": {"type": "string"}},
            },
            "runtime": {"type": "string"},
            "storageUri": {"type": "string"},
            "runtimeVersion": {"type": "string"},
            "protocolVersion": {"enum": PROTOCOLS},
            "storage": _OBJECT,
        },
    }
    extension = {  # ComponentExtensionSpec
        "minReplicas": {"type": "integer", "minimum": 0},
        "maxReplicas": {"type": "integer", "minimum": 0},
        "scaleTarget": {"type": "integer"},
        "scaleMetric": {"type": "string"},
        "scaleMetricType": {"type": "string"},
        "autoScaling": _OBJECT,
        "containerConcurrency": {"type": "integer", "minimum": 0},
        "timeout": {"type": "integer"},
        "canaryTrafficPercent": {"type": "integer", "minimum": 0, "maximum": 100},
        "logger": _OBJECT,
        "batcher": _OBJECT,
        "labels": _MAP,
        "annotations": _MAP,
        "deploymentStrategy": _OBJECT,
    }
    pod = _k8s_properties("api.core.v1.PodSpec")
    pod["containers"] = _array(_k8s("api.core.v1.Container"))  # optional in a predictor
    predictor = {
        "type": "object",
        "additionalProperties": False,
        "properties": {**pod, **extension, "model": model, "workerSpec": _OBJECT},
    }
    spec = {
        "type": "object",
        "required": ["predictor"],
        "additionalProperties": False,
        "properties": {"predictor": predictor, "transformer": _OBJECT, "explainer": _OBJECT},
    }
    return _object("serving.kserve.io/v1beta1", "InferenceService", spec)


def _object(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "$id": f"https://kubernetes.io/kserve/{kind.lower()}.json",
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": _k8s("apimachinery.pkg.apis.meta.v1.ObjectMeta"),
            "spec": spec,
            "status": _OBJECT,
        },
    }


SCHEMAS = {"ServingRuntime": serving_runtime_schema, "InferenceService": inference_service_schema}


def validate(document: dict[str, Any]) -> None:
    """Raise ``jsonschema.ValidationError`` unless ``document`` fits its KServe kind's schema."""
    schema = SCHEMAS[document["kind"]]()
    registry: Registry = Resource.from_contents(_definitions()) @ Registry()
    jsonschema.Draft202012Validator(schema, registry=registry).validate(document)
