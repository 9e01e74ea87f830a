"""The tiny random model ("jaxrunner-tiny-random"): a Llama-shaped model with random weights and a
character-level tokenizer, both built in memory, for tests and for machines without the real default
model (`model_files`). Its output is gibberish; it exists to show the machinery, not to write text.

The tokenizer knows printable ASCII and newline (anything else becomes <unk>), so even random output
is safe to print to a terminal.
"""

from __future__ import annotations

import functools
import string

from tokenizers import Tokenizer, decoders, models, processors

from jaxrunner.checkpoints.dummy import Params, random_params
from jaxrunner.config import ModelConfig

TINY_MODEL = "jaxrunner-tiny-random"
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
CHARACTERS = "\n" + "".join(c for c in string.printable if c.isprintable())
SEED = 0


def default_tokenizer():
    """One token per character, as a `transformers.PreTrainedTokenizerFast`; a BOS is added in front
    of every prompt, as Llama tokenizers do."""
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(CHARACTERS))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )


def default_model_config() -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=len(SPECIAL_TOKENS) + len(CHARACTERS),
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
    )


@functools.cache
def default_model(dtype: str = "float32") -> tuple[ModelConfig, Params]:
    """The default model's config and its fixed random weights (the same on every machine).

    Cached: drawing the weights compiles a few random-number programs, which is slow on a CPU, and
    the runner never modifies its params."""
    cfg = default_model_config()
    return cfg, random_params(cfg, dtype, SEED, std=0.5)
