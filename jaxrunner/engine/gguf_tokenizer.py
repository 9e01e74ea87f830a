"""A GGUF file's tokenizer, rebuilt from its metadata as a `transformers.PreTrainedTokenizerFast`.

GGUF stores a byte-level BPE tokenizer ("gpt2" in `tokenizer.ggml.model`: SmolLM, Llama 3, Qwen) as
its vocabulary, merges, token types and special ids, and names its pre-tokenizer
(`tokenizer.ggml.pre`); each name stands for the split rules of the original tokenizer.json, which
`_SPLITS` spells out for the names we know.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from jaxrunner.checkpoints.gguf_file import GGUFFile

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# tokenizer.ggml.pre -> the regexes that split text before BPE, applied in turn.
_SPLITS = {
    "gpt-2": (_GPT2,),
    "smollm": (r"\p{N}", _GPT2),
    "llama-bpe": (_LLAMA3,),
    "qwen2": (_QWEN2,),
}
_NFC = ("qwen2",)
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def gguf_tokenizer(gguf: GGUFFile):
    """The tokenizer the GGUF file describes, with its chat template."""
    from transformers import PreTrainedTokenizerFast

    meta = gguf.metadata
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "gpt-2")
    hint = "pass a Hugging Face tokenizer directory as tokenizer= (--tokenizer)"
    if kind != "gpt2":
        raise ValueError(f"GGUF file {gguf.path!r} has a {kind!r} tokenizer; jaxrunner rebuilds only byte-level BPE "
                         f"('gpt2') tokenizers from GGUF: {hint}")
    if pre not in _SPLITS:
        raise ValueError(f"GGUF file {gguf.path!r} names the pre-tokenizer {pre!r}, which jaxrunner does not know "
                         f"(known: {', '.join(_SPLITS)}): {hint}")
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    if pre in _NFC:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(rule), behavior="isolated") for rule in _SPLITS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED])

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if i is None else tokens[i]

    bos, bos_id = token("bos"), meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, bos_id)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=token("eos"), unk_token=token("unknown"),
        pad_token=token("padding"), chat_template=meta.get("tokenizer.chat_template"),
    )
