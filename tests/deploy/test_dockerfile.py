"""The Dockerfile builds one small, non-root image for both roles.

No Docker engine runs here: these tests read the Dockerfile's instructions,
and build the same wheel the image installs to check that the installed
package, without the checkout, carries its migrations.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.deploy.compose import ROOT, cli_commands

DOCKERFILE = ROOT / "Dockerfile"


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args_of(self, instruction: str) -> list[str]:
        return [a for i, a in self.instructions if i == instruction]


def parse_dockerfile(text: str) -> tuple[list[str], list[Stage]]:
    """Global ARGs and the stages, each a list of (INSTRUCTION, arguments)."""
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    global_args: list[str] = []
    stages: list[Stage] = []
    for line in logical:
        instruction, _, rest = line.partition(" ")
        instruction, rest = instruction.upper(), rest.strip()
        if instruction == "FROM":
            m = re.match(r"(\S+)(?:\s+AS\s+(\S+))?$", rest, re.IGNORECASE)
            assert m, line
            stages.append(Stage(m[1], m[2]))
        elif not stages:
            assert instruction == "ARG", f"only ARG may come before the first FROM: {line}"
            global_args.append(rest)
        else:
            stages[-1].instructions.append((instruction, rest))
    return global_args, stages


@pytest.fixture(scope="module")
def stages() -> list[Stage]:
    return parse_dockerfile(DOCKERFILE.read_text())[1]


def test_the_build_is_multi_stage_and_the_final_stage_only_copies_the_result(
    stages: list[Stage],
) -> None:
    assert len(stages) >= 2
    build, final = stages[0], stages[-1]
    assert build.name
    copies = final.args_of("COPY")
    assert copies == [f"--from={build.name} /opt/relaunch /opt/relaunch"]
    final_runs = " ".join(final.args_of("RUN"))
    for tool in ("apt-get", "gcc", "build-essential", "pip install"):
        assert tool not in final_runs, f"the final image must not carry {tool}"


def test_the_image_runs_as_a_non_root_user_with_a_health_check(stages: list[Stage]) -> None:
    final = stages[-1]
    [user] = final.args_of("USER")
    assert user not in ("root", "0") and not user.startswith("0:")
    assert "useradd" in " ".join(final.args_of("RUN"))
    [health] = final.args_of("HEALTHCHECK")
    exec_form = json.loads(health[health.index("CMD") + 3 :].strip())
    assert exec_form[:2] == ["relaunch", "healthcheck"]


def test_the_command_picks_the_role(stages: list[Stage]) -> None:
    final = stages[-1]
    [entrypoint], [command] = final.args_of("ENTRYPOINT"), final.args_of("CMD")
    assert json.loads(entrypoint) == ["relaunch"]
    assert {json.loads(command)[0], "agent", "healthcheck"} <= cli_commands()


def test_torch_comes_from_the_constraints_file_and_cuda_is_a_build_argument(
    stages: list[Stage],
) -> None:
    build = stages[0]
    assert any(
        a.startswith("TORCH_INDEX_URL=") and a.endswith("/whl/cpu") for a in build.args_of("ARG")
    )
    install = " ".join(build.args_of("RUN"))
    assert "grep -E '^torch==' constraints.txt" in install
    assert "-c constraints.txt" in install
    assert "TORCH_INDEX_URL" in (ROOT / "README.md").read_text()
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv"} <= set(ignored)


def test_the_installed_package_carries_its_migrations(tmp_path: Path) -> None:
    """The image installs the wheel, not the checkout: migrations must be in it."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        check=True,
    )  # fmt: skip
    [wheel] = tmp_path.glob("relaunch-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    db = tmp_path / "fresh.db"
    code = (
        "import sys, service.db as d; "
        f"assert d.__file__.startswith({str(site)!r}), d.__file__; "
        f"d.upgrade_to_head('sqlite:///{db}')"
    )
    subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(site)}, check=True
    )
    assert db.stat().st_size > 0
