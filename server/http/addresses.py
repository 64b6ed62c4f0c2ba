"""Peer addresses, as the access rules see them."""

from __future__ import annotations

import ipaddress


def is_loopback(remote: str | None) -> bool:
    """Whether a peer address is loopback, IPv4-mapped IPv6 (``::ffff:127.0.0.1``) included."""
    if not remote:
        return False
    try:
        address = ipaddress.ip_address(remote.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback
