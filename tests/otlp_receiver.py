"""An in-process OTLP/HTTP trace receiver for tests: what an exporter (the engine's own
provider, vLLM's) sends to ``POST /v1/traces``, decoded with opentelemetry-proto.

``with otlp_receiver() as rx:`` serves on a free localhost port in one thread (stopped and
joined when the block ends); ``rx.endpoint`` is the URL to export to, ``rx.spans()`` every
span received so far, ``rx.wait_for(match, timeout)`` blocks (a real wait, bounded) until a
span matches."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root
    kind: int
    attributes: dict[str, object]
    service: str


def _value(v: object) -> object:
    kind = v.WhichOneof("value")  # type: ignore[attr-defined]
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)  # type: ignore[attr-defined]
    return getattr(v, kind) if kind else None


def decode(body: bytes) -> list[ReceivedSpan]:
    """Every span of one OTLP/HTTP protobuf export request. Pure."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    out = []
    for rs in request.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for span in ss.spans:
                out.append(
                    ReceivedSpan(
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        kind=span.kind,
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        service=str(resource.get("service.name", "")),
                    )
                )
    return out


class Receiver:
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._spans: list[ReceivedSpan] = []
        self._changed = threading.Condition()
        self.requests = 0

    def add(self, spans: list[ReceivedSpan]) -> None:
        with self._changed:
            self.requests += 1
            self._spans.extend(spans)
            self._changed.notify_all()

    def spans(self) -> list[ReceivedSpan]:
        with self._changed:
            return list(self._spans)

    def wait_for(self, match: Callable[[ReceivedSpan], bool], timeout: float) -> ReceivedSpan:  # noqa: ASYNC109
        """The first span received that matches; waits up to ``timeout`` seconds (blocking:
        call it from a worker thread in a trio test). Raises TimeoutError naming what came."""
        with self._changed:
            found = self._changed.wait_for(
                lambda: next((s for s in self._spans if match(s)), None), timeout
            )
            if found is None:
                names = sorted({s.name for s in self._spans})
                raise TimeoutError(f"no matching span within {timeout}s; received: {names}")
            return found


@contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    receiver: Receiver

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            status = 200
            try:
                receiver.add(decode(body))
            except Exception:
                status = 400
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(status)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver = Receiver(f"http://127.0.0.1:{server.server_address[1]}/v1/traces")
    thread = threading.Thread(target=server.serve_forever, name="otlp-receiver")
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
