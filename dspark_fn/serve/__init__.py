"""``dspark serve``: an OpenAI-compatible HTTP server over the continuous-batching engine."""
