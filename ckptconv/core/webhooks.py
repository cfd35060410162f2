"""Webhook destinations (checked against SSRF) and Standard Webhooks signatures
(https://www.standardwebhooks.com/): sign and verify.

Destinations: unless private networks are allowed, a webhook URL whose host has any loopback,
private, link-local or reserved address is refused, when the job is submitted (the API) and again
at every delivery attempt, where the connection goes to the address just checked (a name that
answers differently the second time, DNS rebinding, cannot redirect the request).

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
import logging
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ckptconv.core.errors import ServiceUnavailable, Unauthorized, WebhookRefused

SECRET_PREFIX = "whsec_"

log = logging.getLogger(__name__)


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


class Unresolvable(Exception):
    """The destination's name did not resolve (DNS down, or a name not known yet): worth retrying."""


@dataclass(frozen=True)
class Destination:
    """Where a webhook goes: the URL as given, and the address the request will connect to."""

    url: str
    scheme: str
    host: str
    port: int
    address: str

    def request_args(self) -> dict[str, Any]:
        """httpx arguments that connect to ``address`` (the one that was checked, never a second
        lookup of the name), while the Host header and TLS (SNI and certificate) use the name."""
        parts = urlsplit(self.url)
        literal = f"[{self.address}]" if ":" in self.address else self.address
        pinned = parts._replace(netloc=f"{literal}:{self.port}").geturl()
        extensions = {"sni_hostname": self.host} if self.scheme == "https" else {}
        return {"url": pinned, "headers": {"host": parts.netloc.rpartition("@")[2]}, "extensions": extensions}


def parse_destination(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of a webhook URL; :class:`WebhookRefused` unless it is http(s) with a host."""
    try:
        parts = urlsplit(url)  # ValueError: an unclosed or invalid [IPv6] host, NFKC tricks in the netloc
    except ValueError:
        raise WebhookRefused(f"not a valid URL: {url}") from None
    try:
        port = parts.port
    except ValueError:
        raise WebhookRefused(f"invalid port in {url}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise WebhookRefused(f"not an http(s) URL: {url}")
    return parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80)


def check_addresses(host: str, addresses: list[str], allow_private: bool) -> None:
    """Refuse a host any of whose addresses is loopback, private, link-local or reserved (SSRF)."""
    if not addresses:
        raise Unresolvable(f"{host} has no address")
    if allow_private:
        return
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        if not ip.is_global or ip.is_multicast:
            # The address stays in the log: inside the service's network, where a name points is
            # not the submitter's to learn.
            log.info("webhook host %s refused: it resolves to %s", host, ip)
            raise WebhookRefused(f"{host} resolves to a non-public address")


def addresses_of(infos: list[Any]) -> list[str]:
    """The addresses in ``getaddrinfo`` results, in order, once each."""
    return list(dict.fromkeys(info[4][0] for info in infos))


def resolve_destination(
    url: str, allow_private: bool, getaddrinfo: Callable[..., list[Any]] = socket.getaddrinfo
) -> Destination:
    """Resolve the webhook's host, check every address, and pin the first one for the connection.

    Called at each delivery attempt (the answer may have changed since the job was submitted: DNS
    rebinding), and the connection goes to the address checked here. Raises
    :class:`WebhookRefused` (final) or :class:`Unresolvable` (retry later).
    """
    scheme, host, port = parse_destination(url)
    try:
        infos = getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise Unresolvable(f"cannot resolve {host}: {e}") from None
    addresses = addresses_of(infos)
    check_addresses(host, addresses, allow_private)
    return Destination(url, scheme, host, port, addresses[0])


def post(
    url: str,
    body: bytes,
    headers: dict[str, str],
    *,
    timeout: float,
    allow_private: bool,
    getaddrinfo: Callable[..., list[Any]] = socket.getaddrinfo,
) -> int:
    """One delivery attempt: resolve and check the destination, POST to the checked address.

    Returns the HTTP status. Raises :class:`WebhookRefused` (final: retrying cannot help), or
    :class:`Unresolvable` / ``httpx.HTTPError`` (transient: DNS, connect errors, timeouts).
    """
    import httpx

    destination = resolve_destination(url, allow_private, getaddrinfo)
    args = destination.request_args()
    with httpx.Client(timeout=timeout, follow_redirects=False) as client:
        response = client.post(
            args["url"], content=body, headers={**headers, **args["headers"]}, extensions=args["extensions"]
        )
    return response.status_code


# Why the last delivery attempt failed, as the job's owner reads it (``webhook.last_error``): one
# of these codes, never exception text, addresses or endpoint details (those go to the worker's log).
DELIVERY_ERRORS = ("http_status", "refused", "unresolvable", "timeout", "connect_error", "transport_error")


def delivery_error(exc: BaseException | None, status: int | None) -> str | None:
    """The code of a failed attempt (``None`` for a 2xx answer): ``http_status`` for any other
    answer (its status is ``last_status``), else the kind of ``exc``."""
    import httpx

    if exc is None:
        return None if status is not None and 200 <= status < 300 else "http_status"
    if isinstance(exc, WebhookRefused):
        return "refused"
    if isinstance(exc, Unresolvable):
        return "unresolvable"
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, httpx.ConnectError):
        return "connect_error"
    return "transport_error"


async def check_at_submit(url: str, allow_private: bool) -> None:
    """The API's check of a new job's webhook: every address of its host must be public.

    Raises :class:`WebhookRefused` (422) for a refused destination or a name that does not exist,
    :class:`ServiceUnavailable` (503, retry) when name resolution failed for now.
    """
    # asyncio is imported here, by the API's event loop that awaits this: the job records import this
    # module for its error names, in processes (a local conversion) that run no event loop.
    import asyncio

    _scheme, host, port = parse_destination(url)
    if allow_private:
        return
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        if e.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            raise WebhookRefused(f"{host} does not resolve", hint="check the webhook URL's host name") from None
        raise ServiceUnavailable(f"could not resolve the webhook's host {host} now") from None
    except (OSError, UnicodeError):
        raise WebhookRefused(f"{host} does not resolve", hint="check the webhook URL's host name") from None
    check_addresses(host, addresses_of(infos), allow_private)
