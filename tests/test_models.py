"""Tiny model factory and loader.

Reference: Hugging Face transformers' Qwen2 (`Qwen2ForCausalLM`, `Qwen2Tokenizer`, loaded through the Auto
classes) and the `tokenizers` library reading tokenizer.json: both must give the same ids on every text.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import Qwen2ForCausalLM
from transformers.utils import logging as hf_logging

from inflight.config import RunConfig
from inflight.errors import UserError
from inflight.models import PRESETS, build_tiny, count_parameters, load_model, load_tokenizer
from inflight.models.corpus import synthetic_corpus
from inflight.models.tiny import model_config, train_tokenizer
from inflight.orchestrator.setup import resolve_model

TEXTS = [
    "",
    "hit",
    "stand",
    "Your hand: 10 of Hearts, King of Spades (total 20). Dealer shows: 7 of Clubs. hit or stand?",
    "What is 12 + 7? 123456789 0.25 -3e10 1,000,000",
    "The answer is $\\boxed{\\frac{1}{2}}$ and \\sqrt{x^2}.",
    "def f(x):\n    return x * 2\n\n\tif x >= 10:  # tab\n        pass\n",
    '{"action": "hit", "reward": 1.0, "done": true, "list": [1, 2, 3]}',
    "spaces   runs \n\n\n  trailing   \r\nwindows\r\n",
    "unicode: café cafe\u0301 naïve Ωmega 日本語 🙂 👍🏽 \u00a0nbsp",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "special inside<|endoftext|>text <|im_end|>and <|im_start|>more",
    "I'm sure it's what they'll say; we've DON'T",
    "".join(chr(c) for c in range(32, 127)),
    "\x00\x01\x7f bytes and controls",
]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny"), preset="tiny", seed=0)


def _files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def test_presets_stay_within_parameter_budgets() -> None:
    counts = {}
    for name, preset in PRESETS.items():
        with torch.device("meta"):  # shapes only: no memory, no init time
            counts[name] = count_parameters(Qwen2ForCausalLM(model_config(preset)))
    assert counts["tiny"] <= 5_000_000
    assert 15_000_000 <= counts["small"] <= 25_000_000


def test_small_preset_corpus_yields_its_vocab() -> None:
    small = PRESETS["small"]
    tokenizer = train_tokenizer(small.vocab_size, small.corpus_lines)
    assert tokenizer.get_vocab_size() == small.vocab_size


def test_same_seed_gives_byte_identical_files(tiny_dir: Path, tmp_path: Path) -> None:
    again = build_tiny(tmp_path / "again", preset="tiny", seed=0)
    first, second = _files(tiny_dir), _files(again)
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= set(first)
    assert first.keys() == second.keys()
    for name in first:
        assert first[name] == second[name], f"{name} differs between two builds with the same seed"


def test_other_seed_changes_weights_only_and_keeps_global_rng(tiny_dir: Path, tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    other = _files(build_tiny(tmp_path / "other", preset="tiny", seed=1))
    assert torch.equal(torch.rand(3), expected), "build_tiny must not consume the caller's RNG"
    first = _files(tiny_dir)
    assert other["model.safetensors"] != first["model.safetensors"]
    assert other["tokenizer.json"] == first["tokenizer.json"]
    assert other["config.json"] == first["config.json"]


def test_autotokenizer_and_tokenizers_agree(tiny_dir: Path) -> None:
    raw = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    hf = load_tokenizer(tiny_dir)
    assert type(hf).__name__ == "Qwen2Tokenizer"
    assert hf.get_vocab() == raw.get_vocab()
    texts = TEXTS + list(synthetic_corpus(300, seed=99))
    normalizer = raw.normalizer
    assert normalizer is not None
    for text in texts:
        ids = raw.encode(text).ids
        assert hf.encode(text, add_special_tokens=False) == ids, text
        assert hf.encode(text) == ids, text  # nothing (no BOS) is added
        # Byte-level BPE loses nothing but what NFC normalises away.
        assert hf.decode(ids) == raw.decode(ids, skip_special_tokens=False) == normalizer.normalize_str(text)


def test_special_tokens_and_single_token_words(tiny_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_dir)
    ids = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert ids == [0, 1, 2]
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id) == (0, 2, None)
    assert len(tokenizer) == PRESETS["tiny"].vocab_size
    # Actions in BlackJack must be one token each, bare and after a space.
    for word in ["hit", " hit", "stand", " stand", "Hit", "Stand"]:
        assert len(tokenizer.encode(word)) == 1, word
    # Qwen2's pre-tokenizer isolates every digit.
    assert [len(tokenizer.encode(str(d))) for d in range(10)] == [1] * 10
    assert len(tokenizer.encode("2026")) == 4


def test_chat_template_is_chatml(tiny_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_dir)
    messages = [{"role": "system", "content": "Play."}, {"role": "user", "content": "Dealer shows 7."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = (
        "<|im_start|>system\nPlay.<|im_end|>\n<|im_start|>user\nDealer shows 7.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert text == expected
    closed = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert closed == expected.removesuffix("<|im_start|>assistant\n")


def test_loaded_model_forward(tiny_dir: Path) -> None:
    model = load_model(tiny_dir)
    assert model.config.model_type == "qwen2"
    assert not model.config.tie_word_embeddings
    assert count_parameters(model) <= 5_000_000
    input_ids = load_tokenizer(tiny_dir)("Dealer shows 7. hit or stand?", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    assert logits.shape == (1, input_ids.shape[1], PRESETS["tiny"].vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert load_model(tiny_dir, dtype=torch.bfloat16).model.embed_tokens.weight.dtype == torch.bfloat16


class Terminal(io.StringIO):
    """A stderr that says it is a terminal: where a loading bar belongs."""

    def isatty(self) -> bool:
        return True


def test_the_loading_bar_shows_only_on_a_terminal_with_progress_on(
    tiny_dir: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A QA pass: transformers' "Loading weights" bar (redrawn with \\r) was printed with progress=false and
    into logs (stderr not a terminal). transformers' process-wide switch is left as it was."""
    monkeypatch.setattr(hf_logging, "_tqdm_active", True)  # its default, whatever HF_HUB_DISABLE_... says
    load_model(tiny_dir)  # pytest's stderr is no terminal
    assert "Loading weights" not in capfd.readouterr().err
    load_model(tiny_dir, progress=False)
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    load_model(tiny_dir, progress=False)
    assert "Loading weights" not in terminal.getvalue()
    load_model(tiny_dir)
    assert "Loading weights" in terminal.getvalue()


def test_a_runs_tiny_model_is_built_without_a_bar_off_a_terminal(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same QA pass: a run's first tiny model (built once, cached) drew "Writing model shards"."""
    monkeypatch.setenv("INFLIGHT_CACHE", str(tmp_path))  # a cache of its own: the model is built here
    monkeypatch.setattr(hf_logging, "_tqdm_active", True)
    built = Path(resolve_model(RunConfig()))
    assert (built / "config.json").is_file() and built.is_relative_to(tmp_path)
    assert "Writing model shards" not in capfd.readouterr().err


@pytest.mark.parametrize("name", ["./no-such-model", "~/no-such/model", "runs/x/no-such-model", "/no-such"])
def test_missing_local_path_is_a_user_error(name: str, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="inflight model tiny --out") as info:
        load_model(name)
    message = str(info.value)
    assert "no-such" in message and "does not exist" in message and "\n" not in message
    missing = tmp_path / "missing"
    with pytest.raises(UserError, match=str(missing)):
        load_tokenizer(missing)


def test_unknown_preset_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="tiny, small"):
        build_tiny(tmp_path / "x", preset="huge")


@pytest.mark.parametrize(
    ("flags", "native"),
    [
        ({"avx512_bf16": True, "amx_bf16": False}, True),
        ({"amx_bf16": True}, True),
        ({"avx512_bw": True}, False),
    ],
)
def test_native_bfloat16_and_auto_dtype_read_the_cpu_flags(
    monkeypatch: pytest.MonkeyPatch, flags: dict, native: bool
) -> None:
    from inflight.models.loader import native_bfloat16, resolve_dtype

    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: flags)
    cpu = torch.device("cpu")
    assert native_bfloat16(cpu) is native
    assert native_bfloat16(torch.device("meta")) is False
    assert resolve_dtype("auto", cpu) == (torch.bfloat16 if native else torch.float32)
    assert (resolve_dtype("float32", cpu), resolve_dtype("bfloat16", cpu)) == (torch.float32, torch.bfloat16)


def test_cpu_float32_attention_keeps_float32_and_upcasts_bfloat16(tiny_dir: Path) -> None:
    """Switching a model to the CPU float32 attention leaves a float32 model's logits bit for bit as they
    were, and gives a bfloat16 model float32 attention: logits within bfloat16's rounding of float32's."""
    from inflight.models.attention import CPU_FLOAT32_SDPA, use_cpu_float32_attention

    ids = torch.tensor([[5, 17, 300, 42, 9, 1000, 77, 3]])
    full = load_model(tiny_dir).eval()
    with torch.no_grad():
        expected = full(input_ids=ids).logits
        use_cpu_float32_attention(full)
        assert full.config._attn_implementation == CPU_FLOAT32_SDPA
        assert torch.equal(full(input_ids=ids).logits, expected)
        half = load_model(tiny_dir, dtype=torch.bfloat16).eval()
        use_cpu_float32_attention(half)
        logits = half(input_ids=ids).logits
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), expected, rtol=0, atol=0.05)
