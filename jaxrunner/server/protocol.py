"""The OpenAI request bodies (pydantic), with vLLM's extra sampling fields, and their mapping onto
`SamplingParams`: a field the body leaves out takes the model's default (vLLM's generation_config),
else OpenAI's. Unknown fields are refused, so a misspelt parameter is a 400 that names it rather
than a default silently used. What one request may ask for is bounded (completions per prompt,
prompts, stop strings), so no single request takes the engine from the others."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxrunner.sampling_params import SamplingParams, StructuredOutputsParams

MAX_N = 128  # completions per prompt
MAX_PROMPTS = 256  # prompts in one completions request
MAX_STOP = 64  # stop strings: each is matched against every new piece of text


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str = "schema"
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs` field: one of these."""

    json_: str | dict | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(_Body):
    """What completions and chat share: OpenAI's sampling fields, then vLLM's extras."""

    model: str | None = None
    n: int = Field(default=1, le=MAX_N)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputs | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, defaults: dict) -> SamplingParams:
        """The body's fields over `defaults` (what a field left out takes); ValueError (a 400) for
        values SamplingParams refuses or fields that do not combine."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream: true")
        given = {name: getattr(self, name) for name in (
            "n", "temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "stop", "top_k", "min_p",
            "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "include_stop_str_in_output",
            "skip_special_tokens", "allowed_token_ids", "bad_words") if getattr(self, name) is not None}
        if max_tokens is not None:
            given["max_tokens"] = max_tokens
        if self.logit_bias is not None:
            try:
                given["logit_bias"] = {int(token): bias for token, bias in self.logit_bias.items()}
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {sorted(self.logit_bias)[:5]}") from None
        return SamplingParams(**{**defaults, **given}, logprobs=logprobs, structured_outputs=self._structured())

    def _structured(self) -> StructuredOutputsParams | None:
        formats = []
        if (rf := self.response_format) is not None and rf.type != "text":
            if rf.type == "json_object":
                formats.append(StructuredOutputsParams(json_object=True))
            elif rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ValueError("response_format of type json_schema needs json_schema.schema")
            else:
                formats.append(StructuredOutputsParams(json=rf.json_schema.schema_))
        if (so := self.structured_outputs) is not None:
            formats.append(StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                                   json_object=so.json_object))
        if len(formats) > 1:
            raise ValueError("give response_format or structured_outputs, not both")
        return formats[0] if formats else None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        if not self.prompt:
            raise ValueError("prompt is empty")
        if len(self.prompt) > MAX_PROMPTS:
            raise ValueError(f"prompt holds {len(self.prompt)} prompts, more than the {MAX_PROMPTS} one request may give")
        return list(self.prompt)

    def to_sampling_params(self, defaults: dict) -> SamplingParams:
        """`defaults`: the model's, for the fields the body leaves out (max_tokens: else OpenAI's 16)."""
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of} is not supported: leave it out or equal to n")
        if self.suffix is not None:
            raise ValueError("suffix is not supported")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not supported")
        if self.echo and not all(isinstance(p, str) for p in self.prompts()):
            raise ValueError("echo needs text prompts")
        return self.sampling_params(self.max_tokens, self.logprobs, {"max_tokens": 16, **defaults})


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def as_dict(self) -> dict:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or ())
        return {"role": self.role, "content": content}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def to_sampling_params(self, defaults: dict) -> SamplingParams:
        """`defaults`: the model's, for the fields the body leaves out (max_tokens: else up to the
        model length)."""
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens
        return self.sampling_params(max_tokens, logprobs, {"max_tokens": None, **defaults})


class LoadLoRAAdapterRequest(_Body):
    """vLLM's /v1/load_lora_adapter body: the name `model` will give, and the PEFT directory."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(_Body):
    lora_name: str = Field(min_length=1)
