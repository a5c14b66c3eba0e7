"""TARGET -> Task: what `inflight run TARGET` names, resolved with one-line errors that say what was expected.

A TARGET is a built-in recipe name (`inflight.recipes.RECIPES`), a path to a Python file, `package.module`,
either of those followed by `:ATTR`, or `openenv:URL`. What the code there provides is, in this order of
preference: `load_problems(split)` and `async generate_rollout(ctx, problem)` (PipelineRL's pair); a
`make_env(**kwargs)` factory; one Environment subclass (OpenEnv's shape). Beside it the module may define
`preset()`, `warmup_reply(seen, rng)` and `summarize(cfg, initial, final)` (docs/bring-your-own-task.md).

It lives in the orchestrator, beside the Task it builds and the `run()` that takes one, and not in
`recipes/`: a built-in recipe is one kind of target, resolved exactly like a user's file, so the
mechanism that loads targets cannot belong to it. Imports the target's code; knows nothing of training.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any, cast

from inflight.envs.base import EnvFactory, Environment
from inflight.errors import UserError, describe
from inflight.orchestrator.task import Task, env_task
from inflight.recipes import RECIPES

EXPECTED = (
    "a task defines `def load_problems(split) -> list[dict]` and `async def generate_rollout(ctx, problem) "
    "-> Rollout`, or an Environment subclass, or a `make_env(**kwargs)` factory (docs/bring-your-own-task.md)"
)
# What each optional function must accept: (name, positional arguments, signature shown in messages).
OPTIONAL = (
    ("preset", 0, "def preset() -> RunConfig"),
    ("warmup_reply", 2, "def warmup_reply(seen, rng) -> str"),
    ("summarize", 3, "def summarize(cfg, initial, final) -> dict"),
)


def forms() -> str:
    return (
        f"TARGET is a recipe name ({', '.join(sorted(RECIPES))}), a path to a .py file, "
        "package.module[:attr] or openenv:URL"
    )


def resolve_target(target: str) -> Task:
    """The Task `target` names; UserError (one line) for anything else."""
    if target.startswith("openenv:"):
        url = target.removeprefix("openenv:")
        if not url:
            raise UserError("openenv: needs the server's URL, e.g. openenv:http://127.0.0.1:8200")
        from inflight.envs.openenv_client import OpenEnvClientEnv

        return env_task("openenv", functools.partial(OpenEnvClientEnv, url))
    if target in RECIPES:
        return _from_module(importlib.import_module(RECIPES[target]), target, f"recipe {target!r}")
    where, sep, attr = target.rpartition(":")
    if not (sep and attr.isidentifier()):
        where, attr = target, ""
    if where.endswith(".py") or "/" in where:
        path = Path(where).expanduser()
        if not path.is_file():
            raise UserError(f"no such file: {where} ({forms()})")
        module, name = _load_file(path), path.stem
    else:
        module, name = _import(where, target), where.rpartition(".")[2]
    if not attr:
        return _from_module(module, name, where)
    if not hasattr(module, attr):
        raise UserError(f"{where} has no {attr!r} ({EXPECTED})")
    return _from_object(getattr(module, attr), module, name, f"{where}:{attr}")


def _load_file(path: Path) -> ModuleType:
    """Import a .py file as `python FILE` would: its directory importable (for its own helpers)."""
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:8]
    stem = re.sub(r"\W", "_", path.stem)
    name = f"inflight_target_{stem}_{digest}"
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise UserError(f"{path} cannot be imported as Python ({forms()})")
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs: dataclasses and pickling look their module up in sys.modules.
    sys.modules[name] = module
    if str(resolved.parent) not in sys.path:
        sys.path.insert(0, str(resolved.parent))
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        line = next(
            (
                f" (line {f.lineno})"
                for f in reversed(traceback.extract_tb(e.__traceback__))
                if f.filename == str(resolved)
            ),
            "",
        )
        raise UserError(f"importing {path} failed{line}: {describe(e)}") from None
    return module


def _import(module_name: str, target: str) -> ModuleType:
    # A module or package in the current directory imports as `python -m` would find it (a console script
    # does not put the directory on sys.path); appended, so an installed module of the same name wins.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise UserError(
                f"unknown target {target!r}: no recipe, file or module of that name; {forms()}"
            ) from None
        raise UserError(f"importing {module_name} failed: {describe(e)}") from None
    except (ValueError, TypeError):  # not a module name at all ("", "..x")
        raise UserError(f"unknown target {target!r}; {forms()}") from None
    except Exception as e:
        raise UserError(f"importing {module_name} failed: {describe(e)}") from None


def _from_module(module: Any, name: str, where: str) -> Task:
    if hasattr(module, "generate_rollout"):
        return _rollout_task(module, module, name, where)
    factory = _env_factory(module, where)
    if factory is None and callable(getattr(module, "load_problems", None)):  # half of the rollout pair
        raise UserError(
            f"{where} has load_problems but no `async def generate_rollout(ctx, problem) -> Rollout` (it "
            "plays one problem and returns its Rollout; docs/bring-your-own-task.md)"
        )
    if factory is None:
        raise UserError(f"{where} provides no task: {EXPECTED}")
    return env_task(name, factory, **_optional(module, where))


def _from_object(obj: Any, module: ModuleType, name: str, where: str) -> Task:
    """`FILE:ATTR` or `module:attr`: an Env class or factory, or an object with the rollout pair."""
    if inspect.isclass(obj) and _is_env_class(obj):  # an Environment, or any class with reset and step
        return env_task(name, cast(EnvFactory, obj), **_optional(module, where))
    if hasattr(obj, "generate_rollout"):
        return _rollout_task(obj, module, name, where)
    if inspect.iscoroutinefunction(obj):
        raise UserError(f"{where} is a rollout function: name its module instead ({EXPECTED})")
    if callable(obj) and not inspect.isclass(obj):
        return env_task(name, obj, **_optional(module, where))  # a factory: what it returns is checked at run
    raise UserError(f"{where} is a {type(obj).__name__}, not a task: {EXPECTED}")


def _rollout_task(obj: Any, module: Any, name: str, where: str) -> Task:
    generate, load = obj.generate_rollout, getattr(obj, "load_problems", None)
    if not callable(load):
        raise UserError(
            f"{where} has generate_rollout but no `def load_problems(split) -> list[dict]` (its train and "
            "test problems)"
        )
    if not (inspect.iscoroutinefunction(generate) and _accepts(generate, 2)):
        raise UserError(
            f"{where}: generate_rollout must be `async def generate_rollout(ctx, problem) -> Rollout`, not "
            f"`{_shown(generate)}`"
        )
    if not _accepts(load, 1):
        raise UserError(
            f"{where}: load_problems must be `def load_problems(split) -> list[dict]`, not `{_shown(load)}`"
        )
    # The object's own preset/warmup_reply/summarize first, then its module's.
    return Task(name, load, generate, **(_optional(module, where) | _optional(obj, where)))


def _env_factory(module: Any, where: str) -> Any:
    """A module's `make_env`, else its one concrete Environment subclass (one defined there first)."""
    from inflight.envs.base import make_env as registry_make_env

    make = getattr(module, "make_env", None)
    if callable(make) and make is not registry_make_env:  # `from inflight.envs import make_env` is no task
        return make
    classes = [v for v in vars(module).values() if inspect.isclass(v) and _is_env_class(v, strict=True)]
    own = [c for c in classes if c.__module__ == module.__name__] or classes
    if len(own) > 1:
        names = ", ".join(sorted(c.__name__ for c in own))
        raise UserError(
            f"{where} holds several Environment classes ({names}): name one as {where}:{own[0].__name__}"
        )
    return own[0] if own else None


def _is_env_class(cls: type, strict: bool = False) -> bool:
    """An instantiable Environment subclass; unless `strict`, any class with reset() and step() too."""
    if issubclass(cls, Environment):
        return not inspect.isabstract(cls)
    return not strict and callable(getattr(cls, "reset", None)) and callable(getattr(cls, "step", None))


def _optional(obj: Any, where: str) -> dict[str, Any]:
    """The optional functions `obj` defines, checked: {name: function}."""
    found = {}
    for name, args, shown in OPTIONAL:
        fn = getattr(obj, name, None)
        if fn is None:
            continue
        if not (callable(fn) and _accepts(fn, args)):
            raise UserError(f"{where}: {name} must be `{shown}`, not `{_shown(fn)}`")
        found[name] = fn
    return found


def _accepts(fn: Any, num_args: int) -> bool:
    """Whether `fn(a, b, ...)` with `num_args` positional arguments binds."""
    try:
        inspect.signature(fn).bind(*([None] * num_args))
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): let the call tell
        return True
    return True


def _shown(fn: Any) -> str:
    if not callable(fn):
        return f"{type(fn).__name__} {fn!r:.40}"
    try:
        signature = str(inspect.signature(fn))
    except (TypeError, ValueError):
        signature = "(...)"
    prefix = "async def" if inspect.iscoroutinefunction(fn) else "def"
    return f"{prefix} {getattr(fn, '__name__', type(fn).__name__)}{signature}"
