"""Which URIs a job or plan request names, checked against the caller's prefixes before it is accepted.

The worker checks every URI a job touches again, at its storage layer (files can name URIs too;
see :mod:`ckptconv.storage.confined`); this early check answers a request that names a forbidden
location with 403 at once. Both use the rules of :mod:`ckptconv.core.scopes`.
"""

from __future__ import annotations

from typing import Any

from ckptconv.core.auth import Principal
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
