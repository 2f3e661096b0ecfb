"""The worker's HTTP port (``--metrics-port``): Prometheus metrics and Kubernetes probes.

- ``/metrics``: the worker's registry, in Prometheus' text format (``prometheus_client``).
- ``/livez``: 200 while the batch loop and the fetch thread keep turning (idle counts:
  both turn at least every few hundred milliseconds); 503 once either has been stuck
  for ``liveness_timeout_s`` (a handler that never returns, a deadlock). Restart on it.
- ``/readyz``: 200 once the worker has joined its group, claimed every partition it was
  assigned, and its database answers; 503 before that, during a rebalance's claim, and
  while the database is away or a topic it produces to does not exist. Take it out of
  rotation on it, do not restart it.

The body of each probe is one line saying why. Served by a small threaded WSGI
server (the standard library's), one daemon thread per request.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from kstore.errors import ConfigurationError

log = logging.getLogger(__name__)

#: What a probe asks of the worker: (healthy, why).
Probe = Callable[[], tuple[bool, str]]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr (a probe every few seconds would drown the worker's own lines)."""

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("http: " + format, *args)


def app(registry: CollectorRegistry, livez: Probe, readyz: Probe) -> Callable[..., Iterable[bytes]]:
    """The WSGI app: /metrics, /livez, /readyz."""
    metrics = make_wsgi_app(registry)

    def probe(check: Probe, start_response: Callable[..., Any]) -> list[bytes]:
        healthy, why = check()
        status = "200 OK" if healthy else "503 Service Unavailable"
        start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
        return [f"{'ok' if healthy else 'unhealthy'}: {why}\n".encode()]

    def route(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/livez":
            return probe(livez, start_response)
        if path == "/readyz":
            return probe(readyz, start_response)
        if path in ("/metrics", "/"):
            return metrics(environ, start_response)  # type: ignore[no-any-return]
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"not found: try /metrics, /livez or /readyz\n"]

    return route


class HealthServer:
    """Serves :func:`app` on ``host:port`` from a daemon thread until :meth:`stop`."""

    def __init__(self, host: str, port: int, wsgi: Callable[..., Iterable[bytes]]) -> None:
        try:
            self._server = make_server(host, port, wsgi, server_class=_Server, handler_class=_QuietHandler)
        except OSError as exc:  # the port taken, an address not of this host, a name that does not resolve
            raise ConfigurationError(f"cannot serve /metrics on {host}:{port} (metrics_host, metrics_port): "
                                     f"{exc.strerror or exc}") from None
        self._thread = threading.Thread(target=self._server.serve_forever, name="kstore-http", daemon=True)

    @property
    def port(self) -> int:
        """The port bound (the one asked for, or the one chosen for port 0)."""
        return int(self._server.server_address[1])

    def start(self) -> HealthServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
