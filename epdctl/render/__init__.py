"""Renderers: a topology written out for somewhere other than this machine."""

from __future__ import annotations

from epdctl.render.k8s import K8sOptions, Rendering, render_k8s

__all__ = ["K8sOptions", "Rendering", "render_k8s"]
