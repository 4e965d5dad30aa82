# hipq — `make test` runs everything CI runs: vet, format check, lint, and
# the tests with the race detector against real PostgreSQL and Kafka (kfake).

GO ?= go

.PHONY: test test-citus vet fmt-check lint postgres-check build bench demo fuzz screenshot schema

test: vet fmt-check lint postgres-check
	$(GO) test -race -count=1 -timeout 15m ./...
	cd client && $(GO) test -race -count=1 -timeout 5m ./...

# The tests of every package that stores jobs, again on a Citus cluster of a
# coordinator and two workers (HIPQ_TEST_CITUS=1: internal/citustest starts
# one per package, from the PostgreSQL binaries the tests use, with Citus
# installed beside them). Without Citus they skip, saying so. Tests that do
# not hold on Citus skip there, each saying why (pgtest.SkipOnCitus).
# HIPQ_TEST_CITUS_URL=<coordinator URL> runs them on a cluster that runs
# already instead (a coordinator and its workers of one's own): its user
# must be allowed to create databases, and every node must be reachable at
# the host and port the coordinator's pg_dist_node gives. Each test's
# database is made on every node and dropped when its package's tests end.
CITUS_PACKAGES := ./store ./sweeper ./consumer ./dispatcher ./api ./internal/activity ./cmd/hipq
test-citus: postgres-check
	HIPQ_TEST_CITUS=1 $(GO) test -p 1 -count=1 -timeout 25m $(CITUS_PACKAGES)

# The producers' client is a module of its own (client/go.mod).
vet:
	$(GO) vet ./...
	cd client && $(GO) vet ./...

# golangci-lint is a tool, not a dependency of either module: `make lint`
# installs this exact version into $(go env GOPATH)/bin when the one there
# is missing or another version (.ci/run installs the same one).
GOLANGCI_LINT_VERSION := v2.15.0
GOLANGCI_LINT := $(firstword $(subst :, ,$(shell $(GO) env GOPATH)))/bin/golangci-lint

# Both modules, with the one .golangci.yml at the root.
lint:
	@if [ "$$($(GOLANGCI_LINT) version --short 2>/dev/null)" != "$(GOLANGCI_LINT_VERSION:v%=%)" ]; then \
	  echo "== installing golangci-lint $(GOLANGCI_LINT_VERSION) into $(dir $(GOLANGCI_LINT))"; \
	  GOBIN=$(dir $(GOLANGCI_LINT)) $(GO) install github.com/golangci/golangci-lint/v2/cmd/golangci-lint@$(GOLANGCI_LINT_VERSION); \
	fi
	$(GOLANGCI_LINT) run ./...
	cd client && $(GOLANGCI_LINT) run ./...

fmt-check:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi

# The tests start a private PostgreSQL from the server binaries, unless
# HIPQ_TEST_DATABASE_URL names a server to use.
postgres-check:
	@if [ -z "$$HIPQ_TEST_DATABASE_URL" ] && ! command -v initdb >/dev/null 2>&1 && \
	   ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then \
	  echo "The tests need PostgreSQL's server binaries (initdb, postgres) and none were found."; \
	  echo "Install them (Debian/Ubuntu: sudo apt-get install -y postgresql; macOS: brew install postgresql)"; \
	  echo "or point HIPQ_TEST_DATABASE_URL at a server where the user may create databases."; \
	  exit 1; \
	fi

build:
	$(GO) build -o hipq ./cmd/hipq

# Write schemas/schema.sql from a freshly migrated database (a private
# PostgreSQL, as the tests start): the schema the migrations make, which
# TestSchemaSnapshot (store) holds them to. Run it after changing a
# migration, and commit the file with it.
schema: postgres-check
	$(GO) test -count=1 -run '^TestSchemaSnapshot$$' ./store -update

demo:
	$(GO) run ./cmd/hipq demo

bench:
	$(GO) run ./cmd/hipq bench

# The dashboard's browser test, saving its screenshot of the overview
# with live traffic where the README shows it.
screenshot:
	HIPQ_UI_SCREENSHOT=$(CURDIR)/docs/ui-overview.png $(GO) test -count=1 -run TestDashboardInBrowser ./cmd/hipq

# Run each fuzzer for a while (FUZZTIME=1m make fuzz), one at a time:
# -fuzz takes a regular expression that must match exactly one fuzzer, so
# each is named anchored. TestMakeFuzzRunsEveryFuzzer (cmd/hipq) fails when
# a Fuzz function of the repository is missing here.
FUZZTIME ?= 30s
fuzz:
	$(GO) test ./api -run '^$$' -fuzz '^FuzzDecodeCallback$$' -fuzztime $(FUZZTIME)
	$(GO) test ./api -run '^$$' -fuzz '^FuzzDecodeEnqueue$$' -fuzztime $(FUZZTIME)
	$(GO) test ./api -run '^$$' -fuzz '^FuzzDecodeBulk$$' -fuzztime $(FUZZTIME)
	$(GO) test ./config -run '^$$' -fuzz '^FuzzParse$$' -fuzztime $(FUZZTIME)
	$(GO) test ./correlator -run '^$$' -fuzz '^FuzzCheckJSON$$' -fuzztime $(FUZZTIME)
	$(GO) test ./correlator -run '^$$' -fuzz '^FuzzDecodePlain$$' -fuzztime $(FUZZTIME)
	$(GO) test ./correlator -run '^$$' -fuzz '^FuzzDecodeRequest$$' -fuzztime $(FUZZTIME)
	$(GO) test ./correlator -run '^$$' -fuzz '^FuzzMatch$$' -fuzztime $(FUZZTIME)
	$(GO) test ./correlator -run '^$$' -fuzz '^FuzzMatchMembers$$' -fuzztime $(FUZZTIME)
