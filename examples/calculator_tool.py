"""A multi-turn task with a tool: multiply two numbers, with a calculator the policy may call.

The policy replies `<calc>EXPRESSION</calc>` to use the calculator (its result comes back as the next
user turn, masked out of the loss like all environment text) or `<answer>NUMBER</answer>` to finish.
Reward 1 for the right product. The warm-up's scripted replies call the calculator on unrelated numbers
and answer with what it returned: the protocol, never the solution.

    inflight run examples/calculator_tool.py
"""

import ast
import operator
import random
import re

from inflight.config import EvalConfig, GRPOConfig, RunConfig, SamplingConfig, WarmupConfig
from inflight.rollouts.api import RolloutContext
from inflight.types import Rollout

MAX_TURNS = 3  # up to two calculator calls, then an answer
CALC = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
RESULT = re.compile(r"<result>(.*?)</result>")
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> str:
    """+, - and * over integers; anything else is an error message (the tool never runs code)."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("only integers, +, - and *")

    try:
        return str(value(ast.parse(expression[:100], mode="eval").body))
    except (SyntaxError, ValueError) as e:
        return f"error: {e}"


def load_problems(split: str) -> list[dict]:
    rng = random.Random(0 if split == "train" else 1)
    return [{"a": rng.randint(10, 99), "b": rng.randint(10, 99)} for _ in range(1000)]


async def generate_rollout(ctx: RolloutContext, problem: dict) -> Rollout:
    chat = ctx.chat()
    chat.user(f"What is {problem['a']} * {problem['b']}? Use <calc>...</calc>, answer <answer>N</answer>.")
    correct, calls = False, 0
    for turn in range(MAX_TURNS):
        reply = await chat.assistant()
        if answer := ANSWER.search(reply):
            correct = int(answer.group(1)) == problem["a"] * problem["b"]
            break
        call = CALC.search(reply)
        if call is None or turn == MAX_TURNS - 1:
            break  # neither a call nor an answer, or no turn left to answer in: wrong
        calls += 1
        chat.user(f"<result>{calculate(call.group(1))}</result>")
    return chat.to_rollout(float(correct), {"correct": float(correct), "calculator_calls": float(calls)})


def warmup_reply(transcript: str, rng: random.Random) -> str:
    """Call the calculator on unrelated numbers, then answer with whatever it returned."""
    results = RESULT.findall(transcript)
    if not results:
        return f"<calc>{rng.randint(10, 99)} * {rng.randint(10, 99)}</calc>"
    return f"<answer>{results[-1]}</answer>"


def preset() -> RunConfig:
    return RunConfig(
        sampling=SamplingConfig(max_tokens_per_turn=16),
        grpo=GRPOConfig(
            steps=100, prompts_per_step=8, group_size=8, advantage="mean_std", max_turns=MAX_TURNS
        ),
        warmup=WarmupConfig(sft_steps=50, sft_batch_size=32, sft_lr=3e-3, tokens="all"),
        eval=EvalConfig(num_episodes=100, every_steps=25, num_episodes_during=50),
    )
