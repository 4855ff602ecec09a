# Two commands: `make run` (the nightly cycle on the embedded default) and `make test`.
# Each installs what it needs into .venv from this project's own files.
VENV  ?= .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test bench clean

$(STAMP): pyproject.toml Makefile
	@command -v bwrap >/dev/null || (apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null) \
	  || echo "note: bubblewrap not installed; the sandbox's bwrap backend will be unavailable"
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(VENV)/bin/ratchet run

test: $(STAMP)
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(PY) -m pytest -q -p no:cacheprovider

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m bench.sandbox
	$(PY) -m bench.rollout
	$(PY) -m bench.train_step
	$(PY) -m bench.orchestration

clean:
	rm -rf .ratchet
