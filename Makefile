# Two commands on a fresh Debian/Ubuntu machine: `make run` and `make test`.
# Both install what they need first (system packages via apt, Python packages into .venv).

SHELL := /bin/bash
.DEFAULT_GOAL := run
VENV := .venv
CARGO ?= cargo
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: run test bench deps deps-system deps-rust deps-python build build-release lint fmt clean

deps-system:
	@missing=""; \
	command -v cc >/dev/null || missing="$$missing build-essential"; \
	command -v pkg-config >/dev/null || missing="$$missing pkg-config"; \
	command -v python3 >/dev/null || missing="$$missing python3"; \
	python3 -c 'import ensurepip, venv' 2>/dev/null || missing="$$missing python3-venv"; \
	if [ -n "$$missing" ]; then \
		echo "==> installing system packages:$$missing"; \
		$(SUDO) apt-get update -qq && $(SUDO) DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

deps-rust:
	@command -v $(CARGO) >/dev/null || { echo "Rust is not installed: install it with rustup (https://rustup.rs), then rerun make." >&2; exit 1; }

deps-python: deps-system
	@if [ ! -x $(VENV)/bin/pytest ] || ! cmp -s tests/requirements.txt $(VENV)/.requirements; then \
		echo "==> installing Python test packages into $(VENV)"; \
		python3 -m venv $(VENV) && $(VENV)/bin/pip install -q --disable-pip-version-check -r tests/requirements.txt \
		&& cp tests/requirements.txt $(VENV)/.requirements; \
	fi

deps: deps-system deps-rust deps-python

build: deps-system deps-rust
	$(CARGO) build -p spillway-cli

build-release: deps-system deps-rust
	$(CARGO) build --release -p spillway-cli

## The console on the embedded default: SQLite ledger in the data directory, simulated
## providers (real ones for any OPENAI_API_KEY / ANTHROPIC_API_KEY / GEMINI_API_KEY set),
## demo traffic so there is something to watch. Ctrl-C stops it.
run: build-release
	./target/release/spillway serve --demo-traffic

lint: deps-rust
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all

## Every test: formatting and lints, Rust unit and integration tests, then the black-box
## suite (real binary, real simulator process, real SQLite file, official SDKs).
test: deps build deps-python lint
	$(CARGO) test --workspace
	SPILLWAY_BIN=$(CURDIR)/target/debug/spillway $(VENV)/bin/pytest tests -q -p no:cacheprovider

## Gateway overhead over the simulator at fixed rates and at saturation; JSON under bench/results/.
bench: deps-system deps-rust
	$(CARGO) build --release -p spillway-cli -p spillway-bench
	./target/release/spillway-bench --spillway ./target/release/spillway --out bench/results

clean:
	$(CARGO) clean
	rm -rf $(VENV)
