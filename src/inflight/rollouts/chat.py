"""ChatML token layout for multi-turn episodes kept as one token stream (token-in/token-out).

Generated tokens are never re-tokenised: each turn appends the engine's exact ids, then the
environment's next message rendered as a user turn plus the assistant generation prompt.
"""

from __future__ import annotations

from typing import Any


class ChatFormat:
    def __init__(self, tokenizer: Any, system_prompt: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if not isinstance(end, int) or end == tokenizer.unk_token_id:
            raise ValueError("ChatFormat needs a ChatML tokenizer with an <|im_end|> token")
        self.end_of_turn_id: int = end

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def first_turn(self, user_text: str) -> list[int]:
        """Tokens of the opening prompt: optional system message, the user turn, the generation prompt."""
        messages = [{"role": "user", "content": user_text}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.encode(text)

    def next_turn(self, user_text: str) -> list[int]:
        """Tokens that follow a generated `<|im_end|>`: the newline, the user turn, the generation prompt."""
        return self.encode(f"\n<|im_start|>user\n{user_text}<|im_end|>\n<|im_start|>assistant\n")

    def assistant_reply(self, text: str) -> list[int]:
        """A scripted reply as the policy would emit it: content then `<|im_end|>` (for warm-up data)."""
        return [*self.encode(text), self.end_of_turn_id]

    def reply_text(self, token_ids: list[int]) -> str:
        """The text of a generated reply without its end-of-turn token."""
        ids = token_ids[:-1] if token_ids and token_ids[-1] == self.end_of_turn_id else token_ids
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))
