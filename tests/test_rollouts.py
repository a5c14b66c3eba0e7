"""Episodes become single token streams: generated ids kept exactly, environment tokens masked out.

Reference: a hand-written fake engine that answers from a script (so every token is known).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from inflight.envs.blackjack import BlackJackEnv
from inflight.models import load_tokenizer
from inflight.rollouts.chat import ChatFormat
from inflight.rollouts.episodes import run_episodes, run_scripted_episode
from inflight.types import Completion, SampleRequest, SamplingParams, WeightUpdate


class ScriptedEngine:
    """Replies `hit` on the first turn of each episode and `stand` afterwards; version 7."""

    version = 7

    def __init__(self, chat: ChatFormat, replies: list[str]) -> None:
        self.chat, self.replies, self.requests = chat, replies, []

    def generate(self, requests: list[SampleRequest]) -> list[Completion]:
        out = []
        for req in requests:
            self.requests.append(req)
            turn = sum(1 for t in req.prompt_token_ids if t == self.chat.end_of_turn_id) // 2
            ids = self.chat.assistant_reply(self.replies[min(turn, len(self.replies) - 1)])
            out.append(
                Completion(
                    req.request_id,
                    req.prompt_token_ids,
                    ids,
                    [-0.5] * len(ids),
                    [self.version] * len(ids),
                    "stop",
                )
            )
        return out

    def update_weights(self, update: WeightUpdate) -> None:
        raise AssertionError("not used")


@pytest.fixture(scope="module")
def chat(tiny_model_dir: Path) -> ChatFormat:
    return ChatFormat(load_tokenizer(tiny_model_dir))


def test_multi_turn_episode_is_one_masked_stream(chat: ChatFormat) -> None:
    # Player 5 3, dealer up 10, hole 7; the player hits a 2 then stands on 10; dealer has 17.
    engine = ScriptedEngine(chat, ["hit", "stand"])
    cards = ["5", "10", "3", "7", "2"]

    class FixedHand(BlackJackEnv):
        def reset(self, seed=None, episode_id=None, **kwargs):  # type: ignore[override]
            return super().reset(cards=cards)

    [rollout] = run_episodes(
        engine, [FixedHand()], [0], ["g"], chat, SamplingParams(max_tokens=4), max_turns=8
    )
    assert rollout.reward == -1.0  # 10 loses to the dealer's 17
    assert rollout.metrics["turns"] == 2.0
    reply_ids = [chat.assistant_reply("hit"), chat.assistant_reply("stand")]
    generated = [t for t, m in zip(rollout.token_ids, rollout.loss_mask, strict=True) if m]
    assert generated == reply_ids[0] + reply_ids[1]
    assert all(v == 7 for v, m in zip(rollout.versions, rollout.loss_mask, strict=True) if m)
    assert all(
        v == -1 and lp == 0.0
        for v, lp, m in zip(rollout.versions, rollout.logprobs, rollout.loss_mask, strict=True)
        if not m
    )
    # The stream is exactly: first prompt, reply 1, environment turn, reply 2 (token-in/token-out).
    first = chat.first_turn("Your hand: 5 3 (8). Dealer shows: 10. hit or stand?")
    second = chat.next_turn("Your hand: 5 3 2 (10). Dealer shows: 10. hit or stand?")
    assert rollout.token_ids == first + reply_ids[0] + second + reply_ids[1]
    # The engine was asked with the end-of-turn stop token and the exact growing prefix.
    assert chat.end_of_turn_id in engine.requests[0].params.stop_token_ids
    assert engine.requests[1].prompt_token_ids == first + reply_ids[0] + second


def test_unparseable_reply_ends_with_format_penalty(chat: ChatFormat) -> None:
    engine = ScriptedEngine(chat, ["maybe"])
    seeds = [s for s in range(50) if not BlackJackEnv().reset(seed=s).done][:4]
    rollouts = run_episodes(
        engine,
        [BlackJackEnv() for _ in seeds],
        seeds,
        ["g"] * 4,
        chat,
        SamplingParams(max_tokens=4),
        max_turns=8,
    )
    assert [r.reward for r in rollouts] == [-1.0] * 4
    assert all(r.metrics["format_error"] == 1.0 for r in rollouts)


def test_hand_done_at_reset_has_no_policy_tokens(chat: ChatFormat) -> None:
    seed = next(s for s in range(1000) if BlackJackEnv().reset(seed=s).done)
    [rollout] = run_episodes(
        ScriptedEngine(chat, ["hit"]),
        [BlackJackEnv()],
        [seed],
        ["g"],
        chat,
        SamplingParams(max_tokens=4),
        max_turns=8,
    )
    assert rollout.num_generated == 0 and rollout.min_version == -1


def test_scripted_episode_matches_engine_layout(chat: ChatFormat) -> None:
    seed = next(s for s in range(1000) if not BlackJackEnv().reset(seed=s).done)
    scripted = run_scripted_episode(BlackJackEnv(), seed, lambda obs: "stand", chat, max_turns=8)
    [engine_made] = run_episodes(
        ScriptedEngine(chat, ["stand"]),
        [BlackJackEnv()],
        [seed],
        ["g"],
        chat,
        SamplingParams(max_tokens=4),
        max_turns=8,
    )
    assert scripted.token_ids == engine_made.token_ids
    assert scripted.loss_mask == engine_made.loss_mask
    assert scripted.reward == engine_made.reward


def test_turns_are_rendered_once_and_handed_out_as_copies(chat: ChatFormat) -> None:
    first = chat.first_turn("Your hand: 9 7 (16). Dealer shows: K. hit or stand?")
    fresh = ChatFormat(chat.tokenizer, chat.system_prompt, chat.eos_token_ids)
    assert first == fresh.first_turn("Your hand: 9 7 (16). Dealer shows: K. hit or stand?")
    first.append(-1)  # a caller extends its prompt: the cached turn stays as it was
    again = chat.first_turn("Your hand: 9 7 (16). Dealer shows: K. hit or stand?")
    assert again[-1] != -1 and again == fresh.first_turn(
        "Your hand: 9 7 (16). Dealer shows: K. hit or stand?"
    )
    assert (
        chat.next_turn("Dealer: K 6.") == fresh.next_turn("Dealer: K 6.") != chat.first_turn("Dealer: K 6.")
    )
