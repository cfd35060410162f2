"""``GET /``: the job dashboard, a static page and one ES module that talk to the API from the same origin.

Every asset ships in the package (``service/dashboard/``) and is read once at import: nothing is
fetched from elsewhere at run time. The page renders all data as text (never as markup), and the
Content-Security-Policy allows scripts, styles and requests only from this origin, with no inline
script, so a hostile label or error message cannot run code in it.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, Response

from ckptconv.core.errors import NotFound

router = APIRouter(include_in_schema=False)

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css"}


def _load() -> dict[str, tuple[bytes, str]]:
    folder = resources.files("service").joinpath("dashboard")
    assets = {}
    for item in folder.iterdir():
        suffix = "." + item.name.rpartition(".")[2]
        if suffix in MEDIA_TYPES:
            assets[item.name] = (item.read_bytes(), MEDIA_TYPES[suffix])
    return assets


ASSETS = _load()


@router.get("/")
async def dashboard() -> Response:
    body, media_type = ASSETS["index.html"]
    return Response(body, media_type=media_type, headers=HEADERS)


@router.get("/dashboard/{name}")
async def dashboard_asset(name: str) -> Response:
    if name == "index.html" or name not in ASSETS:
        raise NotFound(f"no such resource: GET /dashboard/{name}")
    body, media_type = ASSETS[name]
    return Response(body, media_type=media_type, headers=HEADERS)
