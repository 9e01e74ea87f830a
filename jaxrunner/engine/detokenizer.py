"""Incremental detokenization and stop strings, with vLLM's semantics.

Text grows one token at a time. Decoding a token alone is wrong for most tokenizers (a leading space
depends on the token before it; a multi-byte character can span tokens), so each step decodes a
short window that starts a few tokens back and keeps only what the new token added; text ending in
an incomplete character ("\\ufffd") is held until the character completes.

Stop strings are searched in the new text (plus the overlap a match could straddle). On a match the
text is cut before the stop string, or after it with `include_stop_str_in_output`; the token ids are
not cut. A request ended by EOS or a stop token id does not get that token's text, unless
`include_stop_str_in_output`. While streaming, the last `len(longest stop string) - 1` characters
are held back, since they may turn out to be the start of a stop string.
"""

from __future__ import annotations

from jaxrunner.sampling_params import SamplingParams

# Prompt tokens decoded ahead of the first output token, so it gets the spacing it has mid-text.
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop_strings
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        hold_back = self.stop and not self.include_stop_str_in_output
        self.stop_buffer_length = max(len(s) for s in self.stop) - 1 if hold_back else 0
        self.output_text = ""
        self.num_output_tokens = 0
        self._ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._sent = 0

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Add tokens to the text; the stop string that ended the request, if one matched.

        `stop_terminated`: the last token is the EOS or stop token id that finished the request.
        """
        if stop_terminated and not self.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        check_from = len(self.output_text)
        for token_id in new_token_ids:
            self.num_output_tokens += 1
            self.output_text += self._decode_next(token_id)
            if self.num_output_tokens <= self.min_tokens:
                check_from = len(self.output_text)
        if stop_terminated or not self.stop:
            return None
        return self._match_stop_string(check_from)

    def text(self, finished: bool, delta: bool = False) -> str:
        """The output text so far (or, with `delta`, what was not returned before), minus held-back
        characters while the request runs."""
        end = max(len(self.output_text) - (0 if finished else self.stop_buffer_length), 0)
        if not delta:
            return self.output_text[:end]
        start, self._sent = self._sent, max(self._sent, end)
        return self.output_text[start:end]

    def _decode_next(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _match_stop_string(self, check_from: int) -> str | None:
        """The first stop string (in the user's order) found in the new text; cuts the text there."""
        for stop in self.stop:
            index = self.output_text.find(stop, max(check_from - len(stop) + 1, 0))
            if index < 0:
                continue
            if self.include_stop_str_in_output:
                index += len(stop)
            self.output_text = self.output_text[:index]
            return stop
        return None
