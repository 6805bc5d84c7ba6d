"""Which node endpoints the gateway may call: every notation of a non-public host is refused."""

from __future__ import annotations

import ipaddress
import random
import socket

import pytest

from neuralgrid.gateway.endpoints import PrivateEndpoint, check_literal, is_public, parse_ipv4

# (endpoint URL, refused as non-public). tests/db/test_endpoints_sql.py checks SQL against this table.
ENDPOINTS: list[tuple[str, bool]] = [
    ("http://127.0.0.1:8000", True),
    ("http://0x7f000001:8000", True),  # the bypass the review found
    ("http://0X7F000001:8000", True),
    ("http://127.1/", True),
    ("http://2130706433", True),
    ("http://0177.0.0.1", True),
    ("http://0x7f.0.0.1", True),
    ("http://127.0.0.1.", True),
    ("http://0", True),
    ("http://10.0.0.5/admin", True),
    ("http://169.254.169.254/latest/meta-data", True),  # cloud metadata
    ("http://100.64.1.1", True),  # shared address space (CGNAT)
    ("http://192.168.1.1:8080", True),
    ("http://224.0.0.1", True),
    ("http://255.255.255.255", True),
    ("http://user:pw@10.1.2.3:80/x", True),
    ("http://localhost:1", True),
    ("http://LOCALHOST.:1", True),
    ("http://gpu.localhost:1", True),
    ("http://[::1]:80", True),
    ("http://[::]:80", True),
    ("http://[::ffff:127.0.0.1]:80", True),
    ("http://[::ffff:7f00:1]:80", True),
    ("http://[64:ff9b::7f00:1]", True),  # NAT64 of 127.0.0.1
    ("http://[2002:7f00:1::1]", True),  # 6to4
    ("http://[2002:808:808::1]", True),  # 6to4, even of a public address: refused whole, in SQL too
    ("http://[fe80::1%25eth0]:1", True),
    ("http://[fd00::1]", True),
    ("https://8.8.8.8", False),
    ("https://1.1.1.1:8443/v1", False),
    ("http://0x08080808", False),  # 8.8.8.8 written in hex is still public
    ("http://[::ffff:8.8.8.8]", False),
    ("http://[2606:4700:4700::1111]", False),
    ("https://gpu.example.com:8443", False),  # a name: checked where it resolves, at connect time
    ("http://08.1.1.1", False),  # not octal, so a name to libc too
    ("http://1.2.3.4.5", False),  # five parts: a name
    ("tunnel:box", False),
]


@pytest.mark.parametrize(("url", "refused"), ENDPOINTS)
def test_every_notation_of_a_non_public_host_is_refused(url: str, refused: bool) -> None:
    check_literal.cache_clear()
    if refused:
        with pytest.raises(PrivateEndpoint):
            check_literal(url)
    else:
        check_literal(url)


def test_ipv4_is_read_as_libc_reads_it() -> None:
    """Whatever inet_aton(3) accepts as an address (what the resolver would connect to), we read as the
    same address: no notation turns an address into a 'name' that passes unchecked."""
    rng = random.Random(7)
    compared = 0
    for _ in range(5000):
        parts = []
        for _ in range(rng.randint(1, 4)):
            value = rng.choice([0, 1, 7, 127, 255, 256, 65535, 2**24 - 1, rng.randrange(2**32)])
            form = rng.choice(["{:d}", "0{:o}", "0x{:x}", "0X{:X}"])
            parts.append(form.format(value))
        host = ".".join(parts).lower()
        try:
            libc = ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            continue
        assert parse_ipv4(host) == libc, host
        compared += 1
    assert compared > 1000


def test_public_means_globally_routable() -> None:
    assert is_public(ipaddress.ip_address("8.8.8.8"))
    for private in ("127.0.0.1", "10.1.1.1", "172.31.0.1", "192.0.2.1", "::1", "fc00::1", "ff02::1"):
        assert not is_public(ipaddress.ip_address(private)), private
