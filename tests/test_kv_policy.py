"""The KV-cache policy across in-flight weight updates (`BuiltinEngineConfig.kv_policy`) and update metrics.

Reference: HF transformers' full-sequence forward. With "recompute", tokens sampled after an update must
have exactly the logprobs that the new weights give over the whole prefix (and greedy tokens equal a fresh
generation from that prefix); with "keep" they read the old K/V (checked exactly in tests/test_engine.py)
and the stale-token counter counts them. Tiny random models built in memory; float32 throughout.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from inflight.inference import BuiltinEngine, BuiltinEngineConfig
from inflight.types import SampleRequest, SamplingParams, WeightUpdate

VOCAB = 500


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models; spinning threads on shared cores only slows everyone down
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models() -> tuple[transformers.PreTrainedModel, transformers.PreTrainedModel]:
    """(old, new): a random Qwen2 model and the same model with every parameter perturbed."""
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    old = transformers.Qwen2ForCausalLM(config).eval()
    new = copy.deepcopy(old)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return old, new


def engine_for(model, kv_policy: str, max_batch_size: int = 8, **kw) -> BuiltinEngine:
    config = BuiltinEngineConfig(
        max_batch_size=max_batch_size, max_seq_len_tokens=128, kv_policy=kv_policy, **kw
    )
    return BuiltinEngine(model, config=config)


def prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def hf_logprobs(model, prefix: list[int], tokens: list[int]) -> torch.Tensor:
    """log_softmax of each of `tokens` continuing `prefix`, from one full-sequence forward (temperature 1)."""
    with torch.no_grad():
        logits = model(torch.tensor([prefix + tokens])).logits[0, len(prefix) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def max_diff(a, b) -> float:
    diff = torch.as_tensor(a, dtype=torch.float32) - torch.as_tensor(b, dtype=torch.float32)
    return diff.abs().max().item() if diff.numel() else 0.0


def run_with_update_after(engine: BuiltinEngine, requests: list[SampleRequest], new_model, k: int) -> dict:
    """Run `requests` for k steps, publish new_model's weights as version 1, then run to completion."""
    for r in requests:
        engine.add_request(r)
    done = {}
    for _ in range(k):
        done.update((c.request_id, c) for c in engine.step())
    engine.update_weights(WeightUpdate(version=1, state_dict=new_model.state_dict()))
    while engine.has_unfinished():
        done.update((c.request_id, c) for c in engine.step())
    return done


def test_recompute_continues_exactly_as_the_new_weights_over_the_whole_prefix(models) -> None:
    old, new = models
    engine = engine_for(old, "recompute")
    lengths, k, max_tokens = [3, 11, 6], 4, 10  # unequal prompts: the batched recompute pads rows
    requests = [
        SampleRequest(p, SamplingParams(max_tokens=max_tokens, seed=i))
        for i, p in enumerate(prompts(lengths))
    ]
    done = run_with_update_after(engine, requests, new, k)
    for r in requests:
        out, prompt = done[r.request_id], r.prompt_token_ids
        assert out.versions == [0] * k + [1] * (max_tokens - k)
        assert max_diff(out.logprobs[:k], hf_logprobs(old, prompt, out.token_ids[:k])) < 1e-4
        after = hf_logprobs(new, prompt + out.token_ids[:k], out.token_ids[k:])
        assert max_diff(out.logprobs[k:], after) < 1e-4
    m = engine.metrics()
    assert m.tokens_on_stale_kv == 0 and m.stale_kv_token_frac == 0.0
    assert (m.updates_received, m.updates_applied, m.updates_superseded) == (1, 1, 0)
    assert m.sequences_recomputed == len(requests)
    # A row caches its prompt and all but its newest token when the update lands after k steps.
    assert m.tokens_recomputed == sum(n + k - 1 for n in lengths)
    [record] = m.recent_updates
    assert record.version == 1 and record.pause_s > 0 and record.tokens_recomputed == m.tokens_recomputed


def test_keep_reads_the_stale_cache_and_counts_those_tokens(models) -> None:
    old, new = models
    k, max_tokens = 4, 10
    results = {}
    for policy in ("keep", "recompute"):
        engine = engine_for(old, policy)
        requests = [SampleRequest(p, SamplingParams(max_tokens=max_tokens, seed=5)) for p in prompts([7, 2])]
        results[policy] = (requests, run_with_update_after(engine, requests, new, k), engine.metrics())
    requests, done, m = results["keep"]
    for r in requests:
        out = done[r.request_id]
        after = hf_logprobs(new, r.prompt_token_ids + out.token_ids[:k], out.token_ids[k:])
        assert max_diff(out.logprobs[k:], after) > 1e-3  # not what a fresh prefix under v1 gives
    # By definition every token after the update of a sequence in flight at the update is on a stale prefix.
    assert m.tokens_on_stale_kv == len(requests) * (max_tokens - k)
    assert m.tokens_generated == len(requests) * max_tokens
    assert m.stale_kv_token_frac == pytest.approx((max_tokens - k) / max_tokens)
    assert m.sequences_recomputed == 0 and m.tokens_recomputed == 0
    assert results["recompute"][2].tokens_on_stale_kv == 0


def test_recompute_greedy_equals_a_fresh_generation_with_the_new_weights(models) -> None:
    old, new = models
    k, max_tokens = 5, 12
    prompt = prompts([9], seed=3)[0]
    request = SampleRequest(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    out = run_with_update_after(engine_for(old, "recompute"), [request], new, k)[request.request_id]
    fresh_request = SampleRequest(
        prompt + out.token_ids[:k], SamplingParams(max_tokens=max_tokens - k, temperature=0)
    )
    [fresh] = engine_for(new, "keep").generate([fresh_request])
    assert out.token_ids[k:] == fresh.token_ids
    assert max_diff(out.logprobs[k:], fresh.logprobs) < 1e-4


def test_chunked_recompute_equals_one_batch(models) -> None:
    """A token budget smaller than one row still recomputes every row (one row per chunk)."""
    old, new = models
    outputs = []
    for chunk_tokens in (16384, 20, 1):
        engine = engine_for(old, "recompute", recompute_chunk_tokens=chunk_tokens)
        requests = [
            SampleRequest(p, SamplingParams(max_tokens=8, seed=i))
            for i, p in enumerate(prompts([5, 13, 2, 8]))
        ]
        done = run_with_update_after(engine, requests, new, 3)
        outputs.append([done[r.request_id] for r in requests])
    for other in outputs[1:]:
        for a, b in zip(outputs[0], other, strict=True):
            assert a.token_ids == b.token_ids
            assert max_diff(a.logprobs, b.logprobs) < 1e-5


def test_recompute_with_abort_admission_and_finishing_rows_in_the_update_step(models) -> None:
    """The update's step also frees an aborted row and admits a newcomer; a row finishing later moves rows."""
    old, new = models
    engine = engine_for(old, "recompute", max_batch_size=3)
    short, long_, aborted, newcomer = (
        SampleRequest(p, SamplingParams(max_tokens=m, seed=i))
        for i, (p, m) in enumerate(zip(prompts([4, 10, 6, 5]), [5, 12, 12, 6], strict=True))
    )
    for r in (short, long_, aborted):
        engine.add_request(r)
    done = {}
    for _ in range(3):
        done.update((c.request_id, c) for c in engine.step())
    engine.abort(aborted.request_id)
    engine.add_request(newcomer)
    engine.update_weights(WeightUpdate(version=1, state_dict=new.state_dict()))
    while engine.has_unfinished():
        done.update((c.request_id, c) for c in engine.step())
    assert done[aborted.request_id].finish_reason == "abort"
    assert done[newcomer.request_id].versions == [1] * 6  # admitted under the new weights
    for r in (short, long_, newcomer):
        out = done[r.request_id]
        k = out.versions.count(0)
        assert max_diff(out.logprobs[:k], hf_logprobs(old, r.prompt_token_ids, out.token_ids[:k])) < 1e-4
        after = hf_logprobs(new, r.prompt_token_ids + out.token_ids[:k], out.token_ids[k:])
        assert max_diff(out.logprobs[k:], after) < 1e-4
    assert engine.metrics().sequences_recomputed == 2  # short and long: not the aborted row, not the newcomer


def test_metrics_count_superseded_updates_and_tokens(models) -> None:
    old, new = models
    engine = engine_for(old, "keep")
    m0 = engine.metrics()
    assert (m0.tokens_generated, m0.tokens_per_s, m0.stale_kv_token_frac, m0.recent_updates) == (
        0,
        0.0,
        0.0,
        (),
    )
    engine.update_weights(WeightUpdate(version=1, state_dict=old.state_dict()))
    engine.update_weights(WeightUpdate(version=2, state_dict=new.state_dict()))
    assert engine.has_pending_update() and engine.metrics().updates_consumed == 1
    [out] = engine.generate([SampleRequest(prompts([4])[0], SamplingParams(max_tokens=6))])
    assert out.versions == [2] * 6 and not engine.has_pending_update()
    m = engine.metrics()
    assert (m.updates_received, m.updates_applied, m.updates_superseded, m.updates_consumed) == (2, 1, 1, 2)
    assert [r.version for r in m.recent_updates] == [2]
    assert m.tokens_generated == 6 and m.tokens_per_s > 0 and m.update_copy_s_total > 0
    assert (m.num_running, m.num_waiting, m.kv_policy) == (0, 0, "keep")


def test_kv_policy_is_validated() -> None:
    with pytest.raises(ValueError, match="kv_policy"):
        BuiltinEngineConfig(kv_policy="invalidate")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="recompute_chunk_tokens"):
        BuiltinEngineConfig(recompute_chunk_tokens=0)
