"""The token layout of multi-turn episodes kept as one token stream (token-in/token-out), read from the
tokenizer's own chat template (ChatML, Llama 3, ...), and the tokens that end a policy turn.

Generated tokens are never re-tokenised: each turn appends the engine's exact ids, then the tokens the
template puts between an assistant's end-of-turn token and the next assistant reply (the environment's
message as a user turn and the generation prompt). It knows nothing of engines or environments.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from inflight.errors import UserError
from inflight.models.chat_template import (
    REPLY_PLACEHOLDER,
    end_of_turn,
    generation_stop_ids,
    render,
    reply_stop_ids,
)

__all__ = ["ChatFormat", "generation_stop_ids"]  # generation_stop_ids: re-exported from its new home

MAX_CACHED_TURNS = 65_536  # per ChatFormat; the cache starts over when full


class ChatFormat:
    """`eos_token_ids`: the ids generation stops at besides the end-of-turn token, usually the model's
    generation config's (`ChatFormat.for_model`)."""

    def __init__(
        self, tokenizer: Any, system_prompt: str | None = None, eos_token_ids: Sequence[int] = ()
    ) -> None:
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.eos_token_ids = tuple(eos_token_ids)
        self.end_of_turn_id, self._end_of_turn_text = end_of_turn(tokenizer, system_prompt)
        # Stop at the end of the turn first; the model's own EOS ids end a reply too.
        self.stop_token_ids: tuple[int, ...] = reply_stop_ids(self.end_of_turn_id, self.eos_token_ids)
        # Rendered and encoded turns by (kind, user text): a template render and an encode cost ~0.3 ms,
        # and a GRPO group's samples, or an evaluation's repeated hands, open with the same turn.
        self._turns: dict[tuple[str, str], tuple[int, ...]] = {}

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
        return self._cached("first", user_text, self._first_turn)

    def _first_turn(self, user_text: str) -> list[int]:
        return self.encode(self._render([("user", user_text)], generation_prompt=True))

    def next_turn(self, user_text: str) -> list[int]:
        """Tokens that follow a generated end-of-turn token: what the template writes after it (ChatML: a
        newline), the user turn and the generation prompt (see `_next_turn`)."""
        return self._cached("next", user_text, self._next_turn)

    def _cached(self, kind: str, user_text: str, make: Callable[[str], list[int]]) -> list[int]:
        key = (kind, user_text)
        tokens = self._turns.get(key)
        if tokens is None:
            if len(self._turns) >= MAX_CACHED_TURNS:
                self._turns.clear()
            tokens = self._turns[key] = tuple(make(user_text))
        return list(tokens)

    def _next_turn(self, user_text: str) -> list[int]:
        """Tokens that follow a generated end-of-turn token: what the template writes after it (ChatML: a
        newline), the user turn and the generation prompt.

        Rendered as the suffix of a conversation with one more user message, behind a placeholder reply;
        what the template writes after the end-of-turn does not depend on the earlier turns' text.
        """
        text = self._render(
            [("user", "?"), ("assistant", REPLY_PLACEHOLDER), ("user", user_text)], generation_prompt=True
        )
        after = text[text.rfind(REPLY_PLACEHOLDER) + len(REPLY_PLACEHOLDER) :]
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
        return render(self.tokenizer, messages, generation_prompt)
