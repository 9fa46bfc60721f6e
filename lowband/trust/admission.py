"""Who may join a fault-tolerant job, and where its listeners may listen (docs/internet.md).

torchft's Lighthouse admits anyone who asks for a quorum, and its Lighthouse, Manager, state server,
store and gloo ask for no credential. lowband adds two things above it:

- **admission by the job's secret** (:mod:`lowband.trust.secret`): the replica id a node gives torchft
  carries, beside its job's fingerprint and its slot, the address of the store it registers and an
  HMAC tag of the three under the secret. Every node checks every member of every quorum
  (:func:`screen`) before torchft configures a process group, sends or fetches state: a member whose
  tag fails, or whose addresses in the quorum are not the ones its tag vouches for, is an *outsider*.
  An outsider is never trained with, healed from or sent state; the job's nodes ask for the quorum
  again (no step is dropped, no process group ever holds the outsider), and never leave because of
  outsiders. A node whose secret is not the job's is the one refused: it finds no member that
  proves its secret and leaves with :class:`AdmissionRefused` at its first quorum.
- **listeners on the job's network** (:func:`job_address`, :func:`check_bind`): loopback by default, a private
  address (a VPN's) when given, in whatever spelling; a wildcard or public address is refused unless the
  user says the network is trusted, because torchft's Lighthouse serves every member and a kill route,
  and its Manager a kill RPC, to anyone who reaches them. A listener binds the checked address, as an IP
  literal.
"""

from __future__ import annotations

import fcntl
import ipaddress
import re
import socket
import struct
from dataclasses import dataclass

from lowband.trust.secret import tag, verify

__all__ = ["Address", "AdmissionRefused", "BindRefused", "CannotListen", "Claim", "RemovedFromJob", "admit", "check_bind", "check_port",
           "claim_of", "is_public", "job_address", "join_bind", "member_of", "replica_id", "same_host", "screen"]


class AdmissionRefused(ValueError):
    """This node's secret is not the running job's (or it has none and the job has one)."""


class RemovedFromJob(AdmissionRefused):
    """The Lighthouse's gate removed this node from the running job (it stalled the job, or most of the other
    members reported its bad messages)."""


class BindRefused(ValueError):
    """A listener would bind a wildcard or public address without ``--trusted-network``."""


class CannotListen(OSError):
    """A listener cannot bind the checked address: not an address of this machine, or the port is taken."""


# --------------------------------------------------------------------------- replica ids
def replica_id(fingerprint: str, node: int, *, secret: bytes | None = None, store: str = "",
               manager: str = "", last_step: int | None = None) -> str:
    """A node's torchft replica id: its job's fingerprint and its slot (torchft reads the slot from the
    trailing digits and appends ``:uuid``); with a secret, also the addresses it registers (its store's
    and its Manager's, ``HOST:PORT``), the job's last step when given (the gate's record of the job's end,
    :mod:`lowband.ft.completion`), and the tag that binds them all to the secret."""
    fp = fingerprint or "none"
    if secret is None:
        return f"lowband_{fp}_node{node}"
    addr = f"{store},{manager}"
    if last_step is None:
        return f"lowband_{fp}_a{addr.encode().hex()}_t{tag(secret, 'lowband-member', fp, node, addr)}_node{node}"
    last = int(last_step)
    mac = tag(secret, "lowband-member", fp, node, addr, f"last={last}")
    return f"lowband_{fp}_a{addr.encode().hex()}_t{mac}_l{last}_node{node}"


#: The longest replica id read (lowband's own: two ``HOST:PORT`` of at most 253 + 6 characters each, hex-coded, a
#: tag, a slot and torchft's ``:uuid``, are well under it). Anything longer is no member's, and is not looked into.
MAX_ID_CHARS = 4096
#: The most digits of a node slot (torchft reads the slot from the id's trailing digits as an int).
MAX_SLOT_DIGITS = 9
_REPLICA_ID = re.compile(r"lowband_(?:(?P<fp>[0-9A-Za-z]{1,64})_)?(?:a(?P<store>(?:[0-9a-f]{2}){0,1100})_"
                         rf"t(?P<tag>[0-9a-f]{{32}})_(?:l(?P<last>[0-9]{{1,12}})_)?)?node(?P<node>[0-9]{{1,{MAX_SLOT_DIGITS}}})", re.ASCII)


@dataclass(frozen=True)
class Claim:
    """What a member's replica id claims: its job's fingerprint, its slot, its store address, its tag, and the job's
    last step (None where the id names none)."""

    fingerprint: str
    node: int
    store: str = ""
    tag: str = ""
    manager: str = ""
    last_step: int | None = None

    @property
    def addr(self) -> str:
        return f"{self.store},{self.manager}"


def claim_of(rid: object) -> Claim | None:
    """The claim in a quorum member's replica id; None for anything lowband did not make (another type, longer
    than :data:`MAX_ID_CHARS`, another shape, a slot of more than :data:`MAX_SLOT_DIGITS` digits, an address
    that is not UTF-8). Never raises: ids come from anyone who reaches the Lighthouse."""
    if not isinstance(rid, str) or len(rid) > MAX_ID_CHARS:
        return None
    m = _REPLICA_ID.fullmatch(rid.partition(":")[0])
    if m is None:
        return None
    try:
        store, _, manager = bytes.fromhex(m["store"] or "").decode().partition(",")
    except (ValueError, UnicodeDecodeError):
        return None
    return Claim(m["fp"] or "", int(m["node"]), store, m["tag"] or "", manager,
                 int(m["last"]) if m["last"] else None)


def member_of(rid: str) -> tuple[str, int | None]:
    """(fingerprint, node slot) of a quorum member's replica id ("" and None for ids lowband did not make)."""
    c = claim_of(rid)
    return ("", None) if c is None else (c.fingerprint, c.node)


def proves(secret: bytes, rid: str) -> bool:
    """Whether ``rid``'s tag proves the secret for what the id claims (its fingerprint, slot, addresses and, where it
    names one, the job's last step)."""
    c = claim_of(rid)
    last = () if c is None or c.last_step is None else (f"last={c.last_step}",)
    return c is not None and bool(c.tag) and verify(secret, c.tag, "lowband-member", c.fingerprint or "none",
                                                    c.node, c.addr, *last)


# --------------------------------------------------------------------------- admission
def admit(replica_ids: list[str], mine: str, *, behind: bool, rounds: int, patience: int = 1) -> str:
    """What a node does with a quorum whose members are not all of one job (one fingerprint).

    Every member sees the same members, so they all judge alike: the job with the most nodes in the
    quorum stays and asks for a quorum again (the Lighthouse forms it without the others once they
    leave); the nodes of every other job leave. When two jobs have as many nodes, a node that is
    behind (a newcomer: someone in the quorum is at a newer step) leaves first; if the tie remains
    ``patience`` rounds later, the job with the smaller fingerprint stays. Patience lets the nodes of
    both jobs that are still starting arrive and break the tie by number (in a loaded CI run one node
    of a job and a foreign node met alone at the start, and the job's node, whose fingerprint was the
    larger, left a round later, before its job's two other nodes were up).

    A member whose id lowband did not make is no job: it is not counted, and only makes the quorum
    ``"retry"``. Returns ``"accept"`` (one job), ``"retry"`` or ``"leave"``.
    """
    counts: dict[str, int] = {}
    strangers = False
    for rid in replica_ids:
        claim = claim_of(rid)
        if claim is None:
            strangers = True
            continue
        counts[claim.fingerprint] = counts.get(claim.fingerprint, 0) + 1
    if len(counts) <= 1:
        return "retry" if strangers else "accept"
    top = max(counts.values())
    if counts.get(mine, 0) < top:
        return "leave"
    tied = sorted(fp for fp, c in counts.items() if c == top)
    if len(tied) == 1:
        return "retry"
    if behind:
        return "leave"
    if rounds < patience:
        return "retry"
    return "retry" if mine == tied[0] else "leave"


def free_port(host: str) -> int:
    """A free TCP port on ``host`` (for a listener whose address must be known before it starts)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Screening:
    """:func:`screen`'s verdict on one quorum: ``"accept"``, ``"retry"`` (ask again: outsiders in it) or
    ``"refused"`` (this node is the one without the job's secret), and the outsiders' replica ids."""

    verdict: str
    outsiders: list[str]
    why: str = ""
    peers: int = 0  # other members that prove this node's secret


def screen(result, *, secret: bytes | None, me: str, new: bool, behind: bool) -> Screening:
    """Check every member of a torchft quorum (``result``: its ``replica_ids``, ``replica_rank``,
    ``store_address``, ``recover_src_replica_rank``, ``recover_src_manager_address`` and
    ``recover_dst_replica_ranks``) before anything is configured, sent or fetched with it. ``me`` is this
    node's full replica id (torchft's, with its ``:uuid``).

    With a secret, an outsider is a member whose tag does not prove the secret for what its id
    claims; the quorum is also refused when the store every rank will rendezvous at is not one a
    proven member claims, or when this node would heal from (or send its state to) an outsider, or
    fetch state from another address than its source's, or when a slot is claimed twice (a copied id:
    ``"twin"`` for a new node whose own slot it is, as torchft's twin check). This node is ``"refused"`` when it is new (its
    first quorum), no other member proves its secret, and the others look like a job with a secret of
    its own (a tagged id) that is ahead of it or two or more strong; otherwise outsiders only make the
    quorum ``"retry"``: no fake member can send a job's node away. Without a secret, members whose ids
    carry a tag (a job with a secret) refuse this node, and a member whose id lowband did not make (any
    shape :func:`claim_of` does not read) is an outsider that makes the quorum ``"retry"``; nothing else
    is checked here. Never raises, whatever the members' ids and the quorum's fields hold.
    """
    ids = [r if isinstance(r, str) else repr(r) for r in result.replica_ids]
    others = [r for r in ids if r != me]
    tagged = [r for r in others if (claim_of(r) or Claim("", -1)).tag]
    if secret is None:
        if tagged and new:
            return Screening("refused", tagged, "the job's nodes prove a secret and this node has none")
        strangers = [r for r in others if claim_of(r) is None]
        if strangers:  # not a job at all: never counted as one (admit), never a reason to leave
            return Screening("retry", strangers, "members whose replica ids lowband did not make")
        return Screening("accept", [])
    outsiders = [r for r in others if not proves(secret, r)]
    proven = {r.split(":", 1)[0] for r in ids if r not in outsiders}
    peers = [r for r in others if r not in outsiders]
    if outsiders and not peers and new and tagged and (behind or len(tagged) >= 2):
        return Screening("refused", outsiders, "no member of the quorum proves this node's secret")
    if outsiders:
        return Screening("retry", outsiders, "outsiders in the quorum", len(peers))
    slots: dict[tuple[str, int], list[str]] = {}
    for r in ids:
        c = claim_of(r)
        slots.setdefault((c.fingerprint, c.node), []).append(r)
    twins = [r for group in slots.values() if len(group) > 1 for r in group]
    if twins:  # a copied id (or a node started twice): whoever is real, the quorum is not used
        mine_twice = me in twins
        return Screening("twin" if mine_twice and new else "retry", [r for r in twins if r != me],
                         "a node slot is claimed twice in the quorum (a copied id, or a node started twice)",
                         len(peers))
    stores = {claim_of(r).store for r in ids if r.split(":", 1)[0] in proven}
    store = str(getattr(result, "store_address", ""))
    if store and store not in stores:
        return Screening("retry", [], f"the quorum's store {store[:100]} is no member's", len(peers))
    src = getattr(result, "recover_src_replica_rank", None)
    if src is not None and getattr(result, "heal", False):
        if not (isinstance(src, int) and 0 <= src < len(ids)):
            return Screening("retry", [], f"the quorum names no member as the state source ({src!r})", len(peers))
        claim = claim_of(ids[src])
        addr = str(getattr(result, "recover_src_manager_address", ""))
        if claim is None or addr.split("://", 1)[-1].rstrip("/") != claim.manager:
            return Screening("retry", [ids[src]], f"the state source's address {addr[:100]} is not the one it claims",
                             len(peers))
    return Screening("accept", [], "", len(peers))


# --------------------------------------------------------------------------- listeners
LOOPBACK = "127.0.0.1"


#: The job's network: loopback, the private ranges of RFC 1918 and RFC 4193 (a VPN's, e.g. WireGuard's 10.0.0.x) and
#: link-local addresses. Every other address is public, whatever Python's ``is_private`` says of it (it counts
#: Teredo's and documentation ranges as private, and an IPv4-mapped ``::ffff:0.0.0.0`` too).
JOB_NETWORKS = tuple(ipaddress.ip_network(n) for n in (
    "127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16",
    "::1/128", "fc00::/7", "fe80::/10"))
_HOST_CHARS = re.compile(r"[0-9A-Za-z._%:-]{1,253}", re.ASCII)


@dataclass(frozen=True)
class Address:
    """What :func:`job_address` decided of a host: the address to bind (an IP literal, or None when there is
    none), whether it is the job's network, and why not."""

    host: str
    address: str | None
    job: bool
    why: str = ""


def _judge(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> tuple[ipaddress._BaseAddress, str]:
    """(the address as it is bound, why it is not the job's network or "")."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:  # ::ffff:a.b.c.d reaches the IPv4 address a.b.c.d, and is bound as it
            ip = ip.ipv4_mapped
        elif ip.scope_id is None and int(ip) >> 32 == 0 and int(ip) > 1:
            return ip, "an IPv4-compatible IPv6 address (::a.b.c.d, deprecated): write the IPv4 address itself"
    if ip.is_unspecified:
        return ip, "a wildcard: every interface of this machine"
    if ip.version == 4 and int(ip) >> 24 == 0:
        return ip, "an address of 0.0.0.0/8 (\"this network\": no interface holds one, and 0.0.0.0 is every interface)"
    bare = ipaddress.ip_address(str(ip).split("%", 1)[0])
    if not any(bare in n for n in JOB_NETWORKS if n.version == bare.version):
        return ip, "a public address (not loopback, private or link-local)"
    return ip, ""


def job_address(host: str) -> Address:
    """Decide whether binding ``host`` keeps a listener on the job's network, for every spelling of an address:
    IPv4 (dotted, and the short, hex, octal and integer forms the resolver takes: ``127.1``, ``0x7f000001``,
    ``0177.0.0.1``, ``0``), IPv6 (``::``, IPv4-mapped ``::ffff:a.b.c.d``, IPv4-compatible ``::a.b.c.d``, with a
    scope), in brackets or not, and host names (every address the name resolves to must be the job's; it is
    bound at the first). The address to bind is returned as an IP literal: a listener binds that, never the
    name or spelling again (so what is bound is what was checked). Never raises."""
    h = host[1:-1] if isinstance(host, str) and host.startswith("[") and host.endswith("]") else host
    if not isinstance(h, str) or h in ("", "*"):
        return Address(str(host), None, False, "a wildcard: every interface of this machine")
    if not _HOST_CHARS.fullmatch(h):
        return Address(host, None, False, "not an address or host name (characters outside [0-9A-Za-z._%:-])")
    try:
        ips = [ipaddress.ip_address(h)]
    except ValueError:
        try:  # the resolver's own IPv4 forms (``127.1``, ``0x7f000001``, ``0177.0.0.1``, ``0``)
            ips = [ipaddress.ip_address(socket.inet_ntoa(socket.inet_aton(h)))]
        except (OSError, ValueError):
            try:
                infos = socket.getaddrinfo(h, None, type=socket.SOCK_STREAM)
                ips = [ipaddress.ip_address(i[4][0]) for i in infos]
            except (OSError, ValueError, UnicodeError):
                return Address(host, None, False, "a host name that does not resolve here")
            if not ips:
                return Address(host, None, False, "a host name that does not resolve here")
    judged = [_judge(ip) for ip in ips]
    bad = [(ip, why) for ip, why in judged if why]
    if bad:
        ip, why = bad[0]
        named = f"{ip}, " if str(ip) != h else ""
        return Address(host, str(ip), False, f"{named}{why}")
    return Address(host, str(judged[0][0]), True)


def is_public(host: str) -> bool:
    """Whether binding ``host`` exposes a listener beyond the job's network (:func:`job_address`): a wildcard (every
    interface), a public address, or a name that resolves to one (or not at all)."""
    return not job_address(host).job


def split_bind(bind: str) -> tuple[str, str]:
    """``HOST:PORT`` / ``[V6]:PORT`` -> (host, port)."""
    if bind.startswith("["):
        host, _, port = bind[1:].partition("]:")
        return host, port
    host, _, port = bind.rpartition(":")
    return host, port


def join_bind(host: str, port: int | str) -> str:
    """(host, port) -> ``HOST:PORT``, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_port(port: str, *, flag: str) -> int:
    """A listener's port: decimal digits, 0 (any free port) to 65535; a ValueError that names ``flag`` otherwise."""
    if not re.fullmatch(r"[0-9]{1,5}", port or "", re.ASCII) or int(port) > 65535:
        raise ValueError(f"{flag}: the port must be a number from 0 to 65535 (HOST:PORT, [IPv6]:PORT), got {port!r}")
    return int(port)


def check_bind(host: str, *, what: str, flag: str, secret: bool, trusted_network: bool, port: str = "") -> str:
    """The address a listener binds for ``host`` (an IP literal: :func:`job_address`), or :class:`BindRefused` when
    it is not the job's network and not ``trusted_network`` (the user says every host that reaches it is
    trusted). A secret does not make it safe: torchft's Lighthouse lists the members and kills a node on
    request, and its Manager does too, for anyone who reaches them. With ``trusted_network``, a wildcard is
    bound as ``0.0.0.0`` (or ``::``) and a name that resolves at its first address."""
    decided = job_address(host)
    if decided.job:
        return decided.address
    if trusted_network:
        if decided.address is not None:
            return decided.address
        if host in ("", "*"):
            return "0.0.0.0"
        raise BindRefused(f"{what}: {flag} {host!r} is {decided.why}; give an address of this machine")
    why = ("and this job has no secret: anyone who reaches it can join the job" if not secret else
           "where anyone who reaches it can stop a node (torchft's Lighthouse and Manager ask for no credential; "
           "the job's secret guards who joins, not these ports)")
    raise BindRefused(
        f"{what} would listen on {host or 'every interface'}, a public interface ({decided.why}), {why}. Bind the "
        f"job's network instead: {flag} 127.0.0.1{':' + port if port else ''} (one machine) or this host's VPN "
        "address (e.g. WireGuard's 10.0.0.x, see docs/internet.md); or, if every host that can reach it is trusted, "
        "pass --trusted-network")


def same_host(a: str, b: str) -> bool:
    """Whether two spellings of a host are one address (an IPv4-mapped IPv6 address is its IPv4 one)."""
    def norm(h: str) -> str:
        try:
            ip = ipaddress.ip_address(h.strip("[]").split("%", 1)[0])
        except ValueError:
            return h
        return str(ip.ipv4_mapped or ip) if ip.version == 6 else str(ip)
    return norm(a) == norm(b)


def gloo_interface(host: str) -> str | None:
    """The name of the network interface that holds address ``host`` (gloo binds by interface:
    GLOO_SOCKET_IFNAME), or None (IPv6 addresses are read from Linux's /proc/net/if_inet6)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if ip.is_loopback:
        return "lo"
    if ip.version != 4:
        try:
            lines = open("/proc/net/if_inet6").read().splitlines()  # noqa: SIM115 - a small file, read at once
        except OSError:
            return None
        bare = ipaddress.ip_address(str(ip).split("%", 1)[0])
        for line in lines:
            parts = line.split()
            if len(parts) == 6 and ipaddress.IPv6Address(int(parts[0], 16)) == bare:
                return parts[5]
        return None

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == str(ip):
                return name
    finally:
        s.close()
    return None
