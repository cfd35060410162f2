"""Which URIs a job or plan request names, checked against the caller's prefixes before it is accepted.

The worker checks every URI a job touches again, at its storage layer (files can name URIs too;
see :mod:`ckptconv.storage.confined`); this early check answers a request that names a forbidden
location with 403 at once. Both use the rules of :mod:`ckptconv.core.scopes`.
"""

from __future__ import annotations

from typing import Any

from ckptconv.core.auth import Principal
from ckptconv.core.errors import Forbidden
from ckptconv.engine.staging import staging_root
from ckptconv.jobs.kinds import option_uris


def scoped_refs(caller: Principal, body: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Canonical source and target of a job or plan request, after checking every URI it names
    (source, target, URIs inside the options) against the caller's prefixes."""
    source = {"uri": caller.check_uri(body.source.uri), "format": body.source.format}
    target = getattr(body, "target", None)
    target_doc = {"uri": caller.check_uri(target.uri), "format": target.format} if target is not None else None
    for uri in option_uris(body.options):
        caller.check_uri(uri)
    return source, target_doc


def check_staging(caller: Principal, target: str) -> None:
    """A job stages and writes its manifest beside its ``target`` (canonical, checked already):
    :func:`staging_root`. For a target at a prefix's root that is outside the prefix: refused here,
    not by the worker after the job was accepted. A prefix match of the name is enough here (the
    target's checked parent is the staging area's): the worker's storage layer checks the staging
    area itself, links included, whatever this early answer says."""
    prefixes = caller.scopes.prefixes
    staging = staging_root(target)
    if prefixes is not None and not staging.startswith(prefixes):
        raise Forbidden(
            f"a job writes its staging area beside its target, in {staging}, which this API key may not access",
            hint="name a target inside one of the key's prefixes (a file or directory below it), not the prefix itself",
            uri=target,
        )
