"""OpenAI-compatible routes (``/v1/...``) for routes that declare ``[route] openai``."""
