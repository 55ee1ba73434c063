"""Credentials and TLS for the cluster planes, against real servers: NATS with a user and
password and over TLS, etcd with authentication on and over TLS with client certificates.
Passwords never reach a log line."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpx
import pytest

from orchestrator.cli.main import build_parser
from orchestrator.runtime.discovery import DiscoveryUnavailable, make_discovery
from orchestrator.runtime.discovery.etcd import EtcdDiscovery
from orchestrator.runtime.events import make_event_plane
from orchestrator.runtime.protocol import Instance
from orchestrator.runtime.urls import redacted
from tests.certs import make_certs
from tests.servers import etcd_server, nats_server

PASSWORD = "s3cret-pw"


def test_redacted_hides_passwords_and_tokens() -> None:
    assert redacted("nats://weir:s3cret@10.0.0.1:4222") == "nats://weir:***@10.0.0.1:4222"
    assert redacted("nats://t0ken@nats:4222") == "nats://***@nats:4222"
    assert redacted("http://root:pw@etcd:2379") == "http://root:***@etcd:2379"
    assert redacted("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"
    assert redacted("etcd:2379") == "etcd:2379"


async def roundtrip(url: str) -> bytes:
    plane = make_event_plane(url)
    try:
        sub = await plane.subscribe("weir.creds.m.kv")
        await plane.publish("weir.creds.m.kv", b"hello")
        return await asyncio.wait_for(anext(sub), 5)
    finally:
        await plane.close()


async def test_nats_user_and_password_in_the_url(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with nats_server(tmp_path, "--user", "weir", "--pass", PASSWORD) as url:
        host = url.removeprefix("nats://")
        assert await roundtrip(f"nats://weir:{PASSWORD}@{host}") == b"hello"
        caplog.set_level(logging.INFO)
        # A refused login is an outage to the plane: it keeps retrying (and says why) while
        # nothing is delivered.
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(roundtrip(f"nats://weir:wrong-{PASSWORD}@{host}"), 3)
    assert "Authorization Violation" in caplog.text
    assert PASSWORD not in caplog.text


async def test_nats_over_tls_verified_against_a_private_ca(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    certs = make_certs(tmp_path)
    tls = ("--tls", "--tlscert", str(certs.cert), "--tlskey", str(certs.key))
    with nats_server(tmp_path, *tls) as url:
        tls_url = url.replace("nats://", "tls://")
        # ssl.create_default_context, which nats-py uses for tls://, trusts $SSL_CERT_FILE.
        monkeypatch.setenv("SSL_CERT_FILE", str(certs.ca))
        assert await roundtrip(tls_url) == b"hello"
        (tmp_path / "other").mkdir()
        monkeypatch.setenv("SSL_CERT_FILE", str(make_certs(tmp_path / "other").ca))
        with pytest.raises(TimeoutError):  # an untrusted server gets nothing, and it says why
            await asyncio.wait_for(roundtrip(tls_url), 3)
    assert "CERTIFICATE_VERIFY_FAILED" in caplog.text


def enable_etcd_auth(url: str) -> None:
    """A root user with the root role, then authentication on: etcd's JSON gateway (v3.4)."""
    for path, body in [
        ("user/add", {"name": "root", "password": PASSWORD}),
        ("role/add", {"name": "root"}),
        ("user/grant", {"user": "root", "role": "root"}),
        ("enable", {}),
    ]:
        httpx.post(f"{url}/v3/auth/{path}", json=body, timeout=10).raise_for_status()


async def test_etcd_user_and_password_in_the_url(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with etcd_server(tmp_path) as url:
        enable_etcd_auth(url)
        host = url.removeprefix("http://")
        authorized = make_discovery(f"http://root:{PASSWORD}@{host}", "creds")
        anonymous = make_discovery(url, "creds")
        try:
            await authorized.register(Instance(instance_id="w1", component="worker"))
            assert [i.instance_id for i in await authorized.list("worker")] == ["w1"]
            caplog.set_level(logging.INFO)
            with pytest.raises(DiscoveryUnavailable):
                await anonymous.list("worker")
        finally:
            await authorized.close()
            await anonymous.close()
    assert PASSWORD not in caplog.text


async def test_etcd_over_tls_with_a_client_certificate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    certs = make_certs(tmp_path)
    with etcd_server(tmp_path, tls=certs) as url:
        assert url.startswith("https://")
        monkeypatch.setenv("SSL_CERT_FILE", str(certs.ca))
        # etcd was started with --client-cert-auth: without a certificate it accepts no call.
        anonymous = EtcdDiscovery(url, "tls", timeout=2.0)
        try:
            with pytest.raises(DiscoveryUnavailable):
                await anonymous.list("worker")
        finally:
            await anonymous.close()
        # The test certificate has no key-usage limits, so it serves as the client's too.
        monkeypatch.setenv("WEIR_ETCD_CERT_FILE", str(certs.cert))
        monkeypatch.setenv("WEIR_ETCD_KEY_FILE", str(certs.key))
        trusted = EtcdDiscovery(url, "tls", timeout=2.0)
        try:
            await trusted.register(Instance(instance_id="w1", component="worker"))
            assert [i.instance_id for i in await trusted.list("worker")] == ["w1"]
        finally:
            await trusted.close()
        # A server the CA bundle does not vouch for gets nothing, even with the certificate.
        (tmp_path / "other").mkdir()
        monkeypatch.setenv("SSL_CERT_FILE", str(make_certs(tmp_path / "other").ca))
        untrusted = EtcdDiscovery(url, "tls", timeout=2.0)
        try:
            with pytest.raises(DiscoveryUnavailable):
                await untrusted.list("worker")
        finally:
            await untrusted.close()


def test_etcd_over_tls_is_accepted_on_the_command_line() -> None:
    for command in ("worker", "frontend", "router", "status"):
        args = build_parser(only=command).parse_args([command, "--etcd", "https://etcd:2379"])
        assert args.etcd == "https://etcd:2379"
