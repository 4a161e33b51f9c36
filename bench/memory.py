"""Peak memory and time of one training step, chunked (the module) vs full `[B, T, V]` logits.

    python bench/memory.py [--shapes 16x256 32x512] [--threads 2] [--steps 2] [--hidden 896]
    python bench/memory.py --shapes 16x160 --hidden 64 --mmap-threshold
    python bench/memory.py --micro-rows 8 32 128 [--micro-T 64] [--micro-tokens 512] [--repeats 5]
    python bench/memory.py --chunk-mib 4 8 16 32 64 128 [--shapes 16x160] [--hidden 896]
        [--chunk-heads all|dr_grpo]
    python bench/memory.py --smoke [--micro-rows 4] [--chunk-mib 0.01 0.05]

A Qwen2.5-0.5B-wide policy (vocabulary 151,936, hidden 896, MLP 4,864, 14 heads / 2 KV heads,
tied embeddings) with 2 layers; all heads: Dr. GRPO + OPD (teacher = the policy given the
hint) + KL in the advantage (a frozen reference copy) in one surrogate, SDPO on the hinted
samples' response tokens, replay DPO on 4 recorded pairs. Synthetic rollout batches of B
samples × T tokens (half prompt, response lengths uniform up to T/2, half the samples hinted).
Activation checkpointing of the decoder layers is on in both paths (`--no-checkpointing`: off),
so what is measured is the logits path, not the layers' activations.

Each (path, shape) runs in its own process. A warm-up step on a tiny batch (4 x 32) allocates
the optimizer state and gradients. Three figures per run:
- "peak": the whole process's peak resident memory (libraries, weights, state and the step);
- "extra": peak RSS of the measured steps minus the peak RSS of the warm-up step, i.e. what the
  step's B x T adds (activations, logits) over a step that already pays every fixed cost
  (weights, reference, gradients, AdamW state, and the [V, H]-sized transients of the embedding
  / LM-head gradient accumulation and of AdamW's update, which do not depend on B x T);
- "over state": peak RSS minus the RSS after the warm-up step (weights + reference + gradients
  + AdamW state), i.e. extra plus those fixed transients.
The full-logits path is the same module with its forwards swapped for the reference
full-logits functions (what the module did before it used hidden states), the same loop,
objective and heads, with SDPO on gathered `[B, T, V]` logits. Both paths print their loss, so
the run also checks they compute the same objective. Shapes whose full-logits step cannot fit
in this machine's memory are estimated (marked "est.") from the smaller shape, linearly in
B·T.

`--hidden N`: the policy's hidden size (Qwen's vocabulary kept; MLP and heads as `--smoke`'s when
N < 896), to see the logits path beside a small state. `--mmap-threshold`: also the chunked
path with glibc's mmap threshold fixed at 1 MiB (`MALLOC_MMAP_THRESHOLD_=1048576`). By default
glibc raises the threshold to each freed mapping's size (up to 32 MiB), and later mid-size
tensors come from a heap that fragments and does not shrink; fixed, they are mapped and
unmapped each time: less resident memory, more page faults.

`--micro-rows`: the same step on rollout batches of growing size at a fixed length, one forward
per minibatch vs micro-batches under a fixed token budget (`max_tokens_per_micro_batch`): the
micro-batched step's peak memory and time per token should stay flat in the batch size.
`--repeats N` runs each of them in N processes and takes the median peak and time: the peak
moves between identical runs (1.01–1.34 GiB at 32 x 160, docs/benchmarks/memory.md).

`--chunk-mib`: instead, the chunked path alone at each LM-head chunk size (MiB of fp32 logits
a chunk, i.e. `chunk_size` = MiB * 2**18 / V tokens): its extra memory should fall as the chunk
shrinks (only one chunk's `[n, V]` logits are alive, in the forward and in the recompute) and
its time should not grow until the chunks are too small to amortise one pass over the `[V, H]`
weight gradient each (`training/hidden.py`'s H / 8 floor). `--chunk-heads dr_grpo`: Dr. GRPO
alone, whose log-probs run in vocabulary tiles of the same memory (`functional/vocab_tiles.py`),
where the time should not grow at all; with every head, SDPO's JSD and the entropies keep the
chunks of tokens.

`--smoke`: the same runs on a policy of tiny widths (`SMOKE_WIDTHS`), one step of 4 x 32 on
one thread (`--micro-rows`: T = 32, micro-batches of 64 tokens): a check that every path of the
bench still runs (the test suite's, `tests/test_benches.py`), not a measurement.

Why this file is long: it is the driver and, re-invoked with `--worker`, the one-run worker
(peak RSS is only meaningful per process), and it holds the full-logits baseline
(`FullLogitsModule`, `FullLogitsSDPO`) that only this bench uses; each part is short.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from composer_lightning.datamodules.synthetic import synthetic_batch  # noqa: E402
from composer_lightning.functional import generalized_jsd_per_token, logprobs_from_logits  # noqa: E402
from composer_lightning.functional.align import gather_teacher_logits, teacher_alignment  # noqa: E402
from composer_lightning.heads.base import HeadOutput  # noqa: E402
from composer_lightning.heads.dr_grpo import DrGRPOHead  # noqa: E402
from composer_lightning.heads.kl import KLHead  # noqa: E402
from composer_lightning.heads.opd import OPDHead  # noqa: E402
from composer_lightning.heads.replay_dpo import ReplayDPOHead  # noqa: E402
from composer_lightning.heads.sdpo import SDPOHead  # noqa: E402
from composer_lightning.protocols.step import RolloutTargets, StepContext  # noqa: E402
from composer_lightning.runtime.allocator import malloc_in_use  # noqa: E402
from composer_lightning.training.module import ComposerModule  # noqa: E402

QWEN_WIDTHS = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=2,
    num_attention_heads=14,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)
#: `--smoke`: the same layout, small enough that a step takes well under a second
SMOKE_WIDTHS = dict(
    QWEN_WIDTHS,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=2,
    num_key_value_heads=1,
)
GiB = 2**30


def rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ------------------------------------------------------------------ one measured process
def logits_of(model, ids, mask):
    """`[B, T, V]` logits the plain way."""
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits


class FullLogitsModule(ComposerModule):
    """ComposerModule with every forward on full `[B, T, V]` logits (one update per batch)."""

    def rollout_targets(
        self, rb, needs, splits=None, updates=1, plans=None, behavior_logprobs=None
    ):
        with torch.no_grad():
            ref = logprobs_from_logits(
                logits_of(self.reference, rb.input_ids, rb.attention_mask),
                rb.input_ids,
                self.temperature,
            )
            t_logits = logits_of(self.policy, rb.teacher_input_ids, rb.teacher_attention_mask)
            t_lp = logprobs_from_logits(t_logits, rb.teacher_input_ids, self.temperature)
            pos = rb.teacher_positions
            lp = torch.where(
                pos >= 1, t_lp.gather(1, pos.clamp(min=0)), torch.zeros_like(t_lp[:, :1])
            )
            required = (rb.response_mask & rb.has_teacher.unsqueeze(1)) | rb.sdpo_mask
            aligned = teacher_alignment(rb.input_ids, rb.teacher_input_ids, pos, required)
            self._teacher_logits = gather_teacher_logits(t_logits, pos)  # [B, T, V]
        return RolloutTargets(
            ref_logprobs=ref,
            teacher_logprobs=lp,
            teacher_aligned=aligned,
            behavior_logprobs=behavior_logprobs,
        )

    def step_context(self, mb, needs, targets=None, scores=None, rollout=None, rows=None):
        logits = logits_of(self.policy, mb.input_ids, mb.attention_mask)  # [B, T, V]
        logprobs = logprobs_from_logits(logits, mb.input_ids, self.temperature)
        shifted = torch.cat([torch.zeros_like(logits[:, :1]), logits[:, :-1]], dim=1)
        provided = {
            "ref_logprobs": targets.ref_logprobs,
            "teacher_logprobs": targets.teacher_logprobs,
            "teacher_aligned": targets.teacher_aligned,
            "logits": shifted,
            "teacher_logits": self._teacher_logits,
        }

        def policy_forward(ids, attn, mask):
            return logprobs_from_logits(logits_of(self.policy, ids, attn), ids, self.temperature)

        return StepContext(
            global_step=self.global_step,
            logprobs=logprobs,
            old_logprobs=logprobs.detach(),
            aggregation=self.objective.aggregation,
            norm_length=mb.max_response_length,
            temperature=self.temperature,
            behavior_logprobs=targets.behavior_logprobs,
            rollout=rollout,
            rows=rows,
            _provided=provided,
            _policy_forward=policy_forward,
        )


class FullLogitsSDPO(SDPOHead):
    """SDPO as the module computed it before: the JSD of gathered `[B, T, V]` logits."""

    requires = frozenset({"logits", "teacher_logits"})

    def compute(self, batch, ctx):
        mask = batch.sdpo_mask & batch.has_teacher.unsqueeze(1) & ctx.teacher_aligned.unsqueeze(1)
        per_token, _ = generalized_jsd_per_token(
            ctx.logits[mask],
            ctx.teacher_logits[mask].detach(),
            beta=self.beta,
            temperature=self.temperature,
            clip=self.clip,
            clip_mode=self.clip_mode,
        )
        return HeadOutput(loss=per_token.sum() / max(int(mask.sum()), 1))


class Recorder(L.Callback):
    """RSS after the warm-up step (the baseline), time and loss of every measured step."""

    def __init__(self):
        self.base, self.base_peak, self.times, self.losses = 0, 0, [], []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx == 1:
            self.base, self.base_peak = rss_now(), rss_peak()
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx >= 1:
            self.times.append(time.perf_counter() - self.t0)
            self.losses.append(float(trainer.callback_metrics["train/loss"]))


def worker(
    path: str,
    B: int,
    T: int,
    steps: int,
    threads: int,
    checkpointing: bool,
    widths: dict,
    chunk_size: int | None = None,
) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    policy = Qwen2ForCausalLM(Qwen2Config(**widths, max_position_embeddings=4096)).train()
    replay = ReplayDPOHead(weight=0.05, pairs_per_step=4)
    heads = [
        DrGRPOHead(),
        OPDHead(weight=0.5),
        KLHead(kl_coef=0.01),
        (FullLogitsSDPO if path == "full" else SDPOHead)(weight=0.1),
        replay,
    ]
    if path == "dr_grpo":  # the log-probs alone (`--chunk-heads dr_grpo`)
        heads, path = heads[:1], "chunked"
    cls = FullLogitsModule if path == "full" else ComposerModule
    micro = {}
    if path.startswith("micro"):  # micro<N>: micro-batches of at most N padded tokens
        micro = {"max_tokens_per_micro_batch": int(path[len("micro") :])}
    module = cls(
        policy,
        heads,
        max_logprob_gap=None,
        # both paths compute the same objective; the cap's gradient measurement (the teachers'
        # pull against the rest) is not the logits path this bench weighs
        teacher_cap=None,
        activation_checkpointing=checkpointing,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-6),
        chunk_size=chunk_size,
        **micro,
    )
    g = torch.Generator().manual_seed(1)

    def batch(b: int, t: int):
        return synthetic_batch(
            g,
            prompts=b // 4,
            group_size=4,
            prompt_length=t // 2,
            response_length=t // 2,
            hint_length=16,
            vocab_size=widths["vocab_size"],
            reward_prob=1.0,
            hint_prob=0.5,
        )

    measured = [batch(B, T) for _ in range(steps)]
    filler = batch(B, T)  # full-length replay pairs: every group's rewards differ
    filler.rewards = torch.arange(filler.batch_size).remainder(2).float()
    replay.on_rollout(filler, torch.zeros_like(filler.input_ids, dtype=torch.float))
    rec = Recorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1 + steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[rec],
    )
    trainer.fit(module, train_dataloaders=DataLoader([batch(4, 32), *measured], batch_size=None))
    return {
        "path": path,
        "B": B,
        "T": T,
        "params_M": sum(p.numel() for p in policy.parameters()) / 1e6,
        "base_GiB": rec.base / GiB,
        "peak_GiB": rss_peak() / GiB,
        "state_extra_GiB": (rss_peak() - rec.base) / GiB,
        "extra_GiB": (rss_peak() - rec.base_peak) / GiB,
        "step_s": sorted(rec.times)[len(rec.times) // 2],
        "losses": rec.losses,
        "tokens": sum(int(b.attention_mask.sum()) for b in measured) / steps,
        "sdpo_tokens": sum(int(b.sdpo_mask.sum()) for b in measured) / steps,
    }


# ------------------------------------------------------------------ the driver
def run(
    path: str,
    B: int,
    T: int,
    steps: int,
    threads: int,
    checkpointing: bool,
    smoke: bool,
    hidden: int | None = None,
    chunk_size: int | None = None,
) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if path == "chunked-mmap":  # glibc's mmap threshold fixed: freed tensors leave the process
        env["MALLOC_MMAP_THRESHOLD_"] = str(2**20)
        path = "chunked"
    proc = subprocess.run(
        [
            sys.executable,
            __file__,
            "--worker",
            path,
            f"{B}x{T}",
            "--steps",
            str(steps),
            "--threads",
            str(threads),
        ]
        + ([] if checkpointing else ["--no-checkpointing"])
        + (["--smoke"] if smoke else [])
        + ([] if hidden is None else ["--hidden", str(hidden)])
        + ([] if chunk_size is None else ["--chunk-size", str(chunk_size)]),
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        return {"path": path, "B": B, "T": T, "error": proc.stderr.strip().splitlines()[-1:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["16x256", "32x512"])
    ap.add_argument("--steps", type=int, default=2, help="measured steps per run (median time)")
    ap.add_argument(
        "--repeats", type=int, default=1, help="--micro-rows: processes per run (median peak)"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--memory-gib",
        type=float,
        default=None,
        help="memory available for one run; default: MemAvailable now",
    )
    ap.add_argument(
        "--no-checkpointing",
        action="store_true",
        help="without activation checkpointing of the decoder layers (both paths)",
    )
    ap.add_argument(
        "--micro-rows",
        nargs="+",
        type=int,
        default=None,
        help="instead: rollout batches of these many samples (e.g. 8 32 128), one forward vs "
        "micro-batches of --micro-tokens padded tokens",
    )
    ap.add_argument("--micro-T", type=int, default=64, help="tokens per sample for --micro-rows")
    ap.add_argument("--micro-tokens", type=int, default=512, help="micro-batch token budget")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="tiny widths, one 4x32 step on one thread (micro: T 32, 64 tokens): a check, "
        "not a measurement",
    )
    ap.add_argument(
        "--hidden",
        type=int,
        default=None,
        help="hidden size at Qwen's vocabulary (default 896; below it, the MLP and attention "
        "heads of --smoke)",
    )
    ap.add_argument(
        "--mmap-threshold",
        action="store_true",
        help="also the chunked path with MALLOC_MMAP_THRESHOLD_=1048576 (glibc)",
    )
    ap.add_argument(
        "--chunk-mib",
        nargs="+",
        type=float,
        default=None,
        help="instead: the chunked path alone at these LM-head chunk sizes (MiB of fp32 logits)",
    )
    ap.add_argument(
        "--chunk-heads",
        choices=["all", "dr_grpo"],
        default="all",
        help="--chunk-mib's heads: all (the default) or Dr. GRPO alone (the log-probs' path)",
    )
    ap.add_argument("--chunk-size", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker", nargs=2, metavar=("PATH", "BxT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    widths = widths_for(args.smoke, args.hidden)
    if args.worker:
        B, T = map(int, args.worker[1].split("x"))
        ckpt = not args.no_checkpointing
        r = worker(args.worker[0], B, T, args.steps, args.threads, ckpt, widths, args.chunk_size)
        print(json.dumps(r))
        return
    if args.smoke:
        args.shapes, args.steps, args.threads = ["4x32"], 1, 1
        args.micro_T, args.micro_tokens = 32, 64
    if args.micro_rows:
        exit_on_errors(micro_table(args))
        return
    if args.chunk_mib:
        exit_on_errors(chunk_table(args, widths))
        return
    avail = args.memory_gib or _mem_available_gib()
    rows, first_full = [], None
    for shape in args.shapes:
        B, T = map(int, shape.split("x"))
        copy_gib = B * T * widths["vocab_size"] * 4 / GiB
        ckpt = not args.no_checkpointing
        chunked = run("chunked", B, T, args.steps, args.threads, ckpt, args.smoke, args.hidden)
        mmapped = None
        if args.mmap_threshold:
            mmapped = run(
                "chunked-mmap", B, T, args.steps, args.threads, ckpt, args.smoke, args.hidden
            )
        full = None
        if first_full is not None:
            scale = B * T / (first_full["B"] * first_full["T"])
            needed = first_full["base_GiB"] + first_full["extra_GiB"] * scale
            if needed > 0.9 * avail:
                full = {
                    "path": "full",
                    "B": B,
                    "T": T,
                    "est": True,
                    "extra_GiB": first_full["extra_GiB"] * scale,
                    "step_s": first_full["step_s"] * scale,
                }
        if full is None:
            full = run("full", B, T, args.steps, args.threads, ckpt, args.smoke, args.hidden)
            if "error" not in full and first_full is None:
                first_full = full
        rows.append((shape, copy_gib, chunked, full, mmapped))
        print(
            json.dumps({"shape": shape, "chunked": chunked, "full": full, "mmap": mmapped}),
            file=sys.stderr,
        )
    print(
        f"policy {widths} + frozen reference copy; AdamW; {args.threads} thread(s); "
        f"median of {args.steps} step(s); activation checkpointing "
        f"{'off' if args.no_checkpointing else 'on'} (both paths)"
    )
    print(
        "| B x T | one fp32 [B,T,V] copy | full-logits extra | chunked extra | chunked extra / copy | "
        "chunked over state | full peak | chunked peak | full s/step | chunked s/step | "
        "chunked / full time | loss full | loss chunked |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for shape, copy_gib, c, f, _ in rows:
        est = " (est.)" if f.get("est") else ""
        if (error := first_error(f, c)) is not None:
            print(f"| {shape} | {copy_gib:.2f} GiB | error: {error} |")
            continue
        loss_f = "—" if f.get("est") else f"{f['losses'][0]:.6f}"
        peak_f = "—" if f.get("est") else f"{f['peak_GiB']:.2f} GiB"
        print(
            f"| {shape} | {copy_gib:.2f} GiB | {f['extra_GiB']:.2f} GiB{est} | {c['extra_GiB']:.3f} GiB | "
            f"{c['extra_GiB'] / copy_gib:.3f} | {c['state_extra_GiB']:.2f} GiB | {peak_f} | "
            f"{c['peak_GiB']:.2f} GiB | {f['step_s']:.1f}{est} | "
            f"{c['step_s']:.1f} | {c['step_s'] / f['step_s']:.2f}{est} | {loss_f} | {c['losses'][0]:.6f} |"
        )
    fixed = [(shape, c, h) for shape, _, c, _, h in rows if h is not None]
    if fixed:
        print(
            "\nThe chunked path with glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_=1048576):"
        )
        print(
            "| B x T | peak, glibc default | peak, fixed threshold | fixed / default | "
            "s/step default | s/step fixed | fixed / default time |"
        )
        print("|---|---|---|---|---|---|---|")
        for shape, c, h in fixed:
            if (error := first_error(h, c)) is not None:
                print(f"| {shape} | error: {error} |")
                continue
            print(
                f"| {shape} | {c['peak_GiB']:.2f} GiB | {h['peak_GiB']:.2f} GiB | "
                f"{h['peak_GiB'] / c['peak_GiB']:.2f} | {c['step_s']:.1f} | {h['step_s']:.1f} | "
                f"{h['step_s'] / c['step_s']:.2f} |"
            )
    exit_on_errors([r for row in rows for r in row[2:]])


def exit_on_errors(runs: list) -> None:
    """Exit 1 when any measured run failed: its row says `error: ...` above, and a bench that
    printed one must not look like a clean measurement to a script or CI."""
    failed = [r for r in runs if isinstance(r, dict) and "error" in r]
    if failed:
        raise SystemExit(f"{len(failed)} run(s) failed: see the error rows above")


def first_error(*runs: dict) -> object:
    """The first of `runs` that failed: its error (the last lines of its stderr); None if none."""
    return next((r["error"] for r in runs if "error" in r), None)


def widths_for(smoke: bool, hidden: int | None) -> dict:
    """The policy's widths: Qwen's, `--smoke`'s, or Qwen's vocabulary at another hidden size."""
    if smoke:
        return SMOKE_WIDTHS
    if hidden is None or hidden == QWEN_WIDTHS["hidden_size"]:
        return QWEN_WIDTHS
    if hidden > QWEN_WIDTHS["hidden_size"]:
        return dict(QWEN_WIDTHS, hidden_size=hidden)
    return dict(SMOKE_WIDTHS, vocab_size=QWEN_WIDTHS["vocab_size"], hidden_size=hidden)


def repeated(n: int, one_run: Callable[[], dict]) -> dict:
    """`one_run()` in `n` processes: the first run's figures with the median peak RSS and step
    time, and `peaks` (every run's peak: the peak moves between identical runs, glibc's heap);
    the first failed run as is."""
    runs = []
    for _ in range(n):
        r = one_run()
        if "error" in r:
            return r
        runs.append(r)
    out = dict(runs[0])
    out["peak_GiB"] = statistics.median(r["peak_GiB"] for r in runs)
    out["step_s"] = statistics.median(r["step_s"] for r in runs)
    out["peaks"] = [r["peak_GiB"] for r in runs]
    return out


def micro_table(args: argparse.Namespace) -> list[dict]:
    """Peak RSS and time per token of a step as the rollout batch grows: one forward per
    minibatch (the baseline) vs micro-batches under a fixed token budget, each its own process."""
    ckpt, smoke = not args.no_checkpointing, args.smoke
    rows = []
    for B in args.micro_rows:
        one = repeated(
            args.repeats,
            partial(
                run, "chunked", B, args.micro_T, args.steps, args.threads, ckpt, smoke, args.hidden
            ),
        )
        micro = repeated(
            args.repeats,
            partial(
                run,
                f"micro{args.micro_tokens}",
                B,
                args.micro_T,
                args.steps,
                args.threads,
                ckpt,
                smoke,
                args.hidden,
            ),
        )
        rows.append((B, one, micro))
        print(json.dumps({"B": B, "one": one, "micro": micro}), file=sys.stderr)
    print(
        f"policy {widths_for(smoke, args.hidden)} + frozen reference copy; AdamW; "
        f"{args.threads} thread(s); T = {args.micro_T}; micro-batches of <= "
        f"{args.micro_tokens} padded tokens; median of {args.steps} step(s); peak and time "
        f"the median of {args.repeats} process(es); activation "
        f"checkpointing {'on' if ckpt else 'off'}"
    )
    print(
        "| samples | one forward: peak RSS | micro: peak RSS | micro / one | one forward: "
        "ms/token | micro: ms/token | micro / one | loss one | loss micro |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for B, one, micro in rows:
        if (error := first_error(one, micro)) is not None:
            print(f"| {B} | error: {error} |")
            continue
        peak = [r["peak_GiB"] for r in (one, micro)]
        per_token = [1e3 * r["step_s"] / r["tokens"] for r in (one, micro)]
        print(
            f"| {B} | {peak[0]:.2f} GiB | {peak[1]:.2f} GiB | {peak[1] / peak[0]:.2f} | "
            f"{per_token[0]:.3f} | {per_token[1]:.3f} | {per_token[1] / per_token[0]:.2f} | "
            f"{one['losses'][0]:.6f} | {micro['losses'][0]:.6f} |"
        )
    ok = [(one, micro) for _, one, micro in rows if first_error(one, micro) is None]
    if args.repeats > 1:
        for one, micro in ok:
            ranges = [f"{min(r['peaks']):.2f}–{max(r['peaks']):.2f}" for r in (one, micro)]
            print(
                f"{one['B']} samples, peak RSS over the runs: one {ranges[0]} GiB, micro {ranges[1]} GiB"
            )
    if len(ok) > 1:
        peaks = [m["peak_GiB"] for _, m in ok]
        print(
            f"micro-batched, largest / smallest batch: peak RSS {max(peaks) / min(peaks):.3f}, "
            f"time per token {max(r['step_s'] / r['tokens'] for _, r in ok) / min(r['step_s'] / r['tokens'] for _, r in ok):.3f}"
        )
        # a step is a fixed cost (the optimizer, the [V, H] embedding and LM-head gradients)
        # plus a cost per token: the marginal time per token between two sizes is the latter
        print("| from → to samples | one forward: marginal ms/token | micro: marginal ms/token |")
        print("|---|---|---|")
        for (o1, m1), (o2, m2) in zip(ok, ok[1:], strict=False):
            marginal = [
                1e3 * (b["step_s"] - a["step_s"]) / (b["tokens"] - a["tokens"])
                for a, b in ((o1, o2), (m1, m2))
            ]
            print(f"| {o1['B']} → {o2['B']} | {marginal[0]:.2f} | {marginal[1]:.2f} |")
    return [r for _, one, micro in rows for r in (one, micro)]


def chunk_table(args: argparse.Namespace, widths: dict) -> list[dict]:
    """The chunked path alone at each LM-head chunk size, each (shape, size) its own process:
    what the step adds over the warm-up, and its time, as the chunk shrinks."""
    vocab, ckpt = widths["vocab_size"], not args.no_checkpointing
    runs = []
    print(
        f"policy {widths} + frozen reference copy; AdamW; {args.threads} thread(s); median of "
        f"{args.steps} step(s); heads: {args.chunk_heads}; "
        f"activation checkpointing {'on' if ckpt else 'off'}; "
        f"{malloc_in_use()} (the workers inherit its LD_PRELOAD)"
    )
    print(
        "| B x T | chunk (MiB of fp32 logits) | chunk tokens | extra | over state | peak | "
        "s/step | time / largest chunk's | loss |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        B, T = map(int, shape.split("x"))
        rows = []
        for mib in args.chunk_mib:
            tokens = max(1, round(mib * 2**20 / 4 / vocab))
            path = "chunked" if args.chunk_heads == "all" else args.chunk_heads
            r = run(path, B, T, args.steps, args.threads, ckpt, args.smoke, args.hidden, tokens)
            print(json.dumps({"shape": shape, "chunk_mib": mib, "run": r}), file=sys.stderr)
            rows.append((mib, tokens, r))
            runs.append(r)
        ok = [r for _, _, r in rows if "error" not in r]
        largest = max(rows, key=lambda row: row[0])[2]
        for mib, tokens, r in rows:
            if (error := first_error(r)) is not None:
                print(f"| {shape} | {mib:g} | {tokens} | error: {error} |")
                continue
            ratio = f"{r['step_s'] / largest['step_s']:.2f}" if "error" not in largest else "—"
            print(
                f"| {shape} | {mib:g} | {tokens} | {r['extra_GiB']:.3f} GiB | "
                f"{r['state_extra_GiB']:.3f} GiB | {r['peak_GiB']:.2f} GiB | {r['step_s']:.2f} | "
                f"{ratio} | {r['losses'][0]:.6f} |"
            )
        if len({round(r["losses"][0], 5) for r in ok}) > 1:
            print(f"{shape}: the losses differ between chunk sizes (see the table)")
    return runs


def _mem_available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable"):
                return int(line.split()[1]) * 1024 / GiB
    return 16.0


if __name__ == "__main__":
    main()
