"""A fake Kubernetes API server on loopback that serves EndpointSlices of one namespace.

It answers what the real ``kubernetes`` client sends for discovery: a list
(``GET /apis/discovery.k8s.io/v1/namespaces/<ns>/endpointslices?labelSelector=...``, an
EndpointSliceList with its resourceVersion) and a watch (the same with ``watch=true``: a chunked
stream of newline-delimited JSON events, replayed from the requested resourceVersion). Tests change
the slices through methods that record events, like the API server's watch cache does.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from kubernetes import client

SERVICE_LABEL = "kubernetes.io/service-name"


def endpoint_slice(
    name: str,
    service: str,
    endpoints: list[tuple[str, bool | None, bool | None]],
    port: int,
    port_name: str = "grpc",
    address_type: str = "IPv4",
) -> dict:
    """An EndpointSlice of ``service``: one endpoint per (address, ready, terminating); None leaves
    a condition unset."""
    items = []
    for address, ready, terminating in endpoints:
        conditions = {}
        if ready is not None:
            conditions["ready"] = ready
            conditions["serving"] = ready
        if terminating is not None:
            conditions["terminating"] = terminating
        items.append({"addresses": [address], "conditions": conditions})
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "labels": {SERVICE_LABEL: service}},
        "addressType": address_type,
        "endpoints": items,
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
    }


class FakeKubernetesApi:
    """EndpointSlices of one namespace, listed and watched over HTTP."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._changed = threading.Condition()
        self._slices: dict[str, dict] = {}
        self._version = 1
        # (resourceVersion, type, object): what watches replay and stream.
        self._events: list[tuple[int, str, dict]] = []
        self._closing = False
        self.lists = 0
        self.open_watches = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                fake._serve(self)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """Where the fake listens."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def api_client(self) -> client.ApiClient:
        """A real client pointed at the fake."""
        return client.ApiClient(client.Configuration(host=self.url))

    def put(self, obj: dict) -> None:
        """Creates (ADDED) or replaces (MODIFIED) a slice."""
        name = obj["metadata"]["name"]
        self._record("MODIFIED" if name in self._slices else "ADDED", obj)

    def delete(self, name: str) -> None:
        """Deletes a slice (DELETED)."""
        self._record("DELETED", self._slices[name])

    def put_quietly(self, obj: dict) -> None:
        """Changes a slice without a watch event, as if the event fell into an expired window: only a
        fresh list shows it."""
        with self._changed:
            self._version += 1
            self._slices[obj["metadata"]["name"]] = self._stamped(obj)

    def expire_watches(self) -> None:
        """Ends open watches with the 410 Gone error of an expired resourceVersion."""
        status = {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "reason": "Expired",
            "message": "too old resource version",
            "code": 410,
        }
        with self._changed:
            self._version += 1
            self._events.append((self._version, "ERROR", status))
            self._changed.notify_all()

    def close(self) -> None:
        """Ends every watch and stops serving."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._server.shutdown()
        self._server.server_close()

    def _stamped(self, obj: dict) -> dict:
        obj = json.loads(json.dumps(obj))
        obj["metadata"]["namespace"] = self.namespace
        obj["metadata"]["resourceVersion"] = str(self._version)
        return obj

    def _record(self, kind: str, obj: dict) -> None:
        with self._changed:
            self._version += 1
            stamped = self._stamped(obj)
            if kind == "DELETED":
                del self._slices[stamped["metadata"]["name"]]
            else:
                self._slices[stamped["metadata"]["name"]] = stamped
            self._events.append((self._version, kind, stamped))
            self._changed.notify_all()

    def _serve(self, request: BaseHTTPRequestHandler) -> None:
        url = urlsplit(request.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        if url.path != f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices":
            self._reply(request, 404, {"kind": "Status", "code": 404, "reason": "NotFound", "message": url.path})
            return
        key, _, service = query.get("labelSelector", "").partition("=")
        if key != SERVICE_LABEL or not service:
            self._reply(
                request,
                400,
                {
                    "kind": "Status",
                    "code": 400,
                    "reason": "BadRequest",
                    "message": "discovery must select one service's slices",
                },
            )
            return
        if query.get("watch") == "true":
            self._watch(request, service, int(query.get("resourceVersion", "0")))
            return
        with self._changed:
            self.lists += 1
            items = [s for s in self._slices.values() if s["metadata"]["labels"][SERVICE_LABEL] == service]
            version = self._version
        self._reply(
            request,
            200,
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSliceList",
                "metadata": {"resourceVersion": str(version)},
                "items": items,
            },
        )

    @staticmethod
    def _reply(request: BaseHTTPRequestHandler, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        request.send_response(code)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)

    def _watch(self, request: BaseHTTPRequestHandler, service: str, since: int) -> None:
        request.send_response(200)
        request.send_header("Content-Type", "application/json")
        request.send_header("Transfer-Encoding", "chunked")
        request.end_headers()
        request.wfile.flush()
        with self._changed:
            self.open_watches += 1
        ended = False
        try:
            while not ended:
                with self._changed:
                    self._changed.wait_for(
                        lambda since=since: self._closing or any(v > since for v, _, _ in self._events), timeout=0.2
                    )
                    if self._closing:
                        break
                    fresh = [(v, t, o) for v, t, o in self._events if v > since]
                for version, kind, obj in fresh:
                    since = version
                    if kind != "ERROR" and obj["metadata"]["labels"][SERVICE_LABEL] != service:
                        continue
                    line = json.dumps({"type": kind, "object": obj}).encode() + b"\n"
                    request.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                    request.wfile.flush()
                    # The API server ends a watch after its error event.
                    ended = kind == "ERROR"
                    if ended:
                        break
            request.wfile.write(b"0\r\n\r\n")
            request.wfile.flush()
        except OSError:
            pass  # the client hung up
        finally:
            with self._changed:
                self.open_watches -= 1
            request.close_connection = True
