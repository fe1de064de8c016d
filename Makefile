# Two entry points for a fresh Debian/Ubuntu machine, as root: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SANDBOX_INVENTORY ?= .sandbox/inventory.yaml
SYSTEM_PACKAGES := systemd-container openssh-server openssh-client rsync iproute2 util-linux procps python3 python3-venv

.PHONY: system-deps venv lint test demo demo-down bench clean

system-deps:
	@if ! command -v systemd-nspawn >/dev/null || ! command -v sshd >/dev/null && [ ! -x /usr/sbin/sshd ] \
	   || [ ! -x /usr/bin/python3 ]; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SYSTEM_PACKAGES) >/dev/null; \
	fi

$(BIN)/kdeploy: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	@touch $@

venv: $(BIN)/kdeploy

lint: venv
	$(BIN)/ruff check kdeploy tests kernels bench

test: system-deps venv lint
	$(BIN)/pytest -q tests

demo: system-deps venv
	$(BIN)/kdeploy sandbox up --hosts 2 --inventory-out $(SANDBOX_INVENTORY)
	$(BIN)/kdeploy push all --inventory $(SANDBOX_INVENTORY)
	$(BIN)/kdeploy verify all --inventory $(SANDBOX_INVENTORY)
	$(BIN)/kdeploy history all --inventory $(SANDBOX_INVENTORY)
	@echo "sandbox left running; tear it down with: $(BIN)/kdeploy sandbox down"

demo-down: venv
	$(BIN)/kdeploy sandbox down

clean:
	rm -rf $(VENV) .sandbox
