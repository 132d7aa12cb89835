"""The outbound-URL policy: every HTTP call the platform makes on a team's behalf (LLM judges,
remote policies, scenario generation, MCP over HTTP; later webhooks and storage endpoints) goes
through one ``OutboundPolicy``.

Invariant: a team's URL reaches public addresses only, unless the operator allow-listed the host
or its network. The check is made where the socket opens: the name is resolved once, every address
is checked, and the connection goes to a checked address (the Host header and TLS SNI keep the
name), so a DNS answer that changes between a check and the connect (rebinding) gains nothing.
Redirects are refused, and proxies from the environment are ignored (a proxy would be the peer).

    policy = OutboundPolicy(allow=("judge.corp.example", "10.20.0.0/16", "127.0.0.1:8000"))
    policy.check_url(url)                 # at input: OutboundRefused with the reason, or a Target
    policy.opener().open(request)         # urllib, pinned, no redirects, no proxies
    policy.create_connection((host, port), timeout)   # a checked socket for any client
    policy.httpx_transport()              # httpx (MCP's client), pinned the same way
    ascii_url(url)                        # at every write: an internationalised host as IDNA

Standard library plus ``idna`` (IDNA 2008; the stdlib codec is IDNA 2003); httpx and httpcore are
imported only by ``httpx_transport``. No Django: the operator's allow-list is passed in
(``projects.outbound`` builds the policy from settings).
"""

from __future__ import annotations

import functools
import ipaddress
import re
import socket
import urllib.request
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import urlsplit

from training.safety.outbound_names import OutboundRefused, ascii_url, idna_host, normalise_host
from training.safety.outbound_transport import (
    PinnedAsyncBackend,
    PinnedHTTPHandler,
    PinnedHTTPSHandler,
    RefuseRedirects,
)
from training.safety.redaction import REASON_CHARS, REDACTED, redact, upstream_reason

# Re-exported: callers import them here (training.safety.outbound_names and training.safety.redaction hold them).
__all__ = ["REASON_CHARS", "REDACTED", "OutboundRefused", "ascii_url", "idna_host", "normalise_host", "redact",
           "upstream_reason"]  # fmt: skip

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# Names of cloud metadata services: refused by name (they resolve to link-local addresses, which
# are refused anyway, but a resolver may answer differently inside the cloud).
METADATA_NAMES = frozenset(
    {"metadata", "metadata.google.internal", "metadata.goog", "instance-data", "instance-data.ec2.internal"}
)
_SHARED = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT (RFC 6598)
_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")  # Linux connects 0.0.0.0 to the local host
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # well-known NAT64 prefix: the last 32 bits are IPv4
_UNIQUE_LOCAL = ipaddress.ip_network("fc00::/7")


@dataclass(frozen=True)
class Target:
    """A URL the policy accepted: what a client connects to. ``addresses`` are the checked ones
    (empty when the name does not resolve right now: it is checked again at every connect)."""

    url: str
    scheme: str  # "http" or "https"
    host: str  # lower case, IDNA-encoded, no trailing dot, no brackets
    port: int
    addresses: tuple[str, ...]


@dataclass(frozen=True)
class _Rule:
    """One allow-list entry: a host name or a network, optionally one port only."""

    host: str | None = None
    network: IPNetwork | None = None
    port: int | None = None


@dataclass(frozen=True)
class OutboundPolicy:
    """Which hosts a team's URL may reach. ``allow``: the operator's exceptions to "public addresses
    only": host names (``judge.corp.example``), addresses or CIDRs (``10.20.0.0/16``, ``::1``), each
    optionally with a port (``127.0.0.1:8000``, ``[::1]:8000``). A bad entry is a ValueError."""

    allow: tuple[str, ...] = ()
    _rules: tuple[_Rule, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_rules", tuple(parse_allow_entry(entry) for entry in self.allow))

    # -- checks ---------------------------------------------------------------------------------

    def check_url(self, url: str, *, resolve: bool = True) -> Target:
        """``url`` parsed and checked (http/https only; the host by name, and by every address it
        resolves to when ``resolve``); OutboundRefused saying why not."""
        if not isinstance(url, str):
            raise OutboundRefused("must be an http:// or https:// URL")
        try:
            parts = urlsplit(url.strip())
            port = parts.port
        except ValueError:
            raise OutboundRefused("must be an http:// or https:// URL with a valid host and port") from None
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https"):
            raise OutboundRefused("must be an http:// or https:// URL")
        host = normalise_host(parts.hostname or "")
        port = port if port is not None else (443 if scheme == "https" else 80)
        if not 0 < port < 65536:
            raise OutboundRefused("the port must be from 1 to 65535")
        self._check_name(host, port)
        addresses: tuple[str, ...] = ()
        if resolve:
            try:
                addresses = tuple(sockaddr[0] for _, sockaddr in self.resolve(host, port))
            except socket.gaierror:
                addresses = ()  # unknown now; refused or allowed when a connection is made
        return Target(url=url, scheme=scheme, host=host, port=port, addresses=addresses)

    def resolve(self, host: str, port: int) -> list[tuple[int, Any]]:
        """``[(family, sockaddr)]`` for ``host``, every address checked: OutboundRefused when any
        is forbidden (a name that answers both public and internal addresses is refused);
        socket.gaierror when it does not resolve."""
        host = normalise_host(host)
        self._check_name(host, port)
        try:
            answers = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (UnicodeError, ValueError):  # a NUL byte, a label over 63 characters
            raise OutboundRefused("the host is not a valid name") from None
        checked: list[tuple[int, Any]] = []
        for family, _, _, _, sockaddr in answers:
            if family not in (socket.AF_INET, socket.AF_INET6):
                continue
            self.check_address(host, port, str(sockaddr[0]))
            if (family, sockaddr) not in checked:
                checked.append((family, sockaddr))
        if not checked:
            raise socket.gaierror(socket.EAI_NONAME, "no IPv4 or IPv6 address")
        return checked

    def check_address(self, host: str, port: int, address: str) -> None:
        """OutboundRefused unless a connection to ``address`` for ``host:port`` is allowed."""
        if self._host_allowed(host, port):
            return
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 scope id is no part of it
        for judged in addresses_to_judge(ip):
            if self._network_allowed(judged, port):
                continue
            reason = forbidden_reason(judged)
            if reason:
                shown = f"{host} is" if _is_literal(host, ip) else f"{host} resolves to"
                message = f"{shown} {reason} address; only public addresses may be called"
                if "metadata" in reason:
                    raise OutboundRefused(message)
                # The entry that admits it: the name, or the address judged (a mapped IPv6 form of
                # an IPv4 address is judged, and allowed, as the IPv4 one).
                allowed = str(judged) if _is_literal(host, ip) else host
                entry = f"[{allowed}]:{port}" if ":" in allowed else f"{allowed}:{port}"
                raise OutboundRefused(message, allow_entry=entry)

    # -- connections ----------------------------------------------------------------------------

    def create_connection(
        self,
        address: tuple[str, int],
        timeout: float | None | object = socket._GLOBAL_DEFAULT_TIMEOUT,  # type: ignore[attr-defined]
        source_address: tuple[str, int] | None = None,
    ) -> socket.socket:
        """``socket.create_connection`` to a checked address of ``address``'s host: the socket's peer
        is the address that was checked (no second lookup)."""
        host, port = address
        error: OSError | None = None
        for family, sockaddr in self.resolve(host, port):
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                if timeout is not socket._GLOBAL_DEFAULT_TIMEOUT:  # type: ignore[attr-defined]
                    sock.settimeout(timeout)  # type: ignore[arg-type]
                if source_address:
                    sock.bind(source_address)
                sock.connect(sockaddr)
                return sock
            except OSError as exc:
                sock.close()
                error = exc
        assert error is not None  # resolve() returns at least one address
        raise error

    def opener(self) -> urllib.request.OpenerDirector:
        """A urllib opener for http(s) only: pinned connections, redirects refused (urllib would
        forward the Authorization header to wherever Location points), no proxies. Built once per
        policy; safe to share between threads."""
        return self._opener

    @functools.cached_property
    def _opener(self) -> urllib.request.OpenerDirector:
        opener = urllib.request.OpenerDirector()
        for handler in (
            PinnedHTTPHandler(self),
            PinnedHTTPSHandler(self),
            RefuseRedirects(),
            urllib.request.HTTPDefaultErrorHandler(),
            urllib.request.HTTPErrorProcessor(),
            urllib.request.UnknownHandler(),
        ):
            opener.add_handler(handler)
        return opener

    def httpx_transport(self) -> Any:
        """An ``httpx.AsyncHTTPTransport`` whose connections go to checked addresses (TLS SNI and
        the Host header keep the name). Give it to ``httpx.AsyncClient(transport=...)``, which then
        also ignores proxy variables; keep ``follow_redirects`` off (httpx's default)."""
        import httpcore
        import httpx

        transport = httpx.AsyncHTTPTransport(trust_env=False)
        # httpx has no public hook for the network backend; httpcore's pool has one. The MCP
        # rebinding test (tests/training/test_outbound.py) fails if this stops being the pool used.
        transport._pool = httpcore.AsyncConnectionPool(
            ssl_context=httpx.create_ssl_context(trust_env=False),
            max_connections=100,  # httpx's default limits
            max_keepalive_connections=20,
            keepalive_expiry=5.0,
            network_backend=cast(Any, PinnedAsyncBackend(self, httpcore.AnyIOBackend())),  # duck-typed
        )
        return transport

    # -- rules ----------------------------------------------------------------------------------

    def _check_name(self, host: str, port: int) -> None:
        if not host:
            raise OutboundRefused("the URL has no host")
        if self._host_allowed(host, port):
            return
        if host in METADATA_NAMES:
            raise OutboundRefused(f"{host} is a cloud metadata service")
        if host == "localhost" or host.endswith(".localhost"):
            raise OutboundRefused(
                f"{host} is a loopback address; only public addresses may be called",
                allow_entry=f"{host}:{port}",
            )

    def _host_allowed(self, host: str, port: int) -> bool:
        return any(rule.host == host and rule.port in (None, port) for rule in self._rules)

    def _network_allowed(self, ip: IPAddress, port: int) -> bool:
        return any(
            rule.network is not None and ip in rule.network and rule.port in (None, port)
            for rule in self._rules
        )


# What a client built without the operator's policy may reach: public addresses only.
PUBLIC_ONLY = OutboundPolicy()


def _is_literal(host: str, ip: IPAddress) -> bool:
    try:
        return ipaddress.ip_address(host) == ip
    except ValueError:
        return False


def parse_allow_entry(entry: str) -> _Rule:
    """``host``, ``address``, ``CIDR``, ``host:port``, ``address:port`` or ``[IPv6]:port`` as a rule;
    ValueError naming the entry when it is none of those."""
    text = entry.strip()
    port: int | None = None
    match = re.fullmatch(r"\[([0-9a-fA-F:.]+)\](?::(\d+))?", text) or re.fullmatch(r"([^:\[\]]+):(\d+)", text)
    if match:
        text = match.group(1)
        port = int(match.group(2)) if match.group(2) else None
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"outbound allow-list entry {entry!r}: the port must be from 1 to 65535")
    try:
        return _Rule(network=ipaddress.ip_network(text, strict=False), port=port)
    except ValueError:
        pass
    try:
        host = normalise_host(text)
    except OutboundRefused:
        host = ""
    if not re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*", host):
        raise ValueError(
            f"outbound allow-list entry {entry!r} is not a host name, an address or a CIDR (with an optional :port)"
        )
    return _Rule(host=host, port=port)


def addresses_to_judge(ip: IPAddress) -> list[IPAddress]:
    """The address and the IPv4 addresses it stands for: an IPv4-mapped address is its IPv4 one on
        the wire, and so is a NAT64 one (64:ff9b::/96); 6to4 and Teredo addresses are judged together
    with the IPv4 addresses they embed."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return [ip.ipv4_mapped]
        if ip in _NAT64:  # a DNS64 network's name for a public IPv4 host: judged as that host
            return [ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)]
        embedded = []
        if ip.sixtofour is not None:
            embedded.append(ip.sixtofour)
        if ip.teredo is not None:
            embedded.extend(ip.teredo)
        return [ip, *embedded]
    return [ip]


def forbidden_reason(ip: IPAddress) -> str:
    """Why ``ip`` is no public address ("a loopback", "a link-local (cloud metadata)", …); ""
    for a public one."""
    if ip.is_unspecified or (isinstance(ip, ipaddress.IPv4Address) and ip in _THIS_NETWORK):
        return "an unspecified"
    if ip.is_loopback:
        return "a loopback"
    if ip.is_link_local:
        metadata = str(ip) in ("169.254.169.254", "fd00:ec2::254")
        return "a link-local (cloud metadata)" if metadata else "a link-local"
    if ip.is_multicast:
        return "a multicast"
    if isinstance(ip, ipaddress.IPv4Address) and ip in _SHARED:
        return "a shared (carrier-grade NAT)"
    if isinstance(ip, ipaddress.IPv6Address) and ip in _UNIQUE_LOCAL:
        return "a unique-local"
    if isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local:
        return "a site-local"
    if ip.is_reserved:
        return "a reserved"
    if ip.is_private:
        return "a private"
    if not ip.is_global:
        return "a reserved"
    return ""
