"""Run by tests/test_hub_export.py in a subprocess: vLLM loads an exported model directory as
it is (tokenizer included) and prints, as one JSON line, the token ids of TEXT and the
log-prob of each token after the first given the ones before it (prompt log-probs)."""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

model_dir, text = sys.argv[1], sys.argv[2]
llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, seed=0, max_model_len=256)
ids = llm.get_tokenizer()(text)["input_ids"]
params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
(out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
logprobs = [entry[tok].logprob for entry, tok in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
print(json.dumps({"ids": list(ids), "logprobs": logprobs}))
