"""The pipeline's engine as HTTP replicas (`inflight serve-engine`), in place of the in-process engine loop.

Rollouts call the replicas through the balanced client (least outstanding requests, failover counted);
new weights go through the filesystem transport (safetensors written by atomic rename) and each
replica is told to install them (`/update_weights`), between two of its decode steps. A LoRA adapter goes
the same way: a PEFT adapter directory written next to the weights, then `/set_adapter` on each replica.
Without a filesystem the replicas share (`transport="http"`, `pipeline.weight_transport`), the same
updates travel as safetensors bytes in the request bodies (`/update_weights_raw`, `/set_adapter_raw`).
With `transport="torch_dist"` full weights are broadcast over a torch.distributed group of this process
(rank 0) and every replica (`weight_sync/torch_dist.py`: bucketed flat buffers over gloo; the replicas
join on `/weight_broadcast/join` before the first update) and the trainer waits until /health shows the
version live everywhere; adapters go by http. A broadcast that fails (a replica died: the group has a fixed
size) falls back to http for the rest of the run, counted (`replicas/broadcast_fallbacks`); a replica that
comes back gets the last weights by http.
The interface is the engine loop's: `version`, `generate`, `submit`, `update_weights`, plus `set_adapter`
/ `remove_adapter` and async start/close because the client lives on the pipeline's event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import re
import shutil
import socket
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

from inflight.inference.adapter_files import write_adapter_dir
from inflight.inference.client import BalancedClient, EngineClient, NoReplicaAvailableError, weights_bytes
from inflight.types import AdapterUpdate, Completion, SampleRequest, WeightUpdate
from inflight.weight_sync.filesystem import FilesystemPublisher, FilesystemSyncConfig, weights_path
from inflight.weight_sync.torch_dist import TorchDistPublisher, TorchDistSyncConfig, listen

log = logging.getLogger(__name__)
BROADCAST_TIMEOUT_S = 60.0  # joining the broadcast group, and each publish's collectives

T = TypeVar("T")
ADAPTER_VERSIONS_KEPT = 2  # as the weights' keep_last: a replica still reading the previous one finds it
LOOPBACK_HOSTS = {"localhost", "127.0.0.1", "::1"}


Transport = Literal["filesystem", "http", "torch_dist"]


def weight_transport(
    choice: Literal["auto", "filesystem", "http", "torch_dist"], urls: list[str]
) -> Transport:
    """`pipeline.weight_transport` resolved for `urls`: "auto" is the filesystem when every replica is on
    this machine (it reads the files this process writes), else the request bodies."""
    if choice != "auto":
        return choice
    local = all(_is_this_machine(urlsplit(url).hostname or "") for url in urls)
    return "filesystem" if local else "http"


def _is_this_machine(host: str) -> bool:
    """Loopback, or an address of one of this machine's interfaces (binding to it succeeds only then: a
    replica a launcher placed on this node by its IP)."""
    if host in LOOPBACK_HOSTS:
        return True
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.bind((host, 0))
    except OSError:  # not ours, or a name that does not resolve
        return False
    return True


def _address_toward(url: str) -> str:
    """This machine's address as the replica at `url` reaches it: loopback for a replica on loopback, else
    the address of the interface that routes to it."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    if host in LOOPBACK_HOSTS:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((host, parts.port or 80))  # UDP: no packet is sent, the route is chosen
        return str(sock.getsockname()[0])


def adapter_path(root: Path, name: str, version: int) -> Path:
    """Where version `version` of adapter `name` is written: one directory per adapter, whatever characters
    its name holds (the hash keeps two names that sanitise alike apart)."""
    digest = hashlib.sha1(name.encode()).hexdigest()[:10]
    readable = re.sub(r"[^A-Za-z0-9_.-]", "_", name).lstrip(".")[:60]
    return root / "adapters" / f"{readable}-{digest}" / f"v{version:08d}"


class RemoteEngines:
    def __init__(
        self,
        urls: list[str],
        weights_dir: Path,
        update_timeout_s: float = 600.0,
        policy_adapter: str | None = None,
        transport: Transport = "filesystem",
        follows_others: bool = False,
    ) -> None:
        """`policy_adapter`: LoRA RL; every request samples with that adapter, and `version` is its version
        (the policy's), not the base weights'. `transport`: how updates reach the replicas (files in
        `weights_dir` they can read, or the request bodies). `follows_others`: this one only generates
        (a rollout worker's), another publishes; a replica that was away serves it once the other brought
        it up to date (`BalancedClient`)."""
        self.urls = urls
        self.transport = transport
        self.policy_adapter = policy_adapter
        self.follows_others = follows_others
        self._publisher: FilesystemPublisher | None = None  # made on the first file update (it makes the dir)
        self._weights_dir = weights_dir
        self._update_timeout_s = update_timeout_s
        self._client: BalancedClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._version = -1  # installed on every live replica (update_weights answers once it is live)
        self.adapter_versions: dict[str, int] = {}  # served by every live replica
        self.busy_s = self.idle_s = 0.0  # measured on the replicas, not here
        self._broadcaster: TorchDistPublisher | None = None  # transport "torch_dist", once joined
        self.broadcast_updates = self.broadcast_fallbacks = 0

    @property
    def version(self) -> int:
        """The policy version every live replica serves: the base weights', or the policy adapter's."""
        if self.policy_adapter is not None:
            return self.adapter_versions.get(self.policy_adapter, -1)
        return self._version

    async def astart(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._client = BalancedClient(self.urls, follows_others=self.follows_others)
        await self._client.start()

    async def aclose(self) -> None:
        if self._broadcaster is not None:  # tells the replicas to leave the group
            await asyncio.to_thread(self._broadcaster.close)
            self._broadcaster = None
        if self._client is not None:
            await self._client.aclose()

    async def generate(self, request: SampleRequest, timeout_s: float) -> Completion:
        assert self._client is not None, "RemoteEngines.astart() first"
        if self.policy_adapter is not None and request.adapter is None:
            request.adapter = self.policy_adapter
        return await asyncio.wait_for(self._client.generate(request), timeout_s)

    def submit(self, request: SampleRequest) -> concurrent.futures.Future[Completion]:
        """From another thread (the trainer's evaluation)."""
        assert self._loop is not None, "RemoteEngines.astart() first"
        return asyncio.run_coroutine_threadsafe(self.generate(request, self._update_timeout_s), self._loop)

    def update_weights(self, update: WeightUpdate) -> None:
        """From the trainer thread: write the file (or send the bytes), then wait until every live replica
        generates with it."""
        assert self._client is not None, "RemoteEngines.astart() first"
        if self.transport == "torch_dist" and self._broadcast(update):
            self._version = update.version
            return
        if self.transport == "http":
            self._wait(self._client.update_weights_raw(weights_bytes(update.state_dict), update.version))
        else:
            if self._publisher is None:
                self._publisher = FilesystemPublisher(FilesystemSyncConfig(root=str(self._weights_dir)))
            self._publisher.publish(update.state_dict, update.version)
            path = str(weights_path(self._weights_dir, update.version).resolve())
            self._wait(self._client.update_weights(path, update.version))
        self._version = update.version

    def set_adapter(self, update: AdapterUpdate) -> None:
        """From the trainer thread: write the adapter as a PEFT directory, then wait until every live replica
        has it (a replacement reaches the requests running on it between two decode steps)."""
        assert self._client is not None, "RemoteEngines.astart() first"
        if self.transport != "filesystem":  # http, and torch_dist, which broadcasts full weights only
            self._wait(self._client.set_adapter_raw(update))
            self.adapter_versions[update.name] = update.version
            return
        path = adapter_path(self._weights_dir, update.name, update.version)
        write_adapter_dir(path, update)
        self._wait(self._client.set_adapter(update.name, str(path.resolve()), update.version))
        self.adapter_versions[update.name] = update.version
        # Older versions go only now: until every replica answered, one may still be reading them.
        for old in sorted(path.parent.glob("v*"))[:-ADAPTER_VERSIONS_KEPT]:
            shutil.rmtree(old, ignore_errors=True)

    def remove_adapter(self, name: str) -> None:
        """From any thread but the event loop's: later requests naming it are refused on every replica."""
        assert self._client is not None, "RemoteEngines.astart() first"
        self._wait(self._client.remove_adapter(name))
        self.adapter_versions.pop(name, None)

    def metrics(self) -> dict[str, float]:
        if self._client is None:
            return {}
        m = self._client.metrics()
        out = {f"replicas/{k}": float(v) for k, v in vars(m).items() if isinstance(v, int | float)}
        if self.transport == "torch_dist" or self.broadcast_fallbacks:
            out["replicas/broadcast_updates"] = float(self.broadcast_updates)
            out["replicas/broadcast_fallbacks"] = float(self.broadcast_fallbacks)
        return out

    def _broadcast(self, update: WeightUpdate) -> bool:
        """From the trainer thread: the weights over the broadcast group (joined on first use), then wait
        until every replica generates with them. False after a failure, the transport then http."""
        assert self._client is not None
        client = self._client
        cpu = {name: t.detach().cpu() for name, t in update.state_dict.items()}
        try:
            if self._broadcaster is None:
                self._broadcaster = self._join_broadcast()
            self._broadcaster.publish(cpu, update.version)
            self._wait(self._until_live(update.version))
        except (RuntimeError, TimeoutError, NoReplicaAvailableError) as exc:
            log.warning("weight broadcast of version %d failed (%s); weights go by http from now on",
                        update.version, exc)  # fmt: skip
            self.broadcast_fallbacks += 1
            self.transport = "http"
            broadcaster, self._broadcaster = self._broadcaster, None
            if broadcaster is not None:
                broadcaster.close()
            return False

        def install(replica: EngineClient) -> Any:  # for a replica that comes back
            return replica.update_weights_raw(weights_bytes(cpu), update.version)

        client.weights_installed(update.version, install)
        self.broadcast_updates += 1
        return True

    def _join_broadcast(self) -> TorchDistPublisher:
        assert self._client is not None
        host = _address_toward(self.urls[0])
        world_size = len(self.urls) + 1
        store = listen(host, world_size, BROADCAST_TIMEOUT_S)  # on a port the OS assigned
        self._wait(self._client.join_weight_broadcast(host, store.port, BROADCAST_TIMEOUT_S))
        config = TorchDistSyncConfig(
            host=host, port=store.port, world_size=world_size, timeout_s=BROADCAST_TIMEOUT_S
        )
        return TorchDistPublisher(config, store)  # returns once every replica joined

    async def _until_live(self, version: int) -> None:
        assert self._client is not None
        deadline = time.monotonic() + self._update_timeout_s
        while True:
            live = await self._client.versions()
            if all(v is not None and v >= version for v in live.values()):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"weights of version {version} were broadcast but not live on: {live}")
            await asyncio.sleep(0.005)

    def _wait(self, call: Coroutine[Any, Any, T]) -> T:
        assert self._loop is not None, "RemoteEngines.astart() first"
        return asyncio.run_coroutine_threadsafe(call, self._loop).result(timeout=self._update_timeout_s)
