"""Which node endpoints the gateway may call: public addresses only, checked when a node registers
and again for the address actually connected to (so a name that resolves to a private address, at
registration or later, is refused too).

One reading of a host for the whole platform: IPv4 in every notation libc accepts (`127.1`,
`0x7f000001`, `0177.0.0.1`, `2130706433`), IPv6 (IPv4-mapped and NAT64 read as the IPv4 address they
carry; 6to4 and Teredo refused whole), and `localhost`. SQL refuses the same hosts for owners' writes
to `nodes.endpoint_url` (private.endpoint_is_private), held equal to this module by
tests/db/test_endpoints_sql.py.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import re
import socket
from typing import Any
from urllib.parse import urlsplit

from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

_IPV4_PART = r"(?:0x[0-9a-f]*|[0-9]+)"
_LEGACY_IPV4 = re.compile(rf"{_IPV4_PART}(?:\.{_IPV4_PART}){{0,3}}")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")

# Not public (RFC 6890 and its successors), listed here rather than taken from ipaddress.is_global,
# whose list changes between Python versions, and written identically in SQL.
NON_PUBLIC = tuple(
    ipaddress.ip_network(network)
    for network in (
        # IPv4: this network, private, shared (CGNAT), loopback, link-local, private, IETF protocol
        # assignments, documentation, 6to4 relays, private, benchmarking, documentation (twice),
        # multicast, reserved and broadcast.
        "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
        "192.0.0.0/24", "192.0.2.0/24", "192.88.99.0/24", "192.168.0.0/16", "198.18.0.0/15",
        "198.51.100.0/24", "203.0.113.0/24", "224.0.0.0/4", "240.0.0.0/4",
        # IPv6: unspecified, loopback and IPv4-compatible, discard, IETF (Teredo included),
        # documentation, 6to4, local NAT64, unique local, link-local, site-local, multicast.
        "::/96", "100::/64", "2001::/23", "2001:db8::/32", "2002::/16", "64:ff9b:1::/48", "fc00::/7",
        "fe80::/10", "fec0::/10", "ff00::/8",
    )
)  # fmt: skip


class PrivateEndpoint(ValueError):
    """An endpoint on a loopback, private, link-local or otherwise non-public address."""


def host_of(url: str) -> str:
    """The URL's host as it will be looked up: lowercase, brackets and a trailing dot removed."""
    return (urlsplit(url).hostname or "").rstrip(".")


def parse_ipv4(host: str) -> ipaddress.IPv4Address | None:
    """An IPv4 address in any notation inet_aton(3) reads (1 to 4 parts, each decimal, octal with a
    leading 0, or hex with 0x; the last part fills the remaining bytes), or None for a name."""
    if not _LEGACY_IPV4.fullmatch(host):
        return None
    values: list[int] = []
    for part in host.split("."):
        try:
            if part.startswith("0x"):
                values.append(int(part[2:] or "0", 16))
            elif len(part) > 1 and part.startswith("0"):
                values.append(int(part, 8))
            else:
                values.append(int(part))
        except ValueError:  # 08, 09: not octal, so not an address (libc then tries it as a name)
            return None
    *head, last = values
    if any(value > 255 for value in head) or last >= 256 ** (4 - len(head)):
        return None
    number = last
    for shift, value in enumerate(reversed(head), start=4 - len(head)):
        number |= value << (8 * shift)
    return ipaddress.IPv4Address(number)


def parse_address(host: str) -> Address | None:
    """The host as an address (IPv4 in any notation, or IPv6), or None when it is a name."""
    if ":" in host:
        try:
            return ipaddress.IPv6Address(host.split("%", 1)[0])  # a zone (%eth0) names no address
        except ValueError:
            return None
    return parse_ipv4(host)


def embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries and routes to: IPv4-mapped or NAT64 (6to4 is refused
    whole, as SQL does)."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def is_public(address: Address) -> bool:
    """Globally routable unicast, and for IPv6 that carries an IPv4 address, that address too."""
    if isinstance(address, ipaddress.IPv6Address) and (inner := embedded_ipv4(address)) is not None:
        return is_public(inner)
    return not any(address in network for network in NON_PUBLIC)


def is_local_name(host: str) -> bool:
    return host == "localhost" or host.endswith(".localhost")


@functools.lru_cache(maxsize=4096)
def check_literal(url: str) -> None:
    """Refuse a URL whose host is a non-public address or localhost; names pass (see resolve)."""
    host = host_of(url)
    if is_local_name(host):
        raise PrivateEndpoint(f"{host} is this machine")
    address = parse_address(host)
    if address is not None and not is_public(address):
        raise PrivateEndpoint(f"{host} is the non-public address {address}")


async def check_endpoint(url: str, timeout_s: float = 2.0) -> None:
    """Registration's check: the literal one, then a name's addresses (every one must be public).
    A name that does not resolve in time passes: the connect-time check still guards it."""
    if url.startswith("tunnel:"):
        return
    check_literal(url)
    host = host_of(url)
    if parse_address(host) is not None:
        return
    try:
        infos = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(host, None), timeout_s)
    except (OSError, TimeoutError):
        return
    for *_, sockaddr in infos:
        address = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        if not is_public(address):
            raise PrivateEndpoint(f"{host} resolves to the non-public address {address}")


class PublicResolver(AbstractResolver):
    """aiohttp's resolver, keeping only public addresses: the check at connect time, on the very
    addresses the connection then uses (a name re-pointed at 127.0.0.1 after registration, or a
    notation aiohttp hands to the resolver such as 0x7f000001, finds nothing to connect to)."""

    def __init__(self) -> None:
        self._resolver = ThreadedResolver()

    async def resolve(self, host: str, port: int = 0, family: Any = socket.AF_INET) -> list[ResolveResult]:
        if is_local_name(host.lower().rstrip(".")):
            raise OSError(f"refused to connect to {host}: it is this machine")
        found = await self._resolver.resolve(host, port, family)
        public = [info for info in found if is_public(ipaddress.ip_address(info["host"]))]
        if not public:
            raise OSError(f"refused to connect to {host}: it resolves only to non-public addresses")
        return public

    async def close(self) -> None:
        await self._resolver.close()
