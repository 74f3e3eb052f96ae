"""The CPU figures of a remote pdchat server reach the panel: EngineStats -> /metrics -> RemoteBackend."""
from __future__ import annotations

import httpx

from pdchat.chatapp.backends.metrics_parsers import parse_metrics
from pdchat.chatapp.backends.openai_client import Endpoint
from pdchat.chatapp.backends.remote import RemoteBackend
from pdchat.chatapp.serve.prometheus import ServerMetrics
from pdchat.engine import EngineStats

from .test_metrics_parsers import VLLM_V1

CPU_FIGURES = ("cpu_util_pct", "process_cpu_pct", "rss_bytes")


def remote_over(metrics_text: str) -> RemoteBackend:
    """A RemoteBackend whose server answers /metrics with `metrics_text`."""
    backend = RemoteBackend("http://127.0.0.1:9")
    backend.endpoint = Endpoint.parse(backend.url)
    backend._client = httpx.Client(transport=httpx.MockTransport(
        lambda request: httpx.Response(200, text=metrics_text) if request.url.path == "/metrics"
        else httpx.Response(404)))
    return backend


def test_a_pdchat_server_passes_its_cpu_figures_through() -> None:
    stats = EngineStats(model="random:tiny", cpu_util_pct=91.5, process_cpu_pct=12.25, rss_bytes=300 * 2**20)
    text = ServerMetrics(lambda: stats).render().decode()
    assert "pdchat:process_cpu_pct 12.25" in text
    backend = remote_over(text)
    try:
        backend._refresh()
        snap = backend.stats()
    finally:
        backend.close()
    assert [snap[k] for k in CPU_FIGURES] == [91.5, 12.25, 300 * 2**20]


def test_a_server_that_does_not_report_them_reads_none() -> None:
    unmeasured = ServerMetrics(lambda: EngineStats(model="random:tiny")).render().decode()
    assert "process_cpu_pct" not in unmeasured            # None is left out, never sent as 0
    for text in (unmeasured, VLLM_V1):
        snap = parse_metrics(text)
        assert all(k in snap and snap[k] is None for k in CPU_FIGURES)
