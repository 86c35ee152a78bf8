"""The OpenAI API's request and response bodies, as pydantic models (the part of the API nanoserve serves),
re-exported here: the server imports them as `from nanoserve.server.openai import schema as P`.

    completions.py   POST /v1/completions: request, choices, response, stream chunk
    chat.py          POST /v1/chat/completions: messages, request, choices, response, stream chunk
    tokenize.py      POST /tokenize and POST /detokenize
    common.py        the strict request base every API's bodies build on (the Responses and Messages APIs' too),
                     the sampling fields shared by every generation request, usage, the model list, OpenAI's
                     error body

The other APIs' bodies are in their packages: responses/schema.py (OpenAI's Responses API) and
anthropic/schema.py (Anthropic's Messages API). A new OpenAI endpoint's bodies get a module of their own here,
re-exported below.

Requests are parsed strictly - "10" is not an integer, 1.5 is not an integer, true is not a number - so a wrong
type is a 400 that names the field instead of a silent conversion (one exception, as in vLLM's models: an
integer field takes an integral float, n=1.0). Unknown fields are ignored (clients send fields such as `store`
or `service_tier`), but fields nanoserve cannot honour (`suffix`, `best_of` other than n, `use_beam_search`)
are refused rather than ignored. Value ranges are not repeated here: `SamplingParams` checks them, and its
errors name the parameter. vLLM's extensions are accepted too: top_k, min_p, repetition_penalty, min_tokens,
ignore_eos, stop_token_ids, include_stop_str_in_output, skip_special_tokens, allowed_token_ids, bad_words,
prompt_logprobs, return_token_ids, return_tokens_as_token_ids, add_special_tokens, chat_template_kwargs.
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
from nanoserve.server.openai.schema.common import (
    ElidedText,
    ErrorInfo,
    ErrorResponse,
    Int,
    ModelCard,
    ModelList,
    PromptLogprob,
    PromptTokensDetails,
    RequestBody,
    RequestModel,
    ResponseModel,
    SamplingRequest,
    StreamOptions,
    UsageInfo,
)
from nanoserve.server.openai.schema.completions import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
)
from nanoserve.server.openai.schema.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)

__all__ = ["ChatChoice", "ChatCompletionChunk", "ChatCompletionRequest", "ChatCompletionResponse", "ChatLogProb",
           "ChatLogProbs", "ChatMessage", "ChatResponseMessage", "ChatStreamChoice", "ChatTool", "ChatTopLogProb",
           "DeltaFunctionCall", "DeltaToolCall", "FunctionCall", "FunctionDefinition", "ResponseFunctionCall",
           "ResponseToolCall", "ToolCallParam",
           "CompletionChoice", "CompletionChunk", "CompletionLogProbs", "CompletionRequest", "CompletionResponse",
           "DeltaMessage", "DetokenizeRequest", "DetokenizeResponse", "ElidedText", "ErrorInfo", "ErrorResponse",
           "Int", "ModelCard", "ModelList", "PromptLogprob", "PromptTokensDetails", "RequestBody", "RequestModel",
           "ResponseModel",
           "SamplingRequest", "StreamOptions", "TextPart", "TokenizeRequest", "TokenizeResponse", "UsageInfo"]
