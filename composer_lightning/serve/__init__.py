"""Serve the policy behind an OpenAI-compatible chat endpoint and record what it serves.

`TurnStore` (store.py) keeps served turns durably from recording to training; `make_app`
(app.py) is the endpoint and chat.py its chat completions, request.py checks what a client sends, access.py says who may call
and whose sessions are whose, protocol.py writes OpenAI's shapes; `EngineBackend` (backend.py) puts a rollout engine behind it;
`BackgroundServer` (server.py) runs it with uvicorn on a thread; `ServeCallback` (training.py)
and `ServeDataModule` (data.py) train on what was served (`python -m composer_lightning serve`);
lineage.py counts the optimizer steps between two weight versions when restarts fork the run.

May import: every room below it in `composer_lightning.LAYERS` (it trains through the
rollout callback's push and the module's step).
"""

from composer_lightning.serve.app import make_app
from composer_lightning.serve.backend import EngineBackend, ServeBackend
from composer_lightning.serve.chat import ServeMetrics
from composer_lightning.serve.data import ServeDataModule
from composer_lightning.serve.server import BackgroundServer
from composer_lightning.serve.store import STATES, Turn, TurnStore
from composer_lightning.serve.training import ServeCallback

__all__ = [
    "STATES",
    "BackgroundServer",
    "EngineBackend",
    "ServeBackend",
    "ServeCallback",
    "ServeDataModule",
    "ServeMetrics",
    "Turn",
    "TurnStore",
    "make_app",
]
