"""The connection to a Ray cluster: `ray.address` checked (HOST:PORT, a Ray head there, one that takes this
process's token) and joined, or a local Ray started, every wait bounded and the caller's signal handlers
kept. Knows nothing of what is placed on the cluster."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from inflight.config import RayConfig
from inflight.errors import UserError, describe

RAY_MISSING = "launcher=ray needs Ray: pip install 'inflight[ray]'"


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise UserError(RAY_MISSING) from None
    return ray


def ray_connection(cfg: RayConfig, key: str) -> contextlib.AbstractContextManager[None]:
    """`connected` for a caller that connects before it places anything (`inflight serve --launcher ray`,
    before its app starts); `key` names the address as the user gave it (--ray-address)."""
    return connected(import_ray(), cfg, key)


@contextmanager
def connected(ray: Any, cfg: RayConfig, key: str = "ray.address") -> Iterator[None]:
    """Ray as ray.address says, for the run. A Ray this process had already started (a test's, a notebook's,
    `ray_connection`'s) is used as it is and left running; one started here is shut down after the run.
    Every wait is bounded: an address is first asked whether it is a Ray head that takes this process's
    token (`_check_head`, within ray.connect_timeout_s), as ray.init's own retries are long or endless."""
    if ray.is_initialized():
        yield
        return
    address = cfg.address
    if address not in (None, "auto"):
        check_address(address, key)
        _check_head(address, cfg.connect_timeout_s, key)
    auth_error = getattr(ray.exceptions, "AuthenticationError", ())  # Ray >= 2.52
    try:
        # Unset: a new local cluster for this run ("local": never one that `ray start` left running here),
        # with this machine's CPUs and no dashboard.
        with _signal_handlers_kept():
            if address is None:
                ray.init(address="local", include_dashboard=False, log_to_driver=True)
            else:
                ray.init(address=address, log_to_driver=True)
    except ConnectionError as e:
        raise UserError(
            f"{key}={address}: no Ray cluster found ({describe(e)}); start one with "
            f"`ray start --head`, or leave {key} unset for a local Ray"
        ) from None
    except auth_error:  # RAY_AUTH_MODE=token, and no token to send
        raise UserError(f"{key}={address}: {_token()[1]}") from None
    try:
        yield
    finally:
        ray.shutdown()


@contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """The SIGINT and SIGTERM handlers of before, again after the block (ray.init's). ray.init installs its
    own SIGTERM handler, an exit with status 1, and under it Ray's C++ failure handler, which aborts: the
    caller's own (`stop_on_signals`' graceful stop, uvicorn's drain, or the default) must stay in force.
    The Ray processes a local ray.init starts die with this one anyway (Ray ties them to it), and
    `connected` shuts them down on its way out."""
    if threading.current_thread() is not threading.main_thread():  # Python's rule: no handlers to set
        yield
        return
    kept = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in kept.items():
            if handler is not None:  # None: a handler not set from Python, which Python cannot set again
                signal.signal(signum, handler)


def check_address(address: str, key: str) -> None:
    """One line when `address` (ray.address, or --ray-address as `key` says) is not HOST:PORT, "auto", or a
    Ray Client URL (ray://HOST:PORT, which Ray reaches through the head's client server)."""
    scheme, sep, rest = address.partition("://")
    if sep and scheme != "ray":
        raise UserError(
            f"{key}={address}: expected HOST:PORT (the head's GCS port, e.g. 10.0.0.5:6379) or auto, not a "
            "URL (the one URL Ray takes is ray://HOST:PORT, its client server's)"
        )
    host, sep, port = (rest if sep else address).rpartition(":")
    if address != "auto" and (not host or not sep or not port.isdigit()):
        raise UserError(
            f"{key}={address}: expected HOST:PORT (the head's GCS port, e.g. 10.0.0.5:6379), auto (the "
            f"cluster this machine joined with `ray start`), or {key} unset for a local Ray"
        )


def _check_head(address: str, timeout_s: float, key: str) -> None:
    """A bounded TCP connect to HOST:PORT, then (but for a ray:// URL) one gRPC call to the GCS there,
    GetClusterId, Ray's own first question, with this process's token: whether a Ray head answers, and takes
    the token. ray.init itself retries for ~20 s at a step, a line of log a try, and on a port that speaks
    something else (an HTTP server, say) never gives up."""
    client = address.startswith("ray://")
    host, _, port = address.removeprefix("ray://").rpartition(":")
    deadline = time.monotonic() + timeout_s
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise UserError(
            f"{key}={address}: nothing answers there within {timeout_s:g} s ({describe(e)}); start the "
            f"cluster with `ray start --head`, or leave {key} unset for a local Ray"
        ) from None
    if client:
        return
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    messages: Any = gcs_service_pb2  # generated code, which the type checker does not see into
    metadata, unauthenticated = _token()
    with grpc.insecure_channel(address) as channel:
        ask = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId
        try:
            left_s = max(deadline - time.monotonic(), 0.1)
            ask(messages.GetClusterIdRequest(), timeout=left_s, metadata=metadata)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise UserError(f"{key}={address}: {unauthenticated}") from None
            raise UserError(
                f"{key}={address}: something answers there, but not as a Ray head within {timeout_s:g} s "
                f"({e.code().name}: {e.details()}); name the port of the head's GCS, the one `ray start "
                "--head --port=PORT` opened (6379 by default)"
            ) from None


def _token() -> tuple[tuple[tuple[str, str], ...], str]:
    """The gRPC metadata carrying this process's Ray token (none unless RAY_AUTH_MODE=token and a token is
    found, as for Ray's own calls), and what to say when a cluster wants another."""
    how = (
        "the head's token (`ray get-auth-token` there prints it) in RAY_AUTH_TOKEN, in the file "
        "RAY_AUTH_TOKEN_PATH names, or in ~/.ray/auth_token (docs/laptop-to-cluster.md)"
    )
    import ray._raylet

    raylet: Any = ray._raylet  # its stubs predate token authentication
    if not hasattr(raylet, "AuthenticationTokenLoader"):  # a Ray before token authentication (2.52)
        return (), f"the cluster wants a token this Ray ({ray.__version__}) cannot send: install ray>=2.52"
    loader = raylet.AuthenticationTokenLoader.instance()
    if raylet.get_authentication_mode() != raylet.AuthenticationMode.TOKEN:
        return (), (
            "the cluster wants a token (Ray's token authentication, which `ray start --head` turns on) and "
            f"this process sends none: set RAY_AUTH_MODE=token, with {how}"
        )
    try:
        found = loader.has_token()
    except Exception as e:  # none, or RAY_AUTH_TOKEN_PATH names a file it cannot read: Ray's first sentence
        why = str(getattr(e, "message", e)).split(". ")[0]
        return (), f"RAY_AUTH_MODE=token, but no token was found ({why}): give {how}"
    if not found:
        return (), f"RAY_AUTH_MODE=token, but no token was found: give {how}"
    metadata = tuple(loader.get_token_for_http_header().items())
    return metadata, f"the cluster refused this process's token (RAY_AUTH_MODE=token): give {how}"
