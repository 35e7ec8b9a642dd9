"""OpenAI-compatible serving: ASGI app, engine thread, `llmopt serve` and `llmopt bench serve`."""
