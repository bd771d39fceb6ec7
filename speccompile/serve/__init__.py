"""`speccompile serve`: an OpenAI-compatible server (FastAPI + uvicorn, or Ray Serve) over an artifact.

The HTTP side: app.py (routes), schemas.py (request bodies), responses.py (response bodies, event streams),
api_errors.py, observe.py (request counting middleware), metrics.py (Prometheus). The model side: requests.py
(what the two sides exchange), engine.py (the Engine interface, admission, outcomes), batched_engine.py (the one
request lifecycle, over the runtime's batch decoder on every backend), loader.py (opens the runner and the engine). server.py runs uvicorn, ray_app.py the Ray Serve deployment.
"""
