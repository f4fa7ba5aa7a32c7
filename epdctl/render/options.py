"""Render-time choices about the cluster (a leaf: the renderer's modules and the CLI read it)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_IMAGE = "vllm/vllm-openai:latest"
DEFAULT_EC_CONNECTOR = "ECMooncakeConnector"
HF_TOKEN_KEY = "HF_TOKEN"
"""The key read in --hf-token-secret when it names none."""


@dataclass(frozen=True)
class K8sOptions:
    """Render-time choices about the cluster (the topology says what runs)."""

    namespace: str | None = None
    image: str = DEFAULT_IMAGE
    ec_connector: str = DEFAULT_EC_CONNECTOR
    gpus_per_node: int | None = None
    """GPUs one node offers; a role whose tensor_parallel is larger spans nodes (LWS)."""
    model_pvc: str | None = None
    """PersistentVolumeClaim holding the model (an absolute `model:` path in the pods)."""
    model_host_path: str | None = None
    """Node directory holding the model, instead of a PVC."""
    model_mount: str | None = None
    """Where the model volume is mounted; default: the directory of `model:`."""
    hf_cache_pvc: str | None = None
    """PersistentVolumeClaim for the Hugging Face cache; default for a hub id: an emptyDir."""
    hf_token_secret: str | None = None
    """Secret the engines read HF_TOKEN from."""
    hf_token_key: str = HF_TOKEN_KEY
    """The key in hf_token_secret that holds the token."""
