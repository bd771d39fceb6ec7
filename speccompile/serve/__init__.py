"""`speccompile serve`: an OpenAI-compatible server (FastAPI + uvicorn, or Ray Serve) over an artifact.

engine.py owns the model (every runtime call), app.py the HTTP API, metrics.py the Prometheus metrics,
server.py the uvicorn process, ray_app.py the Ray Serve deployment.
"""
