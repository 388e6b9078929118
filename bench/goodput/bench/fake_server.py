"""A fake OpenAI-compatible completion server with a fixed timing model, for testing the
benchmark harness without a model:

    python -m goodput.bench.fake_server --port 8000 --prefill-ms-per-token 0.2 --itl-ms 5

Prompt tokens are counted as whitespace-separated words. Each request: sleep prompt_tokens x
prefill-ms-per-token (+ ttft-ms), then emit max_tokens one-token SSE events itl-ms apart, a final
chunk with finish_reason "length" and a usage chunk. /ready, /v1/models, /admin/state answer
like the worker's. Requests beyond --max-inflight get 429 with Retry-After.
"""
import argparse
import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def make_app(ttft_ms: float = 5.0, itl_ms: float = 5.0, prefill_ms_per_token: float = 0.05,
             max_inflight: int = 1000, model: str = "fake"):
    app = FastAPI()
    state = {"inflight": 0, "generation_tokens": 0}

    @app.get("/ready")
    async def ready():
        return {"status": "ready", "model": model}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model"}]}

    @app.get("/admin/state")
    async def admin_state():
        return {"running": state["inflight"], "counters": {"generation_tokens": state["generation_tokens"]}}

    @app.post("/v1/completions")
    async def completions(req: Request):
        body = await req.json()
        if state["inflight"] >= max_inflight:
            return JSONResponse({"error": {"message": "queue full", "type": "rate_limit_error", "param": None,
                                           "code": None}}, status_code=429, headers={"Retry-After": "1"})
        n = int(body.get("max_tokens", 16))
        n_prompt = len(str(body.get("prompt", "")).split())
        state["inflight"] += 1

        async def gen():
            try:
                await asyncio.sleep((ttft_ms + n_prompt * prefill_ms_per_token) / 1e3)
                for i in range(n):
                    if i:
                        await asyncio.sleep(itl_ms / 1e3)
                    state["generation_tokens"] += 1
                    ch = {"object": "text_completion", "model": model,
                          "choices": [{"index": 0, "text": f" w{i}", "finish_reason": "length" if i == n - 1 else None}]}
                    yield f"data: {json.dumps(ch)}\n\n"
                u = {"choices": [], "usage": {"prompt_tokens": n_prompt, "completion_tokens": n,
                                              "total_tokens": n_prompt + n}}
                yield f"data: {json.dumps(u)}\n\ndata: [DONE]\n\n"
            finally:
                state["inflight"] -= 1

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ttft-ms", type=float, default=5.0)
    p.add_argument("--itl-ms", type=float, default=5.0)
    p.add_argument("--prefill-ms-per-token", type=float, default=0.05)
    p.add_argument("--max-inflight", type=int, default=1000)
    a, _ = p.parse_known_args(argv)  # tolerate worker flags when standing in for the worker
    uvicorn.run(make_app(a.ttft_ms, a.itl_ms, a.prefill_ms_per_token, a.max_inflight), host=a.host, port=a.port,
                log_level="warning")


if __name__ == "__main__":
    main()
