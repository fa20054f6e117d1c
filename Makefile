# accel: the two commands of the README live here.
#   make demo   install what is missing, build, launch a multi-process run
#   make test   install what is missing, then format check, clippy and every test
SHELL := /bin/bash
export PATH := $(HOME)/.cargo/bin:$(PATH)
CARGO ?= cargo
# Debian packages the workspace needs: Gloo for cpu-gloo, g++ for its shim;
# Open MPI for the mpi backend, libclang for bindgen in its mpi-sys build.
DEB_PACKAGES := libgloo-dev g++ pkg-config libopenmpi-dev openmpi-bin libclang-dev

.PHONY: setup build demo test lint fmt-check unit

setup:
	@missing=""; for p in $(DEB_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "setup: installing$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q $$missing; \
	else echo "setup: system packages present"; fi
	@command -v $(CARGO) >/dev/null || { echo "setup: cargo not found: install Rust with rustup (https://rustup.rs)"; exit 1; }

build: setup
	$(CARGO) build --release -p accel-launcher -p accel-example-train -p accel-conformance

# The main job: builds the launcher and the training demo (release), then a
# 2-rank data-parallel run over cpu-gloo. ARGS="--stop-after 23" / ARGS=--resume.
demo: build
	./scripts/demo.sh $(ARGS)

fmt-check:
	$(CARGO) fmt --all -- --check

# Clippy per feature set (rustls habit): the default workspace build, and the
# facade and launcher without their optional backends.
lint: setup
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy -p accel -p accel-launcher --no-default-features --all-targets -- -D warnings

unit: setup
	$(CARGO) test --workspace --no-fail-fast

test: setup fmt-check lint unit
	@echo "make test: all checks passed"
