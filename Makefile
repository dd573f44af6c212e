# Two commands on a fresh Debian/Ubuntu machine: `make run` and `make test`.
# Both install what they need first (system packages via apt, Python packages into .venv).

SHELL := /bin/bash
.DEFAULT_GOAL := run
VENV := .venv
CARGO ?= cargo
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: run test bench deps deps-system deps-browser deps-rust deps-python deps-ui ui build build-release lint fmt clean

deps-system:
	@missing=""; \
	command -v cc >/dev/null || missing="$$missing build-essential"; \
	command -v pkg-config >/dev/null || missing="$$missing pkg-config"; \
	command -v python3 >/dev/null || missing="$$missing python3"; \
	python3 -c 'import ensurepip, venv' 2>/dev/null || missing="$$missing python3-venv"; \
	command -v npm >/dev/null || missing="$$missing nodejs npm"; \
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

## Debian's Chromium for the browser tests (no browser download: Playwright drives this one).
deps-browser:
	@if [ ! -x /usr/bin/chromium ]; then \
		echo "==> installing chromium for the browser tests"; \
		$(SUDO) apt-get update -qq && $(SUDO) DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	fi

deps-ui: deps-system
	@if [ ! -d ui/node_modules ] || [ ui/package-lock.json -nt ui/node_modules/.package-lock.json ]; then \
		echo "==> installing the console's npm packages"; \
		cd ui && npm ci --no-audit --no-fund; \
	fi

## The console (React + Vite) into ui/dist, which `spillway serve` serves at /.
ui: deps-ui
	cd ui && npm run build

deps: deps-system deps-rust deps-python deps-ui

build: deps-system deps-rust
	$(CARGO) build -p spillway-cli

build-release: deps-system deps-rust
	$(CARGO) build --release -p spillway-cli

## The console on the embedded default: SQLite ledger in the data directory, simulated
## providers (real ones for any OPENAI_API_KEY / ANTHROPIC_API_KEY / GEMINI_API_KEY set),
## demo traffic so there is something to watch. Prints the console's address with its
## admin token; open it in a browser. Ctrl-C stops it.
run: build-release ui
	./target/release/spillway serve --demo-traffic --show-admin-token --ui-dir ui/dist

lint: deps-rust deps-ui
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	cd ui && npm run lint

fmt:
	$(CARGO) fmt --all

## Every test: formatting and lints, Rust unit and integration tests (including the check
## that ui/src/bindings matches the Rust types), the console's unit tests, the browser
## end-to-end tests (real gateway, Debian's Chromium; screenshots into docs/screenshots),
## then the black-box suite (real binary, real simulator process, real SQLite file,
## official SDKs).
test: deps deps-browser build ui lint
	$(CARGO) test --workspace
	cd ui && npm test
	cd ui && SPILLWAY_BIN=$(CURDIR)/target/debug/spillway npm run e2e
	SPILLWAY_BIN=$(CURDIR)/target/debug/spillway $(VENV)/bin/pytest tests -q -p no:cacheprovider

## Gateway overhead over the simulator at fixed rates and at saturation; JSON under bench/results/.
bench: deps-system deps-rust
	$(CARGO) build --release -p spillway-cli -p spillway-bench
	./target/release/spillway-bench --spillway ./target/release/spillway --out bench/results

clean:
	$(CARGO) clean
	rm -rf $(VENV) ui/node_modules ui/dist
