"""`VllmEngine`: the Engine protocol (`engine.py`) on vLLM's `LLMEngine`, stepped like the built-in engine so
`engine_loop.EngineLoop` and `server.py` drive it unchanged. Owns the translation between inflight's
requests, adapters and weight updates and vLLM's; `import vllm` happens only here, only when this backend is
chosen (`inflight serve-engine --backend vllm`, run in the environment `launch/vllm_env.py` builds).

How the contract maps onto vLLM (held by tests/test_engine_contract.py's "http-vllm" backend):
- Token-in/token-out: `TokensPrompt`, `ignore_eos` (inflight stops only where asked), one token per running
  request per `step()`, so each token is stamped with the base version installed at that step.
- Logprobs: vLLM computes them in one engine-wide `logprobs_mode`, chosen by `logprobs_kind`: "sampled"
  (the pipeline's; vLLM's "processed_logprobs", log_softmax after temperature and top-k/top-p masking) or
  "raw" (the Tinker service's; "raw_logprobs"). The two kinds agree at temperature 0 or 1 without
  truncation; a request for the other kind under any other sampling is refused (ValueError), since vLLM
  cannot report both from one engine.
- Prompt logprobs: vLLM's `prompt_logprobs=k` (log_softmax of the unprocessed logits); the k most likely are
  those of rank <= k. Top-k logprobs of generated tokens: vLLM's `logprobs=k` (in its logprobs_mode, so the
  "sampled" kind, as the token's own). Target prompt ids and alternative draws at prompt positions have no
  vLLM counterpart and are refused (ValueError).
- Adapters: a name keeps one `LoRARequest` id (and one PEFT directory) from `set_adapter` to
  `remove_adapter`. A replacement is staged in the caller's thread and installed between two steps by
  moving its files into that directory and reloading the id in place (vLLM's `load_inplace`), so requests
  already running on it continue on the new weights from that step, their tokens stamped with the new
  version (the contract). A removed adapter stays loaded until its last running request finishes.
- vLLM's CPU LoRA kernels index the stacked adapter weights with a row's slot, and a row without an adapter
  has slot -1, i.e. the last slot: once that slot holds an adapter, base rows batched with adapter rows are
  computed with it. On the CPU platform, base rows therefore run on an all-zero adapter of their own (one
  extra slot) from the first `set_adapter` on; its contribution is exactly zero.
- Full weights: written as safetensors and installed between two steps with `collective_rpc
  ("reload_weights")`; running requests keep their KV cache (the built-in engine's "keep" policy). Models
  with tied embeddings are refused, since vLLM's reload leaves them wrong.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from inflight.errors import UserError
from inflight.inference.adapter_files import write_adapter_dir
from inflight.inference.adapters import ModuleShapes, parse_adapter
from inflight.inference.builtin import EngineMetrics, UpdateRecord
from inflight.inference.scratch import ScratchDirectory
from inflight.models.lora_adapter import peft_key
from inflight.types import AdapterUpdate, Completion, FinishReason, SampleRequest, WeightUpdate

_ZERO_LORA = "inflight-base-rows"  # see VllmEngine's docstring
# The linear layers vLLM's LoRA can adapt in the models inflight serves (Qwen2/Llama layouts).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class VllmEngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_batch_size: int = Field(default=64, ge=1)  # vLLM's max_num_seqs
    max_seq_len_tokens: int = Field(default=1024, ge=2)  # vLLM's max_model_len: prompt + completion
    dtype: Literal["float32", "bfloat16"] = "float32"
    max_loras: int = Field(default=4, ge=0)  # adapters in one batch; 0 turns LoRA off
    max_lora_rank: int = Field(default=16, ge=1)
    max_prompt_logprobs: int = Field(default=20, ge=0)  # vLLM's max_logprobs
    # The one kind of logprobs this engine reports under any sampling (see the module docstring).
    logprobs_kind: Literal["sampled", "raw"] = "sampled"
    # Weight updates and adapters are written here for vLLM to read, in a fresh directory of this process's
    # (`ScratchDirectory`); default: in /dev/shm (memory) where it exists.
    scratch_dir: str | None = None


@dataclass
class _Adapter:
    lora: Any  # vllm.lora.request.LoRARequest, one id for the name's lifetime
    path: Path  # its PEFT directory; a replacement's files are moved in here
    version: int  # as installed (a staged replacement counts once step() installed it)


@dataclass
class _Running:
    request: SampleRequest
    lora_id: int | None  # None: base weights, stamped per step with the engine's version
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    topk_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # [T] when asked


@dataclass
class _Counters:
    tokens_generated: int = 0
    busy_s: float = 0.0
    updates_received: int = 0
    updates_applied: int = 0
    updates_superseded: int = 0
    update_pause_s_total: float = 0.0
    update_pause_s_max: float = 0.0
    update_copy_s_total: float = 0.0
    prefill_failures: int = 0
    adapter_updates_received: int = 0
    adapter_updates_applied: int = 0


class VllmEngine:
    """vLLM's LLMEngine, in this process (no engine-core subprocess: `step()` runs one schedule -> execute
    -> update cycle here), behind the SteppedEngine protocol. `add_request`, `abort`, `update_weights`,
    `set_adapter` and `remove_adapter` are thread-safe and queue work; only `step()` touches vLLM."""

    def __init__(self, model_dir: str, config: VllmEngineConfig | None = None) -> None:
        self.config = config or VllmEngineConfig()
        self._model_dir = Path(model_dir)
        hf_config = json.loads((self._model_dir / "config.json").read_text())
        # transformers' default is True; Qwen2 configs say False explicitly when untied.
        self._tied = bool(hf_config.get("tie_word_embeddings", True))
        self._param_shapes = _checkpoint_shapes(self._model_dir)
        self._scratch_dir = ScratchDirectory(self.config.scratch_dir)
        self._scratch = self._scratch_dir.path
        try:
            self._engine = self._start_vllm()
        except BaseException:
            self._scratch_dir.close()
            raise
        self._lora_targets = LORA_TARGETS + (("lm_head",) if self._adapts_lm_head() else ())
        self._lora_shapes: ModuleShapes = {
            name.removesuffix(".weight"): (shape[1], shape[0])
            for name, shape in self._param_shapes.items()
            if name.endswith(".weight") and len(shape) == 2 and name.split(".")[-2] in self._lora_targets
        }
        if "lm_head" in self._lora_targets and "lm_head" not in self._lora_shapes:  # tied: the embedding's
            vocab, hidden = self._param_shapes["model.embed_tokens.weight"]
            self._lora_shapes["lm_head"] = (hidden, vocab)

        self._lock = threading.Lock()  # guards everything below; never held while vLLM runs
        self._version = 0
        self._pending: tuple[int, Path, float] | None = None  # version, checkpoint dir, copy_s
        self._waiting: deque[tuple[SampleRequest, Any]] = deque()  # request, vLLM SamplingParams
        self._aborts: set[str] = set()
        self._running: dict[str, _Running] = {}
        self._in_flight: set[str] = set()
        self._adapters: dict[str, _Adapter] = {}  # registered names
        self._lora_versions: dict[int, int] = {}  # LoRA id -> installed version (removed ones until unloaded)
        self._staged: dict[str, tuple[int, Path, int]] = {}  # name -> (LoRA id, staged dir, version)
        self._retired: dict[int, Path] = {}  # removed ids -> directory, unloaded once no request runs on them
        self._next_lora_id = 1
        self._zero_lora: Any = None  # the all-zero adapter of base rows (CPU platform, see the docstring)
        self._counters = _Counters()
        self._recent: deque[UpdateRecord] = deque(maxlen=16)

    def _start_vllm(self) -> Any:
        # In-process engine core: step() is then synchronous, and collective_rpc reaches the worker here.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU default is sized for servers
        try:
            from vllm import EngineArgs, LLMEngine
        except ImportError as exc:
            raise UserError(
                f"--backend vllm needs vLLM, which this environment lacks ({exc}): build the environment "
                "that has it with `python -m inflight.launch.vllm_env` and run serve-engine with the python "
                "it prints"
            ) from None

        c = self.config
        from vllm.platforms import current_platform

        # Base rows run on an all-zero adapter where vLLM's LoRA kernels misread slot -1 (the docstring).
        self._zero_base_rows = bool(current_platform.is_cpu())
        args = EngineArgs(
            model=str(self._model_dir),
            dtype=c.dtype,
            max_model_len=c.max_seq_len_tokens,
            max_num_seqs=c.max_batch_size,
            max_num_batched_tokens=max(c.max_seq_len_tokens, 2048),
            # Whole prompts only: a prompt split across steps samples a token that vLLM discards and then
            # rewinds the request's seeded generator (`set_offset`), which a CPU generator cannot do
            # ("CPU Generator does not use offset": a step with more prompt tokens than the budget and a
            # seeded request failed the engine). One prompt always fits: the budget >= max_model_len.
            enable_chunked_prefill=False,
            enforce_eager=True,
            # A cached prefix computed under older weights would outlive a weight update.
            enable_prefix_caching=False,
            async_scheduling=False,  # tokens must come back from the step that produced them
            logprobs_mode="processed_logprobs" if c.logprobs_kind == "sampled" else "raw_logprobs",
            max_logprobs=c.max_prompt_logprobs,
            enable_lora=c.max_loras > 0,
            max_loras=max(c.max_loras, 1) + (1 if self._zero_base_rows else 0),  # + the zero adapter
            max_lora_rank=c.max_lora_rank,
            seed=0,
        )
        return LLMEngine.from_engine_args(args)

    def _adapts_lm_head(self) -> bool:
        """Whether vLLM's LoRA can adapt this model's LM head: its model class lists lm_head among its
        embedding modules (Llama, Qwen3, Mistral do; Qwen2 does not)."""
        from vllm.model_executor.models import ModelRegistry

        model_config = self._engine.model_config
        cls, _ = ModelRegistry.resolve_model_cls(model_config.architectures, model_config=model_config)
        return "lm_head" in (getattr(cls, "embedding_modules", None) or {})

    def lora_modules(self) -> list[str]:
        return list(self._lora_targets)

    # -- the Engine protocol -------------------------------------------------------------------------
    @property
    def version(self) -> int:
        with self._lock:
            return self._version

    def adapters(self) -> dict[str, int]:
        with self._lock:
            return {
                name: self._staged[name][2] if name in self._staged else adapter.version
                for name, adapter in self._adapters.items()
            }

    def generate(self, requests: Sequence[SampleRequest]) -> list[Completion]:
        for request in requests:  # all checked before any runs
            self._check(request)
        for request in requests:
            self.add_request(request)
        done: dict[str, Completion] = {}
        while len(done) < len(requests):
            done.update((c.request_id, c) for c in self.step())
        return [done[r.request_id] for r in requests]

    def add_request(self, request: SampleRequest) -> None:
        self._check(request)
        params = self._sampling_params(request)
        with self._lock:
            if request.request_id in self._in_flight:
                raise ValueError(f"request_id {request.request_id!r} is already in flight")
            self._lookup_adapter(request.adapter)  # resolved again at admission: it may be removed
            self._in_flight.add(request.request_id)
            self._waiting.append((request, params))

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(request_id)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._waiting or self._running)

    def has_pending_update(self) -> bool:
        with self._lock:
            return self._pending is not None

    def update_weights(self, update: WeightUpdate) -> None:
        """Check and write the weights now (caller's thread); step() installs them before its next decode."""
        if self._tied:
            raise ValueError(
                "this model ties its input and output embeddings (tie_word_embeddings); vLLM's in-place "
                "reload leaves such models wrong, so the vLLM backend refuses weight updates for them: "
                "serve an untied model, or use the built-in engine"
            )
        shapes = {name: tuple(t.shape) for name, t in update.state_dict.items()}
        missing = sorted(set(self._param_shapes) - set(shapes))
        unknown = sorted(set(shapes) - set(self._param_shapes))
        wrong = sorted(n for n in set(shapes) & set(self._param_shapes) if shapes[n] != self._param_shapes[n])
        if missing or unknown or wrong:
            raise ValueError(
                f"weight update {update.version}: the vLLM backend installs whole checkpoints; missing "
                f"{missing[:5]}, unknown {unknown[:5]}, wrong shape {wrong[:5]}"
            )
        from safetensors.torch import save_file

        start = time.perf_counter()
        target = Path(tempfile.mkdtemp(prefix=f"weights-v{update.version}-", dir=self._scratch))
        tensors = {k: t.detach().to("cpu").contiguous() for k, t in update.state_dict.items()}
        save_file(tensors, str(target / "model.safetensors"))
        copy_s = time.perf_counter() - start
        with self._lock:
            self._counters.updates_received += 1
            self._counters.update_copy_s_total += copy_s
            if self._pending is not None:  # latest call wins
                self._counters.updates_superseded += 1
                shutil.rmtree(self._pending[1], ignore_errors=True)
            self._pending = (update.version, target, copy_s)

    def set_adapter(self, update: AdapterUpdate) -> None:
        """Register `update.name`, or stage a replacement that step() installs in place before its next
        decode (requests running on the adapter continue on the new weights). Checked and written in the
        caller's thread."""
        if self.config.max_loras == 0:
            raise ValueError("this vLLM engine was started with max_loras=0: LoRA adapters are off")
        if update.rank > self.config.max_lora_rank:
            raise ValueError(
                f"adapter {update.name!r}: rank {update.rank} exceeds this engine's max_lora_rank="
                f"{self.config.max_lora_rank}"
            )
        parse_adapter(update, self._lora_shapes)  # ValueError naming the module at fault
        from vllm.lora.request import LoRARequest

        if self._zero_base_rows:
            self._ensure_zero_lora()
        with self._lock:
            current = self._adapters.get(update.name)
            lora_id = current.lora.lora_int_id if current is not None else self._new_lora_id()
        if current is None:  # a new name: nothing reads its directory before it is registered
            path = self._scratch / "adapters" / f"{update.name}-{lora_id}"
            write_adapter_dir(path, update)
            with self._lock:
                self._counters.adapter_updates_received += 1
                self._adapters[update.name] = _Adapter(
                    LoRARequest(_lora_name(update.name, lora_id), lora_id, str(path)), path, update.version
                )
                self._lora_versions[lora_id] = update.version
            return
        staged = Path(tempfile.mkdtemp(prefix=f"adapter-{lora_id}-v{update.version}-", dir=self._scratch))
        write_adapter_dir(staged / "adapter", update)
        with self._lock:
            self._counters.adapter_updates_received += 1
            registered = self._adapters.get(update.name)
            if registered is None or registered.lora.lora_int_id != lora_id:  # removed meanwhile
                shutil.rmtree(staged, ignore_errors=True)
                raise ValueError(f"adapter {update.name!r} was removed while its replacement was written")
            previous = self._staged.pop(update.name, None)  # latest call wins
            self._staged[update.name] = (lora_id, staged, update.version)
        if previous is not None:
            shutil.rmtree(previous[1], ignore_errors=True)

    def remove_adapter(self, name: str) -> None:
        with self._lock:
            adapter = self._adapters.pop(name, None)
            if adapter is None:
                raise ValueError(
                    f"remove_adapter: no adapter named {name!r} (registered: {sorted(self._adapters)})"
                )
            staged = self._staged.pop(name, None)
            self._retired[adapter.lora.lora_int_id] = adapter.path
        if staged is not None:
            shutil.rmtree(staged[1], ignore_errors=True)

    def step(self) -> list[Completion]:
        """Install a pending update, admit and abort queued requests, then one vLLM step."""
        start = time.perf_counter()
        finished = self._install_pending()
        self._install_adapters()
        with self._lock:
            waiting, self._waiting = list(self._waiting), deque()
            aborts, self._aborts = self._aborts, set()
        finished += self._admit(waiting)
        finished += self._abort(aborts)
        if self._engine.has_unfinished_requests():
            finished += self._collect(self._engine.step())
        self._unload_retired()
        with self._lock:
            self._counters.busy_s += time.perf_counter() - start
        return finished

    def metrics(self) -> EngineMetrics:
        with self._lock:
            c = self._counters
            return EngineMetrics(
                version=self._version,
                kv_policy="keep",
                runner="vllm",
                num_running=len(self._running),
                num_waiting=len(self._waiting),
                tokens_generated=c.tokens_generated,
                tokens_on_stale_kv=0,  # not tracked: vLLM does not say which cache rows predate an update
                busy_s=c.busy_s,
                updates_received=c.updates_received,
                updates_applied=c.updates_applied,
                updates_superseded=c.updates_superseded,
                update_pause_s_total=c.update_pause_s_total,
                update_pause_s_max=c.update_pause_s_max,
                update_copy_s_total=c.update_copy_s_total,
                sequences_recomputed=0,
                tokens_recomputed=0,
                prefill_failures=c.prefill_failures,
                adapter_updates_received=c.adapter_updates_received,
                adapter_updates_applied=c.adapter_updates_applied,
                adapters_registered=len(self._adapters),
                recent_updates=tuple(self._recent),
            )

    def close(self) -> None:
        self._scratch_dir.close()

    # -- internals -----------------------------------------------------------------------------------
    def _check(self, request: SampleRequest) -> None:
        if not request.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        p = request.params
        served = self.config.logprobs_kind
        if p.logprobs_kind != served and (p.temperature not in (0.0, 1.0) or p.truncates_distribution):
            raise ValueError(
                f"this vLLM engine reports logprobs of the {served!r} kind (vLLM's engine-wide "
                f"logprobs_mode, set by serve-engine --logprobs-kind); logprobs_kind={p.logprobs_kind!r} "
                "is served only where the two agree (temperature 0 or 1, no top-k/top-p): ask for "
                f"{served!r}, score the completion with prompt_logprobs, or start the engine with "
                f"--logprobs-kind {p.logprobs_kind}"
            )
        # As the built-in engine: the prompt must leave room for one token, and a completion that reaches
        # max_seq_len_tokens finishes there ("length"); max_tokens is cut to the room left.
        limit = self.config.max_seq_len_tokens - 1
        if len(request.prompt_token_ids) > limit:
            raise ValueError(
                f"request {request.request_id}: prompt has {len(request.prompt_token_ids)} tokens, more than "
                f"the {limit} that max_seq_len_tokens={self.config.max_seq_len_tokens} allows; raise "
                "--max-seq-len-tokens or shorten the prompt"
            )
        for name, k in (
            ("topk_prompt_logprobs", request.topk_prompt_logprobs),
            ("topk_logprobs", p.topk_logprobs),
        ):
            if k > self.config.max_prompt_logprobs:
                raise ValueError(
                    f"{name}={k} exceeds this engine's max_prompt_logprobs={self.config.max_prompt_logprobs}"
                )
        if request.target_prompt_ids is not None or request.prompt_alt_tokens_k:
            raise ValueError(
                "the vLLM backend cannot score target ids (target_prompt_ids) or draw alternatives "
                "(prompt_alt_tokens_k) at prompt positions: vLLM reports only the top-k there; use the "
                "built-in engine (--backend builtin)"
            )
        with self._lock:
            self._lookup_adapter(request.adapter)

    def _lookup_adapter(self, name: str | None) -> Any:
        """The LoRARequest a request on adapter `name` runs with (the zero adapter or None for the base
        model); ValueError for an unknown name. Called with the lock held."""
        if name is None:
            return self._zero_lora
        entry = self._adapters.get(name)
        if entry is None:
            raise ValueError(
                f"no adapter named {name!r} is registered (registered: {sorted(self._adapters)}); register "
                "it with set_adapter first, or leave adapter unset for the base model"
            )
        return entry.lora

    def _new_lora_id(self) -> int:
        lora_id = self._next_lora_id
        self._next_lora_id += 1
        return lora_id

    def _ensure_zero_lora(self) -> None:
        """The base rows' all-zero adapter (rank 1, one module), written once."""
        with self._lock:
            if self._zero_lora is not None:
                return
            lora_id = self._new_lora_id()
        import torch
        from vllm.lora.request import LoRARequest

        module, (fan_in, fan_out) = next(iter(sorted(self._lora_shapes.items())))
        tensors = {
            peft_key(module, "A"): torch.zeros(1, fan_in),
            peft_key(module, "B"): torch.zeros(fan_out, 1),
        }
        path = self._scratch / "zero-adapter"
        write_adapter_dir(path, AdapterUpdate(name=_ZERO_LORA, version=0, rank=1, scale=1.0, tensors=tensors))
        with self._lock:
            if self._zero_lora is None:
                self._zero_lora = LoRARequest(_lora_name(_ZERO_LORA, lora_id), lora_id, str(path))

    def _sampling_params(self, request: SampleRequest) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        p = request.params
        asks_prompt = request.prompt_logprobs or request.topk_prompt_logprobs > 0
        return SamplingParams(
            n=1,
            max_tokens=min(p.max_tokens, self.config.max_seq_len_tokens - len(request.prompt_token_ids)),
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k if p.top_k > 0 else 0,
            seed=p.seed,
            stop=list(p.stop),
            stop_token_ids=list(p.stop_token_ids),
            ignore_eos=True,  # inflight's engines stop only where the request says
            logprobs=p.topk_logprobs,  # the sampled token's own logprob, and the k most likely
            prompt_logprobs=request.topk_prompt_logprobs if asks_prompt else None,
            # Cumulative: tokens new since the last step are those past what we hold; the final text is
            # vLLM's, cut before a stop string.
            output_kind=RequestOutputKind.CUMULATIVE,
            skip_special_tokens=True,
        )

    def _install_pending(self) -> list[Completion]:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return []
        version, path, copy_s = pending
        start = time.perf_counter()
        self._engine.collective_rpc(
            "reload_weights", kwargs={"weights_path": str(path), "is_checkpoint_format": True}
        )
        pause_s = time.perf_counter() - start
        shutil.rmtree(path, ignore_errors=True)
        with self._lock:
            self._version = version
            c = self._counters
            c.updates_applied += 1
            c.update_pause_s_total += pause_s
            c.update_pause_s_max = max(c.update_pause_s_max, pause_s)
            self._recent.append(UpdateRecord(version, pause_s, copy_s, 0, 0))
        return []

    def _install_adapters(self) -> None:
        """Staged replacements: files moved into the adapter's directory (the only one vLLM reads for
        that id), then reloaded in place; requests on it use the new weights from this step."""
        with self._lock:
            staged, self._staged = self._staged, {}
        if not staged:
            return
        from vllm.lora.request import LoRARequest

        for name, (lora_id, directory, version) in staged.items():
            with self._lock:
                adapter = self._adapters.get(name)
            if adapter is None or adapter.lora.lora_int_id != lora_id:  # removed after staging
                shutil.rmtree(directory, ignore_errors=True)
                continue
            for file in (directory / "adapter").iterdir():
                os.replace(file, adapter.path / file.name)
            shutil.rmtree(directory, ignore_errors=True)
            self._engine.add_lora(
                LoRARequest(_lora_name(name, lora_id), lora_id, str(adapter.path), load_inplace=True)
            )
            with self._lock:
                adapter.version = version
                self._lora_versions[lora_id] = version
                self._counters.adapter_updates_applied += 1

    def _unload_retired(self) -> None:
        """Removed adapters that no running request uses any more leave vLLM's cache and the disk."""
        with self._lock:
            if not self._retired:  # every step: nothing to scan in the usual case
                return
            in_use = {r.lora_id for r in self._running.values()} | {
                self._adapters[r.adapter].lora.lora_int_id
                for r, _ in self._waiting
                if r.adapter in self._adapters
            }
            done = [i for i in self._retired if i not in in_use]
            paths = [self._retired.pop(i) for i in done]
            for lora_id in done:  # no token will be stamped with it any more
                del self._lora_versions[lora_id]
        for lora_id, path in zip(done, paths, strict=True):
            self._engine.remove_lora(lora_id)
            shutil.rmtree(path, ignore_errors=True)

    def _admit(self, waiting: list[tuple[SampleRequest, Any]]) -> list[Completion]:
        from vllm.inputs import TokensPrompt

        failed = []
        for request, params in waiting:
            with self._lock:
                try:
                    lora = self._lookup_adapter(request.adapter)
                except ValueError as exc:  # removed after it was queued
                    self._in_flight.discard(request.request_id)
                    failed.append(_completion(_Running(request, None), "abort", error=str(exc)))
                    continue
            lora_id = lora.lora_int_id if lora is not None and request.adapter is not None else None
            try:
                self._engine.add_request(
                    request.request_id,
                    TokensPrompt(prompt_token_ids=list(request.prompt_token_ids)),
                    params,
                    lora_request=lora,
                )
            except ValueError as exc:  # vLLM's own checks on this request; the others go on
                with self._lock:
                    self._counters.prefill_failures += 1
                    self._in_flight.discard(request.request_id)
                failed.append(_completion(_Running(request, lora_id), "abort", error=str(exc)))
                continue
            with self._lock:
                self._running[request.request_id] = _Running(request, lora_id)
        return failed

    def _abort(self, request_ids: set[str]) -> list[Completion]:
        with self._lock:
            hit = [self._running.pop(i) for i in request_ids if i in self._running]
            for running in hit:
                self._in_flight.discard(running.request.request_id)
        if hit:
            self._engine.abort_request([r.request.request_id for r in hit])
        return [_completion(r, "abort") for r in hit]

    def _collect(self, outputs: list[Any]) -> list[Completion]:
        finished = []
        with self._lock:
            version = self._version
            for output in outputs:
                running = self._running.get(output.request_id)
                if running is None:  # aborted meanwhile
                    continue
                sample = output.outputs[0]
                new = list(sample.token_ids[len(running.token_ids) :])
                new_logprobs = sample.logprobs[len(running.logprobs) :] if sample.logprobs else []
                running.token_ids += new
                running.logprobs += [lp[t].logprob for t, lp in zip(new, new_logprobs, strict=True)]
                if running.request.params.topk_logprobs > 0:
                    k = running.request.params.topk_logprobs
                    running.topk_logprobs += [_top(lp, k) for lp in new_logprobs]
                stamp = version if running.lora_id is None else self._lora_versions[running.lora_id]
                running.versions += [stamp] * len(new)
                self._counters.tokens_generated += len(new)
                if output.finished:
                    del self._running[output.request_id]
                    self._in_flight.discard(output.request_id)
                    reason: FinishReason = "stop" if sample.finish_reason == "stop" else "length"
                    finished.append(
                        _completion(running, reason, text=sample.text, prompt=output.prompt_logprobs)
                    )
        return finished


def _completion(
    running: _Running,
    reason: FinishReason,
    text: str | None = None,
    prompt: list[Any] | None = None,
    error: str | None = None,
) -> Completion:
    request = running.request
    prompt_logprobs: list[float] | None = None
    topk: list[list[tuple[int, float]]] | None = None
    if prompt is not None:
        ids = request.prompt_token_ids
        # Position 0 has no prefix: vLLM gives None there, inflight NaN and [].
        if request.prompt_logprobs:
            prompt_logprobs = [float("nan")] + [prompt[t][ids[t]].logprob for t in range(1, len(ids))]
        if request.topk_prompt_logprobs > 0:
            k = request.topk_prompt_logprobs
            topk = [[]] + [
                [
                    (token, lp.logprob)
                    for token, lp in sorted(prompt[t].items(), key=lambda x: x[1].rank)
                    if lp.rank <= k
                ]
                for t in range(1, len(ids))
            ]
    return Completion(
        request_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        token_ids=running.token_ids,
        logprobs=running.logprobs,
        versions=running.versions,
        finish_reason=reason,
        text=text,
        prompt_logprobs=prompt_logprobs,
        topk_prompt_logprobs=topk,
        topk_logprobs=running.topk_logprobs if request.params.topk_logprobs > 0 else None,
        error=error,
    )


def _lora_name(name: str, lora_id: int) -> str:
    """vLLM's name for a LoRA id. vLLM tells LoRARequests apart by name (their __eq__ and __hash__), so a
    name removed while requests still run on it and registered again must not look like its successor."""
    return f"{name}@{lora_id}"


def _top(logprobs: dict[int, Any], k: int) -> list[tuple[int, float]]:
    """The (id, logprob) of rank <= k, most likely first; -inf ones (outside top-k/top-p) left out, as the
    built-in engine does."""
    ranked = sorted(logprobs.items(), key=lambda x: x[1].rank)
    return [(token, lp.logprob) for token, lp in ranked if lp.rank <= k and lp.logprob != float("-inf")]


def _checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape, from the safetensors headers (nothing loaded)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[name] = tuple(f.get_slice(name).get_shape())
    if not shapes:
        raise ValueError(
            f"{str(model_dir)!r} holds no *.safetensors weights; vLLM needs a safetensors checkpoint"
        )
    return shapes
