"""The engine and its parts: the engine that steps every running sequence (engine.py), the sessions it opens
and admits (sessions.py, admission.py), the prefix cache it keeps by content (prefix.py), and the executor that
owns the stage pipeline (executor.py). The request path runs one way: route -> service -> engine -> executor ->
pipeline."""
