"""The service's compute engine (`inflight.api.compute`) on the tiny model, against naive references: the bare
Hugging Face model for log-probs and greedy decoding, one-by-one runs for the batched multi-adapter pass,
Tinker's loss formulas written out per token (reference/tinker-api.md §7.3), and torch.optim.AdamW.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from inflight.api.compute import ServiceCompute, ServiceComputeConfig
from inflight.api.job_types import (
    Datum,
    ForwardBackwardJob,
    ForwardBackwardOutput,
    LoraSpec,
    OptimStep,
    ProvenanceSpan,
)
from inflight.errors import UserError
from inflight.models import load_model

VOCAB = 2048
EOS = 2


def _engine(model_dir: Path, **config) -> ServiceCompute:
    """float32 unless a test names the dtype: these tests hold the engine to float32 references exactly (the
    bfloat16 engine has its own tests, test_service_engine_bfloat16.py)."""
    config = {"seed": 0, "dtype": "float32", "sample_kv_cache_mb": 64, **config}
    return ServiceCompute({"tiny": str(model_dir)}, max_rank=32, config=ServiceComputeConfig(**config))


@pytest.fixture
def engine(tiny_model_dir: Path) -> ServiceCompute:
    return _engine(tiny_model_dir)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path):
    return load_model(tiny_model_dir).eval()


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _datum(tokens: list[int], **inputs: list[float]) -> Datum:
    """Tinker's shifted datum: input tokens[:-1], target tokens[1:], other inputs one per target."""
    return Datum(input_tokens=tokens[:-1], loss_fn_inputs={"target_tokens": tokens[1:], **inputs})


def _ok(result: ForwardBackwardOutput | Exception):
    assert not isinstance(result, Exception), result
    return result


def _forward_logprobs(engine: ServiceCompute, model_id: str, tokens: list[int]) -> list[float]:
    out = engine.forward_backward(
        [ForwardBackwardJob(model_id, [_datum(tokens)], "cross_entropy", backward=False)]
    )
    return _ok(out[0]).loss_fn_outputs[0]["logprobs"]


def _hf_logprobs(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens[:-1]])).logits[0]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None]).squeeze(1)


def _train(engine: ServiceCompute, model_id: str, steps: int, lr: float = 0.02, seed: int = 0) -> None:
    for step in range(steps):
        data = [_datum(_tokens(12, seed * 100 + step)), _datum(_tokens(7, seed * 100 + step + 50))]
        _ok(engine.forward_backward([ForwardBackwardJob(model_id, data, "cross_entropy")])[0])
        engine.optim_step(OptimStep(model_id, learning_rate=lr))


def _rl_datum(tokens: list[int], seed: int, prompt: int = 3) -> Datum:
    """An RL datum like the cookbook's: prompt positions carry A = 0 and q = 0."""
    g = torch.Generator().manual_seed(seed)
    n = len(tokens) - 1
    q = (-3 - torch.rand(n, generator=g) * 5).tolist()
    a = (torch.randn(n, generator=g)).tolist()
    q[:prompt], a[:prompt] = [0.0] * prompt, [0.0] * prompt
    return _datum(tokens, logprobs=q, advantages=a)


# ---- forward / backward --------------------------------------------------------------------------------


def test_fresh_adapter_equals_the_base_model(engine, hf_model):
    engine.create_adapter("m", "tiny", LoraSpec(rank=8, seed=1, train_unembed=True))
    tokens = _tokens(20, seed=1)
    torch.testing.assert_close(
        torch.tensor(_forward_logprobs(engine, "m", tokens)),
        _hf_logprobs(hf_model, tokens),
        rtol=0,
        atol=1e-5,
    )


def _three_adapters(engine: ServiceCompute) -> None:
    engine.create_adapter("a", "tiny", LoraSpec(rank=8, seed=1))
    engine.create_adapter("b", "tiny", LoraSpec(rank=4, seed=2, train_unembed=True))
    engine.create_adapter("c", "tiny", LoraSpec(rank=16, seed=3, train_mlp=False))
    for i, model_id in enumerate("abc"):  # distinct nonzero adapters (a fresh one has B = 0)
        _train(engine, model_id, steps=2, seed=i)


def _mixed_jobs() -> list[ForwardBackwardJob]:
    return [
        ForwardBackwardJob(
            "a", [_datum(_tokens(15, 1)), _datum(_tokens(6, 2), weights=[0.5, 0, 1, 2, -1])], "cross_entropy"
        ),
        ForwardBackwardJob("b", [_rl_datum(_tokens(11, 3), seed=3)], "importance_sampling"),
        ForwardBackwardJob("c", [_rl_datum(_tokens(9, 4), seed=4), _rl_datum(_tokens(13, 5), seed=5)], "ppo"),
        ForwardBackwardJob("a", [_rl_datum(_tokens(10, 6), seed=6)], "cispo", {"clip_high_threshold": 2.0}),
        ForwardBackwardJob("b", [_datum(_tokens(8, 7))], "cross_entropy", backward=False),
    ]


def _copy_adapters(source: ServiceCompute, targets: list[ServiceCompute], tmp_path: Path) -> None:
    """The adapters a, b, c of `source` (weights and AdamW state) into each of `targets`: engines whose
    passes round differently would train apart, most of all under Adam, whose updates follow the sign."""
    for model_id in "abc":
        source.save_state(model_id, tmp_path / model_id)
        for target in targets:
            target.load_state(model_id, tmp_path / model_id, load_optimizer=True)


# (logprob atol, metric rel, gradient atol relative to its scale). float32: sums in another order; entries
# four orders of magnitude below the largest gradient differ by up to ~1.5e-5 of it (how much depends on
# the rounding of the log-softmax kernel in use). bfloat16: a 64-row bmm and a 1-row mm may round the
# LoRA terms differently (measured: logprobs equal, gradients within 4e-3 of their scale). A routing or
# accumulation bug differs by the order of the scale itself.
_BATCHED_TOLERANCE = {"float32": (1e-5, 1e-4, 1e-4), "bfloat16": (1e-3, 1e-3, 1e-2)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batched_multi_adapter_pass_equals_one_by_one_runs(tiny_model_dir, tmp_path, dtype):
    """One call with every job (several adapters, ranks, losses, a forward-only job) gives the same outputs
    and accumulated gradients as one call per job on an identical engine whose micro-batches hold a
    single datum each."""
    batched = _engine(tiny_model_dir, dtype=dtype)
    serial = _engine(tiny_model_dir, max_batch_tokens=1, dtype=dtype)
    _three_adapters(batched)
    _copy_adapters(batched, [serial], tmp_path)
    jobs = _mixed_jobs()
    together = [_ok(r) for r in batched.forward_backward(jobs)]
    alone = [_ok(serial.forward_backward([job])[0]) for job in jobs]
    lp_atol, metric_rel, grad_atol = _BATCHED_TOLERANCE[dtype]
    for one, other in zip(together, alone, strict=True):
        assert one.metrics.keys() == other.metrics.keys()
        for key in one.metrics:
            assert one.metrics[key] == pytest.approx(other.metrics[key], rel=metric_rel, abs=1e-5), key
        for d1, d2 in zip(one.loss_fn_outputs, other.loss_fn_outputs, strict=True):
            for key in ("logprobs", "elementwise_loss"):
                torch.testing.assert_close(
                    torch.tensor(d1[key]), torch.tensor(d2[key]), rtol=1e-4, atol=lp_atol
                )
    for model_id in "abc":
        g1, g2 = batched.adapter_gradients(model_id), serial.adapter_gradients(model_id)
        assert sum(float(g.abs().sum()) for g in g1.values()) > 0
        for key in g1:
            scale = float(g2[key].abs().max())
            torch.testing.assert_close(g1[key], g2[key], rtol=1e-4, atol=grad_atol * scale)


def test_bfloat16_engine_stays_close_to_float32(tiny_model_dir, tmp_path):
    """bfloat16 base weights (adapters and their optimizer stay float32) give the float32 engine's log-probs
    within bfloat16's rounding and the same gradients up to a percent (measured: logprobs within 4e-3,
    cosine >= 0.9993, total relative error <= 1%); the optimizer step lands in float32 weights."""
    reference, half = _engine(tiny_model_dir), _engine(tiny_model_dir, dtype="bfloat16")
    assert (reference.model_info("tiny")["dtype"], half.model_info("tiny")["dtype"]) == (
        "float32",
        "bfloat16",
    )
    _three_adapters(reference)
    _copy_adapters(reference, [half], tmp_path)
    jobs = _mixed_jobs()
    expected = [_ok(r) for r in reference.forward_backward(jobs)]
    got = [_ok(r) for r in half.forward_backward(jobs)]
    for one, other in zip(got, expected, strict=True):
        for d1, d2 in zip(one.loss_fn_outputs, other.loss_fn_outputs, strict=True):
            torch.testing.assert_close(
                torch.tensor(d1["logprobs"]), torch.tensor(d2["logprobs"]), rtol=0, atol=0.02
            )
    for model_id in "abc":
        g_half, g_ref = half.adapter_gradients(model_id), reference.adapter_gradients(model_id)
        assert all(g.dtype == torch.float32 for g in g_half.values())
        flat_half = torch.cat([g.flatten() for g in g_half.values()])
        flat_ref = torch.cat([g_ref[key].flatten() for key in g_half])
        assert float((flat_half - flat_ref).norm() / flat_ref.norm()) < 0.05
        for key in g_half:
            assert float(torch.cosine_similarity(g_half[key].flatten(), g_ref[key].flatten(), dim=0)) > 0.99
    half.optim_step(OptimStep("a", learning_rate=0.01))
    assert all(w.dtype == torch.float32 for w in half.adapter_weights("a").values())


def test_losses_are_sums_without_normalisation(engine):
    engine.create_adapter("m", "tiny", LoraSpec(rank=4, seed=0))
    _train(engine, "m", steps=1)
    datum = _datum(_tokens(10, 0))
    once = _ok(engine.forward_backward([ForwardBackwardJob("m", [datum], "cross_entropy")])[0])
    grads_once = engine.adapter_gradients("m")
    engine.optim_step(OptimStep("m", learning_rate=0.0))  # zeroes the gradients, weights unchanged
    twice = _ok(engine.forward_backward([ForwardBackwardJob("m", [datum, datum], "cross_entropy")])[0])
    assert twice.metrics["loss:sum"] == pytest.approx(2 * once.metrics["loss:sum"], rel=1e-6)
    for key, grad in engine.adapter_gradients("m").items():
        # float32 sums over 2 rows in one pass vs 1 row: tolerance relative to the gradient's own scale
        scale = float(grads_once[key].abs().max())
        torch.testing.assert_close(grad, 2 * grads_once[key], rtol=1e-5, atol=1e-5 * scale)


def test_forward_only_touches_no_gradient(engine):
    engine.create_adapter("m", "tiny", LoraSpec(rank=4, seed=0))
    _train(engine, "m", steps=1)
    out = engine.forward_backward(
        [ForwardBackwardJob("m", [_datum(_tokens(9, 1))], "cross_entropy", backward=False)]
    )
    assert _ok(out[0]).metrics["loss:sum"] > 0
    assert all(torch.count_nonzero(g) == 0 for g in engine.adapter_gradients("m").values())


def _ratio_inputs(lp: list[float]) -> tuple[list[float], list[float]]:
    """Behaviour logprobs q giving ratios r = exp(lp - q) from 0.3 to 3 (inside and outside every clip range
    tested), and advantages of both signs."""
    ratios = [0.3, 0.7, 0.85, 1.0, 1.1, 1.3, 1.8, 3.0]
    q = [x - math.log(ratios[i % len(ratios)]) for i, x in enumerate(lp)]
    a = [(1.0 if i % 2 else -1.5) * (1 + i / 10) for i in range(len(lp))]
    return q, a


def _hand_loss(
    loss_fn: str, lp: list[float], q: list[float], a: list[float], w: list[float], lo: float, hi: float
):
    """Tinker's per-token losses, written out (reference/tinker-api.md §7.3)."""
    out = []
    for lp_i, q_i, a_i, w_i in zip(lp, q, a, w, strict=True):
        r = math.exp(lp_i - q_i)
        if loss_fn == "cross_entropy":
            out.append(-w_i * lp_i)
        elif loss_fn == "importance_sampling":
            out.append(-w_i * r * a_i)
        elif loss_fn == "ppo":
            out.append(-w_i * min(r * a_i, min(max(r, lo), hi) * a_i))
        else:  # cispo
            out.append(-w_i * min(max(r, lo), hi) * lp_i * a_i)
    return out


@pytest.mark.parametrize(
    ("loss_fn", "config", "lo", "hi"),
    [
        ("cross_entropy", None, 0, 0),
        ("importance_sampling", None, 0, 0),
        ("ppo", None, 0.8, 1.2),
        ("ppo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}, 0.5, 1.5),
        ("cispo", None, 0.0, 4.0),
        ("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.2}, 0.9, 1.2),
    ],
)
def test_loss_values_match_the_tinker_formulas(engine, loss_fn, config, lo, hi):
    engine.create_adapter("m", "tiny", LoraSpec(rank=4, seed=0))
    _train(engine, "m", steps=1)
    data_tokens = [_tokens(17, 11), _tokens(9, 12)]
    expected_total, data, hand = 0.0, [], []
    for tokens in data_tokens:
        lp = _forward_logprobs(engine, "m", tokens)
        q, a = _ratio_inputs(lp)
        w = [1.0, 0.5, 2.0, 0.0] * (len(lp) // 4) + [1.0] * (len(lp) % 4)
        inputs = (
            {"weights": w} if loss_fn == "cross_entropy" else {"logprobs": q, "advantages": a, "weights": w}
        )
        data.append(_datum(tokens, **inputs))
        per_token = _hand_loss(loss_fn, lp, q, a, w, lo, hi)
        hand.append(per_token)
        expected_total += sum(per_token)
    out = _ok(engine.forward_backward([ForwardBackwardJob("m", data, loss_fn, config)])[0])
    assert out.metrics["loss:sum"] == pytest.approx(expected_total, rel=1e-5, abs=1e-5)
    for datum_out, per_token in zip(out.loss_fn_outputs, hand, strict=True):
        torch.testing.assert_close(
            torch.tensor(datum_out["elementwise_loss"]), torch.tensor(per_token), rtol=1e-5, atol=1e-5
        )
    assert all(":" in key and key.count(":") == 1 for key in out.metrics)


def _with_provenance(datum: Datum, prompt: int) -> Datum:
    """The cookbook's provenance: the first `prompt` rows from the request's prompt, the rest sampled."""
    n = len(datum.input_tokens)
    datum.loss_fn_input_spans = [
        ProvenanceSpan(False, "s-0", 1, prompt),
        ProvenanceSpan(True, "s-0", 0, n - prompt),
    ]
    return datum


def test_stable_reinforce_value_and_gradient_on_sampled_rows(engine):
    """Reference: -A*lp + c*(r - 1 - log r) per sampled row (losses/policy.py's reading), 0 on prompt rows;
    its gradient, -A + c*(r - 1), is what a cross_entropy job with those weights (forward_backward_custom's
    surrogate) accumulates into an identical adapter."""
    c, prompt = 0.2, 3
    for name in ("sr", "ce"):
        engine.create_adapter(name, "tiny", LoraSpec(rank=4, seed=0))
        _train(engine, name, steps=1)
    data, ce_data, expected = [], [], 0.0
    for tokens in [_tokens(17, 21), _tokens(9, 22)]:
        lp = _forward_logprobs(engine, "sr", tokens)
        q, a = _ratio_inputs(lp)
        q[:prompt], a[:prompt] = [0.0] * prompt, [0.0] * prompt  # the cookbook pads the prompt rows
        data.append(_with_provenance(_datum(tokens, logprobs=q, advantages=a), prompt))
        sampled = range(prompt, len(lp))
        expected += sum(-a[i] * lp[i] + c * (math.exp(lp[i] - q[i]) - 1 - (lp[i] - q[i])) for i in sampled)
        weights = [0.0] * prompt + [a[i] - c * (math.exp(lp[i] - q[i]) - 1) for i in sampled]
        ce_data.append(_datum(tokens, weights=weights))
    out = _ok(
        engine.forward_backward([ForwardBackwardJob("sr", data, "stable_reinforce", {"kl_coeff": c})])[0]
    )
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
    assert out.metrics["kl_sampler_k3:mean"] > 0
    assert all(v == 0 for d in out.loss_fn_outputs for v in d["elementwise_loss"][:prompt])
    _ok(engine.forward_backward([ForwardBackwardJob("ce", ce_data, "cross_entropy")])[0])
    surrogate = engine.adapter_gradients("ce")
    for key, grad in engine.adapter_gradients("sr").items():
        assert torch.count_nonzero(grad) > 0
        torch.testing.assert_close(grad, surrogate[key], rtol=1e-4, atol=1e-6 * surrogate[key].abs().max())


def test_stable_reinforce_needs_provenance_and_sampled_advantages(engine):
    engine.create_adapter("m", "tiny", LoraSpec(rank=4, seed=0))
    tokens = _tokens(9, 3)
    plain = _rl_datum(tokens, seed=0)  # A = 0 on its 3 prompt rows
    on_prompt = _with_provenance(_rl_datum(tokens, seed=0), prompt=4)  # row 3 has A != 0 but is a prompt row
    short = _rl_datum(tokens, seed=0)
    short.loss_fn_input_spans = [ProvenanceSpan(True, "s-0", 0, 5)]
    jobs = [
        ForwardBackwardJob("m", [_with_provenance(_rl_datum(tokens, seed=0), prompt=3)], "stable_reinforce"),
        ForwardBackwardJob("m", [plain], "stable_reinforce"),
        ForwardBackwardJob("m", [on_prompt], "stable_reinforce"),
        ForwardBackwardJob("m", [short], "stable_reinforce"),
        ForwardBackwardJob("m", [plain], "stable_reinforce", {"kl_coeff": -0.1}),
        ForwardBackwardJob("m", [plain], "stable_reinforce", {"beta": 0.1}),
    ]
    messages = [
        None,
        "datum 0: loss 'stable_reinforce' needs provenance: loss_fn_input_spans",
        "loss_fn_inputs['advantages'][3]",
        "loss_fn_input_spans cover 5 rows but target_tokens has 8",
        "loss_fn_config['kl_coeff'] must be >= 0",
        "unknown keys ['beta']; it accepts kl_coeff",
    ]
    for result, message in zip(engine.forward_backward(jobs), messages, strict=True):
        if message is None:
            _ok(result)
        else:
            assert isinstance(result, UserError) and message in str(result), (message, result)


def test_optim_step_equals_torch_adamw(engine):
    engine.create_adapter("m", "tiny", LoraSpec(rank=4, seed=0))
    params = {k: v.clone().requires_grad_() for k, v in engine.adapter_weights("m").items()}
    reference = torch.optim.AdamW(list(params.values()), lr=0.0)
    steps = [
        OptimStep(
            "m", learning_rate=0.01, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip_norm=0.5
        ),
        OptimStep("m", learning_rate=0.003, beta1=0.8, beta2=0.99, eps=1e-12, weight_decay=0.0),
    ]
    for i, step in enumerate(steps):
        _ok(engine.forward_backward([ForwardBackwardJob("m", [_datum(_tokens(14, i))], "cross_entropy")])[0])
        grads = engine.adapter_gradients("m")
        metrics = engine.optim_step(step)
        for key, p in params.items():
            p.grad = grads[key].clone()
        norm = torch.nn.utils.clip_grad_norm_(list(params.values()), step.grad_clip_norm or math.inf)
        assert metrics["grad_norm:mean"] == pytest.approx(float(norm), rel=1e-5)
        for group in reference.param_groups:
            group.update(
                lr=step.learning_rate,
                betas=(step.beta1, step.beta2),
                eps=step.eps,
                weight_decay=step.weight_decay,
            )
        reference.step()
        for key, value in engine.adapter_weights("m").items():
            torch.testing.assert_close(value, params[key].detach(), rtol=1e-6, atol=1e-8)
        assert all(torch.count_nonzero(g) == 0 for g in engine.adapter_gradients("m").values())
    with pytest.raises(UserError, match="learning_rate"):
        engine.optim_step(OptimStep("m", learning_rate=-1.0))
    with pytest.raises(UserError, match="unknown model"):
        engine.optim_step(OptimStep("nope", learning_rate=0.1))


def test_a_gradient_that_is_not_finite_is_discarded_and_its_step_refused(tiny_model_dir):
    """Loss weights of 3e38 overflow the loss and its gradient: optim_step refuses with a UserError naming
    it, leaves weights, moments and the step count as they were and discards the gradient, so the next
    forward_backward and optim_step go on exactly as on an engine that never saw the overflow."""
    engines = [_engine(tiny_model_dir), _engine(tiny_model_dir)]
    tokens = _tokens(12, 5)
    step = OptimStep("m", learning_rate=0.01)
    for engine in engines:
        engine.create_adapter("m", "tiny", LoraSpec(rank=4, seed=0))
        _one_step(engine, "m")
    hit, clean = engines
    before = hit.adapter_weights("m")
    huge = Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": [3e38] * 11})
    out = _ok(hit.forward_backward([ForwardBackwardJob("m", [huge], "cross_entropy")])[0])
    assert not math.isfinite(out.metrics["loss:sum"])
    with pytest.raises(UserError, match=r"optim_step for model 'm': the gradient .* is not finite"):
        hit.optim_step(step)
    assert all(torch.equal(value, before[key]) for key, value in hit.adapter_weights("m").items())
    assert all(torch.count_nonzero(g) == 0 for g in hit.adapter_gradients("m").values())
    for engine in engines:
        _ok(engine.forward_backward([ForwardBackwardJob("m", [_datum(tokens)], "cross_entropy")])[0])
        metrics = engine.optim_step(step)
        assert math.isfinite(metrics["grad_norm:mean"])
    assert _same_weights(hit, "m", clean, "m")


def test_bad_jobs_fail_alone_with_user_errors(engine):
    engine.create_adapter("m", "tiny", LoraSpec(rank=4, seed=0))
    good = _datum(_tokens(8, 0))
    jobs = [
        ForwardBackwardJob("m", [good], "cross_entropy"),
        ForwardBackwardJob("m", [good], "nope"),
        ForwardBackwardJob("m", [_datum([5, 6, VOCAB + 3])], "cross_entropy"),
        ForwardBackwardJob("m", [Datum([5, 6, 7], {"target_tokens": [6, 7]})], "cross_entropy"),
        ForwardBackwardJob("m", [good], "ppo"),  # no logprobs/advantages
        ForwardBackwardJob("m", [good], "ppo", {"clip_low_threshold": 2.0, "clip_high_threshold": 1.0}),
        ForwardBackwardJob("m", [good], "cross_entropy", {"clip_low_threshold": 0.5}),
        ForwardBackwardJob("nope", [good], "cross_entropy"),
        ForwardBackwardJob("m", [_datum([5, 6, 7], weights=[1.0, math.nan])], "cross_entropy"),
        ForwardBackwardJob("m", [good], "importance_sampling", None, backward=False),
    ]
    results = engine.forward_backward(jobs)
    messages = [
        None,
        "unknown loss_fn 'nope'; this server supports: cross_entropy, importance_sampling, ppo, cispo, dro, "
        "stable_reinforce",
        "not a token id",
        "has 2 values but model_input has 3 tokens",
        "needs loss_fn_inputs ['logprobs', 'advantages']",
        "clip_low_threshold <= clip_high_threshold",
        "takes no config",
        "unknown model 'nope'",
        "is not finite",
        "needs loss_fn_inputs",
    ]
    for result, message in zip(results, messages, strict=True):
        if message is None:
            assert _ok(result).metrics["loss:sum"] > 0
        else:
            assert isinstance(result, UserError) and message in str(result), (message, result)
    alone = _ok(engine.forward_backward([jobs[0]])[0])
    assert alone.metrics["loss:sum"] == pytest.approx(_ok(results[0]).metrics["loss:sum"], rel=1e-5)


# ---- optimizer state and checkpoints --------------------------------------------------------------------


def _same_weights(e1: ServiceCompute, m1: str, e2: ServiceCompute, m2: str) -> bool:
    w1, w2 = e1.adapter_weights(m1), e2.adapter_weights(m2)
    return w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)


def _one_step(engine: ServiceCompute, model_id: str) -> None:
    data = [_datum(_tokens(13, 99))]
    _ok(engine.forward_backward([ForwardBackwardJob(model_id, data, "cross_entropy")])[0])
    engine.optim_step(OptimStep(model_id, learning_rate=0.01, weight_decay=0.01))


def test_save_state_and_load_state_round_trip_with_optimizer(engine, tiny_model_dir, tmp_path):
    engine.create_adapter("m", "tiny", LoraSpec(rank=8, seed=3, train_unembed=True))
    _train(engine, "m", steps=3)
    written = engine.save_state("m", tmp_path / "ckpt")
    files = {p.name: p for p in (tmp_path / "ckpt").iterdir()}
    assert set(files) == {
        "adapter_model.safetensors",
        "adapter_config.json",
        "optimizer.safetensors",
        "inflight_state.json",
    }
    assert written == sum(p.stat().st_size for p in files.values())
    config = json.loads(files["adapter_config.json"].read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 8, 32)
    assert "lm_head" in config["target_modules"] and "q_proj" in config["target_modules"]
    assert not list(tmp_path.glob(".ckpt*"))  # no temp dir left behind

    other = _engine(tiny_model_dir)
    other.load_state("copy", tmp_path / "ckpt", load_optimizer=True)  # create-via-load
    assert other.has_adapter("copy") and _same_weights(engine, "m", other, "copy")
    tokens = _tokens(16, 5)
    assert _forward_logprobs(engine, "m", tokens) == _forward_logprobs(other, "copy", tokens)
    _one_step(engine, "m")
    _one_step(other, "copy")
    assert _same_weights(engine, "m", other, "copy")  # same AdamW moments and step count


def test_load_state_without_optimizer_starts_fresh_moments(engine, tiny_model_dir, tmp_path):
    engine.create_adapter("m", "tiny", LoraSpec(rank=4, seed=1))
    _train(engine, "m", steps=3)
    engine.save_state("m", tmp_path / "ckpt")
    weights_only = _engine(tiny_model_dir)
    weights_only.load_state("w", tmp_path / "ckpt", load_optimizer=False)
    assert _same_weights(engine, "m", weights_only, "w")
    # A fresh adapter given the same weights through a sampler checkpoint has fresh moments too.
    engine.save_sampler_weights("m", tmp_path / "sampler")
    fresh = _engine(tiny_model_dir)
    fresh.load_state("f", tmp_path / "sampler", load_optimizer=False)
    _one_step(weights_only, "w")
    _one_step(fresh, "f")
    _one_step(engine, "m")
    assert _same_weights(weights_only, "w", fresh, "f")
    assert not _same_weights(weights_only, "w", engine, "m")  # the restored moments would have differed

    with pytest.raises(UserError, match="no optimizer state"):
        fresh.load_state("g", tmp_path / "sampler", load_optimizer=True)
    engine.create_adapter("rank8", "tiny", LoraSpec(rank=8))
    with pytest.raises(UserError, match="adapter of"):
        engine.load_state("rank8", tmp_path / "ckpt", load_optimizer=False)
    with pytest.raises(UserError, match="does not exist"):
        engine.load_state("x", tmp_path / "missing", load_optimizer=False)
    assert not engine.has_adapter("x")


def test_save_state_before_any_step_and_overwrite(engine, tmp_path):
    engine.create_adapter("m", "tiny", LoraSpec(rank=2, seed=0))
    engine.save_state("m", tmp_path / "ckpt")
    engine.load_state("m", tmp_path / "ckpt", load_optimizer=True)  # no moments yet: a fresh optimizer
    _train(engine, "m", steps=1)
    engine.save_state("m", tmp_path / "ckpt")  # replaces the directory
    other = "m2"
    engine.load_state(other, tmp_path / "ckpt", load_optimizer=True)
    assert _same_weights(engine, "m", engine, other)


# ---- adapters and base models ---------------------------------------------------------------------------


def test_adapter_lifecycle_and_base_model_info(engine, tiny_model_dir):
    assert engine.base_model_names() == ["tiny"]
    info = engine.model_info("tiny")
    assert (info["vocab_size"], info["max_context"], info["eos_token_ids"]) == (VOCAB, 2048, [EOS])
    tokenizer = AutoTokenizer.from_pretrained(engine.tokenizer_dir("tiny"))
    assert tokenizer.decode(tokenizer.encode("hit or stand")) == "hit or stand"
    engine.create_adapter("m", "tiny", LoraSpec(rank=32))
    with pytest.raises(UserError, match="already exists"):
        engine.create_adapter("m", "tiny", LoraSpec())
    with pytest.raises(UserError, match="between 1 and 32"):
        engine.create_adapter("big", "tiny", LoraSpec(rank=64))
    with pytest.raises(UserError, match="unknown base model"):
        engine.create_adapter("x", "nope", LoraSpec())
    with pytest.raises(UserError, match="must train something"):
        engine.create_adapter("x", "tiny", LoraSpec(train_attn=False, train_mlp=False))
    engine.delete_adapter("m")
    engine.delete_adapter("m")  # idempotent
    assert not engine.has_adapter("m")
    with pytest.raises(UserError, match="unknown model"):
        engine.save_state("m", Path("/nonexistent"))


def test_a_fault_in_the_batched_pass_fails_its_jobs_not_the_engine(engine, monkeypatch):
    import inflight.trainer.adapters as adapters_module  # the engine's batched pass runs through it

    engine.create_adapter("m", "tiny", LoraSpec(rank=4, seed=0))
    job = ForwardBackwardJob("m", [_datum(_tokens(6, 0))], "cross_entropy")

    def broken(*args, **kwargs):
        raise RuntimeError("device fell over")

    with monkeypatch.context() as patch:
        patch.setattr(adapters_module, "run_forward_backward", broken)
        results = engine.forward_backward([job, job, ForwardBackwardJob("m", [], "cross_entropy")])
    assert [type(r) for r in results] == [RuntimeError, RuntimeError, UserError]
    # The batch of two fails, then each job alone (a fault fails only the jobs that cause it).
    assert engine.counters["failed_batches"] == 3 and engine.counters["batches_split"] == 1
    assert _ok(engine.forward_backward([job])[0]).metrics["loss:sum"] > 0  # and the next call works
