"""The OpenAI-compatible HTTP API (``mdiedge serve``; ``mdiedge starter --api-port``).

``schema`` reads requests, ``responses`` writes bodies and stream chunks, ``chat`` renders chat
templates, ``service`` runs requests on an engine's scheduler (continuous batching over a fixed
number of KV slots), ``metrics`` is ``/metrics``, ``app`` the ASGI routes and ``server`` runs them
under uvicorn."""
