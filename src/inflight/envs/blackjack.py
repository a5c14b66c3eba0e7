"""BlackJack as a text environment: infinite deck, dealer peeks and stands on soft 17, hit/stand only.

Owns the rules, the prompt text, basic strategy and evaluation on fixed hands; knows nothing of tokens.
One seed fixes a hand's whole card sequence, so every rollout of a GRPO group faces the same cards.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

from pydantic import Field

from inflight.envs.base import Environment, State, TextAction, TextObservation, episode_seeds, play_episodes
from inflight.errors import UserError

Move = Literal["hit", "stand"]
Outcome = Literal["blackjack", "win", "push", "loss", "bust", "format_error"]
RANKS = ("A", "2", "3", "4", "5", "6", "7", "8", "9", "10", "J", "Q", "K")  # uniform draws: infinite deck
VALUE = {rank: min(i + 1, 10) for i, rank in enumerate(RANKS)}  # the ace counts 1 here, 11 when soft
COUNTERS = ("hands", "format_errors", "busts", "wins", "losses", "pushes", "naturals")
_COUNTER = {"blackjack": "wins", "win": "wins", "push": "pushes", "loss": "losses", "bust": "losses"}
_COUNTER["format_error"] = "format_errors"
_RESULT = {"blackjack": "Blackjack! You win", "win": "You win", "push": "Push", "loss": "You lose"}
_RESULT |= {"bust": "You lose", "format_error": "Invalid action (reply hit or stand); hand forfeited"}


def parse_action(text: str) -> Move | None:
    """The move named by `text` alone (case and surrounding whitespace ignored), else None."""
    word = text.strip().lower()
    return "hit" if word == "hit" else "stand" if word == "stand" else None


def hand_total(cards: Sequence[str]) -> tuple[int, bool]:
    """Best total of `cards` and whether it is soft (an ace counted as 11)."""
    hard = sum(map(VALUE.__getitem__, cards))
    return (hard + 10, True) if hard <= 11 and "A" in cards else (hard, False)


def basic_strategy(player_total: int, soft: bool, dealer_up: int) -> Move:
    """Hit/stand-only basic strategy, infinite deck, S17, dealer peeks; `dealer_up` is 2-11 (ace = 11).

    Source: Wizard of Odds, "4-Deck to 8-Deck Blackjack Strategy", dealer stands on soft 17
    (wizardofodds.com/games/blackjack/strategy/4-decks/), read without doubling (D = hit, Ds = stand);
    tests/test_blackjack.py re-derives every cell from exact infinite-deck expected values.
    """
    if not 2 <= dealer_up <= 11:
        raise ValueError(f"dealer_up must be 2-10, or 11 for an ace; got {dealer_up}")
    if soft:  # soft 18 stands only vs 2-8: a dealer 9, 10 or ace makes 19+ often enough to beat it
        return "stand" if player_total >= 19 or (player_total == 18 and dealer_up <= 8) else "hit"
    if 12 <= player_total <= 16:  # a stiff hand stands only when the dealer's up-card busts often
        return "stand" if (4 if player_total == 12 else 2) <= dealer_up <= 6 else "hit"
    return "hit" if player_total <= 11 else "stand"


class Shoe:
    """The card sequence of one hand: drawn lazily from `random.Random(seed)`, or an explicit list."""

    def __init__(self, seed: int | None = None, cards: Sequence[str] | None = None) -> None:
        if (seed is None) == (cards is None):
            raise ValueError("Shoe needs exactly one of seed or cards")
        if unknown := [c for c in cards or () if c not in RANKS]:
            raise UserError(f"unknown cards {unknown}: use rank labels {' '.join(RANKS)}")
        self._rng = random.Random(seed) if cards is None else None
        self._cards, self._next = list(cards or ()), 0

    def draw(self) -> str:
        if self._rng is not None:
            return RANKS[int(13 * self._rng.random())]  # 2x faster than randrange; bias < 1e-15
        if self._next == len(self._cards):
            raise RuntimeError(f"the explicit card list ran out after {self._next} cards")
        self._next += 1
        return self._cards[self._next - 1]


class Hand:
    """The rules of one hand, without text. Deal order: player, dealer up, player, dealer hole; then the
    player's hits, then the dealer's draws. Naturals settle at the deal because the dealer peeks."""

    def __init__(self, shoe: Shoe) -> None:
        self.shoe = shoe
        first, up, second, hole = shoe.draw(), shoe.draw(), shoe.draw(), shoe.draw()
        self.player, self.dealer = [first, second], [up, hole]
        self.total, self.soft = hand_total(self.player)
        self.dealer_value = 11 if up == "A" else VALUE[up]  # basic_strategy's `dealer_up`
        self.natural = self.total == 21
        self.outcome: Outcome | None = None
        self.reward = 0.0
        if hand_total(self.dealer)[0] == 21:
            self._end("push" if self.natural else "loss", 0.0 if self.natural else -1.0)
        elif self.natural:
            self._end("blackjack", 1.5)

    def hit(self) -> None:
        self.player.append(self.shoe.draw())
        self.total, self.soft = hand_total(self.player)
        if self.total > 21:
            self._end("bust", -1.0)

    def stand(self) -> None:
        while (dealer := hand_total(self.dealer)[0]) < 17:  # a soft 17 totals 17: the dealer stands (S17)
            self.dealer.append(self.shoe.draw())
        if dealer > 21 or self.total > dealer:
            self._end("win", 1.0)
        else:
            self._end("push" if self.total == dealer else "loss", 0.0 if self.total == dealer else -1.0)

    def forfeit(self, penalty: float) -> None:
        self._end("format_error", penalty)

    def _end(self, outcome: Outcome, reward: float) -> None:
        self.outcome, self.reward = outcome, reward


class BlackJackObservation(TextObservation):
    """One turn as the policy sees it; once done, `prompt` states the outcome and the dealer's cards."""

    player_cards: list[str]
    player_total: int
    soft: bool
    dealer_upcard: str
    dealer_value: int  # 2-11, the ace as 11: basic_strategy's `dealer_up`
    dealer_cards: list[str]  # the up-card while the hand is live; every dealer card once it is done
    legal_actions: list[str]  # empty once done
    outcome: Outcome | None = None


class BlackJackState(State):
    seed: int | None = None  # None when the hand came from an explicit card list
    player_cards: list[str] = Field(default_factory=list)
    dealer_cards: list[str] = Field(default_factory=list)  # hidden while the hand is live
    outcome: Outcome | None = None


class BlackJackEnv(Environment[TextAction, BlackJackObservation, BlackJackState]):
    """One hand per episode; an unparseable action ends it with reward `format_penalty`.

    Counters split finished hands into wins, losses, pushes and format_errors; busts are losses and
    naturals are the player's two-card 21s (wins or pushes). A finished hand's metadata says whether it
    ended in a format error and how many of its decisions were not basic strategy's (`strategy_errors`):
    averaged over hands, a measure of the policy that does not wait on the cards' luck as the return does.
    """

    blocking = False  # quick pure Python: called on the event loop, no thread hop (`Environment.blocking`)

    def __init__(self, format_penalty: float = -1.0, seed: int | None = None) -> None:
        self.format_penalty = format_penalty
        self._seed = seed  # seeds the hand seeds drawn when reset() gets neither seed nor cards
        self._seeds: random.Random | None = None
        self._hand: Hand | None = None
        self._episode: tuple[str | None, int | None] = (None, None)  # episode_id, hand seed
        self._steps = 0
        self._strategy_errors = 0  # this hand's parsed decisions other than basic strategy's
        self._counters = dict.fromkeys(COUNTERS, 0)

    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        cards: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> BlackJackObservation:
        """Deal from `seed`, or from `cards` in deal order (player, up, player, hole, then draws)."""
        if kwargs:
            raise UserError(f"BlackJackEnv.reset got unknown arguments {sorted(kwargs)}; use seed, cards")
        if seed is None and cards is None:
            self._seeds = self._seeds or random.Random(self._seed)
            seed = self._seeds.getrandbits(63)
        self._hand = Hand(Shoe(seed=seed) if cards is None else Shoe(cards=cards))
        self._episode, self._steps = (episode_id, seed if cards is None else None), 0
        self._strategy_errors = 0
        self._counters["hands"] += 1
        return self._observe(self._hand)

    def step(self, action: TextAction, timeout_s: float | None = None, **kwargs: Any) -> BlackJackObservation:
        hand = self._hand
        if hand is None or hand.outcome is not None:
            raise RuntimeError("BlackJackEnv.step called before reset() or after the hand ended")
        move = parse_action(action.text)
        if move is not None and move != basic_strategy(hand.total, hand.soft, hand.dealer_value):
            self._strategy_errors += 1
        if move is None:
            hand.forfeit(self.format_penalty)
        elif move == "hit":
            hand.hit()
        else:
            hand.stand()
        self._steps += 1
        return self._observe(hand)

    @property
    def state(self) -> BlackJackState:
        hand = self._hand
        return BlackJackState(
            episode_id=self._episode[0],
            step_count=self._steps,
            seed=self._episode[1],
            player_cards=list(hand.player) if hand else [],
            dealer_cards=list(hand.dealer) if hand else [],
            outcome=hand.outcome if hand else None,
        )

    @property
    def counters(self) -> dict[str, int]:
        return dict(self._counters)

    def _observe(self, hand: Hand) -> BlackJackObservation:
        up = hand.dealer[0]
        you = f"Your hand: {' '.join(hand.player)} ({_describe(hand.player)})."
        obs: dict[str, Any] = dict(
            prompt=f"{you} Dealer shows: {up}. hit or stand?",
            player_cards=list(hand.player),
            player_total=hand.total,
            soft=hand.soft,
            dealer_upcard=up,
            dealer_value=hand.dealer_value,
            dealer_cards=[up],
            legal_actions=["hit", "stand"],
        )
        if hand.outcome is not None:  # every finished hand passes here exactly once
            self._counters[_COUNTER[hand.outcome]] += 1
            self._counters["busts"] += hand.outcome == "bust"
            self._counters["naturals"] += hand.natural
            dealer = f"Dealer: {' '.join(hand.dealer)} ({_describe(hand.dealer)})."
            reward = f"{hand.reward:+g}" if hand.reward else "0"
            obs.update(
                prompt=f"{you} {dealer} {_RESULT[hand.outcome]} ({reward}).",
                dealer_cards=list(hand.dealer),
                legal_actions=[],
                outcome=hand.outcome,
                done=True,
                reward=hand.reward,
                metadata={
                    "format_error": int(hand.outcome == "format_error"),
                    "strategy_errors": self._strategy_errors,
                },
            )
        return BlackJackObservation(**obs)


def _describe(cards: Sequence[str]) -> str:
    total, soft = hand_total(cards)
    if total == 21 and len(cards) == 2:
        return "blackjack"
    return f"soft {total}" if soft else f"{total}, bust" if total > 21 else str(total)


def play_hands(
    policy: Callable[[BlackJackObservation], str], seeds: Iterable[int], format_penalty: float = -1.0
) -> list[float]:
    """Reward of each hand dealt from `seeds`. A batched policy calls `play_episodes` (or drives a
    `TextEnvBatch`) with `lambda: BlackJackEnv(format_penalty)` itself."""
    one_by_one = lambda batch: [policy(obs) for obs in batch]  # noqa: E731
    return play_episodes(lambda: BlackJackEnv(format_penalty), one_by_one, seeds)


def expected_return(policy: Callable[[BlackJackObservation], str], num_hands: int, seed: int = 0) -> float:
    """Mean reward over the fixed hands `episode_seeds(num_hands, seed)`: every policy sees equal cards."""
    return sum(play_hands(policy, episode_seeds(num_hands, seed))) / num_hands


def basic_strategy_policy(obs: BlackJackObservation) -> str:
    return basic_strategy(obs.player_total, obs.soft, obs.dealer_value)
