"""Offline pieces for driving the Tinker cookbook: a byte-level tokenizer built in-process (no download),
a Qwen3 renderer over it, and a scripted token policy that replays model texts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tinker_cookbook.completers import StopCondition, TokenCompleter, TokensWithLogprobs

TOKENIZER_NAME = "rlgate-test/bytes"


def make_tokenizer() -> Any:
    import threading

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    class LockedTokenizer(PreTrainedTokenizerFast):
        # The cookbook renders in threads and toggles split_special_tokens per call, which a shared Rust
        # tokenizer rejects ("Already borrowed") when two threads do it at once: serialize encoding.
        _lock = threading.RLock()

        def encode(self, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return super().encode(*args, **kwargs)

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = LockedTokenizer(tokenizer_object=tok, eos_token="<|im_end|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]})
    return fast


def renderer() -> Any:
    from tinker_cookbook.renderers import get_renderer
    from tinker_cookbook.tokenizer_utils import get_tokenizer, register_tokenizer

    register_tokenizer(TOKENIZER_NAME, make_tokenizer)
    return get_renderer("qwen3_instruct", get_tokenizer(TOKENIZER_NAME), model_name=TOKENIZER_NAME)


class ScriptedPolicy(TokenCompleter):
    """A TokenCompleter whose reply is `script(prompt_text, turn_index)`, encoded and ended with <|im_end|>."""

    def __init__(self, script: Callable[[str, int], str]) -> None:
        self.script = script
        self.tokenizer = make_tokenizer()
        self.calls = 0

    async def __call__(
        self, model_input: Any, stop: StopCondition, *, max_tokens: int | None = None
    ) -> TokensWithLogprobs:
        self.calls += 1
        prompt = self.tokenizer.decode(model_input.to_ints())
        turn = prompt.count("<|im_start|>assistant") - 1
        text = self.script(prompt, turn)
        tokens = [*self.tokenizer.encode(text, add_special_tokens=False), *(int(t) for t in stop)]
        return TokensWithLogprobs(tokens=tokens, maybe_logprobs=[0.0] * len(tokens))
