# singleton: `make test` sets up everything it needs (venv, Python deps, the Go-built
# control plane, PostgreSQL) and runs the linters and the whole test suite.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PACKAGES := election sidecar testbed operator sdk

.PHONY: prerequisites test test-newest lint unit venv testbed testbed-up testbed-down testbed-node-test e2e-existing clean

# The test bed (testbed/pyproject.toml) is a distribution of its own, for development only.
# After the prerequisites (python3-venv), also under make -j; order-only: they are no reason to rebuild.
$(BIN)/.installed: pyproject.toml testbed/pyproject.toml sdk/pyproject.toml | prerequisites
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]' -e ./testbed -e ./sdk
	touch $@

# What the goals need from the machine (testbed/prerequisites.sh: the list, and why): as root
# with apt it installs what is missing first, saying what; SINGLETON_NO_APT=1 only checks.
prerequisites: ## install (root, apt) or name the Debian packages `make test` and `make demo` need
	@PYTHON=$(PYTHON) bash testbed/prerequisites.sh install $(or $(MAKECMDGOALS),venv)

venv: prerequisites $(BIN)/.installed

testbed: prerequisites ## build (once) the control plane binaries, kubelet, kube-proxy and pause from Go modules
	bash testbed/build.sh

lint: venv
	$(BIN)/ruff check $(PACKAGES) tests benchmarks demo
	$(BIN)/mypy
	$(BIN)/mypy --strict demo
	$(BIN)/mypy --config-file tests/mypy.ini tests benchmarks  # not strict: types where tests and benchmarks give them
	$(BIN)/mypy --strict --follow-imports=silent --config-file tests/mypy.ini benchmarks/figures*.py  # make figures: strict
	$(BIN)/lint-imports --no-logo --no-cache  # the layer contracts: [tool.importlinter] in pyproject.toml

# Workers of `make test` (pytest-xdist): the tests mostly wait on servers and programs, so more
# workers than cores pay. One worker runs the group that needs the machine to itself (the real
# node, the image: tests/conftest.py MACHINE_GROUP); the others share the rest by module, each
# with a PostgreSQL and a control plane of its own. TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 3
test: prerequisites venv testbed lint
	$(BIN)/pytest -ra --durations=12 -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# The newest Kubernetes the project pins (KUBERNETES_NEWEST_VERSION of testbed/go/versions.env;
# `make test` runs on the oldest it supports): the test bed's own check, the operator, admission
# (the CRD's CEL rules, RBAC and the admission policy, the webhook), the chart, and on the real
# node the end-to-end, chart, mesh order and drain modules.
NEWEST_KUBERNETES := $(shell sed -n 's/^KUBERNETES_NEWEST_VERSION=//p' testbed/go/versions.env)
NEWEST_MODULES := tests/integration/kube/test_testbed.py tests/integration/kube/test_operator.py \
	tests/integration/kube/test_crd.py tests/integration/kube/test_rbac.py tests/integration/kube/test_adoption.py \
	tests/integration/kube/test_chart.py tests/node/test_e2e.py tests/node/test_chart_node.py \
	tests/node/test_mesh_order.py tests/node/test_drain_node.py
test-newest: prerequisites venv ## root: the operator, admission, chart and e2e modules on the newest pinned Kubernetes
	SINGLETON_KUBERNETES_VERSION=$(NEWEST_KUBERNETES) bash testbed/build.sh
	SINGLETON_KUBERNETES_VERSION=$(NEWEST_KUBERNETES) $(BIN)/pytest -ra --durations=8 -n $(TEST_WORKERS) \
		--dist loadgroup $(NEWEST_MODULES) $(PYTEST_ARGS)

# The inner loop: every test that starts no server and builds nothing (markers: pyproject.toml).
UNIT_MARKERS := not k8s and not postgres and not controlplane and not node and not image and not build and not slow
unit: venv ## the inner loop: every test that needs no server and builds nothing (under a minute)
	$(BIN)/pytest -ra -n 4 -m "$(UNIT_MARKERS)" $(PYTEST_ARGS)

testbed-up: venv testbed ## start PostgreSQL + control plane (+ a real node when root) in the background
	$(BIN)/singleton-testbed up

testbed-down: venv
	$(BIN)/singleton-testbed down

testbed-node-test: venv testbed ## root: the real node's tests (containerd + kubelet + kube-proxy), docs/testbed.md
	$(BIN)/pytest -ra tests/node/test_node.py $(PYTEST_ARGS)

# USE_EXISTING_CLUSTER's path, proven on the test bed's own real node through its kubeconfig
# alone: `singleton-testbed up` (control plane + real node + the project's image), the e2e
# suite, `singleton-testbed down` (testbed/e2e-existing.sh; docs/testbed.md).
e2e-existing: venv testbed ## root: the e2e suite with USE_EXISTING_CLUSTER=true against `singleton-testbed up`
	BIN=$(BIN) bash testbed/e2e-existing.sh $(PYTEST_ARGS)

# Every figure of README's Figures section in one run, on this machine (benchmarks/figures.py,
# benchmarks/README.md "Every figure in one run"): about 40 min on 2 cores, root for the real
# node's rows (without it they are skipped, saying why), into benchmarks/figures.json; then
# `python -m benchmarks.figures --check` (the goals) and `--render` (README's block).
# FIGURES_ARGS=--quick: every step with small n (about 14 min), into build/figures-quick.json.
.PHONY: figures
figures: prerequisites venv testbed ## root: every figure of README in one run (about 40 min) into benchmarks/figures.json
	$(BIN)/python -m benchmarks.figures $(FIGURES_ARGS)

.PHONY: demo demo-down
demo: prerequisites venv ## root: test bed + real node + the image (built, cached) + operator + 3 pollers; a live view of scripted handovers
	$(BIN)/python -m demo run $(DEMO_ARGS)

demo-down: venv ## stop everything `make demo` started and remove its files
	$(BIN)/python -m demo down

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache

# --- image, chart and static checks (not part of `make test`) ------------------------------

IMAGE ?= ghcr.io/singleton-dev/singleton
IMAGE_TAG ?= 0.1.0
CHECKOV_VENV ?= build/venv-checkov
CHECKOV_VERSION ?= 3.3.30
KUBE_VERSION ?= 1.34.0
HELM ?= $$(bash testbed/build.sh | tail -n 1)/helm

.PHONY: docker-build image chart-crds check-static

# The one image (operator + sidecar), into the local Docker engine when one answers; without
# an engine (this repository's test machines) `make image` builds the same Dockerfile.
docker-build: ## build the image with Docker where an engine runs, else `make image`
	@if docker info >/dev/null 2>&1; then \
		echo "docker build -t $(IMAGE):$(IMAGE_TAG) ."; \
		docker build --build-arg VERSION=$(IMAGE_TAG) -t $(IMAGE):$(IMAGE_TAG) .; \
	else \
		echo "no Docker engine answers: building with buildah instead (make image)"; \
		$(MAKE) --no-print-directory image; \
	fi

# No engine, no registry: buildah builds the Dockerfile on a local copy of its base made here
# from Debian packages (mmdebstrap), and exports an OCI archive for `ctr images import`;
# cached by content in ~/.cache/singleton/images (singleton_testbed.images).
image: venv ## build the Dockerfile with buildah into an OCI archive; prints its path, reference, size
	$(BIN)/singleton-testbed image

# Wheels and sdists of both distributions, the chart, the krew plugin's zipapps and archives
# (all four platforms: minutes), the image as an OCI archive with its SBOM (root: buildah,
# mmdebstrap; syft built once, about 5 minutes; `--no-image` leaves it out), SHA256SUMS, each
# checked (twine check --strict, helm lint, their contents): singleton_testbed/dist.py;
# tests/release/test_dist.py, test_krew.py and test_image.py run its steps too.
.PHONY: dist
dist: venv ## build and check every release artifact into dist/ (nothing is pushed)
	$(BIN)/python -m singleton_testbed.dist dist

chart-crds: ## copy the CRDs (crds/ is the single source of truth) into the chart
	cp crds/singleton.dev_singletonservices.yaml charts/singleton/crds/singleton.dev_singletonservices.yaml

$(CHECKOV_VENV)/.installed:
	$(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install --quiet --upgrade pip
	$(CHECKOV_VENV)/bin/pip install --quiet 'checkov==$(CHECKOV_VERSION)'
	touch $@

# checkov renders the chart with `helm template CHART`. The shim passes --kube-version,
# because a helm built from Go modules (the test bed's) assumes Kubernetes v1.20 and the
# chart requires >= 1.34; checkov would otherwise skip the chart with only a warning.
# CKV_K8S_21 ("default namespace") is skipped: checkov renders without --namespace; the
# chart puts everything in the release namespace. Deliberate findings of the chart are
# skipped with checkov.io/skipN annotations (with reasons) on the objects concerned.
check-static: $(CHECKOV_VENV)/.installed ## checkov on the Dockerfile and the Helm chart
	mkdir -p build/helm-shim
	helm="$(HELM)" && test -x "$$helm" && \
	printf '#!/bin/sh\nif [ "$$1" = template ]; then shift; exec "%s" template --kube-version $(KUBE_VERSION) "$$@"; fi\nexec "%s" "$$@"\n' \
		"$$helm" "$$helm" > build/helm-shim/helm
	chmod +x build/helm-shim/helm
	$(CHECKOV_VENV)/bin/checkov --quiet --compact --skip-download -f Dockerfile --framework dockerfile
	PATH="$(CURDIR)/build/helm-shim:$$PATH" $(CHECKOV_VENV)/bin/checkov --quiet --compact --skip-download \
		-d charts/singleton --framework helm --skip-check CKV_K8S_21
