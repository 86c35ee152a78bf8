"""The OpenAI API: POST /v1/completions and POST /v1/chat/completions, and vLLM's POST /tokenize and
POST /detokenize beside them (docs/server_api.md). Its chat is what the other APIs are served as: a Responses or
Messages request becomes a ChatCompletionRequest (responses/, anthropic/).

    schema/      the request and response bodies, as pydantic models (a package: three endpoints' bodies)
    convert.py   engine output -> the whole answer's body: choices, usage, logprobs in the two OpenAI formats
    events.py    engine output -> the streamed answer's Server-Sent Events
    routes.py    the routes

Every API package has these four jobs under these names (responses/ and anthropic/ add their own convert.py's
request -> chat request); an OpenAI request becomes engine input in server/prepare.py, which every API shares.
"""
