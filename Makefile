# Two commands do everything on a fresh Debian machine: `make demo` and `make test`.
# Each installs what it needs first (system packages, a virtual environment, the project)
# and is idempotent on a second run.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)
APT_PACKAGES := fuse3 gcc python3-dev python3-venv s3fs rclone
PYTEST_ARGS ?=

.PHONY: demo test test-unit bench bench-ab system venv clean

demo: venv
	$(BIN)/stoker demo

test: venv
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-unit: venv
	$(BIN)/python -m pytest -m "not integration" $(PYTEST_ARGS)

bench: venv
	$(BIN)/stoker bench

BASE ?= HEAD
bench-ab: venv  # A/B of the working tree against BASE (make bench-ab BASE=<commit>)
	$(BIN)/stoker bench --compare $(BASE)

system:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:$$missing"; \
	  $(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q $$missing; \
	fi

$(BIN)/python: | system
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,bench,demo]'
	touch $@

venv: system $(VENV)/.installed

clean:
	rm -rf $(VENV) build *.egg-info bench-results
