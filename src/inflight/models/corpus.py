"""The synthetic text the tiny tokenizer is trained on: deterministic, generated in code, no downloads.

It covers the words of the built-in tasks (BlackJack, guess-the-number, arithmetic, math, code, JSON) so
that their prompts and answers tokenize compactly. It knows nothing about models or tokenizer files.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Iterator

RANKS = ["Ace", "2", "3", "4", "5", "6", "7", "8", "9", "10", "Jack", "Queen", "King"]
SUITS = ["Hearts", "Diamonds", "Clubs", "Spades"]
# General English used in instructions, reasoning and feedback; word lists read best as prose.
WORDS = (  # noqa: SIM905
    "the a an and or but if then else when while of to in on at for with from by as is are was were be been "
    "you your I my we our it its this that these those there here what which who how why not no yes do "
    "does did done can could should would will must may might have has had get got make made take give "
    "let think step first second third next last final answer result number numbers value values total sum "
    "difference product quotient remainder equal equals greater less than more most least each every all "
    "some any many much few one two three four five six seven eight nine ten hundred thousand zero "
    "hand hands card cards dealer player shows showing hit stand bust busted win wins won lose lost draw "
    "push blackjack deck round game score points reward action choose choice play turn again "
    "guess guesses guessed higher lower correct wrong too high low between range secret try tries left "
    "compute calculate solve simplify evaluate find show prove given let suppose assume therefore so "
    "because since hence thus only also just very well good bad best new old same other another "
    "question problem solution example input output return print function list string integer float "
    "true false none null error test tests case cases check valid invalid format reply respond write "
    "word words line lines character name key keys item items count index length size time times "
    "please help helpful assistant user system message role content following below above before after "
    "start end begin stop continue until over under into out up down left right half double square root "
    "even odd prime factor multiple divide divided multiply multiplied add added subtract minus plus "
    "fraction decimal percent ratio angle triangle circle area perimeter radius length width height "
    "point line equation variable expression term coefficient degree polynomial root roots "
    "apples oranges books pages cost costs price dollars cents money buy buys sold sells pay paid spent "
    "store shop friend friends family people students class school teacher day days week weeks month "
    "year years hour hours minute minutes miles speed distance train car bus walk runs ran water "
    "bag box boxes cup cups piece pieces group groups team share shared split per rate age older younger"
).split()
PY_NAMES = "x y i j k n m s t a b xs ys nums items result total count value key acc left right mid".split()  # noqa: SIM905
PY_FUNCS = "solve add mul gcd fib is_prime reverse count_vowels max_value sum_list parse main f g".split()  # noqa: SIM905
PY_BUILTINS = "len range print int str list dict set sorted sum min max abs enumerate zip map".split()  # noqa: SIM905
LATEX = [r"\frac{1}{2}", r"\sqrt{2}", r"x^2", r"x^{2}", r"\cdot", r"\times", r"\div", r"\pi", r"\le", r"\ge"]
LATEX += [r"\neq", r"\left(", r"\right)", r"\sum_{i=1}^{n}", r"\text{and}", r"\quad", r"\dfrac{3}{4}"]


def _blackjack(rng: random.Random) -> str:
    cards = [f"{rng.choice(RANKS)} of {rng.choice(SUITS)}" for _ in range(rng.randint(2, 4))]
    total, dealer = rng.randint(4, 26), f"{rng.choice(RANKS)} of {rng.choice(SUITS)}"
    action = rng.choice(["hit", "stand"])
    return rng.choice(
        [
            f"Your hand: {', '.join(cards)} (total {total}). Dealer shows: {dealer}. Do you hit or stand?",
            f"Your hand is {' and '.join(cards)}, total {total}. The dealer shows {dealer}. hit or stand?",
            f"I have {total}, the dealer shows {rng.choice(RANKS)}. I will {action}. Action: {action}",
            f"You {rng.choice(['win', 'lose', 'push', 'bust'])}! Dealer total: {rng.randint(17, 26)}.",
            f"{action}\n{action.capitalize()}. Reply with one word: hit or stand. Answer: {action}",
        ]
    )


def _guess_number(rng: random.Random) -> str:
    lo, hi = sorted(rng.sample(range(0, 1001), 2))
    guess = rng.randint(lo, hi)
    return rng.choice(
        [
            f"I am thinking of a number between {lo} and {hi}. What is your guess?",
            f"My guess is {guess}. Guess: {guess}",
            f"{guess} is too {rng.choice(['high', 'low'])}. {rng.choice(['Higher', 'Lower'])}! "
            f"You have {rng.randint(1, 9)} guesses left.",
            f"Correct! The number was {guess}. You found it in {rng.randint(1, 10)} tries.",
            f"higher\nlower\nGuess a number from {lo} to {hi}.",
        ]
    )


def _arithmetic(rng: random.Random) -> str:
    a, b, op = rng.randint(0, 999), rng.randint(1, 99), rng.choice("+-*/")
    value = {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
    return rng.choice(
        [
            f"What is {a} {op} {b}?",
            f"What is {a} {op} {b}? Answer: {value}",
            f"Compute ({a} + {b}) * {rng.randint(2, 9)}. The answer is \\boxed{{{value}}}.",
            f"{a} {op} {b} = {value}. So the final answer is {value}.",
            f"Solve for x: {rng.randint(2, 9)}x + {a} = {b}. Let's think step by step.",
        ]
    )


def _math(rng: random.Random) -> str:
    parts = rng.sample(LATEX, 3)
    n = rng.randint(1, 100)
    return rng.choice(
        [
            f"Let $x = {n}$. Then $x^2 = {n * n}$, so the answer is $\\boxed{{{n * n}}}$.",
            f"We have $${parts[0]} + {parts[1]} = {parts[2]}$$ and therefore \\boxed{{{n}}}.",
            f"The area of a circle of radius {n} is ${n * n}\\pi$. Final answer: \\boxed{{{n * n}\\pi}}",
            f"Simplify \\frac{{{n}}}{{{n + rng.randint(1, 9)}}}. Put your final answer in \\boxed{{}}.",
        ]
    )


def _python(rng: random.Random) -> str:
    name, args = rng.choice(PY_FUNCS), rng.sample(PY_NAMES, rng.randint(1, 3))
    x, y = rng.sample(PY_NAMES, 2)
    body = rng.choice(
        [
            f"    return {' + '.join(args)}\n",
            f"    {x} = 0\n    for {y} in range({args[0]}):\n        {x} += {y} * 2\n    return {x}\n",
            f"    if {args[0]} <= 1:\n        return {args[0]}\n    return {name}({args[0]} - 1)\n",
            f"    {x} = [{y} for {y} in {args[0]} if {y} % 2 == 0]\n"
            f"    return {rng.choice(PY_BUILTINS)}({x})\n",
            f"    while {args[0]} != 0:\n        {args[0]}, {x} = {x} % {args[0]}, {args[0]}\n"
            f"    return {x}\n",
        ]
    )
    call = f"print({name}({', '.join(str(rng.randint(0, 20)) for _ in args)}))"
    return f"```python\ndef {name}({', '.join(args)}):\n{body}\n\n{call}\n```"


def _json(rng: random.Random) -> str:
    keys = rng.sample(["name", "role", "content", "answer", "reward", "done", "score", "action", "id"], 3)
    values = [rng.choice(['"hit"', '"stand"', "true", "false", "null", str(rng.randint(0, 99)), "[1, 2]"])]
    values += ['{"ok": true}', f"{rng.random():.3f}"]
    return "{" + ", ".join(f'"{k}": {v}' for k, v in zip(keys, values, strict=True)) + "}"


def _identifiers(rng: random.Random) -> str:
    # snake_case names and attribute access give each word its "_word" and ".word" pre-tokens.
    a, b, c = rng.sample(WORDS, 3)
    return rng.choice(
        [
            f"{a}_{b} = {c}.{a}_{b}({rng.choice(PY_NAMES)})",
            f"self.{a} = {b}_{c}\nreturn self.{b}.get({a!r})",
            f"class {a.capitalize()}{b.capitalize()}:\n    {c}: int = {rng.randint(0, 9)}",
            f"# {a.capitalize()} {b} {c}.\n{c}_{a}.append({b})",
        ]
    )


def _prose(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(4, 14))]
    sentence = " ".join(words)
    return sentence[0].upper() + sentence[1:] + rng.choice([".", "?", "!", ":", ","])


GENERATORS: list[Callable[[random.Random], str]] = [
    _blackjack,
    _guess_number,
    _arithmetic,
    _math,
    _python,
    _json,
    _identifiers,
    _prose,
    _prose,
]


def synthetic_corpus(num_lines: int, seed: int = 1234) -> Iterator[str]:
    """Yield `num_lines` texts; the same arguments always yield the same texts in the same order."""
    rng = random.Random(seed)
    # Printable ASCII once, and each common word bare and capitalised, so every such word can merge.
    yield string.printable
    yield " ".join(WORDS + [w.capitalize() for w in WORDS] + PY_NAMES + PY_FUNCS + PY_BUILTINS)
    for _ in range(num_lines):
        yield rng.choice(GENERATORS)(rng)
