"""The daemon: ``omni-trio serve`` -- engines behind an OpenAI-compatible images API.

Layout (one concept per module)::

    config.py   ServeConfig: every daemon setting (flags, TOML file, env), validated
    pool.py     EnginePool: K supervised engine replicas (one_for_one) + least-loaded routing
    images.py   request parsing (OpenAI Images fields -> SamplingParams) and image encoding
    app.py      the ASGI app (routes, OpenAI error envelopes, SSE, auth, limits)
    metrics.py  Prometheus metrics (one registry per app)
    notify.py   systemd notify protocol (READY, WATCHDOG, STOPPING, STATUS)
    daemon.py   serve_daemon(): pool + hypercorn (trio worker) + signals + drain, in one trio run
"""
