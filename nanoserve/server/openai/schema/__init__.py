"""The OpenAI API's request and response bodies, as pydantic models (the part of the API nanoserve serves),
re-exported here: the server imports them as `from nanoserve.server.openai import schema as P`.

    completions.py   POST /v1/completions: request, choices, response, stream chunk
    chat.py          POST /v1/chat/completions: messages, request, choices, response, stream chunk
    sampling.py      what those two share: the sampling fields and their SamplingParams, response_format, the
                     fields refused by name, usage, prompt_logprobs
    tokenize.py      POST /tokenize and POST /detokenize
    models.py        GET /v1/models

They build on server/schema_base.py (the strict request base, the response base, the error body), as the other
APIs' bodies do: responses/schema.py (OpenAI's Responses API) and anthropic/schema.py (Anthropic's Messages API).
A new OpenAI endpoint's bodies get a module of their own here, re-exported below.

Value ranges are not repeated here: `SamplingParams` checks them, and its errors name the parameter. Fields
nanoserve cannot honour (`suffix`, `best_of` other than n, `logits_processors`, ...) are refused by name rather
than ignored. vLLM's extensions are accepted too: top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids, include_stop_str_in_output, skip_special_tokens, allowed_token_ids, bad_words, prompt_logprobs,
return_token_ids, return_tokens_as_token_ids, add_special_tokens, chat_template_kwargs.
"""

from nanoserve.server.openai.schema.chat import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogProb,
    ChatLogProbs,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTool,
    ChatTopLogProb,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    FunctionDefinition,
    ResponseFunctionCall,
    ResponseToolCall,
    TextPart,
    ToolCallParam,
)
from nanoserve.server.openai.schema.completions import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
)
from nanoserve.server.openai.schema.models import ModelCard, ModelList
from nanoserve.server.openai.schema.sampling import (
    PromptLogprob,
    PromptTokensDetails,
    ResponseFormat,
    SamplingRequest,
    StreamOptions,
    UsageInfo,
)
from nanoserve.server.openai.schema.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)

__all__ = ["ChatChoice", "ChatCompletionChunk", "ChatCompletionRequest", "ChatCompletionResponse", "ChatLogProb",
           "ChatLogProbs", "ChatMessage", "ChatResponseMessage", "ChatStreamChoice", "ChatTool", "ChatTopLogProb",
           "DeltaFunctionCall", "DeltaMessage", "DeltaToolCall", "FunctionCall", "FunctionDefinition",
           "ResponseFunctionCall", "ResponseToolCall", "TextPart", "ToolCallParam",
           "CompletionChoice", "CompletionChunk", "CompletionLogProbs", "CompletionRequest", "CompletionResponse",
           "PromptLogprob", "PromptTokensDetails", "ResponseFormat", "SamplingRequest", "StreamOptions", "UsageInfo",
           "DetokenizeRequest", "DetokenizeResponse", "TokenizeRequest", "TokenizeResponse", "ModelCard", "ModelList"]
