"""The verifier fleet: replicas of the verifier on Ray Serve behind one address (the `fleet` extra).

`config.py` maps the application's arguments to Serve's deployment options and each replica's
`ServerConfig` (no Ray needed), `app.py` is the Serve deployment and `build_app`, `status.py`
gathers what every replica runs, `cli.py` is `cloud-verifier fleet`.
"""
