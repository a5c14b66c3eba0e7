"""Where a model's replies end, read from the model's own files: the end-of-turn token its tokenizer's chat
template writes after an assistant message (ChatML's <|im_end|>, Llama 3's <|eot_id|>) and the ids its
generation config stops at.

Shared by `rollouts/chat.py` (episodes as one token stream) and the engine server's chat route; knows
nothing of either.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from inflight.errors import UserError

# Stands in for a reply's text when rendering a conversation, to find what the template writes around it.
REPLY_PLACEHOLDER = "INFLIGHT_REPLY_PLACEHOLDER"


def generation_stop_ids(model: Any) -> tuple[int, ...]:
    """The ids a Hugging Face model's generation ends at: generation_config.eos_token_id (an int or a list:
    Llama 3 Instruct lists <|end_of_text|>, <|eom_id|> and <|eot_id|>), else its config's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(i) for i in (eos if isinstance(eos, list | tuple) else [eos]))


def generation_stop_ids_of(model_dir: str | Path) -> tuple[int, ...]:
    """`generation_stop_ids` of the model in `model_dir`, read from its configs alone (no weights loaded:
    for a process that only talks to an engine, or an engine that loads the weights itself)."""
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(model_dir)
    try:
        generation: GenerationConfig | None = GenerationConfig.from_pretrained(model_dir)
    except OSError:  # no generation_config.json: the model config's EOS
        generation = None
    return generation_stop_ids(SimpleNamespace(generation_config=generation, config=config))


def render(
    tokenizer: Any,
    messages: Sequence[dict[str, str]],
    generation_prompt: bool,
    chat_template: str | None = None,
) -> str:
    """The conversation as text, through `chat_template` or else the tokenizer's own."""
    return str(
        tokenizer.apply_chat_template(
            list(messages),
            tokenize=False,
            add_generation_prompt=generation_prompt,
            chat_template=chat_template,
        )
    )


def end_of_turn(
    tokenizer: Any, system_prompt: str | None = None, chat_template: str | None = None
) -> tuple[int, str]:
    """(id, token text) of the special token the template closes an assistant turn with; UserError when the
    template closes it with ordinary text, which generation could not stop at."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages += [{"role": "user", "content": "?"}, {"role": "assistant", "content": REPLY_PLACEHOLDER}]
    closing = render(tokenizer, messages, generation_prompt=False, chat_template=chat_template)
    closing = closing[closing.rfind(REPLY_PLACEHOLDER) + len(REPLY_PLACEHOLDER) :]
    ids = list(tokenizer.encode(closing, add_special_tokens=False))
    if not ids or not is_special(tokenizer, ids[0]):
        raise UserError(
            f"the chat template ends an assistant turn with {closing!r}, not with a special token (such "
            "as <|im_end|> or <|eot_id|>) that generation could stop at; use a chat model's tokenizer"
        )
    return ids[0], str(tokenizer.convert_ids_to_tokens(ids[0]))


def reply_stop_ids(end_of_turn_id: int, eos_token_ids: Sequence[int]) -> tuple[int, ...]:
    """What ends a chat reply: the end of the turn first, then the model's own EOS ids, no repeats."""
    return tuple(dict.fromkeys((end_of_turn_id, *eos_token_ids)))


def is_special(tokenizer: Any, token_id: int) -> bool:
    added = getattr(tokenizer, "added_tokens_decoder", {}).get(token_id)
    return token_id in tokenizer.all_special_ids or bool(getattr(added, "special", False))
