"""What the bodies of every API build on - common.py: the strict request base, the sampling fields of a
generation request, usage, the model list, OpenAI's error body. The OpenAI API's own bodies are in
openai/schema/ (which re-exports these), the Responses API's in responses/schema.py, Anthropic's in
anthropic/schema.py.
"""
