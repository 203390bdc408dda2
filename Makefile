# relaunch: `make demo` installs and runs the demo; `make test` installs and runs the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# pytest's worker processes: one runs every e2e and deploy test in turn (tests/conftest.py),
# the others the in-process tests. 0 runs everything in this process, one test at a time.
TEST_WORKERS ?= 2

.PHONY: install demo test test-fast lint postgres browser slurm bench bench-snapshots bench-status \
	bench-control-plane bench-reconcile-pass bench-report-cost bench-request-cost bench-chaos clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $@

demo: install
	$(VENV)/bin/relaunch demo

# PostgreSQL for the tests: 127.0.0.1:5432, database `test`, trust auth.
postgres:
	@pg_isready -q -h 127.0.0.1 -p 5432 || \
	  pg_ctlcluster --skip-systemctl-redirect $$(ls /etc/postgresql | head -1) main start
	@for i in $$(seq 30); do pg_isready -q -h 127.0.0.1 -p 5432 && exit 0; sleep 1; done; \
	  echo "PostgreSQL is not answering on 127.0.0.1:5432" >&2; exit 1

# Debian's Chromium for the dashboard tests; Playwright drives it and downloads no browser.
# Headless needs none of its Recommends (udev, upower, notification and printer tools, about
# a hundred packages that can upgrade systemd); the font is named so that text always renders.
BROWSER_PACKAGES := chromium fonts-dejavu-core
browser:
	@command -v chromium >/dev/null || { apt-get update -qq && \
	  apt-get install -y -qq --no-install-recommends $(BROWSER_PACKAGES); }
	@command -v chromium >/dev/null || { echo "chromium is not installed" >&2; exit 1; }

# Slurm's daemons and commands for tests/deploy/test_slurm.py, which starts its own
# slurmctld and two slurmd on this host (as root) and stops them; shellcheck for the sbatch
# script. The packages' services stay stopped where no init runs, and find no slurm.conf
# where one does.
SLURM_PACKAGES := slurmctld slurmd slurm-client munge shellcheck
slurm:
	@command -v slurmd >/dev/null && command -v shellcheck >/dev/null || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	  $(SLURM_PACKAGES); }
	@command -v slurmd >/dev/null || { echo "slurmd is not installed" >&2; exit 1; }

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: install postgres browser slurm lint
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --durations=25 $(PYTEST_ARGS)

# The inner loop: no lint, no e2e or deploy tests (real processes, PostgreSQL, Chromium, Slurm),
# and the database tests on SQLite only.
# `make test` is what CI runs.
test-fast: install
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) -m "not e2e and not postgres" $(PYTEST_ARGS)

bench: install
	$(PY) -m bench.recovery

bench-snapshots: install
	$(PY) -m bench.snapshots

bench-status: install
	$(PY) -m bench.status_load

# The issue's size: 1,000 simulated nodes and 10,000 queued jobs on PostgreSQL, for 60 s.
bench-control-plane: install postgres
	$(PY) -m bench.control_plane --nodes 1000 --jobs 10000 --db postgresql --seconds 60

bench-reconcile-pass: install postgres
	$(PY) -m bench.reconcile_pass --nodes 1000 --jobs 10000 --db postgresql

# What each kind of node report costs; add --baseline-code DIR (a checkout of another
# commit, e.g. from git worktree) to price that code's reports in the same run.
bench-report-cost: install postgres
	$(PY) -m bench.report_cost --jobs 200 --db postgresql

# What a heartbeat and a report cost the API's process, side by side with --baseline-code.
bench-request-cost: install postgres
	$(PY) -m bench.request_cost

# Needs root (every node agent in a network namespace of its own).
bench-chaos: install
	$(PY) -m bench.chaos --minutes 10 --seed 1 --json chaos.json

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
