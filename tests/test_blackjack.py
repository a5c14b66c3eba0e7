"""BlackJack rules, parsing, determinism and policy returns.

References: standard casino BlackJack rules (infinite deck, dealer peeks, stands on soft 17, natural
pays 3:2); the Wizard of Odds basic strategy tables (4-8 decks, S17) read without doubling. Returns are
checked against exact expected values computed below by an independent dynamic program.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from functools import cache

import pytest

from inflight.envs import TextAction, episode_seeds, play_episodes
from inflight.envs.blackjack import (
    BlackJackEnv,
    BlackJackObservation,
    Hand,
    Shoe,
    basic_strategy,
    basic_strategy_policy,
    expected_return,
    parse_action,
    play_hands,
)
from inflight.errors import UserError

# --- the exact reference: infinite deck, S17, peek; ace = 1 in hard sums -----------------------------
CARD_P = {v: (4 if v == 10 else 1) / 13 for v in range(1, 11)}
Decide = Callable[[int, bool, int], float]  # (total, soft, dealer_up 2-11) -> probability of hitting


def _best(hard: int, ace: bool) -> tuple[int, bool]:
    return (hard + 10, True) if ace and hard <= 11 else (hard, False)


@cache
def _dealer_final(hard: int, ace: bool) -> dict[int, float]:
    """Distribution of the dealer's final total (22 = bust) from a hard sum and whether it holds an ace."""
    total = _best(hard, ace)[0]
    if total >= 17:
        return {min(total, 22): 1.0}
    out: dict[int, float] = {}
    for card, p in CARD_P.items():
        for final, q in _dealer_final(hard + card, ace or card == 1).items():
            out[final] = out.get(final, 0.0) + p * q
    return out


def _dealer_given_up(up: int) -> tuple[dict[int, float], float]:
    """Dealer final totals given the up-card and no dealer natural, and P(no natural)."""
    out: dict[int, float] = {}
    for hole, p in CARD_P.items():
        if {up, hole} != {1, 10}:
            for final, q in _dealer_final(up + hole, 1 in (up, hole)).items():
                out[final] = out.get(final, 0.0) + p * q
    norm = sum(out.values())
    return {k: v / norm for k, v in out.items()}, norm


def _stand_ev(total: int, dealer: dict[int, float]) -> float:
    return sum(
        q * (1 if final == 22 or total > final else 0 if total == final else -1)
        for final, q in dealer.items()
    )


def exact_return(decide: Decide) -> float:
    ev = 0.0
    for up, p_up in CARD_P.items():
        dealer, p_no_natural = _dealer_given_up(up)

        @cache
        def value(hard: int, ace: bool, up: int = up, dealer: dict[int, float] = dealer) -> float:
            total, soft = _best(hard, ace)
            if total > 21:
                return -1.0
            p_hit = decide(total, soft, 11 if up == 1 else up)
            hit = sum(p * value(hard + c, ace or c == 1) for c, p in CARD_P.items()) if p_hit else 0.0
            return p_hit * hit + (1 - p_hit) * _stand_ev(total, dealer)

        for a, pa in CARD_P.items():
            for b, pb in CARD_P.items():
                natural = {a, b} == {1, 10}
                live = 1.5 if natural else value(a + b, 1 in (a, b))
                ev += p_up * pa * pb * ((1 - p_no_natural) * (0.0 if natural else -1.0) + p_no_natural * live)
    return ev


def test_basic_strategy_is_the_exact_hit_stand_optimum() -> None:
    for up in range(1, 11):
        dealer, _ = _dealer_given_up(up)

        @cache
        def best_ev(hard: int, ace: bool, dealer: dict[int, float] = dealer) -> float:
            total = _best(hard, ace)[0]
            if total > 21:
                return -1.0
            hit = sum(p * best_ev(hard + c, ace or c == 1) for c, p in CARD_P.items())
            return max(hit, _stand_ev(total, dealer))

        for hard in range(4, 21):
            for ace in (False, True):
                total, soft = _best(hard, ace)
                hit = sum(p * best_ev(hard + c, ace or c == 1) for c, p in CARD_P.items())
                optimum = "hit" if hit > _stand_ev(total, dealer) else "stand"
                assert basic_strategy(total, soft, 11 if up == 1 else up) == optimum, (total, soft, up)


# --- rules on explicit card lists: player, dealer up, player, dealer hole, then hits, then draws ------
RULE_CASES = [  # name, cards, actions, reward, outcome, final player total, dealer's cards at the end
    ("natural pays 3:2", "A 9 K 7", "", 1.5, "blackjack", 21, "9 7"),
    ("both naturals push", "A A K Q", "", 0.0, "push", 21, "A Q"),
    ("dealer natural ends the hand at reset", "10 A 7 K", "", -1.0, "loss", 17, "A K"),
    ("dealer natural with a ten up", "9 Q 9 A", "", -1.0, "loss", 18, "Q A"),
    ("player bust", "10 9 6 7 K", "hit", -1.0, "bust", 26, "9 7"),
    ("dealer bust", "10 6 8 10 K", "stand", 1.0, "win", 18, "6 10 K"),
    ("dealer stands on soft 17 (A+6)", "10 A 8 6", "stand", 1.0, "win", 18, "A 6"),
    ("dealer stands on a 3-card soft 17", "10 2 8 4 A", "stand", 1.0, "win", 18, "2 4 A"),
    ("dealer hits hard 16", "10 10 9 6 4", "stand", -1.0, "loss", 19, "10 6 4"),
    ("dealer hits soft 16", "10 A 9 5 4", "stand", -1.0, "loss", 19, "A 5 4"),
    ("push at equal totals", "10 K Q J", "stand", 0.0, "push", 20, "K J"),
    ("ace re-valued: A+6 then 10 is hard 17", "A 9 6 8 10", "hit stand", 0.0, "push", 17, "9 8"),
    ("three aces and a 9 make hard 12", "A 10 A 7 A 9", "hit hit stand", -1.0, "loss", 12, "10 7"),
    ("a 3-card 21 pays 1, not 1.5", "A 10 A 7 9", "hit stand", 1.0, "win", 21, "10 7"),
]


@pytest.mark.parametrize(("name", "cards", "actions", "reward", "outcome", "total", "dealer"), RULE_CASES)
def test_rules_table(
    name: str, cards: str, actions: str, reward: float, outcome: str, total: int, dealer: str
) -> None:
    env = BlackJackEnv()
    obs = env.reset(cards=cards.split())  # the explicit list raises if the dealer draws past its end
    for action in actions.split():
        assert not obs.done and obs.legal_actions == ["hit", "stand"]
        obs = env.step(TextAction(text=action))
    assert (obs.done, obs.reward, obs.outcome) == (True, reward, outcome), name
    assert (obs.player_total, obs.dealer_cards, obs.legal_actions) == (total, dealer.split(), []), name


def test_soft_totals_through_a_hand() -> None:
    env = BlackJackEnv()
    obs = env.reset(cards=["A", "10", "A", "7", "A", "9"])
    assert (obs.player_total, obs.soft, obs.dealer_value) == (12, True, 10)
    assert obs.prompt == "Your hand: A A (soft 12). Dealer shows: 10. hit or stand?"
    obs = env.step(TextAction(text="hit"))
    assert (obs.player_total, obs.soft, obs.dealer_cards) == (13, True, ["10"])  # hole card stays hidden
    obs = env.step(TextAction(text="hit"))
    assert (obs.player_total, obs.soft) == (12, False)
    assert env.reset(cards=["5", "A", "6", "2"]).dealer_value == 11


def test_prompts_state_the_outcome() -> None:
    env = BlackJackEnv()
    obs = env.reset(cards=["10", "9", "6", "8", "5"])
    assert obs.prompt == "Your hand: 10 6 (16). Dealer shows: 9. hit or stand?"
    obs = env.step(TextAction(text="hit"))
    assert obs.prompt == "Your hand: 10 6 5 (21). Dealer shows: 9. hit or stand?"
    obs = env.step(TextAction(text="stand"))
    assert obs.prompt == "Your hand: 10 6 5 (21). Dealer: 9 8 (17). You win (+1)."
    assert env.reset(cards=["A", "9", "K", "7"]).prompt.endswith(
        "Dealer: 9 7 (16). Blackjack! You win (+1.5)."
    )
    obs = env.reset(cards=["10", "9", "6", "8", "K"])
    assert (
        env.step(TextAction(text="hit")).prompt
        == "Your hand: 10 6 K (26, bust). Dealer: 9 8 (17). You lose (-1)."
    )


@pytest.mark.parametrize("text", ["hit", "HIT", "  Hit\n", "\tstand ", "STAND"])
def test_parse_accepts_the_bare_word(text: str) -> None:
    assert parse_action(text) == text.strip().lower()


@pytest.mark.parametrize("text", ["", "hit me", "stand.", "I stand", "h", "hitstand", "<hit>", "stay"])
def test_parse_rejects_anything_else(text: str) -> None:
    assert parse_action(text) is None


def test_unparseable_action_ends_the_hand_with_the_format_penalty() -> None:
    env = BlackJackEnv(format_penalty=-2.0)
    env.reset(cards=["10", "9", "6", "8"])
    obs = env.step(TextAction(text="I think I will hit"))
    assert (obs.done, obs.reward, obs.outcome, obs.metadata) == (
        True,
        -2.0,
        "format_error",
        {"format_error": 1, "strategy_errors": 0},
    )
    assert "Invalid action" in obs.prompt
    assert env.counters["format_errors"] == 1 and env.counters["losses"] == 0
    env.reset(cards=["10", "9", "6", "8"])
    # Parsed despite the spaces and capital; standing on 16 against a 9 is not basic strategy's choice.
    assert env.step(TextAction(text=" Stand ")).metadata == {"format_error": 0, "strategy_errors": 1}
    with pytest.raises(RuntimeError, match="after the hand ended"):
        env.step(TextAction(text="hit"))


def test_counters_partition_finished_hands() -> None:
    env = BlackJackEnv(seed=0)
    for i in range(2000):
        obs = env.reset()
        while not obs.done:
            obs = env.step(TextAction(text="hit" if i % 3 else "?"))
    c = env.counters
    assert c["hands"] == 2000 == c["wins"] + c["losses"] + c["pushes"] + c["format_errors"]
    assert 0 < c["busts"] <= c["losses"] and 0 < c["naturals"] <= c["wins"] + c["pushes"]


def test_strategy_errors_count_a_hands_decisions_other_than_basic_strategys() -> None:
    env = BlackJackEnv()
    # Hard 12 against a dealer's 2: basic strategy hits; standing is one error.
    env.reset(cards=["10", "2", "2", "10", "10"])
    assert env.step(TextAction(text="stand")).metadata["strategy_errors"] == 1
    # Hard 10 against a 6: hit (right) to 16, then hit again (wrong: 16 stands against a 6) and bust.
    env.reset(cards=["4", "6", "6", "10", "6", "9"])
    assert not env.step(TextAction(text="hit")).done
    obs = env.step(TextAction(text="hit"))
    assert obs.done and obs.outcome == "bust" and obs.metadata["strategy_errors"] == 1
    # Basic strategy itself makes none, on every hand; always standing makes some on most seeds.
    errors = {"basic": 0.0, "stand": 0.0}
    for policy in errors:
        for seed in range(500):
            obs = env.reset(seed=seed)
            while not obs.done:
                move = basic_strategy_policy(obs) if policy == "basic" else "stand"
                obs = env.step(TextAction(text=move))
            errors[policy] += obs.metadata["strategy_errors"]
    assert errors["basic"] == 0 and errors["stand"] > 100, errors


def test_bad_inputs_fail_fast() -> None:
    with pytest.raises(UserError, match="unknown card"):
        BlackJackEnv().reset(cards=["A", "1", "K", "7"])
    with pytest.raises(UserError, match="unknown arguments"):
        BlackJackEnv().reset(seed=1, deck=6)
    with pytest.raises(RuntimeError, match="ran out after 5 cards"):
        env = BlackJackEnv()
        env.reset(cards=["10", "10", "6", "2", "2"])
        env.step(TextAction(text="stand"))  # the dealer's 14 must draw again
    with pytest.raises(RuntimeError, match="before reset"):
        BlackJackEnv().step(TextAction(text="hit"))


# --- determinism and common random numbers --------------------------------------------------------
def _draw_order(obs: BlackJackObservation) -> list[str]:
    p, d = obs.player_cards, obs.dealer_cards
    return [p[0], d[0], p[1], d[1], *p[2:], *d[2:]]


def test_same_seed_same_actions_same_hand() -> None:
    a, b = BlackJackEnv(), BlackJackEnv()
    for seed in range(200):
        oa, ob = a.reset(seed=seed), b.reset(seed=seed)
        while not oa.done:
            oa, ob = a.step(TextAction(text="hit")), b.step(TextAction(text="hit"))
        assert oa == ob and a.state.seed == seed
    seeded = BlackJackEnv(seed=5), BlackJackEnv(seed=5)  # unseeded resets draw hand seeds from the env seed
    assert [seeded[0].reset() for _ in range(5)] == [seeded[1].reset() for _ in range(5)]


def test_different_actions_from_one_seed_face_the_same_cards() -> None:
    env = BlackJackEnv()
    for seed in range(300):
        shoe = Shoe(seed=seed)
        stream = [shoe.draw() for _ in range(30)]
        for hits in range(3):
            obs = env.reset(seed=seed)
            for _ in range(hits):
                obs = obs if obs.done else env.step(TextAction(text="hit"))
            obs = obs if obs.done else env.step(TextAction(text="stand"))
            order = _draw_order(obs)
            assert order == stream[: len(order)], (seed, hits)


# --- returns: every policy on the same hands, against the exact values ----------------------------
def _play_core(decide: Callable[[int, bool, int], str], seeds: list[int]) -> list[float]:
    """The rules core without text or pydantic: fast enough for 10^5 hands per policy."""
    rewards = []
    for seed in seeds:
        hand = Hand(Shoe(seed=seed))
        while hand.outcome is None:
            hand.hit() if decide(hand.total, hand.soft, hand.dealer_value) == "hit" else hand.stand()
        rewards.append(hand.reward)
    return rewards


def test_env_path_and_rules_core_agree_hand_by_hand() -> None:
    seeds = episode_seeds(3000, seed=1)
    assert play_hands(basic_strategy_policy, seeds) == _play_core(basic_strategy, seeds)
    batched = play_episodes(
        BlackJackEnv, lambda b: [basic_strategy_policy(o) for o in b], seeds, batch_size=256
    )
    assert batched == _play_core(basic_strategy, seeds)
    assert (
        expected_return(basic_strategy_policy, 3000, seed=1) == sum(_play_core(basic_strategy, seeds)) / 3000
    )


def _check_mean(name: str, rewards: list[float], exact: float) -> float:
    """The sample mean, asserted within 4 standard errors of the exact value."""
    n = len(rewards)
    mean = sum(rewards) / n
    stderr = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1) / n)
    assert abs(mean - exact) < 4 * stderr, f"{name}: {mean:.4f} over {n} hands, exact {exact:.4f}"
    return mean


def test_returns_match_exact_values_and_basic_strategy_wins() -> None:
    # ~15 us a hand here: basic strategy gets 100k hands (4 standard errors = 0.015), the others 25k;
    # every policy plays the same first 25k hands, so the comparison has common random numbers.
    seeds = episode_seeds(100_000, seed=2024)
    exact_basic = exact_return(lambda t, s, u: float(basic_strategy(t, s, u) == "hit"))
    assert exact_basic == pytest.approx(-0.02421, abs=1e-5)
    basic = _play_core(basic_strategy, seeds)
    assert -0.045 < _check_mean("basic", basic, exact_basic) < -0.005

    coin = random.Random(0)
    others: dict[str, tuple[Callable[[int, bool, int], str], Decide, float]] = {
        "always_stand": (lambda t, s, u: "stand", lambda t, s, u: 0.0, -0.16038),
        "hit_below_17": (
            lambda t, s, u: "hit" if t < 17 else "stand",
            lambda t, s, u: float(t < 17),
            -0.05675,
        ),
        "random": (lambda t, s, u: coin.choice(("hit", "stand")), lambda t, s, u: 0.5, -0.34226),
    }
    basic_mean = sum(basic[:25_000]) / 25_000
    for name, (decide, exact_decide, known) in others.items():
        exact = exact_return(exact_decide)
        assert exact == pytest.approx(known, abs=1e-5)
        mean = _check_mean(name, _play_core(decide, seeds[:25_000]), exact)
        assert basic_mean > mean, name
