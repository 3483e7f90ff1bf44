"""GET /docs works offline: Swagger UI's files come from this server (issue 22 item 6). In headless Chromium with
every request to another origin refused, the page renders the API's operations with no console or CSP error."""

from __future__ import annotations

import httpx

from tests.browser.test_playground import chromium_path  # noqa: F401 - the fixture
from tests.conftest import STREAMING_API_KEY

AUTH = {"Authorization": f"Bearer {STREAMING_API_KEY}"}


def test_docs_files_are_ours_under_the_playground_policy(streaming_server):
    base = streaming_server.base_url
    page = httpx.get(f"{base}/docs", headers=AUTH, timeout=30)
    assert page.status_code == 200
    assert "http://" not in page.text and "https://" not in page.text and "<script>" not in page.text
    for path in ("/docs", "/docs/swagger-ui-bundle.js", "/docs/swagger-ui.css", "/docs/swagger-init.js"):
        response = httpx.get(f"{base}{path}", headers=AUTH, timeout=30)
        assert response.status_code == 200, path
        csp = response.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "connect-src 'self'" in csp and "unsafe-inline" not in csp, path
        assert httpx.get(f"{base}{path}", timeout=30).status_code == 401, "behind the key, like the API"
    for path in ("/docs/redoc.standalone.js", "/docs/..%2fapp.py", "/docs/core.py", "/redoc"):
        assert httpx.get(f"{base}{path}", headers=AUTH, timeout=30).status_code == 404, path


def test_docs_render_offline_in_headless_chromium(streaming_server, chromium_path):  # noqa: F811
    from playwright.sync_api import sync_playwright

    base = streaming_server.base_url
    errors: list[str] = []
    elsewhere: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium_path,
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
        )
        try:
            context = browser.new_context(extra_http_headers=AUTH)

            def only_ours(route) -> None:
                if route.request.url.startswith(base):
                    route.continue_()
                else:  # offline: nothing but this server answers
                    elsewhere.append(route.request.url)
                    route.abort()

            context.route("**/*", only_ours)
            page = context.new_page()
            page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{base}/docs")
            page.wait_for_selector(".opblock", timeout=60_000)
            paths = page.eval_on_selector_all(".opblock-summary-path", "nodes => nodes.map(n => n.textContent)")
            title = page.text_content(".info .title")
        finally:
            browser.close()
    assert any("/v1/images/generations" in p for p in paths), paths
    assert title is not None and "diffuserve" in title
    assert elsewhere == [], elsewhere
    assert errors == [], errors
