# Two commands on a fresh Debian/Ubuntu machine: `make run` and `make test`.
# Both install what they need first (system packages via apt, Python packages into .venv).

SHELL := /bin/bash
.DEFAULT_GOAL := run
VENV := .venv
CARGO ?= cargo
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: run test fleet bench link-order link-order-deps package deps deps-system deps-browser deps-desktop deps-fleet deps-rust deps-python deps-ui ui build build-release build-desktop lint fmt clean

deps-system:
	@missing=""; \
	command -v cc >/dev/null || missing="$$missing build-essential"; \
	command -v pkg-config >/dev/null || missing="$$missing pkg-config"; \
	command -v python3 >/dev/null || missing="$$missing python3"; \
	python3 -c 'import ensurepip, venv' 2>/dev/null || missing="$$missing python3-venv"; \
	command -v npm >/dev/null || missing="$$missing nodejs npm"; \
	[ -e /usr/share/zoneinfo/Europe/Berlin ] || missing="$$missing tzdata"; \
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

## Debian's PostgreSQL and Redis for fleet mode (R1, R2): `make test` and `make fleet` start
## private servers from them on loopback ports (scripts/services), never the system services.
deps-fleet:
	@missing=""; \
	bindir=$$(pg_config --bindir 2>/dev/null || true); \
	if { [ -z "$$bindir" ] || [ ! -x "$$bindir/initdb" ]; } && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then \
		missing="$$missing postgresql"; fi; \
	command -v psql >/dev/null || missing="$$missing postgresql-client"; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v redis-cli >/dev/null || missing="$$missing redis-tools"; \
	if [ -n "$$missing" ]; then \
		echo "==> installing system packages for fleet mode:$$missing"; \
		$(SUDO) apt-get update -qq && $(SUDO) DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

deps-ui: deps-system
	@if [ ! -d ui/node_modules ] || [ ui/package-lock.json -nt ui/node_modules/.package-lock.json ]; then \
		echo "==> installing the console's npm packages"; \
		cd ui && npm ci --no-audit --no-fund; \
	fi

## The console (React + Vite) into ui/dist, which the `spillway` binary compiles in: build
## it before any cargo step.
ui: deps-ui
	cd ui && npm run build

## System libraries for the Tauri desktop shell, and its WebDriver test tools
## (Xvfb, Debian's WebKitWebDriver, tauri-driver from crates.io).
deps-desktop: deps-rust
	@missing=""; \
	pkg-config --exists webkit2gtk-4.1 2>/dev/null || missing="$$missing libwebkit2gtk-4.1-dev"; \
	pkg-config --exists ayatana-appindicator3-0.1 2>/dev/null || missing="$$missing libayatana-appindicator3-dev"; \
	pkg-config --exists librsvg-2.0 2>/dev/null || missing="$$missing librsvg2-dev"; \
	[ -e /usr/include/xdo.h ] || missing="$$missing libxdo-dev"; \
	command -v WebKitWebDriver >/dev/null || missing="$$missing webkit2gtk-driver"; \
	command -v xvfb-run >/dev/null || missing="$$missing xvfb xauth"; \
	if [ -n "$$missing" ]; then \
		echo "==> installing system packages for the desktop shell:$$missing"; \
		$(SUDO) apt-get update -qq && $(SUDO) DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi
	@command -v tauri-driver >/dev/null || [ -x $$HOME/.cargo/bin/tauri-driver ] || { \
		echo "==> installing tauri-driver"; $(CARGO) install tauri-driver@2.1.0 --locked; }

build-desktop: deps-desktop ui
	$(CARGO) build -p spillway-desktop

deps: deps-system deps-rust deps-python deps-ui

build: deps-system deps-rust ui
	$(CARGO) build -p spillway-cli

build-release: deps-system deps-rust ui
	$(CARGO) build --release -p spillway-cli

## The console on the embedded default (policies/demo.yaml): SQLite ledger in the data
## directory, simulated providers (real ones for any OPENAI_API_KEY / ANTHROPIC_API_KEY /
## GEMINI_API_KEY set), demo traffic so there is something to watch. Prints the console's
## address with its admin token; open it in a browser. Ctrl-C stops it (a second Ctrl-C
## stops it at once).
run: ui
	@if [ -n "$$DISPLAY$$WAYLAND_DISPLAY" ]; then \
		$(MAKE) --no-print-directory deps-desktop && $(CARGO) build --release -p spillway-desktop \
		&& SPILLWAY_CONFIG=$(CURDIR)/policies/demo.yaml ./target/release/spillway-desktop; \
	else \
		echo "==> no display: starting the gateway headless; open the console link below in a browser"; \
		$(MAKE) --no-print-directory build-release \
		&& ./target/release/spillway serve --config policies/demo.yaml --demo-traffic --show-admin-token; \
	fi

## The desktop installers (.deb and AppImage) with Tauri's bundler, into
## target/release/bundle/; the binary in them is stripped (the bench's release builds keep
## their symbols for perf). The AppImage step fetches linuxdeploy from GitHub on its first
## run; where that is unreachable only the .deb is built (and the step says so).
package: deps-desktop ui
	@command -v cargo-tauri >/dev/null || [ -x $$HOME/.cargo/bin/cargo-tauri ] || { \
		echo "==> installing tauri-cli"; $(CARGO) install tauri-cli --version "^2" --locked; }
	cd src-tauri && CARGO_PROFILE_RELEASE_DEBUG=false CARGO_PROFILE_RELEASE_STRIP=symbols $(CARGO) tauri build --bundles deb
	@cd src-tauri && if CARGO_PROFILE_RELEASE_DEBUG=false CARGO_PROFILE_RELEASE_STRIP=symbols $(CARGO) tauri build --bundles appimage; then :; else \
		echo "==> the AppImage could not be built here (its tools come from GitHub); the .deb is in target/release/bundle/deb/"; fi
	@ls -1 target/release/bundle/*/* 2>/dev/null

lint: deps-rust deps-ui deps-desktop
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	cd ui && npm run lint

fmt:
	$(CARGO) fmt --all

## Every test: formatting and lints, Rust unit and integration tests (including the check
## that ui/src/bindings matches the Rust types), the console's unit tests, the browser
## end-to-end tests (real gateway, Debian's Chromium; screenshots into docs/screenshots),
## then the black-box suite (real binary, real simulator process, real SQLite file,
## official SDKs). Private PostgreSQL and Redis servers run for the whole of it, in a
## temporary directory on free loopback ports (the ledger's PostgreSQL half, the shared
## limits, the fleet tests); SPILLWAY_REQUIRE_SERVICES=1 makes a test that cannot reach them
## fail instead of skip. They are stopped at the end, on failure too; a failure's details
## are printed again last (scripts/failures), where a CI page showing only the tail has them.
test: deps deps-browser deps-fleet ui build build-desktop lint
	@set -e -o pipefail; \
	dir=$$(mktemp -d -t spillway-services.XXXXXX); \
	log=$$(mktemp -t spillway-test.XXXXXX.log); \
	trap 'rc=$$?; set +ex; scripts/services stop "$$dir" || true; rm -rf "$$dir"; \
		[ $$rc -eq 0 ] || scripts/failures "$$log"; rm -f "$$log"; exit $$rc' EXIT; \
	trap 'exit 130' INT TERM; \
	exports=$$(scripts/services start "$$dir"); eval "$$exports"; \
	export SPILLWAY_TEST_POSTGRES SPILLWAY_TEST_REDIS SPILLWAY_SERVICES_DIR="$$dir" SPILLWAY_REQUIRE_SERVICES=1; \
	echo "==> PostgreSQL and Redis for the tests: $$SPILLWAY_TEST_POSTGRES $$SPILLWAY_TEST_REDIS"; \
	set -x; \
	$(CARGO) test --workspace --exclude spillway-desktop 2>&1 | tee -a "$$log"; \
	(cd ui && npm test) 2>&1 | tee -a "$$log"; \
	(cd ui && SPILLWAY_BIN=$(CURDIR)/target/debug/spillway npm run e2e) 2>&1 | tee -a "$$log"; \
	(cd ui && PATH="$$HOME/.cargo/bin:$$PATH" xvfb-run -a -s "-screen 0 1400x900x24" npm run e2e:desktop) 2>&1 | tee -a "$$log"; \
	SPILLWAY_BIN=$(CURDIR)/target/debug/spillway $(VENV)/bin/pytest tests -q -p no:cacheprovider 2>&1 | tee -a "$$log"

## Three gateways (a, b, c) on one PostgreSQL ledger and one Redis (R1, R2), the servers private
## in .fleet/ (or $SPILLWAY_FLEET_DIR); the first sends demo traffic. Prints each instance's
## address and console link; Ctrl-C stops the gateways, then the servers.
fleet: build-release deps-fleet
	scripts/fleet

## The gateway beside a bare forwarder (the yardstick), against the same simulator, with a
## verdict line per performance target; JSON under bench/results/ (one file per run).
bench: deps-system deps-rust deps-fleet
	$(CARGO) build --release -p spillway-cli -p spillway-bench
	./target/release/spillway-bench --spillway ./target/release/spillway --forwarder ./target/release/bare-forwarder --out bench/results

## Rewrites crates/spillway-cli/link-order.txt, the order release builds link the binary's
## functions in (start-up's, then a request's, together): run it after a toolchain or
## dependency update, when `make bench` says the binary no longer has most of the file.
link-order: link-order-deps build-release
	scripts/link-order

link-order-deps:
	@missing=""; \
	command -v valgrind >/dev/null || missing="$$missing valgrind"; \
	command -v curl >/dev/null || missing="$$missing curl"; \
	if [ -n "$$missing" ]; then \
		echo "==> installing system packages for make link-order:$$missing"; \
		$(SUDO) apt-get update -qq && $(SUDO) DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

clean:
	$(CARGO) clean
	rm -rf $(VENV) ui/node_modules ui/dist
