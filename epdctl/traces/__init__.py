"""Traces of multimodal traffic: what requests arrived when, and their shapes (never their
content). One format (JSON lines, docs/traces.md) that Mooncake's traces already are, Azure's
LLM traces (CSV) read as, the proxy's log is exported to (`epdctl logs --export-trace`), and
`bench --trace` / `tune --trace` replay. Stdlib only: the CLI, the proxy and the simulated
machine read it alike.

format   TraceRequest and MediaItem, reading (with one-line errors) and writing
classes  a request's shape class (text, image, image2, video, ...), a trace's classes
mix      `--mix text:0.4,image:0.6`: a synthetic trace of given proportions
"""
