"""Where a webhook may POST (pure): the URL's form, and its resolved addresses against the
operator's allow-list, TRAINYARD_WEBHOOK_ALLOW (comma-separated host names or addresses/CIDRs;
empty: nothing is reachable).

The service resolves the host (at create and again at every delivery, since DNS can change) and
hands the addresses here; the delivery then connects to the one address `pick_address` returned,
never to the name again, so a second lookup cannot rebind it to an internal address."""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_URL_LENGTH = 2000
_HOST = re.compile(r"^(?=.{1,253}$)([a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)(\.[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)*\.?$")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class Allow:
    """The parsed TRAINYARD_WEBHOOK_ALLOW: host names allowed by name, and networks."""

    hosts: frozenset[str] = frozenset()
    networks: tuple[Network, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.hosts and not self.networks


@dataclass(frozen=True)
class Target:
    """A webhook URL taken apart: what the delivery connects to and asks for."""

    scheme: str
    host: str        # lower case, no brackets (an IPv6 literal is bare)
    port: int
    path: str        # path and query, at least "/"

    @property
    def host_header(self) -> str:
        default = {"http": 80, "https": 443}[self.scheme]
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == default else f"{host}:{self.port}"


class TargetError(ValueError):
    """The URL may not be used; the message says why (the API's field error for `url`)."""


def parse_allow(entries: list[str] | tuple[str, ...]) -> Allow:
    """Each entry an address, a CIDR or a host name; a malformed one raises TargetError naming it."""
    hosts, networks = set(), []
    for raw in entries:
        item = raw.strip().lower()
        if not item:
            continue
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
            continue
        except ValueError:
            pass
        if not _HOST.match(item):
            raise TargetError(f"TRAINYARD_WEBHOOK_ALLOW: {raw[:100]!r} is not a host name, address or CIDR")
        hosts.add(item.rstrip("."))
    return Allow(frozenset(hosts), tuple(networks))


def parse_url(url: str) -> Target:
    """http or https, a host, no credentials, no fragment games; the port defaulted."""
    if not isinstance(url, str) or not url.strip():
        raise TargetError("give the URL the deliveries are POSTed to")
    if len(url) > MAX_URL_LENGTH:
        raise TargetError(f"at most {MAX_URL_LENGTH} characters")
    if any(ord(c) < 33 or ord(c) == 127 for c in url):
        raise TargetError("no spaces or control characters in the URL")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise TargetError(f"not a valid URL ({exc})") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise TargetError(f"only http and https URLs are allowed, not {scheme or 'no scheme'!r}")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise TargetError("no credentials in the URL (user:password@); the signature authenticates deliveries")
    host = (parts.hostname or "").lower()
    if not host:
        raise TargetError("the URL names no host")
    if ":" not in host and not _HOST.match(host):
        raise TargetError(f"{host[:100]!r} is not a valid host name")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Target(scheme, host.rstrip("."), port or {"http": 80, "https": 443}[scheme], path)


def literal_address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def pick_address(target: Target, addresses: list[str], allow: Allow) -> str:
    """The address to connect to: the first resolved one, and only when every resolved address is
    allowed (a name that resolves partly inside the allow-list is refused, so which address a client
    would pick cannot matter). A host allowed by name may resolve anywhere: the operator vouched
    for it."""
    if allow.empty:
        raise TargetError("no webhook destination is allowed on this server (TRAINYARD_WEBHOOK_ALLOW is empty)")
    if not addresses:
        raise TargetError(f"{target.host!r} does not resolve to any address")
    by_name = target.host in allow.hosts
    for text in addresses:
        address = ipaddress.ip_address(text)
        if getattr(address, "ipv4_mapped", None):
            address = address.ipv4_mapped
        if not by_name and not any(address in n for n in allow.networks if n.version == address.version):
            raise TargetError(f"{target.host!r} resolves to {address}, which TRAINYARD_WEBHOOK_ALLOW does not allow")
    return addresses[0]
