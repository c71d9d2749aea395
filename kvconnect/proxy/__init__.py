"""`kvconnect proxy`: an OpenAI-compatible router that runs each request as prefill, then decode.

`pool` decides which instance serves (least outstanding requests among the live ones); `upstream`
makes the calls to instances (HTTP client, health probes, deadlines, errors); `pull` and `push` are
the two flows (prefill first, then decode with the returned transfer params; or both at once);
`relay` passes decode's stream through; `bodies` shapes the client's request; `app` serves the
routes; `config` is what it is told, `metrics` its Prometheus series, `command` the command line.
Needs the `proxy` extra (httpx, starlette, uvicorn).
"""
