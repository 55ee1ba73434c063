"""The OpenAI-compatible HTTP frontend: `/v1/chat/completions`, `/v1/completions`, `/v1/models`,
`/health`, `/live`, `/metrics`. Entry points: `run_frontend` (serve) and `create_app` (the ASGI app)."""
