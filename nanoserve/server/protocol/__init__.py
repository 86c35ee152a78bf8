"""What the bodies of every API build on (common.py: the strict request base, the sampling fields of a
generation request, usage, the model list, OpenAI's error body), and the Responses API's bodies
(responses_api.py). The OpenAI API's own bodies are in openai/schema/, Anthropic's in anthropic/schema.py.
"""
