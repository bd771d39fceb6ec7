"""The request bodies of /v1/completions and /v1/chat/completions (OpenAI's fields; unknown fields are ignored,
unsupported ones refused) and what a validated body asks the engine for."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from .requests import GenerationRequest


def _refuse_unless_off(value, info):
    """A field this server does not implement is accepted only at its 'off' value (null, false, 0, empty)."""
    if value not in (None, False, 0, [], {}):
        raise ValueError(f"{info.field_name} is not supported by this server")
    return value


def _only_one(value, info):
    """n and best_of: one choice per request."""
    if value not in (None, 1):
        raise ValueError(f"only {info.field_name}=1 is supported, got {value}")
    return value


class _StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: StrictInt | None = Field(None, ge=-1, description="extension: keep the k most likely tokens; 0 or -1 = off")
    seed: StrictInt | None = Field(None, ge=0)
    n: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: _StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    one_choice = field_validator("n")(_only_one)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    refuse_unsupported = field_validator("presence_penalty", "frequency_penalty", "logit_bias")(_refuse_unless_off)

    def request(self, prompt_ids: list[int], max_tokens: int) -> GenerationRequest:
        return GenerationRequest(
            prompt_ids=tuple(prompt_ids),
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,  # OpenAI's default
            top_k=max(self.top_k or 0, 0),
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            stop=tuple(self.stop or ()),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerationFields):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    echo: bool | None = None
    suffix: str | None = None
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError(f"one prompt per request is supported, got {len(prompt)}")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt

    refuse_unsupported_here = field_validator("echo", "suffix", "logprobs")(_refuse_unless_off)

    one_candidate = field_validator("best_of")(_only_one)


class _TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[_TextPart] | None = None

    def as_template_message(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: bool | None = None
    tools: list | None = None
    response_format: dict | None = None

    refuse_unsupported_here = field_validator("logprobs", "tools")(_refuse_unless_off)

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: dict | None) -> dict | None:
        if value and value.get("type") != "text":
            raise ValueError("only response_format {\"type\": \"text\"} is supported")
        return value
