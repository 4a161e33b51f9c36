"""Serve the policy behind an OpenAI-compatible chat endpoint and record what it serves.

`TurnStore` (store.py) keeps served turns durably from recording to training; `make_app`
(app.py) is the endpoint; `EngineBackend` (backend.py) puts a rollout engine behind it;
`BackgroundServer` (server.py) runs it with uvicorn on a thread.
"""

from composer_lightning.serve.app import ServeMetrics, make_app
from composer_lightning.serve.backend import EngineBackend, ServeBackend
from composer_lightning.serve.server import BackgroundServer
from composer_lightning.serve.store import STATES, Turn, TurnStore

__all__ = [
    "STATES",
    "BackgroundServer",
    "EngineBackend",
    "ServeBackend",
    "ServeMetrics",
    "Turn",
    "TurnStore",
    "make_app",
]
