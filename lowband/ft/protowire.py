"""Protobuf's wire format, read and written by hand with bounds: what the Lighthouse's gate reads of a request
(:mod:`lowband.ft.gateway`) without deserialising it into objects."""

from __future__ import annotations

from lowband.trust.keys import MemberKey, mac_call, sign_call

__all__ = ["MAX_FIELDS", "RESPONSE_FIELDS", "SIGNED_FIELDS", "call_gate", "encode_varint", "parse_fields", "sign_request",
           "signed_parts", "string_field", "string_of"]

#: The most fields :func:`parse_fields` reads in one message of a request (a QuorumMember has 8), and in the
#: Lighthouse's own answer to a quorum request (one field per member).
MAX_FIELDS, RESPONSE_FIELDS = 64, 1 << 16


def _varint(buf, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError("truncated or overlong varint")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7


def parse_fields(buf: bytes | memoryview, *, max_fields: int = MAX_FIELDS) -> dict[int, list[bytes | int]]:
    """The top-level fields of a protobuf message: field number -> values (bytes for length-delimited
    fields, ints for varints and fixed-width ones). A ValueError for anything malformed, and for more than
    ``max_fields`` fields (so that the work is bounded by the count, not by what the sender chose)."""
    view = memoryview(buf)
    fields: dict[int, list[bytes | int]] = {}
    i = count = 0
    while i < len(view):
        count += 1
        if count > max_fields:
            raise ValueError(f"more than {max_fields} fields")
        key, i = _varint(view, i)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise ValueError("field number 0")
        if wire == 0:
            value, i = _varint(view, i)
        elif wire == 2:
            n, i = _varint(view, i)
            if n > len(view) - i:
                raise ValueError("a length-delimited field runs past the end")
            value, i = bytes(view[i:i + n]), i + n
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            if i + width > len(view):
                raise ValueError("a fixed-width field runs past the end")
            value, i = int.from_bytes(view[i:i + width], "little"), i + width
        else:
            raise ValueError(f"wire type {wire} is not read here")
        fields.setdefault(number, []).append(value)
    return fields


def string_of(fields: dict[int, list[bytes | int]], number: int) -> str:
    """The last value of string field ``number`` in ``fields`` (empty when absent); a ValueError when it is no string."""
    values = fields.get(number) or [b""]
    value = values[-1]
    if not isinstance(value, bytes):
        raise ValueError(f"field {number} is not a string")
    return value.decode("utf-8")


def encode_varint(n: int) -> bytes:
    """``n`` (>= 0) as a protobuf varint."""
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def string_field(number: int, value: bytes) -> bytes:
    """A length-delimited protobuf field: its key (``number``, wire type 2), its length, then ``value``."""
    return encode_varint(number << 3 | 2) + encode_varint(len(value)) + value


#: The fields of a call signed by its member (:func:`sign_request`): its time, nonce and Ed25519 signature.
SIGNED_FIELDS = (4, 5, 6)


def signed_parts(request: bytes) -> tuple[str, tuple[str, ...], tuple[str, str, str]]:
    """(the caller's replica id, what a signature of ``request`` covers, (time, nonce, signature)) of one of the gate's
    own calls (``Admit``, ``Accuse``, ``Done`` of :mod:`lowband.ft.gateway`): the requester's replica id, Manager and store addresses
    (field 1), fields 2 and 3 (the report), and the fields of :data:`SIGNED_FIELDS` ("" where absent). A ValueError
    or UnicodeDecodeError when malformed."""
    fields = parse_fields(request)
    member = (fields.get(1) or [b""])[-1]
    if not isinstance(member, bytes):
        raise ValueError("the request names no requester")
    m = parse_fields(member)
    rid = string_of(m, 1)
    parts = (rid, string_of(m, 2), string_of(m, 3), string_of(fields, 2), string_of(fields, 3))
    t, nonce, sig = (string_of(fields, n) for n in SIGNED_FIELDS)
    return rid, parts, (t, nonce, sig)


def sign_request(key: MemberKey | None, method: str, request: bytes, *, secret: bytes | None = None) -> bytes:
    """``request`` (a gate's own call ``method``) with the member's signature appended (:data:`SIGNED_FIELDS`): over
    the method, what :func:`signed_parts` reads of it, the time and a fresh nonce. Without ``key``, with the job's
    ``secret`` (a job without a roster): the same fields hold an HMAC under the secret. Unchanged without either."""
    if key is None and secret is None:
        return request
    _, parts, _ = signed_parts(request)
    t, nonce, sig = sign_call(key, method, *parts) if key is not None else mac_call(secret, method, *parts)
    return request + b"".join(string_field(n, v.encode()) for n, v in zip(SIGNED_FIELDS, (t, nonce, sig), strict=True))


def call_gate(lighthouse: str, method: str, request: bytes, *, timeout_s: float = 10.0) -> str | None:
    """One of the gate's own calls (``method``, answered by the gate, never forwarded) to the gate at ``lighthouse``
    (``http://HOST:PORT``): None when it was accepted, else ``"CODE: details"`` (refused; unreachable; or torchft's
    own Lighthouse, which has no such call)."""
    import grpc  # optional dependency (the ft extra)

    with grpc.insecure_channel(lighthouse.split("://", 1)[-1].rstrip("/")) as channel:
        try:
            channel.unary_unary(method)(request, timeout=timeout_s)
        except grpc.RpcError as e:
            return f"{e.code().name}: {e.details() or ''}"
    return None
