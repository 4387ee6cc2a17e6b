"""The OpenAI-compatible server: `swarmkv serve` (docs/serve.md).

engine.py   requests as short-lived agents on lmxd's engine, the radix cache of kept cells
text.py     tokens to text as they come, stop strings
schemas.py  the request bodies the OpenAI API defines, validated
keys.py     API keys and the principals they stand for
app.py      the HTTP front: routes, errors in OpenAI's shape, server-sent events
cli.py      the command line, uvicorn
"""
