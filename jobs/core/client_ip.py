"""The client's address, for the request rate limits (jobs/core/throttles.py, jobs/access/api.py) and the
login lockout (django-axes, AXES_CLIENT_IP_CALLABLE): one answer for all three.

X-Forwarded-For is whatever the client sent, with each proxy on the way appending the address it
got the request from. DRF's default read it whole, so a client rotating the header got a fresh rate
limit on every request. Here it is believed only as far as the proxies are trusted
(settings.TRAINYARD_TRUSTED_PROXIES, addresses and CIDRs; default none):

- the peer (REMOTE_ADDR) is not a trusted proxy: the peer is the client, the header is ignored;
- it is: the header is read from the right, past every trusted address, and the first address that
  is not trusted is the client (what a trusted proxy saw). Anything left of it the client wrote.
  An entry that is not an address stops the walk at the trusted hop that reported it.
"""
from __future__ import annotations

import ipaddress
from functools import lru_cache

from django.conf import settings

MAX_HOPS = 32
"""X-Forwarded-For entries read at most, from the right (a longer chain is the client's padding)."""

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


@lru_cache(maxsize=8)
def _networks(spec: tuple[str, ...]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    return tuple(ipaddress.ip_network(item, strict=False) for item in spec)


def parse_address(text: str) -> Address | None:
    """An address from a header entry or REMOTE_ADDR ("1.2.3.4", "1.2.3.4:5678", "[::1]:80",
    IPv4-mapped IPv6 as IPv4); None when it is not one."""
    t = text.strip()
    if t.startswith("[") and "]" in t:
        t = t[1:t.index("]")]
    elif t.count(":") == 1:  # IPv4 with a port
        t = t.split(":", 1)[0]
    try:
        address = ipaddress.ip_address(t)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _trusted(address: Address, networks) -> bool:
    return any(address.version == n.version and address in n for n in networks)


def client_ip(request) -> str:
    """The client's address for `request` (a Django or DRF request)."""
    meta = request.META
    remote = meta.get("REMOTE_ADDR") or ""
    networks = _networks(tuple(getattr(settings, "TRAINYARD_TRUSTED_PROXIES", ()) or ()))
    hop = parse_address(remote) if networks else None
    if hop is None or not _trusted(hop, networks):
        return remote
    forwarded = (meta.get("HTTP_X_FORWARDED_FOR") or "").split(",")
    for entry in reversed(forwarded[-MAX_HOPS:]):
        address = parse_address(entry)
        if address is None:
            break  # not an address: the trusted hop that reported it is what is known
        hop = address
        if not _trusted(address, networks):
            return str(address)
    return str(hop)
