"""Offline checks of rendered manifests: Kubernetes OpenAPI schemas, and LWS by structure."""

from __future__ import annotations

from typing import Any

import kubernetes_validate

# A fixed version bundled by kubernetes-validate, so a package upgrade cannot move the goal.
K8S_VERSION = "1.33.0"
LWS_API = "leaderworkerset.x-k8s.io/v1"
# leaderworkerset.x-k8s.io/v1 fields (sigs.k8s.io/lws api/leaderworkerset/v1); the CRD's
# schema is not bundled by kubernetes-validate, so unknown keys are caught here instead.
_LWS_SPEC = {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy",
             "networkConfig"}
_LWS_TEMPLATE = {"leaderTemplate", "workerTemplate", "size", "restartPolicy", "subGroupPolicy"}
_LWS_RESTART = {"RecreateGroupOnPodRestart", "None"}


def _validate_lws(obj: dict[str, Any]) -> None:
    spec = obj["spec"]
    assert set(obj) == {"apiVersion", "kind", "metadata", "spec"}, obj.keys()
    assert set(spec) <= _LWS_SPEC, set(spec) - _LWS_SPEC
    assert isinstance(spec["replicas"], int) and spec["replicas"] >= 1
    lwt = spec["leaderWorkerTemplate"]
    assert set(lwt) <= _LWS_TEMPLATE, set(lwt) - _LWS_TEMPLATE
    assert isinstance(lwt["size"], int) and lwt["size"] >= 2
    assert lwt["restartPolicy"] in _LWS_RESTART
    # The pod templates are core types: validate them as PodTemplates against the real schema.
    for key in ("leaderTemplate", "workerTemplate"):
        holder = {"apiVersion": "v1", "kind": "PodTemplate",
                  "metadata": {"name": obj["metadata"]["name"]}, "template": lwt[key]}
        kubernetes_validate.validate(holder, K8S_VERSION, strict=True)
    meta = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]}
    kubernetes_validate.validate(meta, K8S_VERSION, strict=True)


def validate(obj: dict[str, Any]) -> None:
    """Raise if obj is not a valid manifest (strict: unknown fields fail too)."""
    if obj.get("apiVersion") == LWS_API and obj.get("kind") == "LeaderWorkerSet":
        _validate_lws(obj)
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
