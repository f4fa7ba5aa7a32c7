"""The `epdctl top` screen: rich renderables built from the summary document (pure)."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from epdctl.proxy.config import MODE_LABEL
from epdctl.units import format_bytes

ROLE_LABEL = {"encode": "E", "prefill_decode": "PD", "prefill": "P", "decode": "D"}


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f}ms" if seconds < 10 else f"{seconds:.1f}s"


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pct(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.0%}"


def _bytes(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def _table(*columns: str) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold")
    for i, name in enumerate(columns):
        table.add_column(name, justify="left" if i < 2 else "right")
    return table


def render(doc: dict[str, Any]) -> Group:
    """Header, proxy, stages, instances, cache and GPUs, as one renderable."""
    window = doc["latency_window_s"]
    head = Text(f"{doc['name']}  {MODE_LABEL.get(doc['mode'], doc['mode'])}  {doc['time']}  ",
                style="bold")
    head.append(f"latency over the last {window:.0f}s" if window else "latency since start",
                style="dim")
    parts: list[Any] = [head, _proxy(doc["proxy"]), _stages(doc["proxy"]["stages"]),
                        _instances(doc["instances"]), _cache(doc["cache"])]
    for gpu in doc["gpus"]:
        parts.append(Text(f"GPU {gpu['id']} {gpu['name']}: {_bytes(gpu['used_bytes'])} used "
                          f"of {_bytes(gpu['total_bytes'])}"))
    return Group(*parts)


def _proxy(p: dict[str, Any]) -> Text:
    line = Text("proxy ", style="bold")
    if not p["up"]:
        return line.append(f"{p['url']}  no /metrics answer", style="red")
    fan = p["encoder_fanout"]
    line.append(f"{p['url']}  in flight {_num(p['inflight'])}  req/s "
                f"{_num(p['requests_per_s'], 1)}  requests {p['requests']} (ok {p['ok']}, "
                f"errors {p['errors']})\n")
    line.append(f"  E fan-out {_num(fan['mean_items'], 2)} items per media request "
                f"({fan['requests']} requests, {fan['items']} items, "
                f"{_num(fan['items_per_s'], 1)}/s)  ")
    for title, counts in (("fallbacks", p["fallbacks"]), ("retries", p["retries"])):
        detail = ", ".join(f"{k} {v}" for k, v in counts.items() if v)
        line.append(f"{title} {sum(counts.values())}" + (f" ({detail})" if detail else "") + "  ")
    line.rstrip()
    return line


def _stages(stages: dict[str, dict[str, Any]]) -> Table:
    table = _table("STAGE", "", "COUNT", "P50", "P90", "MEAN")
    for name, s in stages.items():
        table.add_row(name, "", str(s["count"]), _ms(s["p50_s"]), _ms(s["p90_s"]),
                      _ms(s["mean_s"]))
    return table


def _instances(rows: list[dict[str, Any]]) -> Table:
    table = _table("INSTANCE", "ROLE", "UP", "RUN", "WAIT", "REQ/S", "REQS", "P50", "P90",
                   "MEAN", "TTFT P50", "HIT%", "LOADS", "SAVES", "GPU MEM")
    for r in rows:
        up = "yes" if r["up"] else "no"
        if r["in_rotation"] is False:
            up = "out"  # the proxy ejected it
        if r.get("is_failed"):
            up = "failed"  # out of restarts: the supervisor gave up on it
        c = r["cache"]
        table.add_row(
            Text(r["name"]), ROLE_LABEL.get(r["role"], r["role"]),
            Text(up, style="green" if up == "yes" else "red"), _num(r["running"]),
            _num(r["waiting"]), _num(r["requests_per_s"], 1), _num(r["requests"]),
            _ms(r["latency_p50_s"]), _ms(r["latency_p90_s"]), _ms(r["latency_mean_s"]),
            _ms(r["ttft_p50_s"]),
            _pct(c["hit_ratio"]), str(c["loads"]), str(c["saves"]),
            _bytes(r["gpu_memory_bytes"]))
    return table


def _cache(c: dict[str, Any]) -> Text:
    from epdctl.cache import CONNECTOR_NAME

    if c["connector"] != CONNECTOR_NAME:
        return Text(f"EC connector {c['connector']}: it keeps no counters epdctl can read")
    text = Text("EC store ", style="bold")
    text.append(f"{c['namespace']}: {c['entries']} entries, {_bytes(c['size_bytes'])} of "
                f"{_bytes(c['capacity_bytes'])}; hits {c['hits']}, misses {c['misses']} "
                f"(hit ratio {_pct(c['hit_ratio'])}); loaded {_bytes(c['load_bytes'])}, "
                f"saved {_bytes(c['save_bytes'])}")
    return text
