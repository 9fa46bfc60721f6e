"""The job secret: what every node of one job holds and no outsider does.

A secret is read from a file (``--secret-file PATH``) or from the environment (``LOWBAND_SECRET``:
the secret itself, or ``LOWBAND_SECRET_FILE``: a file that holds it), never from the command line,
so that it never shows in ``ps``, a log, a config.toml, a results.json or an error. ``lowband secret
PATH`` writes a new one (32 random bytes, hex, mode 0600).

Nodes prove they hold it without sending it: :func:`tag` is an HMAC-SHA256 of what a node claims
(job, node slot, address...) under the secret, and :func:`verify` checks one in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

ENV_SECRET = "LOWBAND_SECRET"
ENV_SECRET_FILE = "LOWBAND_SECRET_FILE"
MIN_BYTES = 16  # a secret shorter than this is refused: it could be guessed


class SecretError(ValueError):
    """A secret that cannot be read or is too weak to protect a job."""


def new_secret() -> str:
    """A fresh secret: 32 random bytes as 64 hex characters."""
    return secrets.token_hex(32)


def write_secret(path: str | os.PathLike) -> Path:
    """Write a fresh secret to ``path`` (readable by its owner only); refuses to overwrite a file."""
    p = Path(path)
    if p.exists():
        raise SecretError(f"{p} exists: a job's secret is not overwritten (remove it first, or use another path)")
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(new_secret() + "\n")
    return p


def _from_file(path: str | os.PathLike, source: str) -> bytes:
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise SecretError(f"{source}: no such file {p} (make one with `lowband secret {p}`)") from None
    except OSError as e:
        raise SecretError(f"{source}: cannot read {p}: {e.strerror}") from None
    if os.name == "posix" and p.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretError(f"{source}: {p} can be read by other users (mode {oct(p.stat().st_mode & 0o777)}); "
                          f"run `chmod 600 {p}`")
    return raw.strip()


def load_secret(path: str | os.PathLike | None = None, *, environ: dict[str, str] | None = None) -> bytes | None:
    """The job's secret, or None when none is given.

    ``path`` (the ``--secret-file`` option) comes first, then ``LOWBAND_SECRET_FILE``, then
    ``LOWBAND_SECRET``. The error never contains the secret.
    """
    env = os.environ if environ is None else environ
    if path is not None:
        value, source = _from_file(path, "--secret-file"), "--secret-file"
    elif env.get(ENV_SECRET_FILE):
        value, source = _from_file(env[ENV_SECRET_FILE], ENV_SECRET_FILE), ENV_SECRET_FILE
    elif env.get(ENV_SECRET):
        value, source = env[ENV_SECRET].strip().encode(), ENV_SECRET
    else:
        return None
    if len(value) < MIN_BYTES:
        raise SecretError(f"{source}: the secret is {len(value)} bytes, fewer than {MIN_BYTES}; make a strong one "
                          "with `lowband secret PATH` (32 random bytes)")
    return value


def tag(secret: bytes, *claims: object) -> str:
    """HMAC-SHA256 (hex, 32 characters) of ``claims`` under ``secret``: proves the secret, bound to the claims."""
    msg = "\x1f".join(str(c) for c in claims).encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()[:32]


def verify(secret: bytes, mac: str, *claims: object) -> bool:
    """Whether ``mac`` is :func:`tag` of ``claims`` under ``secret`` (constant-time comparison). Anything else than
    the tag (another type, non-ASCII text: what a stranger sends) is False, never an error."""
    given = mac if isinstance(mac, bytes) else str(mac).encode("utf-8", "surrogatepass")
    return hmac.compare_digest(tag(secret, *claims).encode("ascii"), given)
