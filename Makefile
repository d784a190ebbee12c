# InstaSlice — one front door. `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha1sum | cut -c1-12)
CLUSTER_SPEC ?= hack/specs/dev.yaml
CHAOS_MINUTES ?= 10
CHAOS_SEED ?= 1
FUZZ_REVIEWS ?= 100000
FUZZ_SEED ?= 1
# The one version (common/version.py): image tags v$(VERSION) and labels, the chart, krew
VERSION := $(shell sed -n 's/^VERSION = "\(.*\)"$$/\1/p' common/version.py)

.PHONY: help install lint test test-unit test-packaging test-integration test-e2e control-plane-bins kube-bins chart protos \
        node-deps node-bins images cluster-up cluster-down dev-up dev-down demo uninstall bench-placement \
        bench-agent-leases bench-latency bench-autoscale bench-memory bench-apiserver bench-check \
        chaos chaos-dra fuzz release clean

help: ## list targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-18s %s\n", $$1, $$2}'

# constraints.txt: the versions the images ship (tests/packaging/test_constraints.py)
$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt pip
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	@rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP) ## create .venv/ with the project (editable) and its dev tools

lint: install ## ruff check + ruff format --check + mypy --strict + import-linter
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

control-plane-bins: install ## build (or verify cached) etcd, kube-*, kubectl and kwok: all that make demo needs
	hack/kube/build.sh

kube-bins: install node-deps control-plane-bins ## also node-bins, helm, kueue and karpenter: all that make test needs
	hack/kube/build-node.sh
	hack/helm/build.sh
	hack/kueue/build.sh
	hack/karpenter/build.sh

NODE_DEBS := runc busybox-static containernetworking-plugins
node-deps: ## Debian packages the real node needs: runc, busybox-static, CNI bridge + host-local (apt-get when missing)
	@if [ -x /usr/sbin/runc ] && [ -x /bin/busybox ] && [ -x /usr/lib/cni/bridge ]; then :; else \
		apt-get install -y $(NODE_DEBS) || { apt-get update && apt-get install -y $(NODE_DEBS); }; fi

node-bins: node-deps ## build (or verify cached) kubelet, containerd, ctr, shim, CNI loopback, pause, nvidia-container-runtime
	hack/kube/build-node.sh

images: install ## build the webhook and node-agent images from the Containerfiles (Buildah, a Debian base; no registry)
	@command -v buildah >/dev/null && command -v mmdebstrap >/dev/null || \
		apt-get install -y buildah mmdebstrap || { apt-get update && apt-get install -y buildah mmdebstrap; }
	$(BIN)/python -m hack.images

test-unit: install ## pure-logic tests (milliseconds each)
	$(BIN)/pytest -q tests/unit

test-packaging: install ## the wheel, installed into a fresh virtualenv outside the tree, imports and runs
	$(BIN)/pytest -q tests/packaging

chart: install ## regenerate the Helm chart charts/instaslice from manifests/ (needs kube-bins' kubectl)
	$(BIN)/python -m hack.gen_chart

protos: install ## regenerate the committed kubelet gRPC stubs from third_party/k8s.io/kubelet
	PY=$(BIN)/python hack/gen-protos.sh

test-integration: install kube-bins ## components against the real local control plane
	$(BIN)/pytest -q tests/integration

test-e2e: install kube-bins images ## whole system on the local control plane
	$(BIN)/pytest -q tests/e2e

test: lint kube-bins images ## the whole suite: lint, unit, integration, e2e (what CI runs); failures named last
	@mkdir -p .dev && rm -f .dev/test-report.xml
	$(BIN)/pytest -q tests --durations=25 --junitxml=.dev/test-report.xml || { status=$$?; \
		$(BIN)/python -m hack.test_report .dev/test-report.xml; exit $$status; }

cluster-up: install kube-bins ## local control plane only; kubeconfig at .dev/kubeconfig
	$(BIN)/python -m hack.cluster up

cluster-down: install ## stop the local control plane
	$(BIN)/python -m hack.cluster down

dev-up: install kube-bins ## control plane + KWOK GPU nodes + webhook + allocator + emulated agents
	$(BIN)/python -m hack.dev up --spec $(CLUSTER_SPEC)

dev-down: install ## stop everything dev-up started
	$(BIN)/python -m hack.dev down

demo: install control-plane-bins ## the main job: a heterogeneous emulated cluster running a mixed workload
	$(BIN)/python -m hack.demo

bench-placement: install ## placement quality, decision speed, preemption, allocator-model scenarios (no cluster); .dev/bench/placement*.json
	$(BIN)/python -m bench.placement

bench-agent-leases: install ## the allocator's CPU for watching node-agent Leases (no cluster)
	$(BIN)/python -m bench.agent_leases

bench-autoscale: install kube-bins ## Karpenter: nodes created for a MIG burst vs the minimum, and scale-down
	$(BIN)/python -m bench.autoscale

bench-latency: install kube-bins ## time-to-slice, throughput, scale and the contract chain's floor on the local control plane
	$(BIN)/python -m bench.latency --report .dev/bench
	$(BIN)/python -m bench.pod_cache --out .dev/bench/latency.json

bench-memory: install ## the allocator's memory: 30 000 real-sized pods, 1000-5000 nodes x 8 GPUs (`memory`, `fleet_memory`)
	$(BIN)/python -m bench.pod_cache --out .dev/bench/latency.json
	$(BIN)/python -m bench.fleet_memory --out .dev/bench/latency.json

bench-apiserver: install kube-bins ## the API server's CPU per request InstaSlice makes, and the pod policy's share; .dev/bench/apiserver.json
	@mkdir -p .dev/bench
	$(BIN)/python -m bench.apiserver_cost --policies shipped unbound --out .dev/bench/apiserver.json

bench-check: install ## the benchmarks' key figures in .dev/bench/ against bench/expected.yaml (a benchmark, not a test)
	$(BIN)/python -m bench.check

chaos: install kube-bins ## fault-injection soak; .dev/bench/chaos.json
	$(BIN)/python -m bench.chaos --minutes $(CHAOS_MINUTES) --seed $(CHAOS_SEED)

chaos-dra: install kube-bins ## the soak in DRA mode (users' own ResourceClaims); .dev/bench/chaos-dra.json
	$(BIN)/python -m bench.chaos_dra --minutes $(CHAOS_MINUTES) --seed $(CHAOS_SEED)

fuzz: install ## hostile AdmissionReviews against the admission server (no cluster); .dev/bench/fuzz.json
	$(BIN)/python -m bench.fuzz --reviews $(FUZZ_REVIEWS) --seed $(FUZZ_SEED)

release: install ## the release's files (version: common/version.py) in .dev/release/: images (make images), chart package, krew archive, SHA256SUMS; pushes nothing
	$(MAKE) images
	$(BIN)/python -m hack.release --out .dev/release

uninstall: install ## the checked uninstall of docs/upgrade.md: make uninstall OVERLAY=manifests/overlays/<platform>
	@test -n "$(OVERLAY)" || { echo "usage: make uninstall OVERLAY=<the kustomize dir you installed>"; exit 2; }
	$(BIN)/python -m hack.uninstall --overlay "$(OVERLAY)" $(if $(CONTEXT),--context "$(CONTEXT)")

clean: ## remove .dev/ (state, logs, kubeconfig)
	rm -rf .dev
