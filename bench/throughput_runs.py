"""The measured processes of `bench/throughput.py`, one configuration per process.

Each function runs in a fresh interpreter with `OMP_NUM_THREADS` set to its thread count and
returns per-step figures (medians after `WARMUP` steps). Steps are timed start to start,
everything in.

- `ours`: this library's loop (`RolloutCallback` with `max_staleness` k); besides the step
  time it times the parts of the trainer's step by wrapping the functions that do them
  (waiting for the engine, scoring and packing, the canary's recompute at the generating
  version, the update, the metrics write, the push and the fingerprint inside it).
- `generation`: the engine alone, doing per batch what the engine process of k ≥ 1 does:
  reload the weights, read their fingerprint, generate the batch (same prompts and seeds);
  it records the completions for `training`.
- `training`: the trainer alone on the recorded batches (an engine that replays them): score,
  update, metrics write; no generation, no push.
- `trl`: TRL's `GRPOTrainer(loss_type="dr_grpo")` with HF `generate`.

`precision` is the update's on both sides: "fp32", or "bf16" (autocast over fp32 master weights:
`trainer.precision="bf16-mixed"` here, `bf16=True` in TRL).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

BATCH = 8 * 4  # prompts x G, every run
WARMUP = 3  # steps left out of every median


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


class Timers:
    """Seconds spent in wrapped functions, binned by training step: wall time, and the calling
    thread's CPU time under `<name>_cpu` (less than the wall time when the thread was waiting
    for a core)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def start_step(self) -> None:
        self.steps.append(defaultdict(float))

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args: Any, **kw: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kw)
            finally:
                if self.steps:
                    self.steps[-1][name] += time.perf_counter() - t0
                    self.steps[-1][f"{name}_cpu"] += time.thread_time() - c0

        return timed

    def medians_ms(self, steps: int) -> dict[str, float]:
        """Median ms per step of each timer over the measured steps (the first `steps`)."""
        measured = self.steps[WARMUP:steps]
        names = {n for s in measured for n in s}
        return {n: 1e3 * _median([s.get(n, 0.0) for s in measured]) for n in names}


class ReplayEngine:
    """An engine that returns recorded completions (one batch per call, in order) at once."""

    def __init__(self, batches: list[list[list[dict]]]):
        from composer_lightning.engines.base import Completion

        self.batches = [[[Completion(**c) for c in row] for row in b] for b in batches]
        self._calls, self._version = 0, 0

    def start(self, context: Any = None) -> None:
        pass

    def generate(self, prompts: list[list[int]], n: int, sampling: Any) -> list:
        out = self.batches[self._calls % len(self.batches)]
        self._calls += 1
        return out

    def load_weights(self, weights: Iterable, version: int) -> None:
        self._version = int(version)  # the weights are not read: no push cost

    def reset_cache(self) -> None:
        pass

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def tensor_parallel_size(self) -> int:
        return 1


#: the projections LoRA adapts on both sides (`--lora R`): attention and MLP, as bench/step_cost.py
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]


def lora_config(rank: int) -> Any:
    """peft's LoraConfig at rank `rank` (alpha 2r, no dropout), or None for a full fine-tune."""
    if not rank:
        return None
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=LORA_TARGETS)


def _optimizer(params: Iterable) -> Any:
    import torch

    # TRL's optimizer: transformers' default `adamw_torch_fused`, weight decay 0
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=True)


def sampled_in(engine: Any) -> str:
    """The dtype the engine's model runs in, read back from vLLM where it runs in this process
    (its `model_config`), else the dtype the engine was configured with."""
    config = getattr(
        getattr(getattr(engine, "llm", None), "llm_engine", None), "model_config", None
    )
    return str(getattr(config, "dtype", None) or getattr(engine, "dtype", "—")).removeprefix(
        "torch."
    )


#: `--precision` → Lightning's `trainer.precision`
PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed"}


def ours(
    path: str,
    k: int | None,
    steps: int,
    max_tokens: int,
    threads: int,
    record: str,
    lora: int = 0,
    precision: str = "fp32",
    engine_dtype: str = "float32",
) -> dict:
    """This library's loop with `max_staleness` k; k None: `training`, on the batches that
    `generation` recorded in the file `record`. `lora` > 0: LoRA at that rank (the engine gets
    the merged weights). `engine_dtype`: the dtype vLLM samples in."""
    import lightning as L
    import torch

    import composer_lightning.engines.fingerprint as fingerprint_file
    import composer_lightning.rollout.callback as rollout_file
    import composer_lightning.training.module as module_file
    from composer_lightning.datamodules.rollout import RolloutDataModule
    from composer_lightning.engines import SamplingConfig, VLLMEngine
    from composer_lightning.heads.dr_grpo import DrGRPOHead
    from composer_lightning.rollout.ahead import GenerationAhead
    from composer_lightning.rollout.callback import RolloutCallback
    from composer_lightning.training.module import ComposerModule

    torch.set_num_threads(threads)
    timers = Timers()
    for file, name, label in [
        (module_file, "log_step", "logging"),
        (rollout_file, "generate_in_group", "generate"),
        (rollout_file, "build_rollout", "score"),
        (fingerprint_file, "tensor_fingerprint", "fingerprint"),
    ]:
        setattr(file, name, timers.wrap(label, getattr(file, name)))
    for cls, name, label in [
        (GenerationAhead, "generate", "wait"),
        (GenerationAhead, "behavior_logprobs", "canary"),
        (RolloutCallback, "_push", "push"),
        (ComposerModule, "training_step", "update"),
    ]:
        setattr(cls, name, timers.wrap(label, getattr(cls, name)))
    starts: list[float] = []
    tokens: list[float] = []
    engine_gen: list[float] = []

    class Clock(L.Callback):  # first in the list: its start comes before generation
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            starts.append(time.perf_counter())
            timers.start_step()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            tokens.append(float(batch.rollout.response_mask.sum()))
            engine_gen.append(float(trainer.callback_metrics.get("rollout/gen_time", 0.0)))

    if k is None:
        if not Path(record).exists():
            raise FileNotFoundError(f"{record}: run `generation` first, it records the batches")
        engine = ReplayEngine(json.loads(Path(record).read_text()))
    else:
        engine = VLLMEngine(seed=0, dtype=engine_dtype)
    callback = RolloutCallback(
        engine,
        group_size=4,
        max_staleness=k or 0,
        samples_every_n_steps=0,
        sampling=SamplingConfig(max_tokens=max_tokens, seed=0),
    )
    # replayed batches carry the log-probs of the weights that generated them, not the
    # trainer's: no canary there
    gap = None if k is None else "auto"
    module = ComposerModule(
        path, [DrGRPOHead()], optimizer=_optimizer, max_logprob_gap=gap, peft=lora_config(lora)
    )
    trainer = L.Trainer(
        accelerator="cpu",
        precision=PRECISION[precision],
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[Clock(), callback],
    )
    trainer.fit(module, RolloutDataModule(prompts_per_step=8, val_prompts=0))
    trained = sum(p.numel() for p in module.parameters() if p.requires_grad)
    update_in = str(trainer.precision)  # as the trainer ran it
    times = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    step = _median(times[WARMUP:])
    parts = timers.medians_ms(len(times))
    for key in ("update", "update_cpu"):  # the metrics write happens inside it
        parts[key] = parts.get(key, 0.0) - parts.get(key.replace("update", "logging"), 0.0)
    return {
        "step_s": step,
        "trained": trained,
        "precision": update_in,
        "engine": sampled_in(engine) if k is not None else "—",
        "tok_s": _median(tokens[WARMUP:]) / step,
        "push_ms": parts.get("push", float("nan")),
        "log_ms": parts.get("logging", float("nan")),
        "parts_ms": parts,
        "engine_gen_ms": 1e3 * _median(engine_gen[WARMUP + 1 :]) if k else float("nan"),
    }


def generation(
    path: str, steps: int, max_tokens: int, threads: int, record: str, engine_dtype: str = "float32"
) -> dict:
    """The engine alone, sampling in `engine_dtype`: per batch a reload of the weights, their
    fingerprint, the batch."""
    from dataclasses import asdict

    import torch

    from composer_lightning.datamodules.rollout import RolloutDataModule
    from composer_lightning.engines import SamplingConfig, VLLMEngine, iter_hf_weights
    from composer_lightning.engines.base import EngineContext
    from composer_lightning.models.random import load_policy
    from composer_lightning.rollout.generation import generate_on_rank

    torch.set_num_threads(threads)
    data = RolloutDataModule(tokenizer=path, prompts_per_step=8, val_prompts=0)
    tokenizer = data.tokenizer
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    sampling = SamplingConfig(max_tokens=max_tokens, seed=0, stop_token_ids=eos)
    engine = VLLMEngine(seed=0, dtype=engine_dtype)
    engine.start(EngineContext(model_path=path))
    policy = load_policy(path)
    starts, reloads, tokens, recorded = [], [], [], []
    for step in range(steps):
        starts.append(time.perf_counter())
        engine.load_weights(iter_hf_weights(policy), version=step)
        engine.weight_fingerprint()
        reloads.append(time.perf_counter() - starts[-1])
        prompts = data.prompt_batch(step).prompt_ids
        outs = generate_on_rank(engine, prompts, sampling, step, 0, 4)
        tokens.append(sum(len(c.token_ids) for row in outs for c in row))
        recorded.append([[asdict(c) for c in row] for row in outs])
    starts.append(time.perf_counter())
    Path(record).write_text(json.dumps(recorded))
    times = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    step = _median(times[WARMUP:])
    nan = float("nan")
    return {
        "step_s": step,
        "engine": sampled_in(engine),
        "tok_s": _median(tokens[WARMUP:]) / step,
        "push_ms": 1e3 * _median(reloads[WARMUP:]),
        "log_ms": nan,
    }


def trl(
    path: str, steps: int, max_tokens: int, threads: int, lora: int = 0, precision: str = "fp32"
) -> dict:
    """TRL 1.16's GRPOTrainer, Dr. GRPO, HF generate, no activation checkpointing, the update in
    `precision` (bf16: TRL's own default, autocast over fp32 weights);
    `lora` > 0: its `peft_config` at that rank, the same LoraConfig as this library's rows."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from composer_lightning.tasks import Arithmetic, VerifierScore

    torch.set_num_threads(threads)
    task = Arithmetic()
    problems = task.samples(8 * (steps + 2), seed=0)
    data = Dataset.from_list([{"prompt": p["messages"], "answer": p["answer"]} for p in problems])
    verifier = VerifierScore(task)

    def reward(prompts, completions, answer, **_):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return verifier.score([{"answer": a} for a in answer], texts)

    starts: list[float] = []
    lengths: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            starts.append(time.perf_counter())  # start to start, everything in

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(BATCH * float(logs["completions/mean_length"]))

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            loss_type="dr_grpo",
            num_generations=4,
            per_device_train_batch_size=32,
            gradient_accumulation_steps=1,
            max_completion_length=max_tokens,
            learning_rate=1e-4,
            beta=0.0,
            max_steps=steps,
            logging_steps=1,
            report_to=[],
            use_cpu=True,
            # TRL 1.16 defaults to bf16 autocast and activation checkpointing even on CPU;
            # both sides run the same precision, without checkpointing
            bf16=precision == "bf16",
            gradient_checkpointing=False,
            save_strategy="no",
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            seed=0,
        )
        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(path),
            reward_funcs=reward,
            args=config,
            train_dataset=data,
            processing_class=AutoTokenizer.from_pretrained(path),
            callbacks=[Clock()],
            peft_config=lora_config(lora),
        )
        trainer.train()
        trained = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        # as TRL's accelerator ran it, in Lightning's words
        update_in = "bf16-mixed" if trainer.accelerator.mixed_precision == "bf16" else "32-true"
    times = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    step = _median(times[WARMUP:])
    nan = float("nan")
    tok_s = _median(lengths[WARMUP:]) / step if len(lengths) > WARMUP else nan
    return {
        "step_s": step,
        "trained": trained,
        "precision": update_in,
        "tok_s": tok_s,
        "push_ms": nan,
        "log_ms": nan,
    }
