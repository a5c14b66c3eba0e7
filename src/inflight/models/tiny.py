"""Build small Qwen2-architecture causal LMs with random weights and a locally trained tokenizer.

Everything is generated on this machine (no hub): same preset and seed give byte-identical files.
The output is an ordinary Hugging Face model directory that `loader`, vLLM and `transformers` read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

from inflight.errors import UserError
from inflight.models.corpus import synthetic_corpus

# Stable ids: the trainer places special tokens first, in this order, before the 256 byte symbols.
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
PAD_ID, EOS_ID = 0, 2
MAX_POSITIONS = 2048
# ChatML as Qwen2 writes it, without Qwen's default system prompt: RL prompts should be exactly what
# the task wrote.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyPreset:
    """Shape of one tiny model and its tokenizer."""

    vocab_size: int  # tokens, special ones included; the model's embedding rows equal it exactly
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    corpus_lines: int  # synthetic texts the tokenizer is trained on (must supply vocab_size tokens)


PRESETS: dict[str, TinyPreset] = {
    # ~1.5M parameters: unit tests and CI.
    "tiny": TinyPreset(2048, 128, 4, 4, 2, 512, corpus_lines=10_000),
    # ~20M parameters: demos that must visibly learn within minutes on a CPU.
    "small": TinyPreset(3072, 384, 8, 6, 2, 1536, corpus_lines=20_000),
}


def train_tokenizer(vocab_size: int, corpus_lines: int) -> Tokenizer:
    """Byte-level BPE with exactly Qwen2's normaliser and pre-tokenizer.

    transformers' Qwen2Tokenizer rebuilds this pipeline from vocab + merges and ignores the saved one, so
    any other pre-tokenization would make `tokenizers` and `AutoTokenizer` disagree on ids.
    """
    tokenizer = Tokenizer(BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        # All 256 byte symbols, so any text encodes whatever the corpus lacks.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(synthetic_corpus(corpus_lines), trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(
            f"the synthetic corpus ({corpus_lines} lines) yields only {tokenizer.get_vocab_size()} tokens, "
            f"not {vocab_size}: raise corpus_lines or lower vocab_size in the preset"
        )
    return tokenizer


def _save_tokenizer(tokenizer: Tokenizer, out_dir: Path) -> None:
    # Saved through Qwen2Tokenizer so tokenizer_config.json is what transformers itself writes and reads.
    model = json.loads(tokenizer.to_str())["model"]
    hf_tokenizer = Qwen2Tokenizer(
        vocab=model["vocab"],
        # transformers annotates merges as strings and unk_token as str; it takes pairs and None (as Qwen).
        merges=[tuple(pair) for pair in model["merges"]],  # type: ignore[misc]
        unk_token=None,  # type: ignore[arg-type]  # byte-level: nothing is unknown
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        extra_special_tokens=[IM_START],
        model_max_length=MAX_POSITIONS,
    )
    hf_tokenizer.chat_template = CHAT_TEMPLATE
    hf_tokenizer.save_pretrained(out_dir)


def model_config(preset: TinyPreset) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=preset.vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        max_position_embeddings=MAX_POSITIONS,
        # Untied: vLLM's in-place weight reload gives wrong outputs with tied embeddings.
        tie_word_embeddings=False,
        bos_token_id=PAD_ID,  # as in Qwen2: never prepended by the tokenizer
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        dtype="float32",
    )


def build_tiny(out_dir: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Write a Qwen2-architecture model with random weights plus its tokenizer to `out_dir`.

    The tokenizer depends only on the preset; the weights depend on the preset and `seed`.
    The caller's global torch RNG state is left as it was.
    """
    if preset not in PRESETS:
        raise UserError(f"unknown tiny preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    spec = PRESETS[preset]
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)

    _save_tokenizer(train_tokenizer(spec.vocab_size, spec.corpus_lines), out)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # An explicit dtype: initialising under another default dtype and casting would change the bytes.
        model = AutoModelForCausalLM.from_config(model_config(spec), dtype=torch.float32)
    # Explicit, so no sampling defaults hide in generation_config.json: callers pass SamplingParams.
    model.generation_config = GenerationConfig(bos_token_id=PAD_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.save_pretrained(out)
    return out
