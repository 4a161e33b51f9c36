"""Quiet output: drop the log lines measured to be harmless, keep everything else.

vLLM's INFO lines (several per weight push) are off unless asked for (`VLLM_LOGGING_LEVEL`,
set before vLLM is imported); of its warnings, exactly the ones below are dropped, each known
to be harmless here. The rotary message is dropped only for the rotary layer (and Gemma 3's
model layer, whose only own tensor is a scale): the in-place reloader counts the rotary cache
buffer, which has no checkpoint weight, whereas the same message for any other layer means a
layer the push did not reach. Lightning's start-up lines
about accelerators, seeds and an optional logger package are dropped by the command line.
"""

from __future__ import annotations

import logging

#: vLLM warnings that are harmless in this library's in-process, tokenizer-free use.
HARMLESS_VLLM = (
    "RotaryEmbedding: Failed to load weights",  # the rotary cache buffer (see above)
    # Gemma 3's model layer holds one tensor of its own, the embedding scale sqrt(hidden) as a
    # buffer with no checkpoint weight; its parameters are its sublayers' (measured: the
    # canary's gap 2-6e-5 and the fingerprints held over 20 pushes of Gemma 3 270M)
    "Gemma3Model: Failed to load weights",
    "Chat template warmup failed",  # skip_tokenizer_init=True: the engine takes token ids
    # `VLLMEngine.add` passes token ids (`TokensPrompt`) straight to `LLMEngine.add_request`:
    # they need none of the rendering the message points to
    "Passing raw prompts to InputProcessor is deprecated",
    "Using None for EOS token id because tokenizer is not initialized",  # stop ids are given
    "CPU backend doesn't allow to use `torch.set_num_threads`",  # VLLMEngine restores it
    "The global random seed is set to",  # VLLMEngine restores the host's RNG states
    "libtcmalloc is not found in LD_PRELOAD",  # performance advice for dedicated CPU servers
    "libiomp is not found in LD_PRELOAD",
    "Reset SSM cache type to float32",  # no SSM layers
    "Model Runner V2 requires Triton",
    "Triton is not installed",
    "Inductor compilation was disabled by user settings",  # enforce_eager=True, on purpose
    "Enforce eager set, disabling torch.compile",
    "Triton is installed, but doesn't include CPU backend",
    # VLLMEngine turns chunked prefill off on CPU (a seeded split prefill crashes there); its
    # outputs were measured identical to chunked prefill's where that worked (engines/vllm.py)
    "This model does not officially support disabling chunked prefill",
    # the trainer's threads, which the user set; the engine shares the process (ENVIRONMENT.md)
    "OMP_NUM_THREADS=",
)

#: Lightning start-up lines that say nothing about this run.
HARMLESS_LIGHTNING = (
    "GPU available:",
    "TPU available:",
    "HPU available:",
    "💡 Tip:",
    "Seed set to",
    "`Trainer.fit` stopped:",  # the progress line already says where it stopped
)


class DropMessages(logging.Filter):
    """Drop records whose message starts with one of `prefixes`."""

    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().lstrip().startswith(self.prefixes)


def _attach(logger_name: str, prefixes: tuple[str, ...]) -> None:
    logger = logging.getLogger(logger_name)
    targets = [logger, *logger.handlers]  # handler filters also see records of child loggers
    for target in targets:
        if not any(isinstance(f, DropMessages) and f.prefixes == prefixes for f in target.filters):
            target.addFilter(DropMessages(prefixes))


def harmless_vllm_filter() -> DropMessages:
    """The filter of `HARMLESS_VLLM` (a factory for a logging config's `()` key)."""
    return DropMessages(HARMLESS_VLLM)


def quiet_vllm(level: str = "WARNING") -> None:
    """vLLM's logging at `level` without the known-harmless warnings (call after `import vllm`).

    vLLM re-applies its logging config when an `LLM` is created, replacing its handlers (and any
    filter on them), unless the config comes from the file named by `VLLM_LOGGING_CONFIG_PATH`:
    so its default config, plus the filter, is written to such a file and applied now and then.
    """
    import copy
    import json
    import logging.config
    import os
    import tempfile

    from vllm import logger as vllm_logger

    config = copy.deepcopy(vllm_logger.DEFAULT_LOGGING_CONFIG)
    config["filters"] = {"harmless": {"()": f"{__name__}.harmless_vllm_filter"}}
    handler = config["handlers"]["vllm"]
    handler.update(level=level, formatter="vllm", filters=["harmless"])
    config["loggers"]["vllm"]["level"] = level
    for formatter in config["formatters"].values():
        formatter["log_level"] = level
    with tempfile.NamedTemporaryFile(
        "w", suffix=".json", prefix="vllm_logging_", delete=False
    ) as f:
        json.dump(config, f)
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = f.name  # what vLLM applies when an LLM starts
    # Until then vLLM's records lack the fields of its formatter: a plain one meanwhile.
    early = copy.deepcopy(config)
    early["formatters"] = {"vllm": {"format": "%(levelname)s %(asctime)s %(message)s"}}
    logging.config.dictConfig(early)


def quiet_lightning() -> None:
    """Filter Lightning's start-up lines about accelerators, seeds and optional packages."""
    for name in (
        "lightning.pytorch",
        "lightning.fabric",
        "lightning.pytorch.utilities.rank_zero",
        "lightning.fabric.utilities.seed",
    ):
        _attach(name, HARMLESS_LIGHTNING)
