"""JSON wire requests -> engine jobs (LoraSpec, OptimStep, SampleJob), with the checks a route makes before
accepting a request and the worker repeats when it builds the job.

Pure functions over `schemas` and `job_types`; protobuf requests are `proto`'s business.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from inflight.api.job_types import CsrLayout, LoraSpec, OptimStep, PromptTargets, SampleJob
from inflight.api.schemas import AdamParams, LoraConfig, OptimStepRequest, SampleRequest, TensorData
from inflight.errors import UserError
from inflight.types import MIN_TEMPERATURE

MAX_STOP_SEQUENCES = 64  # each is checked against every new token, on the thread all tenants share
MAX_STOP_STRING_CHARS = 1024


@dataclass(frozen=True)
class BaseModelLimits:
    """What a request must fit in; read once from the engine at start."""

    vocab_size: int
    max_context: int  # tokens: prompt + generated


def lora_spec(config: LoraConfig | dict[str, object]) -> LoraSpec:
    wire = config if isinstance(config, LoraConfig) else LoraConfig.model_validate(config)
    return LoraSpec(
        rank=wire.rank,
        seed=wire.seed,
        train_attn=wire.train_attn,
        train_mlp=wire.train_mlp,
        train_unembed=wire.train_unembed,
    )


def optim_step(request: OptimStepRequest) -> OptimStep:
    params = request.adam_params or request.optim_params
    if params is None:
        if request.optimizer_params is not None:
            family = request.optimizer_params.get("type", "?")
            raise UserError(f"optimizer {family!r} is not supported; this server runs AdamW (adam_params)")
        params = AdamParams()
    return OptimStep(
        model_id=request.model_id,
        learning_rate=params.learning_rate,
        beta1=params.beta1,
        beta2=params.beta2,
        eps=params.eps,
        weight_decay=params.weight_decay,
        grad_clip_norm=params.grad_clip_norm,
    )


def sample_job(
    request: SampleRequest,
    *,
    base_model: str,
    weights: str | None,
    limits: BaseModelLimits,
    default_max_tokens: int,
    max_num_samples: int,
    max_topk_logprobs: int,
) -> SampleJob:
    """Raises UserError, naming the field, for anything the engine cannot honour or that would take more
    than a request's share of the machine, so the SDK never gets a silently different answer than it
    asked for and one tenant's request cannot stall the others'."""
    _check_unsupported(request)
    prompt = request.prompt.tokens()
    if not prompt:
        raise UserError("the prompt is empty: sampling needs at least one prompt token")
    bad = [token for token in prompt if not 0 <= token < limits.vocab_size]
    if bad:
        raise UserError(f"prompt holds token id {bad[0]}, outside the vocabulary [0, {limits.vocab_size})")
    if request.num_samples > max_num_samples:
        raise UserError(
            f"num_samples={request.num_samples} is above this server's limit of {max_num_samples}"
        )
    room = limits.max_context - len(prompt)
    if room < 1:
        raise UserError(f"the prompt has {len(prompt)} tokens; the model's context is {limits.max_context}")
    params = request.sampling_params
    max_tokens = params.max_tokens if params.max_tokens is not None else min(default_max_tokens, room)
    if max_tokens > room:
        raise UserError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the model's context of "
            f"{limits.max_context} tokens"
        )
    last_n = request.prompt_logprobs_last_n
    if last_n is not None and not 1 <= last_n <= len(prompt) - 1:
        raise UserError(
            f"prompt_logprobs_last_n={last_n} must be between 1 and len(prompt) - 1 = {len(prompt) - 1}"
        )
    stop = [params.stop] if isinstance(params.stop, str) else params.stop
    if stop is not None and len(stop) > MAX_STOP_SEQUENCES:
        raise UserError(
            f"sampling_params.stop has {len(stop)} entries; this server takes at most {MAX_STOP_SEQUENCES}"
        )
    long_stops = [s for s in stop or () if isinstance(s, str) and len(s) > MAX_STOP_STRING_CHARS]
    if long_stops:
        raise UserError(
            f"sampling_params.stop holds a string of {len(long_stops[0])} characters; the limit is "
            f"{MAX_STOP_STRING_CHARS}"
        )
    stop_ids = [t for t in stop or () if isinstance(t, int)]
    if any(not 0 <= t < limits.vocab_size for t in stop_ids):
        raise UserError(f"stop token ids {stop_ids} must lie in the vocabulary [0, {limits.vocab_size})")
    topk_limit = min(max_topk_logprobs, limits.vocab_size)
    widths = {
        "topk_prompt_logprobs": request.topk_prompt_logprobs,
        "topk_sample_logprobs": request.topk_sample_logprobs,
    }
    for name, k in widths.items():
        if k > topk_limit:
            raise UserError(
                f"{name}={k} is above this server's limit of {topk_limit} (the vocabulary has "
                f"{limits.vocab_size} tokens)"
            )
    # Draws may repeat, so the vocabulary does not bound them; the table's width (the answer's size) does.
    if request.prompt_alt_tokens_k > max_topk_logprobs:
        raise UserError(
            f"prompt_alt_tokens_k={request.prompt_alt_tokens_k} is above this server's limit of "
            f"{max_topk_logprobs} draws per prompt position"
        )
    target = request.target_prompt_logprobs
    targets = (
        None if target is None else prompt_targets(target, len(prompt), limits.vocab_size, max_topk_logprobs)
    )
    # k at or above the vocabulary keeps every token: exactly top_k=-1, served as such.
    top_k = -1 if params.top_k >= limits.vocab_size else params.top_k
    temperature = 0.0 if params.temperature < MIN_TEMPERATURE else params.temperature
    return SampleJob(
        weights=weights,
        base_model=base_model,
        prompt_tokens=prompt,
        num_samples=request.num_samples,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=params.top_p,
        top_k=top_k,
        seed=params.seed,
        stop=stop,
        prompt_logprobs=bool(request.prompt_logprobs) or request.topk_prompt_logprobs > 0,
        topk_prompt_logprobs=request.topk_prompt_logprobs,
        topk_sample_logprobs=request.topk_sample_logprobs,
        target_prompt=targets,
        prompt_alt_tokens_k=request.prompt_alt_tokens_k,
    )


def prompt_targets(tensor: TensorData, prompt_len: int, vocab_size: int, max_width: int) -> PromptTargets:
    """A sample's target_prompt_logprobs as ids [P-1][K] (-1 in every cell a sparse tensor leaves out), with
    its layout for the answer. Raises UserError naming the problem; the width K is bounded by `max_width`,
    as a top-k is (the answer is a [P-1, K] table)."""
    name = "target_prompt_logprobs"
    if tensor.dtype != "int64":
        raise UserError(f"{name} must be an int64 tensor of token ids, got {tensor.dtype}")
    shape = tensor.shape
    if shape is None or len(shape) != 2:
        raise UserError(f"{name} must be 2-D, [len(prompt) - 1, K]; got shape {shape}")
    rows, width = shape
    if rows != prompt_len - 1:
        raise UserError(
            f"{name} has {rows} rows; the prompt has {prompt_len} tokens, so it needs len(prompt) - 1 = "
            f"{prompt_len - 1} (row i scores prompt position i + 1)"
        )
    if not 1 <= width <= max_width:
        raise UserError(f"{name} has {width} columns; this server takes 1 to {max_width} ids per position")
    values = _token_ids(name, tensor.data, vocab_size)
    layout = _csr_layout(name, tensor, rows, width, len(values))
    if layout is None:
        if len(values) != rows * width:
            raise UserError(f"{name} declares shape {shape} but holds {len(values)} values")
        ids = [values[i * width : (i + 1) * width] for i in range(rows)]
    else:
        ids = [[-1] * width for _ in range(rows)]
        crow, col = layout.crow_indices, layout.col_indices
        for i in range(rows):
            for j in range(crow[i], crow[i + 1]):
                ids[i][col[j]] = values[j]
    if all(t == -1 for row in ids for t in row):
        raise UserError(f"{name} names no token id (every cell is -1): name at least one, or leave it out")
    return PromptTargets(ids=ids, layout=layout)


def _token_ids(name: str, data: list[float], vocab_size: int) -> list[int]:
    bad = [v for v in data if not (math.isfinite(v) and v == int(v) and -1 <= v < vocab_size)]
    if bad:
        raise UserError(
            f"{name} holds {bad[0]:g}; ids must lie in the vocabulary [0, {vocab_size}), or be -1"
        )
    return [int(v) for v in data]


def _csr_layout(name: str, tensor: TensorData, rows: int, width: int, nnz: int) -> CsrLayout | None:
    """The tensor's sparse layout, checked (rows' column indices strictly increase); None if dense."""
    crow, col = tensor.sparse_crow_indices, tensor.sparse_col_indices
    if crow is None and col is None:
        return None
    if crow is None or col is None:
        raise UserError(f"{name}: a sparse tensor needs both sparse_crow_indices and sparse_col_indices")
    if len(crow) != rows + 1 or crow[0] != 0 or crow[-1] != nnz or len(col) != nnz:
        raise UserError(
            f"{name}: sparse_crow_indices must hold rows + 1 = {rows + 1} offsets from 0 to the {nnz} "
            f"values, and sparse_col_indices {nnz} columns; got {len(crow)} offsets and {len(col)} columns"
        )
    for i in range(rows):
        cells = col[crow[i] : crow[i + 1]] if crow[i] <= crow[i + 1] else None
        if cells is None or any(not 0 <= c < width for c in cells) or cells != sorted(set(cells)):
            raise UserError(
                f"{name}: row {i} of the sparse tensor is malformed (its offsets must not decrease, its "
                f"columns must increase within [0, {width}))"
            )
    return CsrLayout(crow_indices=list(crow), col_indices=list(col))


def _check_unsupported(request: SampleRequest) -> None:
    # record_stability_info is accepted and records nothing: this server's stable_reinforce reads only the
    # datums' logprobs, which the engine returns exactly (trainer/tinker_losses.py, `_sampled_rows`).
    if request.sampling_params.top_k == 0:
        raise UserError("top_k=0 keeps no token: use -1 for no top-k limit, or a positive k")
