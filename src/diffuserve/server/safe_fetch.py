"""Fetching an image that a request names by http(s) URL, without letting the request aim the server at itself.

Only with `--allow-remote-urls`. A URL is a request to make the server open a connection somewhere, so every hop
(the URL, then each redirect, followed here by hand up to `MAX_REDIRECTS`) is checked before anything connects:

- the scheme is http or https, and with `--allowed-media-domains` the host is one of those names (exact match);
- the name is resolved once, here, and every address it resolves to must be public: loopback, private, link-local,
  multicast, reserved, unspecified and shared (CGNAT) addresses are refused, for IPv4 and IPv6, including IPv4
  carried inside IPv6 (IPv4-mapped, 6to4, NAT64);
- the connection goes to that checked address, not to the name, so no second DNS lookup (which a rebinding name
  could answer differently) happens between the check and the connect. httpx is given a URL whose host is the
  address; the `Host` header and, for https, the TLS SNI name (httpcore's `sni_hostname` request extension, which
  is also the name the certificate is verified against) carry the original name. `trust_env=False`: a proxy from
  the environment would resolve the name itself.

The answer is read as a stream under the byte cap (`--max-upload-bytes`; refused as soon as it is passed, or at
once when Content-Length says so), uncompressed (`Accept-Encoding: identity`; an encoded answer is refused, so a
small compressed body cannot expand past the cap), and the whole fetch, lookups and redirects included, runs under
one deadline (`--media-fetch-timeout-s`), so an answer that drips a byte at a time is cut off too. Every refusal
is an `InvalidRequestError` (400) naming the request field.

`DIFFUSERVE_TEST_MEDIA_LOOPBACK=1` in the server's environment lets loopback addresses (only those) through: it
exists for the test suite, which serves images from 127.0.0.1; no flag or config key turns it on.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from diffuserve.errors import InvalidRequestError

if TYPE_CHECKING:
    from diffuserve.config.limits import LimitsArgs

MAX_REDIRECTS = 5
"""Redirects followed per URL; one more is refused."""
CONNECT_TIMEOUT_S = 5.0
"""Per-connection connect timeout (the fetch's total deadline still applies)."""
TEST_LOOPBACK_ENV = "DIFFUSERVE_TEST_MEDIA_LOOPBACK"
"""Test-only: `1` lets fetches reach loopback addresses (the tests' local image server). Never for deployments."""
_SHARED_V4 = ipaddress.IPv4Network("100.64.0.0/10")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_NOT_PUBLIC = "the server never fetches from loopback, private, link-local, multicast or reserved addresses"


@dataclass(frozen=True)
class FetchPolicy:
    """What a request may make the server fetch: built from the flags by `FetchPolicy.from_limits`."""

    allow_remote: bool = False
    """--allow-remote-urls: http(s) URLs are fetched at all."""
    allowed_domains: tuple[str, ...] = ()
    """--allowed-media-domains, normalized (lower case, no trailing dot); empty: any host with public addresses."""
    max_bytes: int = 16 * 1024 * 1024
    """--max-upload-bytes: the largest image body read."""
    timeout_s: float = 10.0
    """--media-fetch-timeout-s: the whole fetch (lookups, connects, redirects, body)."""
    allow_loopback: bool = False
    """Test-only (DIFFUSERVE_TEST_MEDIA_LOOPBACK=1): loopback addresses pass the address check."""

    @classmethod
    def from_limits(cls, limits: LimitsArgs) -> FetchPolicy:
        """The policy of a server's flags (`ServerArgs.limits`)."""
        return cls(
            allow_remote=bool(limits.allow_remote_urls),
            allowed_domains=tuple(normal_host(h) for h in limits.allowed_media_domains or ()),
            max_bytes=int(limits.max_upload_bytes),
            timeout_s=float(limits.media_fetch_timeout_s),
            allow_loopback=os.environ.get(TEST_LOOPBACK_ENV) == "1",
        )


def normal_host(host: str) -> str:
    """A host as compared with --allowed-media-domains: lower case, no IPv6 brackets, no trailing dot."""
    return host.strip().strip("[]").rstrip(".").lower()


def _embedded_v4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries to (IPv4-mapped, 6to4, NAT64), if any."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def address_refusal(
    address: str | ipaddress.IPv4Address | ipaddress.IPv6Address, *, allow_loopback: bool = False
) -> str | None:
    """Why the server must not connect to `address` (e.g. "link-local"), or None when it is a public address.

    Pure: no lookup, no connection. IPv6 forms that carry an IPv4 address are judged by that address too, so
    `::ffff:169.254.169.254` is link-local. `allow_loopback` (test-only) admits loopback addresses and nothing else.
    """
    ip = ipaddress.ip_address(address) if isinstance(address, str) else address
    if isinstance(ip, ipaddress.IPv6Address):
        ip = ipaddress.IPv6Address(ip.packed)  # drop a %zone: it does not change the category
        inner = _embedded_v4(ip)
        if inner is not None:
            return address_refusal(inner, allow_loopback=allow_loopback)
    checks = (
        ("unspecified", ip.is_unspecified),
        ("loopback", ip.is_loopback),
        ("link-local", ip.is_link_local),
        ("multicast", ip.is_multicast),
        ("private", ip.is_private),
        ("reserved", ip.is_reserved),
        ("shared (carrier-grade NAT)", isinstance(ip, ipaddress.IPv4Address) and ip in _SHARED_V4),
        ("non-global", not ip.is_global),
    )
    reason = next((name for name, hit in checks if hit), None)
    if reason == "loopback" and allow_loopback:
        return None
    return reason


def host_refusal(host: str, allowed_domains: tuple[str, ...]) -> str | None:
    """Why `host` may not be fetched under --allowed-media-domains (exact host match), or None."""
    if not allowed_domains or normal_host(host) in allowed_domains:
        return None
    return f"{host} is not in --allowed-media-domains ({', '.join(allowed_domains)})"


async def resolve_host(host: str, port: int) -> list[str]:
    """The addresses of `host` (one lookup; an IP literal is returned as it is). Tests replace it to play DNS."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _refuse(field: str, url: Any, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"{field}: refused to fetch {url}: {why}.", param=field)


async def checked_address(url: httpx.URL, policy: FetchPolicy, field: str) -> str:
    """The address to connect to for `url`, after the scheme, host list and address checks of one hop."""
    if url.scheme not in ("http", "https"):
        raise _refuse(field, url, f"only http and https URLs are fetched, not {url.scheme or 'a relative'} URLs")
    if not url.host:
        raise _refuse(field, url, "the URL has no host")
    why = host_refusal(url.host, policy.allowed_domains)
    if why is not None:
        raise _refuse(field, url, why)
    try:
        addresses = await resolve_host(url.host, url.port or (443 if url.scheme == "https" else 80))
    except (OSError, UnicodeError) as exc:
        raise _refuse(field, url, f"the name {url.host} does not resolve ({exc})") from None
    if not addresses:
        raise _refuse(field, url, f"the name {url.host} does not resolve")
    for address in addresses:  # every address, not only the one used: a mixed answer is refused whole
        reason = address_refusal(address, allow_loopback=policy.allow_loopback)
        if reason is not None:
            where = address if address == normal_host(url.host) else f"{url.host} resolves to {address}, which"
            raise _refuse(field, url, f"{where} is a {reason} address ({_NOT_PUBLIC})")
    return addresses[0]


def _pinned_request(client: httpx.AsyncClient, url: httpx.URL, address: str) -> httpx.Request:
    """A GET of `url` sent to `address`: the URL's host becomes the checked address, while the Host header and the
    TLS server name (SNI and certificate check) stay the URL's name."""
    extensions = {"sni_hostname": url.host} if url.scheme == "https" else {}
    host = url.netloc.decode("ascii")  # the name with its port when not the default, as a client sends Host
    headers = {"Host": host, "Accept": "image/*", "Accept-Encoding": "identity"}
    return client.build_request("GET", url.copy_with(host=address), headers=headers, extensions=extensions)


async def fetch_url(url: str, field: str, policy: FetchPolicy) -> bytes:
    """GET an image the request named by URL, under `policy` (see the module docstring); refusals are 400s."""
    try:
        target = httpx.URL(url)
    except (httpx.InvalidURL, ValueError) as exc:
        raise _refuse(field, url, f"not a valid URL ({exc})") from None
    try:
        async with asyncio.timeout(policy.timeout_s):
            return await _follow(target, field, policy)
    except TimeoutError:
        raise _refuse(
            field, url, f"no complete answer within {policy.timeout_s:g} s (--media-fetch-timeout-s)"
        ) from None
    except httpx.TimeoutException:
        raise _refuse(field, url, "the host did not answer in time (connect or read timeout)") from None
    except httpx.HTTPError as exc:
        raise _refuse(field, url, f"the fetch failed ({type(exc).__name__}: {exc})") from None


async def _follow(url: httpx.URL, field: str, policy: FetchPolicy) -> bytes:
    timeout = httpx.Timeout(policy.timeout_s, connect=min(CONNECT_TIMEOUT_S, policy.timeout_s))
    for _ in range(MAX_REDIRECTS + 1):
        address = await checked_address(url, policy, field)
        # A client per hop: its pool is keyed by the address, so a kept-alive TLS connection made (and verified) for
        # one name must never carry the next hop's request for another name on the same address.
        async with httpx.AsyncClient(trust_env=False, follow_redirects=False, timeout=timeout) as client:
            reply = await client.send(_pinned_request(client, url, address), stream=True)
            try:
                if reply.is_redirect:
                    url = url.join(reply.headers["location"])  # checked like the first URL on the next turn
                    continue
                if reply.status_code != 200:
                    raise _refuse(field, url, f"the host answered HTTP {reply.status_code}")
                return await _read_capped(reply, url, field, policy.max_bytes)
            finally:
                await reply.aclose()
    raise _refuse(field, url, f"more than {MAX_REDIRECTS} redirects")


async def _read_capped(reply: httpx.Response, url: httpx.URL, field: str, max_bytes: int) -> bytes:
    too_large = f"the image is larger than {max_bytes} bytes (--max-upload-bytes)"
    encoding = reply.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise _refuse(field, url, f"the answer is {encoding}-encoded; an image is fetched uncompressed")
    declared = reply.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _refuse(field, url, too_large)
    data = bytearray()
    async for chunk in reply.aiter_raw():
        data += chunk
        if len(data) > max_bytes:
            raise _refuse(field, url, too_large)
    return bytes(data)
