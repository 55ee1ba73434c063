"""One TCP port shared by sibling frontend processes (`weir frontend --processes N`).

Each process binds its own listening socket with SO_REUSEPORT, so each has its own accept
queue and the kernel spreads new connections across them by a hash of their addresses: no
process wakes for a connection another one takes, and nothing but the port is shared. The
spread ignores load; with keep-alive clients it is per connection, not per request.

The supervisor reserves the port before it starts any child: `reserve` binds it without
SO_REUSEPORT first, so a port some other program already listens on (with or without the
option) fails at once with EADDRINUSE instead of being silently shared, then holds it bound
(not listening: the kernel routes connections only to listening sockets) with the option for
its own lifetime, so `--port 0` resolves once for every child and no one else takes it while
a child restarts. Linux only lets sockets of the same user join a SO_REUSEPORT group.
"""

from __future__ import annotations

import socket


def _socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


def reserve(host: str, port: int) -> socket.socket:
    """A socket holding `host:port` (port 0: a free one) for processes that `listen_shared`."""
    with _socket(host, port, reuse_port=False) as probe:
        port = probe.getsockname()[1]
    return _socket(host, port, reuse_port=True)


def listen_shared(host: str, port: int) -> socket.socket:
    """This process's listening socket on a port `reserve` holds; uvicorn calls listen()."""
    return _socket(host, port, reuse_port=True)
