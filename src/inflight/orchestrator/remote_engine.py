"""The pipeline's engine as HTTP replicas (`inflight serve-engine`), in place of the in-process engine loop.

Rollouts call the replicas through the balanced client (least outstanding requests, failover counted);
new weights go through the filesystem transport (safetensors written by atomic rename) and each
replica is told to install them (`/update_weights`), between two of its decode steps. The interface is
the engine loop's: `version`, `generate`, `submit`, `update_weights`, plus async start/close because
the client lives on the pipeline's event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from pathlib import Path

from inflight.inference.client import BalancedClient
from inflight.types import Completion, SampleRequest, WeightUpdate
from inflight.weight_sync.filesystem import FilesystemPublisher, FilesystemSyncConfig, weights_path


class RemoteEngines:
    def __init__(self, urls: list[str], weights_dir: Path, update_timeout_s: float = 600.0) -> None:
        self.urls = urls
        self._publisher = FilesystemPublisher(FilesystemSyncConfig(root=str(weights_dir)))
        self._weights_dir = weights_dir
        self._update_timeout_s = update_timeout_s
        self._client: BalancedClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._version = -1  # installed on every live replica (update_weights answers once it is live)
        self.busy_s = self.idle_s = 0.0  # measured on the replicas, not here

    @property
    def version(self) -> int:
        return self._version

    async def astart(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._client = BalancedClient(self.urls)
        await self._client.start()

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def generate(self, request: SampleRequest, timeout_s: float) -> Completion:
        assert self._client is not None, "RemoteEngines.astart() first"
        return await asyncio.wait_for(
            self._client.generate(request.prompt_token_ids, request.params, request.request_id), timeout_s
        )

    def submit(self, request: SampleRequest) -> concurrent.futures.Future[Completion]:
        """From another thread (the trainer's evaluation)."""
        assert self._loop is not None, "RemoteEngines.astart() first"
        return asyncio.run_coroutine_threadsafe(self.generate(request, self._update_timeout_s), self._loop)

    def update_weights(self, update: WeightUpdate) -> None:
        """From the trainer thread: write the file, then wait until every live replica generates with it."""
        assert self._client is not None and self._loop is not None, "RemoteEngines.astart() first"
        self._publisher.publish(update.state_dict, update.version)
        path = str(weights_path(self._weights_dir, update.version).resolve())
        live = asyncio.run_coroutine_threadsafe(self._client.update_weights(path, update.version), self._loop)
        live.result(timeout=self._update_timeout_s)
        self._version = update.version

    def metrics(self) -> dict[str, float]:
        if self._client is None:
            return {}
        m = self._client.metrics()
        return {f"replicas/{k}": float(v) for k, v in vars(m).items() if isinstance(v, int | float)}
