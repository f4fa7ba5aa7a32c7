"""Renderers: a topology written out for somewhere other than this machine."""

from __future__ import annotations

from epdctl.render._yaml import dump_all, write_dir
from epdctl.render.k8s import K8sOptions, Rendering, render_k8s

__all__ = ["K8sOptions", "Rendering", "dump_all", "render_k8s", "write_dir"]
