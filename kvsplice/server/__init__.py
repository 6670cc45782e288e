"""The OpenAI-compatible HTTP server (`kvsplice serve`); see docs/server.md.

    app.py          routes: completions, chat, models, health, metrics; streaming and disconnects
    engine_loop.py  the engine's own thread, and the queues that connect handlers to it
    prompts.py      the HTTP prompt forms, segments and the chat template -> engine prompts
    protocol.py     request bodies and usage
    metrics.py      Prometheus metrics (vLLM's names where they exist)
    errors.py       OpenAI-shaped error bodies
    launch.py       `kvsplice serve`, and a server in a background thread

Nothing is imported here, so that the CLI can register `serve` without loading the web stack.
"""
