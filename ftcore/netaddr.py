"""Where a rank listens: the one address its store, heal server and gloo bind and advertise.

FTCORE_HOST names it. Unset, it is derived: loopback when the lighthouse is on loopback
(a single-host run), otherwise this host's address on the interface that routes to the
lighthouse, so that every peer that can reach the lighthouse can reach this rank too.
Nothing binds to all interfaces: a wildcard cannot be advertised, and it would expose
the unauthenticated data plane (TCPStore, gloo) on every network the host is on.
"""

import fcntl
import ipaddress
import socket
import struct

from ftcore import environment

_SIOCGIFADDR = 0x8915  # Linux ioctl: the IPv4 address of an interface


class AddressError(ValueError):
    """FTCORE_HOST (or the derived address) cannot be used; the message says what to set."""


def _host_of(addr: str) -> str:
    host = addr.removeprefix("http://").removeprefix("https://").rstrip("/").rpartition(":")[0]
    return host.strip("[]") or "127.0.0.1"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def route_to(host: str) -> str:
    """This host's source address toward `host` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), 9))
        return s.getsockname()[0]


def rank_host(lighthouse: str) -> str:
    """The address this rank binds and advertises (FTCORE_HOST, or derived as above)."""
    host = environment.text("FTCORE_HOST").strip()
    if host:
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            raise AddressError(
                f"FTCORE_HOST={host!r} is not an IP address; set it to this host's address "
                "on the network the other replica groups reach it by"
            ) from None
        if ip.is_unspecified:
            raise AddressError(
                f"FTCORE_HOST={host} is a wildcard: peers cannot connect to it; set this "
                "host's own address (nothing binds to all interfaces)"
            )
        return host
    lh = _host_of(lighthouse)
    if is_loopback(lh):
        return "127.0.0.1"
    try:
        return route_to(lh)
    except OSError as e:
        raise AddressError(
            f"no route from this host to the lighthouse {lighthouse} ({e.strerror}); "
            "set FTCORE_HOST to this host's address"
        ) from None


def interface_of(host: str) -> str | None:
    """The name of the interface that holds IPv4 address `host` (for GLOO_SOCKET_IFNAME)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on it
            if socket.inet_ntoa(raw[20:24]) == host:
                return name
    return None


def listen_fd(host: str, port: int = 0, backlog: int = 1024) -> tuple[int, int]:
    """(fd, port) of a TCP socket listening on exactly (host, port), for a TCPStore's
    `master_listen_fd` (TCPStore itself listens on every interface). The store owns the fd
    and closes it: the Python socket object is detached, or it would close the fd number a
    second time, by then someone else's."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
        s.listen(backlog)
    except OSError as e:
        s.close()
        raise AddressError(
            f"cannot listen on {host}:{port} ({e.strerror}); FTCORE_HOST must be an address of this host"
        ) from None
    port = s.getsockname()[1]
    return s.detach(), port
