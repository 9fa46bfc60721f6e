"""A member's process names, signed, the connections it calls the Lighthouse's gate over; the gate then takes its
slot's ``Quorum`` and ``Heartbeat`` over those connections only (:meth:`lowband.ft.gateway.LighthouseGateway.member_refusal`).

torchft's requests carry nothing to sign, and on one host every process calls from the member's own address: a
process that learnt the member's full replica id could otherwise take over its slot whenever the member's connection
broke (the gate pinned the first connection to call after that). A connection is a port on the member's own address,
which another process cannot hold while the member does; the member's rank 0 reads its own sockets from Linux's
``/proc/self`` and registers again, signed with its key, whenever torchft's Manager opens a new one.

Once a connection closes, its port is free: another process may bind it and call from the same end before the member
names its connections again (a poll, :class:`PinKeeper`). The gate therefore ties each named end to the connection
(the kernel's socket, :func:`connection_inode`) its first call came over, and refuses a call from that end over any
other connection.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable

__all__ = ["MAX_PINS", "PinKeeper", "addresses_of", "connection_inode", "endpoint_of_peer", "own_connections",
           "parse_pins", "plain_ip", "spell_pins"]

log = logging.getLogger(__name__)

#: The most connections one registration names (torchft's Manager calls over one; lowband's own calls add a few).
MAX_PINS = 8
Endpoint = tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]


def plain_ip(ip):
    """An IPv4-mapped IPv6 address as the IPv4 address it is; any other as it is."""
    return ip.ipv4_mapped or ip if ip.version == 6 else ip


def _endpoint(hex_pair: str) -> Endpoint:
    """``0100007F:D431`` (Linux's /proc/net/tcp: the address in host-order 32-bit words, then the port) as (ip, port)."""
    addr, port = hex_pair.split(":")
    raw = bytes.fromhex(addr)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return plain_ip(ipaddress.ip_address(raw)), int(port, 16)


def addresses_of(host: str, port: int) -> frozenset:
    """The IP addresses ``host`` (a literal or a name) stands for."""
    return frozenset(plain_ip(ipaddress.ip_address(a[4][0].split("%", 1)[0]))
                     for a in socket.getaddrinfo(host.strip("[]"), port, proto=socket.IPPROTO_TCP))


def _ends_of(fd: int) -> tuple[Endpoint, Endpoint] | None:
    """(local end, remote end) of this process's TCP socket ``fd`` (a duplicate is read and closed), or None."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            return None
        here, there = sock.getsockname(), sock.getpeername()
        return ((plain_ip(ipaddress.ip_address(here[0].split("%", 1)[0])), here[1]),
                (plain_ip(ipaddress.ip_address(there[0].split("%", 1)[0])), there[1]))
    except (OSError, ValueError):
        return None  # not connected (yet, or any more)
    finally:
        sock.close()


#: socket inode -> its ends, once connected (they never change): a poll then reads only this process's fd table.
_ENDS: dict[str, tuple[Endpoint, Endpoint]] = {}


def _own_sockets() -> list[tuple[str, Endpoint, Endpoint]]:
    """(the socket's name, ``socket:[INODE]``, its local end, its remote end) of each TCP socket this process holds
    that was connected when first seen (ends are kept by name: a socket reset since still shows them, until its owner
    closes it); empty where Linux's /proc/self cannot be read."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return []
    out, live = [], set()
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if not link.startswith("socket:["):
            continue
        live.add(link)
        ends = _ENDS.get(link)
        if ends is None and (ends := _ends_of(int(fd))) is not None:
            _ENDS[link] = ends
        if ends is not None:
            out.append((link, *ends))
    for gone in [k for k in _ENDS if k not in live]:
        del _ENDS[gone]  # bounded by this process's open sockets
    return out


def own_connections(host: str | frozenset, port: int) -> frozenset[Endpoint]:
    """The local ends (ip, port) of this process's connected TCP sockets to ``host:port`` (``host``: a name, resolved,
    or the addresses it stands for); empty where Linux's /proc/self cannot be read."""
    try:
        remote = host if isinstance(host, frozenset) else addresses_of(host, port)
    except OSError:
        return frozenset()
    return frozenset(here for _, here, there in _own_sockets() if there[1] == port and there[0] in remote)


# Linux's sock_diag (netlink): SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, NLMSG_ERROR, and "no cookie" (match any socket).
_SOCK_DIAG, _REQUEST, _ERROR, _NO_COOKIE = 20, 1, 2, 0xFFFFFFFF
_LISTEN = 10  # TCP_LISTEN


def _diag_address(ip, family: int) -> bytes:
    if family == socket.AF_INET6 and ip.version == 4:
        ip = ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + ip.packed)  # a v4 peer of a dual-stack socket
    return ip.packed.ljust(16, b"\0")


def connection_inode(local: Endpoint, remote: Endpoint) -> int | None:
    """The inode of the established TCP socket from ``local`` to ``remote`` (any process's), asked of the kernel by
    its four ends (sock_diag: one lookup, however many sockets the host holds); 0 when there is no such connection;
    None when the kernel cannot be asked (not Linux, or netlink refused)."""
    family = socket.AF_INET6 if local[0].version == 6 else socket.AF_INET
    sock_id = (struct.pack("!HH", local[1], remote[1]) + _diag_address(local[0], family)
               + _diag_address(remote[0], family) + struct.pack("=III", 0, _NO_COOKIE, _NO_COOKIE))
    body = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sock_id
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 4) as nl:  # NETLINK_SOCK_DIAG
            nl.settimeout(1.0)
            nl.send(struct.pack("=IHHII", 16 + len(body), _SOCK_DIAG, _REQUEST, 1, 0) + body)
            answer = nl.recv(8192)
    except (OSError, AttributeError):  # no AF_NETLINK (not Linux), or no sock_diag
        return None
    if len(answer) < 20:
        return None
    kind = struct.unpack_from("=H", answer, 4)[0]
    if kind == _ERROR:
        return 0 if struct.unpack_from("=i", answer, 16)[0] == -errno.ENOENT else None
    if kind != _SOCK_DIAG or len(answer) < 16 + 72:
        return None
    # inet_diag_msg: family, state, ..., the socket's ends, ..., uid, inode. With no such connection the kernel answers
    # with the listening socket of the local end.
    state, remote_port = answer[17], struct.unpack_from("!H", answer, 16 + 6)[0]
    if state == _LISTEN or remote_port != remote[1]:
        return 0
    return struct.unpack_from("=I", answer, 16 + 68)[0]


def spell_pins(pins: frozenset[Endpoint]) -> str:
    """Endpoints as a registration names them: ``127.0.0.1:54321 [::1]:5555`` (sorted, at most :data:`MAX_PINS`)."""
    spelt = sorted(f"[{ip}]:{p}" if ip.version == 6 else f"{ip}:{p}" for ip, p in pins)
    return " ".join(spelt[:MAX_PINS])


def parse_pins(text: str) -> frozenset[Endpoint]:
    """What :func:`spell_pins` wrote; a ValueError for anything else (a caller's text, read with bounds)."""
    if len(text) > MAX_PINS * 48:
        raise ValueError("too long a list of connections")
    out = set()
    for item in text.split():
        host, _, port = item.rpartition(":")
        if not port.isdigit() or len(port) > 5 or not 0 < int(port) < 65536:
            raise ValueError(f"not a connection's end: {item[:60]!r}")
        out.add((plain_ip(ipaddress.ip_address(host.strip("[]"))), int(port)))
    if len(out) > MAX_PINS:
        raise ValueError(f"more than {MAX_PINS} connections")
    return frozenset(out)


def endpoint_of_peer(peer: str) -> Endpoint | None:
    """gRPC's peer string (``ipv4:127.0.0.1:5123``, ``ipv6:[::1]:5123``) as (ip, port); None for another kind."""
    kind, _, rest = peer.partition(":")
    host, _, port = rest.rpartition(":")
    if kind not in ("ipv4", "ipv6") or not port.isdigit():
        return None
    try:
        return plain_ip(ipaddress.ip_address(host.strip("[]"))), int(port)
    except ValueError:
        return None


class PinKeeper:
    """Rank 0's thread that registers again (``register(pins)``: a signed ``Admit`` naming them) whenever the
    connections this process holds to the gate at ``host:port`` are not the ones its last registration named: a new
    one (the gate holds its first calls a moment for it), or one gone (its port is free for another process to bind:
    the gate then takes none of the slot's calls until the next is named)."""

    def __init__(self, host: str, port: int | str, register: Callable[[str], str | None], *,
                 poll_s: float = 0.25) -> None:
        self._register, self._poll_s = register, poll_s
        try:  # resolved once: a poll reads /proc only
            self._where = (addresses_of(host, int(port)), int(port))
        except OSError:
            self._where = (host, int(port))
        self.named: frozenset[Endpoint] = frozenset()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lowband-pins", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Register again if this process holds a connection to the gate that is not named yet."""
        now = own_connections(*self._where)
        if now != self.named:  # a new connection, or one gone (closed: another process may bind its port)
            why = self._register(spell_pins(now))
            if why is None:
                self.named = now
                log.info("this node calls the Lighthouse's gate over %s (registered, signed)",
                         spell_pins(now) or "no connection now")
            else:
                log.debug("the gate did not take this node's connections (%s)", why)

    def renew(self) -> None:
        """Name the connections again (the process registered anew without them: the gate then forgot them)."""
        self.named = frozenset()
        self.check()

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                self.check()
            except Exception as e:  # noqa: BLE001 - a daemon's poll: the next one tries again
                log.debug("naming this node's connections to the gate failed: %s", e)

    def stop(self) -> None:
        self._stop.set()
