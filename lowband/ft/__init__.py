"""Fault tolerance on torchft: the node side, its quorums, the healing state transfer, the gate and the Lighthouse.

Names are imported when first used: torchft and grpcio are optional (the ``ft`` extra).
"""

from __future__ import annotations

from lowband.util import lazy_exports

_EXPORTS: dict[str, str] = {
    "FaultTolerance": "lowband.ft.node",
    "FaultToleranceConfig": "lowband.ft.node",
    "committed_of": "lowband.ft.node",
    "load_local_state": "lowband.ft.node",
    "local_state": "lowband.ft.node",
    "quorum_step": "lowband.ft.node",
    "require_torchft": "lowband.ft.node",
    "ForeignJob": "lowband.ft.quorum",
    "GATE_POLL_S": "lowband.ft.quorum",
    "NodeSlotTaken": "lowband.ft.quorum",
    "QuorumRecorder": "lowband.ft.quorum",
    "gate_refusal": "lowband.ft.quorum",
    "check_heal": "lowband.ft.node",
    "FORMAT": "lowband.ft.transport",
    "PoisonedState": "lowband.ft.transport",
    "check_values": "lowband.ft.transport",
    "header_limit": "lowband.ft.transport",
    "parse_request": "lowband.ft.transport",
    "StateTransport": "lowband.ft.transport",
    "TransferError": "lowband.ft.transport",
    "decode_header": "lowband.ft.transport",
    "encode_state": "lowband.ft.transport",
    "read_state": "lowband.ft.transport",
    "receive_limit": "lowband.ft.transport",
    "template_of": "lowband.ft.transport",
    "check_peer_state": "lowband.ft.state",
    "load_optimizer_local_state": "lowband.ft.state",
    "local_tensor": "lowband.ft.state",
    "optimizer_local_state": "lowband.ft.state",
    "ACCUSE": "lowband.ft.gateway",
    "ADMIT": "lowband.ft.gateway",
    "COMMITTED_SCALE": "lowband.ft.breaker",
    "GatedManager": "lowband.ft.managergate",
    "HEARTBEAT": "lowband.ft.gateway",
    "KEPT_OUT": "lowband.ft.gateway",
    "LighthouseGateway": "lowband.ft.gateway",
    "ManagerGate": "lowband.ft.managergate",
    "QUORUM": "lowband.ft.gateway",
    "REFUSED": "lowband.ft.gateway",
    "StallBreaker": "lowband.ft.breaker",
    "accusation_request": "lowband.ft.gateway",
    "accuse_at_gate": "lowband.ft.gateway",
    "admission_request": "lowband.ft.gateway",
    "ask_gate": "lowband.ft.gateway",
    "gate_reason": "lowband.ft.gateway",
    "parse_fields": "lowband.ft.gateway",
    "peer_host": "lowband.ft.gateway",
    "quorum_round": "lowband.ft.breaker",
    "refusal": "lowband.ft.gateway",
    "string_field": "lowband.ft.gateway",
    "GatedLighthouse": "lowband.ft.lighthouse",
    "CompletionRecord": "lowband.ft.completion",
    "DONE": "lowband.ft.completion",
    "JobComplete": "lowband.ft.completion",
    "report_done": "lowband.ft.completion",
    "start_lighthouse": "lowband.ft.lighthouse",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
