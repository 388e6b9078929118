"""FastAPI server of a worker: OpenAI routes, SSE streaming, metrics, admin."""
