"""edgespec: an OpenAI-compatible LLM inference server across the small devices people already own.

The installed distribution's one import name: the repository's top-level folders (server, workers, planning,
decoding, model, bench) are its subpackages (pyproject.toml's package-dir).
"""
