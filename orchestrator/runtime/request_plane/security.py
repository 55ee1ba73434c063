"""What closes the request plane: frame and connection limits, the cluster-secret handshake, TLS.

Handshake (only when a cluster secret is set; both ends need the same one). Raw bytes, before
any frame:

    server -> caller   nonce_s (32 random bytes)
    caller -> server   HMAC-SHA256(secret, "weir-caller" + nonce_s) + nonce_c (32 random bytes)
    server -> caller   HMAC-SHA256(secret, "weir-server" + nonce_c + nonce_s)

The secret never crosses the wire, a recorded answer is useless against a fresh nonce, and
the caller sends no call before the server proved it holds the secret too (mutual), so a
stranger listening on a worker's address learns no prompt. Until its answer checks out, the
server processes no frame, and it closes a connection that has not answered within
`handshake_timeout`.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import ssl
from dataclasses import dataclass, field

NONCE_BYTES = 32
MAC_BYTES = hashlib.sha256().digest_size
CALLER_CONTEXT = b"weir-caller"
SERVER_CONTEXT = b"weir-server"

DEFAULT_MAX_FRAME_BYTES = 4 * 1024 * 1024
# A caller reads answers from servers it chose (and, with a secret, authenticated): they may be
# larger than any request, e.g. `model_files` (up to MAX_MODEL_FILES_BYTES of tokenizer files).
MAX_ANSWER_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_MAX_CONNECTIONS_PER_PEER = 64
DEFAULT_HANDSHAKE_TIMEOUT = 5.0


@dataclass(frozen=True, slots=True)
class PlaneSecurity:
    """How one process's request-plane servers and callers protect themselves. The default
    is open (no secret, no TLS) with bounded frames and connections."""

    # Kept out of repr so it never reaches a log line.
    secret: bytes | None = field(default=None, repr=False)
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_connections_per_peer: int = DEFAULT_MAX_CONNECTIONS_PER_PEER
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT
    server_tls: ssl.SSLContext | None = None
    client_tls: ssl.SSLContext | None = None

    def __post_init__(self) -> None:
        if self.secret is not None and len(self.secret) < 16:
            raise ValueError("the cluster secret must be at least 16 bytes")
        for name in ("max_frame_bytes", "max_connections", "max_connections_per_peer"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.handshake_timeout <= 0:
            raise ValueError("handshake_timeout must be positive")


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def caller_proof(secret: bytes, server_nonce: bytes) -> bytes:
    return hmac.digest(secret, CALLER_CONTEXT + server_nonce, "sha256")


def server_proof(secret: bytes, caller_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.digest(secret, SERVER_CONTEXT + caller_nonce + server_nonce, "sha256")


def matches(expected: bytes, given: bytes) -> bool:
    return hmac.compare_digest(expected, given)


def server_tls_context(cert: str, key: str, ca: str | None = None) -> ssl.SSLContext:
    """TLS for a listening server; with `ca`, callers must present a certificate it signed."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    if ca:
        context.load_verify_locations(ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_tls_context(ca: str, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    """TLS for a caller: the server's certificate must chain to `ca`. Host names are not
    checked: callers dial pod IPs found in discovery, which no certificate could list ahead of
    time; the CA says "one of ours", the cluster secret says who."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    context.check_hostname = False
    if cert and key:
        context.load_cert_chain(cert, key)
    return context
