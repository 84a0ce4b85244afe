"""Access control: API keys on the coordinator, TLS on every hop and mutual TLS on the internal ones.

Certificates are throwaway ones made here with the ``openssl`` CLI (a CA, a server certificate for
127.0.0.1, a client certificate, and a rogue client certificate from another CA).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from harness import InProcessStack

from coordinator.auth import ApiKeyInterceptor, hash_key, parse_key_entries, read_api_key_hashes
from coordinator.cli import coordinator_config
from coordinator.server import SERVICE_NAME
from coordinator.sessions import StoreUnavailable, open_store
from draft_service.engine import ModelDrafter
from specdec import AsyncClient, Client, SpecdecError, TlsClientConfig, Unauthenticated, Unavailable
from specdec.cli import _parser
from specdec.config import DnsDiscovery, ServerConfig
from specdec.rpc import start_server
from specdec.stack import Process, free_port, redis_argv
from target_service.engine import TargetEngine

KEY = "sk-test-3f9c1b7e-right-key"
OTHER_KEY = "sk-test-second-key"
WRONG_KEY = "sk-test-0000-wrong-key"
PROMPT = "w7 w7 w8 w9 w10"
EC_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(folder: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True, timeout=60)


def _make_ca(folder: Path, name: str) -> None:
    _openssl(
        folder,
        "req",
        "-x509",
        *EC_KEY,
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.pem",
        "-days",
        "1",
        "-subj",
        f"/CN=specdec test {name}",
    )


def _make_cert(folder: Path, name: str, ca: str, serial: int, extensions: str) -> None:
    _openssl(folder, "req", *EC_KEY, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
    (folder / f"{name}.ext").write_text(extensions)
    _openssl(
        folder,
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        f"{ca}.pem",
        "-CAkey",
        f"{ca}.key",
        "-set_serial",
        str(serial),
        "-days",
        "1",
        "-out",
        f"{name}.pem",
        "-extfile",
        f"{name}.ext",
    )


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> SimpleNamespace:
    """Paths of a CA, a server certificate for 127.0.0.1, and a trusted and a rogue client certificate."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is needed to make test certificates")
    folder = tmp_path_factory.mktemp("certs")
    _make_ca(folder, "ca")
    _make_ca(folder, "rogue-ca")
    _make_cert(folder, "server", "ca", 2, "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    _make_cert(folder, "client", "ca", 3, "extendedKeyUsage=clientAuth\n")
    _make_cert(folder, "rogue", "rogue-ca", 4, "extendedKeyUsage=clientAuth\n")
    # Names a host only, as a certificate issued for a Service does: dialling its IP does not match it.
    _make_cert(folder, "named", "ca", 5, "subjectAltName=DNS:localhost\nextendedKeyUsage=serverAuth\n")
    return SimpleNamespace(
        **{
            f"{name}_{part}": folder / f"{name}.{ext}"
            for name in ("ca", "server", "client", "rogue", "named")
            for part, ext in (("cert", "pem"), ("key", "key"))
        }
    )


def reference(loaded, prompt: str, max_new_tokens: int) -> list[int]:
    """Target-only greedy decoding in process, with HF generate."""
    ids = loaded.tokenizer.encode(prompt, add_special_tokens=False)
    with torch.inference_mode():
        out = loaded.model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(ids) :].tolist()


def _health(channel: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


# ---- API keys: reading, hashing, comparing -------------------------------------------------------------


def test_key_entries_are_hashed_and_digests_accepted(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"# team keys\n\n{KEY}\nsha256:{hash_key(OTHER_KEY).upper()}\n")
    hashes = read_api_key_hashes(keys_file, f" {WRONG_KEY} ,,{KEY}")
    assert hashes == (hash_key(KEY), hash_key(OTHER_KEY), hash_key(WRONG_KEY))
    assert not any(key in "".join(hashes) for key in (KEY, OTHER_KEY, WRONG_KEY))
    with pytest.raises(ValueError, match="entry 2") as err:
        parse_key_entries(["ok", "sha256:not-hex-" + KEY], "keys")
    assert KEY not in str(err.value)
    assert read_api_key_hashes(None, None) == ()


def test_interceptor_allows_only_known_keys():
    interceptor = ApiKeyInterceptor([hash_key(KEY), hash_key(OTHER_KEY)])
    assert interceptor.allows(KEY) and interceptor.allows(OTHER_KEY)
    assert not interceptor.allows(WRONG_KEY) and not interceptor.allows("")
    with pytest.raises(ValueError):
        ApiKeyInterceptor([])


def test_cli_reads_keys_and_tls_once(tmp_path, monkeypatch):
    keys_file = tmp_path / "keys"
    keys_file.write_text(KEY + "\n")
    monkeypatch.setenv("SPECDEC_API_KEYS", OTHER_KEY)
    pem = [str(tmp_path / f"{name}.pem") for name in ("cert", "key", "ca", "client-cert", "client-key")]
    args = _parser().parse_args(
        [
            "serve-coordinator",
            "--draft",
            "d:1",
            "--target",
            "t:2",
            "--api-keys-file",
            str(keys_file),
            "--tls-cert",
            pem[0],
            "--tls-key",
            pem[1],
            "--tls-ca",
            pem[2],
            "--tls-client-cert",
            pem[3],
            "--tls-client-key",
            pem[4],
        ]
    )
    config = coordinator_config(args)
    assert config.api_key_hashes == (hash_key(KEY), hash_key(OTHER_KEY))
    assert config.server.tls_cert == Path(pem[0]) and config.server.tls_client_ca is None
    assert config.backend_tls == TlsClientConfig(ca=Path(pem[2]), cert=Path(pem[3]), key=Path(pem[4]))
    monkeypatch.delenv("SPECDEC_API_KEYS")
    plain = coordinator_config(_parser().parse_args(["serve-coordinator"]))
    assert plain.api_key_hashes == () and plain.backend_tls is None and plain.server.tls_cert is None
    with pytest.raises(SystemExit, match="certificate"):
        coordinator_config(_parser().parse_args(["serve-coordinator", "--tls-cert", pem[0]]))
    with pytest.raises(SystemExit, match="client certificate"):
        coordinator_config(_parser().parse_args(["serve-coordinator", "--tls-client-cert", pem[3]]))


# ---- API keys on a running coordinator ------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(tiny_target, tiny_draft, tiny_dir, redis_url):
    """A coordinator that requires KEY or OTHER_KEY, and an open one over the same services."""
    stack = InProcessStack(
        TargetEngine(tiny_target, 16), ModelDrafter(tiny_draft, 16, 64), tiny_dir / "target", redis_url
    )
    stack.start(api_key_hashes=(hash_key(KEY), hash_key(OTHER_KEY)))
    open_address = stack.add_coordinator()
    yield SimpleNamespace(stack=stack, address=stack.address, open_address=open_address)
    stack.close()


def test_missing_or_wrong_key_is_unauthenticated(keyed):
    with Client(keyed.address, timeout=30) as client:
        with pytest.raises(Unauthenticated, match="missing API key") as err:
            client.complete(PROMPT, max_new_tokens=5)
        assert isinstance(err.value, SpecdecError) and err.value.code == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(Unauthenticated, match="missing API key"):
            list(client.stream(PROMPT, max_new_tokens=5))
    with Client(keyed.address, timeout=30, api_key=WRONG_KEY) as client:
        with pytest.raises(Unauthenticated, match="invalid API key"):
            client.complete(PROMPT, max_new_tokens=5)
        with pytest.raises(Unauthenticated, match="invalid API key"):
            list(client.stream(PROMPT, max_new_tokens=5))
    # A key sent under another scheme is no bearer token.
    with grpc.insecure_channel(keyed.address) as channel:
        call = channel.unary_unary(f"/{SERVICE_NAME}/Complete")
        with pytest.raises(grpc.RpcError) as rpc_err:
            call(b"", timeout=10, metadata=(("authorization", f"Basic {KEY}"),))
        assert rpc_err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_right_key_completes_like_an_open_coordinator(keyed):
    with Client(keyed.open_address, timeout=60) as client:
        expected = client.complete(PROMPT, max_new_tokens=20, k=3)
    for key in (KEY, OTHER_KEY):
        with Client(keyed.address, timeout=60, api_key=key) as client:
            result = client.complete(PROMPT, max_new_tokens=20, k=3)
            streamed = [t for chunk in client.stream(PROMPT, max_new_tokens=20, k=3) for t in chunk.token_ids]
        assert result.token_ids == expected.token_ids and result.text == expected.text
        assert streamed == expected.token_ids

    async def complete_async() -> list[int]:
        async with AsyncClient(keyed.address, timeout=60, api_key=KEY) as client:
            return (await client.complete(PROMPT, max_new_tokens=20, k=3)).token_ids

    assert asyncio.run(complete_async()) == expected.token_ids


def test_health_and_reflection_need_no_key(keyed):
    with grpc.insecure_channel(keyed.address) as channel:
        assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        replies = stub.ServerReflectionInfo(iter([request]), timeout=10)
        names = {s.name for reply in replies for s in reply.list_services_response.service}
    assert SERVICE_NAME in names


def test_keys_never_reach_the_logs(keyed, caplog):
    caplog.set_level(logging.DEBUG)
    for key in (None, WRONG_KEY, KEY):
        with Client(keyed.address, timeout=30, api_key=key) as client:
            try:
                client.complete(PROMPT, max_new_tokens=3)
            except Unauthenticated:
                pass
    assert "refused a call" in caplog.text  # the refusals were logged, and captured here
    for key in (KEY, WRONG_KEY, OTHER_KEY):
        assert key not in caplog.text


# ---- TLS and mutual TLS -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def secure(certs, tiny_target, tiny_draft, tiny_dir, redis_url):
    """Draft and target demand client certificates; the coordinator serves TLS and requires KEY."""
    services = ServerConfig(tls_cert=certs.server_cert, tls_key=certs.server_key, tls_client_ca=certs.ca_cert)
    stack = InProcessStack(
        TargetEngine(tiny_target, 16),
        ModelDrafter(tiny_draft, 16, 64),
        tiny_dir / "target",
        redis_url,
        services=services,
    )
    stack.start(
        server=ServerConfig(tls_cert=certs.server_cert, tls_key=certs.server_key),
        backend_tls=TlsClientConfig(ca=certs.ca_cert, cert=certs.client_cert, key=certs.client_key),
        api_key_hashes=(hash_key(KEY),),
    )
    yield stack
    stack.close()


def _credentials(certs, client: str | None) -> grpc.ChannelCredentials:
    ca = certs.ca_cert.read_bytes()
    if client is None:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    key, cert = getattr(certs, f"{client}_key").read_bytes(), getattr(certs, f"{client}_cert").read_bytes()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


@pytest.mark.parametrize("service", ["draft", "target"])
def test_mtls_service_refuses_clients_without_a_valid_certificate(secure, certs, service):
    address = getattr(secure, f"{service}_address")
    with grpc.secure_channel(address, _credentials(certs, "client")) as channel:
        assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
    for client in (None, "rogue"):  # no certificate; one from a CA the service does not trust
        with grpc.secure_channel(address, _credentials(certs, client)) as channel:
            with pytest.raises(grpc.RpcError) as err:
                _health(channel)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, client
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            _health(channel)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_full_stack_over_tls_with_mutual_tls_hops(secure, certs, tiny_target):
    tls = TlsClientConfig(ca=certs.ca_cert)
    with Client(secure.address, timeout=60, tls=tls, api_key=KEY) as client:
        for k in (0, 3):
            result = client.complete(PROMPT, max_new_tokens=20, k=k)
            assert result.token_ids == reference(tiny_target, PROMPT, 20)
        assert result.stats.drafted_tokens > 0  # the draft hop (mutual TLS) was used, not only the target
    with Client(secure.address, timeout=10, tls=tls) as client:
        with pytest.raises(Unauthenticated):
            client.complete(PROMPT, max_new_tokens=3)
    with Client(secure.address, timeout=10, api_key=KEY) as client:  # plaintext to a TLS port
        with pytest.raises(Unavailable):
            client.complete(PROMPT, max_new_tokens=3)


def test_coordinator_without_client_certificate_cannot_reach_services(secure, certs):
    with pytest.raises(TimeoutError, match="UNAVAILABLE"):
        secure.add_coordinator(backend_tls=TlsClientConfig(ca=certs.ca_cert), startup_timeout_s=2.0)


def test_redis_password_from_the_environment(tmp_path, monkeypatch):
    """A Redis that requires AUTH: the password comes from SPECDEC_REDIS_PASSWORD (never a flag), and
    a coordinator without it cannot reach its session store."""
    port = free_port()
    proc = Process("redis-auth", [*redis_argv(port), "--requirepass", "s3cret"], tmp_path, dict(os.environ))
    try:
        wait_for_port(port)
        monkeypatch.setenv("SPECDEC_REDIS_PASSWORD", "s3cret")
        config = coordinator_config(
            _parser().parse_args(
                ["serve-coordinator", "--redis-url", f"redis://127.0.0.1:{port}/0", "--draft", "d:1", "--target", "t:1"]
            )
        )
        assert "s3cret" not in repr(config)

        async def ping(password):
            store = open_store(config.redis_url, 60, password)
            try:
                await store.ping()
            finally:
                await store.close()

        asyncio.run(ping(config.redis_password))
        with pytest.raises(StoreUnavailable):
            asyncio.run(ping(None))
    finally:
        proc.stop()


def wait_for_port(port: int, timeout_s: float = 20.0) -> None:
    """Waits until something listens on loopback ``port``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens on {port}"
            time.sleep(0.05)


def test_plaintext_health_port_beside_a_tls_server(certs):
    """Kubelet probes speak plaintext only: a TLS server can serve health alone on a second port, with
    the same status as the TLS port and nothing else there."""

    async def scenario() -> None:
        config = ServerConfig(tls_cert=certs.server_cert, tls_key=certs.server_key, health_port=0)
        running = await start_server(config, lambda server: None, ("specdec.v1.TargetService",))
        probe_address = f"127.0.0.1:{running.health_port}"
        try:
            async with grpc.aio.insecure_channel(probe_address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                status = (await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)).status
                assert status == health_pb2.HealthCheckResponse.NOT_SERVING
                await running.set_serving()
                status = (
                    await stub.Check(health_pb2.HealthCheckRequest(service="specdec.v1.TargetService"), timeout=5)
                ).status
                assert status == health_pb2.HealthCheckResponse.SERVING
                reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    request = reflection_pb2.ServerReflectionRequest(list_services="")
                    async for _ in reflection.ServerReflectionInfo(iter([request]), timeout=5):
                        pass
                assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
            async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:  # the main port stays TLS-only
                    await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await running.stop(0)

    asyncio.run(scenario())


def test_discovered_replicas_are_checked_against_their_service_name(
    certs, tiny_target, tiny_draft, tiny_dir, redis_url
):
    """Discovery dials replicas by IP, but their certificates name the Service: the coordinator checks
    each certificate against the discovered name, not the IP."""
    services = ServerConfig(tls_cert=certs.named_cert, tls_key=certs.named_key)
    stack = InProcessStack(
        TargetEngine(tiny_target, 16),
        ModelDrafter(tiny_draft, 16, 64),
        tiny_dir / "target",
        redis_url,
        services=services,
    )
    try:
        stack.target_address = stack.add_target(stack.target_engine)
        stack.draft_address = stack.add_draft(stack.draft_engine)
        tls = TlsClientConfig(ca=certs.ca_cert)
        with pytest.raises(TimeoutError, match="UNAVAILABLE"):  # by IP, the certificate does not match
            stack.add_coordinator(backend_tls=tls, startup_timeout_s=2.0)
        port = {role: int(getattr(stack, f"{role}_address").rsplit(":", 1)[1]) for role in ("draft", "target")}
        address = stack.add_coordinator(
            draft_addresses=(),
            target_addresses=(),
            backend_tls=tls,
            discovery_interval_s=0.5,
            draft_discovery=DnsDiscovery("localhost", port["draft"]),
            target_discovery=DnsDiscovery("localhost", port["target"]),
        )
        with Client(address, timeout=60) as client:
            result = client.complete(PROMPT, max_new_tokens=12, k=3)
        assert result.token_ids == reference(tiny_target, PROMPT, 12)
        assert result.stats.drafted_tokens > 0
    finally:
        stack.close()
