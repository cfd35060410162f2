"""Standard Webhooks signatures (https://www.standardwebhooks.com/): sign and verify.

A delivery carries three headers: ``webhook-id`` (stable across retries of one event, so a
receiver can drop duplicates), ``webhook-timestamp`` (Unix seconds of this attempt) and
``webhook-signature``: ``v1,`` + base64 of HMAC-SHA256 over ``{id}.{timestamp}.{body}``.
Secrets are ``whsec_`` + base64 of the key bytes, as the standard writes them; any other string is
used as UTF-8 bytes.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import socket
import time
from collections.abc import Mapping
from urllib.parse import urlsplit

from ckptconv.core.errors import Unauthorized

SECRET_PREFIX = "whsec_"


def secret_bytes(secret: str) -> bytes:
    if secret.startswith(SECRET_PREFIX):
        try:
            return base64.b64decode(secret[len(SECRET_PREFIX) :], validate=True)
        except ValueError:
            pass
    return secret.encode()


def signature(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    signed = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret_bytes(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def sign(secret: str, msg_id: str, body: bytes, timestamp: int | None = None) -> dict[str, str]:
    """The headers of one delivery of ``body``."""
    ts = int(time.time()) if timestamp is None else timestamp
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(ts),
        "webhook-signature": signature(secret, msg_id, ts, body),
    }


def verify(secret: str, headers: Mapping[str, str], body: bytes, *, tolerance_seconds: int = 300) -> None:
    """Check a delivery's signature and freshness; raises :class:`Unauthorized` when it does not hold."""
    lower = {k.lower(): v for k, v in headers.items()}
    try:
        msg_id = lower["webhook-id"]
        ts = int(lower["webhook-timestamp"])
        sigs = lower["webhook-signature"].split()
    except (KeyError, ValueError):
        raise Unauthorized("webhook delivery without valid webhook-id/timestamp/signature headers") from None
    if abs(time.time() - ts) > tolerance_seconds:
        raise Unauthorized("webhook timestamp outside the tolerance window (replayed or clock skew)")
    expected = signature(secret, msg_id, ts, body)
    if not any(hmac.compare_digest(expected, s) for s in sigs):
        raise Unauthorized("webhook signature does not match")


class WebhookRefused(Exception):
    """The destination may not be called (e.g. a private address): retrying cannot help."""


def check_destination(url: str, allow_private: bool) -> None:
    """Refuse URLs that resolve to loopback, private, link-local or reserved addresses (SSRF).

    The check resolves the name at delivery time; a name that changes its answer between this
    check and the connection (DNS rebinding) is not caught: put an egress proxy in front of
    workers where that matters.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise WebhookRefused(f"not an http(s) URL: {url}")
    if allow_private:
        return
    try:
        infos = socket.getaddrinfo(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
    except OSError as e:
        raise WebhookRefused(f"cannot resolve {parts.hostname}: {e}") from None
    for info in infos:
        ip = ipaddress.ip_address(info[4][0])
        if not ip.is_global:
            raise WebhookRefused(f"{parts.hostname} resolves to a non-public address ({ip})")
