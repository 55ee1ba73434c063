"""URLs of the cluster planes, which may carry credentials (`nats://user:secret@host:4222`,
`http://user:secret@etcd:2379`): what may be printed of them."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def redacted(url: str) -> str:
    """`url` with any password or token replaced by `***`, for logs and banners."""
    parts = urlsplit(url if "://" in url else f"//{url}")
    if "@" not in parts.netloc:
        return url
    userinfo, host = parts.netloc.rsplit("@", 1)
    user = userinfo.split(":", 1)[0] if ":" in userinfo else ""
    hidden = f"{user}:***" if user else "***"
    shown = urlunsplit(parts._replace(netloc=f"{hidden}@{host}"))
    return shown if "://" in url else shown.removeprefix("//")
