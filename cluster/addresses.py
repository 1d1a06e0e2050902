"""Bus addresses: what a host and a port may be, checked once for everyone.

Hosts arrive from the command line (``--bus``, ``--join``, ``pgq cluster
meet``) and from other nodes (gossiped member records). Before this check
a record with a host the IDNA codec rejects (``"\\u200d"``, 64 ``é``) made
``connect_tcp`` raise outside the handled errors and stopped the node; the
record was stored, so the node crash-looped. Now every host is one of:

* an IPv4 or IPv6 address (literal), or
* an ASCII host name (RFC 1123: labels of letters, digits and hyphens, at
  most 63 characters each, 253 in all),

and anything else is refused where it enters (a typed error for a user, a
dropped message for a peer). Ports are 1..65535.
"""

from __future__ import annotations

import ipaddress
import re

from pgq.arguments import port_number
from pgq.errors import InvalidArgumentError

__all__ = ["valid_host", "valid_port", "check_host", "parse_address"]

_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)\Z")
_SCOPE = re.compile(r"[A-Za-z0-9_.-]{1,15}")  # an interface name or number (IFNAMSIZ)


def valid_host(host: object) -> bool:
    if not isinstance(host, str) or not 0 < len(host) <= 253:
        return False
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return all(_LABEL.match(label) for label in host.removesuffix(".").split("."))
    # An IPv6 scope id ("fe80::1%eth0") is any text to ipaddress: a NUL or a
    # newline there passed, and made every save of the members fail on
    # every node the address was gossiped to.
    _address, _sep, scope = host.partition("%")
    return _SCOPE.fullmatch(scope) is not None if _sep else True


def valid_port(port: object) -> bool:
    return isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536


def check_host(host: str) -> str:
    if not valid_host(host):
        raise InvalidArgumentError(
            f"{host!r} is not a host: give an IP address or an ASCII host name")
    return host


def parse_address(text: str, what: str = "") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as (host, port), checked;
    ``what`` names the option in the error (``--bus``)."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    number = port_number(port)
    named = f"{what}: " if what else ""
    if not sep or not host or number is None:
        raise InvalidArgumentError(f"{named}expected HOST:PORT, not {text!r}")
    if not valid_port(number):
        raise InvalidArgumentError(f"{named}the port of {text!r} is not from 1 to 65535")
    return check_host(host), number
