# SYNAPSE. Two commands for a new user: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DATASET ?= ../shared/data/metatool
HOST ?= 127.0.0.1
PORT ?= 8000
DATA_DIR := $(or $(SYNAPSE_DATA_DIR),.data)
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install demo test lint db-stop clean

install: $(VENV)/.installed

# torch==2.13.0 must be the CPU build: these machines' pip serves it; where plain PyPI would give
# the multi-GB CUDA build, name the CPU index: make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(if $(TORCH_INDEX),$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0 --index-url $(TORCH_INDEX))
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $@

demo: install
	$(PY) manage.py migrate --noinput
	$(PY) manage.py collectstatic --noinput -v 0
	@mkdir -p $(DATA_DIR)
	@# The logins (passwords, client tokens) for the owner only, as the secret key beside them;
	@# removed first: a redirect keeps the mode of a file an earlier demo left.
	umask 077 && rm -f $(DATA_DIR)/demo-logins.txt && $(PY) manage.py bootstrap_demo --dataset $(DATASET) \
		--url http://$(HOST):$(PORT)/ > $(DATA_DIR)/demo-logins.txt
	$(PY) manage.py demo_rounds --dataset $(DATASET) --rounds 3
	-$(PY) manage.py tune_router --epochs 1
	$(PY) manage.py simulate --dataset $(DATASET) --orgs 3 --clients-per-org 2 --rounds 3 \
		--queries-per-client 300 --probe-fraction 0.03 --test-limit 600 --sweep-epsilon 1 \
		--sweep-lambda 0,1.5 --label "demo: 3 orgs x 2 clients, 3% public probe set" --unless-stored
	@cat $(DATA_DIR)/demo-logins.txt
	@$(PY) manage.py round_status --last 4
	@# Served as in production: DEBUG off (no traceback or URL-list pages), with the checkout's
	@# own secret key, which the settings made in $(DATA_DIR)/secret_key at the first command above
	@# (or the SECRET_KEY the environment gives, which the commands above used too).
	DEBUG=0 SECRET_KEY="$${SECRET_KEY:-$$(cat $(DATA_DIR)/secret_key)}" $(PY) -m gunicorn synapse_web.wsgi:application \
		--bind $(HOST):$(PORT) --workers 2 --threads 4 --access-logfile -

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

lint: install
	$(PY) -m ruff check .

db-stop: install
	$(PY) manage.py embedded_db stop

clean:
	rm -rf staticfiles .pytest_cache .ruff_cache
