"""A node's torchft Manager behind a gate on the job's network (docs/internet.md): torchft's Manager serves a ``Kill``
that ends the node, and quorum requests and commit votes for any of the node's ranks, to whoever reaches it."""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from http.server import ThreadingHTTPServer

from lowband.ft.gateway import SERVER_OPTIONS, _listen, _timeout, peer_host
from lowband.trust.admission import split_bind

__all__ = ["MANAGER_METHODS", "MANAGER_SERVICE", "GatedManager", "ManagerGate", "listening_on"]

MANAGER_SERVICE = "torchft.ManagerService"
#: What a node's Manager gate serves, and to whom: ``CheckpointMetadata`` (where to fetch a healing source's
#: state) to every host of the job's network, ``Quorum`` and ``ShouldCommit`` (the node's own ranks) only to
#: the node's own addresses. ``Kill`` is not served at all.
MANAGER_METHODS = {"CheckpointMetadata": False, "Quorum": True, "ShouldCommit": True}


class ManagerGate:
    """A node's torchft Manager (its gRPC server) on loopback, behind this gate on the node's address and the
    same port: the address the Manager advertises reaches the gate. torchft's Manager serves a ``Kill`` that
    ends the node to whoever reaches it, and takes quorum requests and commit votes for any of the node's
    ranks from anyone; the gate serves ``Kill`` to no one, and the node's own calls (``Quorum``,
    ``ShouldCommit``) only to the node's own addresses (``own_hosts``). What it cannot tell apart: another
    process on the node's own host."""

    def __init__(self, *, bind: str, backend: str, own_hosts: set[str], workers: int = 16) -> None:
        import grpc  # optional dependency (the ft extra)

        self._grpc = grpc
        self._own = set(own_hosts)
        self._channel = grpc.insecure_channel(backend)
        self.refused: Counter[str] = Counter()
        handlers = {name: grpc.unary_unary_rpc_method_handler(self._handler(name, own))
                    for name, own in MANAGER_METHODS.items()}
        self._server = grpc.server(ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lowband-manager-gate"),
                                   handlers=[grpc.method_handlers_generic_handler(MANAGER_SERVICE, handlers)],
                                   options=SERVER_OPTIONS, maximum_concurrent_rpcs=4 * workers)
        self.port = _listen(self._server, bind, "the Manager's gate")
        self._server.start()

    def _handler(self, name: str, own_only: bool):
        forward = self._channel.unary_unary(f"/{MANAGER_SERVICE}/{name}")

        def handle(request: bytes, context) -> bytes:
            host = peer_host(context.peer())
            if own_only and host not in self._own:
                self.refused[name] += 1
                context.abort(self._grpc.StatusCode.PERMISSION_DENIED,
                              f"lowband: {name} is served to this node's own ranks only, not to {host}")
            try:
                return forward(request, timeout=_timeout(context))
            except self._grpc.RpcError as e:
                context.abort(e.code(), e.details() or "")
        return handle

    def shutdown(self) -> None:
        self._server.stop(grace=None)
        self._channel.close()


class GatedManager:
    """torchft's ManagerServer on loopback with a :class:`~lowband.ft.gateway.ManagerGate` in front, on ``host``."""

    def __init__(self, server, host: str, port: str) -> None:
        self._server = server
        loopback = "::1" if ":" in host else "127.0.0.1"
        try:
            self.gate = ManagerGate(bind=f"{f'[{host}]' if ':' in host else host}:{port}",
                                    backend=f"{f'[{loopback}]' if ':' in host else loopback}:{port}",
                                    own_hosts={host, loopback})
        except BaseException:
            server.shutdown()
            raise

    def address(self) -> str:
        return self._server.address()

    def shutdown(self) -> None:
        self.gate.shutdown()
        self._server.shutdown()


@contextlib.contextmanager
def listening_on(host: str, *, register: Callable[[str], object] | None = None):
    """While torchft's Manager is built: its gRPC and HTTP servers bind ``host`` (torchft 0.2 binds both on ``[::]``);
    ``register`` gets the full replica id torchft gives its Manager server, before that server starts."""
    import torchft.checkpointing.http_transport as http_transport  # optional dependency (the ft extra)
    import torchft.manager as manager  # optional dependency (the ft extra)

    ipv6 = ":" in host
    family = socket.AF_INET6 if ipv6 else socket.AF_INET

    class _Server(ThreadingHTTPServer):
        address_family = family

    def http_server(address, handler):
        return _Server((host, address[1]), handler)

    def manager_server(*, bind: str, **kwargs):
        if register is not None:
            register(kwargs["replica_id"])
        port = split_bind(bind)[1]
        if ipaddress.ip_address(host).is_loopback or not port or port == "0":
            return server_cls(bind=f"{f'[{host}]' if ipv6 else host}:{port}", **kwargs)
        # On the job's network: torchft's Manager on loopback, its gate on the job's address and the same port
        # (the address the Manager advertises), which serves no Kill and the node's own calls to it only.
        return GatedManager(server_cls(bind=f"{'[::1]' if ipv6 else '127.0.0.1'}:{port}", **kwargs), host, port)

    server_cls, http_cls = manager.ManagerServer, http_transport._IPv6HTTPServer
    manager.ManagerServer, http_transport._IPv6HTTPServer = manager_server, http_server
    try:
        yield
    finally:
        manager.ManagerServer, http_transport._IPv6HTTPServer = server_cls, http_cls
