"""The prefix cache: its bookkeeping (pure), and the engine resuming a multi-turn episode's next turn from
the K/V its last turn left, against the same engine without the cache (same seeds: the same tokens, the
same logprobs to float32 rounding)."""

from __future__ import annotations

import copy

import pytest
import torch

from inflight.inference import BuiltinEngine, BuiltinEngineConfig
from inflight.inference.prefix_cache import PrefixCache
from inflight.types import SampleRequest, SamplingParams, WeightUpdate
from test_engine import max_diff, prompts, tiny_model


def test_lookup_finds_the_longest_cached_prefix_of_the_same_adapter_and_version() -> None:
    cache = PrefixCache(first_row=8, rows=3)
    adapter = object()
    assert cache.retain([1, 2, 3], None, 0) == 8
    assert cache.retain([1, 2, 3, 4, 5], None, 0) == 9
    assert cache.retain([1, 2, 3, 4, 5], adapter, 0) == 10
    assert cache.lookup([1, 2, 3, 4, 5, 6], None, 0) == (9, 5)
    assert cache.lookup([1, 2, 3, 4, 5], None, 0) == (8, 3)  # the last prompt token is always prefilled
    assert cache.lookup([1, 2, 3, 4, 5, 6], adapter, 0) == (10, 5)
    assert cache.lookup([1, 2, 3, 4, 5, 6], None, 1) is None  # K/V of other weights are never reused
    assert cache.lookup([1, 2, 4], None, 0) is None
    assert cache.retain([1, 2, 3], None, 0) is None  # already held: nothing to copy


def test_the_least_recently_used_entry_is_evicted() -> None:
    cache = PrefixCache(first_row=4, rows=2)
    assert cache.retain([1, 1], None, 0) == 4
    assert cache.retain([2, 2], None, 0) == 5
    assert cache.lookup([1, 1, 9], None, 0) == (4, 2)  # now [2, 2] is the least recently used
    assert cache.retain([3, 3], None, 0) == 5
    assert cache.lookup([2, 2, 9], None, 0) is None and len(cache) == 2
    assert PrefixCache(first_row=4, rows=0).retain([1, 2], None, 0) is None  # off


@pytest.mark.parametrize("runner", ["fast", "hf"])
def test_a_next_turn_resumes_from_the_last_turns_k_v(runner: str) -> None:
    torch.set_num_threads(1)
    model = tiny_model()

    def engine(rows: int) -> BuiltinEngine:
        config = BuiltinEngineConfig(
            max_batch_size=4,
            max_seq_len_tokens=96,
            runner=runner,
            prefix_cache_rows=rows,  # type: ignore[arg-type]
        )
        return BuiltinEngine(model, config=config)

    def episode(e: BuiltinEngine) -> tuple[list, list[list[int]]]:
        """Three turns of two episodes side by side: each turn's prompt is the last turn's prompt and
        completion (its final token included) and a new message. Also returns the next turn's prompts."""
        histories = [prompts([11])[0], prompts([7], seed=5)[0]]
        messages = prompts([3, 4, 5], seed=9)
        outs = []
        for turn, message in enumerate(messages):
            requests = [
                SampleRequest(h, SamplingParams(max_tokens=5, seed=10 * turn + i))
                for i, h in enumerate(histories)
            ]
            done = e.generate(copy.deepcopy(requests))
            outs.append(done)
            histories = [h + c.token_ids + message for h, c in zip(histories, done, strict=True)]
        return outs, histories

    def assert_same(want: list, got: list) -> None:
        for a, b in zip(want, got, strict=True):
            assert a.token_ids == b.token_ids
            assert max_diff(a.logprobs, b.logprobs) < 1e-4

    plain, cached = engine(0), engine(4)
    (want, _), (got, next_turns) = episode(plain), episode(cached)
    for a, b in zip(want, got, strict=True):
        assert_same(a, b)
    resumed = cached.metrics().prompt_tokens_cached
    assert plain.metrics().prompt_tokens_cached == 0
    assert resumed > 0 if runner == "fast" else resumed == 0  # the hf runner cannot resume a prefix

    # New weights: the K/V the old ones left are never reused. The next turn extends a cached sequence,
    # yet prefills in full and matches the engine without a cache.
    torch.manual_seed(1)
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
    for e in (plain, cached):
        e.update_weights(WeightUpdate(version=1, state_dict={k: v.clone() for k, v in new.items()}))
    request = SampleRequest(next_turns[0], SamplingParams(max_tokens=5, seed=99))
    assert_same(plain.generate([copy.deepcopy(request)]), cached.generate([copy.deepcopy(request)]))
    assert cached.metrics().prompt_tokens_cached == resumed
    # Entries of the new weights are reused again, with the new weights' results.
    (want, _), (got, _) = episode(plain), episode(cached)
    for a, b in zip(want, got, strict=True):
        assert_same(a, b)
    assert (cached.metrics().prompt_tokens_cached > resumed) == (runner == "fast")
