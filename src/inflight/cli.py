"""The `inflight` command: run | serve | serve-engine | env serve | model tiny | bench | plot.

Heavy imports (torch, transformers) happen inside the subcommands so `--help` is instant. Errors a
user can fix print one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.util
import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import get_args

from inflight.errors import UserError
from inflight.types import DtypeName

BENCHMARKS = ("engine", "grpo", "pipeline", "serve", "sandbox", "train", "trl")


def _cmd_run(args: argparse.Namespace) -> int:
    from inflight.config import apply_overrides, check_overrides_apply, list_keys

    if args.list_keys and not args.target:
        print("\n".join(list_keys()))
        return 0
    from inflight.orchestrator.target import forms, resolve_target

    if not args.target:
        raise UserError(f"missing TARGET: {forms()}; e.g. `inflight run blackjack`")
    _check_target_spelling(args.target)
    task = resolve_target(args.target)
    overrides = list(args.overrides)
    if args.run_dir:
        overrides.append(f"run_dir={json.dumps(args.run_dir)}")
    cfg = apply_overrides(task.config(), overrides)
    if args.list_keys:  # with a target: every key and its value for this target and these overrides
        values = cfg.model_dump()
        for key in list_keys():
            value: object = values
            for part in key.split("."):
                value = value[part]  # type: ignore[index]
            print(f"{key}={json.dumps(value)}")
        return 0
    check_overrides_apply(cfg, list(args.overrides), task.name, plays_env=task.env is not None)
    from inflight.preflight import check_run

    check_run(cfg, task.name, task.env)
    from inflight.orchestrator.stopping import StopRequest, stop_on_signals

    # Ctrl-C or SIGTERM: the step in flight finishes, then the checkpoint and the summary (exit 130 / 143).
    with stop_on_signals(StopRequest()) as stop:
        if cfg.launcher == "ray":  # the same run, its engine replicas and trainer placed on a Ray cluster
            from inflight.launch.ray import run_on_ray
            from inflight.orchestrator.stopping import StoppedBeforeRun

            try:
                summary = run_on_ray(cfg, args.target, stop)
            except StoppedBeforeRun as e:  # while Ray placed the actors: no run, no summary
                print(f"inflight: {e}", file=sys.stderr)
                return e.exit_code
        else:
            from inflight.launch.local import run_local

            summary = run_local(cfg, task, stop)
    print(json.dumps(summary))
    stopped = summary.get("stopped")  # the signal that ended the training early, if one did
    return 0 if stopped is None else 128 + signal.Signals[stopped].value


def _check_target_spelling(target: str) -> None:
    """Two slips `resolve_target` can only call an unknown module: a setting where TARGET goes
    (`inflight run grpo.steps=3`), and a recipe misspelled (`blackjak`), named here with the likely fix."""
    from inflight.orchestrator.target import forms
    from inflight.recipes import RECIPES

    if "=" in target and not Path(target).exists():
        raise UserError(
            f"missing TARGET: {target!r} is a setting, and settings come after the TARGET: "
            f"`inflight run TARGET {target}` ({forms()})"
        )
    if not target.isidentifier() or target in RECIPES:
        return
    near = difflib.get_close_matches(target, sorted(RECIPES), n=1, cutoff=0.75)
    # A module of that name is what the user meant (resolve_target imports it): no suggestion then.
    if near and importlib.util.find_spec(target) is None:
        raise UserError(f"unknown target {target!r}: did you mean the recipe {near[0]}? ({forms()})")


def _cmd_model_tiny(args: argparse.Namespace) -> int:
    from inflight.models import build_tiny
    from inflight.preflight import ensure_dir

    out = build_tiny(ensure_dir(args.out, "--out"), preset=args.preset, seed=args.seed)
    print(json.dumps({"model_dir": str(out), "preset": args.preset, "seed": args.seed}))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.name is None:
        raise UserError(
            f"which benchmark? `inflight bench NAME [OPTIONS]`, NAME one of {', '.join(BENCHMARKS)} "
            "(e.g. `inflight bench engine`; its options: `inflight bench engine --help`)"
        )
    # Benchmarks live in the repository's benchmarks/ folder (next to src/), not in the package.
    root = Path(__file__).resolve().parents[2]
    if not (root / "benchmarks").is_dir():
        raise UserError(f"benchmarks/ not found next to {root / 'src'}: run from a source checkout")
    sys.path.insert(0, str(root))
    module = importlib.import_module(f"benchmarks.{args.name}")
    module.main(args.args)  # each benchmark prints its result as one JSON line, last
    return 0


def _parse_base_models(items: list[str]) -> dict[str, str]:
    models: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise UserError(f"--base-model expects NAME=DIR_OR_HUB_ID, got {item!r}")
        if name in models:  # the later one would replace the earlier without a word
            raise UserError(
                f"--base-model {name}= is given twice ({models[name]} and {path}): give each base model a "
                "name of its own"
            )
        models[name] = path
    return models


def _cmd_serve(args: argparse.Namespace) -> int:
    from inflight.auth import SERVE_API_KEY_ENV, TINKER_KEY_PREFIX, check_listening, keys_from
    from inflight.models.paths import resolve
    from inflight.preflight import check_port

    # Before the service's imports (torch, via the tinker SDK: seconds): these refusals are instant.
    api_keys = check_listening(args.host, keys_from(args.api_key, SERVE_API_KEY_ENV, TINKER_KEY_PREFIX))
    check_port(args.port)
    if args.ray_address is not None:
        if args.launcher != "ray":
            raise UserError(
                f"--ray-address={args.ray_address}: names the Ray cluster of --launcher ray, and this "
                "service's launcher is local: add --launcher ray, or drop --ray-address"
            )
        from inflight.launch.ray import check_address

        check_address(args.ray_address, "--ray-address")  # the cluster's answer: before uvicorn (app.py)
    base_models = _parse_base_models(args.base_model)
    for path in base_models.values():
        resolve(path)  # a missing model directory (the service checks the rest of each once it loads)
    from inflight.api.app import serve

    serve(
        base_models=base_models,
        db_url=args.db,
        host=args.host,
        port=args.port,
        api_keys=api_keys,
        state_dir=args.state_dir,
        dtype=args.dtype,
        device=args.device,
        shutdown_grace_s=args.shutdown_grace_s,
        engine=args.engine,
        launcher=args.launcher,
        ray_address=args.ray_address,
        max_models_per_key=args.max_models_per_key,
        max_queued_requests_per_key=args.max_queued_requests_per_key,
        max_tokens_per_train_request=args.max_tokens_per_train_request,
        max_train_tokens_per_round=args.max_train_tokens_per_round,
        max_checkpoint_gib_per_key=args.max_checkpoint_gib_per_key,
        request_body_timeout_s=args.request_body_timeout_s,
        session_expiry_s=args.session_expiry_s,
        request_header_timeout_s=args.request_header_timeout_s,
        send_timeout_s=args.send_timeout_s,
        max_connections=args.max_connections,
    )
    return 0


def _at_least_one(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def _finite(unit: str, minimum: float, bound: str, *, exclusive: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number of `unit` at least (or, `exclusive`, above) `minimum`; `bound`
    says which to the user (">= 0", "> 0")."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of {unit}, got {text!r}") from None
        low_enough = value <= minimum if exclusive else value < minimum
        if low_enough or not value < float("inf"):  # NaN fails both comparisons: refused here
            raise argparse.ArgumentTypeError(f"expected a finite number of {unit} {bound}, got {text!r}")
        return value

    return parse


_seconds = _finite("seconds", 0.0, ">= 0")
_positive_seconds = _finite("seconds", 0.0, "> 0", exclusive=True)
_positive_gib = _finite("GiB", 2**-30, "> 0")  # at least a byte
_positive_mib = _finite("MiB", 2**-10, ">= 1/1024")


def _cmd_serve_engine(args: argparse.Namespace) -> int:
    from inflight.inference.access import check_engine_listening, engine_api_keys
    from inflight.preflight import check_port

    # Before the server's imports (torch: seconds): these refusals are instant.
    api_keys = engine_api_keys(args.api_key)
    check_engine_listening(args.host, api_keys, args.weights_dir)
    check_port(args.port)
    for flag, value, least in [
        ("--max-batch-size", args.max_batch_size, 1),
        ("--max-seq-len-tokens", args.max_seq_len_tokens, 2),  # a prompt token and a generated one
        ("--max-lora-rank", args.max_lora_rank, 1),
        ("--max-logprobs", args.max_logprobs, 0),
    ]:
        if value is not None and value < least:
            raise UserError(f"{flag} must be >= {least}, got {value}")
    if args.weights_dir is not None and not Path(args.weights_dir).expanduser().is_dir():
        raise UserError(
            f"--weights-dir {args.weights_dir} is not a directory: create it (updates by path are read from "
            "it), or leave --weights-dir out"
        )
    # Options one backend reads and the other would ignore. Their parser default is None, so that one given
    # with the other backend is refused rather than dropped without a word; serve() holds the defaults.
    backend_only = {
        "builtin": ("kv_policy", "device"),
        "vllm": ("logprobs_kind", "max_lora_rank", "max_logprobs"),
    }
    given = {name: getattr(args, name) for names in backend_only.values() for name in names}
    for backend, names in backend_only.items():
        for name in names:
            if given[name] is not None and args.backend != backend:
                raise UserError(
                    f"--{name.replace('_', '-')} is for --backend {backend} only: drop it, or serve with "
                    f"--backend {backend}"
                )
    from inflight.inference.serve_engine import serve

    serve(
        model=args.model,
        host=args.host,
        port=args.port,
        max_batch_size=args.max_batch_size,
        backend=args.backend,
        max_seq_len_tokens=args.max_seq_len_tokens,
        weights_dir=args.weights_dir,
        parent_pid=args.parent_pid,
        api_keys=api_keys,
        request_header_timeout_s=args.request_header_timeout_s,
        request_body_timeout_s=args.request_body_timeout_s,
        max_body_bytes=int(args.max_body_mib * 2**20),
        max_connections=args.max_connections,
        **{name: value for name, value in given.items() if value is not None},
    )
    return 0


def _cmd_env_serve(args: argparse.Namespace) -> int:
    from inflight.envs.openenv_server import OpenEnvServerConfig, check_env_listening, env_api_keys, serve
    from inflight.preflight import check_port

    # Before openenv-core's import (seconds): these refusals are instant.
    api_keys = env_api_keys(args.api_key)
    check_env_listening(args.host, api_keys)
    check_port(args.port)
    if args.max_sessions < 1:
        raise UserError(f"--max-sessions must be >= 1, got {args.max_sessions}")
    serve(
        args.name,
        host=args.host,
        port=args.port,
        config=OpenEnvServerConfig(
            max_sessions=args.max_sessions,
            api_keys=api_keys,
            request_header_timeout_s=args.request_header_timeout_s,
            request_body_timeout_s=args.request_body_timeout_s,
            session_idle_timeout_s=args.session_idle_timeout_s,
            max_connections=args.max_connections,
        ),
    )
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from inflight.metrics.plot import plot_run
    from inflight.preflight import check_output_file

    print(plot_run(args.run_dir, check_output_file(args.out, "--out") if args.out else None))
    return 0


def _add_timeout_options(parser: argparse.ArgumentParser, body_default_s: float, body_note: str) -> None:
    """--request-header-timeout-s and --request-body-timeout-s, as `serve` has them, for the engine and env
    servers."""
    parser.add_argument(
        "--request-header-timeout-s",
        type=_positive_seconds,
        default=30.0,
        metavar="SECONDS",
        help="a request's head (request line and headers) must arrive whole this long after the connection "
        "opens, or after the request's first byte on a kept-alive connection, else 408 and the connection "
        "closes: a client that connects and sends nothing, or trickles headers, cannot hold connections "
        "open (default %(default)g)",
    )
    parser.add_argument(
        "--request-body-timeout-s",
        type=_positive_seconds,
        default=body_default_s,
        metavar="SECONDS",
        help="a request's body must arrive whole this long after its headers, else 408 and the connection "
        f"closes: a client trickling bodies cannot hold connections open (default %(default)g; {body_note})",
    )


def _add_max_connections_option(parser: argparse.ArgumentParser) -> None:
    """--max-connections, the same for the three servers (inflight/connections.py)."""
    parser.add_argument(
        "--max-connections",
        type=_at_least_one,
        default=None,
        metavar="N",
        help="connections open at once; one more is answered 503 with Retry-After and closed unread, so "
        "that a flood of connections cannot take the file descriptors the server's own files need (default: "
        "the open-files limit, which the server first raises to its hard limit up to 65536, less 256 kept "
        "for those files, at most 10000)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inflight", description="Asynchronous RL for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run",
        help="train on a task: a built-in recipe or your own",
        description="Train on a task, e.g. `inflight run blackjack grpo.steps=100 trainer.lr=3e-4` or "
        "`inflight run examples/letter_count.py`. Overrides are dotted config keys (see --list-keys). Runs "
        "the asynchronous pipeline by default (mode=async); mode=sync runs the on-policy reference loop. "
        "launcher=ray places its engine replicas and trainer on a Ray cluster (ray.address, "
        "ray.num_engine_replicas; needs `pip install 'inflight[ray]'`). "
        "engine.backend=vllm samples from vLLM (its CPU build, in an environment built on first use) in a "
        "process beside the run, or in each replica's actor with launcher=ray. "
        "A run directory with a checkpoint is resumed (not one of another task, nor one already past "
        "grpo.steps). Ctrl-C or SIGTERM stops it after the step in flight, with a checkpoint, the final "
        "evaluation and the summary; during the warm-up, with the warm-up's state, which the same command "
        "continues (exit code 130 / 143; a second signal quits at once). Prints one JSON summary line at "
        "the end. Writing a task: docs/bring-your-own-task.md.",
    )
    run.add_argument(
        "target",
        nargs="?",
        metavar="TARGET",
        help="a recipe (blackjack, guess_number, arithmetic, math, code, tools), a .py file, "
        "package.module[:attr], or openenv:URL",
    )
    run.add_argument(
        "overrides", nargs="*", help="config overrides, key=value (before, between or after the options)"
    )
    run.add_argument("--run-dir", help="where metrics, checkpoints and plots go (default runs/NAME-TIME)")
    run.add_argument(
        "--list-keys",
        action="store_true",
        help="print every config key and exit (with a TARGET: key=value, the target's preset with overrides)",
    )
    run.set_defaults(func=_cmd_run)

    serve = sub.add_parser(
        "serve",
        help="the Tinker-compatible training and sampling service",
        description="Serve Tinker's REST API (forward_backward, optim_step, sample, save_state, ...) for "
        "LoRA adapters over local base models; the official `tinker` SDK is the client. Example: "
        "`inflight serve --base-model tiny=/path/to/model --port 8000`. Prometheus metrics at /metrics; one "
        "JSON line per request on stdout; SIGTERM or Ctrl-C drains the requests in flight "
        "(--shutdown-grace-s) before it stops. Bad input is one line on stderr and exit code 2.",
    )
    serve.add_argument(
        "--base-model",
        action="append",
        required=True,
        metavar="NAME=DIR",
        help="a base model clients may name, and its directory or hub id (repeatable)",
    )
    serve.add_argument("--db", default=None, help="SQLAlchemy URL (default sqlite in --state-dir)")
    serve.add_argument(
        "--state-dir",
        default="inflight-serve",
        help="checkpoints and the default database (default %(default)s, in the current directory)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default %(default)s)")
    serve.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="accepted X-API-Key (repeatable), starting with tml- as every tinker SDK requires of its "
        "api_key, e.g. tml-$(openssl rand -hex 32); empty or blank keys are refused; each key is a tenant "
        "that sees only its own runs, checkpoints and futures (docs/security.md); without one, the key in "
        "$INFLIGHT_SERVE_API_KEY (out of `ps` and shell history), else none, and then the server only "
        "listens on loopback",
    )
    serve.add_argument(
        "--dtype",
        choices=get_args(DtypeName),
        default="auto",
        help="base weights' precision; LoRA adapters and their optimizer state stay float32 (default auto: "
        "bfloat16 where the device multiplies it natively, i.e. a CUDA GPU or a CPU with AVX512-BF16/AMX, "
        "else float32)",
    )
    serve.add_argument(
        "--device",
        default="auto",
        help="where base models, adapters, training and sampling run: auto (a CUDA GPU when there is one, "
        "else cpu), cpu, cuda or cuda:N",
    )
    serve.add_argument(
        "--shutdown-grace-s",
        type=_seconds,
        default=20.0,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, new work is refused (503) and the requests already accepted get this long "
        "to finish; what is left then fails with an error naming the shutdown (default 20; a second signal "
        "ends the wait at once)",
    )
    serve.add_argument(
        "--max-models-per-key",
        type=_at_least_one,
        default=64,
        metavar="N",
        help="models (LoRA adapters with their optimizer state, in memory until their session finishes) "
        "one API key may have loaded at once; a create beyond it is refused, naming how to free one "
        "(default %(default)s)",
    )
    serve.add_argument(
        "--max-queued-requests-per-key",
        type=_at_least_one,
        default=10_000,
        metavar="N",
        help="requests (training and samples) one API key may have queued or running at once; one more is "
        "recorded as failed, naming the limit, so that one key's backlog cannot slow every other key's "
        "(default %(default)s)",
    )
    serve.add_argument(
        "--max-tokens-per-train-request",
        type=_at_least_one,
        default=2**20,
        metavar="N",
        help="tokens in one forward or forward_backward request; a larger request fails, naming the limit "
        "(the tinker SDK splits a call into requests of at most 5 MB, which stay under the default "
        "%(default)s)",
    )
    serve.add_argument(
        "--max-train-tokens-per-round",
        type=_at_least_one,
        default=None,
        metavar="N",
        help="tokens of one forward or forward_backward request the worker runs before other keys' "
        "requests get their turn: a larger request runs in slices of whole datums, so another key's training "
        "waits for a slice of it, not all of it (default: two training micro-batches, 4096 tokens on a CPU, "
        "16384 on a GPU)",
    )
    serve.add_argument(
        "--max-checkpoint-gib-per-key",
        type=_positive_gib,
        default=50.0,
        metavar="GIB",
        help="disk one API key's unexpired checkpoints may take (their recorded sizes, in GiB, fractions "
        "allowed); a save beyond it fails naming how to make room (delete checkpoints, save with a TTL), and "
        "any save that would leave the state dir's disk under 1 GiB free fails too, whatever the key "
        "(default %(default)g)",
    )
    _add_timeout_options(serve, body_default_s=120.0, body_note="a 64 MiB body then needs ~0.5 MB/s")
    _add_max_connections_option(serve)
    serve.add_argument(
        "--send-timeout-s",
        type=_positive_seconds,
        default=60.0,
        metavar="SECONDS",
        help="an answer its client reads none of for this long (an archive download nobody reads) is "
        "abandoned and the connection closed; a client that reads, however slowly, is never cut off "
        "(default %(default)g)",
    )
    serve.add_argument(
        "--session-expiry-s",
        type=_positive_seconds,
        default=600.0,
        metavar="SECONDS",
        help="a session whose client sent no heartbeat (the SDK sends one every 10 s) and no request this "
        "long, with nothing queued or running, is finished and its models unloaded: a client that died "
        "without closing its session no longer holds them (default %(default)g)",
    )
    serve.add_argument(
        "--engine",
        choices=["builtin", "vllm"],
        default="builtin",
        help="who samples: the built-in engine in this process, or per base model a vLLM engine process "
        "(vLLM's CPU build, in the environment `python -m inflight.launch.vllm_env` builds on first use: "
        "~3.5 GB, minutes); training stays in this process. vLLM cannot adapt every model's LM head: "
        "there, LoRA clients must pass train_unembed=False",
    )
    serve.add_argument(
        "--launcher",
        choices=["local", "ray"],
        default="local",
        help="local: sampling and training in this process (or vLLM processes beside it); ray: each base "
        "model's sampling engine (built-in or vLLM) in an actor on a Ray cluster, reached over HTTP, and the "
        "training in an actor of its own (GPU bundles when --device is cuda; needs `pip install "
        "'inflight[ray]'`); the API and the futures database stay in this process",
    )
    serve.add_argument(
        "--ray-address",
        default=None,
        metavar="HOST:PORT",
        help="with --launcher ray only: the cluster's head, HOST:PORT (the port `ray start --head` opened, "
        "6379 by default; unset: a private local Ray; auto: the cluster this machine joined; "
        "ray://HOST:PORT: through Ray Client); a cluster with token authentication (`ray start --head` turns "
        "it on) wants RAY_AUTH_MODE=token and its token (docs/laptop-to-cluster.md)",
    )
    serve.set_defaults(func=_cmd_serve)

    serve_engine = sub.add_parser(
        "serve-engine",
        help="an inference engine behind HTTP (OpenAI-compatible + token-level generate + weight updates)",
        description="Serve one model's engine over HTTP: /v1/completions and /v1/chat/completions "
        "(OpenAI's shapes), /generate, /update_weights, /health; the pipeline's replicas "
        "(pipeline.engine_urls). Beyond loopback it needs an API key and --weights-dir (docs/security.md). "
        "Bad input is one line on stderr and exit code 2.",
    )
    serve_engine.add_argument("--model", required=True, help="model directory or hub id")
    serve_engine.add_argument(
        "--backend",
        choices=["builtin", "vllm"],
        default="builtin",
        help="inflight's own engine, or vLLM (run by the python `python -m inflight.launch.vllm_env` prints)",
    )
    serve_engine.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default %(default)s)"
    )
    serve_engine.add_argument(
        "--port", type=int, default=8100, help="port to listen on (default %(default)s)"
    )
    serve_engine.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="accepted X-API-Key (repeatable; also a bearer token on /v1/* and /metrics); without one, the "
        "key in $INFLIGHT_ENGINE_API_KEY (which the pipeline's clients send), else none, and then the server "
        "only listens on loopback. Every route but /health needs it",
    )
    serve_engine.add_argument("--max-batch-size", type=int, default=64, help="sequences decoded together")
    serve_engine.add_argument(
        "--device",
        default=None,
        help="built-in engine only: its device, cpu, cuda, cuda:N, or auto (cuda when there is one; "
        "default cpu)",
    )
    serve_engine.add_argument(
        "--kv-policy",
        choices=["keep", "recompute"],
        default=None,
        help="built-in engine only: on a weight update, sequences in flight keep their cache or re-prefill "
        "it with the new weights (default keep)",
    )
    serve_engine.add_argument(
        "--max-seq-len-tokens",
        type=int,
        default=None,
        help="prompt + completion, at most the model's positions (default: model limit, <=1024)",
    )
    serve_engine.add_argument(
        "--logprobs-kind",
        choices=["sampled", "raw"],
        default=None,
        help="vLLM only: the logprobs it reports under any sampling, one kind per engine (sampled: after "
        "temperature and top-k/top-p, what the pipeline trains with; raw: the model's own distribution, "
        "what the Tinker service returns; default sampled); the built-in engine serves both per request",
    )
    serve_engine.add_argument(
        "--max-lora-rank",
        type=int,
        default=None,
        help="vLLM only: the largest adapter rank it accepts (memory is reserved for it; default 16)",
    )
    serve_engine.add_argument(
        "--max-logprobs",
        type=int,
        default=None,
        help="vLLM only: the most top-k logprobs a request may ask for, per position (default 20)",
    )
    serve_engine.add_argument(
        "--weights-dir",
        default=None,
        help="weight and adapter updates by path (/update_weights, /set_adapter) read only files under "
        "this directory (default: any file this process can read; required beyond loopback)",
    )
    serve_engine.add_argument(
        "--max-body-mib",
        type=_positive_mib,
        default=256.0,
        metavar="MIB",
        help="the largest JSON body a request may send, in MiB (413 past it, before it is parsed): room for "
        "a /generate_batch of 4096 requests with 8192-token prompts (default %(default)g; weight and adapter "
        "bodies may take 16 GiB)",
    )
    _add_timeout_options(serve_engine, body_default_s=600.0, body_note="16 GiB of weights then need ~28 MB/s")
    _add_max_connections_option(serve_engine)
    serve_engine.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="stop when this process, the server's parent, exits (set by the launchers that start it)",
    )
    serve_engine.set_defaults(func=_cmd_serve_engine)

    env = sub.add_parser("env", help="environments")
    env_sub = env.add_subparsers(dest="env_command", required=True)
    env_serve = env_sub.add_parser(
        "serve",
        help="serve an inflight environment with OpenEnv's HTTP + WebSocket protocol",
        description="Serve a registered environment with OpenEnv's protocol (HTTP /reset /step /state "
        "/health and /ws sessions), e.g. for `inflight run TASK env.name=openenv:URL`. Beyond loopback it "
        "needs an API key (docs/security.md). Request bodies and /ws messages are at most 1 MiB (a larger "
        "/ws message closes its connection, code 1009). Bad input is one line on stderr and exit code 2.",
    )
    env_serve.add_argument("name", help="environment name, e.g. blackjack")
    env_serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    env_serve.add_argument(
        "--port",
        type=int,
        default=8200,
        help="default %(default)s; 0: a free one (the line printed names it)",
    )
    env_serve.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="accepted X-API-Key (repeatable); without one, the key in $INFLIGHT_ENV_API_KEY (which "
        "inflight's OpenEnv client sends), else none, and then the server only listens on loopback. Every "
        "route but /health needs it, the /ws handshake included",
    )
    env_serve.add_argument(
        "--max-sessions",
        type=int,
        default=256,
        help="concurrent /ws episodes (a run needs prompts x group size)",
    )
    _add_timeout_options(env_serve, body_default_s=30.0, body_note="bodies are at most 1 MiB")
    _add_max_connections_option(env_serve)
    env_serve.add_argument(
        "--session-idle-timeout-s",
        type=_positive_seconds,
        default=600.0,
        metavar="SECONDS",
        help="a WebSocket session (/ws) whose client sends no message this long while the server waits for "
        "one is closed (code 1001, the reason naming this option) and its env and slot freed: clients that "
        "connect and stay silent cannot hold every --max-sessions slot (default %(default)g)",
    )
    env_serve.set_defaults(func=_cmd_env_serve)

    model = sub.add_parser("model", help="build models")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    tiny = model_sub.add_parser(
        "tiny", help="build a small Qwen2 model + tokenizer locally, deterministically"
    )
    tiny.add_argument("--out", required=True, help="output directory (a Hugging Face model directory)")
    tiny.add_argument(
        "--preset", choices=["tiny", "small"], default="tiny", help="tiny: <=5M params; small: ~20M"
    )
    tiny.add_argument("--seed", type=int, default=0, help="same seed -> byte-identical files")
    tiny.set_defaults(func=_cmd_model_tiny)

    bench = sub.add_parser(
        "bench",
        help="run a benchmark; prints one JSON line last",
        description="Run one of the benchmarks in benchmarks/ (results and commands: docs/benchmarks.md), "
        "e.g. `inflight bench engine --batch-size 8`; its options: `inflight bench NAME --help`.",
    )
    # Optional here so that a missing NAME is _cmd_bench's line naming the benchmarks, not argparse's
    # "required: name, args" (a benchmark's arguments are all optional).
    bench.add_argument("name", nargs="?", choices=BENCHMARKS, metavar="NAME", help=", ".join(BENCHMARKS))
    bench.add_argument(
        "args", nargs=argparse.REMAINDER, help="the benchmark's options (all optional; see its --help)"
    )
    bench.set_defaults(func=_cmd_bench)

    plot = sub.add_parser("plot", help="write a PNG of a run's reward and loss curves")
    plot.add_argument("run_dir")
    plot.add_argument("--out", help="PNG path (default RUN_DIR/curves.png)")
    plot.set_defaults(func=_cmd_plot)
    return parser


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """parse_args, except that `inflight run`'s key=value settings may also follow its options
    (`inflight run task.py --run-dir X grpo.steps=2`). argparse fills a positional list once, from the
    words before the first option, and calls the later ones unrecognized; its intermixed parsing, which
    would collect them, refuses a parser with subcommands. So the leftover words are taken here: a
    key=value one is a setting (in order, after those before the options), anything else stays an error."""
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    settings = [a for a in extras if args.command == "run" and "=" in a and not a.startswith("-")]
    unknown = [a for a in extras if a not in settings]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if settings:
        args.overrides = [*args.overrides, *settings]
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        return int(args.func(args))
    except UserError as e:
        print(f"inflight: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("inflight: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
