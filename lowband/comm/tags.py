"""Each message a node gathers or exchanges under fault tolerance with the job's secret carries a tag (an HMAC under a
key drawn from the secret) over its sender's place in the quorum, the quorum and its step, and its bytes.

gloo's traffic is not authenticated: someone who reaches the job's network (or writes into a quorum's TCPStore) can
put a message on the wire in a member's place. A message that fails its checks is counted against its sender, and
the others report a sender of bad messages to the Lighthouse's gate, which removes it: without a tag, a stranger's
garbage in a member's place would have an honest member removed. With it, a message whose tag fails is not the
member's: it is left out of the mean, marked not counted (:data:`lowband.compress.check.NOT_COUNTED`), and counted
against no one. A member's own bad message (its tag holds) is still its own.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

import torch

from lowband.compress.check import NOT_COUNTED

__all__ = ["TAG_BYTES", "MessageTags"]

#: The bytes a tag adds to each message (an HMAC-SHA256, cut to 128 bits).
TAG_BYTES = 16


class MessageTags:
    """Tags of the messages of one job (``secret``: the job's)."""

    def __init__(self, secret: bytes) -> None:
        self._key = hmac.new(secret, b"lowband message tag v1", hashlib.sha256).digest()
        self.forged = 0  # messages whose tag failed: someone else's, in a member's place

    def _tag(self, data: bytes, sender: int, context: int | tuple[int, ...]) -> bytes:
        ctx = (context,) if isinstance(context, int) else tuple(context)
        head = struct.pack(f">{len(ctx) + 1}q", *ctx, sender)
        return hmac.new(self._key, head + data, hashlib.sha256).digest()[:TAG_BYTES]

    def seal(self, tensor: torch.Tensor, *, sender: int, context: int | tuple[int, ...]) -> torch.Tensor:
        """``tensor``'s bytes (uint8, 1-D) followed by its tag as sent by quorum member ``sender`` (``context``: what
        is the same on every member for this message and no other: the quorum's id and its step)."""
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        tag = self._tag(raw.cpu().numpy().tobytes(), sender, context)
        return torch.cat([raw, torch.frombuffer(bytearray(tag), dtype=torch.uint8).to(raw.device)])

    def open(self, sealed: torch.Tensor, *, senders: list[int], context: int | tuple[int, ...],
             like: torch.Tensor) -> tuple[
            torch.Tensor, list[int]]:
        """Rows of sealed messages (``sealed``: (R, n + TAG_BYTES) uint8, row i sent by ``senders[i]``) -> (the
        messages, (R, *like.shape) of ``like``'s dtype; the rows whose tag failed), each failed row replaced by
        zeros marked :data:`NOT_COUNTED` in its last element."""
        host = sealed.cpu().numpy()
        forged = [i for i, s in enumerate(senders)
                  if not hmac.compare_digest(self._tag(host[i, :-TAG_BYTES].tobytes(), s, context),
                                             host[i, -TAG_BYTES:].tobytes())]
        rows = sealed[:, :-TAG_BYTES].contiguous().view(like.dtype).reshape(len(senders), *like.shape)
        for i in forged:
            rows[i].zero_()
            rows[i].reshape(-1)[-1] = NOT_COUNTED
        self.forged += len(forged)
        return rows, forged
