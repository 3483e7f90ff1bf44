"""GET /docs: Swagger UI over /openapi.json, every file served by us (it works offline and behind a firewall).

FastAPI's own /docs page loads Swagger UI from a CDN, so on a host without internet it stays blank. Here the
Swagger UI files (5.x, which reads OpenAPI 3.1) come from the `fastapi-offline` package (a dependency; only its
static files are used) and our page and start-up script from `api_docs_static/`; only the files named in
`OWN_ASSETS` and `BUNDLE_ASSETS` are served. The answers carry the playground's strict
Content-Security-Policy (scripts and styles from this origin only, no inline script, requests only to this origin),
with `style-src` unchanged: Swagger UI sets styles through the DOM, which the policy allows. ReDoc (`/redoc`) is
off: it injects `<style>` elements, which the policy forbids. Like the API, /docs needs the key when the server has one.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

from diffuserve.errors import NotFoundError
from diffuserve.server.playground import SECURITY_HEADERS

router = APIRouter()

OWN_ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "swagger-init.js": "text/javascript; charset=utf-8",
}
"""Our page and the script that starts Swagger UI (no inline script: the CSP forbids it)."""

BUNDLE_ASSETS = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "favicon.png": "image/png",
}
"""The files of `fastapi-offline`'s static folder that the page loads."""


def _bundle_folder() -> Path:
    try:
        import fastapi_offline
    except ImportError as exc:  # a dependency; only a broken install lacks it
        raise NotFoundError(
            "Swagger UI is not installed here: `pip install fastapi-offline` (a dependency of "
            "diffuserve); the schema itself is at /openapi.json.",
            param="path",
        ) from exc
    return Path(fastapi_offline.__file__).parent / "static"


def _asset(name: str) -> Response:
    if name in OWN_ASSETS:
        data = resources.files(__package__).joinpath("api_docs_static", name).read_bytes()
        return Response(content=data, media_type=OWN_ASSETS[name], headers=SECURITY_HEADERS)
    if name in BUNDLE_ASSETS:
        data = (_bundle_folder() / name).read_bytes()
        return Response(content=data, media_type=BUNDLE_ASSETS[name], headers=SECURITY_HEADERS)
    raise NotFoundError(f"No /docs file {name!r}.", param="path")


@router.get("/docs", include_in_schema=False)
async def docs_page() -> Response:
    return _asset("index.html")


@router.get("/docs/{name}", include_in_schema=False)
async def docs_asset(name: str) -> Response:
    return _asset(name)
