"""API keys, principals and URI scopes.

- A key is ``ckc_`` + 43 URL-safe characters (256 random bits), shown once when created. Only its
  SHA-256 is stored: in Redis (``ckptconv keys create``: hash ``{p}apikey:<sha256>``) or in a keys
  file given to ``ckptconv serve --api-keys-file`` (YAML or JSON: ``keys: [{name, sha256, prefixes}]``).
- Each key has a name and the URI prefixes it may touch (:mod:`ckptconv.core.scopes`: prefixes end
  with ``/`` and match whole segments). Every URI of a request (source, target, URIs inside options)
  must lie under one of them (403 otherwise), and the worker checks every URI a job touches again at
  its storage layer. Jobs belong to the key that
  created them; other keys get 404 for them.
- Lookups are cached in the process for ``auth_cache_seconds`` (also misses, for a shorter time),
  so a request pays no Redis round trip for its key; revoking a key takes effect within that time.
- Development mode (``auth_disabled``, refused outside ``environment=development``) lets every
  request in as the principal ``dev`` with access to every URI.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptconv.core.errors import CkptconvError, Unauthorized
from ckptconv.core.jobstore import RedisKeys
from ckptconv.core.scopes import UNRESTRICTED, Scopes, canonical_prefix, canonical_uri

log = logging.getLogger("ckptconv.auth")

KEY_PREFIX = "ckc_"
NEGATIVE_CACHE_SECONDS = 2.0
CACHE_MAX_ENTRIES = 10_000


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def principal_id(key_hash: str) -> str:
    return "key_" + key_hash[:16]


@dataclass(frozen=True)
class Principal:
    """Who is calling: owns jobs under ``id`` and may touch URIs under ``prefixes``."""

    id: str
    name: str

    scopes: Scopes

    @property
    def prefixes(self) -> tuple[str, ...]:
        return self.scopes.prefixes or ()

    def check_uri(self, uri: str) -> str:
        """The canonical form of ``uri``; Forbidden unless it lies under one of this principal's prefixes."""
        return self.scopes.check_canonical(canonical_uri(uri))


DEV_PRINCIPAL = Principal("dev", "development", UNRESTRICTED)


def principal_from_record(key_hash: str, rec: dict[str, Any]) -> Principal:
    prefixes = rec.get("prefixes", [])
    if isinstance(prefixes, str):
        prefixes = json.loads(prefixes)
    return Principal(principal_id(key_hash), str(rec.get("name") or principal_id(key_hash)), _scopes(prefixes))


def _scopes(prefixes: list[str]) -> Scopes:
    """A stored key's scopes; a prefix that no longer passes the rules grants nothing (and is logged)."""
    kept = []
    for prefix in prefixes:
        try:
            kept.append(canonical_prefix(prefix))
        except CkptconvError as e:
            log.warning("API key prefix %r ignored: %s", prefix, e)
    return Scopes(tuple(kept))


def load_keys_file(path: Path) -> dict[str, Principal]:
    """sha256 -> Principal from a YAML or JSON keys file."""
    import yaml

    doc = yaml.safe_load(Path(path).read_text()) or {}
    out: dict[str, Principal] = {}
    for entry in doc.get("keys", []):
        digest = str(entry["sha256"]).lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(f"{path}: key {entry.get('name')!r} has no valid sha256")
        # An unusable prefix in the file is an operator's mistake: refuse to start rather than drop it.
        prefixes = [canonical_prefix(p) for p in entry["prefixes"]]
        out[digest] = principal_from_record(digest, {**entry, "prefixes": prefixes})
    return out


class KeyRegistry:
    """Resolves bearer tokens to principals, with an in-process cache."""

    def __init__(
        self, redis: Any, keys: RedisKeys, *, file_keys: dict[str, Principal] | None = None, cache_seconds: float
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.file_keys = file_keys or {}
        self.cache_seconds = cache_seconds
        self._cache: dict[str, tuple[float, Principal | None]] = {}

    async def authenticate(self, token: str | None) -> Principal:
        if not token:
            raise Unauthorized("missing API key")
        digest = hash_key(token)
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is not None and hit[0] > now:
            principal = hit[1]
        else:
            principal = self.file_keys.get(digest)
            if principal is None:
                rec = await self.redis.hgetall(self.keys.api_key(digest))
                principal = principal_from_record(digest, rec) if rec and not rec.get("revoked") else None
            if len(self._cache) >= CACHE_MAX_ENTRIES:
                self._cache.clear()
            ttl = self.cache_seconds if principal is not None else min(self.cache_seconds, NEGATIVE_CACHE_SECONDS)
            self._cache[digest] = (now + ttl, principal)
        if principal is None:
            raise Unauthorized("unknown or revoked API key")
        return principal


# --- key management (CLI) ----------------------------------------------------------------------


def create_key(redis: Any, keys: RedisKeys, name: str, prefixes: list[str]) -> tuple[str, dict[str, Any]]:
    """Store a new key's hash in Redis; returns (the key, its record). The key is not stored."""
    key = generate_key()
    digest = hash_key(key)
    rec = {
        "name": name,
        "id": principal_id(digest),
        "prefixes": json.dumps([canonical_prefix(p) for p in prefixes]),
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    pipe = redis.pipeline()
    pipe.hset(keys.api_key(digest), mapping=rec)
    pipe.sadd(keys.api_keys, digest)
    pipe.execute()
    return key, {**rec, "sha256": digest, "prefixes": json.loads(rec["prefixes"])}


def list_keys(redis: Any, keys: RedisKeys) -> list[dict[str, Any]]:
    out = []
    for digest in sorted(redis.smembers(keys.api_keys)):
        digest = digest.decode() if isinstance(digest, bytes) else digest
        rec = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in redis.hgetall(keys.api_key(digest)).items()
        }
        if rec:
            rec["prefixes"] = json.loads(rec.get("prefixes") or "[]")
            out.append({"sha256": digest, **rec})
    return out


def revoke_key(redis: Any, keys: RedisKeys, ident: str) -> bool:
    """Revoke by key id (``key_…``) or sha256; returns whether a key was found."""
    for rec in list_keys(redis, keys):
        if ident in (rec["sha256"], rec.get("id")):
            pipe = redis.pipeline()
            pipe.delete(keys.api_key(rec["sha256"]))
            pipe.srem(keys.api_keys, rec["sha256"])
            pipe.execute()
            return True
    return False
