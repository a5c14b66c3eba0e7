"""Built-in engine tests. References: HF transformers' Qwen2/Llama/Qwen3 full-sequence forward and
`generate` (numerics, greedy tokens), and vLLM's semantics (continuous batching, seeds, stop conditions,
top-k/top-p order, abort). Tiny random models built in memory; float32 throughout.
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
import transformers

from inflight.errors import UserError
from inflight.inference import BuiltinEngine, BuiltinEngineConfig, Engine
from inflight.inference.adapters import FusedAdapter, LoraStacks
from inflight.inference.qwen2 import gate_up_linear
from inflight.inference.sampling import sample
from inflight.types import SampleRequest, SamplingParams, WeightUpdate

VOCAB = 1000


def tiny_model(arch: str = "qwen2", tie: bool = False, seed: int = 0) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    shape = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, intermediate_size=128)
    shape |= dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie, rope_theta=5000.0)
    config_cls, model_cls = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    if arch == "qwen3":
        shape["head_dim"] = 16
    model = model_cls(config_cls(**shape)).eval()
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0: perturb them so they matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # These tiny models gain nothing from 2 threads, and spinning OpenMP threads on cores shared with
    # other processes can slow each op down 100x (reference/machine-notes.md).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model() -> transformers.PreTrainedModel:
    return tiny_model()


def engine_for(model, max_batch_size: int = 8, max_seq_len: int = 128, **kw) -> BuiltinEngine:
    config = BuiltinEngineConfig(max_batch_size=max_batch_size, max_seq_len_tokens=max_seq_len)
    return BuiltinEngine(model, config=config, **kw)


def prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def hf_logprobs(model, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) of each generated token from one full-sequence HF forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def max_diff(a: list[float] | torch.Tensor, b: list[float] | torch.Tensor) -> float:
    return (
        (torch.as_tensor(a, dtype=torch.float32) - torch.as_tensor(b, dtype=torch.float32)).abs().max().item()
    )


class CharTokenizer:
    """A fake tokenizer: token i decodes to one letter, so text offsets equal token offsets."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


@pytest.mark.parametrize("arch,tie", [("qwen2", False), ("qwen2", True), ("llama", False), ("qwen3", False)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprob_parity_with_hf_forward(arch: str, tie: bool, temperature: float) -> None:
    model = tiny_model(arch, tie)
    engine = engine_for(model)
    assert isinstance(engine, Engine)
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=3)
    requests = [SampleRequest(p, params) for p in prompts([1, 5, 17, 40])]
    for req, out in zip(requests, engine.generate(requests), strict=True):
        assert len(out.token_ids) == 12 and out.finish_reason == "length"
        assert (
            max_diff(out.logprobs, hf_logprobs(model, req.prompt_token_ids, out.token_ids, temperature))
            < 1e-4
        )


@pytest.mark.parametrize("rows", [1, 64, 300])  # <= 256 rows: one matmul per thread; more: one matmul
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("adapters", [0, 1, 2])  # LoRA on the rows: none, one adapter, two (half each)
def test_gate_up_linear_equals_the_stacked_matmul(rows: int, threads: int, adapters: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    x, gate_up = torch.randn(rows, 16, generator=generator), torch.randn(2 * 24, 16, generator=generator)
    expected = torch.nn.functional.linear(x, gate_up)
    lora = None
    if adapters:
        layout = {"gate_up": [("gate", 0, 24), ("up", 24, 24)]}

        def modules() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
            return {
                part: (torch.randn(4, 16, generator=generator), torch.randn(24, 4, generator=generator))
                for part in ("gate", "up")
            }

        cpu = torch.device("cpu")
        fused = [FusedAdapter.build(modules(), 0.5, layout, torch.float32, cpu) for _ in range(adapters)]
        row_adapters = [fused[i * adapters // rows] for i in range(rows)]
        lora = LoraStacks(list(layout), torch.float32, torch.device("cpu")).batch(row_adapters)
        assert lora is not None
        delta = lora.delta("gate_up", x)
        assert delta is not None
        expected = expected + delta
    expected_gate, expected_up = expected.chunk(2, dim=-1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gate, up = gate_up_linear(x, gate_up, lora, "gate_up")
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(gate, expected_gate)
    torch.testing.assert_close(up, expected_up)


def test_truncated_logprobs_are_renormalised(model) -> None:
    engine = engine_for(model)
    for params in [
        SamplingParams(max_tokens=8, top_k=20, seed=1),
        SamplingParams(max_tokens=8, top_p=0.5, seed=2),
    ]:
        [out] = engine.generate([SampleRequest(prompts([9])[0], params)])
        prompt = prompts([9])[0]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
        probs = logits.softmax(-1).sort(-1, descending=True)
        keep = (
            torch.arange(VOCAB) < params.top_k
            if params.top_k
            else probs.values.cumsum(-1) - probs.values < 0.5
        )
        kept = torch.zeros_like(logits, dtype=torch.bool).scatter(1, probs.indices, keep.expand_as(logits))
        ref = torch.log_softmax(logits.masked_fill(~kept, float("-inf")), -1)
        ref = ref.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
        assert kept.gather(1, torch.tensor(out.token_ids)[:, None]).all()  # sampled inside the set
        assert max_diff(out.logprobs, ref) < 1e-4


def test_sample_mixed_batch_reports_the_behaviour_distribution() -> None:
    """sample() alone: greedy, plain, top-k, top-p and an oversized top-k side by side in one batch."""
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0)) * 3
    params = [
        SamplingParams(temperature=0.0, top_k=3),  # greedy ignores truncation
        SamplingParams(temperature=0.5),
        SamplingParams(top_k=4),
        SamplingParams(top_p=0.6, temperature=2.0),
        SamplingParams(top_k=500),  # larger than the vocabulary: no truncation
    ]
    for seed in range(20):
        tokens, logprobs = sample(logits, params, [None] * 5, torch.Generator().manual_seed(seed))
        assert tokens[0] == logits[0].argmax()
        ref = [torch.log_softmax(logits[0], -1), torch.log_softmax(logits[1] / 0.5, -1)]
        top4 = logits[2].topk(4).indices
        probs, order = (logits[3] / 2.0).softmax(-1).sort(descending=True)
        nucleus = order[probs.cumsum(-1) - probs < 0.6]  # smallest prefix reaching 0.6

        def only(row: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
            return torch.log_softmax(torch.full((50,), float("-inf")).index_copy(0, keep, row[keep]), -1)

        ref += [only(logits[2], top4), only(logits[3] / 2.0, nucleus), torch.log_softmax(logits[4], -1)]
        assert tokens[2] in top4 and tokens[3] in nucleus
        expected = torch.stack([r[t] for r, t in zip(ref, tokens.tolist(), strict=True)])
        assert max_diff(logprobs, expected) < 1e-5


def test_seeded_sampling_is_reproducible_and_batch_independent(model) -> None:
    prompt, others = prompts([6])[0], prompts([3, 11, 8], seed=2)
    seeded = SampleRequest(prompt, SamplingParams(max_tokens=16, seed=42))
    alone = engine_for(model).generate([seeded])[0].token_ids
    mixed = [SampleRequest(p, SamplingParams(max_tokens=20)) for p in others]
    batch = [mixed[0], SampleRequest(prompt, SamplingParams(max_tokens=16, seed=42)), *mixed[1:]]
    assert engine_for(model).generate(batch)[1].token_ids == alone
    reordered = [SampleRequest(prompt, SamplingParams(max_tokens=16, seed=42)), *reversed(mixed)]
    assert engine_for(model).generate(reordered)[0].token_ids == alone
    other_seed = SampleRequest(prompt, SamplingParams(max_tokens=16, seed=43))
    assert engine_for(model).generate([other_seed])[0].token_ids != alone


@pytest.mark.parametrize("runner", ["fast", "hf"])
def test_a_prompt_admitted_several_times_is_prefilled_once(model, runner: str) -> None:
    """A GRPO group: the same prompt 4 times (each its own seed) between other prompts, in one step. The
    copies' K/V come from one prefill; every completion equals the one its request gets alone."""
    group, others = prompts([9])[0], prompts([5, 12], seed=3)
    requests = [SampleRequest(others[0], SamplingParams(max_tokens=6, seed=7))]
    requests += [SampleRequest(group, SamplingParams(max_tokens=6, seed=s)) for s in range(4)]
    requests += [SampleRequest(others[1], SamplingParams(max_tokens=6, seed=8))]

    def engine() -> BuiltinEngine:
        config = BuiltinEngineConfig(max_batch_size=8, max_seq_len_tokens=64, runner=runner)  # type: ignore[arg-type]
        return BuiltinEngine(model, config=config)

    alone = [engine().generate([copy.deepcopy(r)])[0] for r in requests]
    shared = engine()
    together = shared.generate(requests)
    assert shared.metrics().prompt_tokens_shared == 3 * len(group)
    assert len({tuple(c.token_ids) for c in together[1:5]}) > 1  # the seeds differ, so do the samples
    for got, ref in zip(together, alone, strict=True):
        assert got.token_ids == ref.token_ids
        assert max_diff(got.logprobs, ref.logprobs) < 1e-5


def test_continuous_batching_matches_one_at_a_time(model) -> None:
    specs = [(3, 10), (12, 4), (7, 15), (1, 6), (25, 9), (5, 12)]  # (prompt tokens, max_tokens)
    requests = [
        SampleRequest(p, SamplingParams(max_tokens=m, temperature=0.0))
        for p, (_, m) in zip(prompts([n for n, _ in specs]), specs, strict=True)
    ]
    expected = [engine_for(model).generate([copy.deepcopy(r)])[0] for r in requests]
    engine = engine_for(model, max_batch_size=3)  # three rows: later requests wait for free ones
    for r in requests[:4]:
        engine.add_request(r)
    done = {}
    for step in range(100):
        if step == 3:  # join while others are mid-generation
            engine.add_request(requests[4])
        if step == 5:
            engine.add_request(requests[5])
        done.update((c.request_id, c) for c in engine.step())
        if step > 5 and not engine.has_unfinished():
            break
    for r, ref in zip(requests, expected, strict=True):
        assert done[r.request_id].token_ids == ref.token_ids
        assert max_diff(done[r.request_id].logprobs, ref.logprobs) < 1e-5


def test_greedy_matches_hf_generate(model) -> None:
    engine = engine_for(model)
    for prompt in prompts([1, 4, 13]):
        [out] = engine.generate([SampleRequest(prompt, SamplingParams(max_tokens=10, temperature=0.0))])
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10, pad_token_id=0)
        assert out.token_ids == ref[0, len(prompt) :].tolist()


def perturbed_state_dict(model, seed: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


def test_weight_update_applies_at_the_next_step_and_keeps_stale_kv(model) -> None:
    """After k steps the update lands: tokens k+1.. come from the new weights reading the prefix's old K/V.

    Exactly checkable reference: HF's cache from the OLD model over prompt + tokens[:k-1] (what the engine
    had cached), then the NEW model over tokens[k-1:] continuing that cache (the "keep" KV policy).
    """
    new_sd = perturbed_state_dict(model)
    new_model = copy.deepcopy(model)
    new_model.load_state_dict(new_sd)
    engine = engine_for(model)
    requests = [
        SampleRequest(p, SamplingParams(max_tokens=10, seed=i)) for i, p in enumerate(prompts([4, 9]))
    ]
    for r in requests:
        engine.add_request(r)
    k, done = 3, {}
    for _ in range(k):
        assert not engine.step()
    engine.update_weights(WeightUpdate(version=1, state_dict=new_sd))
    assert engine.version == 0  # pending until the next step
    while engine.has_unfinished():
        done.update((c.request_id, c) for c in engine.step())
    assert engine.version == 1
    for r in requests:
        out, prompt = done[r.request_id], r.prompt_token_ids
        assert out.versions == [0] * k + [1] * (10 - k)
        assert max_diff(out.logprobs[:k], hf_logprobs(model, prompt, out.token_ids[:k])) < 1e-4
        with torch.no_grad():
            cache = model(torch.tensor([prompt + out.token_ids[: k - 1]]), use_cache=True).past_key_values
            logits = new_model(torch.tensor([out.token_ids[k - 1 : -1]]), past_key_values=cache).logits[0]
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.token_ids[k:])[:, None]).squeeze(1)
        assert max_diff(out.logprobs[k:], ref) < 1e-4
        # Not vacuous: a full recompute with the new weights (the "recompute" policy) gives other values.
        assert (
            max_diff(out.logprobs[k:], hf_logprobs(new_model, prompt + out.token_ids[:k], out.token_ids[k:]))
            > 1e-3
        )


def test_update_latest_wins_and_is_copied(model) -> None:
    new_model = copy.deepcopy(model)
    new_sd = perturbed_state_dict(model)
    new_model.load_state_dict(new_sd)
    engine = engine_for(model)
    engine.update_weights(WeightUpdate(version=1, state_dict=perturbed_state_dict(model, seed=99)))
    engine.update_weights(WeightUpdate(version=2, state_dict=new_sd))
    for t in new_sd.values():
        t.zero_()  # the caller reuses its buffers: the engine must have copied
    prompt = prompts([6])[0]
    [out] = engine.generate([SampleRequest(prompt, SamplingParams(max_tokens=6, seed=0))])
    assert out.versions == [2] * 6
    assert max_diff(out.logprobs, hf_logprobs(new_model, prompt, out.token_ids)) < 1e-4


def test_update_from_another_thread_is_applied_between_steps(model) -> None:
    engine = engine_for(model, max_seq_len=256)
    requests = [SampleRequest(p, SamplingParams(max_tokens=200)) for p in prompts([3, 8])]
    for r in requests:
        engine.add_request(r)
    sds = [perturbed_state_dict(model, seed=s) for s in range(10)]

    def push() -> None:  # like a trainer: publish, then wait until the engine runs on it
        for v, sd in enumerate(sds, start=1):
            engine.update_weights(WeightUpdate(version=v, state_dict=sd))
            while engine.version < v and engine.has_unfinished():
                time.sleep(0.001)

    thread = threading.Thread(target=push)
    done = {}
    thread.start()
    while engine.has_unfinished():
        done.update((c.request_id, c) for c in engine.step())
    thread.join()
    engine.step()  # an update pending at the end is applied even with nothing running
    assert engine.version == len(sds)
    for c in done.values():
        assert c.versions == sorted(c.versions) and set(c.versions) <= set(range(len(sds) + 1))
        assert len(set(c.versions)) > 1  # the updates landed while the request was in flight


def test_update_rejects_bad_names_and_shapes(model) -> None:
    engine = engine_for(model)
    sd = dict(model.state_dict())
    missing = {k: v for k, v in sd.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match=r"missing names \['model.norm.weight'\]"):
        engine.update_weights(WeightUpdate(version=1, state_dict=missing))
    with pytest.raises(ValueError, match=r"unknown names.*model\.bogus"):
        engine.update_weights(WeightUpdate(version=1, state_dict={**sd, "model.bogus": torch.zeros(1)}))
    with pytest.raises(ValueError, match=r"wrong shapes.*lm_head\.weight"):
        engine.update_weights(WeightUpdate(version=1, state_dict={**sd, "lm_head.weight": torch.zeros(3, 3)}))
    assert engine.version == 0


def test_stop_strings_and_stop_token_ids(model) -> None:
    engine = engine_for(model, tokenizer=CharTokenizer())
    prompt = prompts([5])[0]
    [free] = engine.generate([SampleRequest(prompt, SamplingParams(max_tokens=20, seed=0))])
    assert free.text == CharTokenizer().decode(free.token_ids) and free.finish_reason == "length"
    for stop in [free.text[6:8], free.text[17:19]]:  # the later one ends past a 12-token tail window
        j = free.text.index(stop)
        params = SamplingParams(max_tokens=20, seed=0, stop=["!!", stop])  # same seed: same tokens
        [out] = engine.generate([SampleRequest(prompt, params)])
        expected = ("stop", free.token_ids[: j + 2], free.text[:j])  # tokens kept, text cut before stop
        assert (out.finish_reason, out.token_ids, out.text) == expected
    stop_id = free.token_ids[5]
    j = free.token_ids.index(stop_id)
    params = SamplingParams(max_tokens=20, seed=0, stop_token_ids=[stop_id])
    [out] = engine.generate([SampleRequest(prompt, params)])
    assert (out.finish_reason, out.token_ids) == ("stop", free.token_ids[: j + 1])  # stop token kept
    with pytest.raises(ValueError, match="need a tokenizer"):
        engine_for(model).add_request(SampleRequest(prompt, SamplingParams(stop=["x"])))


def test_top_k_1_and_tiny_top_p_equal_greedy(model) -> None:
    engine = engine_for(model)
    prompt = prompts([7])[0]
    greedy = engine.generate([SampleRequest(prompt, SamplingParams(max_tokens=12, temperature=0.0))])[0]
    for params in [SamplingParams(max_tokens=12, top_k=1), SamplingParams(max_tokens=12, top_p=1e-6)]:
        [out] = engine.generate([SampleRequest(prompt, params)])
        assert out.token_ids == greedy.token_ids
        assert max(abs(lp) for lp in out.logprobs) < 1e-6  # a one-token distribution has log-prob 0


def test_top_k_samples_lie_in_the_top_k(model) -> None:
    engine = engine_for(model)
    requests = [
        SampleRequest(p, SamplingParams(max_tokens=30, top_k=5, temperature=2.0)) for p in prompts([2, 6])
    ]
    for r, out in zip(requests, engine.generate(requests), strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([r.prompt_token_ids + out.token_ids])).logits[0]
        top5 = logits[len(r.prompt_token_ids) - 1 : -1].topk(5).indices
        assert (top5 == torch.tensor(out.token_ids)[:, None]).any(-1).all()


def test_abort_waiting_and_running(model) -> None:
    engine = engine_for(model, max_batch_size=1)
    running, waiting = (SampleRequest(p, SamplingParams(max_tokens=50)) for p in prompts([4, 4]))
    engine.add_request(running)
    engine.add_request(waiting)
    engine.step()
    engine.step()
    engine.abort(running.request_id)
    engine.abort(waiting.request_id)
    engine.abort("not-a-request")  # ignored: it may have finished already
    out = {c.request_id: c for c in engine.step()}
    assert out[running.request_id].finish_reason == "abort" and len(out[running.request_id].token_ids) == 2
    assert out[waiting.request_id].finish_reason == "abort" and out[waiting.request_id].token_ids == []
    assert not engine.has_unfinished()


def test_max_seq_len_and_prompt_logprobs(model) -> None:
    engine = engine_for(model, max_seq_len=16)
    prompt = prompts([10])[0]
    [out] = engine.generate([SampleRequest(prompt, SamplingParams(max_tokens=50))])
    assert out.finish_reason == "length" and len(prompt) + len(out.token_ids) == 16
    lps = engine.prompt_logprobs(prompt)
    assert len(lps) == len(prompt) and lps[0] != lps[0]  # NaN first: no prefix to condition on
    assert max_diff(lps[1:], hf_logprobs(model, prompt[:1], prompt[1:])) < 1e-4
    assert len(engine.prompt_logprobs(prompt[:1])) == 1


def test_bfloat16_stays_close_to_float32_hf(model) -> None:
    config = BuiltinEngineConfig(max_batch_size=4, max_seq_len_tokens=64, dtype="bfloat16")
    engine = BuiltinEngine(model, config=config)
    requests = [SampleRequest(p, SamplingParams(max_tokens=10, seed=1)) for p in prompts([3, 9])]
    for r, out in zip(requests, engine.generate(requests), strict=True):
        assert max_diff(out.logprobs, hf_logprobs(model, r.prompt_token_ids, out.token_ids)) < 2e-2


def test_bad_input_is_rejected_clearly(model) -> None:
    for bad in [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-1)]:
        with pytest.raises(ValueError, match="SamplingParams"):
            SamplingParams(**bad)
    engine = engine_for(model, max_seq_len=16)
    with pytest.raises(ValueError, match=r"prompt has 16 tokens.*max_seq_len_tokens"):
        engine.add_request(SampleRequest(list(range(16))))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(SampleRequest([]))
    with pytest.raises(ValueError, match="token ids must lie"):
        engine.add_request(SampleRequest([VOCAB]))
    request = SampleRequest([1, 2])
    engine.add_request(request)
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request(request)
    with pytest.raises(ValueError):
        BuiltinEngineConfig(max_batch_size=4, bogus=1)  # type: ignore[call-arg]
    # A rope scaling the fast path lacks: one clear line when asked for the fast path, else the generic one
    # (tests/test_model_families.py holds that path to HF).
    rope_model = tiny_model()
    rope_model.config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    fast = BuiltinEngineConfig(max_seq_len_tokens=16, runner="fast")
    with pytest.raises(UserError, match=r"engine.runner=fast: rope_type 'linear'.*engine.runner=auto"):
        BuiltinEngine(rope_model, config=fast)
    assert BuiltinEngine(rope_model, config=BuiltinEngineConfig(max_seq_len_tokens=16)).runner == "hf"
