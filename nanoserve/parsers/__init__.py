"""Output parsers for the chat API: what the model generated -> the OpenAI message fields.

    reasoning.py    --reasoning-parser NAME: splits the thinking block (<mm:think>...</mm:think>) out of the text
    tool_calls.py   --tool-call-parser NAME: turns the model's tool-call markup into OpenAI `tool_calls`
    markers.py      held-back text: what might still become a marker
    tool_values.py  typing a tool call's raw argument text by the tool's JSON schema (numbers, booleans, objects)
    tools.py        the request side: validating `tools` / `tool_choice`, and what a forced call must look like
    chat_output.py  both parsers chained over one choice's text, whole or as it streams

Each parser is incremental (text arrives in pieces, a marker may be split across pieces) and the whole-text
result is the streaming result fed in one piece, so streaming and non-streaming answers agree by construction.
"""

from nanoserve.parsers.reasoning import REASONING_PARSERS, get_reasoning_parser
from nanoserve.parsers.tool_calls import TOOL_CALL_PARSERS, get_tool_call_parser

__all__ = ["REASONING_PARSERS", "TOOL_CALL_PARSERS", "get_reasoning_parser", "get_tool_call_parser"]
