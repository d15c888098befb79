"""The browser pages: the playground at `/` and the live cache view at `/ui/cache`.

They are static files from `kvserve/server/ui/` (no build step, nothing loaded from another
origin), public as files are: every call they make goes through the API, with the key the page
asks for when the API answers 401. They stay out of the OpenAPI schema (they are not API), and
`--no-ui` leaves them out altogether."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

UI = Path(__file__).with_name("ui")
# Only this origin: scripts, styles and calls; a page that reached for a CDN would break visibly.
_POLICY = "default-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"


def _page(name: str):
    async def page() -> FileResponse:
        return FileResponse(UI / name, headers={"content-security-policy": _POLICY, "cache-control": "no-cache"})
    return page


def install(app: FastAPI) -> None:
    app.add_api_route("/", _page("playground.html"), methods=["GET"], include_in_schema=False)
    app.add_api_route("/ui/cache", _page("cache.html"), methods=["GET"], include_in_schema=False)
    app.mount("/ui/static", StaticFiles(directory=UI), name="ui")
