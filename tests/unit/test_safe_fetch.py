"""Image sources by URL (server/media_sources.py, server/safe_fetch.py): the address and host checks as pure
functions, and the fetch itself against a local HTTP server (tests/media_server.py) for every SSRF case.

The loopback allowance (`allow_loopback`, test-only) is on only where a test needs to reach the local server;
each refusal also checks that no connection was opened (the transport was never called, or the local server
never saw the request).
"""

from __future__ import annotations

import asyncio
import base64
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from diffuserve.errors import InvalidRequestError
from diffuserve.server import safe_fetch
from diffuserve.server.media_sources import load_image_source
from diffuserve.server.safe_fetch import FetchPolicy, address_refusal, host_refusal
from tests.media_server import media_server

# -- the pure checks --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("8.8.8.8", None),
        ("2606:4700::1111", None),
        ("127.0.0.1", "loopback"),
        ("127.8.9.10", "loopback"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),  # IPv4-mapped IPv6 is judged by its IPv4 address
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("fc00::1", "private"),
        ("169.254.169.254", "link-local"),  # cloud metadata
        ("::ffff:169.254.169.254", "link-local"),
        ("fe80::1", "link-local"),
        ("fe80::1%eth0", "link-local"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("240.0.0.1", "private"),  # reserved (Python files 240/4 under private too)
        ("100.64.0.1", "shared (carrier-grade NAT)"),
        ("2002:a00:1::", "private"),  # 6to4 of 10.0.0.1
        ("64:ff9b::a9fe:a9fe", "link-local"),  # NAT64 of 169.254.169.254
        ("::ffff:8.8.8.8", None),
    ],
)
def test_address_refusal_names_the_category(address, reason):
    assert address_refusal(address) == reason


def test_the_test_allowance_admits_loopback_only():
    assert address_refusal("127.0.0.1", allow_loopback=True) is None
    assert address_refusal("::ffff:127.0.0.1", allow_loopback=True) is None
    for other in ("10.0.0.1", "169.254.169.254", "0.0.0.0", "fe80::1"):
        assert address_refusal(other, allow_loopback=True) is not None


def test_allowed_media_domains_match_exact_hosts():
    allowed = ("images.example.com", "127.0.0.1")
    assert host_refusal("images.example.com", allowed) is None
    assert host_refusal("IMAGES.example.com.", allowed) is None  # case and a trailing dot do not matter
    assert "not in --allowed-media-domains" in host_refusal("cdn.images.example.com", allowed)
    assert host_refusal("example.com", allowed) is not None
    assert host_refusal("anything.test", ()) is None  # no list: any host (its addresses are still checked)


def test_policy_from_the_limit_flags_and_the_test_only_environment(monkeypatch):
    args = SimpleNamespace(
        allow_remote_urls=True,
        allowed_media_domains=["Img.Example.com."],
        max_upload_bytes=1024,
        media_fetch_timeout_s=2,
    )
    monkeypatch.delenv(safe_fetch.TEST_LOOPBACK_ENV, raising=False)
    policy = FetchPolicy.from_limits(args)
    assert policy == FetchPolicy(True, ("img.example.com",), 1024, 2.0, allow_loopback=False)
    monkeypatch.setenv(safe_fetch.TEST_LOOPBACK_ENV, "1")
    assert FetchPolicy.from_limits(args).allow_loopback


# -- data: URLs and the switch ------------------------------------------------------------------------------------


def _load(value, policy=FetchPolicy(), field="image"):
    return asyncio.run(load_image_source(value, field, policy))


def _refusal(value, policy=FetchPolicy(), field="image") -> str:
    with pytest.raises(InvalidRequestError) as info:
        _load(value, policy, field)
    assert info.value.param == field
    return info.value.message


def test_data_urls_and_image_objects_decode_without_any_flag():
    data = b"\x89PNG fake"
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    assert _load(url) == _load({"image_url": url}) == _load({"image_url": {"url": url}}) == data
    assert "base64" in _refusal("data:image/png,abc")
    assert "not valid base64" in _refusal("data:image/png;base64,@@@@")
    assert "file_id" in _refusal({"file_id": "file_1"}, field="mask")
    assert "not an image" in _refusal("/etc/passwd")
    assert "--allow-remote-urls" in _refusal("http://169.254.169.254/latest/meta-data", field="url")


# -- the fetch, against a local server ----------------------------------------------------------------------------

ALLOWED = FetchPolicy(allow_remote=True, max_bytes=2 * 1024 * 1024, timeout_s=5.0, allow_loopback=True)
STRICT = FetchPolicy(allow_remote=True, max_bytes=2 * 1024 * 1024, timeout_s=5.0)


@pytest.fixture
def sends(monkeypatch) -> list[str]:
    """The URLs the HTTP transport was asked to connect to (wraps httpx's real transport)."""
    calls: list[str] = []
    real = httpx.AsyncHTTPTransport.handle_async_request

    async def recording(self, request):
        calls.append(str(request.url))
        return await real(self, request)

    monkeypatch.setattr(httpx.AsyncHTTPTransport, "handle_async_request", recording)
    return calls


def test_an_allowed_url_is_fetched(sends):
    with media_server() as media:
        assert _load(media.url("/cat.png"), ALLOWED, "url") == media.image
        assert media.requests == [("/cat.png", f"127.0.0.1:{media.port}")]


def test_the_connection_goes_to_the_checked_address_with_the_name_as_host(monkeypatch, sends):
    # `images.test` resolves nowhere but in this test: the fetch can only succeed by connecting to the address the
    # one lookup gave (no second lookup by the HTTP client), while the server still sees the name.
    lookups: list[str] = []

    async def fake_resolve(host: str, port: int) -> list[str]:
        lookups.append(host)
        return ["127.0.0.1"]

    monkeypatch.setattr(safe_fetch, "resolve_host", fake_resolve)
    with media_server() as media:
        assert _load(media.url("/cat.png", host="images.test"), ALLOWED) == media.image
        assert media.requests == [("/cat.png", f"images.test:{media.port}")]
    assert lookups == ["images.test"] and sends == [f"http://127.0.0.1:{media.port}/cat.png"]


def test_https_names_the_host_in_sni_while_connecting_to_the_checked_address(monkeypatch):
    # A bare TCP listener on 127.0.0.1 reads the TLS ClientHello (sent in the clear) and hangs up: the handshake
    # fails (a 400), but the hello shows the server name went out as SNI, which is also the name the certificate
    # would be verified against, while the connection went to the address the one lookup gave.
    async def fake_resolve(host: str, port: int) -> list[str]:
        return ["127.0.0.1"]

    monkeypatch.setattr(safe_fetch, "resolve_host", fake_resolve)
    hello = bytearray()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]

        def accept() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(5)
                hello.extend(conn.recv(4096))

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        assert "fetch failed" in _refusal(f"https://images.test:{port}/cat.png", ALLOWED)
        thread.join(5)
    assert hello[:1] == b"\x16" and b"images.test" in hello  # a TLS handshake record carrying the name


@pytest.mark.parametrize("url", ["http://169.254.169.254/latest/meta-data/", "http://10.0.0.1/cat.png"])
def test_private_addresses_are_refused_before_connecting(url, sends):
    message = _refusal(url, ALLOWED)
    assert "link-local" in message or "private" in message
    assert sends == []


def test_names_are_judged_by_what_they_resolve_to(monkeypatch, sends):
    answers = {"internal.test": ["10.9.8.7"], "mixed.test": ["8.8.8.8", "127.0.0.1"]}

    async def fake_resolve(host: str, port: int) -> list[str]:
        return answers[host]

    monkeypatch.setattr(safe_fetch, "resolve_host", fake_resolve)
    assert "internal.test resolves to 10.9.8.7, which is a private address" in _refusal(
        "http://internal.test/x", STRICT
    )
    assert "loopback" in _refusal("http://mixed.test/x", STRICT)  # one bad address refuses the name
    assert sends == []


@pytest.mark.parametrize("url", ["http://2130706433/", "http://0x7f.1/", "http://[::ffff:127.0.0.1]/", "http://0/"])
def test_other_spellings_of_loopback_are_judged_by_the_address(url, sends):
    # Decimal, hex and short IPv4 forms and IPv4-mapped IPv6 resolve to 127.0.0.1 / 0.0.0.0: the resolved address
    # is what is checked, whatever the spelling.
    message = _refusal(url, STRICT)
    assert "loopback" in message or "unspecified" in message
    assert sends == []


def test_localhost_is_refused_without_the_test_allowance(sends):
    with media_server() as media:
        message = _refusal(media.url("/cat.png", host="localhost"), STRICT)
        assert "localhost resolves to" in message and "loopback" in message
        assert "is a loopback address" in _refusal(media.url("/cat.png"), STRICT)
        assert media.requests == [] and sends == []


def test_every_redirect_hop_is_checked(sends):
    with media_server() as media:
        hop = media.url("/redirect?to=http://169.254.169.254/latest/meta-data/")
        assert "link-local" in _refusal(hop, ALLOWED)
        assert [path for path, _ in media.requests] == ["/redirect?to=http://169.254.169.254/latest/meta-data/"]
        assert len(sends) == 1  # the first hop only: the metadata address was never connected to
        only_ip = FetchPolicy(**{**ALLOWED.__dict__, "allowed_domains": ("127.0.0.1",)})
        to_name = media.url(f"/redirect?to=http://localhost:{media.port}/cat.png")
        assert "localhost is not in --allowed-media-domains" in _refusal(to_name, only_ip)
        assert "only http and https" in _refusal(media.url("/redirect?to=file:///etc/passwd"), ALLOWED)
        assert "more than 5 redirects" in _refusal(media.url("/loop"), ALLOWED)
        # A redirect to an allowed place is followed.
        assert _load(media.url(f"/redirect?to=http://127.0.0.1:{media.port}/cat.png"), ALLOWED) == media.image


def test_hosts_outside_the_allowed_domains_are_refused(sends):
    with media_server() as media:
        policy = FetchPolicy(**{**ALLOWED.__dict__, "allowed_domains": ("images.example.com",)})
        assert "not in --allowed-media-domains" in _refusal(media.url("/cat.png"), policy)
        assert media.requests == [] and sends == []


def test_a_slow_answer_hits_the_total_deadline():
    with media_server() as media:
        policy = FetchPolicy(**{**ALLOWED.__dict__, "timeout_s": 0.5})
        started = time.monotonic()
        assert "--media-fetch-timeout-s" in _refusal(media.url("/slow"), policy)
        # A byte every 0.1 s never trips a read timeout; the total deadline stops it (with slack for a loaded box).
        assert time.monotonic() - started < 3.0


@pytest.mark.parametrize("path", ["/big", "/big-chunked"])
def test_a_too_large_answer_is_cut_at_the_cap(path):
    with media_server() as media:
        assert "--max-upload-bytes" in _refusal(media.url(path), ALLOWED)


def test_encoded_and_failed_answers_are_refused():
    with media_server() as media:
        assert "gzip-encoded" in _refusal(media.url("/gzip"), ALLOWED)
        assert "HTTP 404" in _refusal(media.url("/missing"), ALLOWED)


# -- the flags ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        ({"allowed_media_domains": ["img.example.com"]}, "has no effect without --allow-remote-urls"),
        ({"allow_remote_urls": True, "allowed_media_domains": ["https://img.example.com"]}, "not a host name"),
        ({"allow_remote_urls": True, "allowed_media_domains": ["*.example.com"]}, "not a host name"),
        ({"allow_remote_urls": True, "media_fetch_timeout_s": 0}, "must be > 0"),
    ],
)
def test_bad_fetch_flags_fail_at_start_up_naming_the_flag(flags, needle):
    from diffuserve.config.limits import LimitsArgs
    from diffuserve.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        LimitsArgs(**flags).validate()
    assert needle in str(info.value) and str(info.value).startswith("--")
    LimitsArgs(allow_remote_urls=True, allowed_media_domains=["img.example.com", "10.0.0.1", "::1"]).validate()


def test_control_image_goes_through_the_one_loader(sends):
    from diffuserve.server.control_fields import load_control_image

    def control(value, policy):
        return asyncio.run(load_control_image(SimpleNamespace(control_image=value), policy))

    data = b"\x89PNG control"
    encoded = base64.b64encode(data).decode()
    assert control(None, STRICT) is None
    assert control(encoded, FetchPolicy()) == control("data:image/png;base64," + encoded, FetchPolicy()) == data
    with pytest.raises(InvalidRequestError) as info:
        control("http://169.254.169.254/latest/meta-data", FetchPolicy())
    assert info.value.param == "control_image" and "--allow-remote-urls" in info.value.message
    with pytest.raises(InvalidRequestError) as info:
        control("http://169.254.169.254/latest/meta-data", STRICT)
    assert info.value.param == "control_image" and not sends  # refused before any connection
    with media_server() as media:
        assert control(media.url("/cat.png"), ALLOWED) == media.image
