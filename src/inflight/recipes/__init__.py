"""Built-in tasks, each written exactly as a user writes one (docs/bring-your-own-task.md): an Env
(`make_env`) or PipelineRL's pair (`load_problems`, `generate_rollout`), plus `preset()` and, where the task
has them, `warmup_reply` and `summarize`. `inflight run NAME` resolves them like any other target
(`orchestrator/target.py`); this table only maps names to modules.
"""

from __future__ import annotations

RECIPES: dict[str, str] = {
    "blackjack": "inflight.recipes.blackjack",
    "arithmetic": "inflight.recipes.arithmetic",
    "math": "inflight.recipes.math",
    "code": "inflight.recipes.code",
    "tools": "inflight.recipes.tools",
    "guess_number": "inflight.recipes.guess_number",
}
