"""`clover serve`: an OpenAI-compatible HTTP API over one decoding engine (schemas, request planning,
the engine thread, streamed text and tool calls, response formats, the app)."""
