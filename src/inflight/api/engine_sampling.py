"""Batched sampling across sampling jobs and adapters of one base model, with a KV cache.

Each job's prompt is prefilled once (left-padded with the other jobs' prompts), its cache rows are copied
to its `num_samples` sequences, and all sequences decode together, each row with its own adapter; finished
rows leave the batch. Knows nothing of requests, futures or where the adapters come from.

Logprob convention: every reported logprob (sampled tokens and prompt tokens) is the log-softmax of the
model's raw logits, i.e. at temperature 1 without top-k/top-p truncation, computed like the training
forward. At temperature 1 with no truncation (what the Tinker recipes use) this is exactly the
distribution sampled from, so exp(lp_train - lp_sample) is 1 on-policy; at other settings it is the raw
model distribution (vLLM's default), not the temperature-scaled or truncated one.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from inflight.api.engine_types import SampledSequence, SampleJob, SampleOutput
from inflight.errors import UserError
from inflight.inference.sampling import sample
from inflight.models.lora import LoraPlan, LoraRouter
from inflight.models.lora_adapter import LoraAdapter
from inflight.types import SamplingParams


def _cache_kwarg(model: nn.Module) -> str:
    """The forward argument that takes the KV cache: `cache` in recent transformers 5.x, which deprecates
    `past_key_values` (removed in 5.40); `past_key_values` before it."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@dataclass
class PreparedSample:
    job: SampleJob
    params: SamplingParams  # temperature, top-k (0 = off), top-p; max_tokens is max_new_tokens
    stop_token_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    slot: int = 0  # the job's adapter in the group's plan


def prepare_sample(
    job: SampleJob, vocab_size: int, max_context: int, eos_ids: Sequence[int]
) -> PreparedSample:
    """Validate a sampling job; every problem is a UserError naming it."""
    prompt = job.prompt_tokens
    if not prompt:
        raise UserError("sample: the prompt has no tokens")
    bad = [i for i, t in enumerate(prompt) if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise UserError(
            f"sample: prompt token {bad[0]} = {prompt[bad[0]]!r} is not a token id in [0, {vocab_size})"
        )
    if len(prompt) >= max_context:
        raise UserError(
            f"sample: the prompt has {len(prompt)} tokens, leaving no room to generate within the "
            f"model's context of {max_context}"
        )
    if job.max_tokens < 1:
        raise UserError(f"sample: max_tokens must be >= 1, got {job.max_tokens}")
    if job.num_samples < 1:
        raise UserError(f"sample: num_samples must be >= 1, got {job.num_samples}")
    if job.top_k < -1:
        raise UserError(f"sample: top_k must be -1 (off) or >= 1, got {job.top_k}")
    if job.topk_prompt_logprobs < 0:
        raise UserError(f"sample: topk_prompt_logprobs must be >= 0, got {job.topk_prompt_logprobs}")
    try:
        params = SamplingParams(
            # Generation also ends at the context limit (stop reason "length").
            max_tokens=min(job.max_tokens, max_context - len(prompt)),
            temperature=job.temperature,
            top_p=job.top_p,
            top_k=max(job.top_k, 0),
            seed=job.seed,
        )
    except ValueError as exc:
        raise UserError(f"sample: {exc}") from exc
    stop_ids, stop_strings = _stops(job.stop, vocab_size, eos_ids)
    return PreparedSample(job=job, params=params, stop_token_ids=stop_ids, stop_strings=stop_strings)


def _stops(
    stop: Sequence[str] | Sequence[int] | str | None, vocab_size: int, eos_ids: Sequence[int]
) -> tuple[frozenset[int], tuple[str, ...]]:
    if stop is None:  # Tinker: no stop given = stop at EOS; [] = never stop, not even at EOS
        return frozenset(eos_ids), ()
    if isinstance(stop, str):
        stop = [stop]
    if all(isinstance(s, str) for s in stop):
        if any(s == "" for s in stop):
            raise UserError("sample: stop strings must be non-empty")
        return frozenset(), tuple(str(s) for s in stop)
    if all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
        bad = [s for s in stop if not 0 <= int(s) < vocab_size]
        if bad:
            raise UserError(f"sample: stop token ids {bad} are not in [0, {vocab_size})")
        return frozenset(int(s) for s in stop), ()
    raise UserError(f"sample: stop must be a list of strings or a list of token ids, got {list(stop)!r}")


# job index -> ([P] prompt logprobs, [P] top-k (token id, logprob) per position); None at position 0
PromptLogprobs = dict[int, tuple[list[float | None], list[list[tuple[int, float]] | None]]]


@dataclass
class _Row:
    """One sequence being generated."""

    item: int  # index of its PreparedSample
    generator: torch.Generator | None  # None: the engine's shared generator (unseeded jobs)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: str | None = None


@dataclass
class _Prompts:
    """Prompts left-padded to one width: row u's tokens sit at columns width - len .. width - 1."""

    ids: Tensor  # [U, L] long
    mask: Tensor  # [U, L] long, 1 at real tokens
    lengths: list[int]


def run_sampling(
    model: nn.Module,
    router: LoraRouter,
    slots: Sequence[LoraAdapter | None],
    items: Sequence[PreparedSample],
    tokenizer: Any,
    default_generator: torch.Generator,
    max_rows: int,
    device: torch.device,
) -> list[SampleOutput]:
    """Generate every item's samples; rows of at most `max_rows` sequences decode together."""
    rows = [
        _Row(i, None if item.params.seed is None else torch.Generator().manual_seed(item.params.seed + s))
        for i, item in enumerate(items)
        for s in range(item.job.num_samples)
    ]
    prompt_lps: PromptLogprobs = {}
    for start in range(0, len(rows), max_rows):
        chunk = rows[start : start + max_rows]
        _Generation(model, router, slots, items, tokenizer, default_generator, device).run(chunk, prompt_lps)
    outputs = []
    for i, item in enumerate(items):
        sequences = [
            SampledSequence(tokens=r.tokens, logprobs=r.logprobs, stop_reason=r.stop_reason or "length")
            for r in rows
            if r.item == i
        ]
        plps, topk = prompt_lps.get(i, (None, None))
        outputs.append(
            SampleOutput(
                sequences=sequences,
                prompt_logprobs=plps if item.job.prompt_logprobs else None,
                topk_prompt_logprobs=topk if item.job.topk_prompt_logprobs > 0 else None,
            )
        )
    return outputs


@dataclass
class _Generation:
    """Prefill then decode for one chunk of rows."""

    model: nn.Module
    router: LoraRouter
    slots: Sequence[LoraAdapter | None]
    items: Sequence[PreparedSample]
    tokenizer: Any
    default_generator: torch.Generator
    device: torch.device

    @torch.inference_mode()
    def run(self, rows: list[_Row], prompt_lps: PromptLogprobs) -> None:
        # Rows (and the chunk's jobs) of one adapter side by side: the LoRA layers' grouped form then needs
        # no permutation (models/lora.py). Sorting is stable, so each job keeps its samples' order.
        rows = sorted(rows, key=lambda r: self.items[r.item].slot)
        unique = sorted(dict.fromkeys(r.item for r in rows), key=lambda i: self.items[i].slot)
        prompts = self._pad([self.items[i].job.prompt_tokens for i in unique])
        want = [
            u
            for u, i in enumerate(unique)
            if i not in prompt_lps
            and (self.items[i].job.prompt_logprobs or self.items[i].job.topk_prompt_logprobs > 0)
        ]
        cache = DynamicCache()
        cache_kwarg = {_cache_kwarg(self.model): cache}
        plan = LoraPlan(self.slots, [self.items[i].slot for i in unique])
        positions = (prompts.mask.cumsum(-1) - 1).clamp_min(0)
        with self.router.use(plan):
            logits = self.model(
                input_ids=prompts.ids,
                attention_mask=prompts.mask,
                position_ids=positions,
                **cache_kwarg,
                use_cache=True,
                logits_to_keep=0 if want else 1,  # 0 = every position, for the prompt logprobs
            ).logits
        for u in want:
            prompt_lps[unique[u]] = self._prompt_logprobs(self.items[unique[u]].job, logits[u])

        # Every sequence of a job starts from its prompt's cache row.
        of_row = torch.tensor([unique.index(r.item) for r in rows], device=self.device)
        cache.reorder_cache(cast(torch.LongTensor, of_row))
        mask = prompts.mask[of_row]
        next_position = torch.tensor([prompts.lengths[u] for u in of_row.tolist()], device=self.device)
        plan = plan.select_rows(of_row)
        last_logits = logits[of_row, -1]
        active = list(rows)
        while True:
            keep = self._sample_step(active, last_logits)
            if not keep:
                return
            if len(keep) < len(active):  # finished sequences leave the batch (and the cache)
                index = torch.tensor(keep, device=self.device)
                cache.reorder_cache(cast(torch.LongTensor, index))
                mask, next_position, plan = mask[index], next_position[index], plan.select_rows(index)
                active = [active[k] for k in keep]
            mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=1)
            tokens = torch.tensor([[r.tokens[-1]] for r in active], device=self.device)
            with self.router.use(plan):
                last_logits = self.model(
                    input_ids=tokens,
                    attention_mask=mask,
                    position_ids=next_position[:, None],
                    **cache_kwarg,
                    use_cache=True,
                    logits_to_keep=1,
                ).logits[:, -1]
            next_position = next_position + 1

    def _sample_step(self, active: list[_Row], logits: Tensor) -> list[int]:
        """Sample one token per active row; returns the positions (in `active`) of unfinished rows."""
        logits = logits.float().cpu()  # `sample` builds its per-row tensors on the CPU
        params = [self.items[r.item].params for r in active]
        tokens, _ = sample(logits, params, [r.generator for r in active], self.default_generator)
        raw_logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)
        keep = []
        for k, (row, token, logprob) in enumerate(
            zip(active, tokens.tolist(), raw_logprobs.tolist(), strict=True)
        ):
            row.tokens.append(token)
            row.logprobs.append(logprob)
            item = self.items[row.item]
            if token in item.stop_token_ids or (item.stop_strings and self._has_stop_string(row, item)):
                row.stop_reason = "stop"
            elif len(row.tokens) >= item.params.max_tokens:
                row.stop_reason = "length"
            else:
                keep.append(k)
        return keep

    def _has_stop_string(self, row: _Row, item: PreparedSample) -> bool:
        """Whether the decoded completion contains a stop string. A new match must end in the newest token,
        so only a tail is decoded (a character spans at most 4 byte-level tokens)."""
        window = 4 * max(len(s) for s in item.stop_strings) + 4
        text = self.tokenizer.decode(row.tokens[-window:], skip_special_tokens=False)
        return any(s in text for s in item.stop_strings)

    def _pad(self, prompts: Sequence[Sequence[int]]) -> _Prompts:
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for u, prompt in enumerate(prompts):
            ids[u, width - len(prompt) :] = torch.tensor(prompt)
            mask[u, width - len(prompt) :] = 1
        return _Prompts(ids=ids.to(self.device), mask=mask.to(self.device), lengths=[len(p) for p in prompts])

    @staticmethod
    def _prompt_logprobs(
        job: SampleJob, logits_L_V: Tensor
    ) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
        """[P] log p(prompt[i] | prompt[:i]) with None first, and the top-k alternatives at each position."""
        prompt = job.prompt_tokens
        n = len(prompt)
        # Left padding: prompt[i] sits at column L - n + i and is predicted by the logits one column before.
        logp = torch.log_softmax(logits_L_V[-n:-1].float(), dim=-1)  # predictions for prompt[1:]
        targets = torch.tensor(prompt[1:], device=logp.device)[:, None]
        lps: list[float | None] = [None, *logp.gather(1, targets).squeeze(1).tolist()]
        topk: list[list[tuple[int, float]] | None] = [None]
        k = min(job.topk_prompt_logprobs, logp.shape[-1])
        if k > 0:
            values, ids = logp.topk(k, dim=-1)
            topk += [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
        return lps, topk
