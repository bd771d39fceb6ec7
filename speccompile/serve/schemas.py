"""The request bodies of /v1/completions and /v1/chat/completions (OpenAI's fields; unknown fields are ignored,
unsupported ones refused) and what a validated body asks the engine for."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from ..runtime.constraints import ConstraintSpec
from ..runtime.options import DraftTuning
from .api_errors import ParamError
from .requests import GenerationRequest
from .structured import ResponseFormat, StructuredOutputs, ToolFields


def _refuse_unless_off(value, info):
    """A field this server does not implement is accepted only at its 'off' value (null, false, 0, empty)."""
    if value not in (None, False, 0, [], {}):
        raise ValueError(f"{info.field_name} is not supported by this server")
    return value


def _only_one(value, info):
    """best_of: one candidate per choice."""
    if value not in (None, 1):
        raise ValueError(f"only {info.field_name}=1 is supported, got {value}")
    return value


MAX_CHOICES = 128  # n (OpenAI's limit); the engine's admission limit applies to the choices of all prompts together


class _StreamOptions(BaseModel):
    include_usage: bool = False


# the runtime's names of the drafting settings (Runner.check_drafting's errors) -> the request's and the server's
SPECULATIVE_NAMES = {
    "drafter": "speculative_config.method", "num_draft_tokens": "speculative_config.num_speculative_tokens",
    "min_match": "speculative_config.prompt_lookup_min", "max_match": "speculative_config.prompt_lookup_max",
    "max_depth": "speculative_config.suffix_decoding_max_tree_depth",
    "min_prob": "speculative_config.suffix_decoding_min_token_prob",
    "spec_factor": "speculative_config.suffix_decoding_max_spec_factor", "suffix_max_depth": "--suffix-max-depth",
    "suffix_decoding_max_cached_requests": "speculative_config.suffix_decoding_max_cached_requests",
}


class SpeculativeConfig(BaseModel):
    """vLLM's `speculative_config`, per request, with vLLM's keys: `method` the server's drafter (vLLM's spellings
    `draft_model` and `<model>_mtp` too) or "none" (plain decoding); `num_speculative_tokens` at most the server's
    `--num-draft-tokens`; n-gram's `prompt_lookup_min` / `_max` and suffix decoding's tree depth (at most the
    server's `--suffix-max-depth`), least token probability and spec factor for this request alone (they change
    proposals only); `suffix_decoding_max_cached_requests` is the server's store (`--suffix-cache-requests`): the
    same number or left out."""

    model_config = ConfigDict(extra="forbid")

    method: str
    num_speculative_tokens: StrictInt | None = Field(None, ge=1)
    prompt_lookup_min: StrictInt | None = Field(None, ge=1)
    prompt_lookup_max: StrictInt | None = Field(None, ge=1)
    suffix_decoding_max_tree_depth: StrictInt | None = Field(None, ge=1)
    suffix_decoding_min_token_prob: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    suffix_decoding_max_spec_factor: float | None = Field(None, gt=0, allow_inf_nan=False)
    suffix_decoding_max_cached_requests: StrictInt | None = Field(None, ge=0)

    @field_validator("method")
    @classmethod
    def _our_spelling(cls, method: str) -> str:
        """vLLM's spellings: `draft_model`, and a model's own MTP (`deepseek_mtp`, `qwen3_next_mtp`, ...) as `mtp`."""
        return "draft-model" if method == "draft_model" else "mtp" if method.endswith("_mtp") else method

    @model_validator(mode="after")
    def _keys_of_the_method(self):
        ngram = ("prompt_lookup_min", "prompt_lookup_max")
        suffix = tuple(name for name in type(self).model_fields if name.startswith("suffix_decoding_"))
        for name in (*ngram, *suffix):
            own = "ngram" if name in ngram else "suffix"
            if getattr(self, name) is not None and self.method != own:
                raise ValueError(f"{name} is a setting of method '{own}', not of '{self.method}'")
        if None not in (self.prompt_lookup_min, self.prompt_lookup_max) and self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min {self.prompt_lookup_min} exceeds prompt_lookup_max {self.prompt_lookup_max}")
        return self

    def tuning(self) -> DraftTuning | None:
        """The request's own drafter settings (None: the server's)."""
        tuning = DraftTuning(self.prompt_lookup_min, self.prompt_lookup_max, self.suffix_decoding_max_tree_depth,
                             self.suffix_decoding_min_token_prob, self.suffix_decoding_max_spec_factor)
        return tuning if tuning.set_fields() else None


class _GenerationFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: StrictInt | None = Field(None, ge=-1, description="extension: keep the k most likely tokens; 0 or -1 = off")
    seed: StrictInt | None = Field(None, ge=0)
    n: StrictInt | None = Field(None, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: _StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0, allow_inf_nan=False, description="vLLM's extension")
    min_p: float | None = Field(None, ge=0, le=1, allow_inf_nan=False, description="vLLM's extension")
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM's extension: regex, choice, grammar, json")
    drafter: Literal["none"] | None = Field(None, description="extension: 'none' decodes this request without drafting")
    speculative_config: SpeculativeConfig | None = Field(None, description="vLLM's: {'method': the server's drafter, or 'none'}")
    user: str | None = Field(None, max_length=256, description="the client: the suffix drafter drafts from its own earlier responses only")

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias_pairs(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        seen: set[int] = set()
        for key, value in (bias or {}).items():
            if not key.isdigit() or not key.isascii():
                raise ValueError(f"keys are token ids, got {key!r}")
            if int(key) in seen:
                raise ValueError(f"token {int(key)} is given twice")
            seen.add(int(key))
            if not -100 <= value <= 100:  # (NaN fails too)
                raise ValueError(f"the bias of token {key} must be in [-100, 100], got {value}")
        return bias

    @model_validator(mode="after")
    def _one_constraint(self):
        if self.structured_outputs is not None and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("give response_format or structured_outputs, not both")
        return self

    def constraint_spec(self) -> ConstraintSpec | None:
        """What the answer must match (response_format or structured_outputs), before compiling."""
        if self.structured_outputs is not None:
            return self.structured_outputs.spec()
        return self.response_format.spec() if self.response_format is not None else None

    @property
    def choices(self) -> int:
        """Choices per prompt (n)."""
        return self.n or 1

    def drafting(self) -> dict[str, Any]:
        """The GenerationRequest fields of `drafter` and `speculative_config`."""
        spec = self.speculative_config
        if spec is None:
            return {"drafter": self.drafter}
        return {"drafter": self.drafter or spec.method, "num_draft_tokens": spec.num_speculative_tokens,
                "draft_tuning": spec.tuning(), "cached_requests": spec.suffix_decoding_max_cached_requests}

    def request(self, prompt_ids: list[int], max_tokens: int, constraint: Any = None,
                logprobs: int | None = None, choice: int = 0, prompt_logprobs: bool = False) -> GenerationRequest:
        """The engine's request for choice `choice` (its seed: seed + choice); `constraint`: the compiled grammar;
        `logprobs`: alternatives per token (None: off); `prompt_logprobs`: the prompt's too (echo)."""
        bias = {int(key): value for key, value in (self.logit_bias or {}).items()}
        return GenerationRequest(
            prompt_ids=tuple(prompt_ids),
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,  # OpenAI's default
            top_k=max(self.top_k or 0, 0),
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=None if self.seed is None else self.seed + choice,
            stop=tuple(self.stop or ()),
            constraint=constraint,
            logprobs=logprobs,
            **self.drafting(),
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=tuple(sorted(bias.items())),
            prompt_logprobs=prompt_logprobs,
            user=self.user,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerationFields):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    echo: bool | None = None
    suffix: str | None = None
    logprobs: StrictInt | None = Field(None, ge=0, le=5)
    best_of: StrictInt | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts_given(cls, prompt):
        if not prompt:
            raise ValueError("the prompt is empty")
        if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) and not all(prompt):
            raise ValueError(f"prompt {[bool(p) for p in prompt].index(False)} of the list is empty")
        return prompt

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts (one, or a list: each gets n choices)."""
        prompt = self.prompt
        return list(prompt) if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) else [prompt]

    refuse_unsupported_here = field_validator("suffix")(_refuse_unless_off)

    one_candidate = field_validator("best_of")(_only_one)


class _TextPart(BaseModel):
    type: Literal["text"]
    text: str


class _CalledFunction(BaseModel):
    name: str
    arguments: str | dict[str, Any]


class _ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: _CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None
    tool_calls: list[_ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None

    @model_validator(mode="after")
    def _shape(self) -> "ChatMessage":
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        for i, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(f"part {i} is of type {kind!r}: this server takes text only (images, audio and "
                                 "files are not supported)")
        return content

    def as_template_message(self) -> dict[str, Any]:
        """The message as chat templates read it (tool-call arguments as objects, as Hugging Face passes them)."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                     for c in self.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


def _arguments(arguments: str | dict[str, Any]) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


class ChatCompletionRequest(_GenerationFields, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ParamError("top_logprobs", "needs logprobs: true")
        forced = self.tool_choice not in (None, "none", "auto") and bool(self.tools)
        if forced and self.constraint_spec() is not None:
            raise ParamError("tool_choice", "required or a named function already fixes the answer's format: drop "
                             "response_format / structured_outputs")
        return self

    @property
    def logprob_count(self) -> int | None:
        """Alternatives per token (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None
