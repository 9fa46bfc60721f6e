"""Per-member keys: each node slot of a job has its own Ed25519 key pair, and the job's roster of public keys is
signed (an HMAC) with the job's secret (docs/internet.md, "Per-member keys").

The job's secret proves that a caller is *a* member; every member holds it, so one member could speak in
another's name, and a call that carries only the secret's tag can be replayed by whoever saw it. A member's own
key proves *which* member calls: its calls (a report of bad messages, the job's end, its claim to a node slot, a
healing source's state) are signed with its private key over what they say, the time and a fresh nonce, and the
verifier checks them with the roster's public key for that slot, refuses a time off by more than
:data:`MAX_SKEW_S`, and refuses a nonce it has seen (:class:`ReplayCache`, bounded).

``lowband secret PATH --nodes N`` writes the secret (``PATH``), the roster (``PATH.roster``) and one private key per
node slot (``PATH.node{i}.key``, mode 0600); node i gets ``--key-file PATH.node{i}.key --roster PATH.roster``, the
Lighthouse ``--roster PATH.roster``.
"""

from __future__ import annotations

import json
import os
import re
import secrets as _secrets
import stat
import threading
import time
from collections import OrderedDict
from pathlib import Path

from lowband.trust.secret import SecretError, load_secret, tag, verify, write_secret

__all__ = ["KEY_FORMAT", "MAX_SKEW_S", "ROSTER_FORMAT", "MemberKey", "ReplayCache", "Roster", "check_member", "key_path",
           "load_key", "load_roster", "mac_call", "roster_path", "sign_call", "signed_bytes", "verify_call", "verify_mac",
           "write_keys"]

ROSTER_FORMAT = "lowband-roster/1"
KEY_FORMAT = "lowband-key/1"
#: How far a signed call's time may be from the verifier's clock (seconds, either way): the nodes' clocks must agree
#: within it (NTP), and a captured call can be replayed within it only once (the nonce is then known).
MAX_SKEW_S = 60.0
#: The most nodes one roster names (a slot is at most 9 digits, but a roster is read whole).
MAX_MEMBERS = 4096
_HEX = re.compile(r"[0-9a-f]+", re.ASCII)


def _ed25519():
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519  # optional dependency (the ft extra)
    except ImportError as e:
        raise ValueError("per-member keys (lowband secret --nodes, --key-file, --roster) need the cryptography "
                         "package: pip install 'lowband[ft]' (or pip install cryptography)") from e
    return ed25519


def roster_path(secret_path: str | os.PathLike) -> Path:
    """Where ``lowband secret PATH --nodes N`` writes the roster: ``PATH.roster``."""
    return Path(f"{secret_path}.roster")


def key_path(secret_path: str | os.PathLike, node: int) -> Path:
    """Where ``lowband secret PATH --nodes N`` writes node slot ``node``'s private key: ``PATH.node{node}.key``."""
    return Path(f"{secret_path}.node{node}.key")


def signed_bytes(*parts: object) -> bytes:
    """What a member signs: each part as text, length-prefixed (no part can pass for another, whatever it holds)."""
    out = bytearray()
    for p in parts:
        b = str(p).encode("utf-8", "surrogatepass")
        out += len(b).to_bytes(4, "big") + b
    return bytes(out)


class MemberKey:
    """A node slot's private key (from ``--key-file``): signs that slot's calls."""

    def __init__(self, node: int, private) -> None:
        self.node = node
        self._private = private

    @property
    def public_hex(self) -> str:
        from cryptography.hazmat.primitives import serialization  # optional dependency (see _ed25519)

        raw = self._private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return raw.hex()

    def sign(self, *parts: object) -> str:
        """The signature (128 hex characters) of ``parts`` (:func:`signed_bytes`)."""
        return self._private.sign(signed_bytes(*parts)).hex()

    def __repr__(self) -> str:  # never the private key
        return f"MemberKey(node={self.node})"


class Roster:
    """The job's members' public keys, by node slot, as signed by the job's secret."""

    def __init__(self, members: dict[int, str]) -> None:
        ed = _ed25519()
        self.members = dict(members)
        self._keys = {slot: ed.Ed25519PublicKey.from_public_bytes(bytes.fromhex(h)) for slot, h in members.items()}

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, slot: object) -> bool:
        return slot in self._keys

    def verify(self, slot: int, signature: str, *parts: object) -> bool:
        """Whether ``signature`` (hex) is slot ``slot``'s signature of ``parts``. Never raises: False for a slot not
        in the roster, or a signature that is not 128 hex characters."""
        key = self._keys.get(slot)
        if key is None or not isinstance(signature, str) or len(signature) != 128 or not _HEX.fullmatch(signature):
            return False
        from cryptography.exceptions import InvalidSignature  # optional dependency (see _ed25519)

        try:
            key.verify(bytes.fromhex(signature), signed_bytes(*parts))
        except InvalidSignature:
            return False
        return True

    def __repr__(self) -> str:
        return f"Roster({sorted(self._keys)})"


def _canonical(members: dict[int, str]) -> str:
    return json.dumps({str(k): v for k, v in sorted(members.items())}, sort_keys=True, separators=(",", ":"))


def _write_new(path: Path, text: str, mode: int) -> None:
    """Write ``text`` to ``path`` through a temporary name in the same folder (nothing half-written under ``path``);
    refuses to replace a file."""
    tmp = path.with_name(f".{path.name}.{_secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.link(tmp, path)  # fails if path exists meanwhile: never replaces a key or a roster
    finally:
        tmp.unlink(missing_ok=True)


def write_keys(secret_path: str | os.PathLike, nodes: int) -> tuple[Path, list[Path]]:
    """Write a key pair per node slot 0..``nodes``-1 and the roster signed by the job's secret at ``secret_path`` (made
    first when it does not exist). Returns (the roster's path, the private keys' paths). Refuses (SecretError)
    before writing anything when a file it would write exists, or ``nodes`` is out of [1, :data:`MAX_MEMBERS`]."""
    if not 1 <= nodes <= MAX_MEMBERS:
        raise SecretError(f"--nodes must be in [1, {MAX_MEMBERS}], got {nodes}")
    ed = _ed25519()
    from cryptography.hazmat.primitives import serialization  # optional dependency (see _ed25519)

    roster, keys = roster_path(secret_path), [key_path(secret_path, i) for i in range(nodes)]
    taken = [str(p) for p in (roster, *keys) if p.exists()]
    if taken:
        raise SecretError(f"{', '.join(taken[:3])}{' ...' if len(taken) > 3 else ''} exist: a job's keys are not "
                          "overwritten (remove them first, or use another PATH)")
    if not Path(secret_path).exists():
        write_secret(secret_path)
    secret = load_secret(secret_path)
    members, private = {}, []
    for i in range(nodes):
        k = ed.Ed25519PrivateKey.generate()
        members[i] = k.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()
        raw = k.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())
        private.append(json.dumps({"format": KEY_FORMAT, "node": i, "private": raw.hex()}) + "\n")
    for p, text in zip(keys, private, strict=True):
        _write_new(p, text, 0o600)
    body = _canonical(members)
    _write_new(roster, json.dumps({"format": ROSTER_FORMAT, "members": json.loads(body),
                                   "tag": tag(secret, "lowband-roster", body)}, indent=1) + "\n", 0o644)
    return roster, keys


def load_roster(path: str | os.PathLike, secret: bytes | None) -> Roster:
    """The roster at ``path``, checked against the job's ``secret`` (its tag). A SecretError that names the problem for
    a missing file, another format, or a roster not signed by this secret (another job's, or altered)."""
    p = Path(path)
    if secret is None:
        raise SecretError(f"--roster {p}: a roster needs the job's secret (--secret-file), which signs it")
    try:
        raw = p.read_text()
    except FileNotFoundError:
        raise SecretError(f"--roster: no such file {p} (`lowband secret SECRET --nodes N` writes SECRET.roster)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SecretError(f"--roster: cannot read {p}: {e}") from None
    try:
        doc = json.loads(raw)
        members = {int(k): v for k, v in doc["members"].items()}
        ok = (doc.get("format") == ROSTER_FORMAT and 1 <= len(members) <= MAX_MEMBERS
              and all(k >= 0 and isinstance(v, str) and len(v) == 64 and _HEX.fullmatch(v) for k, v in members.items()))
        mac = doc.get("tag", "")
    except (ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise SecretError(f"--roster: {p} is not a lowband roster ({ROSTER_FORMAT}: node slot -> Ed25519 public key); "
                          "write one with `lowband secret SECRET --nodes N`")
    if not verify(secret, mac, "lowband-roster", _canonical(members)):
        raise SecretError(f"--roster: {p} is not signed by this job's secret (another job's roster, or it was altered); "
                          "give every node and the Lighthouse the roster written beside the job's secret")
    return Roster(members)


def load_key(path: str | os.PathLike, node: int, roster: Roster) -> MemberKey:
    """Node slot ``node``'s private key at ``path`` (``--key-file``), checked: readable by its owner only, of this slot,
    and the roster's key for it. A SecretError that names the problem and the fix otherwise."""
    p = Path(path)
    try:
        raw = p.read_text()
    except FileNotFoundError:
        raise SecretError(f"--key-file: no such file {p} (`lowband secret SECRET --nodes N` writes "
                          f"SECRET.node{node}.key for node {node})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SecretError(f"--key-file: cannot read {p}: {e}") from None
    if os.name == "posix" and p.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretError(f"--key-file: {p} can be read by other users (mode {oct(p.stat().st_mode & 0o777)}); "
                          f"run `chmod 600 {p}`")
    try:
        doc = json.loads(raw)
        slot, private = int(doc["node"]), bytes.fromhex(doc["private"])
        ok = doc.get("format") == KEY_FORMAT and len(private) == 32
    except (ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise SecretError(f"--key-file: {p} is not a lowband member key ({KEY_FORMAT})")
    if slot != node:
        raise SecretError(f"--key-file: {p} is node {slot}'s key, and this node is --ft-node {node}: give it "
                          f"SECRET.node{node}.key")
    key = MemberKey(slot, _ed25519().Ed25519PrivateKey.from_private_bytes(private))
    if roster.members.get(node) != key.public_hex:
        raise SecretError(f"--key-file: {p} is not the key the roster names for node {node} (another job's key, or "
                          "the roster of another `lowband secret --nodes`)")
    return key


def check_member(node: int, *, key: MemberKey | None, roster: Roster | None, secret: bytes | None) -> None:
    """Refuse (ValueError) a node's keys that do not go together: a roster without a key or the secret, or a key of
    another slot than ``node`` or that the roster does not name."""
    if (roster is None) != (key is None) or (roster is not None and secret is None):
        raise ValueError("--roster and --key-file go together, and need the job's secret (--secret-file)")
    if key is not None and (key.node != node or node not in roster):
        raise ValueError(f"--key-file is node {key.node}'s key and this node is --ft-node {node}; the roster names "
                         f"nodes {sorted(roster.members)[:10]}")


# --------------------------------------------------------------------------- signed calls
class ReplayCache:
    """The nonces of signed calls seen in the last ``2 × window_s`` seconds, at most ``max_entries``. When full, the
    oldest is forgotten and nothing signed at or before its time is taken again (so a forgotten nonce can never be
    replayed): bounded, whoever calls."""

    def __init__(self, *, window_s: float = MAX_SKEW_S, max_entries: int = 1 << 16, clock=time.time) -> None:
        self.window_s, self.max_entries, self._clock = window_s, max_entries, clock
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> its call's time
        self._floor = float("-inf")  # calls signed at or before this time are refused (their nonces were forgotten)
        self._lock = threading.Lock()

    def check(self, t: float, nonce: str) -> str | None:
        """Take a call signed at time ``t`` with ``nonce`` (after its signature was verified): None, or why not (stale,
        from the future, or replayed)."""
        now = self._clock()
        if abs(now - t) > self.window_s:
            return f"stale: signed {now - t:+.0f} s from this host's clock (more than {self.window_s:g} s apart)"
        with self._lock:
            while self._seen and next(iter(self._seen.values())) < now - 2 * self.window_s:
                self._seen.popitem(last=False)
            if nonce in self._seen or t <= self._floor:
                return "replayed: this call was taken before"
            self._seen[nonce] = t
            while len(self._seen) > self.max_entries:
                _, old = self._seen.popitem(last=False)
                self._floor = max(self._floor, old)
        return None

    def __len__(self) -> int:
        return len(self._seen)


def sign_call(key: MemberKey, *parts: object, clock=time.time) -> tuple[str, str, str]:
    """(time, nonce, signature) of a call that says ``parts``, signed by ``key`` now."""
    t, nonce = repr(float(clock())), _secrets.token_hex(16)
    return t, nonce, key.sign(*parts, t, nonce)


def mac_call(secret: bytes, *parts: object, clock=time.time) -> tuple[str, str, str]:
    """(time, nonce, tag) of a call that says ``parts``, made with the job's ``secret`` now: a job without a roster,
    whose members share the secret only (:func:`verify_mac`)."""
    t, nonce = repr(float(clock())), _secrets.token_hex(16)
    return t, nonce, tag(secret, "lowband-call", *parts, t, nonce)


def _time_of(t: object, nonce: object) -> float | None:
    """The time a call says it was made at, or None when its time or nonce is not what :func:`sign_call` writes."""
    if not (isinstance(t, str) and isinstance(nonce, str) and len(t) <= 32 and re.fullmatch(r"[0-9a-f]{32}", nonce)):
        return None
    try:
        when = float(t)
    except ValueError:
        return None
    return None if when != when or when in (float("inf"), float("-inf")) else when


def verify_call(roster: Roster, cache: ReplayCache, slot: int, signature: str, t: str, nonce: str,
                *parts: object) -> str | None:
    """Why a call that says ``parts`` in node slot ``slot``'s name, signed at ``t`` with ``nonce``, is refused; None when
    ``slot``'s key signed it, fresh and never seen. Never raises (every field is a caller's)."""
    if slot not in roster:
        return f"node {slot} has no key in the job's roster"
    when = _time_of(t, nonce)
    if when is None:
        return "the call carries no time and nonce"
    if not roster.verify(slot, signature, *parts, t, nonce):
        return f"forged: not signed by node {slot}'s key"
    return cache.check(when, nonce)


def verify_mac(secret: bytes, cache: ReplayCache, mac: str, t: str, nonce: str, *parts: object) -> str | None:
    """Why a call that says ``parts``, made at ``t`` with ``nonce`` and tagged ``mac`` (:func:`mac_call`), is refused;
    None when the job's secret made it, fresh and never seen. Never raises (every field is a caller's)."""
    when = _time_of(t, nonce)
    if when is None:
        return "the call carries no time and nonce"
    if not verify(secret, mac, "lowband-call", *parts, t, nonce):
        return "forged: not made with the job's secret"
    return cache.check(when, nonce)

