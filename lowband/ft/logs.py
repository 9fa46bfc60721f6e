"""torchft's logs without the members' replica ids.

torchft writes a member's full replica id (lowband's id, with the addresses and the tag that prove the job's secret,
and torchft's per-process ``:uuid``) into every node's log at every step: its Rust side at INFO ("got lighthouse
quorum ...", "Received quorum request for replica ...") and its Python Manager in the prefix of each message. Whoever
reads a log could then ask for quorums in that member's name (docs/internet.md). So before torchft is imported:

- its Rust logger is kept at warnings (``RUST_LOG=warn``; it reads the variable once, when torchft is imported);
- every record of a ``torchft*`` Python logger has each replica id cut to its job and slot (``lowband_FP_nodeN``) in
  its message, and so do the text fields that torchft's quorum, commit and error loggers pass as ``extra``.
"""

from __future__ import annotations

import logging
import os
import re
import sys

__all__ = ["QUIET_RUST_LOG", "quiet_torchft", "redact_ids"]

log = logging.getLogger(__name__)

#: The RUST_LOG torchft runs with: warnings and errors only (its per-step INFO messages name every member).
QUIET_RUST_LOG = "warn"
_QUIET_ENOUGH = {"warn", "error", "off"}
# A lowband replica id (lowband.trust.admission.replica_id), with torchft's ``:uuid`` when it has one.
_ID = re.compile(r"lowband_([0-9A-Za-z]{1,64})_(?:a[0-9a-f]*_t[0-9a-f]{32}_(?:l[0-9]{1,12}_)?)?node([0-9]{1,9})(?::[0-9A-Za-z-]{1,64})?",
                 re.ASCII)
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_installed = False


def redact_ids(text: str) -> str:
    """``text`` with every lowband replica id cut to ``lowband_FP_nodeN`` (no addresses, tag or ``:uuid``) and any
    other UUID (torchft's own ids) replaced by ``<uuid>``."""
    return _UUID.sub("<uuid>", _ID.sub(r"lowband_\1_node\2", text))


def quiet_torchft() -> None:
    """Keep replica ids out of torchft's logs in this process (see the module docstring). Call before torchft is
    imported; idempotent. A RUST_LOG the user set to ``warn``, ``error`` or ``off`` is kept, any other is replaced."""
    global _installed
    if os.environ.get("RUST_LOG", "").strip().lower() not in _QUIET_ENOUGH:
        if "torchft._torchft" in sys.modules:
            log.warning("torchft was imported before lowband quieted its Rust log: its INFO messages (which name "
                        "every member's replica id) are still written in this process")
        os.environ["RUST_LOG"] = QUIET_RUST_LOG
    if _installed:
        return
    _installed = True
    make = logging.getLogRecordFactory()

    def record(*args, **kwargs) -> logging.LogRecord:
        r = make(*args, **kwargs)
        if r.name.startswith("torchft"):
            try:
                r.msg, r.args = redact_ids(r.getMessage()), ()
            except (TypeError, ValueError):  # a message that does not format: left to logging's own error
                pass
        return r

    logging.setLogRecordFactory(record)
    # ``extra`` fields are set on a record after the factory made it: a filter of the loggers that pass ids so.
    for name in EXTRA_LOGGERS:
        logging.getLogger(name).addFilter(_redact_fields)


#: torchft's loggers that pass a replica id as an ``extra`` field (torchft.manager.Manager's).
EXTRA_LOGGERS = ("torchft_quorums", "torchft_commits", "torchft_errors")
_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None)))


def _redact_fields(r: logging.LogRecord) -> bool:
    for k, v in list(vars(r).items()):
        if k not in _RECORD_FIELDS and isinstance(v, str):
            setattr(r, k, redact_ids(v))
    return True
