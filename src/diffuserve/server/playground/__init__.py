"""GET /playground: a small page to try the server from a browser, served entirely by us.

Only the files named in `ASSETS` are served, from this package's `static/` folder: no other path
under /playground reaches the file system. Every answer carries a strict Content-Security-Policy
(scripts and styles from this origin only, no inline script, no framing, requests only to this
origin) and `X-Content-Type-Options: nosniff`. The page and its assets hold no data, so they are
served without the API key (a browser cannot attach one to a navigation); the page asks for the key
when `config.json` says the server needs one and sends it on every API call.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from diffuserve.errors import NotFoundError
from diffuserve.server.common import server_context

router = APIRouter()

ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "playground.js": "text/javascript; charset=utf-8",
    "playground.css": "text/css; charset=utf-8",
}
"""The playground's own files (name -> media type); nothing else is served from its folder."""

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "media-src 'self' blob:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)

SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

PUBLIC_PATHS = frozenset(
    {"/playground", "/playground/", "/playground/config.json", *(f"/playground/{name}" for name in ASSETS)}
)
"""Paths served without the API key (the middleware reads this)."""


def _asset(name: str) -> Response:
    if name not in ASSETS:
        raise NotFoundError(f"No playground file {name!r}.", param="path")
    data = resources.files(__package__).joinpath("static", name).read_bytes()
    return Response(content=data, media_type=ASSETS[name], headers=SECURITY_HEADERS)


@router.get("/playground", include_in_schema=False)
@router.get("/playground/", include_in_schema=False)
async def playground_page() -> Response:
    return _asset("index.html")


@router.get("/playground/config.json", include_in_schema=False)
async def playground_config(request: Request) -> JSONResponse:
    """What the page needs before it has a key: whether it must ask for one."""
    ctx = server_context(request)
    return JSONResponse({"auth_required": ctx.args.resolved_api_key() is not None}, headers=SECURITY_HEADERS)


@router.get("/playground/{name}", include_in_schema=False)
async def playground_asset(name: str) -> Response:
    return _asset(name)
