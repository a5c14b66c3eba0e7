"""Model families in the built-in engine, each a small random model built here (no download).

Fast path (`inference/qwen2.py`): Qwen2, Qwen3 (q/k norms), Llama 3 (rope scaling "llama3"), Mistral. Generic
path (`inference/hf_runner.py`): GPT-NeoX, Mistral with a sliding window shorter than the sequences, and a
rope scaling the fast path lacks. References: transformers' full-sequence forward (log_softmax) and greedy
`generate`, `modeling_rope_utils` for the rope tables, the tokenizer's `apply_chat_template` for chat
streams. float32 throughout.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from inflight.errors import UserError
from inflight.inference import BuiltinEngine, BuiltinEngineConfig
from inflight.inference.qwen2 import ModelSpec, rope_inv_freq
from inflight.models import load_tokenizer
from inflight.rollouts.chat import ChatFormat
from inflight.types import SampleRequest, SamplingParams, WeightUpdate

VOCAB = 1000
SHAPE = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4
)
GQA = dict(num_key_value_heads=2, head_dim=16)
# With head_dim 16 and theta 5e5 the wavelengths run from 6 to ~6e5 positions: an original context of 64
# puts some below high_freq_wavelen (16, kept), some between (smoothed) and most above 64 (slowed 8x).
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
FAMILIES: dict[str, tuple[Any, str]] = {  # name -> (config, the runner the engine picks)
    "qwen2": (transformers.Qwen2Config(**SHAPE, num_key_value_heads=2), "fast"),
    "qwen3": (transformers.Qwen3Config(**SHAPE, **GQA), "fast"),
    "llama3": (transformers.LlamaConfig(**SHAPE, **GQA, rope_parameters=LLAMA3_ROPE), "fast"),
    "mistral": (transformers.MistralConfig(**SHAPE, **GQA), "fast"),  # its 4096 window never slides here
    "mistral_window8": (transformers.MistralConfig(**SHAPE, **GQA, sliding_window=8), "hf"),
    "gpt_neox": (transformers.GPTNeoXConfig(**SHAPE), "hf"),  # LayerNorm, GELU, partial rotary, parallel
    "llama_linear_rope": (
        transformers.LlamaConfig(**SHAPE, **GQA, rope_parameters={"rope_type": "linear", "factor": 2.0}),
        "hf",
    ),
}
LLAMA3_TEMPLATE = (  # Meta-Llama-3-8B-Instruct's chat template
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def random_model(config: Any, seed: int = 0) -> transformers.PreTrainedModel:
    """Weights 5x HF's default scale: peaked next-token distributions, where a wrong rope or mask moves
    logprobs by ~1 rather than by ~1e-3 (near-uniform ones hide it)."""
    torch.manual_seed(seed)
    config = copy.deepcopy(config)
    config.initializer_range = 0.1
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0: perturb them so they matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def perturbed(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return new


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny models gain nothing from 2 threads, and spinning threads on shared cores slows each op down.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> tuple[str, transformers.PreTrainedModel]:
    return request.param, random_model(FAMILIES[request.param][0])


def engine_for(model: Any, **config: Any) -> BuiltinEngine:
    return BuiltinEngine(model, config=BuiltinEngineConfig(max_batch_size=4, max_seq_len_tokens=64, **config))


def prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def hf_logprobs(model: Any, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) of each generated token from one full-sequence HF forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def max_diff(a: Any, b: Any) -> float:
    return (
        (torch.as_tensor(a, dtype=torch.float32) - torch.as_tensor(b, dtype=torch.float32)).abs().max().item()
    )


def test_sampled_logprobs_match_hf(family: tuple[str, Any]) -> None:
    """Six requests through four rows: admissions mid-decode, rows freed and moved, two temperatures."""
    name, model = family
    engine = engine_for(model)
    assert engine.runner == FAMILIES[name][1]
    temperatures = [1.0, 0.7, 1.0, 1.0, 0.7, 1.0]
    requests = [
        SampleRequest(p, SamplingParams(max_tokens=6 + 4 * i, temperature=t, seed=i))
        for i, (p, t) in enumerate(zip(prompts([3, 9, 5, 9, 1, 20]), temperatures, strict=True))
    ]
    for r, out in zip(requests, engine.generate(requests), strict=True):
        assert len(out.token_ids) == r.params.max_tokens
        reference = hf_logprobs(model, r.prompt_token_ids, out.token_ids, r.params.temperature)
        assert max_diff(out.logprobs, reference) < 1e-4, name


def test_greedy_tokens_match_hf_generate(family: tuple[str, Any]) -> None:
    name, model = family
    batch = prompts([5, 11], seed=2)
    outs = engine_for(model).generate(
        [SampleRequest(p, SamplingParams(max_tokens=12, temperature=0)) for p in batch]
    )
    for p, out in zip(batch, outs, strict=True):
        with torch.no_grad():
            ids = model.generate(
                torch.tensor([p]), do_sample=False, max_new_tokens=12, min_new_tokens=12, pad_token_id=0
            )
        assert out.token_ids == ids[0, len(p) :].tolist(), name


def test_weight_update_between_decode_steps(family: tuple[str, Any]) -> None:
    """Tokens before the update come from the old weights, after it from the new ones (the prefix's K/V
    recomputed): both exactly as HF computes them, and the switch shows in `versions`."""
    name, model = family
    new = perturbed(model)
    engine = engine_for(model, kv_policy="recompute")
    batch = prompts([4, 7], seed=3)
    for i, p in enumerate(batch):
        engine.add_request(SampleRequest(p, SamplingParams(max_tokens=8, seed=i), request_id=str(i)))
    for _ in range(3):
        engine.step()
    engine.update_weights(WeightUpdate(version=1, state_dict=new.state_dict()))
    done = {}
    while engine.has_unfinished():
        done.update((c.request_id, c) for c in engine.step())
    for i, p in enumerate(batch):
        out = done[str(i)]
        assert out.versions == [0] * 3 + [1] * 5, name
        assert max_diff(out.logprobs[:3], hf_logprobs(model, p, out.token_ids[:3])) < 1e-4, name
        tail = [hf_logprobs(new, p + out.token_ids[:k], [out.token_ids[k]])[0] for k in range(3, 8)]
        assert max_diff(out.logprobs[3:], tail) < 1e-4, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_sampled_logprobs_match_hf_on_the_cpu(
    family: tuple[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each family's engine on the GPU (weights, cache and sampling there; the runner it picks on the CPU),
    held to HF's float32 forward on the CPU with TF32 off, at the other GPU tests' 1e-3."""
    name, model = family
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    engine = engine_for(model, device="cuda")
    assert engine.device.type == "cuda" and engine.runner == FAMILIES[name][1]
    requests = [
        SampleRequest(p, SamplingParams(max_tokens=8 + 4 * i, temperature=t, seed=i))
        for i, (p, t) in enumerate(zip(prompts([3, 9, 20]), [1.0, 0.7, 1.0], strict=True))
    ]
    for r, out in zip(requests, engine.generate(requests), strict=True):
        assert len(out.token_ids) == r.params.max_tokens
        reference = hf_logprobs(model, r.prompt_token_ids, out.token_ids, r.params.temperature)
        assert max_diff(out.logprobs, reference) < 1e-3, name


def test_generic_path_keeps_tied_embeddings_tied() -> None:
    """An update may leave out a tied copy (lm_head.weight): the generic path installs the embedding twice."""
    model = random_model(transformers.Qwen2Config(**SHAPE, num_key_value_heads=2, tie_word_embeddings=True))
    engine = engine_for(model, runner="hf")
    new = perturbed(model)
    engine.update_weights(
        WeightUpdate(1, {k: v for k, v in new.state_dict().items() if k != "lm_head.weight"})
    )
    [p] = prompts([6], seed=4)
    [out] = engine.generate([SampleRequest(p, SamplingParams(max_tokens=5, seed=0))])
    assert out.versions == [1] * 5
    assert max_diff(out.logprobs, hf_logprobs(new, p, out.token_ids)) < 1e-4


def test_llama3_rope_tables_equal_transformers() -> None:
    config, _ = FAMILIES["llama3"]
    model = random_model(config)
    spec = ModelSpec.from_hf_config(model.config, max_seq_len=64)
    assert spec.llama3_rope is not None
    inv_freq = rope_inv_freq(spec)
    assert torch.equal(inv_freq, model.model.rotary_emb.inv_freq)
    default = rope_inv_freq(dataclasses.replace(spec, llama3_rope=None))
    ratio = inv_freq / default
    kept, slowed = ratio == 1, torch.isclose(ratio, torch.tensor(1 / 8))
    assert kept.any() and slowed.any() and (~kept & ~slowed).any()  # all three regimes are exercised


def test_the_sliding_window_is_exercised() -> None:
    """The generic path's Mistral runs sequences longer than its window of 8: without it they would differ."""
    model = random_model(FAMILIES["mistral_window8"][0])
    unwindowed = copy.deepcopy(model)
    unwindowed.config.sliding_window = None
    ids = torch.tensor(prompts([30], seed=5))
    with torch.no_grad():
        assert (model(ids).logits - unwindowed(ids).logits)[0, -1].abs().max() > 0.1


def test_unsupported_models_say_why_in_one_line() -> None:
    neox = random_model(FAMILIES["gpt_neox"][0])
    with pytest.raises(UserError, match=r"engine.runner=fast: model_type 'gpt_neox'"):
        engine_for(neox, runner="fast")
    window = random_model(FAMILIES["mistral_window8"][0])
    with pytest.raises(UserError, match=r"sliding_window=8 is shorter than engine.max_seq_len_tokens=64"):
        engine_for(window, runner="fast")
    mamba = transformers.MambaForCausalLM(
        transformers.MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=4)
    )
    with pytest.raises(UserError, match=r"MambaForCausalLM cannot run in the engine"):
        engine_for(mamba)


# Chat formats -------------------------------------------------------------------------------------------


def llama3_tokenizer(tiny_model_dir: Path, out: Path) -> Any:
    """The tiny tokenizer with Llama 3's special tokens and chat template, saved and loaded back."""
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.add_special_tokens(
        {
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|eot_id|>",
            "extra_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|end_of_text|>"],
        }
    )
    tokenizer.chat_template = LLAMA3_TEMPLATE
    tokenizer.save_pretrained(out)
    return load_tokenizer(out)


@pytest.fixture(scope="module")
def tokenizers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return {
        "chatml": load_tokenizer(tiny_model_dir),
        "llama3": llama3_tokenizer(tiny_model_dir, tmp_path_factory.mktemp("llama3-tokenizer")),
    }


@pytest.mark.parametrize("system_prompt", [None, "Play well."])
@pytest.mark.parametrize("template", ["chatml", "llama3"])
def test_multi_turn_stream_equals_the_template(
    tokenizers: dict[str, Any], template: str, system_prompt: str | None
) -> None:
    tokenizer = tokenizers[template]
    chat = ChatFormat(tokenizer, system_prompt)
    users, replies = (
        ["Your hand: 5 3 (8). hit or stand?", "Your hand: 5 3 2 (10).", "Dealer: 17."],
        ["hit", "stand"],
    )
    stream = chat.first_turn(users[0])
    for user, reply in zip(users[1:], replies, strict=True):
        stream += chat.assistant_reply(reply) + chat.next_turn(user)
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for i, user in enumerate(users):
        messages.append({"role": "user", "content": user})
        if i < len(replies):
            messages.append({"role": "assistant", "content": replies[i]})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert stream == tokenizer.encode(text, add_special_tokens=False)
    end = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}[template]
    assert chat.end_of_turn_id == tokenizer.convert_tokens_to_ids(end)


def test_stop_ids_come_from_the_generation_config(tokenizers: dict[str, Any]) -> None:
    tokenizer = tokenizers["llama3"]
    eot, end_of_text = tokenizer.convert_tokens_to_ids(["<|eot_id|>", "<|end_of_text|>"])
    model = random_model(FAMILIES["llama3"][0])
    model.generation_config.eos_token_id = [end_of_text, eot]  # a list, as Llama 3 Instruct ships it
    chat = ChatFormat.for_model(tokenizer, model)
    assert chat.stop_token_ids == (eot, end_of_text)  # end of turn first, no duplicates
    assert chat.reply_text([*chat.encode("stand"), end_of_text]) == "stand"
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = end_of_text
    assert ChatFormat.for_model(tokenizer, model).stop_token_ids == (eot, end_of_text)


def test_a_template_without_a_special_end_of_turn_is_refused(tokenizers: dict[str, Any]) -> None:
    tokenizer = copy.deepcopy(tokenizers["chatml"])
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
    )
    with pytest.raises(UserError, match=r"ends an assistant turn with '\\n', not with a special token"):
        ChatFormat(tokenizer)


# `inflight run` on other families -----------------------------------------------------------------------

QUICK = [
    "progress=false",
    "warmup.sft_steps=2",
    "warmup.sft_batch_size=4",
    "grpo.steps=2",
    "grpo.prompts_per_step=2",
    "grpo.group_size=2",
    "eval.num_episodes=2",
    "eval.num_episodes_during=0",
]


def save_model_dir(out: Path, config: Any, tokenizer: Any, eos: list[int]) -> Path:
    model = random_model(config)
    model.generation_config = transformers.GenerationConfig(eos_token_id=eos, pad_token_id=0)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama3", "gpt_neox"])
def test_inflight_run_takes_other_families(
    arch: str,
    tokenizers: dict[str, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A few BlackJack steps end to end: Llama 3 (its template, eot stops) on the fast path; GPT-NeoX (the
    ChatML tokenizer) on the generic path, trained by the same trainer."""
    from inflight.cli import main

    tokenizer = tokenizers["llama3" if arch == "llama3" else "chatml"]
    shape = dict(SHAPE, vocab_size=len(tokenizer))
    config = {
        "llama3": transformers.LlamaConfig(**shape, **GQA, rope_parameters=LLAMA3_ROPE),
        "gpt_neox": transformers.GPTNeoXConfig(**shape),
    }[arch]
    eos = tokenizer.convert_tokens_to_ids(
        ["<|eot_id|>", "<|end_of_text|>"] if arch == "llama3" else ["<|im_end|>"]
    )
    model_dir = save_model_dir(tmp_path / "model", config, tokenizer, eos)
    run_dir = tmp_path / "run"
    assert (
        main(
            [
                "run",
                "blackjack",
                *QUICK,
                f"model.path={json.dumps(str(model_dir))}",
                "--run-dir",
                str(run_dir),
            ]
        )
        == 0
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 2
    generic = "runs on the generic Hugging Face path" in caplog.text
    assert generic == (arch == "gpt_neox")
