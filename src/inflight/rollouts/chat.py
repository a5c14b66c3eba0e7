"""The token layout of multi-turn episodes kept as one token stream (token-in/token-out), read from the
tokenizer's own chat template (ChatML, Llama 3, ...), and the tokens that end a policy turn.

Generated tokens are never re-tokenised: each turn appends the engine's exact ids, then the tokens the
template puts between an assistant's end-of-turn token and the next assistant reply (the environment's
message as a user turn and the generation prompt). It knows nothing of engines or environments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from inflight.errors import UserError

# Stands in for a reply's text when rendering a conversation, to find what the template writes around it.
_REPLY = "INFLIGHT_REPLY_PLACEHOLDER"


def generation_stop_ids(model: Any) -> tuple[int, ...]:
    """The ids a Hugging Face model's generation ends at: generation_config.eos_token_id (an int or a list:
    Llama 3 Instruct lists <|end_of_text|>, <|eom_id|> and <|eot_id|>), else its config's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(i) for i in (eos if isinstance(eos, list | tuple) else [eos]))


class ChatFormat:
    """`eos_token_ids`: the ids generation stops at besides the end-of-turn token, usually the model's
    generation config's (`ChatFormat.for_model`)."""

    def __init__(
        self, tokenizer: Any, system_prompt: str | None = None, eos_token_ids: Sequence[int] = ()
    ) -> None:
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.eos_token_ids = tuple(eos_token_ids)
        closing = self._render([("user", "?"), ("assistant", _REPLY)], generation_prompt=False)
        closing = closing[closing.rfind(_REPLY) + len(_REPLY) :]
        ids = self.encode(closing)
        if not ids or not self._is_special(ids[0]):
            raise UserError(
                f"the chat template ends an assistant turn with {closing!r}, not with a special token (such "
                "as <|im_end|> or <|eot_id|>) that generation could stop at; use a chat model's tokenizer"
            )
        self.end_of_turn_id: int = ids[0]
        self._end_of_turn_text: str = tokenizer.convert_ids_to_tokens(ids[0])
        # Stop at the end of the turn first; the model's own EOS ids end a reply too.
        self.stop_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys((self.end_of_turn_id, *self.eos_token_ids))
        )

    @classmethod
    def for_model(cls, tokenizer: Any, model: Any, system_prompt: str | None = None) -> ChatFormat:
        """The format of `tokenizer`'s template, stopping also where `model`'s generation config stops."""
        return cls(tokenizer, system_prompt, generation_stop_ids(model))

    def with_system_prompt(self, system_prompt: str | None) -> ChatFormat:
        return ChatFormat(self.tokenizer, system_prompt, self.eos_token_ids)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def first_turn(self, user_text: str) -> list[int]:
        """Tokens of the opening prompt: optional system message, the user turn, the generation prompt."""
        return self.encode(self._render([("user", user_text)], generation_prompt=True))

    def next_turn(self, user_text: str) -> list[int]:
        """Tokens that follow a generated end-of-turn token: what the template writes after it (ChatML: a
        newline), the user turn and the generation prompt.

        Rendered as the suffix of a conversation with one more user message, behind a placeholder reply;
        what the template writes after the end-of-turn does not depend on the earlier turns' text.
        """
        text = self._render(
            [("user", "?"), ("assistant", _REPLY), ("user", user_text)], generation_prompt=True
        )
        after = text[text.rfind(_REPLY) + len(_REPLY) :]
        if not after.startswith(self._end_of_turn_text):
            raise UserError(
                f"the chat template closes an assistant turn with {after[:40]!r} before a user turn but "
                f"with {self._end_of_turn_text!r} as the last message: a conversation kept as one token "
                "stream cannot follow it"
            )
        return self.encode(after[len(self._end_of_turn_text) :])

    def assistant_reply(self, text: str) -> list[int]:
        """A scripted reply as the policy would emit it: content then the end-of-turn token (warm-up data)."""
        return [*self.encode(text), self.end_of_turn_id]

    def reply_text(self, token_ids: list[int]) -> str:
        """The text of a generated reply without the stop token that ended it."""
        ids = token_ids[:-1] if token_ids and token_ids[-1] in self.stop_token_ids else token_ids
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def _render(self, turns: list[tuple[str, str]], generation_prompt: bool) -> str:
        messages = [{"role": role, "content": content} for role, content in turns]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return str(
            self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
        )

    def _is_special(self, token_id: int) -> bool:
        added = getattr(self.tokenizer, "added_tokens_decoder", {}).get(token_id)
        return token_id in self.tokenizer.all_special_ids or bool(getattr(added, "special", False))
