"""`kvconnect proxy`: an OpenAI-compatible router that runs each request as prefill, then decode.

`pool` decides which instance serves (least outstanding requests among the live ones); `app` moves
the HTTP (prefill with `do_remote_decode`, decode with the returned transfer params, streaming passed
through); `metrics` its Prometheus series; `command` is the command line. Needs the `proxy` extra (httpx, starlette, uvicorn).
"""
