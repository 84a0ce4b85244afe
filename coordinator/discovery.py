"""Where the draft and target replicas are: a fixed list, DNS of a headless Service, or the
Kubernetes API.

A service's replicas are named by spec strings, parsed once at the CLI edge:

- ``host:port`` (repeatable): a fixed list.
- ``dns:///host:port``: every A and AAAA record of ``host``, looked up again every interval.
- ``k8s:///namespace/service:port``: the ready endpoints of the Service's EndpointSlices, watched
  through the Kubernetes API. ``port`` is the pods' port, or the name of a Service port.

A running source publishes the whole set of ready addresses (``ip:port``) on the event loop whenever
it changes; ``coordinator.membership`` turns those sets into replicas joining and leaving.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from specdec.config import DnsDiscovery, KubernetesDiscovery

log = logging.getLogger(__name__)

Discovery = DnsDiscovery | KubernetesDiscovery
# Called on the event loop with the full set of ready addresses, each time the set changes.
Publish = Callable[[frozenset[str]], None]
# Every address a name resolves to, as host:port; raises OSError when the lookup fails.
Resolver = Callable[[str, int], Iterable[str]]

# A Kubernetes namespace, Service or port name: an RFC 1123 label.
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_SPEC_FORMS = "host:port, dns:///host:port or k8s:///namespace/service:port"
# First wait after a failed Kubernetes list or watch; it doubles up to the discovery interval.
_FIRST_BACKOFF_S = 0.5
# Seconds a watch runs before the server ends it and it is resumed from its last version (the API
# server's own limit is similar); ended watches are how a silently dead connection gets noticed.
_WATCH_S = 240
# Seconds to connect to the Kubernetes API.
_CONNECT_S = 10.0


def join_host_port(host: str, port: int) -> str:
    """``host:port`` as gRPC spells it, with IPv6 literals in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _split_port(value: str, text: str) -> tuple[str, str]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port:
        raise ValueError(f"{text!r}: expected {_SPEC_FORMS}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"{text!r}: write an IPv6 address in brackets, as [::1]:50051")
    if not host or any(c.isspace() or c in "/[]" for c in host):
        raise ValueError(f"{text!r}: {host!r} is not a host name or IP address")
    return host, port


def _port_number(port: str, text: str) -> int:
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{text!r}: the port must be a number from 1 to 65535, not {port!r}")
    return int(port)


def parse_spec(text: str) -> str | Discovery:
    """One replica spec: a static ``host:port`` (returned as given), or a discovery spec."""
    scheme, sep, rest = text.partition("://")
    if not sep:
        host, port = _split_port(text, text)
        _port_number(port, text)
        return text
    if scheme not in ("dns", "k8s"):
        raise ValueError(f"{text!r}: unknown scheme {scheme!r}; expected {_SPEC_FORMS}")
    if not rest.startswith("/"):
        raise ValueError(
            f"{text!r}: naming a {'DNS server' if scheme == 'dns' else 'cluster'} is not supported; "
            f"write {scheme}:/// with three slashes"
        )
    if scheme == "dns":
        host, port = _split_port(rest[1:], text)
        return DnsDiscovery(host, _port_number(port, text))
    namespace, slash, service_port = rest[1:].partition("/")
    service, port = _split_port(service_port, text) if slash else ("", "")
    for what, value in (("namespace", namespace), ("service", service)):
        if not _LABEL.fullmatch(value):
            raise ValueError(
                f"{text!r}: the {what} {value!r} is not a Kubernetes name; expected k8s:///namespace/service:port"
            )
    if port.isdigit():
        return KubernetesDiscovery(namespace, service, _port_number(port, text))
    if not _LABEL.fullmatch(port):
        raise ValueError(f"{text!r}: the port must be a number or a Service port name, not {port!r}")
    return KubernetesDiscovery(namespace, service, port)


def parse_replicas(values: Sequence[str], flag: str) -> tuple[tuple[str, ...], Discovery | None]:
    """One service's repeated ``flag`` values: static addresses, or exactly one discovery spec."""
    try:
        specs = [parse_spec(v) for v in values]
    except ValueError as exc:
        raise ValueError(f"{flag} {exc}") from None
    dynamic = [s for s in specs if not isinstance(s, str)]
    if dynamic and len(specs) > 1:
        raise ValueError(
            f"{flag}: a dns:/// or k8s:/// spec finds every replica itself; give it once, without other addresses"
        )
    if dynamic:
        return (), dynamic[0]
    return tuple(specs), None


class Source(Protocol):
    """A running discovery source."""

    async def run(self, publish: Publish) -> None:
        """Publishes the ready addresses now and on every change, until cancelled."""


def resolve_all(host: str, port: int) -> frozenset[str]:
    """Every address ``host`` resolves to (A and AAAA records), as host:port."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return frozenset(join_host_port(info[4][0], port) for info in infos)


class DnsSource:
    """Looks a name up every interval. A failed or empty lookup keeps the last known set: a DNS blip
    must not take every replica away (replicas that really left fail their calls and rest)."""

    def __init__(self, spec: DnsDiscovery, interval_s: float, resolve: Resolver = resolve_all) -> None:
        self._spec = spec
        self._interval_s = interval_s
        self._resolve = resolve

    async def run(self, publish: Publish) -> None:
        """Resolves now and every interval, publishing each new set, until cancelled."""
        name = f"dns:///{join_host_port(self._spec.host, self._spec.port)}"
        last: frozenset[str] | None = None
        while True:
            try:
                # getaddrinfo blocks, so it runs on a worker thread.
                found = frozenset(await asyncio.to_thread(self._resolve, self._spec.host, self._spec.port))
            except Exception as exc:  # noqa: BLE001 - any resolver failure is a blip, never the end
                log.warning("%s: lookup failed, keeping %d known replicas: %s", name, len(last or ()), exc)
            else:
                if not found:
                    log.warning("%s: lookup found no address, keeping %d known replicas", name, len(last or ()))
                elif found != last:
                    last = found
                    publish(found)
            await asyncio.sleep(self._interval_s)


def _ready(endpoint: Any) -> bool:
    """Whether an endpoint takes traffic: ready (unset counts as ready) and not terminating."""
    conditions = endpoint.conditions
    if conditions is None:
        return True
    return conditions.ready is not False and conditions.terminating is not True


def slice_addresses(endpoint_slice: Any, port: int | str) -> frozenset[str]:
    """The ready ``ip:port`` addresses of one EndpointSlice (a ``V1EndpointSlice``)."""
    if isinstance(port, str):
        # A named port: its number lives in the slice (the Service port's target port).
        numbers = [p.port for p in endpoint_slice.ports or () if p.name == port and p.port]
        if not numbers:
            return frozenset()
        port = numbers[0]
    return frozenset(
        join_host_port(address, port)
        for endpoint in endpoint_slice.endpoints or ()
        if _ready(endpoint)
        for address in endpoint.addresses[:1]  # the only address the slice controller ever sets
    )


class KubernetesSource:
    """Lists a Service's EndpointSlices, then watches them, on a thread (the client blocks).

    Each slice's ready addresses are kept by slice name; their union is published. A watch that
    ends is resumed from its last resource version; one that fails (an expired version, a dropped
    connection, a refused request) is followed by a fresh list after a growing pause.
    """

    def __init__(
        self, spec: KubernetesDiscovery, interval_s: float, api_client: Any = None, watch_s: int = _WATCH_S
    ) -> None:
        """``api_client`` (a ``kubernetes.client.ApiClient``) reaches the API; None: the pod's
        in-cluster service account."""
        self._spec = spec
        self._interval_s = interval_s
        self._api_client = api_client
        self._watch_s = watch_s

    @property
    def name(self) -> str:
        """The spec, for log lines."""
        return f"k8s:///{self._spec.namespace}/{self._spec.service}:{self._spec.port}"

    async def run(self, publish: Publish) -> None:
        """Follows the slices on a thread, publishing each new set on this loop, until cancelled."""
        loop = asyncio.get_running_loop()
        changes: asyncio.Queue[frozenset[str]] = asyncio.Queue()
        stopped = threading.Event()
        watches: list[Any] = []

        def deliver(addresses: frozenset[str]) -> None:
            try:
                loop.call_soon_threadsafe(changes.put_nowait, addresses)
            except RuntimeError:  # the event loop closed under the thread: the coordinator is gone
                stopped.set()

        thread = threading.Thread(
            target=self._follow, args=(deliver, stopped, watches), daemon=True, name=f"discovery {self.name}"
        )
        thread.start()
        try:
            while True:
                addresses = await changes.get()
                while not changes.empty():  # only the newest set matters
                    addresses = changes.get_nowait()
                publish(addresses)
        finally:
            stopped.set()
            for watch in list(watches):  # a copy: the thread adds and removes watches
                watch.stop()  # also shuts the socket, waking a thread blocked reading the stream
            await asyncio.to_thread(thread.join, 5.0)

    def _follow(self, deliver: Publish, stopped: threading.Event, watches: list[Any]) -> None:
        """The thread: list, watch, and on failure list again, until ``stopped``."""
        from kubernetes import client, config, watch

        api_client = self._api_client
        if api_client is None:
            configuration = client.Configuration()
            try:
                config.load_incluster_config(client_configuration=configuration)
            except config.ConfigException as exc:
                log.error("%s: no in-cluster Kubernetes credentials, so no replicas: %s", self.name, exc)
                return
            api_client = client.ApiClient(configuration)
        api = client.DiscoveryV1Api(api_client)
        namespace, port = self._spec.namespace, self._spec.port
        selector = f"kubernetes.io/service-name={self._spec.service}"
        # The read timeout outlasts a watch, which the server ends after ``_watch_s``.
        timeout = (_CONNECT_S, self._watch_s + 30.0)
        backoff = _FIRST_BACKOFF_S
        slices: dict[str, frozenset[str]] = {}
        try:
            while not stopped.is_set():
                try:
                    listed = api.list_namespaced_endpoint_slice(
                        namespace, label_selector=selector, _request_timeout=timeout
                    )
                    slices = {s.metadata.name: slice_addresses(s, port) for s in listed.items}
                    current = frozenset().union(*slices.values())
                    deliver(current)
                    version = listed.metadata.resource_version
                    while not stopped.is_set():
                        follower = watch.Watch()
                        watches.append(follower)
                        try:
                            for event in follower.stream(
                                api.list_namespaced_endpoint_slice,
                                namespace,
                                label_selector=selector,
                                resource_version=version,
                                timeout_seconds=self._watch_s,
                                allow_watch_bookmarks=True,
                                _request_timeout=timeout,
                            ):
                                if event["type"] in ("ADDED", "MODIFIED"):
                                    slices[event["object"].metadata.name] = slice_addresses(event["object"], port)
                                elif event["type"] == "DELETED":
                                    slices.pop(event["object"].metadata.name, None)
                                backoff = _FIRST_BACKOFF_S  # the watch works
                                union = frozenset().union(*slices.values())
                                if union != current:
                                    current = union
                                    deliver(current)
                        finally:
                            watches.remove(follower)
                        version = follower.resource_version or version
                except client.ApiException as exc:
                    if stopped.is_set():
                        return
                    if exc.status == 410:
                        # The watch's version expired, as versions do: list afresh at once.
                        log.info("%s: watch expired; listing again", self.name)
                        continue
                    log.warning(
                        "%s: API error %s %s; listing again in %.1fs", self.name, exc.status, exc.reason, backoff
                    )
                    stopped.wait(backoff)
                    backoff = min(2 * backoff, max(self._interval_s, _FIRST_BACKOFF_S))
                except Exception as exc:  # noqa: BLE001 - the API may fail in many ways; each means list again
                    if stopped.is_set():
                        return
                    log.warning("%s: %s; listing again in %.1fs", self.name, exc, backoff)
                    stopped.wait(backoff)
                    backoff = min(2 * backoff, max(self._interval_s, _FIRST_BACKOFF_S))
        finally:
            if self._api_client is None:
                api_client.close()


def open_source(spec: Discovery, interval_s: float, kubernetes_api: Any = None) -> Source:
    """The running source for a discovery spec (``kubernetes_api``: see ``KubernetesSource``)."""
    if isinstance(spec, DnsDiscovery):
        return DnsSource(spec, interval_s)
    return KubernetesSource(spec, interval_s, kubernetes_api)
