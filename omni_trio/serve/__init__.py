"""The daemon: ``omni-trio serve`` -- engines behind an OpenAI-compatible images API.

Layout (one concept per module)::

    config.py   ServeConfig: every daemon setting (flags, TOML file, env), validated
    pool.py     EnginePool: K supervised engine replicas (one_for_one) + least-loaded routing
    images.py   request parsing (OpenAI Images fields -> SamplingParams) and image encoding
    app.py      the ASGI app (routes, OpenAI error envelopes, SSE, auth, ownership, limits)
    http.py     the HTTP server: hypercorn's protocols under our listener, with the bounds on
                slow and stalled clients (connection cap, the write deadline on HTTP/1.1 and
                HTTP/2 flow control, read-ahead cap, connections closed at shutdown),
                enveloped protocol errors, and one connection's failure kept to itself
    metrics.py  Prometheus metrics (one registry per app)
    notify.py   systemd notify protocol (READY, WATCHDOG, STOPPING, STATUS)
    daemon.py   serve_daemon(): pool + HTTP server + signals + drain + the shutdown bound, in
                one trio run
"""
