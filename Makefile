# The two commands of a fresh machine: `make demo` and `make test`.
# Each bootstraps what is missing: system tools (Java, Maven), the virtual environment
# at .venv with the project and its development kit (devkit/) installed editable, and the
# JVM cache (deploy/jvm).

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
JVM_CACHE := $(CURDIR)/.cache/jvm
VENV_STAMP := $(VENV)/.installed
JVM_STAMP := $(JVM_CACHE)/.fetched
# The Spark drivers' class archive (cdc_shared.jvm.class_archive): ~3 s off every start.
CLASS_ARCHIVE_STAMP := $(JVM_CACHE)/cds/.built
PYTEST_ARGS ?=

.PHONY: help tools venv jvm lint format test test-cluster test-unit demo infra-up infra-down clean

help:
	@echo "make demo       bring up local Kafka + Elasticsearch and run the pipeline demo"
	@echo "make test       lint, type-check and run every test (starts and stops the servers)"
	@echo "make test-unit  the tests that need no server"
	@echo "make test-cluster  the production-shape test on a local Spark cluster and S3"
	@echo "make jvm        fetch the JVM artifacts (Delta, Kafka, Elasticsearch) once and"
	@echo "                dump the Spark drivers' class archive (faster starts)"
	@echo "make infra-up / infra-down   the local servers on their default ports"

tools:
	@bash deploy/local/ensure-tools.sh

$(VENV_STAMP): pyproject.toml devkit/pyproject.toml
	@$(MAKE) --no-print-directory tools
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -e ".[dev]" -e ./devkit
	@touch $@

venv: $(VENV_STAMP)

$(JVM_STAMP): $(shell find deploy/jvm -name pom.xml)
	@$(MAKE) --no-print-directory tools
	mvn --batch-mode --quiet -f deploy/jvm/pom.xml -Djvm.cache=$(JVM_CACHE) package
	@touch $@

# Tolerant: without an archive (e.g. a JDK without CDS) drivers start as before.
$(CLASS_ARCHIVE_STAMP): $(JVM_STAMP) $(VENV_STAMP)
	CDC_JVM_CACHE=$(JVM_CACHE) $(BIN)/python -m cdc_shared.jvm.class_archive
	@mkdir -p $(@D) && touch $@

jvm: $(JVM_STAMP) $(CLASS_ARCHIVE_STAMP)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The Spark-cluster test (marker `cluster`, ~8 min) runs apart, with `make test-cluster`:
# with it the suite nears CI's 90-minute limit.
test: venv jvm lint
	$(BIN)/pytest -m "not cluster" $(PYTEST_ARGS)

test-cluster: venv jvm
	$(BIN)/pytest -m cluster $(PYTEST_ARGS)

test-unit: venv
	$(BIN)/pytest -m "not integration and not slow" $(PYTEST_ARGS)

demo: venv jvm
	$(BIN)/cdc demo

infra-up: venv jvm
	$(BIN)/cdc infra up

infra-down: venv
	$(BIN)/cdc infra down

clean:
	-$(BIN)/cdc infra down
	rm -rf .state data .pytest_cache .mypy_cache .ruff_cache
